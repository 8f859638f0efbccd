use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ErrorKind, PublisherConfirm};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use inbox_core::{OutboxFailure, OutboxFate, OutboxRow, OutboxStore, DEFAULT_OUTBOX_MAX_ATTEMPTS};

use crate::connect::{
    check_backoff, check_connect_timeout, close_connection, connect, pause, SessionEnd,
};
use crate::{Error, Result, TENANT_HEADER};

/// How a [`Relay`] runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RelaySettings {
    /// The relay's name, recorded as `leased_by` (default:
    /// `relay-<host>-<pid>-<random>-<n>`, unique across containers where every process
    /// is pid 1).
    pub relay_id: String,
    /// Most rows leased at once (default 500).
    pub batch_size: usize,
    /// How long a lease holds (default 30 s). A relay that dies leaves leases that
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
    /// doubled per attempt up to one minute (default 1 s).
    pub retry_after: Duration,
    /// Failed publications after which a row is dead: kept in the outbox, never
    /// leased again, listed by the store for an operator (default
    /// [`DEFAULT_OUTBOX_MAX_ATTEMPTS`], about a quarter of an hour of tries with the
    /// default delays).
    pub max_attempts: u32,
    /// First wait before reconnecting (default 100 ms).
    pub backoff_min: Duration,
    /// Longest wait before reconnecting (default 5 s).
    pub backoff_max: Duration,
    /// The connection's name, shown by `rabbitmqctl list_connections`.
    pub connection_name: Option<String>,
    /// Longest wait for a connection's AMQP handshake (default 30 s); a broker that
    /// accepts the connection and never answers is then tried again after backoff.
    pub connect_timeout: Duration,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            relay_id: default_relay_id(),
            batch_size: 500,
            lease_for: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            wake_on_notify: true,
            retry_after: Duration::from_secs(1),
            max_attempts: DEFAULT_OUTBOX_MAX_ATTEMPTS,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            connection_name: None,
            connect_timeout: Duration::from_secs(30),
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

    /// Sets the reconnect backoff.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff_min = min;
        self.backoff_max = max;
        self
    }

    /// Names the connection.
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// Sets the longest wait for a connection's AMQP handshake.
    pub fn connect_timeout(mut self, within: Duration) -> Self {
        self.connect_timeout = within;
        self
    }

    fn check(&self) -> Result<()> {
        if self.batch_size == 0 || self.relay_id.is_empty() {
            return Err(Error::Config(
                "a relay needs a non-empty id and a batch size of at least 1".to_owned(),
            ));
        }
        if self.lease_for.is_zero() || self.poll_interval.is_zero() || self.retry_after.is_zero() {
            return Err(Error::Config(
                "lease, poll interval and retry delay must be greater than zero".to_owned(),
            ));
        }
        if self.max_attempts == 0 {
            return Err(Error::Config(
                "max attempts must be at least 1, found 0".to_owned(),
            ));
        }
        check_backoff(self.backoff_min, self.backoff_max)?;
        check_connect_timeout(self.connect_timeout)?;
        Ok(())
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
    /// Rows the broker nacked.
    pub nacked: u64,
    /// Rows that failed on their own: the broker closed the channel over them (an
    /// exchange that does not exist, a body over its size limit), they cannot be
    /// encoded as AMQP, or the store could not read them.
    pub rejected: u64,
    /// Failed rows recorded for a later retry.
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
/// stops the rows around it: nacked or returned; a row the broker closes the channel
/// over (an exchange that does not exist, a body over `max_message_size`), found by
/// publishing the unconfirmed rows one at a time on a new channel, after which the
/// rest go on; a row that cannot be encoded as AMQP; a row the store cannot read.
/// Rows with the same ordering key are never leased while an earlier one is live,
/// so they reach the broker in commit order across any number of relays. No
/// database transaction is held across broker I/O. After a non-empty
/// round it leases again at once; when idle it waits for a NOTIFY or the poll
/// interval. At-least-once: a relay that dies between publishing and marking leaves
/// leases that expire, and the rows are published again (the consumer's inbox
/// absorbs the copy).
pub struct Relay<O> {
    url: String,
    store: Arc<O>,
    settings: RelaySettings,
    stats: Arc<RelayStats>,
}

impl<O: OutboxStore> Relay<O> {
    /// A relay of `store`'s outbox to the broker at `url`.
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
        let mut backoff = self.settings.backoff_min;
        let mut connected_before = false;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let connected = tokio::select! {
                c = self.connect() => c,
                () = shutdown.cancelled() => return Ok(()),
            };
            let (conn, channel) = match connected {
                Ok(pair) => pair,
                Err(err) if !connected_before => return Err(err),
                Err(err) => {
                    tracing::warn!(relay = %self.settings.relay_id, error = %err, "relay reconnect failed");
                    self.pause(&shutdown, &mut backoff).await;
                    continue;
                }
            };
            if connected_before {
                self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("outbox_relay_reconnects_total").increment(1);
            }
            connected_before = true;
            backoff = self.settings.backoff_min;
            let end = self.session(&conn, channel, &shutdown).await;
            close_connection(&conn, "relay stopping").await;
            match end {
                Ok(()) => return Ok(()),
                Err(SessionEnd::Fatal(err)) => return Err(err),
                Err(SessionEnd::Lost(reason)) => {
                    tracing::warn!(relay = %self.settings.relay_id, %reason, "relay connection lost");
                    self.pause(&shutdown, &mut backoff).await;
                }
            }
        }
    }

    async fn connect(&self) -> Result<(Connection, Channel)> {
        let s = &self.settings;
        let conn = connect(&self.url, s.connection_name.as_deref(), s.connect_timeout).await?;
        let channel = confirm_channel(&conn).await?;
        Ok((conn, channel))
    }

    async fn pause(&self, shutdown: &CancellationToken, backoff: &mut Duration) {
        pause(shutdown, backoff, self.settings.backoff_max).await;
    }

    /// Runs a blocking store call on tokio's blocking pool.
    async fn blocking<T, F>(&self, f: F) -> std::result::Result<T, SessionEnd>
    where
        F: FnOnce(&O) -> inbox_core::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let store = Arc::clone(&self.store);
        match tokio::task::spawn_blocking(move || f(&store)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => Err(SessionEnd::Fatal(Error::Store(err))),
            Err(err) => Err(SessionEnd::Fatal(Error::Config(format!(
                "relay store task failed: {err}"
            )))),
        }
    }

    async fn session(
        &self,
        conn: &Connection,
        mut channel: Channel,
        shutdown: &CancellationToken,
    ) -> std::result::Result<(), SessionEnd> {
        let s = &self.settings;
        let mut rounds: u64 = 0;
        while !shutdown.is_cancelled() {
            let (relay, limit, lease_for) = (s.relay_id.clone(), s.batch_size, s.lease_for);
            // A database outage is not the broker's: wait and lease again.
            let lease = match self
                .blocking(move |o| o.lease(&relay, limit, lease_for))
                .await
            {
                Ok(lease) => lease,
                Err(SessionEnd::Fatal(Error::Store(err))) => {
                    tracing::error!(relay = %s.relay_id, error = %err, "leasing failed");
                    tokio::time::sleep(s.backoff_min).await;
                    continue;
                }
                Err(end) => return Err(end),
            };
            rounds += 1;
            if rounds % 64 == 1 {
                if let Ok(age) = self.blocking(|o| o.oldest_unpublished_age()).await {
                    metrics::gauge!("outbox_oldest_unpublished_seconds")
                        .set(age.map_or(0.0, |a| a.as_secs_f64()));
                }
            }
            if lease.rows.is_empty() && lease.unreadable.is_empty() {
                let wait = s.poll_interval;
                if s.wake_on_notify {
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
                continue;
            }
            self.stats.batches.fetch_add(1, Ordering::Relaxed);
            let span = tracing::debug_span!("outbox.relay.batch", relay = %s.relay_id, size = lease.rows.len());
            let _entered = span.enter();
            // An expired lease may already be another relay's: publish nothing.
            if self.store.now() >= lease.until {
                self.stats.expired_leases.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(relay = %s.relay_id, "lease expired before publishing");
                continue;
            }
            // Confirms are awaited only while the lease holds: past it the rows may be
            // another relay's, and a broker that has not confirmed by then is treated
            // as lost (the rows are leased and published again).
            let left = (lease.until - self.store.now())
                .to_std()
                .unwrap_or_default();
            let mut round = publish(conn, &mut channel, &lease.rows, Instant::now() + left).await;
            for row in &lease.unreadable {
                round.failed.push(Failure {
                    id: row.id,
                    attempts: row.attempts,
                    error: row.error.clone(),
                    kind: FailureKind::Rejected,
                });
            }
            self.settle(round.published, round.failed).await?;
            if let Some(reason) = round.lost {
                return Err(SessionEnd::Lost(reason));
            }
        }
        Ok(())
    }

    /// Marks the confirmed rows published, then records every failure against its
    /// own row, in one store call each.
    async fn settle(
        &self,
        published: Vec<i64>,
        failed: Vec<Failure>,
    ) -> std::result::Result<(), SessionEnd> {
        let s = &self.settings;
        // Marked only after the broker confirmed: a relay that dies here leaves
        // the rows leased, and they are published again after the lease expires.
        let relay = s.relay_id.clone();
        let confirmed = published.len();
        let marked = match self
            .blocking(move |o| o.mark_published(&relay, &published))
            .await
        {
            Ok(marked) => marked,
            // The rows stay leased; when the lease expires they are published
            // again and the consumers' inboxes absorb the copies.
            Err(SessionEnd::Fatal(Error::Store(err))) => {
                tracing::error!(relay = %s.relay_id, error = %err, "marking published rows failed");
                tokio::time::sleep(s.backoff_min).await;
                0
            }
            Err(end) => return Err(end),
        };
        if marked < confirmed {
            tracing::warn!(relay = %s.relay_id, marked, confirmed, "lease lost before marking; those rows will be published again");
        }
        let count = |kind| failed.iter().filter(|f| f.kind == kind).count() as u64;
        let (returned, nacked, rejected) = (
            count(FailureKind::Returned),
            count(FailureKind::Nacked),
            count(FailureKind::Rejected),
        );
        let failures: Vec<OutboxFailure> = failed
            .into_iter()
            .map(|f| OutboxFailure {
                id: f.id,
                fate: OutboxFate::after(s.retry_after, f.attempts, s.max_attempts),
                error: f.error,
            })
            .collect();
        let dead = failures
            .iter()
            .filter(|f| f.fate == OutboxFate::Dead)
            .count() as u64;
        for failure in failures.iter().filter(|f| f.fate == OutboxFate::Dead) {
            tracing::error!(relay = %s.relay_id, row = failure.id, error = %failure.error, "outbox row is dead after its last attempt");
        }
        let retried = failures.len() as u64 - dead;
        if !failures.is_empty() {
            let relay = s.relay_id.clone();
            match self
                .blocking(move |o| o.record_failures(&relay, &failures))
                .await
            {
                Ok(()) => {}
                // Unrecorded, the rows are simply leased again when the lease expires.
                Err(SessionEnd::Fatal(Error::Store(err))) => {
                    tracing::error!(relay = %s.relay_id, error = %err, "recording failed publications failed");
                }
                Err(end) => return Err(end),
            }
        }
        self.stats
            .published
            .fetch_add(marked as u64, Ordering::Relaxed);
        self.stats.returned.fetch_add(returned, Ordering::Relaxed);
        self.stats.nacked.fetch_add(nacked, Ordering::Relaxed);
        self.stats.rejected.fetch_add(rejected, Ordering::Relaxed);
        self.stats.retried.fetch_add(retried, Ordering::Relaxed);
        self.stats.dead.fetch_add(dead, Ordering::Relaxed);
        metrics::counter!("outbox_published_total").increment(marked as u64);
        metrics::counter!("outbox_returned_total").increment(returned);
        metrics::counter!("outbox_nacked_total").increment(nacked);
        metrics::counter!("outbox_rejected_total").increment(rejected);
        metrics::counter!("outbox_retried_total").increment(retried);
        metrics::counter!("outbox_dead_total").increment(dead);
        Ok(())
    }
}

