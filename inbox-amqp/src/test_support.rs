//! What the unit tests that talk to the broker of `AMQP_URL` share: its URL, a
//! runtime, an exclusive queue, and a loopback TCP proxy of the tests' own in front of
//! the broker that can cut every connection through it, or hold back what the broker
//! sends (its confirms, say) while the client's frames still go through.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::watch;

/// `AMQP_URL`, `None` (a skip) when it is not set.
pub(crate) fn amqp_url() -> Option<String> {
    let Ok(url) = std::env::var("AMQP_URL") else {
        assert!(
            std::env::var_os("INBOX_REQUIRE_SERVICES").is_none(),
            "AMQP_URL"
        );
        return None;
    };
    Some(url)
}

/// The broker of `AMQP_URL` as host:port, `None` (a skip) when it is not set.
pub(crate) fn broker() -> Option<String> {
    let uri: lapin::uri::AMQPUri = amqp_url()?.parse().unwrap_or_else(|e| panic!("{e}"));
    Some(format!("{}:{}", uri.authority.host, uri.authority.port))
}

/// A runtime of two worker threads, as the consumer and the relay run on.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"))
}

/// A queue of `channel`'s connection alone, deleted with it; its name.
pub(crate) async fn exclusive_queue(channel: &Channel) -> String {
    let options = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare("".into(), options, FieldTable::default())
        .await
        .unwrap_or_else(|e| panic!("declare: {e}"))
        .name()
        .to_string()
}

/// Through a new [`Proxy`] to `broker`: a connection, a channel of it in confirm
/// mode and an exclusive queue of it (its name).
pub(crate) async fn through_proxy(broker: String) -> (Proxy, Connection, Channel, String) {
    let proxy = Proxy::start(broker).await;
    let conn = Connection::connect(&proxy.url, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
    let channel = crate::publish::confirm_channel(&conn)
        .await
        .unwrap_or_else(|e| panic!("channel: {e}"));
    let queue = exclusive_queue(&channel).await;
    (proxy, conn, channel, queue)
}

/// A running proxy; its clones control the same one.
#[derive(Clone)]
pub(crate) struct Proxy {
    /// `amqp://guest:guest@<the proxy>/%2f`.
    pub(crate) url: String,
    cuts: Arc<watch::Sender<u64>>,
    held: Arc<watch::Sender<bool>>,
    sends_held: Arc<watch::Sender<bool>>,
    taken: Arc<AtomicUsize>,
}

impl Proxy {
    /// A proxy to `target` (host:port) on a free loopback port.
    pub(crate) async fn start(target: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("bind: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("addr: {e}"));
        let proxy = Self {
            url: format!("amqp://guest:guest@{addr}/%2f"),
            cuts: Arc::new(watch::Sender::new(0)),
            held: Arc::new(watch::Sender::new(false)),
            sends_held: Arc::new(watch::Sender::new(false)),
            taken: Arc::default(),
        };
        let running = proxy.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                running.taken.fetch_add(1, Ordering::SeqCst);
                // Subscribed before connecting: a cut from now on drops it.
                let mut cut = running.cuts.subscribe();
                let held = running.held.subscribe();
                let sends_held = running.sends_held.subscribe();
                let Ok(server) = tokio::net::TcpStream::connect(&target).await else {
                    return;
                };
                tokio::spawn(async move {
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::select! {
                        () = pipe(client_read, server_write, sends_held) => {}
                        () = pipe(server_read, client_write, held) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        proxy
    }

    /// Drops every connection open through the proxy (the client sees its
    /// connection fail); later connections go through.
    pub(crate) fn cut(&self) {
        self.cuts.send_modify(|n| *n += 1);
    }

    /// Holds back (or, with `false`, lets through again) what the broker sends on
    /// every connection through the proxy.
    pub(crate) fn hold(&self, held: bool) {
        self.held.send_replace(held);
    }

    /// Stops reading (or, with `false`, reads again) what the client sends on every
    /// connection through the proxy: once the sockets' buffers are full, the
    /// client's writes wait.
    pub(crate) fn hold_sends(&self, held: bool) {
        self.sends_held.send_replace(held);
    }

    /// How many connections the proxy has taken.
    pub(crate) fn taken(&self) -> usize {
        self.taken.load(Ordering::SeqCst)
    }
}

/// Copies `from` to `to` until either closes, pausing while `held` says so: a hold
/// set before bytes arrive holds them back (it is looked at first), bytes already
/// read go through.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut held: watch::Receiver<bool>) {
    let mut buf = vec![0; 16 * 1024];
    loop {
        while *held.borrow_and_update() {
            if held.changed().await.is_err() {
                return;
            }
        }
        let read = tokio::select! {
            biased;
            changed = held.changed() => match changed {
                Ok(()) => continue,
                Err(_) => return,
            },
            read = from.read(&mut buf) => read,
        };
        match read {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}
