//! A connection's caution after a frame the client cannot parse, and the pace of a
//! group's worker.

use super::*;

/// Whether a connection's next session is cautious: its last one was lost to a frame
/// the client cannot parse. Such a frame kills the whole connection (lapin fails the
/// connection on any parse error), so every delivery in flight on it comes back with
/// its delivery count raised, and the poison is sent again at once. A cautious session
/// has one worker per group, prefetch 1 and batches of 1, so the poison travels alone
/// and each of its bounded tries (the queue's delivery limit) costs no other
/// delivery of its queue anything; once it has settled as many deliveries as a normal
/// worker prefetches without a loss, it ends and a normal session starts at once.
#[derive(Default)]
pub(super) struct Caution(pub(super) AtomicBool);

impl Caution {
    pub(super) fn is_on(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Records a task's `end` in its session's `ends` and, when it is the gravest so
    /// far, remembers it at once: an unreadable frame makes the next session
    /// cautious, a relaxed end a normal one. At once, not when the session returns,
    /// because a session given up on (its connection gone, a task still in a batch)
    /// is dropped and never returns.
    pub(super) fn record(&self, ends: &Ends, end: SessionEnd) {
        ends.record(end, |gravest| match gravest {
            SessionEnd::Unreadable(_) => self.0.store(true, Ordering::Relaxed),
            SessionEnd::Relaxed => self.0.store(false, Ordering::Relaxed),
            SessionEnd::Lost(_) | SessionEnd::Fatal(_) => {}
        });
    }
}

/// How a session's tasks read: normally, or cautiously (see [`Caution`]).
#[derive(Clone)]
pub(super) struct Pace {
    pub(super) prefetch: u16,
    pub(super) batch_size: usize,
    /// A cautious session: how many settled deliveries end it, and how many were.
    pub(super) relax: Option<(u64, Arc<AtomicU64>)>,
}

impl Pace {
    pub(super) fn new(cautious: bool, prefetch: u16, batch_size: usize) -> Self {
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
    pub(super) fn settled(&self, n: usize) -> std::result::Result<(), SessionEnd> {
        if let Some((enough, settled)) = &self.relax {
            let total = settled.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
            if total >= *enough {
                return Err(SessionEnd::Relaxed);
            }
        }
        Ok(())
    }
}

/// Fills `batch` from `deliveries` up to `size`, the first delivery already in it.
///
/// With a `wait` of zero (the default) it takes only the deliveries that have already
/// arrived and returns as soon as none is ready: a lone delivery is handled at once,
/// and under load the batches grow by themselves, since deliveries pile up in the
/// client while the previous batch commits. A positive `wait` lingers up to that long
/// for the batch to fill (a wait too long to add to the clock waits until it is
/// full). Ends early, keeping what it took, when the stream ends; returns the
/// stream's error when it fails.
pub(super) async fn fill<T, E, S>(
    deliveries: &mut S,
    batch: &mut Vec<T>,
    size: usize,
    wait: Duration,
) -> std::result::Result<(), E>
where
    S: futures_lite::Stream<Item = std::result::Result<T, E>> + Unpin,
{
    let deadline = if wait.is_zero() {
        None
    } else {
        Some(Instant::now().checked_add(wait))
    };
    while batch.len() < size {
        let next = match deadline {
            // Only what is ready: a pending stream ends the batch.
            None => match futures_lite::future::poll_once(deliveries.next()).await {
                Some(next) => next,
                None => break,
            },
            Some(None) => deliveries.next().await,
            Some(Some(deadline)) => {
                match tokio::time::timeout_at(deadline, deliveries.next()).await {
                    Ok(next) => next,
                    Err(_) => break,
                }
            }
        };
        match next {
            Some(Ok(delivery)) => batch.push(delivery),
            Some(Err(err)) => return Err(err),
            None => break,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The caution follows the gravest end of a session as soon as it is recorded
    /// (a session given up on never returns its end): an unreadable frame turns it
    /// on, a later lesser end of the same session does not turn it off, and a
    /// relaxed end of the next session does.
    #[test]
    fn the_caution_follows_the_gravest_end_as_it_is_recorded() {
        let caution = Caution::default();
        let ends = Ends::default();
        caution.record(&ends, SessionEnd::Lost("cut".into()));
        assert!(!caution.is_on(), "a loss is not a poison");
        caution.record(&ends, SessionEnd::Unreadable("poison".into()));
        assert!(caution.is_on(), "an unreadable frame, at once");
        caution.record(&ends, SessionEnd::Relaxed);
        caution.record(&ends, SessionEnd::Lost("cut".into()));
        assert!(caution.is_on(), "lesser ends of the same session");
        assert!(matches!(ends.take(), Err(SessionEnd::Unreadable(_))));
        let next = Ends::default();
        caution.record(&next, SessionEnd::Relaxed);
        assert!(!caution.is_on(), "the cautious session relaxed");
        let fatal = SessionEnd::Fatal(crate::Error::invalid("test", "nothing", "fatal"));
        caution.record(&next, fatal);
        assert!(!caution.is_on(), "a fatal end leaves the caution as it was");
        assert!(matches!(next.take(), Err(SessionEnd::Fatal(_))));
    }

    type Item = std::result::Result<u32, &'static str>;

    /// The test's end of a stream: what was sent is ready, nothing else is. (Not
    /// tokio's channel, whose receiver turns pending once a task's budget of 128
    /// polls is spent, as lapin's consumer does not.)
    #[derive(Default)]
    struct Queue {
        items: std::collections::VecDeque<Item>,
        waker: Option<std::task::Waker>,
        closed: bool,
    }

    impl Queue {
        fn wake(&mut self) {
            if let Some(waker) = self.waker.take() {
                waker.wake();
            }
        }
    }

    #[derive(Clone, Default)]
    struct Feed(Arc<Mutex<Queue>>);

    impl Feed {
        fn send(&self, item: Item) {
            let mut feed = self.0.lock().unwrap();
            feed.items.push_back(item);
            feed.wake();
        }

        fn close(&self) {
            let mut feed = self.0.lock().unwrap();
            feed.closed = true;
            feed.wake();
        }
    }

    fn stream() -> (Feed, impl futures_lite::Stream<Item = Item> + Unpin) {
        let feed = Feed::default();
        let rx = feed.clone();
        let deliveries = futures_lite::stream::poll_fn(move |cx| {
            let mut feed = rx.0.lock().unwrap();
            match feed.items.pop_front() {
                Some(item) => std::task::Poll::Ready(Some(item)),
                None if feed.closed => std::task::Poll::Ready(None),
                None => {
                    feed.waker = Some(cx.waker().clone());
                    std::task::Poll::Pending
                }
            }
        });
        (feed, deliveries)
    }

    #[test]
    fn the_default_batch_is_what_has_arrived_and_a_lone_delivery_goes_at_once() {
        // A runtime without timers: a fill that so much as arms one panics, so the
        // default fill provably never waits for anything that has not arrived.
        let no_timers = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        no_timers.block_on(async {
            let wait = ConsumerSettings::default().batch_wait;
            let (tx, mut deliveries) = stream();
            let mut batch = vec![0];
            fill(&mut deliveries, &mut batch, 100, wait).await.unwrap();
            assert_eq!(batch, vec![0], "a lone delivery is handed over alone");
            // Deliveries that piled up meanwhile go in the next batches, up to the size.
            for i in 1..=150 {
                tx.send(Ok(i));
            }
            let mut batch = vec![0];
            fill(&mut deliveries, &mut batch, 100, wait).await.unwrap();
            assert_eq!(batch, (0..100).collect::<Vec<_>>());
            let mut batch = vec![0];
            fill(&mut deliveries, &mut batch, 100, wait).await.unwrap();
            let rest: Vec<_> = std::iter::once(0).chain(100..=150).collect();
            assert_eq!(batch, rest, "the rest of the pile, and no wait for more");
        });
    }

    #[tokio::test]
    async fn a_configured_linger_waits_for_the_batch_to_fill_and_a_full_batch_does_not() {
        let (tx, mut deliveries) = stream();
        let later = tx.clone();
        let sent = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            later.send(Ok(1));
        });
        // A linger far longer than the sender's pause: the late delivery joins.
        let mut batch = vec![0];
        let wait = Duration::from_secs(600);
        fill(&mut deliveries, &mut batch, 2, wait).await.unwrap();
        assert_eq!(batch, vec![0, 1]);
        sent.await.unwrap();
        // One that waits without end: filled by what comes next, however late.
        let later = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            later.send(Ok(2));
        });
        let mut batch = vec![0];
        fill(&mut deliveries, &mut batch, 2, Duration::MAX)
            .await
            .unwrap();
        assert_eq!(batch, vec![0, 2], "an unbounded linger waits until full");
        // A full batch returns without its linger: the test would hang otherwise.
        for i in 3..5 {
            tx.send(Ok(i));
        }
        let mut batch = vec![0];
        fill(&mut deliveries, &mut batch, 3, wait).await.unwrap();
        assert_eq!(batch, vec![0, 3, 4]);
        // A short linger with nothing more to come ends with what it has.
        let mut batch = vec![0];
        let short = Duration::from_millis(5);
        fill(&mut deliveries, &mut batch, 3, short).await.unwrap();
        assert_eq!(batch, vec![0]);
    }

    #[tokio::test]
    async fn a_failed_or_ended_stream_stops_the_fill() {
        for wait in [Duration::ZERO, Duration::from_secs(600)] {
            let (tx, mut deliveries) = stream();
            tx.send(Ok(1));
            tx.send(Err("connection lost"));
            tx.send(Ok(2));
            let mut batch = vec![0];
            let failed = fill(&mut deliveries, &mut batch, 100, wait).await;
            assert_eq!((failed, batch), (Err("connection lost"), vec![0, 1]));
            let mut batch = vec![0];
            tx.close();
            fill(&mut deliveries, &mut batch, 100, wait).await.unwrap();
            assert_eq!(batch, vec![0, 2], "an ended stream keeps what it gave");
        }
    }
}
