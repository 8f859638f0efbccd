use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lapin::{Channel, Connection};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use inbox_core::{
    ErrorChain, OutboxFate, OutboxStore, RelayRound, RoundReport, DEFAULT_OUTBOX_MAX_ATTEMPTS,
    MAX_RETRY_DELAY,
};

use crate::connect::{Ends, SessionEnd};
use crate::connection::ConnectionSettings;
use crate::outbox_publisher::AmqpPublisher;
use crate::publish::confirm_channel;
use crate::supervisor::Supervisor;
use crate::{Error, Result};

/// Rounds a relay has in flight unless told otherwise.
pub const DEFAULT_ROUNDS_IN_FLIGHT: usize = 2;

/// The most rounds a relay may have in flight: each holds a channel and a blocking
/// thread while it waits.
pub const MAX_ROUNDS_IN_FLIGHT: usize = 32;

/// How a [`Relay`] runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RelaySettings {
    /// The relay's name (default: `relay-<host>-<pid>-<random>-<n>`, unique across
    /// containers where every process is pid 1). Each round leases as
    /// `<relay_id>/<32 random hex digits>`, recorded as `leased_by`: a round marks
    /// and records failures only of rows its own lease holds.
    pub relay_id: String,
    /// Most rows leased at once (default 500).
    pub batch_size: usize,
    /// Rounds in flight at once (default 2; 1 to 32): each has its own channel on the
    /// relay's connection and leases, publishes and marks on its own, so one round
    /// leases while another waits for its broker's confirms or its mark's commit.
    /// The ordering promise holds across them as across relays: a key's next row is
    /// not leased while an earlier one is unpublished.
    pub rounds_in_flight: usize,
    /// How long a lease holds (default 30 s; above zero and at most a year,
    /// [`MAX_RETRY_DELAY`], else refused). A relay that dies leaves leases that
    /// expire; another relay then takes the rows.
    pub lease_for: Duration,
    /// Longest wait for work when idle (default 1 s). With PostgreSQL's NOTIFY the
    /// relay wakes within milliseconds of a commit; this is the polling fallback.
    pub poll_interval: Duration,
    /// Whether an idle relay waits for the store's enqueue notification (PostgreSQL
    /// NOTIFY) or only polls (default true).
    pub wake_on_notify: bool,
    /// First delay before a failed publication (nack, unroutable, a channel the
    /// broker closed over the row, a row the store cannot read) is tried again;
    /// doubled per attempt up to one minute (default 1 s; above zero and at most a
    /// year, else refused).
    pub retry_after: Duration,
    /// Failed publications after which a row is dead: kept in the outbox, never
    /// leased again, listed by the store for an operator. A nack (the broker's
    /// refusal: a queue without a leader, or over its length) and a publication left
    /// unanswered by a lost connection count as tries for the delay and for this
    /// limit, but are never a row's last: a row refused past the limit stays live,
    /// and is dead at its first failure of its own (default
    /// [`DEFAULT_OUTBOX_MAX_ATTEMPTS`], about a quarter of an hour of tries with the
    /// default delays).
    pub max_attempts: u32,
    /// How the relay connects: its connection's name, the handshake limit, CA
    /// certificates and the reconnect backoff (the consumer's type).
    pub connection: ConnectionSettings,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            relay_id: default_relay_id(),
            batch_size: 500,
            rounds_in_flight: DEFAULT_ROUNDS_IN_FLIGHT,
            lease_for: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            wake_on_notify: true,
            retry_after: Duration::from_secs(1),
            max_attempts: DEFAULT_OUTBOX_MAX_ATTEMPTS,
            connection: ConnectionSettings::default(),
        }
    }
}

impl RelaySettings {
    /// Names the relay.
    pub fn relay_id(mut self, id: impl Into<String>) -> Self {
        self.relay_id = id.into();
        self
    }

    /// Sets the lease size and duration.
    pub fn lease(mut self, batch_size: usize, lease_for: Duration) -> Self {
        self.batch_size = batch_size;
        self.lease_for = lease_for;
        self
    }

    /// Sets how many rounds are in flight at once (1 runs them one after another).
    pub fn rounds_in_flight(mut self, rounds: usize) -> Self {
        self.rounds_in_flight = rounds;
        self
    }

    /// Sets the polling fallback.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Wakes on enqueue notifications (`true`) or only polls (`false`).
    pub fn wake_on_notify(mut self, wake: bool) -> Self {
        self.wake_on_notify = wake;
        self
    }

