//! Legs taking over from the others (a thin volume's copies replacing its own map, in
//! spool-pool): from the moment the pool checks that they are current until the legs that
//! go are gone, no write is acknowledged that only the legs that go hold.
//!
//! Owns: the `taking_over` legs and what a write one of them misses becomes (in `queue.rs`'s
//! settle). Must not know: why legs go (the pool's business).

use std::sync::atomic::Ordering;

use super::Mirror;

impl Mirror {
    /// Legs `slots` (stale bits) take over from the others from now on (a thin volume's
    /// copies replacing its own map): a write that any of them misses fails as a whole, a
    /// path error (`ENOLINK`: its sender sends it again) with nothing marked, even where
    /// another leg took it, as a write every current leg failed does. So nothing is
    /// acknowledged that lives only on the legs that go, and the legs that stay are not
    /// made stale where only those that go would be current. Returns the slots of `slots`
    /// this added (for [`Mirror::cancel_hand_over`]).
    pub fn begin_hand_over(&self, slots: u8) -> u8 {
        let before = self.shared.taking_over.fetch_or(slots, Ordering::AcqRel);
        slots & !before
    }

    /// Takes back what [`Mirror::begin_hand_over`] returned (a hand-over that did not happen).
    pub fn cancel_hand_over(&self, slots: u8) {
        self.shared.taking_over.fetch_and(!slots, Ordering::AcqRel);
    }
}
