use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use inbox_core::display::Escaped;
use inbox_core::{
    check_decision_count, ClaimInvariantViolated, ConsumerGroup, DeadLetterOutcome,
    DeadLetterReason, Decision, ErrorChain, GroupHalts, InboxStore, Tally, TransportAction,
};

use crate::connect::{close_channel, goodbye, next_pause, pause, wait_out, Ends, SessionEnd};
use crate::delivery::{self, Malformed};
use crate::frames::{warn_on_small_stack, FRAME_MAX};
use crate::publish::{Confirmed, InFlight};
use crate::stats::{ConsumerStats, Counter};
use crate::supervisor::Supervisor;
use crate::{Error, Result, Topology};

mod batch;
mod copies;
mod dead_letters;
mod halts;
mod pacing;
mod session;
mod settings;

use batch::*;
use copies::Copies;
use dead_letters::*;
use pacing::*;
use session::*;
pub use settings::ConsumerSettings;

/// Consumes every consumer group of a store from RabbitMQ and carries out the store's
/// decisions.
///
/// Per group, `workers` tasks each own a channel: they batch deliveries, hand each
/// batch to the store on a blocking thread, and only then act: ack after commit (one
/// `multiple` ack when the whole batch may be acked, else one ack each), a retry
/// published with a confirm to its tier before the original is acked (on a second
/// channel of the worker's, replaced after a copy is refused), nothing acked after a
/// store failure. A task per group reads the broker's dead-letter queue into
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
///         .batch(100, Duration::ZERO) // what has arrived, up to 100; no linger
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

impl<S: InboxStore + GroupHalts> Consumer<S> {
    /// A consumer of every route of `store`, through `topology` (whose groups are
    /// completed from the store's routes), from the broker at `url`: one URL, or the
    /// nodes of a cluster as several separated by whitespace or commas, tried in turn
    /// by each connection (see [`BrokerUrls`](crate::BrokerUrls)).
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

    /// Declares its topology once, on a connection of its own closed after (what
    /// [`serve`](crate::serve) does before the relay starts), with the settings'
    /// connect timeout, name and CA; `Ok` at once when `shutdown` is cancelled first.
    /// A declaration answered as a queue without a leader answers (`541`, see
    /// `election`) is tried again after the reconnect backoff, as the consumer's own
    /// declaration is, for as long as it takes, each try starting at the next broker
    /// URL of the list (a node on the minority side of a partition answers so for as
    /// long as the partition lasts).
    pub(crate) async fn declare_topology(&self, shutdown: &CancellationToken) -> Result<()> {
        let settings = &self.shared.settings;
        settings.check()?;
        let c = &settings.connection;
        let name = c.connection_name.as_deref();
        let (within, ca) = (c.connect_timeout, c.ca_cert.as_deref());
        let urls = crate::BrokerUrls::items(&self.url);
        let tries = std::sync::atomic::AtomicUsize::new(0);
        let declare = || {
            let mut list = urls.clone();
            let tried = tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let first = tried % list.len().max(1);
            list.rotate_left(first);
            let list = list.join(" ");
            async move {
                let conn =
                    crate::connect::open_first(&list, name, within, Some(FRAME_MAX), ca).await?;
                let declaring = self.shared.topology.declare(&conn);
                let declared =
                    crate::connect::while_connected(&conn, declaring, |why| Error::Unanswered {
                        url: inbox_core::redact_url(&self.url),
                        why,
                    })
                    .await;
                crate::connect::goodbye("close", conn.close(200, "topology declared".into())).await;
                declared
            }
        };
        let pauses = (c.backoff_min, c.backoff_max);
        crate::election::declare_once_led(shutdown, pauses, declare).await
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
        let name = (self.settings.connection.connection_name.as_deref())
            .map(|n| role.connection_name(n, &group));
        let supervisor = self.supervisor(&url, name.as_deref(), role)?;
        let (shared, group, stop, caution) = (&self, &group, &stop, &Caution::default());
        supervisor
            .run(
                stop,
                move |conn| async move { shared.topology.declare_group(&conn, group).await },
                move |conn, (), ends| async move {
                    shared
                        .session(&conn, group, stop, caution, &ends, role)
                        .await
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
        let connection = &self.settings.connection;
        let supervisor = Supervisor::new(url, name, connection, role.goodbye())?;
        Ok(supervisor.frame_max(FRAME_MAX))
    }

    /// Counts a connection re-established after a loss.
    fn reconnected(&self) {
        self.stats.add(Counter::Reconnects, 1);
        metrics::counter!(inbox_core::metrics::AMQP_RECONNECTS_TOTAL).increment(1);
    }

    /// A consumer of no group still connects and declares (the exchange), so a
    /// misconfigured one fails at startup, then holds the connection until `stop`.
    async fn idle(self: Arc<Self>, url: String, stop: CancellationToken) -> Result<()> {
        let name = self.settings.connection.connection_name.as_deref();
        let supervisor = self.supervisor(&url, name, Role::Workers)?;
        let (shared, stop) = (&self, &stop);
        supervisor
            .run(
                stop,
                move |conn| async move { shared.topology.declare(&conn).await },
                move |_, (), _| async move {
                    stop.cancelled().await;
                    Ok(())
                },
                || shared.reconnected(),
            )
            .await
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