    /// Sets the first delay of a failed publication.
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = delay;
        self
    }

    /// Sets how many failed publications make a row dead.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Sets how the relay connects, all at once.
    pub fn connection(mut self, connection: ConnectionSettings) -> Self {
        self.connection = connection;
        self
    }

    /// Sets the reconnect backoff ([`ConnectionSettings::backoff`]).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.connection = self.connection.backoff(min, max);
        self
    }

    /// Names the connection ([`ConnectionSettings::connection_name`]).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection = self.connection.connection_name(name);
        self
    }

    /// Sets the longest wait for a connection's AMQP handshake
    /// ([`ConnectionSettings::connect_timeout`]).
    pub fn connect_timeout(mut self, within: Duration) -> Self {
        self.connection = self.connection.connect_timeout(within);
        self
    }

    /// Trusts the CA certificates of the PEM file at `path` for `amqps://`, besides
    /// the system's roots ([`ConnectionSettings::ca_cert`]).
    pub fn ca_cert(mut self, path: impl Into<PathBuf>) -> Self {
        self.connection = self.connection.ca_cert(path);
        self
    }

    /// These settings, or [`Error::InvalidSetting`] naming the first one out of range; a
    /// relay checks them again when it runs.
    pub fn checked(self) -> Result<Self> {
        self.check()?;
        Ok(self)
    }

    fn check(&self) -> Result<()> {
        if self.relay_id.is_empty() {
            return Err(Error::invalid("relay_id", "a non-empty id", "\"\""));
        }
        if self.batch_size == 0 {
            return Err(Error::invalid("lease", "a batch size of at least 1", 0));
        }
        if !(1..=MAX_ROUNDS_IN_FLIGHT).contains(&self.rounds_in_flight) {
            return Err(Error::invalid(
                "rounds_in_flight",
                "1 to 32 (MAX_ROUNDS_IN_FLIGHT)",
                self.rounds_in_flight,
            ));
        }
        for (setting, value) in [
            ("lease", self.lease_for),
            ("poll_interval", self.poll_interval),
            ("retry_after", self.retry_after),
        ] {
            if value.is_zero() {
                return Err(Error::invalid(setting, "a duration above zero", "0ns"));
            }
        }
        // Added to now and stored (a lease's end, a retry's due time): at most a year,
        // never a time the store cannot hold.
        for (setting, value) in [("lease", self.lease_for), ("retry_after", self.retry_after)] {
            if value > MAX_RETRY_DELAY {
                return Err(Error::invalid(
                    setting,
                    "at most a year (MAX_RETRY_DELAY)",
                    format_args!("{value:?}"),
                ));
            }
        }
        if self.max_attempts == 0 {
            return Err(Error::invalid("max_attempts", "at least 1", 0));
        }
        self.connection.check()
    }
}

/// Counters of a running relay.
#[derive(Debug, Default)]
pub struct RelayStats {
    published: AtomicU64,
    returned: AtomicU64,
    nacked: AtomicU64,
    rejected: AtomicU64,
    retried: AtomicU64,
    dead: AtomicU64,
    expired_leases: AtomicU64,
    reconnects: AtomicU64,
    batches: AtomicU64,
}

/// A copy of a relay's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelaySnapshot {
    /// Rows published, confirmed and marked.
    pub published: u64,
    /// Rows the broker returned as unroutable.
    pub returned: u64,
    /// Rows the broker nacked (also counted in `retried`: a nack never makes a row
    /// dead).
    pub nacked: u64,
    /// Rows that failed on their own: the broker closed the channel over them (an
    /// exchange that does not exist, a body over its size limit), they cannot be
    /// encoded as AMQP, or the store could not read them.
    pub rejected: u64,
    /// Failed rows recorded for a later retry, nacked ones and those a lost
    /// connection left unanswered included.
    pub retried: u64,
    /// Failed rows recorded dead (their last attempt).
    pub dead: u64,
    /// Leases that expired before publishing (their rows were left for later).
    pub expired_leases: u64,
    /// Connections re-established after a loss.
    pub reconnects: u64,
    /// Non-empty leases handled.
    pub batches: u64,
}

