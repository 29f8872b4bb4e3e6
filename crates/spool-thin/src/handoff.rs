//! [`Handoff`]: one answer from the allocator to a caller that waits for it with a time
//! limit. When the caller gives up, the answer is handed back to the allocator instead of
//! being dropped in between (an answer that carries names in the sharing counts, a
//! snapshot's, must be undone by whoever made it, and only once): the give-up and the answer
//! take one lock, so exactly one side keeps the answer.
//!
//! Owns: the slot. Must not know: what is answered.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

enum Slot<T> {
    Waiting,
    GaveUp,
    Answered(T),
}

/// One answer, from the allocator to its caller.
pub(crate) struct Handoff<T> {
    slot: Mutex<Slot<T>>,
    ready: Condvar,
}

impl<T> std::fmt::Debug for Handoff<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoff").finish_non_exhaustive()
    }
}

impl<T> Handoff<T> {
    pub(crate) fn new() -> Arc<Handoff<T>> {
        Arc::new(Handoff {
            slot: Mutex::new(Slot::Waiting),
            ready: Condvar::new(),
        })
    }

    /// Gives `answer` to the caller; `Err(answer)` when it gave up waiting (the answer is
    /// the sender's to undo).
    pub(crate) fn answer(&self, answer: T) -> Result<(), T> {
        let mut s = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        match *s {
            Slot::GaveUp => Err(answer),
            _ => {
                *s = Slot::Answered(answer);
                drop(s);
                self.ready.notify_all();
                Ok(())
            }
        }
    }

    /// Waits up to `limit` for the answer; `None` when there was none by then (an answer
    /// given after that goes back to its sender), or at once when the sender is gone
    /// without answering (the allocator stopped: nobody else holds the handoff).
    pub(crate) fn wait(self: &Arc<Self>, limit: Duration) -> Option<T> {
        let deadline = Instant::now() + limit;
        let mut s = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if matches!(*s, Slot::Answered(_)) {
                return match std::mem::replace(&mut *s, Slot::GaveUp) {
                    Slot::Answered(a) => Some(a),
                    _ => None,
                };
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || Arc::strong_count(self) == 1 {
                *s = Slot::GaveUp;
                return None;
            }
            // In slices: a sender that goes away without answering notifies nobody.
            let slice = left.min(Duration::from_millis(10));
            s = (self.ready.wait_timeout(s, slice))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exactly one side keeps the answer: the caller when it comes in time, the sender once
    /// the caller gave up (however close the two are).
    #[test]
    fn an_answer_after_the_caller_gave_up_goes_back_to_its_sender() {
        let h = Handoff::new();
        assert_eq!(h.answer(7), Ok(()));
        assert_eq!(h.wait(Duration::ZERO), Some(7), "answered first: kept");
        let h: Arc<Handoff<u32>> = Handoff::new();
        assert_eq!(h.wait(Duration::from_millis(5)), None);
        assert_eq!(h.answer(8), Err(8), "given up: handed back");
        let h = Handoff::new();
        let h2 = h.clone();
        let t = std::thread::spawn(move || h2.answer(9));
        assert_eq!(h.wait(Duration::from_secs(10)), Some(9));
        assert_eq!(t.join().unwrap(), Ok(()));
        // A sender gone without answering ends the wait at once, not at its limit.
        let h: Arc<Handoff<u32>> = Handoff::new();
        drop(h.clone());
        let t0 = Instant::now();
        assert_eq!(h.wait(Duration::from_secs(60)), None);
        assert!(t0.elapsed() < Duration::from_secs(30));
    }
}
