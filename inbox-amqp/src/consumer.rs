use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use inbox_core::display::Escaped;
use inbox_core::{
    check_decision_count, exponential_backoff, ClaimInvariantViolated, ConsumerGroup,
    DeadLetterOutcome, DeadLetterReason, Decision, ErrorChain, GroupHalts, InboxStore, Tally,
    TransportAction,
};

use crate::connect::{
    check_backoff, check_connect_timeout, close_channel, goodbye, pause, SessionEnd,
};
use crate::delivery::{self, Malformed};
use crate::frames::{warn_on_small_stack, FRAME_MAX};
use crate::publish::{publish_with_confirm, Confirmed};
use crate::stats::{ConsumerStats, Counter};
use crate::supervisor::Supervisor;
use crate::{Error, Result, Topology};

/// How a [`Consumer`] runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ConsumerSettings {
    /// Workers per consumer group, each with a channel of its own (default 2).
    pub workers: usize,
    /// Unacked deliveries the broker sends each worker (default 200; at least
    /// `batch_size`).
    pub prefetch: u16,
    /// Most deliveries handed to the store at once (default 100).
    pub batch_size: usize,
    /// Longest wait for a batch to fill once its first delivery arrived (default 10 ms).
    pub batch_wait: Duration,
    /// Largest body accepted (default 1 MiB; at least 1, else refused); a larger one is
    /// dead-lettered as malformed with only its first `inbox_core::CUT_PAYLOAD_PREFIX`
    /// bytes, its length and its SHA-256: the consumer never copies such a body. lapin
    /// assembles a whole body before handing it over, so what a worker holds is bounded
    /// by `prefetch` times the broker's `max_message_size`, not by this setting: set the
    /// broker's limit to match it (see the RabbitMQ guide).
    pub max_body_bytes: usize,
    /// First wait before reconnecting or after a store failure (default 100 ms).
    pub backoff_min: Duration,
    /// Longest such wait (default 5 s).
    pub backoff_max: Duration,
    /// The name of the consumer's connections, shown by `rabbitmqctl
    /// list_connections`: a group's workers' connection is `<name> (<group>)`, its
    /// dead-letter reader's `<name> (<group> dead letters)`.
    pub connection_name: Option<String>,
    /// Longest wait for a connection's AMQP handshake (default 30 s); a broker that
    /// accepts the connection and never answers is then tried again after backoff.
    pub connect_timeout: Duration,
    /// A PEM file of CA certificates trusted for an `amqps://` URL besides the
    /// system's roots (a broker with a private CA); read and checked once when the
    /// run starts (default none; see [`ca_cert_from_env`](crate::ca_cert_from_env)).
    pub ca_cert: Option<PathBuf>,
    /// How often the store's recorded halts are read (default 5 s): a halted group
    /// whose halt an operator lifted resumes within this, a group another consumer
    /// halted halts, and a halt the store failed to record is written again.
    pub halt_poll: Duration,
}

impl Default for ConsumerSettings {
    fn default() -> Self {
        Self {
            workers: 2,
            prefetch: 200,
            batch_size: 100,
            batch_wait: Duration::from_millis(10),
            max_body_bytes: 1 << 20,
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            connection_name: None,
            connect_timeout: Duration::from_secs(30),
            ca_cert: None,
            halt_poll: Duration::from_secs(5),
        }
    }
}

impl ConsumerSettings {
    /// Sets the workers per group.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }

    /// Sets the prefetch per worker.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n;
        self
    }

    /// Sets the batch size and the longest wait for a batch to fill.
    pub fn batch(mut self, size: usize, wait: Duration) -> Self {
        self.batch_size = size;
        self.batch_wait = wait;
        self
    }

    /// Sets the largest body accepted.
    pub fn max_body_bytes(mut self, n: usize) -> Self {
        self.max_body_bytes = n;
        self
    }

    /// Sets the reconnect and store-failure backoff.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff_min = min;
        self.backoff_max = max;
        self
    }

    /// Names the connections (see [`ConsumerSettings::connection_name`](Self#structfield.connection_name)).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// Sets the longest wait for a connection's AMQP handshake.
    pub fn connect_timeout(mut self, within: Duration) -> Self {
        self.connect_timeout = within;
        self
    }

    /// Trusts the CA certificates of the PEM file at `path` for `amqps://`, besides
    /// the system's roots. An unreadable file, one without a certificate, or a CA with
    /// a plain `amqp://` URL stops the run at its start with
    /// [`Error::InvalidSetting`] (`ca_cert`).
    pub fn ca_cert(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_cert = Some(path.into());
        self
    }

    /// Sets how often the store's recorded halts are read.
    pub fn halt_poll(mut self, every: Duration) -> Self {
        self.halt_poll = every;
        self
    }

    /// These settings, or [`Error::InvalidSetting`] naming the first one out of range; a
    /// consumer checks them again when it runs.
    pub fn checked(self) -> Result<Self> {
        self.check()?;
        Ok(self)
    }

    fn check(&self) -> Result<()> {
        if self.workers == 0 {
            return Err(Error::invalid("workers", "at least 1", 0));
        }
        if self.batch_size == 0 {
            return Err(Error::invalid("batch", "a batch size of at least 1", 0));
        }
        if self.max_body_bytes == 0 {
            // Every delivery would be over the limit and dead-lettered.
            return Err(Error::invalid("max_body_bytes", "at least 1 byte", 0));
        }
        if usize::from(self.prefetch) < self.batch_size {
            return Err(Error::invalid(
                "prefetch",
                "at least the batch size",
                format_args!("{} with a batch size of {}", self.prefetch, self.batch_size),
            ));
        }
        check_backoff(self.backoff_min, self.backoff_max)?;
        check_connect_timeout(self.connect_timeout)?;
        if self.halt_poll.is_zero() {
            return Err(Error::invalid(
                "halt_poll",
                "a poll interval above zero",
                "0ns",
            ));
        }
        Ok(())
    }
}