impl RelayStats {
    /// The counters now.
    pub fn snapshot(&self) -> RelaySnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RelaySnapshot {
            published: get(&self.published),
            returned: get(&self.returned),
            nacked: get(&self.nacked),
            rejected: get(&self.rejected),
            retried: get(&self.retried),
            dead: get(&self.dead),
            expired_leases: get(&self.expired_leases),
            reconnects: get(&self.reconnects),
            batches: get(&self.batches),
        }
    }
}

/// Publishes an outbox to RabbitMQ, with publisher confirms.
///
/// Each round leases rows in a short transaction, checks the lease still holds,
/// publishes them (`mandatory`, persistent) and waits for the confirms, then marks the
/// confirmed rows published in a second short transaction (only rows it still
/// leases). A row that fails on its own is recorded against itself (attempts, last
/// error, a doubling delay, dead after [`RelaySettings::max_attempts`]) and never
/// stops the rows around it: nacked (refused by a queue that cannot take anything
/// now: delayed like a failure, never made dead by it) or returned; a row the
/// broker closes the channel
/// over (an exchange that does not exist, a body over `max_message_size`), found by
/// publishing the unconfirmed rows one at a time on a new channel, after which the
/// rest go on; a row that cannot be encoded as AMQP; a row the store cannot read.
/// Rows with the same ordering key are never leased while an earlier one is live,
/// so they reach the broker in commit order across any number of relays. No
/// database transaction is held across broker I/O. A relay keeps
/// [`RelaySettings::rounds_in_flight`] rounds going at once (two by default), each
/// on its own channel: one leases and publishes while another waits for confirms
/// or for its mark to commit. After a non-empty round a lane leases again at once;
/// when idle it waits for a NOTIFY or the poll interval. At-least-once: a relay that dies between publishing and marking leaves
/// leases that expire, and the rows are published again (the consumer's inbox
/// absorbs the copy); a relay that loses its connection mid-round releases the rows
/// left unanswered, to go out again after `retry_after` on its next connection.
///
/// The store is any [`OutboxStore`], e.g. `inbox_diesel::Store`, whose rows
/// `inbox_diesel::enqueue` wrote; it needs a broker:
///
/// ```no_run
/// use std::{sync::Arc, time::Duration};
/// use inbox_amqp::{cancel_on_signals, CancellationToken, Relay, RelaySettings};
/// use inbox_core::OutboxStore;
///
/// async fn relay<O: OutboxStore>(store: O) -> Result<(), inbox_amqp::Error> {
///     let settings = RelaySettings::default()
///         .lease(500, Duration::from_secs(30))
///         .poll_interval(Duration::from_millis(200))
///         .checked()?;
///     let relay = Relay::new("amqp://guest:guest@127.0.0.1:5672/%2f", Arc::new(store))
///         .with_settings(settings); // several relays may run at once
///     let stats = relay.stats();
///     relay.run(cancel_on_signals(CancellationToken::new())).await?; // SIGTERM/ctrl-c
///     println!("published {}", stats.snapshot().published);
///     Ok(())
/// }
/// ```
pub struct Relay<O> {
    url: String,
    store: Arc<O>,
    settings: RelaySettings,
    stats: Arc<RelayStats>,
}

impl<O: OutboxStore> Relay<O> {
    /// A relay of `store`'s outbox to the broker at `url`: one URL, or the nodes of a
    /// cluster as several separated by whitespace or commas, tried in turn (see
    /// [`BrokerUrls`](crate::BrokerUrls)).
    pub fn new(url: impl Into<String>, store: Arc<O>) -> Self {
        Self {
            url: url.into(),
            store,
            settings: RelaySettings::default(),
            stats: Arc::default(),
        }
    }

    /// Replaces the settings.
    pub fn with_settings(mut self, settings: RelaySettings) -> Self {
        self.settings = settings;
        self
    }

    /// The live counters.
    pub fn stats(&self) -> Arc<RelayStats> {
        Arc::clone(&self.stats)
    }

