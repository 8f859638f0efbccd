//! A TLS listener of the test's own in front of the shared broker: it accepts TLS
//! with the committed test certificate for `localhost` and `127.0.0.1` (signed by the
//! test CA of `tests/fixtures/tls/`, see the README there) and forwards the plain
//! stream to the broker, so `amqps://` is tested without reconfiguring RabbitMQ.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// A file of `tests/fixtures/tls/`: `ca.pem` (the CA that signed the proxy's
/// certificate), `other-ca.pem` (an unrelated CA), `server.pem`, `server.key`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/tls")
        .join(name)
}

/// What a [`TlsProxy`] saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    /// The first byte of every connection, before any TLS (0x16 opens a TLS
    /// handshake record; plain AMQP opens with `A` of `AMQP`).
    pub first_bytes: Vec<u8>,
    /// Handshakes that succeeded.
    pub handshakes: u64,
    /// Handshakes that failed, with rustls's reason.
    pub failures: Vec<String>,
}

/// A TLS-terminating proxy on 127.0.0.1 to a plain AMQP broker.
pub struct TlsProxy {
    /// The proxy's address.
    pub addr: SocketAddr,
    first_bytes: Arc<Mutex<Vec<u8>>>,
    handshakes: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
}

impl TlsProxy {
    /// Starts a proxy to `target` (host:port of the plain broker).
    pub async fn start(target: String) -> Self {
        let acceptor = TlsAcceptor::from(Arc::new(server_config()));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("addr");
        let first_bytes = Arc::new(Mutex::new(Vec::new()));
        let handshakes = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let seen = (
            Arc::clone(&first_bytes),
            Arc::clone(&handshakes),
            Arc::clone(&failures),
        );
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (acceptor, target) = (acceptor.clone(), target.clone());
                let (first_bytes, handshakes, failures) = (
                    Arc::clone(&seen.0),
                    Arc::clone(&seen.1),
                    Arc::clone(&seen.2),
                );
                tokio::spawn(async move {
                    let mut first = [0u8; 1];
                    if matches!(client.peek(&mut first).await, Ok(1)) {
                        first_bytes.lock().expect("first bytes").push(first[0]);
                    }
                    let _ = client.set_nodelay(true);
                    let mut client = match acceptor.accept(client).await {
                        Ok(tls) => tls,
                        Err(err) => {
                            failures.lock().expect("failures").push(err.to_string());
                            return;
                        }
                    };
                    handshakes.fetch_add(1, Ordering::SeqCst);
                    let Ok(mut server) = TcpStream::connect(&target).await else {
                        return;
                    };
                    let _ = server.set_nodelay(true);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
            }
        });
        Self {
            addr,
            first_bytes,
            handshakes,
            failures,
        }
    }

    /// `url` (a plain `amqp://` URL of the broker) as `amqps://` to the proxy, by the
    /// name `localhost` its certificate is for.
    /// Panics on a URL lapin cannot read.
    pub fn url_for(&self, url: &str) -> String {
        let mut uri = crate::amqp::uri(url).unwrap_or_else(|why| panic!("{why}"));
        uri.scheme = lapin::uri::AMQPScheme::AMQPS;
        uri.authority.host = "localhost".to_owned();
        uri.authority.port = self.addr.port();
        uri.to_string()
    }

    /// What it saw once `settled` holds of it (the proxy learns a handshake's end
    /// a moment after the client), or after 10 s what it saw then.
    pub async fn seen_once(&self, settled: impl Fn(&Seen) -> bool) -> Seen {
        crate::amqp::eventually(std::time::Duration::from_secs(10), || settled(&self.seen())).await;
        self.seen()
    }

    /// What it saw so far.
    pub fn seen(&self) -> Seen {
        Seen {
            first_bytes: self.first_bytes.lock().expect("first bytes").clone(),
            handshakes: self.handshakes.load(Ordering::SeqCst),
            failures: self.failures.lock().expect("failures").clone(),
        }
    }
}

/// The server side: the fixture's certificate and key, ring as the one provider.
fn server_config() -> ServerConfig {
    let certs = CertificateDer::pem_file_iter(fixture("server.pem"))
        .expect("server.pem")
        .collect::<Result<Vec<_>, _>>()
        .expect("server.pem certificates");
    let key = PrivateKeyDer::from_pem_file(fixture("server.key")).expect("server.key");
    ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("server certificate")
}