/// Consumes every consumer group of a store from RabbitMQ and carries out the store's
/// decisions.
///
/// Per group, `workers` tasks each own a channel: they batch deliveries, hand each
/// batch to the store on a blocking thread, and only then act: ack after commit (one
/// `multiple` ack when the whole batch may be acked, else one ack each), a retry
/// published with a confirm to its tier before the original is acked, nothing acked
/// after a store failure. A task per group reads the broker's dead-letter queue into
/// the store. Each group's workers and its dead-letter reader have a connection of
/// their own (see [`Consumer::run`]). A lost connection is re-established with
/// backoff and the topology declared again.
///
/// A `Stop` (a claim invariant violated) halts its consumer group only: the delivery
/// is left unacked, the group's workers and dead-letter reader stop consuming and hold
/// what they have, an error is logged, the gauge `inbox_group_halted{group}` is set to
/// 1, [`StatsSnapshot::halted`](crate::StatsSnapshot::halted) names the group, and the
/// halt is recorded in the store ([`GroupHalts::record_halt`]). The other groups keep
/// consuming. A halted group stays halted across reconnects and restarts: a consumer
/// starts a group halted while its halt is recorded. A halt the store fails to record
/// is logged and kept in memory (the group stays halted), and written again at every
/// poll.
///
/// Every [`halt_poll`](ConsumerSettings::halt_poll) the consumer reads the recorded
/// halts ([`GroupHalts::halted_groups`]). A group it halted whose halt is no longer
/// recorded (an operator resumed it, e.g. `inbox groups resume <group>`) resumes
/// without a restart: the held deliveries go back to the queue (they come back
/// flagged redelivered and are processed afresh), new workers and the dead-letter
/// reader start, the gauge goes back to 0 and `StatsSnapshot::halted` no longer names
/// it. A group whose halt another consumer recorded halts here too. The other groups
/// are never disturbed.
///
/// The store is any [`InboxStore`] that keeps halts ([`GroupHalts`]), e.g.
/// `inbox_diesel::Store`; it needs a broker:
///
/// ```no_run
/// use std::{sync::Arc, time::Duration};
/// use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings, Topology};
/// use inbox_core::{GroupHalts, InboxStore};
///
/// async fn consume<S: InboxStore + GroupHalts>(store: S) -> Result<(), inbox_amqp::Error> {
///     let topology = Topology::new("billing")?; // the groups come from the store's routes
///     let settings = ConsumerSettings::default()
///         .workers(2)
///         .batch(100, Duration::from_millis(10))
///         .checked()?;
///     let consumer = Consumer::new("amqp://guest:guest@127.0.0.1:5672/%2f", Arc::new(store), topology)
///         .with_settings(settings);
///     let stats = consumer.stats();
///     let shutdown = CancellationToken::new();
///     let stop = shutdown.clone();
///     tokio::spawn(async move {
///         tokio::time::sleep(Duration::from_secs(60)).await;
///         stop.cancel(); // drains: the batches in flight finish and are acked
///     });
///     consumer.run(shutdown).await?;
///     println!("processed {}", stats.snapshot().processed);
///     Ok(())
/// }
/// ```
pub struct Consumer<S> {
    url: String,
    shared: Arc<Shared<S>>,
}

struct Shared<S> {
    store: Arc<S>,
    topology: Topology,
    settings: ConsumerSettings,
    stats: Arc<ConsumerStats>,
    /// Per group, its current run (across sessions and both connections): replaced
    /// by a fresh one when the group resumes.
    halts: BTreeMap<ConsumerGroup, Mutex<Arc<Run>>>,
    /// Counts resumes: a session starts a resumed group's tasks when it changes.
    resumes: tokio::sync::watch::Sender<u64>,
}

/// One run of a group, from its start (or resume) to its resume after a halt.
#[derive(Default)]
struct Run {
    /// Cancelled when the group halts: its tasks stop consuming and hold what they
    /// have.
    halted: CancellationToken,
    /// Cancelled when the group resumes: its halted tasks let go of what they held.
    resumed: CancellationToken,
    /// Why the group halted.
    cause: OnceLock<ClaimInvariantViolated>,
    /// Whether the store has the halt recorded (a resume is only noticed then).
    recorded: AtomicBool,
}

/// The prefetch of a dead-letter queue's reader.
const DLQ_PREFETCH: u16 = 20;

/// Whether a connection's next session is cautious: its last one was lost to a frame
/// the client cannot parse. Such a frame kills the whole connection (lapin fails the
/// connection on any parse error), so every delivery in flight on it comes back with
/// its delivery count raised, and the poison is sent again at once. A cautious session
/// has one worker per group, prefetch 1 and batches of 1, so the poison travels alone
/// and each of its bounded tries (the queue's delivery limit) costs no other
/// delivery of its queue anything; once it has settled as many deliveries as a normal
/// worker prefetches without a loss, it ends and a normal session starts at once.
#[derive(Default)]
struct Caution(AtomicBool);

impl Caution {
    fn is_on(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Remembers how a session ended.
    fn after<T>(&self, end: &std::result::Result<T, SessionEnd>) {
        match end {
            Err(SessionEnd::Unreadable(_)) => self.0.store(true, Ordering::Relaxed),
            Err(SessionEnd::Relaxed) => self.0.store(false, Ordering::Relaxed),
            _ => {}
        }
    }
}

/// How a session's tasks read: normally, or cautiously (see [`Caution`]).
#[derive(Clone)]
struct Pace {
    prefetch: u16,
    batch_size: usize,
    /// A cautious session: how many settled deliveries end it, and how many were.
    relax: Option<(u64, Arc<AtomicU64>)>,
}

impl Pace {
    fn new(cautious: bool, prefetch: u16, batch_size: usize) -> Self {
        if cautious {
            Self {
                prefetch: 1,
                batch_size: 1,
                relax: Some((u64::from(prefetch), Arc::default())),
            }
        } else {
            Self {
                prefetch,
                batch_size,
                relax: None,
            }
        }
    }

    /// Counts `n` settled deliveries; [`SessionEnd::Relaxed`] once a cautious session
    /// has settled enough.
    fn settled(&self, n: usize) -> std::result::Result<(), SessionEnd> {
        if let Some((enough, settled)) = &self.relax {
            let total = settled.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
            if total >= *enough {
                return Err(SessionEnd::Relaxed);
            }
        }
        Ok(())
    }
}

/// What to do with one delivery once the store has decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Ack,
    /// Put back (requeue): comes back flagged redelivered.
    Requeue,
    /// Leave unacked: its retry copy is not confirmed yet, or its group halts.
    Hold,
}

