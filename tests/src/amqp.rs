//! RabbitMQ fixtures: the broker URL, per-test names, publishing with confirms, and a
//! TCP proxy of the test's own to cut a client's connection without touching the
//! shared broker.
//!
//! AMQP URLs are read with lapin's own URI type ([`uri`], amq-protocol-uri's
//! `AMQPUri`), so a helper sees the user, password (percent-decoded), host, port
//! (the scheme's default when none is given) and vhost that lapin connects with. One
//! consequence, lapin's own: amq-protocol-uri 10.6 reads a bracketed IPv6 host as
//! `localhost`, and so does every helper here.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use inbox_amqp::Topology;
use inbox_core::RetryLadder;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The RabbitMQ URL (see [`crate::services`]), or `None` when it is found nowhere and
/// `INBOX_SKIP_SERVICES=1`; panics when it is found nowhere otherwise.
///
/// The first call of a test process also starts the [broker watchdog](watch_broker).
pub fn amqp_url() -> Option<String> {
    let url = crate::services::url_of(crate::Service::Amqp)?;
    watch_broker(&url);
    Some(url)
}

/// How long the broker may leave every AMQP handshake unanswered before
/// [`watch_broker`] ends the test process.
pub const BROKER_SILENCE_LIMIT: Duration = Duration::from_secs(120);

/// Starts, once per test process, a thread that opens an AMQP handshake with the
/// broker at `url` every few seconds (the protocol header, answered by
/// `Connection.Start`) and, once no handshake has been answered for
/// [`BROKER_SILENCE_LIMIT`], writes why to stderr and exits the process with status 101.
///
/// A broker that stops answering (RabbitMQ 3.10 on a small machine has been seen to
/// wedge under hundreds of quorum queues) would otherwise leave every test of the
/// binary waiting forever on a connect or a confirm; this way the binary fails with
/// the cause named, and the next one starts. Only `amqp://` URLs are watched (a TLS
/// port answers the header with nothing readable).
pub fn watch_broker(url: &str) {
    static WATCHING: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    if !url.starts_with("amqp://") {
        return;
    }
    let Some(authority) = crate::services::authority(url) else {
        return;
    };
    WATCHING.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("broker-watchdog".into())
            .spawn(move || watchdog(&authority));
        if let Err(e) = spawned {
            eprintln!("broker watchdog not started: {e}");
        }
    });
}

fn watchdog(authority: &str) {
    let mut last_answer = std::time::Instant::now();
    loop {
        std::thread::sleep(Duration::from_secs(5));
        if handshake_answered(authority) {
            last_answer = std::time::Instant::now();
        } else if last_answer.elapsed() >= BROKER_SILENCE_LIMIT {
            eprintln!(
                "\nbroker watchdog: RabbitMQ at {authority} has answered no AMQP handshake \
                 for {}s; it is wedged or gone. Ending this test process (status 101) \
                 instead of letting its tests wait forever; restart the broker \
                 (.ci/services does).",
                BROKER_SILENCE_LIMIT.as_secs()
            );
            // No destructor runs past `exit`: the programs the tests started would
            // outlive the process and go on reconnecting.
            kill_children(std::process::id());
            std::process::exit(101);
        }
    }
}

