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

    /// Remembers how a session ended.
    pub(super) fn after<T>(&self, end: &std::result::Result<T, SessionEnd>) {
        match end {
            Err(SessionEnd::Unreadable(_)) => self.0.store(true, Ordering::Relaxed),
            Err(SessionEnd::Relaxed) => self.0.store(false, Ordering::Relaxed),
            _ => {}
        }
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