/// Ends a consumer of `channel`: cancels it, holds its deliveries while its group is
/// halted, then closes the channel.
async fn stop_consuming(channel: &Channel, tag: &str, tokens: &Tokens, reason: &str) {
    goodbye(
        "consumer cancel",
        channel.basic_cancel(tag.into(), BasicCancelOptions::default()),
    )
    .await;
    tokens.hold_while_halted().await;
    close_channel(channel, reason).await;
}

/// A worker's backoffs: after a refused retry copy, and after a store failure.
struct Backoff<'a> {
    retry: &'a mut Duration,
    store: &'a mut Duration,
}

/// What the store made of a batch.
struct Stored {
    /// Per malformed delivery (its position), whether its dead letter was recorded.
    malformed_done: Vec<(usize, bool)>,
    /// The store's decisions, one per envelope.
    decided: inbox_core::Result<Vec<Decision>>,
    /// The envelopes read from the batch.
    envelopes: Vec<inbox_core::Envelope>,
    /// Each envelope's position in the batch.
    positions: Vec<usize>,
}

/// A retry to schedule: the delivery's position in its batch, the delay, the
/// message type.
type Retry = (usize, Duration, String);

/// What scheduling a batch's retries works on.
struct Retrying<'a> {
    deliveries: &'a [Delivery],
    actions: &'a mut [Action],
    /// The backoff after a refused retry copy.
    backoff: &'a mut Duration,
    stop: &'a CancellationToken,
    span: &'a tracing::Span,
}

impl<S: InboxStore + GroupHalts> Consumer<S> {
    /// A consumer of every route of `store`, through `topology` (whose groups are
    /// completed from the store's routes).
    pub fn new(url: impl Into<String>, store: Arc<S>, topology: Topology) -> Self {
        let topology = topology.with_routes(store.routes());
        let halts = topology
            .groups()
            .map(|g| (g.clone(), Mutex::default()))
            .collect();
        Self {
            url: url.into(),
            shared: Arc::new(Shared {
                store,
                topology,
                settings: ConsumerSettings::default(),
                stats: Arc::default(),
                halts,
                resumes: tokio::sync::watch::Sender::new(0),
            }),
        }
    }

    /// Replaces the settings.
    pub fn with_settings(mut self, settings: ConsumerSettings) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.settings = settings;
        }
        self
    }

    /// The live counters.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        Arc::clone(&self.shared.stats)
    }

    /// The topology it consumes.
    pub fn topology(&self) -> &Topology {
        &self.shared.topology
    }

    /// Runs until `shutdown` is cancelled (then drains: in-flight batches finish and
    /// are acked, channels and connections close). A group whose store reports a
    /// claim invariant violation halts; the others go on; a resumed group resumes (see
    /// [`Consumer`]).
    ///
    /// The recorded halts are read first (a group halted there starts halted; a store
    /// that cannot be read is [`Error::Store`]), then the first connection and the
    /// topology must succeed, so a misconfigured consumer fails at startup; later
    /// losses reconnect with backoff, and a failed read of the halts at a poll is
    /// logged and tried again at the next.
    ///
    /// Two connections per consumer group: one for its workers, one for its
    /// dead-letter queue's reader. A delivery the client cannot parse fails the whole
    /// connection it arrives on, and every other delivery in flight on that
    /// connection comes back with its delivery count raised; on connections of their
    /// own, a poison in one group's queue or `:dlq` costs no other group and no other
    /// queue anything. Each connection declares the exchange and its group's queues
    /// and reconnects on its own; a fatal end of any ends all. Each asks for frames
    /// of at most [`FRAME_MAX`] bytes; a warning is logged when `RUST_MIN_STACK` is
    /// below what parsing the deepest header table such a frame holds needs (see
    /// [`frame_parse_stack`](crate::frame_parse_stack)). A store with no routes
    /// holds one connection (declaring the exchange) until the shutdown.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let shared = &self.shared;
        shared.settings.check()?;
        warn_on_small_stack(std::env::var("RUST_MIN_STACK").ok().as_deref());
        // A restart does not resume a group whose halt is still recorded.
        shared.poll_halts().await?;
        let stop = shutdown.child_token();
        let mut connections = JoinSet::new();
        for group in shared.topology.groups() {
            for role in [Role::Workers, Role::DeadLetters] {
                let supervised = Arc::clone(shared).supervise(
                    self.url.clone(),
                    group.clone(),
                    role,
                    stop.clone(),
                );
                // Its log lines (losses, reconnects) and its workers' spans say
                // whose connection it is.
                let span = tracing::info_span!(
                    "inbox.amqp.connection",
                    group = %group,
                    dead_letters = role == Role::DeadLetters
                );
                connections.spawn(supervised.instrument(span));
            }
        }
        if connections.is_empty() {
            connections.spawn(Arc::clone(shared).idle(self.url.clone(), stop.clone()));
        }
        let polls = async {
            loop {
                tokio::select! {
                    biased;
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(shared.settings.halt_poll) => {}
                }
                if let Err(err) = shared.poll_halts().await {
                    tracing::warn!(error = %ErrorChain(&err), "reading the recorded halts failed; trying again at the next poll");
                }
            }
        };
        let joins = async {
            let mut ran = Ok(());
            while let Some(joined) = connections.join_next().await {
                let ended = joined.unwrap_or_else(|source| {
                    Err(Error::TaskFailed {
                        task: "consumer connection",
                        source,
                    })
                });
                // A connection's supervisor ends at the shutdown or fatally: either
                // way the others end too, and the first error is the consumer's.
                stop.cancel();
                if let (Err(err), true) = (ended, ran.is_ok()) {
                    ran = Err(err);
                }
            }
            ran
        };
        let (ran, ()) = tokio::join!(joins, polls);
        ran
    }
}

/// What a connection's sessions run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// A group queue's workers.
    Workers,
    /// A dead-letter queue's reader.
    DeadLetters,
}

impl Role {
    /// The connection's name, from the one the settings give: `<name> (<group>)`,
    /// `<name> (<group> dead letters)`.
    fn connection_name(self, name: &str, group: &ConsumerGroup) -> String {
        match self {
            Role::Workers => format!("{name} ({group})"),
            Role::DeadLetters => format!("{name} ({group} dead letters)"),
        }
    }