/// Kills (SIGKILL) every descendant of process `pid`, children first found by their
/// parent in `/proc` (Linux; elsewhere nothing is found).
fn kill_children(pid: u32) {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`: the command may hold spaces and parentheses.
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if parent == Some(pid) {
            kill_children(child);
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &child.to_string()])
                .status();
        }
    }
}

/// Whether the broker answers the AMQP 0-9-1 protocol header within 10 s, at any of
/// the addresses its host resolves to.
fn handshake_answered(authority: &str) -> bool {
    use std::net::ToSocketAddrs;
    authority
        .to_socket_addrs()
        .map(|mut addrs| addrs.any(|addr| answered_at(&addr)))
        .unwrap_or(false)
}

fn answered_at(addr: &std::net::SocketAddr) -> bool {
    use std::io::{Read, Write};
    let within = Duration::from_secs(10);
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(addr, within) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(within));
    let _ = stream.set_write_timeout(Some(within));
    let mut first = [0u8; 1];
    // Connection.Start is a method frame: type 1.
    stream.write_all(b"AMQP\x00\x00\x09\x01").is_ok()
        && stream.read_exact(&mut first).is_ok()
        && first[0] == 1
}

/// A broker name prefix no other test uses: `<unique_name(tag)>.`.
pub fn unique_prefix(tag: &str) -> String {
    format!("{}.", crate::unique_name(tag))
}

/// The tests' topology: exchange `billing` under `prefix`, retry tiers of
/// `ladder_ms` milliseconds, and queues the broker deletes 120 s after their last
/// consumer is gone (should the test die before its cleanup).
pub fn test_topology(prefix: &str, ladder_ms: &[u64]) -> Topology {
    let ladder = ladder_ms.iter().map(|&n| Duration::from_millis(n));
    Topology::new("billing")
        .expect("exchange name")
        .prefix(prefix)
        .expect("prefix")
        .ladder(RetryLadder::new(ladder).expect("retry ladder"))
        .queue_expires(Duration::from_secs(120))
}

/// Every name the `usage_consumer` example declares under `prefix` with its default
/// retry ladder: the exchange `billing`, the group `billing.daily-usage` (type
/// `usage.recorded`) and the group of the canary handler it runs for `inbox selftest`
/// ([`inbox_diesel::operator::CANARY_GROUP`]). A test that runs the program deletes
/// this whole topology: the program's queues carry no expiry, and quorum queues left
/// behind by the hundred slow the shared broker down until it stops answering.
pub fn usage_consumer_topology(prefix: &str) -> Topology {
    use inbox_core::ConsumerGroup;
    use inbox_diesel::operator::{CANARY_GROUP, CANARY_MESSAGE_TYPE};
    Topology::new("billing")
        .expect("exchange name")
        .prefix(prefix)
        .expect("prefix")
        .group(
            ConsumerGroup::new("billing.daily-usage").expect("group name"),
            ["usage.recorded"],
        )
        .group(
            ConsumerGroup::new(CANARY_GROUP).expect("group name"),
            [CANARY_MESSAGE_TYPE],
        )
}

/// Deletes a topology from the broker at `url` when dropped, whether the test
/// passed or failed: the queues of a program a test ran carry no expiry. The delete
/// runs on a thread of its own (so a drop inside a runtime is fine), bounded to 10 s
/// for the connect and 10 s for the delete; its failure is ignored.
pub struct DeleteOnDrop {
    url: String,
    topology: Option<Topology>,
}

impl DeleteOnDrop {
    /// Deletes `topology` from the broker at `url` when dropped.
    pub fn new(url: impl Into<String>, topology: Topology) -> Self {
        Self {
            url: url.into(),
            topology: Some(topology),
        }
    }
}

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        let (url, Some(topology)) = (self.url.clone(), self.topology.take()) else {
            return;
        };
        let deleting = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let within = Duration::from_secs(10);
                let connect = Connection::connect(&url, ConnectionProperties::default());
                if let Ok(Ok(conn)) = tokio::time::timeout(within, connect).await {
                    let _ = tokio::time::timeout(within, topology.delete(&conn)).await;
                    let _ = conn.close(200, "done".into()).await;
                }
            });
        });
        let _ = deleting.join();
    }
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

/// Publishes `body` to `exchange` under `routing_key`, confirmed and routed: mandatory,
/// and tried again every 50 ms, on a new channel when the exchange's absence closed
/// the old one, until a queue is bound to take it (a program under test declares its
/// topology when it starts). Panics after `within`.
pub async fn publish_routed(
    conn: &Connection,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
    within: Duration,
) {
    let deadline = std::time::Instant::now() + within;
    let mut channel = confirm_channel(conn).await;
    loop {
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let published = channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                options,
                body,
                props.clone(),
            )
            .await;
        let confirm = match published {
            Ok(pending) => pending.await.ok(),
            Err(_) => None,
        };
        if confirm.is_some_and(|c| c.is_ack() && c.take_message().is_none()) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nothing bound to {exchange} / {routing_key} within {within:?}"
        );
        if !channel.status().connected() {
            channel = confirm_channel(conn).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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

    /// `url` with its host and port replaced by the proxy's (user, password, vhost
    /// and the query parameters lapin knows are kept); panics on a URL lapin cannot
    /// read.
    pub fn url_for(&self, url: &str) -> String {
        let mut uri = uri(url).unwrap_or_else(|why| panic!("{why}"));
        uri.authority.host = self.addr.ip().to_string();
        uri.authority.port = self.addr.port();
        uri.to_string()
    }
}

/// `url` (`amqp://` or `amqps://`) as lapin reads it; `Err` says why it does not parse.
pub fn uri(url: &str) -> Result<lapin::uri::AMQPUri, String> {
    crate::services::amqp_uri(url)
}

/// host:port of an AMQP URL, the port the scheme's default when it names none;
/// panics on a URL lapin cannot read.
pub fn host_port(url: &str) -> String {
    let uri = uri(url).unwrap_or_else(|why| panic!("{why}"));
    crate::services::amqp_authority(&uri)
}

/// A bare AMQP 0-9-1 publisher that writes its frames byte by byte, for what a client
/// library refuses to send: strings that are not UTF-8, tables nested thousands of
/// levels deep. One connection per publish, with a confirm.
pub mod raw {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// A short string: one length byte, then the bytes (at most 255).
    pub fn short(bytes: &[u8]) -> Vec<u8> {
        let len = u8::try_from(bytes.len()).expect("a short string holds at most 255 bytes");
        let mut out = vec![len];
        out.extend_from_slice(bytes);
        out
    }

    /// A long string: a `u32` length, then the bytes.
    pub fn long(bytes: &[u8]) -> Vec<u8> {
        let mut out = (bytes.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(bytes);
        out
    }

    /// A field table of (name, tagged value) entries; the name is written as given,
    /// UTF-8 or not.
    pub fn table(entries: &[(&[u8], Vec<u8>)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (name, value) in entries {
            body.extend(short(name));
            body.extend_from_slice(value);
        }
        long(&body)
    }

    /// A tagged long-string value (`S`).
    pub fn long_value(bytes: &[u8]) -> Vec<u8> {
        let mut out = vec![b'S'];
        out.extend(long(bytes));
        out
    }

    /// A tagged table value (`F`) nesting `depth` tables, each the only entry `n` of
    /// the one around it, built from the inside out (no recursion on this side).
    pub fn nested_table_value(depth: usize) -> Vec<u8> {
        let mut value = vec![b'F', 0, 0, 0, 0];
        for _ in 1..depth {
            let mut outer = vec![b'F'];
            let inner_len = 2 + value.len();
            outer.extend((inner_len as u32).to_be_bytes());
            outer.extend(short(b"n"));
            outer.extend(value);
            value = outer;
        }
        value
    }

    /// The basic properties a raw publish sets, as wire bytes.
    #[derive(Clone, Debug, Default)]
    pub struct Properties {
        /// `message_id`'s bytes.
        pub message_id: Option<Vec<u8>>,
        /// `type`'s bytes.
        pub message_type: Option<Vec<u8>>,
        /// The encoded headers table (see [`table`]).
        pub headers: Option<Vec<u8>>,
    }

    impl Properties {
        fn encode(&self) -> Vec<u8> {
            // Flags from bit 15: content-type, content-encoding, headers (13),
            // delivery-mode (12), ..., message-id (7), timestamp (6), type (5).
            let mut flags: u16 = 1 << 12;
            let mut list = Vec::new();
            if let Some(headers) = &self.headers {
                flags |= 1 << 13;
                list.extend_from_slice(headers);
            }
            list.push(2); // persistent
            if let Some(id) = &self.message_id {
                flags |= 1 << 7;
                list.extend(short(id));
            }
            if let Some(kind) = &self.message_type {
                flags |= 1 << 5;
                list.extend(short(kind));
            }
            let mut out = flags.to_be_bytes().to_vec();
            out.extend(list);
            out
        }
    }

    struct Wire {
        stream: TcpStream,
    }

    fn method(class: u16, id: u16, args: &[u8]) -> Vec<u8> {
        let mut out = class.to_be_bytes().to_vec();
        out.extend(id.to_be_bytes());
        out.extend_from_slice(args);
        out
    }

    impl Wire {
        async fn send(&mut self, kind: u8, channel: u16, payload: &[u8]) -> std::io::Result<()> {
            let mut frame = vec![kind];
            frame.extend(channel.to_be_bytes());
            frame.extend((payload.len() as u32).to_be_bytes());
            frame.extend_from_slice(payload);
            frame.push(0xCE);
            self.stream.write_all(&frame).await
        }

        /// The next method frame's (class, method, arguments); heartbeats skipped.
        async fn recv(&mut self) -> Result<(u16, u16, Vec<u8>), String> {
            loop {
                let mut head = [0u8; 7];
                self.stream
                    .read_exact(&mut head)
                    .await
                    .map_err(|e| format!("the broker closed the socket: {e}"))?;
                let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
                let mut payload = vec![0u8; size + 1];
                self.stream
                    .read_exact(&mut payload)
                    .await
                    .map_err(|e| format!("the broker closed the socket: {e}"))?;
                payload.pop();
                if head[0] != 1 || payload.len() < 4 {
                    continue;
                }
                let class = u16::from_be_bytes([payload[0], payload[1]]);
                let id = u16::from_be_bytes([payload[2], payload[3]]);
                return Ok((class, id, payload[4..].to_vec()));
            }
        }

        /// Waits for (class, method); a close from the broker is an error with its text.
        async fn expect(&mut self, class: u16, id: u16) -> Result<Vec<u8>, String> {
            let (c, m, args) = self.recv().await?;
            if (c, m) == (class, id) {
                return Ok(args);
            }
            if (c, m) == (10, 50) || (c, m) == (20, 40) {
                let code = u16::from_be_bytes([args[0], args[1]]);
                let len = args[2] as usize;
                let text = String::from_utf8_lossy(&args[3..3 + len]).into_owned();
                return Err(format!("the broker closed: {code} {text}"));
            }
            Err(format!("expected method {class}.{id}, found {c}.{m}"))
        }
    }

    /// (user, password, host:port, vhost) of an `amqp://` URL, decoded as lapin
    /// decodes them (`guest`, `guest` and `/` when it names none).
    pub(crate) fn parts(url: &str) -> Result<(String, String, String, String), String> {
        let uri = super::uri(url)?;
        let addr = crate::services::amqp_authority(&uri);
        let user = uri.authority.userinfo;
        Ok((user.username, user.password, addr, uri.vhost))
    }

    /// Publishes one message with these raw properties to `exchange` and waits for
    /// the broker's confirm. `Err` says how the broker refused it.
    pub async fn publish(
        url: &str,
        exchange: &str,
        routing_key: &str,
        properties: &Properties,
        body: &[u8],
    ) -> Result<(), String> {
        publish_within(
            url,
            exchange,
            routing_key,
            properties,
            body,
            Duration::from_secs(10),
        )
        .await
    }

    /// [`publish`], giving the broker `within` to confirm (a quorum queue takes time
    /// quadratic in a header table's depth to take it: some 25 s at 20,000 levels).
    pub async fn publish_within(
        url: &str,
        exchange: &str,
        routing_key: &str,
        properties: &Properties,
        body: &[u8],
        within: Duration,
    ) -> Result<(), String> {
        let (user, pass, addr, vhost) = parts(url)?;
        let stream = TcpStream::connect(&addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let mut wire = Wire { stream };
        let steps = async {
            wire.stream
                .write_all(b"AMQP\x00\x00\x09\x01")
                .await
                .map_err(|e| e.to_string())?;
            wire.expect(10, 10).await?; // start
            let mut start_ok = long(&[]); // no client properties
            start_ok.extend(short(b"PLAIN"));
            start_ok.extend(long(format!("\0{user}\0{pass}").as_bytes()));
            start_ok.extend(short(b"en_US"));
            wire.send(1, 0, &method(10, 11, &start_ok))
                .await
                .map_err(|e| e.to_string())?;
            let tune = wire.expect(10, 30).await?;
            let frame_max = u32::from_be_bytes([tune[2], tune[3], tune[4], tune[5]]).max(4096);
            let mut tune_ok = tune[..2].to_vec();
            tune_ok.extend(frame_max.to_be_bytes());
            tune_ok.extend(0u16.to_be_bytes()); // no heartbeats
            wire.send(1, 0, &method(10, 31, &tune_ok))
                .await
                .map_err(|e| e.to_string())?;
            let mut open = short(vhost.as_bytes());
            open.extend(short(b""));
            open.push(0);
            wire.send(1, 0, &method(10, 40, &open))
                .await
                .map_err(|e| e.to_string())?;
            wire.expect(10, 41).await?;
            wire.send(1, 1, &method(20, 10, &short(b"")))
                .await
                .map_err(|e| e.to_string())?;
            wire.expect(20, 11).await?;
            wire.send(1, 1, &method(85, 10, &[0]))
                .await
                .map_err(|e| e.to_string())?;
            wire.expect(85, 11).await?;
            let mut publish = 0u16.to_be_bytes().to_vec();
            publish.extend(short(exchange.as_bytes()));
            publish.extend(short(routing_key.as_bytes()));
            publish.push(0);
            wire.send(1, 1, &method(60, 40, &publish))
                .await
                .map_err(|e| e.to_string())?;
            let mut header = 60u16.to_be_bytes().to_vec();
            header.extend(0u16.to_be_bytes());
            header.extend((body.len() as u64).to_be_bytes());
            header.extend(properties.encode());
            wire.send(2, 1, &header).await.map_err(|e| e.to_string())?;
            for chunk in body.chunks(frame_max as usize - 8) {
                wire.send(3, 1, chunk).await.map_err(|e| e.to_string())?;
            }
            wire.expect(60, 80).await?; // basic.ack
            let mut close = 200u16.to_be_bytes().to_vec();
            close.extend(short(b"done"));
            close.extend([0, 0, 0, 0]);
            wire.send(1, 0, &method(10, 50, &close))
                .await
                .map_err(|e| e.to_string())?;
            let _ = wire.expect(10, 51).await;
            Ok(())
        };
        tokio::time::timeout(within, steps)
            .await
            .map_err(|_| format!("the broker did not answer within {within:?}"))?
    }
}

#[cfg(test)]
mod watchdog_tests {
    use super::*;

    /// The raw publisher logs in with what lapin would send: the user name, password
    /// and vhost percent-decoded, a `:` inside the password kept.
    #[test]
    fn raw_publishers_read_the_url_as_lapin_does() {
        assert_eq!(
            raw::parts("amqp://us%65r:p%40ss:w@broker.example:5673/my%2Dvhost").unwrap(),
            (
                "user".to_owned(),
                "p@ss:w".to_owned(),
                "broker.example:5673".to_owned(),
                "my-vhost".to_owned()
            )
        );
        assert_eq!(
            raw::parts("amqp://127.0.0.1").unwrap(),
            (
                "guest".to_owned(),
                "guest".to_owned(),
                "127.0.0.1:5672".to_owned(),
                "/".to_owned()
            )
        );
        assert!(raw::parts("broker.example:5672").is_err());
    }

    /// A listener that accepts and never says a word: a wedged node as a client sees it.
    #[test]
    fn a_silent_listener_is_no_broker() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let held = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            std::thread::sleep(Duration::from_secs(12));
            drop(stream);
        });
        assert!(!handshake_answered(&addr.to_string()));
        held.join().unwrap();
    }

    #[test]
    fn a_wedged_run_leaves_no_program_of_its_own_behind() {
        // A shell whose child sleeps and which then says how the sleep ended: the
        // watchdog kills the descendants of the test process; here, of the shell.
        let shell = std::process::Command::new("sh")
            .args(["-c", "sleep 60; echo $?"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Until the shell has started its sleep.
        let pid = shell.id();
        while !std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            std::fs::read_to_string(e.path().join("stat")).is_ok_and(|stat| {
                stat.contains("(sleep)")
                    && stat
                        .rsplit_once(')')
                        .and_then(|(_, r)| r.split_whitespace().nth(1))
                        == Some(pid.to_string().as_str())
            })
        }) {
            std::thread::sleep(Duration::from_millis(20));
        }
        kill_children(pid);
        let out = shell.wait_with_output().unwrap();
        // 128 + SIGKILL (9): killed, not finished.
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "137");
    }

    #[test]
    fn a_closed_port_is_no_broker() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        assert!(!handshake_answered(&addr.to_string()));
    }

    /// A test that fails still removes its topology: the guard deletes it while the
    /// panic unwinds.
    #[test]
    fn a_failing_test_still_deletes_its_topology() {
        let Some(url) = amqp_url() else { return };
        let topology = test_topology(&unique_prefix("dod"), &[50]).group(
            inbox_core::ConsumerGroup::new("billing.daily-usage").unwrap(),
            ["usage.recorded"],
        );
        let queue = topology.queues()[0].clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let exists = |queue: &str| {
            rt.block_on(async {
                let conn = connect(&url).await;
                let channel = conn.create_channel().await.unwrap();
                let passive = QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                };
                let found = channel
                    .queue_declare(queue.into(), passive, FieldTable::default())
                    .await
                    .is_ok();
                let _ = conn.close(200, "done".into()).await;
                found
            })
        };
        rt.block_on(async { topology.declare(&connect(&url).await).await.unwrap() });
        assert!(exists(&queue));
        let failed = std::panic::catch_unwind(|| {
            let _topology = DeleteOnDrop::new(url.clone(), topology.clone());
            panic!("the test fails");
        });
        assert!(failed.is_err());
        assert!(!exists(&queue), "{queue} outlived the failed test");
    }

    #[test]
    fn the_shared_broker_answers() {
        let Some(url) = amqp_url() else { return };
        let authority = crate::services::authority(&url).unwrap();
        if url.starts_with("amqp://") {
            assert!(handshake_answered(&authority));
        }
    }
}
