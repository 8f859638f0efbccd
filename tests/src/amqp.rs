//! RabbitMQ fixtures: the broker URL, per-test names, publishing with confirms, and a
//! TCP proxy of the test's own to cut a client's connection without touching the
//! shared broker.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::services_required;

/// The RabbitMQ URL, or `None` (after one line on stderr) when there is none.
///
/// From `AMQP_URL`; with the `testcontainers` feature and none set, from a container
/// started for the test process.
pub fn amqp_url() -> Option<String> {
    #[allow(unused_mut)] // assigned only with the `testcontainers` feature
    let mut url = std::env::var("AMQP_URL")
        .ok()
        .filter(|u| u.starts_with("amqp"));
    #[cfg(feature = "testcontainers")]
    if url.is_none() {
        match crate::containers::rabbitmq() {
            Ok(started) => url = Some(started),
            Err(why) => eprintln!("{why}"),
        }
    }
    if url.is_none() {
        assert!(
            !services_required(),
            "INBOX_REQUIRE_SERVICES=1 but AMQP_URL is not set"
        );
        eprintln!("skipping: set AMQP_URL=amqp://... to run the RabbitMQ tests");
    }
    url
}

/// A connection for the test's own publishing and inspection.
pub async fn connect(url: &str) -> Connection {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect to AMQP_URL")
}

/// A channel with publisher confirms on.
pub async fn confirm_channel(conn: &Connection) -> Channel {
    let channel = conn.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm_select");
    channel
}

/// What a test publishes.
pub struct Outgoing<'a> {
    /// `message_id`, if any.
    pub message_id: Option<&'a str>,
    /// `type`.
    pub message_type: &'a str,
    /// The body.
    pub body: &'a [u8],
    /// The `tenant` header.
    pub tenant: Option<&'a str>,
}

/// Publishes to `exchange` with routing key = type (not waiting for the confirm).
pub async fn publish(channel: &Channel, exchange: &str, msg: &Outgoing<'_>) {
    let mut props = BasicProperties::default()
        .with_type(msg.message_type.into())
        .with_delivery_mode(2);
    if let Some(id) = msg.message_id {
        props = props.with_message_id(id.into());
    }
    if let Some(tenant) = msg.tenant {
        let mut headers = FieldTable::default();
        headers.insert(
            "tenant".into(),
            AMQPValue::LongString(LongString::from(tenant)),
        );
        props = props.with_headers(headers);
    }
    channel
        .basic_publish(
            exchange.into(),
            msg.message_type.into(),
            BasicPublishOptions::default(),
            msg.body,
            props,
        )
        .await
        .expect("publish");
}

/// Waits for every confirm of the channel; panics on a returned message.
pub async fn wait_for_confirms(channel: &Channel) {
    let returned = channel.wait_for_confirms().await.expect("confirms");
    assert!(returned.is_empty(), "unroutable: {returned:?}");
}

/// How many ready messages a queue holds.
pub async fn queue_depth(conn: &Connection, queue: &str) -> u32 {
    let channel = conn.create_channel().await.expect("channel");
    let q = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare");
    let _ = channel.close(200, "done".into()).await;
    q.message_count()
}

/// Polls `done` every 20 ms until it holds or `limit` passes; returns whether it held.
pub async fn eventually(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    done()
}

/// How a test cuts the connections through a [`Proxy`].
#[derive(Clone, Copy, Debug)]
pub enum Cuts {
    /// One cut, then new connections are refused for a while.
    Once {
        /// How long new connections are refused.
        refuse_for: Duration,
    },
    /// This many cuts at varied points (see [`Proxy::cut_repeatedly`]).
    Repeatedly(u64),
    /// No cut: the open connections fall silent (see [`Proxy::freeze`]).
    Freeze,
    /// One cut, then new connections are accepted and never answered for a while
    /// (see [`Proxy::stall`]).
    Stalling {
        /// How long new connections stall.
        stall_for: Duration,
    },
}