    /// What the connection says when it closes.
    fn goodbye(self) -> &'static str {
        match self {
            Role::Workers => "inbox consumer stopping",
            Role::DeadLetters => "inbox dead-letter reader stopping",
        }
    }
}

impl<S: InboxStore + GroupHalts> Shared<S> {
    /// Supervises `group`'s connection for `role` until `stop` is cancelled or it
    /// ends fatally: connect, declare the group's topology, run sessions, reconnect.
    /// Its caution is its own: a poison makes only this connection's next session
    /// cautious.
    async fn supervise(
        self: Arc<Self>,
        url: String,
        group: ConsumerGroup,
        role: Role,
        stop: CancellationToken,
    ) -> Result<()> {
        let name =
            (self.settings.connection_name.as_deref()).map(|n| role.connection_name(n, &group));
        let supervisor = self.supervisor(&url, name.as_deref(), role)?;
        let (shared, group, stop, caution) = (&self, &group, &stop, &Caution::default());
        supervisor
            .run(
                stop,
                move |conn| async move { shared.topology.declare_group(&conn, group).await },
                move |conn, ()| async move {
                    let end = shared.session(&conn, group, stop, caution, role).await;
                    caution.after(&end);
                    end
                },
                || shared.reconnected(),
            )
            .await
    }

