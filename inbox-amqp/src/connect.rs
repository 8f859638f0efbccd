//! What the consumer and the relay share about their broker connection: connecting
//! with a name and a bounded handshake, the reconnect backoff, goodbyes that never
//! wait long on a dead connection, the watch that gives up on work outliving its
//! connection, and why a session ended (the loop that uses them is in `supervisor`).

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use lapin::types::LongString;
use lapin::{Channel, Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use inbox_core::{exponential_backoff, redact_url};

use crate::brokers::BrokerUrls;
use crate::tls::Tls;
use crate::{Error, Result};

/// Why a session with the broker ended.
pub(crate) enum SessionEnd {
    /// The connection or a channel was lost: reconnect.
    Lost(String),
    /// The connection was lost to a frame the client cannot parse (a string that is
    /// not UTF-8 where AMQP has a short string): the broker is healthy, so reconnect
    /// after the shortest backoff, and cautiously (see `Caution`).
    Unreadable(String),
    /// A cautious session has read enough without a loss: reconnect at once,
    /// normally.
    Relaxed,
    /// Stop for good.
    Fatal(Error),
}

impl SessionEnd {
    /// How grave an end is: fatal, then unreadable (the caution it starts must not
    /// be lost to a lost or relaxed end), then lost, then relaxed.
    fn rank(&self) -> u8 {
        match self {
            Self::Fatal(_) => 3,
            Self::Unreadable(_) => 2,
            Self::Lost(_) => 1,
            Self::Relaxed => 0,
        }
    }
}

/// The gravest end a session has come to so far, kept outside the session's future.
///
/// A session of several tasks ends when one of them does, and the others first
/// finish their batch; the session's end is the gravest of theirs. It is recorded
/// here as each task ends, not only returned: when the connection dies under a task
/// that never finishes, the supervisor gives up on the session and drops its future
/// (see [`while_connected`]), and the end recorded before the drop still decides
/// what comes next. Without it a task's fatal end would reconnect, and an
/// unreadable frame's caution would be lost, whenever a slow batch outlived the
/// connection by [`GOODBYE_WAIT`].
#[derive(Default)]
pub(crate) struct Ends(std::sync::Mutex<Option<SessionEnd>>);

impl Ends {
    fn gravest(&self) -> std::sync::MutexGuard<'_, Option<SessionEnd>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records `end` when it is graver than every end recorded so far, and then
    /// calls `graver` with it.
    pub(crate) fn record(&self, end: SessionEnd, graver: impl FnOnce(&SessionEnd)) {
        let mut gravest = self.gravest();
        if gravest.as_ref().is_none_or(|g| end.rank() > g.rank()) {
            graver(&end);
            *gravest = Some(end);
        }
    }

    /// The gravest end recorded, taken out: `Ok(())` when none was.
    pub(crate) fn take(&self) -> std::result::Result<(), SessionEnd> {
        let mut gravest = self.gravest();
        gravest.take().map_or(Ok(()), Err)
    }

    /// The end of a session given up on because its connection was lost (`why`):
    /// the gravest of that loss and the ends recorded before it.
    pub(crate) fn given_up(&self, why: String) -> SessionEnd {
        let mut gravest = self.gravest();
        match gravest.take() {
            Some(
                end @ (SessionEnd::Fatal(_) | SessionEnd::Unreadable(_) | SessionEnd::Lost(_)),
            ) => end,
            Some(SessionEnd::Relaxed) | None => SessionEnd::Lost(why),
        }
    }
}

impl From<lapin::Error> for SessionEnd {
    fn from(err: lapin::Error) -> Self {
        if matches!(err.kind(), lapin::ErrorKind::ParsingError(_)) {
            Self::Unreadable(err.to_string())
        } else {
            Self::Lost(err.to_string())
        }
    }
}

/// `url` with its `frame_max` query parameter at most `cap` (added when absent);
/// `None` when the URL does not parse (connecting reports that).
pub(crate) fn capped_frame_max(url: &str, cap: u32) -> Option<lapin::uri::AMQPUri> {
    let mut uri: lapin::uri::AMQPUri = url.parse().ok()?;
    let asked = uri.query.frame_max.map_or(cap, |asked| asked.min(cap));
    uri.query.frame_max = Some(asked);
    Some(uri)
}

/// Connects, naming the connection, and gives up when the AMQP handshake has not
/// finished `within` (a peer that accepts the connection and never answers would
/// otherwise hold it forever: heartbeats only start after the handshake). The error
/// keeps lapin's cause and hides the password.
/// `frame_max`, when given, caps the frame size asked for (see [`capped_frame_max`]);
/// `tls` is how an `amqps://` URL's TLS is done (see [`Tls::for_url`]).
pub(crate) async fn open(
    url: &str,
    name: Option<&str>,
    within: Duration,
    frame_max: Option<u32>,
    tls: &Tls,
) -> Result<Connection> {
    let mut props = ConnectionProperties::default();
    if let Some(name) = name {
        props = props.with_connection_name(LongString::from(name));
    }
    let uri = match frame_max {
        Some(cap) => capped_frame_max(url, cap),
        None => url.parse().ok(),
    };
    let connecting = async {
        match uri {
            Some(uri) => {
                let runtime = lapin::runtime::default_runtime()?;
                Connection::connect_uri_with_config(uri, props, tls.config(), runtime).await
            }
            // lapin's own parse error, quoted back (redacted below).
            None => Connection::connect(url, props).await,
        }
    };
    match tokio::time::timeout(within, connecting).await {
        Ok(connected) => connected.map_err(|source| Error::connect(url, &source)),
        Err(_) => Err(Error::ConnectTimeout {
            url: redact_url(url),
            after: within,
        }),
    }
}

/// The longest wait for a connection's AMQP handshake through [`connect`].
const CONNECT_WITHIN: Duration = Duration::from_secs(30);

/// Opens a connection to the first broker of `urls` (one URL or a list, see
/// [`BrokerUrls::parse`]) that answers, trying them in order, each by
/// [`open`]'s rules with `ca_cert` for `amqps://`; the last one's error when none
/// answers, and an unusable list or CA refused before any is tried.
pub(crate) async fn open_first(
    urls: &str,
    name: Option<&str>,
    within: Duration,
    frame_max: Option<u32>,
    ca_cert: Option<&Path>,
) -> Result<Connection> {
    let urls = BrokerUrls::parse(urls)?;
    let tls = (urls.iter())
        .map(|url| Tls::for_url(url, ca_cert))
        .collect::<Result<Vec<_>>>()?;
    let mut failed = None;
    for (url, tls) in urls.iter().zip(&tls) {
        if let Some(err) = &failed {
            tracing::warn!(error = %inbox_core::ErrorChain(err), "connecting failed; trying the next broker URL");
        }
        match open(url, name, within, frame_max, tls).await {
            Ok(conn) => return Ok(conn),
            Err(err) => failed = Some(err),
        }
    }
    Err(failed.unwrap_or_else(|| Error::invalid("url", "one or more AMQP URLs", "nothing")))
}

/// Opens a connection to `url` by the rules the consumer and the relay connect by:
/// `amqps://` needs this crate's feature `rustls` (else [`Error::TlsUnavailable`], at
/// once), `ca_cert` is a PEM file of CA certificates trusted besides the system's
/// roots (refused as [`Error::InvalidSetting`] when unusable, or with a plain
/// `amqp://` URL), the handshake is given 30 s, and no error prints the URL's
/// password. `url` may list several brokers (the nodes of a cluster, see
/// [`BrokerUrls::parse`]): they are tried in order and the first that answers is
/// connected to. For tools that talk to the broker themselves (`inbox verify` does).
///
/// ```no_run
/// # async fn run() -> Result<(), inbox_amqp::Error> {
/// let ca = inbox_amqp::ca_cert_from_env(); // AMQP_CA_CERT
/// let conn = inbox_amqp::connect("amqps://app:secret@broker:5671/%2f", ca.as_deref()).await?;
/// # drop(conn); Ok(()) }
/// ```
pub async fn connect(url: &str, ca_cert: Option<&Path>) -> Result<Connection> {
    open_first(url, None, CONNECT_WITHIN, None, ca_cert).await
}

/// The longest wait for the broker to acknowledge a goodbye (a cancel or a close). A
/// connection that dies while it is being closed may never answer (lapin can send the
/// close after its I/O loop has stopped); such a connection is dropped, not waited on.
const GOODBYE_WAIT: Duration = Duration::from_secs(2);

/// Runs a goodbye for at most [`GOODBYE_WAIT`]; its outcome does not matter.
pub(crate) async fn goodbye<T>(what: &str, fut: impl Future<Output = T>) {
    if tokio::time::timeout(GOODBYE_WAIT, fut).await.is_err() {
        tracing::debug!(what, "the broker did not answer in time; giving up on it");
    }
}

/// How often [`while_connected`] looks at its connection.
const WATCH_EVERY: Duration = Duration::from_millis(100);

/// Runs `work` (a declaration, a session) on `conn` until it ends, or gives up on it
/// once `conn` has not been connected for [`GOODBYE_WAIT`]: `Err(gone(why))`, the
/// future dropped (a session's tasks aborted with it).
///
/// lapin rejects the calls in flight when its connection fails, but not every one: a
/// call made as the connection fails (a channel being opened, a queue being declared)
/// can wait forever. Under repeated cuts a declaration was seen never to return on a
/// connection lapin had marked failed, and its consumer stalled for good. Work that
/// ends on its own after a loss (the usual case: its calls fail and its tasks drain)
/// is given [`GOODBYE_WAIT`] to do so. Dropping the rest loses nothing: what its
/// tasks held unacked goes back to the queue with the dead connection, and a batch a
/// store thread commits after the drop is a duplicate when it comes back.
pub(crate) async fn while_connected<T, E>(
    conn: &Connection,
    work: impl Future<Output = std::result::Result<T, E>>,
    gone: impl FnOnce(String) -> E,
) -> std::result::Result<T, E> {
    let mut work = std::pin::pin!(work);
    let mut tick = tokio::time::interval(WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut dead_since: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            biased;
            done = &mut work => return done,
            _ = tick.tick() => {}
        }
        if conn.status().connected() {
            dead_since = None;
            continue;
        }
        let since = *dead_since.get_or_insert_with(tokio::time::Instant::now);
        if since.elapsed() >= GOODBYE_WAIT {
            let status = conn.status();
            let state = if status.errored() {
                "failed"
            } else if status.closing() || status.closed() {
                "closed"
            } else {
                "not connected"
            };
            return Err(gone(format!(
                "the connection {state} and calls on it did not return within {GOODBYE_WAIT:?}"
            )));
        }
    }
}

