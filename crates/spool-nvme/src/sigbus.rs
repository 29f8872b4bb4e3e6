//! SIGBUS safety for BAR accesses (Spool §6.1), on the process-wide handler of
//! `spool-sigbus`.
//!
//! A load or store to a BAR whose device has gone (surprise removal, memory decoding turned
//! off under us) raises SIGBUS, which would kill the whole daemon and every tenant with it.
//! A watched BAR that faults is covered with all-ones memory (reads then say "gone", as a
//! removed PCIe device does, and doorbell writes go nowhere), flagged, and the access is
//! retried on the dummy memory, so only that controller is lost.

/// A gone PCIe device reads all ones.
const GONE: u8 = 0xff;

/// Maps anonymous memory filled with 0xff over `[start, start+len)`; true on success.
///
/// # Safety
/// `[start, start+len)` must be a BAR mapping of this process that nothing will munmap
/// concurrently.
pub(crate) unsafe fn cover_with_ones(start: usize, len: usize) -> bool {
    // SAFETY: the caller's contract is `cover`'s.
    unsafe { spool_sigbus::cover(start, len, GONE) }
}

/// Watches a BAR mapping; returns its slot (None when all slots are taken: then a fault on
/// it is fatal, as without this module).
pub(crate) fn watch(start: usize, len: usize) -> Option<usize> {
    spool_sigbus::watch(start, len, GONE)
}

/// Whether the BAR in `slot` faulted (and is now covered by the dummy mapping).
pub(crate) fn faulted(slot: usize) -> bool {
    spool_sigbus::faulted(slot)
}

/// Stops watching (before the BAR is unmapped).
pub(crate) fn unwatch(slot: usize) {
    spool_sigbus::unwatch(slot)
}