    /// A supervisor of connections to `url` named `name`, for `role`.
    fn supervisor<'a>(
        &'a self,
        url: &'a str,
        name: Option<&'a str>,
        role: Role,
    ) -> Result<Supervisor<'a>> {
        let s = &self.settings;
        let backoff = (s.backoff_min, s.backoff_max);
        let supervisor = Supervisor::new(
            url,
            name,
            s.connect_timeout,
            backoff,
            role.goodbye(),
            s.ca_cert.as_deref(),
        )?;
        Ok(supervisor.frame_max(FRAME_MAX))
    }

    /// Counts a connection re-established after a loss.
    fn reconnected(&self) {
        self.stats.add(Counter::Reconnects, 1);
        metrics::counter!("inbox_amqp_reconnects_total").increment(1);
    }

    /// A consumer of no group still connects and declares (the exchange), so a
    /// misconfigured one fails at startup, then holds the connection until `stop`.
    async fn idle(self: Arc<Self>, url: String, stop: CancellationToken) -> Result<()> {
        let name = self.settings.connection_name.as_deref();
        let supervisor = self.supervisor(&url, name, Role::Workers)?;
        let (shared, stop) = (&self, &stop);
        supervisor
            .run(
                stop,
                move |conn| async move { shared.topology.declare(&conn).await },
                move |_, ()| async move {
                    stop.cancelled().await;
                    Ok(())
                },
                || shared.reconnected(),
            )
            .await
    }

    /// One connection's session: `group`'s workers or its dead-letter reader, each
    /// on a channel of its own, until one of them ends it.
    async fn session(
        self: &Arc<Self>,
        conn: &Connection,
        group: &ConsumerGroup,
        shutdown: &CancellationToken,
        caution: &Caution,
        role: Role,
    ) -> std::result::Result<(), SessionEnd> {
        let stop = shutdown.child_token();
        let cautious = caution.is_on();
        let pace = match role {
            Role::Workers => Pace::new(cautious, self.settings.prefetch, self.settings.batch_size),
            Role::DeadLetters => Pace::new(cautious, DLQ_PREFETCH, 1),
        };
        if cautious {
            tracing::info!(
                group = %group,
                dead_letters = role == Role::DeadLetters,
                "cautious session: one reader, prefetch 1, until {} deliveries are settled",
                pace.relax.as_ref().map_or(0, |(n, _)| *n)
            );
        }
        let workers = match role {
            Role::Workers if !cautious => self.settings.workers,
            _ => 1,
        };
        let mut tasks = JoinSet::new();
        // The run whose tasks this session started: once the group resumed (a new
        // run, not halted) it gets tasks of its own; while it is halted, none.
        let mut started: Option<Arc<Run>> = None;
        let mut resumes = self.resumes.subscribe();
        let mut outcome = Ok(());
        loop {
            if !stop.is_cancelled() {
                resumes.borrow_and_update();
                if let Some(run) = self.run_of(group) {
                    let fresh = started.as_ref().is_none_or(|r| !Arc::ptr_eq(r, &run));
                    if fresh && !self.stats.is_halted(group) && !run.halted.is_cancelled() {
                        started = Some(Arc::clone(&run));
                        let tokens = || Tokens {
                            stop: stop.clone(),
                            halt: Arc::clone(&run),
                        };
                        if role == Role::Workers {
                            metrics::gauge!("inbox_group_halted", "group" => group.to_string())
                                .set(0.0);
                        }
                        for worker in 0..workers {
                            let channel = match conn.create_channel().await {
                                Ok(channel) => channel,
                                Err(err) => {
                                    // The tasks started already finish their batch:
                                    // drained, never aborted.
                                    stop.cancel();
                                    if outcome.is_ok() {
                                        outcome = Err(err.into());
                                    }
                                    break;
                                }
                            };
                            let task = Arc::clone(self);
                            match role {
                                Role::DeadLetters => {
                                    let reader = task.dead_letter_reader(
                                        channel,
                                        group.clone(),
                                        tokens(),
                                        pace.clone(),
                                    );
                                    tasks.spawn(reader);
                                }
                                Role::Workers => {
                                    let span = tracing::info_span!(
                                        "inbox.amqp.worker",
                                        group = %group,
                                        worker
                                    );
                                    let worker =
                                        task.worker(channel, group.clone(), tokens(), pace.clone());
                                    tasks.spawn(worker.instrument(span));
                                }
                            }
                        }
                    }
                }
            }
            let joined = tokio::select! {
                joined = tasks.join_next(), if !tasks.is_empty() => joined,
                // Every group halted (or the session ends): hold the connection until
                // a group resumes or the session ends.
                () = stop.cancelled(), if tasks.is_empty() => return outcome,
                changed = resumes.changed(), if !stop.is_cancelled() => {
                    if changed.is_err() {
                        stop.cancel();
                    }
                    continue;
                }
            };
            let Some(joined) = joined else { continue };
            let ended = joined.unwrap_or_else(|err| {
                Err(SessionEnd::Fatal(Error::TaskFailed {
                    task: "consumer worker",
                    source: err,
                }))
            });
            if let Err(end) = ended {
                // One task's end ends the session: the others finish their batch. The
                // gravest end is the session's: fatal, then unreadable (the caution
                // it starts must not be lost to a relaxed or lost end).
                stop.cancel();
                let rank = |end: &SessionEnd| match end {
                    SessionEnd::Fatal(_) => 3,
                    SessionEnd::Unreadable(_) => 2,
                    SessionEnd::Lost(_) => 1,
                    SessionEnd::Relaxed => 0,
                };
                let graver = match &outcome {
                    Ok(()) => true,
                    Err(current) => rank(&end) > rank(current),
                };
                if graver {
                    outcome = Err(end);
                }
            }
        }
    }

    async fn worker(
        self: Arc<Self>,
        channel: Channel,
        group: ConsumerGroup,
        tokens: Tokens,
        pace: Pace,
    ) -> std::result::Result<(), SessionEnd> {
        let settings = &self.settings;
        let mut retry_backoff = settings.backoff_min;
        let mut store_backoff = settings.backoff_min;
        channel
            .basic_qos(pace.prefetch, BasicQosOptions::default())
            .await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let queue = self.topology.queue(&group);
        let tag = format!("inbox-{}-{}", group, channel.id());
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        loop {
            let first = tokio::select! {
                biased;
                () = tokens.stop.cancelled() => break,
                () = tokens.halt.halted.cancelled() => break,
                next = consumer.next() => next,
            };
            let mut batch = match first {
                Some(Ok(delivery)) => vec![delivery],
                Some(Err(err)) => return Err(err.into()),
                None => {
                    return Err(SessionEnd::Lost(format!(
                        "consumer of {queue} was cancelled"
                    )))
                }
            };
            let deadline = Instant::now() + settings.batch_wait;
            while batch.len() < pace.batch_size {
                tokio::select! {
                    biased;
                    next = consumer.next() => match next {
                        Some(Ok(delivery)) => batch.push(delivery),
                        Some(Err(err)) => return Err(err.into()),
                        None => break,
                    },
                    () = tokio::time::sleep_until(deadline) => break,
                }
            }
            let backoff = Backoff {
                retry: &mut retry_backoff,
                store: &mut store_backoff,
            };
            let size = batch.len();
            self.handle_batch(&channel, &group, batch, &tokens, backoff)
                .await?;
            if tokens.halt.halted.is_cancelled() {
                // What it holds stays held: never a relaxed end, which would close the
                // channel and hand the stopping delivery back.
                break;
            }
            pace.settled(size)?;
        }
        // No new deliveries; what was prefetched and not handled goes back to the
        // queue when the channel closes.
        stop_consuming(&channel, &tag, &tokens, "inbox worker stopping").await;
        Ok(())
    }

    /// The group's current run.
    fn run_of(&self, group: &ConsumerGroup) -> Option<Arc<Run>> {
        let cell = self.halts.get(group)?;
        Some(Arc::clone(
            &cell.lock().unwrap_or_else(PoisonError::into_inner),
        ))
    }

    /// Halts a consumer group's run (once): logged, counted, its tasks told, and the
    /// halt recorded in the store. A halt the store fails to record stays halted
    /// here, and the next poll writes it again.
    async fn halt_group(&self, group: &ConsumerGroup, cause: &ClaimInvariantViolated, run: &Run) {
        if run.resumed.is_cancelled() {
            // A batch of a run resumed since: its delivery, held, goes back to the
            // queue, and the current run stops on it again if the cause is not fixed.
            tracing::warn!(group = %group, cause = %Escaped(&cause.to_string()), "a stop of a run resumed since; its delivery goes back to the queue");
            return;
        }
        self.halt_run(
            group,
            cause,
            run,
            "halted; the other groups go on; fix the cause, then resume it (inbox groups resume)",
        );
        self.record_halt(group, cause, run).await;
    }

    /// Marks `run` halted for `cause` and tells its tasks.
    fn halt_run(
        &self,
        group: &ConsumerGroup,
        cause: &ClaimInvariantViolated,
        run: &Run,
        why: &str,
    ) {
        let _ = run.cause.set(cause.clone());
        if self.stats.halt(group, cause.to_string()) {
            tracing::error!(group = %group, cause = %Escaped(&cause.to_string()), "consumer group {why}");
            metrics::gauge!("inbox_group_halted", "group" => group.to_string()).set(1.0);
        }
        run.halted.cancel();
    }

    /// Writes `run`'s halt to the store; remembers whether it is recorded.
    async fn record_halt(&self, group: &ConsumerGroup, cause: &ClaimInvariantViolated, run: &Run) {
        let store = Arc::clone(&self.store);
        let c = cause.clone();
        match tokio::task::spawn_blocking(move || store.record_halt(&c)).await {
            Ok(Ok(())) => run.recorded.store(true, Ordering::SeqCst),
            Ok(Err(err)) => {
                tracing::error!(group = %group, error = %ErrorChain(&err), "recording the halt failed; the group stays halted and the halt is written again at the next poll");
            }
            Err(err) => {
                tracing::error!(group = %group, error = %err, "recording the halt failed; the group stays halted and the halt is written again at the next poll");
            }
        }
    }

    /// Reads the recorded halts and acts on them: a halt this consumer could not
    /// record is written again; a group recorded halted halts; a group this consumer
    /// halted, whose halt was recorded and is gone now, resumes.
    async fn poll_halts(&self) -> Result<()> {
        // Taken before the read: only a halt recorded before it can be found lifted.
        let before: Vec<(&ConsumerGroup, Arc<Run>, bool)> = self
            .halts
            .keys()
            .filter_map(|g| {
                let run = self.run_of(g)?;
                let recorded = run.halted.is_cancelled() && run.recorded.load(Ordering::SeqCst);
                Some((g, run, recorded))
            })
            .collect();
        for (group, run, recorded) in &before {
            if let (false, Some(cause)) = (*recorded, run.cause.get()) {
                self.record_halt(group, cause, run).await;
            }
        }
        let store = Arc::clone(&self.store);
        let halted = tokio::task::spawn_blocking(move || store.halted_groups())
            .await
            .map_err(|source| Error::TaskFailed {
                task: "store",
                source,
            })?
            .map_err(Error::Store)?;
        let halted: BTreeMap<&ConsumerGroup, &ClaimInvariantViolated> =
            halted.iter().map(|c| (&c.group, c)).collect();
        for (group, run, recorded) in before {
            match halted.get(group) {
                Some(cause) if !run.halted.is_cancelled() => {
                    run.recorded.store(true, Ordering::SeqCst);
                    self.halt_run(group, cause, &run, "halted: its halt is recorded; resume it once the cause is fixed (inbox groups resume)");
                }
                None if recorded => self.resume(group, &run),
                _ => {}
            }
        }
        Ok(())
    }

    /// Resumes a halted group: a fresh run replaces `run`, whose tasks let go of what
    /// they held (it goes back to the queue), and the sessions start the new run's
    /// tasks.
    fn resume(&self, group: &ConsumerGroup, run: &Arc<Run>) {
        let Some(cell) = self.halts.get(group) else {
            return;
        };
        {
            let mut current = cell.lock().unwrap_or_else(PoisonError::into_inner);
            if !Arc::ptr_eq(&current, run) {
                return;
            }
            *current = Arc::default();
        }
        self.stats.resume(group);
        metrics::gauge!("inbox_group_halted", "group" => group.to_string()).set(0.0);
        tracing::info!(group = %group, "consumer group resumed: its halt is no longer recorded");
        run.resumed.cancel();
        self.resumes.send_modify(|n| *n += 1);
    }

    /// Hands a batch to the store, then carries out its decisions: acks, retry
    /// copies confirmed before their originals are acked, a halt.
    async fn handle_batch(
        self: &Arc<Self>,
        channel: &Channel,
        group: &ConsumerGroup,
        deliveries: Vec<Delivery>,
        tokens: &Tokens,
        backoff: Backoff<'_>,
    ) -> std::result::Result<(), SessionEnd> {
        let stats = &self.stats;
        stats.add(Counter::Received, deliveries.len() as u64);
        stats.add(Counter::Batches, 1);
        let span =
            tracing::debug_span!("inbox.amqp.batch", group = %group, size = deliveries.len());
        let Some(stored) = self.store_batch(group, &deliveries, &span).await? else {
            // Past twice the store's deadline: nothing is acked, everything comes back
            // redelivered, and the worker goes on.
            stats.add(Counter::Requeued, deliveries.len() as u64);
            let actions = vec![Action::Requeue; deliveries.len()];
            self.settle(channel, &deliveries, &actions).await?;
            pause(&tokens.stop, backoff.store, self.settings.backoff_max).await;
            return Ok(());
        };
        let mut actions = vec![Action::Requeue; deliveries.len()];
        for (i, recorded) in stored.malformed_done {
            if recorded {
                stats.add(Counter::Malformed, 1);
                actions[i] = Action::Ack;
            }
        }
        let positions = &stored.positions;
        let decisions = match stored
            .decided
            .and_then(|d| check_decision_count(d, positions.len()))
        {
            Ok(decisions) => decisions,
            Err(err) => {
                // Nothing of the batch committed: everything comes back.
                tracing::error!(parent: &span, error = %Escaped(&ErrorChain(&err).to_string()), "store failed; requeueing the batch");
                let requeued = actions.iter().filter(|a| **a == Action::Requeue).count();
                stats.add(Counter::Requeued, requeued as u64);
                self.settle(channel, &deliveries, &actions).await?;
                // Not any delivery's fault: back off, longer each time, until the
                // store answers again.
                pause(&tokens.stop, backoff.store, self.settings.backoff_max).await;
                return Ok(());
            }
        };
        *backoff.store = self.settings.backoff_min;

        let (retries, halt) = self.carry_out(
            group,
            decisions,
            positions,
            &stored.envelopes,
            &mut actions,
            &span,
        );
        let retrying = Retrying {
            deliveries: &deliveries,
            actions: &mut actions,
            backoff: backoff.retry,
            stop: &tokens.stop,
            span: &span,
        };
        self.schedule_retries(channel, group, retries, retrying)
            .await?;
        self.settle(channel, &deliveries, &actions).await?;
        if let Some(cause) = halt {
            self.halt_group(group, &cause, &tokens.halt).await;
        }
        Ok(())
    }

    /// Carries out core's action for each decision: an ack counted, a retry held
    /// until its copy is confirmed (returned: position, delay, message type), a stop
    /// held (returned: the cause its group halts for).
    fn carry_out(
        &self,
        group: &ConsumerGroup,
        decisions: Vec<Decision>,
        positions: &[usize],
        envelopes: &[inbox_core::Envelope],
        actions: &mut [Action],
        span: &tracing::Span,
    ) -> (Vec<Retry>, Option<ClaimInvariantViolated>) {
        let mut halt = None;
        let mut retries = Vec::new();
        let envelopes = positions.iter().zip(envelopes);
        for (decision, (&i, envelope)) in decisions.into_iter().zip(envelopes) {
            actions[i] = match decision.action() {
                TransportAction::Ack(tally) => {
                    self.stats.record(tally);
                    Action::Ack
                }
                TransportAction::RetryThenAck(delay) => {
                    retries.push((i, delay, envelope.message_type.clone()));
                    Action::Hold
                }
                TransportAction::HoldAndStop(cause) => {
                    tracing::error!(parent: span, group = %group, key = %Escaped(envelope.message_key.as_str()), cause = %Escaped(&cause.to_string()), "delivery left unacked; its group halts");
                    // The first cause is the one recorded (and the one to fix).
                    halt.get_or_insert(cause);
                    Action::Hold
                }
            };
        }
        (retries, halt)
    }

    /// Reads the batch and hands it to the store on a blocking thread (the store is
    /// synchronous): malformed deliveries are dead-lettered, the others processed.
    /// `None` when the store took more than twice its batch deadline: its handler
    /// hangs and the database has ended its transaction by then, so the batch is
    /// abandoned (the blocking thread is left to finish on its own).
    async fn store_batch(
        self: &Arc<Self>,
        group: &ConsumerGroup,
        deliveries: &[Delivery],
        span: &tracing::Span,
    ) -> std::result::Result<Option<Stored>, SessionEnd> {
        let mut envelopes = Vec::with_capacity(deliveries.len());
        let mut positions = Vec::with_capacity(deliveries.len());
        let mut malformed: Vec<(usize, Box<Malformed>)> = Vec::new();
        for (i, d) in deliveries.iter().enumerate() {
            match delivery::read(d, self.settings.max_body_bytes) {
                Ok(envelope) => {
                    envelopes.push(envelope);
                    positions.push(i);
                }
                Err(m) => malformed.push((i, m)),
            }
        }
        let store = Arc::clone(&self.store);
        let g = group.clone();
        // The store's spans (its batch, each delivery) open inside this batch's span.
        let parent = span.clone();
        let task = tokio::task::spawn_blocking(move || {
            let _entered = parent.enter();
            let malformed_done: Vec<(usize, bool)> = malformed
                .into_iter()
                .map(|(i, m)| {
                    let recorded =
                        store.dead_letter(&g, &m.envelope, DeadLetterReason::Malformed, &m.reason);
                    if let Err(err) = &recorded {
                        tracing::error!(key = %Escaped(m.envelope.message_key.as_str()), error = %Escaped(&ErrorChain(&err).to_string()), "recording a malformed delivery failed");
                    }
                    (i, recorded.is_ok())
                })
                .collect();
            let decided = if envelopes.is_empty() {
                Ok(Vec::new())
            } else {
                store.process_batch(&g, &envelopes)
            };
            Stored {
                malformed_done,
                decided,
                envelopes,
                positions,
            }
        });
        let joined = match self.store.batch_deadline() {
            Some(deadline) => match tokio::time::timeout(deadline.saturating_mul(2), task).await {
                Ok(joined) => joined,
                Err(_) => {
                    tracing::error!(parent: span, group = %group, ?deadline, "batch abandoned past its deadline; requeueing it");
                    return Ok(None);
                }
            },
            None => task.await,
        };
        joined.map(Some).map_err(|source| {
            SessionEnd::Fatal(Error::TaskFailed {
                task: "store",
                source,
            })
        })
    }

    /// Publishes each retry copy with a confirm to its tier and acks its original
    /// only once the copy is confirmed; an original whose copy was refused is
    /// requeued after a pause.
    async fn schedule_retries(
        &self,
        channel: &Channel,
        group: &ConsumerGroup,
        retries: Vec<Retry>,
        r: Retrying<'_>,
    ) -> std::result::Result<(), SessionEnd> {
        if retries.is_empty() {
            return Ok(());
        }
        let mut pending = Vec::with_capacity(retries.len());
        for (i, delay, message_type) in retries {
            let d = &r.deliveries[i];
            // The copy comes back from its tier under the group queue's name as routing
            // key: the type must travel in the `type` property.
            let properties = d.properties.clone().with_type(message_type.as_str().into());
            let tier = self.topology.retry_ladder().tier_for(delay);
            let queue = self.topology.retry_queue(group, delay);
            let published = publish_with_confirm(channel, "", &queue, &d.data, properties).await;
            pending.push((i, tier, queue, published));
        }
        let mut unconfirmed = false;
        for (i, tier, queue, published) in pending {
            let confirmed = match published {
                Ok(pending) => matches!(pending.answer().await, Ok(Confirmed::Ack)),
                Err(err) => return Err(err.into()),
            };
            if confirmed {
                self.stats.record(Tally::Retried);
                self.stats.retried_to(tier);
                tracing::debug!(parent: r.span, %queue, "retry scheduled");
                r.actions[i] = Action::Ack;
            } else {
                tracing::warn!(parent: r.span, %queue, backoff = ?r.backoff, "retry copy not confirmed (a full tier refuses it); requeueing the original after a pause");
                self.stats.add(Counter::Requeued, 1);
                r.actions[i] = Action::Requeue;
                unconfirmed = true;
            }
        }
        if unconfirmed {
            // A full tier refuses copies until it drains: an original requeued at once
            // would come straight back, in a loop as fast as the broker answers.
            pause(r.stop, r.backoff, self.settings.backoff_max).await;
        } else {
            *r.backoff = self.settings.backoff_min;
        }
        Ok(())
    }

    /// Acks, requeues or holds each delivery. One `multiple` ack covers the batch only
    /// when every delivery in it may be acked; earlier batches of this channel are
    /// settled already, so it reaches no further.
    async fn settle(
        &self,
        channel: &Channel,
        deliveries: &[Delivery],
        actions: &[Action],
    ) -> std::result::Result<(), SessionEnd> {
        if let (Some(last), true) = (deliveries.last(), actions.iter().all(|a| *a == Action::Ack)) {
            channel
                .basic_ack(last.delivery_tag, BasicAckOptions { multiple: true })
                .await?;
            return Ok(());
        }
        for (d, action) in deliveries.iter().zip(actions) {
            match action {
                Action::Ack => {
                    channel
                        .basic_ack(d.delivery_tag, BasicAckOptions::default())
                        .await?
                }
                Action::Requeue => {
                    channel
                        .basic_nack(
                            d.delivery_tag,
                            BasicNackOptions {
                                multiple: false,
                                requeue: true,
                            },
                        )
                        .await?
                }
                Action::Hold => {}
            }
        }
        Ok(())
    }

    /// Reads the group's broker dead-letter queue (deliveries over the delivery limit)
    /// into the store: a dead letter, and the claim marked dead in the same transaction.
    async fn dead_letter_reader(
        self: Arc<Self>,
        channel: Channel,
        group: ConsumerGroup,
        tokens: Tokens,
        pace: Pace,
    ) -> std::result::Result<(), SessionEnd> {
        channel
            .basic_qos(pace.prefetch, BasicQosOptions::default())
            .await?;
        let queue = self.topology.dlq(&group);
        let tag = format!("inbox-dlq-{}-{}", group, channel.id());
        let mut consumer = channel
            .basic_consume(
                queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        loop {
            let next = tokio::select! {
                biased;
                () = tokens.stop.cancelled() => break,
                () = tokens.halt.halted.cancelled() => break,
                next = consumer.next() => next,
            };
            let d = match next {
                Some(Ok(d)) => d,
                Some(Err(err)) => return Err(err.into()),
                None => {
                    return Err(SessionEnd::Lost(format!(
                        "consumer of {queue} was cancelled"
                    )))
                }
            };
            let (envelope, reason, detail) = self.broker_dead_letter(&group, &d);
            // A store that cannot record it now keeps the message here, unacked: a
            // nack would requeue it into a queue with no dead-letter target of its
            // own, where a delivery limit drops it. The same delivery is tried again
            // with backoff until the store answers or the session ends (then the
            // broker returns it to the queue).
            let mut backoff = self.settings.backoff_min;
            let recorded = loop {
                let store = Arc::clone(&self.store);
                let (g, env, why) = (group.clone(), envelope.clone(), detail.clone());
                let outcome =
                    tokio::task::spawn_blocking(move || store.dead_letter(&g, &env, reason, &why))
                        .await
                        .map_err(|source| {
                            SessionEnd::Fatal(Error::TaskFailed {
                                task: "store",
                                source,
                            })
                        })?;
                match outcome {
                    Ok(outcome) => break Some(outcome),
                    Err(err) => {
                        tracing::error!(group = %group, key = %Escaped(envelope.message_key.as_str()), error = %Escaped(&ErrorChain(&err).to_string()), ?backoff, "recording a broker dead letter failed; keeping the message and trying again");
                        tokio::select! {
                            biased;
                            () = tokens.stop.cancelled() => break None,
                            () = tokens.halt.halted.cancelled() => break None,
                            () = tokio::time::sleep(backoff) => {}
                        }
                        backoff = exponential_backoff(backoff, 1, self.settings.backoff_max);
                    }
                }
            };
            let Some(outcome) = recorded else { break };
            if outcome == DeadLetterOutcome::Recorded {
                self.stats.add(Counter::DeliveryLimit, 1);
            }
            channel
                .basic_ack(d.delivery_tag, BasicAckOptions::default())
                .await?;
            pace.settled(1)?;
        }
        stop_consuming(&channel, &tag, &tokens, "inbox dead-letter reader stopping").await;
        Ok(())
    }

    /// What the store records of a delivery from the broker's dead-letter queue: its
    /// envelope (with the deliveries the broker counted), the reason and the detail.
    fn broker_dead_letter(
        &self,
        group: &ConsumerGroup,
        d: &Delivery,
    ) -> (inbox_core::Envelope, DeadLetterReason, String) {
        let table = d.properties.headers().as_ref();
        let headers = delivery::headers(table);
        let broker_reason = headers
            .get("x-first-death-reason")
            .map_or("unknown", String::as_str);
        // The same body limit as the workers': a body over it (one a client
        // published straight to the `:dlq`) is cut, never stored whole.
        match delivery::read(d, self.settings.max_body_bytes) {
            Ok(mut envelope) => {
                let group_queue = self.topology.queue(group);
                let limit = self.topology.group_delivery_limit();
                envelope.delivery_count = delivery::deliveries_at_limit(table, &group_queue, limit);
                let detail = match envelope.delivery_count {
                    Some(n) => format!(
                        "the broker dead-lettered the message ({broker_reason}) after {n} deliveries"
                    ),
                    None => format!("the broker dead-lettered the message ({broker_reason})"),
                };
                (envelope, DeadLetterReason::DeliveryLimit, detail)
            }
            Err(m) => (m.envelope, DeadLetterReason::Malformed, m.reason),
        }
    }
}

