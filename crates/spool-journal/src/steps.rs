//! Algorithm 1: the steps of taking a request (2–7) and completing one (10–14), each one
//! ordered store followed by a `Release` fence (see the crate doc on memory ordering).
//!
//! Owns: the order and content of those stores on the data path.
//!
//! Must not know: the virtqueue; the frontend calls these steps in the paper's order.

use std::sync::atomic::{fence, Ordering};

use crate::{pack_aux, unpack_aux, Journal, ReqState, AUX_FINISHED, AUX_START};

impl Journal {
    /// Steps 2–5: one 64-bit store of {START, taken_at + 1, head}, where `taken_at` is the
    /// avail index the head was read at (the journal's `last_avail`). From here on the request
    /// cannot be lost: recovery finishes the transaction. The store replaces the whole `aux`
    /// word, so it also finishes the previous take's transaction (whose head is INFLIGHT by
    /// then): see [`Journal::take_finish`].
    #[inline]
    pub fn take_begin(&self, head: u16, taken_at: u16) {
        self.aux_atomic().store(
            pack_aux(AUX_START, taken_at.wrapping_add(1), head),
            Ordering::Relaxed,
        );
        fence(Ordering::Release);
    }

    /// Step 6: the request is INFLIGHT, with the avail index it was taken at (recovery
    /// resubmits oldest first).
    #[inline]
    pub fn take_mark_inflight(&self, head: u16, taken_at: u16) {
        self.slot(head).store(
            ReqState::Inflight as u32 | ((taken_at as u32) << 16),
            Ordering::Relaxed,
        );
        fence(Ordering::Release);
    }

    /// Step 7: the transaction is FINISHED. Needed once per batch of takes, not per take: the
    /// next take's step 2–5 store finishes the previous transaction as well (a START naming
    /// a head that is already INFLIGHT is finished by recovery without effect). What step 7
    /// must precede is the completion of the head the `aux` word names: with START still
    /// naming it, recovery would mark that head INFLIGHT again after its completion reached
    /// the guest, and complete it twice.
    #[inline]
    pub fn take_finish(&self) {
        let (_, last, head) = unpack_aux(self.aux_atomic().load(Ordering::Relaxed));
        self.aux_atomic()
            .store(pack_aux(AUX_FINISHED, last, head), Ordering::Relaxed);
        fence(Ordering::Release);
    }

    /// Step 10: the journal's used index moves ahead of the ring's.
    #[inline]
    pub fn complete_begin(&self) {
        self.complete_begin_n(1)
    }

    /// Step 10 for a batch of `n` completions published by one used-index update: the
    /// journal's used index moves to where the ring's will be once the batch is published.
    #[inline]
    pub fn complete_begin_n(&self, n: u16) {
        let u = self.used_atomic().load(Ordering::Relaxed);
        self.used_atomic()
            .store(u.wrapping_add(n), Ordering::Relaxed);
        fence(Ordering::Release);
    }

    /// Step 11: the request is DONE (its completion is about to be put in the used ring).
    #[inline]
    pub fn complete_mark_done(&self, head: u16) {
        let s = self.slot(head);
        s.store(
            (s.load(Ordering::Relaxed) & !0xff) | ReqState::Done as u32,
            Ordering::Relaxed,
        );
        fence(Ordering::Release);
    }

    /// Step 14: the completion reached the used ring; the head is free.
    #[inline]
    pub fn complete_mark_none(&self, head: u16) {
        self.slot(head).store(0, Ordering::Relaxed);
        fence(Ordering::Release);
    }
}