    /// Runs until `shutdown` is cancelled (the round in flight finishes and is
    /// marked). The first connection must succeed; later losses reconnect with backoff.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        self.settings.check()?;
        let s = &self.settings;
        let name = s.connection.connection_name.as_deref();
        let supervisor = Supervisor::new(&self.url, name, &s.connection, "relay stopping")?;
        let (relay, shutdown) = (&self, &shutdown);
        let span = tracing::info_span!("outbox.relay", relay = %s.relay_id);
        supervisor
            .run(
                shutdown,
                |conn| async move {
                    let mut channels = Vec::with_capacity(s.rounds_in_flight);
                    for _ in 0..s.rounds_in_flight {
                        channels.push(confirm_channel(&conn).await?);
                    }
                    Ok(channels)
                },
                move |conn, channels, ends| async move {
                    relay.session(conn, channels, shutdown, &ends).await
                },
                || {
                    relay.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!(inbox_core::metrics::OUTBOX_RELAY_RECONNECTS_TOTAL)
                        .increment(1);
                },
            )
            .instrument(span)
            .await
    }

    /// Runs a blocking store call on tokio's blocking pool.
    async fn blocking<T, F>(&self, f: F) -> std::result::Result<T, SessionEnd>
    where
        F: FnOnce(&O) -> T + Send + 'static,
        T: Send + 'static,
    {
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|source| {
                SessionEnd::Fatal(Error::TaskFailed {
                    task: "relay store",
                    source,
                })
            })
    }

    /// A copy sharing the store and the counters, for a round of its own.
    fn lane(&self) -> Self {
        Self {
            url: self.url.clone(),
            store: Arc::clone(&self.store),
            settings: self.settings.clone(),
            stats: Arc::clone(&self.stats),
        }
    }

    /// Relay rounds on one connection until shutdown or the connection is lost: one
    /// lane of rounds per channel, all at once. When one lane ends (the connection
    /// or its channel lost, a fatal error), the others finish the round they are in
    /// and stop, and the session ends with the gravest lane's end, recorded in
    /// `ends` as each lane ends (it still counts when the session is given up on).
    async fn session(
        &self,
        conn: Arc<Connection>,
        channels: Vec<Channel>,
        shutdown: &CancellationToken,
        ends: &Ends,
    ) -> std::result::Result<(), SessionEnd> {
        let stop = shutdown.child_token();
        let mut lanes = JoinSet::new();
        for channel in channels {
            let (lane, conn, stop) = (self.lane(), Arc::clone(&conn), stop.clone());
            lanes.spawn(
                async move {
                    let end = lane.rounds(conn, channel, &stop).await;
                    stop.cancel();
                    end
                }
                .in_current_span(),
            );
        }
        while let Some(joined) = lanes.join_next().await {
            let end = joined.unwrap_or_else(|source| {
                Err(SessionEnd::Fatal(Error::TaskFailed {
                    task: "relay round",
                    source,
                }))
            });
            if let Err(end) = end {
                ends.record(end, |_| {});
            }
        }
        ends.take()
    }

    /// One lane's rounds on `channel` until `shutdown` or a loss.
    async fn rounds(
        &self,
        conn: Arc<Connection>,
        channel: Channel,
        shutdown: &CancellationToken,
    ) -> std::result::Result<(), SessionEnd> {
        let s = &self.settings;
        let round = RelayRound::new(s.relay_id.clone(), s.batch_size)
            .lease_for(s.lease_for)
            .failures(s.retry_after, s.max_attempts);
        let mut publisher = AmqpPublisher::new(conn, channel);
        let mut rounds: u64 = 0;
        // After a failed store call (a lease, a mark, a record of failures), the next
        // round waits a jittered pause whose ceiling doubles with each failure in a
        // row, from the connection's `backoff_min` to its `backoff_max`; a clean round
        // resets it. Relays of a restarted database then come back apart.
        let (min, max) = (s.connection.backoff_min, s.connection.backoff_max);
        let mut store_backoff = min;
        while !shutdown.is_cancelled() {
            rounds += 1;
            if rounds % 64 == 1 {
                if let Ok(Ok(age)) = self.blocking(|o| o.oldest_unpublished_age()).await {
                    metrics::gauge!(inbox_core::metrics::OUTBOX_OLDEST_UNPUBLISHED_SECONDS)
                        .set(age.map_or(0.0, |a| a.as_secs_f64()));
                }
            }
            // The round's store calls and its publishing run on a blocking thread: the
            // store is synchronous, and no database transaction spans the publishing.
            let round = round.clone();
            let span = tracing::debug_span!("outbox.relay.batch", relay = %s.relay_id);
            let (ran, back) = self
                .blocking(move |o| {
                    let _entered = span.enter();
                    let ran = round.run(o, &mut publisher);
                    (ran, publisher)
                })
                .await?;
            publisher = back;
            let report = match ran {
                Ok(report) => report,
                // A database outage is not the broker's: wait and lease again.
                Err(err) => {
                    tracing::error!(error = %ErrorChain(&err), "leasing failed");
                    crate::connect::pause(shutdown, &mut store_backoff, max).await;
                    continue;
                }
            };
            if report.leased == 0 {
                self.idle(shutdown).await;
                continue;
            }
            if self.account(&report, &publisher) {
                crate::connect::pause(shutdown, &mut store_backoff, max).await;
            } else {
                store_backoff = min;
            }
            if let Some(reason) = report.lost {
                return Err(SessionEnd::Lost(reason));
            }
        }
        Ok(())
    }

    /// Waits for an enqueue notification or the poll interval, or the shutdown.
    async fn idle(&self, shutdown: &CancellationToken) {
        let wait = self.settings.poll_interval;
        if self.settings.wake_on_notify {
            let woken = self.blocking(move |o| o.wait_for_enqueue(wait));
            tokio::select! {
                _ = woken => {}
                () = shutdown.cancelled() => {}
            }
        } else {
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = shutdown.cancelled() => {}
            }
        }
    }

    /// Counts, logs and measures what a non-empty round did; whether a store call of
    /// the round failed (marking or recording), which the caller backs off from.
    fn account(&self, report: &RoundReport, publisher: &AmqpPublisher) -> bool {
        let stats = &self.stats;
        stats.batches.fetch_add(1, Ordering::Relaxed);
        if report.expired {
            stats.expired_leases.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("lease expired before publishing");
            return false;
        }
        let (marked, confirmed) = (report.marked, report.confirmed);
        if let Some(err) = &report.mark_error {
            // The rows stay leased; when the lease expires they are published again
            // and the consumers' inboxes absorb the copies.
            tracing::error!(error = %ErrorChain(&err), "marking published rows failed");
        } else if marked < confirmed {
            tracing::warn!(
                marked,
                confirmed,
                "lease lost before marking; those rows will be published again"
            );
        }
        for failure in report
            .failures
            .iter()
            .filter(|f| f.fate == OutboxFate::Dead)
        {
            tracing::error!(row = failure.id, error = %failure.error, "outbox row is dead after its last attempt");
        }
        if let Some(err) = &report.record_error {
            // Unrecorded, the rows are simply leased again when the lease expires.
            tracing::error!(error = %ErrorChain(&err), "recording failed publications failed");
        }
        let (returned, nacked, rejected) = publisher.failure_kinds();
        // Rows the store could not read failed on their own too; rows left
        // unanswered are neither.
        let failed = report.failures.len() as u64;
        let settled = returned + nacked + rejected + report.unanswered as u64;
        let rejected = rejected + failed.saturating_sub(settled);
        let (retried, dead) = (report.retried() as u64, report.dead() as u64);
        stats.published.fetch_add(marked as u64, Ordering::Relaxed);
        stats.returned.fetch_add(returned, Ordering::Relaxed);
        stats.nacked.fetch_add(nacked, Ordering::Relaxed);
        stats.rejected.fetch_add(rejected, Ordering::Relaxed);
        stats.retried.fetch_add(retried, Ordering::Relaxed);
        stats.dead.fetch_add(dead, Ordering::Relaxed);
        metrics::counter!(inbox_core::metrics::OUTBOX_PUBLISHED_TOTAL).increment(marked as u64);
        metrics::counter!(inbox_core::metrics::OUTBOX_RETURNED_TOTAL).increment(returned);
        metrics::counter!(inbox_core::metrics::OUTBOX_NACKED_TOTAL).increment(nacked);
        metrics::counter!(inbox_core::metrics::OUTBOX_REJECTED_TOTAL).increment(rejected);
        metrics::counter!(inbox_core::metrics::OUTBOX_RETRIED_TOTAL).increment(retried);
        metrics::counter!(inbox_core::metrics::OUTBOX_DEAD_TOTAL).increment(dead);
        report.mark_error.is_some() || report.record_error.is_some()
    }
}