/// Closes a connection politely if it is still open.
pub(crate) async fn close_connection(conn: &Connection, text: &str) {
    if conn.status().connected() {
        goodbye("connection close", conn.close(200, text.into())).await;
    }
}

/// Closes a channel politely if it is still open.
pub(crate) async fn close_channel(channel: &Channel, text: &str) {
    if channel.status().connected() {
        goodbye("channel close", channel.close(200, text.into())).await;
    }
}

/// A pause drawn uniformly from `[0, ceiling]`: "full jitter".
///
/// Full rather than decorrelated jitter: the ceiling stays the plain exponential
/// backoff the settings describe (`backoff_min` doubling up to `backoff_max`, back to
/// the minimum after a session that held), so a pause is bounded by what the
/// settings say, and clients that lost their broker at the same instant spread over
/// the whole window instead of clustering near its top. Decorrelated jitter draws
/// from the previous pause instead and can wander anywhere below the cap.
///
/// The generator is `fastrand`'s per-thread one (seeded from the clock and the thread
/// id): not cryptographic, which a pause does not need, and no lock shared across
/// threads.
pub(crate) fn full_jitter(ceiling: Duration) -> Duration {
    let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(fastrand::u64(0..=nanos))
}

/// The next pause of a backoff whose current ceiling is `ceiling`: a full-jitter draw
/// under it; the ceiling then doubles up to `max`. The `n`-th pause from `min` is
/// thus random in `[0, min(max, min * 2^n)]`.
pub(crate) fn next_pause(ceiling: &mut Duration, max: Duration) -> Duration {
    let pause = full_jitter(*ceiling);
    *ceiling = exponential_backoff(*ceiling, 1, max);
    pause
}