/// What a group's task listens to.
struct Tokens {
    /// The session ends (shutdown or a lost connection).
    stop: CancellationToken,
    /// The task's run of its group: it halts, and later resumes.
    halt: Arc<Run>,
}

impl Tokens {
    /// A halted group's task keeps its channel, and so its unacked deliveries, until
    /// the group resumes or the session ends.
    async fn hold_while_halted(&self) {
        if self.halt.halted.is_cancelled() {
            tokio::select! {
                () = self.stop.cancelled() => {}
                () = self.halt.resumed.cancelled() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connect::config_error;

    #[test]
    fn each_connection_is_named_after_its_group_and_role() {
        let group = ConsumerGroup::new("billing.daily-usage").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            Role::Workers.connection_name("usage_consumer", &group),
            "usage_consumer (billing.daily-usage)"
        );
        assert_eq!(
            Role::DeadLetters.connection_name("usage_consumer", &group),
            "usage_consumer (billing.daily-usage dead letters)"
        );
    }

    #[test]
    fn settings_out_of_range_are_refused_by_name() {
        let refused = |settings: ConsumerSettings| config_error(settings.checked().map(|_| ()));
        let ms = Duration::from_millis;
        assert!(ConsumerSettings::default().check().is_ok());
        let found = |setting: &'static str, found: &str| (setting, found.to_owned());
        assert_eq!(
            refused(ConsumerSettings::default().workers(0)),
            found("workers", "0")
        );
        assert_eq!(
            refused(ConsumerSettings::default().batch(0, ms(5))),
            found("batch", "0")
        );
        let thin = ConsumerSettings::default().prefetch(10).batch(20, ms(5));
        assert_eq!(
            refused(thin),
            found("prefetch", "10 with a batch size of 20")
        );
        let inverted = ConsumerSettings::default().backoff(ms(9), ms(1));
        assert_eq!(refused(inverted), found("backoff", "9ms..1ms"));
        let no_wait = ConsumerSettings::default().connect_timeout(Duration::ZERO);
        assert_eq!(refused(no_wait), found("connect_timeout", "0ns"));
        let no_poll = ConsumerSettings::default().halt_poll(Duration::ZERO);
        assert_eq!(refused(no_poll), found("halt_poll", "0ns"));
    }

    #[test]
    fn a_body_limit_of_zero_is_refused_and_any_other_taken() {
        let refused = |settings: ConsumerSettings| config_error(settings.checked().map(|_| ()));
        assert_eq!(
            refused(ConsumerSettings::default().max_body_bytes(0)),
            ("max_body_bytes", "0".to_owned())
        );
        for n in [1, usize::MAX] {
            assert!(ConsumerSettings::default()
                .max_body_bytes(n)
                .check()
                .is_ok());
        }
        let edges = ConsumerSettings::default()
            .workers(usize::MAX)
            .prefetch(u16::MAX)
            .batch(usize::from(u16::MAX), Duration::MAX)
            .backoff(Duration::from_nanos(1), Duration::MAX)
            .connect_timeout(Duration::MAX)
            .halt_poll(Duration::MAX);
        assert!(edges.check().is_ok());
    }
}