/// A TCP proxy on 127.0.0.1 in front of the broker. `cut()` drops every connection
/// through it (the client sees its connection die) and `freeze()` silences them, while
/// new connections keep working; `block` refuses new connections, and `stall` accepts
/// them and never answers.
pub struct Proxy {
    /// The proxy's address.
    pub addr: SocketAddr,
    cut: watch::Sender<u64>,
    freeze: watch::Sender<u64>,
    blocked: Arc<std::sync::atomic::AtomicBool>,
    stalled: Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    /// Starts a proxy to `target` (host:port).
    pub async fn start(target: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("addr");
        let (cut, _) = watch::channel(0u64);
        let (freeze, _) = watch::channel(0u64);
        let blocked = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cuts = cut.clone();
        let freezes = freeze.clone();
        let refuse = Arc::clone(&blocked);
        let stall = Arc::clone(&stalled);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if refuse.load(std::sync::atomic::Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                if stall.load(std::sync::atomic::Ordering::SeqCst) {
                    // Accepted, then silence: held open until a cut or the proxy's end.
                    let mut cut_rx = cuts.subscribe();
                    tokio::spawn(async move {
                        let _held = client;
                        let _ = cut_rx.changed().await;
                    });
                    continue;
                }
                let target = target.clone();
                let mut cut_rx = cuts.subscribe();
                let mut freeze_rx = freezes.subscribe();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&target).await else {
                        return;
                    };
                    // Without this, Nagle's algorithm meets delayed acks and every
                    // small frame (an ack, a confirm) waits tens of milliseconds.
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let frozen = tokio::select! {
                        _ = tokio::io::copy(&mut cr, &mut sw) => false,
                        _ = tokio::io::copy(&mut sr, &mut cw) => false,
                        _ = cut_rx.changed() => false,
                        _ = freeze_rx.changed() => true,
                    };
                    if frozen {
                        // Open but silent both ways until a cut or the proxy's end.
                        let _ = cut_rx.changed().await;
                    }
                });
            }
        });
        Self {
            addr,
            cut,
            freeze,
            blocked,
            stalled,
        }
    }

    /// Drops every open connection through the proxy.
    pub fn cut(&self) {
        self.cut.send_modify(|n| *n += 1);
    }

    /// Silences every open connection through the proxy without closing it, as a
    /// network partition does: nothing passes either way and neither side is told.
    /// New connections work.
    pub fn freeze(&self) {
        self.freeze.send_modify(|n| *n += 1);
    }

    /// Accepts new connections and then says nothing on them (`true`), as a broker
    /// that hangs mid-handshake; or forwards them again (`false`).
    pub fn stall(&self, stalled: bool) {
        self.stalled
            .store(stalled, std::sync::atomic::Ordering::SeqCst);
    }

    /// Cuts every connection as `cuts` says.
    pub async fn cut_as(&self, cuts: Cuts) {
        match cuts {
            Cuts::Once { refuse_for } => self.cut_refusing_for(refuse_for).await,
            Cuts::Repeatedly(times) => self.cut_repeatedly(times).await,
            Cuts::Freeze => self.freeze(),
            Cuts::Stalling { stall_for } => {
                self.stall(true);
                self.cut();
                tokio::time::sleep(stall_for).await;
                self.stall(false);
            }
        }
    }

    /// Cuts every connection and refuses new ones for `refuse_for`.
    pub async fn cut_refusing_for(&self, refuse_for: Duration) {
        self.block(true);
        self.cut();
        tokio::time::sleep(refuse_for).await;
        self.block(false);
    }

    /// Cuts every connection `times` times, 150 to 350 ms apart, each time refusing
    /// new connections for 0 to 300 ms: the cuts land at varied points of whatever the
    /// clients are doing (publishing, waiting for confirms, reconnecting, closing).
    pub async fn cut_repeatedly(&self, times: u64) {
        for i in 0..times {
            tokio::time::sleep(Duration::from_millis(150 + (i * 37) % 200)).await;
            self.cut_refusing_for(Duration::from_millis((i * 53) % 300))
                .await;
        }
    }

    /// Refuses new connections (`true`) or accepts them again (`false`).
    pub fn block(&self, blocked: bool) {
        self.blocked
            .store(blocked, std::sync::atomic::Ordering::SeqCst);
    }

    /// `url` with its host and port replaced by the proxy's.
    pub fn url_for(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("scheme");
        let (auth_host, path) = rest.split_once('/').unwrap_or((rest, ""));
        let auth = auth_host
            .rsplit_once('@')
            .map(|(a, _)| format!("{a}@"))
            .unwrap_or_default();
        format!("{scheme}://{auth}{}/{path}", self.addr)
    }
}

/// host:port of an AMQP URL.
pub fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host = rest.split('/').next().unwrap_or(rest);
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:5672")
    }
}