/// Waits out the next jittered pause of the backoff (or the shutdown): after a lost
/// connection or a store that does not answer, where every consumer and relay of a
/// restarted broker or database would otherwise come back in lockstep.
pub(crate) async fn pause(shutdown: &CancellationToken, backoff: &mut Duration, max: Duration) {
    let wait = next_pause(backoff, max);
    tokio::select! {
        () = tokio::time::sleep(wait) => {}
        () = shutdown.cancelled() => {}
    }
}

/// Waits out the backoff itself (or the shutdown), then doubles it up to `max`: for a
/// pause that no restart synchronises (a full retry tier draining), where the whole
/// wait is what keeps the loop from hammering the broker.
pub(crate) async fn wait_out(shutdown: &CancellationToken, backoff: &mut Duration, max: Duration) {
    tokio::select! {
        () = tokio::time::sleep(*backoff) => {}
        () = shutdown.cancelled() => {}
    }
    *backoff = exponential_backoff(*backoff, 1, max);
}

/// The setting a refusal names and the value it found; panics on anything else.
#[cfg(test)]
pub(crate) fn config_error(checked: Result<()>) -> (&'static str, String) {
    match checked {
        Err(Error::InvalidSetting { setting, found, .. }) => (setting, found),
        other => panic!("expected an invalid setting, got {other:?}"),
    }
}