/// Why a row's publication failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FailureKind {
    /// The broker returned it as unroutable.
    Returned,
    /// The broker nacked it.
    Nacked,
    /// It failed on its own: the broker closed the channel over it, it cannot be
    /// encoded as AMQP, or the store could not read it.
    Rejected,
}

struct Failure {
    id: i64,
    attempts: i32,
    error: String,
    kind: FailureKind,
}

impl Failure {
    fn of(row: &OutboxRow, error: String, kind: FailureKind) -> Self {
        Self {
            id: row.id,
            attempts: row.attempts,
            error,
            kind,
        }
    }
}

/// What a publishing round settled.
#[derive(Default)]
struct Round {
    /// Confirmed rows.
    published: Vec<i64>,
    /// Rows that failed on their own.
    failed: Vec<Failure>,
    /// Why the round stopped before settling every row (the connection was lost, or
    /// the lease ran out); the unsettled rows stay leased and are taken again.
    lost: Option<String>,
}

/// A channel in confirm mode.
async fn confirm_channel(conn: &Connection) -> lapin::Result<Channel> {
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

fn properties(row: &OutboxRow) -> BasicProperties {
    let msg = &row.message;
    let mut headers = FieldTable::default();
    for (k, v) in &msg.headers {
        headers.insert(
            k.as_str().into(),
            AMQPValue::LongString(LongString::from(v.as_str())),
        );
    }
    if let Some(tenant) = &msg.tenant {
        headers.insert(
            TENANT_HEADER.into(),
            AMQPValue::LongString(LongString::from(tenant.as_str())),
        );
    }
    BasicProperties::default()
        .with_message_id(msg.message_key.as_str().into())
        .with_type(msg.message_type.as_str().into())
        .with_delivery_mode(2)
        .with_headers(headers)
}

/// Why a row cannot go out as AMQP: names the protocol carries as short strings (at
/// most 255 bytes). `enqueue` refuses such rows; another producer may write them.
fn unencodable(row: &OutboxRow) -> Option<String> {
    const SHORT: usize = 255;
    let msg = &row.message;
    let fields = [
        ("exchange", msg.exchange.as_str()),
        ("routing key", msg.routing_key.as_str()),
        ("message type", msg.message_type.as_str()),
        ("message key", msg.message_key.as_str()),
    ];
    let names = msg.headers.keys().map(|k| ("header name", k.as_str()));
    fields
        .into_iter()
        .chain(names)
        .find(|(_, v)| v.len() > SHORT)
        .map(|(what, v)| {
            format!(
                "cannot be encoded as AMQP: {what} must be at most {SHORT} bytes, found {} bytes",
                v.len()
            )
        })
}

/// How one row's publication ended.
enum Settled {
    Published,
    Failed(Failure),
}

fn settled(row: &OutboxRow, confirmation: Confirmation) -> Settled {
    if confirmation.is_nack() {
        Settled::Failed(Failure::of(
            row,
            "nacked by the broker".to_owned(),
            FailureKind::Nacked,
        ))
    } else if confirmation.take_message().is_some() {
        let msg = &row.message;
        Settled::Failed(Failure::of(
            row,
            format!(
                "unroutable: exchange {:?} has no queue bound for routing key {:?}",
                msg.exchange, msg.routing_key
            ),
            FailureKind::Returned,
        ))
    } else {
        Settled::Published
    }
}

async fn basic_publish(channel: &Channel, row: &OutboxRow) -> lapin::Result<PublisherConfirm> {
    channel
        .basic_publish(
            row.message.exchange.as_str().into(),
            row.message.routing_key.as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &row.message.payload,
            properties(row),
        )
        .await
}

/// Whether a failed publication is the row's own doing: the broker closed the
/// channel over it (a soft error: 404 no such exchange, 406 over the size limit, 403
/// access refused), or it could not be encoded.
fn is_the_rows_fault(err: &lapin::Error) -> bool {
    err.is_amqp_soft_error() || matches!(err.kind(), ErrorKind::SerialisationError(_))
}

const LEASE_RAN_OUT: &str = "no publisher confirms before the lease expired";

/// Publishes the leased rows with confirms until `deadline`, each row's failure
/// recorded against that row, never stopping the others.
///
/// The rows are published in id order on one channel, then every confirm is awaited.
/// When the broker closes the channel over one row, it drops the rows after it and
/// the confirms still owed for the rows before it: which row it was is not said.
/// The unconfirmed rows are then published one at a time on a new channel until one
/// closes it again (that one is the poison, and is recorded), and the rest go on as
/// before. Each such pass blames one row or settles every row, so a round ends.
async fn publish(
    conn: &Connection,
    channel: &mut Channel,
    rows: &[OutboxRow],
    deadline: Instant,
) -> Round {
    let mut round = Round::default();
    let mut todo: Vec<&OutboxRow> = Vec::with_capacity(rows.len());
    for row in rows {
        match unencodable(row) {
            Some(error) => round
                .failed
                .push(Failure::of(row, error, FailureKind::Rejected)),
            None => todo.push(row),
        }
    }
    while !todo.is_empty() {
        let unsettled = match publish_pipelined(channel, &todo, deadline, &mut round).await {
            Ok(unsettled) => unsettled,
            Err(reason) => {
                round.lost = Some(reason);
                return round;
            }
        };
        if unsettled.is_empty() {
            break;
        }
        // A connection that is gone blames nobody: reconnect and lease again.
        if !conn.status().connected() {
            round.lost = Some("the connection closed while publishing".to_owned());
            return round;
        }
        let mut rest = unsettled.into_iter();
        for row in rest.by_ref() {
            match publish_alone(conn, channel, row, deadline).await {
                Ok(Settled::Published) => round.published.push(row.id),
                Ok(Settled::Failed(failure)) => {
                    let poison = failure.kind == FailureKind::Rejected;
                    round.failed.push(failure);
                    // Found: the rows after it go on together again.
                    if poison {
                        break;
                    }
                }
                Err(reason) => {
                    round.lost = Some(reason);
                    return round;
                }
            }
        }
        todo = rest.collect();
    }
    round
}

/// Publishes `rows` on one channel and awaits every confirm; settles what the broker
/// answered into `round` and returns the rows it did not (the channel closed), in
/// order. `Err` when the lease ran out or the connection is gone.
async fn publish_pipelined<'r>(
    channel: &Channel,
    rows: &[&'r OutboxRow],
    deadline: Instant,
    round: &mut Round,
) -> std::result::Result<Vec<&'r OutboxRow>, String> {
    let mut pending = Vec::with_capacity(rows.len());
    let mut unsent = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        match basic_publish(channel, row).await {
            Ok(confirm) => pending.push((*row, confirm)),
            Err(_) => {
                // The channel is closing or closed; the confirms below say why.
                unsent = rows[i..].to_vec();
                break;
            }
        }
    }
    let mut unsettled = Vec::new();
    for (row, confirm) in pending {
        match tokio::time::timeout_at(deadline, confirm).await {
            Err(_) => return Err(LEASE_RAN_OUT.to_owned()),
            Ok(Ok(confirmation)) => match settled(row, confirmation) {
                Settled::Published => round.published.push(row.id),
                Settled::Failed(failure) => round.failed.push(failure),
            },
            Ok(Err(_)) => unsettled.push(row),
        }
    }
    unsettled.extend(unsent);
    Ok(unsettled)
}

