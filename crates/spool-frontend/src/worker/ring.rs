//! The guest's ring as one queue's worker holds it: the journaled virtqueue, the kick
//! eventfd the guest rings, the call eventfd (swapped by `SET_VRING_CALL` while the worker
//! runs) and whether completions since the last notification want one.
//!
//! Owns: [`Ring`], signalling the guest. Must not know: devices, requests in flight.

use std::fs::File;
use std::io::Write;
use std::sync::Arc;

use arc_swap::ArcSwapOption;

use crate::vring::JournaledQueue;

/// One queue's ring and its eventfds (module doc).
pub(super) struct Ring {
    pub(super) vq: JournaledQueue,
    /// The guest's kick: read to clear it when it woke the worker.
    pub(super) kick: File,
    /// Where interrupts go (the frontend may swap it at any time).
    pub(super) call: Arc<ArcSwapOption<File>>,
    /// Requests were completed into the used ring since the guest was last notified.
    pub(super) need_notify: bool,
}

impl Ring {
    /// Tells the guest to look at the used ring (one interrupt on its call eventfd).
    #[inline]
    pub(super) fn signal_guest(&self) {
        if let Some(call) = self.call.load().as_ref() {
            let _ = (&**call).write(&1u64.to_ne_bytes());
        }
    }
}