/// Refuses a connect timeout of zero.
pub(crate) fn check_connect_timeout(within: Duration) -> Result<()> {
    if within.is_zero() {
        return Err(Error::invalid(
            "connect_timeout",
            "a duration above zero",
            "0ns",
        ));
    }
    Ok(())
}

/// Refuses a backoff that is zero or whose minimum exceeds its maximum.
pub(crate) fn check_backoff(min: Duration, max: Duration) -> Result<()> {
    if min.is_zero() || min > max {
        return Err(Error::invalid(
            "backoff",
            "0 < min <= max",
            format_args!("{min:?}..{max:?}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two clients (two threads, as two processes, each with a generator of its own)
    /// that start backing off at the same instant: the `n`-th pause of each stays in
    /// `[0, min(max, min * 2^n)]`, and their sequences differ, so they do not
    /// reconnect in lockstep.
    #[test]
    fn two_clients_pause_differently_within_the_full_jitter_bounds() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(5));
        let client = move || {
            std::thread::spawn(move || {
                let mut ceiling = min;
                (0..12)
                    .map(|_| next_pause(&mut ceiling, max))
                    .collect::<Vec<_>>()
            })
        };
        let (a, b) = (client(), client());
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        for pauses in [&a, &b] {
            for (n, pause) in pauses.iter().enumerate() {
                let bound = exponential_backoff(min, u32::try_from(n).unwrap(), max);
                assert!(*pause <= bound, "pause {n}: {pause:?} above {bound:?}");
            }
        }
        assert_ne!(a, b, "two clients paused alike");
    }

    /// Full jitter covers the whole window, not only its top.
    #[test]
    fn full_jitter_spreads_over_the_whole_window() {
        let ceiling = Duration::from_secs(1);
        let draws: Vec<_> = (0..10_000).map(|_| full_jitter(ceiling)).collect();
        assert!(draws.iter().all(|d| *d <= ceiling));
        assert!(
            draws.iter().any(|d| *d < ceiling / 20),
            "none in the lowest 5%"
        );
        assert!(
            draws.iter().any(|d| *d > ceiling * 19 / 20),
            "none in the top 5%"
        );
        assert_eq!(full_jitter(Duration::ZERO), Duration::ZERO);
    }

    /// Display of every level of the chain, and Debug of the top.
    fn everything_printed(err: &Error) -> Vec<String> {
        let mut printed = vec![format!("{err:?}")];
        let mut level: Option<&(dyn std::error::Error + 'static)> = Some(err);
        while let Some(e) = level {
            printed.push(e.to_string());
            level = e.source();
        }
        printed
    }

    #[test]
    fn the_frame_size_asked_for_is_capped() {
        let asked = |url: &str| capped_frame_max(url, 131_072).and_then(|u| u.query.frame_max);
        assert_eq!(asked("amqp://127.0.0.1:5672/%2f"), Some(131_072));
        assert_eq!(asked("amqp://h/%2f?frame_max=1048576"), Some(131_072));
        assert_eq!(asked("amqp://h/%2f?frame_max=8192&heartbeat=5"), Some(8192));
        assert_eq!(asked("amqp:not a url"), None);
    }

    /// URLs lapin refuses before any I/O (or that find nothing listening), and the
    /// password each must not print.
    #[test]
    fn connect_errors_print_no_password() {
        let cases = [
            // Not a base URL: amq-protocol-uri quotes it back whole.
            ("amqp:guest:s3cret@127.0.0.1", "s3cret"),
            ("amqp:guest:s3cret@127.0.0.1/%2f", "s3cret"),
            // '?', '#' or '/' end the authority: the head of the password is a port.
            ("amqp://guest:qu?es-s3cret@127.0.0.1:1/%2f", "qu?es-s3cret"),
            ("amqp://guest:ha#sh-s3cret@127.0.0.1:1/%2f", "ha#sh-s3cret"),
            ("amqp://guest:sl4sh/s3cret@127.0.0.1:1/%2f", "sl4sh"),
            // Percent-encoded: neither form is printed.
            ("amqp://guest:p%40ss%3Fw@127.0.0.1:1/%2f", "p%40ss%3Fw"),
            ("amqp://guest:p%40ss%3Fw@127.0.0.1:1/%2f", "p@ss?w"),
            // Invalid UTF-8 once decoded.
            ("amqp://guest:p%FFs3cret@127.0.0.1:1/%2f", "p%FFs3cret"),
            ("amqp://guest:at@s3cret@127.0.0.1:1/%2f", "at@s3cret"),
            ("amqps://guest:tls-s3cret@127.0.0.1:1/%2f", "tls-s3cret"),
            (
                "amqps://guest:tls-qu?es-s3cret@127.0.0.1:1/%2f",
                "tls-qu?es-s3cret",
            ),
            ("amqps://guest:tls-p%40ss@127.0.0.1:1/%2f", "tls-p@ss"),
            ("amqps:guest:tls-n0slash@127.0.0.1/%2f", "tls-n0slash"),
            ("http://guest:http-s3cret@127.0.0.1:1/", "http-s3cret"),
        ];
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        for (url, password) in cases {
            let err = match runtime.block_on(connect(url, None)) {
                Ok(_) => panic!("connected to {}", redact_url(url)),
                Err(err) => err,
            };
            if !crate::TLS_BUILT && url.starts_with("amqps") {
                assert!(matches!(err, Error::TlsUnavailable { .. }), "{err:?}");
                for text in everything_printed(&err) {
                    assert!(!text.contains(password), "{url}: {text}");
                }
                continue;
            }
            assert!(matches!(err, Error::Connect { .. }), "{err:?}");
            for text in everything_printed(&err) {
                assert!(!text.contains(password), "{url}: {text}");
            }
            // The cause is the source, not also part of the message.
            let cause = std::error::Error::source(&err).map(ToString::to_string);
            assert_eq!(
                err.to_string(),
                format!("could not connect to {}", redact_url(url))
            );
            assert!(cause.is_some_and(|c| !c.is_empty()), "{err:?}");
        }
    }
}