/// `relay-<host>-<pid>-<random>-<n>`: the host name tells an operator where a lease
/// came from, the random part keeps two processes apart when the host name does not
/// (containers copied from one image, each with pid 1), `n` two relays of a process.
fn default_relay_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    format!(
        "relay-{}-{}-{:016x}-{}",
        host_label(&host),
        std::process::id(),
        random_u64(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A host name as a short, printable label (`unknown-host` when there is none).
fn host_label(host: &str) -> String {
    let label: String = host
        .trim()
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '-' => c,
            _ => '_',
        })
        .take(64)
        .collect();
    if label.is_empty() {
        "unknown-host".to_owned()
    } else {
        label
    }
}

/// 64 random bits without a dependency: std's hasher keys are drawn from the
/// operating system's randomness once per process, and the clock's nanoseconds vary
/// them further.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    hasher.write_u128(nanos);
    hasher.finish()
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::connect::config_error;

    #[test]
    fn the_default_relay_id_names_the_host_and_differs_between_processes() {
        let id = RelaySettings::default().relay_id;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_default();
        let prefix = format!("relay-{}-{}-", host_label(&host), std::process::id());
        let rest = id
            .strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("{id:?} does not start with {prefix:?}"));
        // Two processes with the same host name and pid (containers of one image)
        // differ in the random part: every draw differs.
        let (random, _) = rest.split_once('-').expect("a random part, then n");
        assert_eq!(random.len(), 16, "{id:?}");
        let draws: std::collections::BTreeSet<u64> = (0..100).map(|_| random_u64()).collect();
        assert_eq!(draws.len(), 100);
        assert_eq!(host_label(" web 1\n"), "web_1");
        assert_eq!(host_label(""), "unknown-host");
        assert_eq!(host_label(&"h".repeat(300)).len(), 64);
    }

    #[test]
    fn settings_out_of_range_are_refused_by_name() {
        let refused = |settings: RelaySettings| config_error(settings.checked().map(|_| ()));
        let ms = Duration::from_millis;
        assert!(RelaySettings::default().check().is_ok());
        let setting = |settings| refused(settings).0;
        assert_eq!(setting(RelaySettings::default().lease(0, ms(10))), "lease");
        for rounds in [0, MAX_ROUNDS_IN_FLIGHT + 1] {
            assert_eq!(
                refused(RelaySettings::default().rounds_in_flight(rounds)),
                ("rounds_in_flight", rounds.to_string())
            );
        }
        for rounds in [1, DEFAULT_ROUNDS_IN_FLIGHT, MAX_ROUNDS_IN_FLIGHT] {
            assert!(RelaySettings::default()
                .rounds_in_flight(rounds)
                .check()
                .is_ok());
        }
        assert_eq!(setting(RelaySettings::default().relay_id("")), "relay_id");
        assert_eq!(
            setting(RelaySettings::default().lease(5, Duration::ZERO)),
            "lease"
        );
        assert_eq!(
            setting(RelaySettings::default().poll_interval(Duration::ZERO)),
            "poll_interval"
        );
        assert_eq!(
            setting(RelaySettings::default().retry_after(Duration::ZERO)),
            "retry_after"
        );
        assert_eq!(
            setting(RelaySettings::default().max_attempts(0)),
            "max_attempts"
        );
        assert_eq!(
            refused(RelaySettings::default().backoff(ms(9), ms(1))),
            ("backoff", "9ms..1ms".to_owned())
        );
        let no_wait = RelaySettings::default().connect_timeout(Duration::ZERO);
        assert_eq!(setting(no_wait), "connect_timeout");
    }

    #[test]
    fn leases_and_retries_past_a_year_are_refused_when_set() {
        let refused = |settings: RelaySettings| config_error(settings.checked().map(|_| ()));
        let year = inbox_core::MAX_RETRY_DELAY;
        let tiny = Duration::from_nanos(1);
        for ok in [tiny, Duration::from_millis(1), year] {
            assert!(
                RelaySettings::default().lease(1, ok).check().is_ok(),
                "{ok:?}"
            );
            assert!(
                RelaySettings::default().retry_after(ok).check().is_ok(),
                "{ok:?}"
            );
        }
        for long in [year + tiny, Duration::MAX] {
            assert_eq!(
                refused(RelaySettings::default().lease(1, long)),
                ("lease", format!("{long:?}"))
            );
            assert_eq!(
                refused(RelaySettings::default().retry_after(long)),
                ("retry_after", format!("{long:?}"))
            );
        }
        assert!(RelaySettings::default()
            .lease(usize::MAX, year)
            .max_attempts(u32::MAX)
            .poll_interval(Duration::MAX)
            .backoff(tiny, Duration::MAX)
            .connect_timeout(Duration::MAX)
            .check()
            .is_ok());
    }
}