/// Publishes one row alone, on a new channel if the last one was closed, and awaits
/// its confirm. A [`FailureKind::Rejected`] failure when the broker closed the
/// channel over it (it was the only row in flight); `Err` when the lease ran out or
/// the connection is gone.
async fn publish_alone(
    conn: &Connection,
    channel: &mut Channel,
    row: &OutboxRow,
    deadline: Instant,
) -> std::result::Result<Settled, String> {
    if !channel.status().connected() {
        match tokio::time::timeout_at(deadline, confirm_channel(conn)).await {
            Err(_) => return Err(LEASE_RAN_OUT.to_owned()),
            Ok(Err(err)) => return Err(format!("reopening the channel failed: {err}")),
            Ok(Ok(fresh)) => *channel = fresh,
        }
    }
    let published = match basic_publish(channel, row).await {
        Ok(confirm) => match tokio::time::timeout_at(deadline, confirm).await {
            Err(_) => return Err(LEASE_RAN_OUT.to_owned()),
            Ok(confirmed) => confirmed,
        },
        Err(err) => Err(err),
    };
    match published {
        Ok(confirmation) => Ok(settled(row, confirmation)),
        Err(err) if is_the_rows_fault(&err) && conn.status().connected() => {
            Ok(Settled::Failed(Failure::of(
                row,
                format!("the broker refused it and closed the channel: {err}"),
                FailureKind::Rejected,
            )))
        }
        Err(err) => Err(format!("publishing failed: {err}")),
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
        let refused = |settings: RelaySettings| config_error(settings.check());
        let ms = Duration::from_millis;
        assert!(RelaySettings::default().check().is_ok());
        assert!(refused(RelaySettings::default().lease(0, ms(10))).contains("batch size"));
        assert!(refused(RelaySettings::default().relay_id("")).contains("non-empty id"));
        assert!(refused(RelaySettings::default().lease(5, Duration::ZERO)).contains("lease"));
        assert!(refused(RelaySettings::default().max_attempts(0)).contains("max attempts"));
        assert!(refused(RelaySettings::default().backoff(ms(9), ms(1))).contains("backoff"));
        let no_wait = RelaySettings::default().connect_timeout(Duration::ZERO);
        assert!(refused(no_wait).contains("connect timeout"));
    }
}
