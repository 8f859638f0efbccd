//! The one connection supervisor of the consumer and the relay: connect with a
//! bounded handshake, declare what the session needs, run the session, close the
//! connection politely, back off and reconnect until shutdown, moving through the
//! broker URLs of the setting (see [`crate::brokers`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::display::Escaped;
use inbox_core::{redact_url, ErrorChain};
use lapin::Connection;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::brokers::BrokerUrls;
use crate::connect::{close_connection, full_jitter, open, pause, while_connected};
use crate::connect::{Ends, SessionEnd};
use crate::connection::ConnectionSettings;
use crate::election::awaits_election;
use crate::tls::Tls;
use crate::{Error, Result};

/// How a supervisor connects and backs off.
pub(crate) struct Supervisor<'a> {
    /// The broker URLs, tried in turn.
    urls: BrokerUrls,
    /// The connection's name.
    name: Option<&'a str>,
    /// Longest wait for the AMQP handshake.
    connect_timeout: Duration,
    /// First wait before reconnecting.
    backoff_min: Duration,
    /// Longest wait before reconnecting.
    backoff_max: Duration,
    /// The text of the connection's close.
    goodbye: &'a str,
    /// The largest frame asked for, if capped.
    frame_max: Option<u32>,
    /// How `amqps://` is done, for each URL.
    tls: Vec<Tls>,
}

impl<'a> Supervisor<'a> {
    /// A supervisor of connections to the brokers of `urls` (one URL or a list,
    /// see [`BrokerUrls::parse`]) named `name`, each handshake given
    /// `connect_timeout`, reconnecting after `backoff` (min, max), closing with
    /// `goodbye`, trusting `ca_cert` for `amqps://` besides the system's roots;
    /// refused when the timeout or the backoff is out of range, when the list is
    /// not one, or when a URL and `ca_cert` cannot make a connection (see
    /// [`Tls::for_url`]).
    pub(crate) fn new(
        urls: &str,
        name: Option<&'a str>,
        settings: &ConnectionSettings,
        goodbye: &'a str,
    ) -> Result<Self> {
        settings.check()?;
        let urls = BrokerUrls::parse(urls)?;
        let tls = (urls.iter())
            .map(|url| Tls::for_url(url, settings.ca_cert.as_deref()))
            .collect::<Result<_>>()?;
        Ok(Self {
            tls,
            urls,
            name,
            connect_timeout: settings.connect_timeout,
            backoff_min: settings.backoff_min,
            backoff_max: settings.backoff_max,
            goodbye,
            frame_max: None,
        })
    }

    /// Asks the broker for frames of at most `frame_max` bytes (lower when the URL
    /// asks for less).
    pub(crate) fn frame_max(mut self, frame_max: u32) -> Self {
        self.frame_max = Some(frame_max);
        self
    }

