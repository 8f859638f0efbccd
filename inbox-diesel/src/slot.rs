//! The crash-detection slot: redelivered messages of one consumer group run one at a
//! time in this process, so that one message's crash never counts as another's start.
//!
//! A holder that hangs (a handler that never returns) must not hold the group's
//! redeliveries forever: past the batch deadline its hold lapses and the next waiter
//! takes the slot over. The hung holder's later release is then a no-op.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
struct State {
    /// The current holder's generation and since when it holds the slot.
    holder: Option<(u64, Instant)>,
    generation: u64,
}

/// One group's slot.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    state: Mutex<State>,
    freed: Condvar,
}

/// Holding the slot; released on drop.
pub(crate) struct SlotGuard<'a> {
    slot: &'a Slot,
    generation: u64,
}

impl Slot {
    /// Waits until the slot is free, or its holder has held it longer than `lapse`
    /// (then it is taken over, with a warning: that holder hung).
    pub(crate) fn acquire(&self, lapse: Duration) -> SlotGuard<'_> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            match state.holder {
                None => break,
                Some((_, since)) => {
                    let held = since.elapsed();
                    if held >= lapse {
                        tracing::warn!(
                            held_ms = u64::try_from(held.as_millis()).unwrap_or(u64::MAX),
                            "crash slot held past the batch deadline: taking it over"
                        );
                        break;
                    }
                    state = self
                        .freed
                        .wait_timeout(state, lapse - held)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        }
        state.generation += 1;
        let generation = state.generation;
        state.holder = Some((generation, Instant::now()));
        SlotGuard {
            slot: self,
            generation,
        }
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        let mut state = self
            .slot
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if state.holder.is_some_and(|(g, _)| g == self.generation) {
            state.holder = None;
            self.slot.freed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_at_a_time_then_a_hung_holder_lapses() {
        let slot = Arc::new(Slot::default());
        let first = slot.acquire(Duration::from_secs(60));
        // A waiter with a short lapse takes over a holder that hangs.
        let second = slot.acquire(Duration::from_millis(50));
        // The lapsed holder's release does not free the new holder's slot.
        drop(first);
        let waiter = {
            let slot = Arc::clone(&slot);
            std::thread::spawn(move || {
                let _g = slot.acquire(Duration::from_secs(60));
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !waiter.is_finished(),
            "the slot was freed by a lapsed holder"
        );
        drop(second);
        waiter.join().unwrap_or_default();
    }
}