    /// Runs sessions until `shutdown` is cancelled or one ends fatally.
    ///
    /// Each connection is first given to `declare` (the topology, a confirm
    /// channel); its result goes to `session`. The first connection and declaration
    /// must succeed, so a misconfigured program fails at startup; a
    /// [`Error::TopologyConflict`] is fatal at any time; later losses reconnect
    /// after a pause drawn with full jitter under a ceiling that doubles up to
    /// `backoff_max` and is back to `backoff_min` only after a session that held for
    /// `backoff_max` (a connection that dies at once must not reconnect in a hot
    /// loop, and clients that lost one broker together must not come back
    /// together). A connection lost to a frame the client cannot parse
    /// ([`SessionEnd::Unreadable`]) reconnects after a random pause of at most
    /// `backoff_min`: the broker is healthy and the poison's deliveries are bounded by
    /// its queue's delivery limit. A [`SessionEnd::Relaxed`] session reconnects at
    /// once. `reconnected` is called on every connection after the first.
    ///
    /// The connection is watched while it declares and while its session runs (see
    /// [`while_connected`]): once it has not been connected for 2 s, the declaration
    /// ([`Error::Unanswered`]) or the session ([`SessionEnd::Lost`]) is given up on.
    /// A session given up on ends as the gravest of that loss and the ends its tasks
    /// recorded in the [`Ends`] it is given (a task's fatal end stays fatal, an
    /// unreadable frame stays unreadable).
    ///
    /// A declaration answered that a quorum queue has no leader yet (an election, see
    /// [`crate::election`]) is not fatal, even the first: it is tried again after
    /// the backoff, on the next URL.
    ///
    /// With several URLs, the first connection tries each in turn until one
    /// connects (the last one's error when none does); after that, a failed
    /// connection, a failed declaration or a lost session moves to the next URL
    /// (round the list) before its pause.
    pub(crate) async fn run<T, D, DF, S, SF>(
        &self,
        shutdown: &CancellationToken,
        mut declare: D,
        mut session: S,
        mut reconnected: impl FnMut(),
    ) -> Result<()>
    where
        D: FnMut(Arc<Connection>) -> DF,
        DF: Future<Output = Result<T>>,
        S: FnMut(Arc<Connection>, T, Arc<Ends>) -> SF,
        SF: Future<Output = std::result::Result<(), SessionEnd>>,
    {
        let mut backoff = self.backoff_min;
        let mut connected_before = false;
        // The URL tried next, counting round the list.
        let mut at = 0;
        let many = self.urls.len() > 1;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let (url, tls) = (self.urls.get(at), &self.tls[at % self.tls.len()]);
            let connected = tokio::select! {
                c = open(url, self.name, self.connect_timeout, self.frame_max, tls) => c,
                () = shutdown.cancelled() => return Ok(()),
            };
            let conn = match connected {
                Ok(conn) => Arc::new(conn),
                Err(err) if !connected_before && at + 1 < self.urls.len() => {
                    tracing::warn!(error = %ErrorChain(&err), "connecting failed; trying the next broker URL");
                    at += 1;
                    continue;
                }
                Err(err) if !connected_before => return Err(err),
                Err(err) => {
                    at += 1;
                    tracing::warn!(error = %ErrorChain(&err), ?backoff, "reconnect failed");
                    pause(shutdown, &mut backoff, self.backoff_max).await;
                    continue;
                }
            };
            if many {
                tracing::debug!(url = %redact_url(url), "connected");
            }
            // A connection that fails with a declaration lapin never returns is
            // given up on (see `while_connected`); a broker that stops answering
            // fails the connection by its heartbeats.
            let unanswered = |why| Error::Unanswered {
                url: redact_url(url),
                why,
            };
            let declaring = declare(Arc::clone(&conn));
            let declared = match while_connected(&conn, declaring, unanswered).await {
                Ok(declared) => declared,
                Err(err) => {
                    let electing = awaits_election(&err);
                    if (!connected_before && !electing)
                        || matches!(err, Error::TopologyConflict { .. })
                    {
                        return Err(err);
                    }
                    at += 1;
                    if electing {
                        tracing::warn!(error = %ErrorChain(&err), ?backoff, "a quorum queue has no leader yet (an election); waiting");
                    } else {
                        tracing::warn!(error = %ErrorChain(&err), "declaring failed; reconnecting");
                    }
                    pause(shutdown, &mut backoff, self.backoff_max).await;
                    continue;
                }
            };
            if connected_before {
                reconnected();
                tracing::info!("reconnected");
            }
            connected_before = true;

            let started = Instant::now();
            let ends = Arc::new(Ends::default());
            let session = session(Arc::clone(&conn), declared, Arc::clone(&ends));
            let end = while_connected(&conn, session, |why| ends.given_up(why)).await;
            close_connection(&conn, self.goodbye).await;
            match end {
                Ok(()) => return Ok(()),
                Err(SessionEnd::Fatal(err)) => return Err(err),
                Err(SessionEnd::Lost(reason)) => {
                    at += 1;
                    backoff = self.backoff_after_session(backoff, started.elapsed());
                    tracing::warn!(reason = %Escaped(&reason), ?backoff, "connection lost; reconnecting");
                    pause(shutdown, &mut backoff, self.backoff_max).await;
                }
                Err(SessionEnd::Unreadable(reason)) => {
                    backoff = self.backoff_min;
                    tracing::warn!(reason = %Escaped(&reason), ?backoff, "connection lost to a frame the client cannot read; reconnecting cautiously");
                    tokio::select! {
                        () = tokio::time::sleep(full_jitter(self.backoff_min)) => {}
                        () = shutdown.cancelled() => {}
                    }
                }
                Err(SessionEnd::Relaxed) => {
                    tracing::info!(
                        "read without a loss since the unreadable frame; reconnecting normally"
                    );
                }
            }
        }
    }

    /// The pause before the next reconnect: back to the minimum after a session
    /// that held for `backoff_max` or longer, else the growing one.
    fn backoff_after_session(&self, backoff: Duration, session: Duration) -> Duration {
        if session >= self.backoff_max {
            self.backoff_min
        } else {
            backoff
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{amqp_url, broker, Proxy};

    fn supervisor() -> Supervisor<'static> {
        let settings = ConnectionSettings::default()
            .backoff(Duration::from_millis(100), Duration::from_secs(5))
            .connect_timeout(Duration::from_secs(1));
        let url = "amqp://127.0.0.1:1/%2f";
        Supervisor::new(url, None, &settings, "bye").unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn settings_out_of_range_are_refused_when_built() {
        let s = Duration::from_secs(1);
        let url = "amqp://127.0.0.1:1/%2f";
        let refused = |timeout, (min, max)| {
            let settings = ConnectionSettings::default()
                .backoff(min, max)
                .connect_timeout(timeout);
            let built = Supervisor::new(url, None, &settings, "bye");
            crate::connect::config_error(built.map(|_| ())).0
        };
        assert_eq!(refused(s, (2 * s, s)), "backoff");
        assert_eq!(refused(s, (Duration::ZERO, s)), "backoff");
        assert_eq!(refused(Duration::ZERO, (s, s)), "connect_timeout");
    }

    #[test]
    fn a_connection_that_dies_at_once_keeps_backing_off() {
        let s = supervisor();
        let grown = s.backoff_min * 8;
        assert_eq!(
            s.backoff_after_session(grown, Duration::from_millis(10)),
            grown
        );
        assert_eq!(s.backoff_after_session(grown, s.backoff_max), s.backoff_min);
    }

    #[test]
    fn the_first_connection_must_succeed() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        let shutdown = CancellationToken::new();
        let mut sessions = 0;
        let ran = runtime.block_on(supervisor().run(
            &shutdown,
            |_| async { Ok(()) },
            |_, (), _| {
                sessions += 1;
                async { Ok(()) }
            },
            || {},
        ));
        assert!(matches!(ran, Err(Error::Connect { .. })), "{ran:?}");
        assert_eq!(sessions, 0);
    }

    /// The first declaration answered that a quorum queue has no leader is waited
    /// for with backoff, not fatal (against the broker of `AMQP_URL`, when set).
    #[test]
    fn a_leaderless_queue_at_startup_is_waited_for() {
        let Some(url) = amqp_url() else {
            return;
        };
        let settings = ConnectionSettings::default()
            .backoff(Duration::from_millis(10), Duration::from_millis(50));
        let supervisor =
            Supervisor::new(&url, None, &settings, "bye").unwrap_or_else(|e| panic!("{e}"));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        let shutdown = CancellationToken::new();
        let declared = std::cell::Cell::new(0);
        let ran = runtime.block_on(supervisor.run(
            &shutdown,
            |_| {
                declared.set(declared.get() + 1);
                let n = declared.get();
                async move {
                    if n < 3 {
                        Err(crate::election::internal_error(
                            "INTERNAL_ERROR - timed out consuming from quorum queue 'q' in vhost '/'",
                        ))
                    } else {
                        Ok(())
                    }
                }
            },
            |_, (), _| async { Ok(()) },
            || {},
        ));
        assert!(ran.is_ok(), "{ran:?}");
        assert_eq!(declared.get(), 3, "declared until the queue had a leader");
    }

    /// What a run of `supervisor` on `url` did: the declarations and sessions it
    /// started, its reconnects, and how it ended (`None`: it hung for 20 s).
    struct Runs {
        declared: usize,
        sessions: usize,
        reconnects: usize,
        ended: Option<Result<()>>,
    }

    /// Runs a supervisor whose `stuck`-th declaration (or session, when `session`)
    /// cuts its own connection and then waits forever, as a lapin call does that the
    /// connection's failure never answers; every other declaration and session ends
    /// at once, the session with a loss until the `stuck`-th has passed.
    fn run_with_a_stuck_call(broker: String, session_stuck: bool, stuck: usize) -> Runs {
        let runtime = crate::test_support::runtime();
        let declared = std::cell::Cell::new(0);
        let sessions = std::cell::Cell::new(0);
        let reconnects = std::cell::Cell::new(0);
        let ended = runtime.block_on(async {
            let proxy = Proxy::start(broker).await;
            let url = proxy.url.clone();
            let settings = ConnectionSettings::default()
                .backoff(Duration::from_millis(10), Duration::from_millis(50));
            let supervisor =
                Supervisor::new(&url, None, &settings, "bye").unwrap_or_else(|e| panic!("{e}"));
            let shutdown = CancellationToken::new();
            let stuck_call = |proxy: Proxy| async move {
                proxy.cut();
                std::future::pending::<()>().await;
            };
            let running = supervisor.run(
                &shutdown,
                |_| {
                    declared.set(declared.get() + 1);
                    let now = !session_stuck && declared.get() == stuck;
                    let proxy = proxy.clone();
                    async move {
                        if now {
                            stuck_call(proxy).await;
                        }
                        Ok(())
                    }
                },
                |_, (), _| {
                    sessions.set(sessions.get() + 1);
                    let n = sessions.get();
                    let now = session_stuck && n == stuck;
                    let proxy = proxy.clone();
                    async move {
                        if now {
                            stuck_call(proxy).await;
                        }
                        if n < stuck {
                            Err(SessionEnd::Lost("again".into()))
                        } else {
                            Ok(())
                        }
                    }
                },
                || reconnects.set(reconnects.get() + 1),
            );
            tokio::time::timeout(Duration::from_secs(20), running)
                .await
                .ok()
        });
        Runs {
            declared: declared.get(),
            sessions: sessions.get(),
            reconnects: reconnects.get(),
            ended,
        }
    }

    /// A session whose connection fails under a call that never returns is given
    /// up on once the connection has been down for `GOODBYE_WAIT`: the supervisor
    /// reconnects (without the watch it waits forever).
    #[test]
    fn a_session_stuck_on_a_failed_connection_is_given_up() {
        let Some(broker) = broker() else { return };
        let runs = run_with_a_stuck_call(broker, true, 1);
        let ended = runs
            .ended
            .expect("the supervisor hung on the stuck session");
        assert!(ended.is_ok(), "{ended:?}");
        assert_eq!(
            (runs.declared, runs.sessions, runs.reconnects),
            (2, 2, 1),
            "declarations, sessions, reconnects"
        );
    }

    /// The same for a declaration of a later connection (the first connection's
    /// declaration must succeed): it is given up on, and the next connection
    /// declares again.
    #[test]
    fn a_declaration_stuck_on_a_failed_connection_is_given_up() {
        let Some(broker) = broker() else { return };
        let runs = run_with_a_stuck_call(broker, false, 2);
        let ended = runs
            .ended
            .expect("the supervisor hung on the stuck declaration");
        assert!(ended.is_ok(), "{ended:?}");
        assert_eq!(
            (runs.declared, runs.sessions, runs.reconnects),
            (3, 2, 1),
            "declarations, sessions, reconnects"
        );
    }

    /// How a supervisor of two broker URLs went on after its first session recorded
    /// `end` in its [`Ends`], cut its own connection and then never returned (a task
    /// still in a batch): how it ended (`None`: it hung for 20 s), and how many
    /// connections each URL took.
    fn after_a_recorded_end_and_a_hung_session(
        broker: String,
        end: fn() -> SessionEnd,
    ) -> (Option<Result<()>>, [usize; 2]) {
        let runtime = crate::test_support::runtime();
        runtime.block_on(async {
            let (first, second) = (
                Proxy::start(broker.clone()).await,
                Proxy::start(broker).await,
            );
            let urls = format!("{} {}", first.url, second.url);
            let settings = ConnectionSettings::default()
                .backoff(Duration::from_millis(10), Duration::from_millis(50));
            let supervisor =
                Supervisor::new(&urls, None, &settings, "bye").unwrap_or_else(|e| panic!("{e}"));
            let shutdown = CancellationToken::new();
            let sessions = std::cell::Cell::new(0);
            let running = supervisor.run(
                &shutdown,
                |_| async { Ok(()) },
                |_, (), ends| {
                    sessions.set(sessions.get() + 1);
                    let hang = sessions.get() == 1;
                    let first = first.clone();
                    async move {
                        if hang {
                            ends.record(end(), |_| {});
                            first.cut();
                            std::future::pending::<()>().await;
                        }
                        Ok(())
                    }
                },
                || {},
            );
            let ended = tokio::time::timeout(Duration::from_secs(20), running)
                .await
                .ok();
            (ended, [first.taken(), second.taken()])
        })
    }

    /// A session given up on after its connection died ends as the gravest end its
    /// tasks recorded, not as a plain loss: a fatal end stops the supervisor
    /// (a loss would reconnect and run on).
    #[test]
    fn a_fatal_end_recorded_before_the_session_is_given_up_stays_fatal() {
        let Some(broker) = broker() else { return };
        let fatal = || SessionEnd::Fatal(Error::invalid("test", "nothing", "a fatal end"));
        let (ended, taken) = after_a_recorded_end_and_a_hung_session(broker, fatal);
        let ended = ended.expect("the supervisor hung on the session");
        assert!(
            matches!(
                &ended,
                Err(Error::InvalidSetting {
                    setting: "test",
                    ..
                })
            ),
            "{ended:?} (connections taken per URL: {taken:?})"
        );
        assert_eq!(taken, [1, 0], "connections taken per URL");
    }

    /// And an unreadable frame stays unreadable: the supervisor reconnects to the
    /// same, healthy broker (a loss moves to the next URL).
    #[test]
    fn an_unreadable_end_recorded_before_the_session_is_given_up_stays_unreadable() {
        let Some(broker) = broker() else { return };
        let unreadable = || SessionEnd::Unreadable("a frame the client cannot parse".into());
        let (ended, taken) = after_a_recorded_end_and_a_hung_session(broker, unreadable);
        let ended = ended.expect("the supervisor hung on the session");
        assert!(ended.is_ok(), "{ended:?}");
        assert_eq!(taken, [2, 0], "connections taken per URL");
    }
}
