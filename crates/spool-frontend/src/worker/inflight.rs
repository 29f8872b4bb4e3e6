//! The in-flight table ([`InflightTable`]): every request the queue has taken from the ring
//! and not yet completed into the used ring, with one explicit state per head ([`HeadState`]:
//! submitted to the devices, held for a resetting device, cancelled by us and waiting to be
//! submitted again) that only the table changes; the request's record ([`Inflight`]) and its
//! device pieces and iovec arrays ([`SlotBufs`], storage reused from request to request);
//! retries after path errors, and which heads a journal replay resubmitted. And writing a
//! request's status byte.
//!
//! The stop that lost a held request (issue 31) lived in the gap between parallel arrays:
//! here "taken and not completed" is one question, [`InflightTable::unsettled`], and a head
//! is offered to the devices only from `Free` ([`InflightTable::busy`]).
//!
//! Knows nothing of devices' health, the ring or the journal.

use smallvec::SmallVec;
use spool_devices::fanout::Fanout;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};

use crate::request::IoVecs;
use crate::stats::OpKind;

/// A request between submission to the devices and completion to the guest.
pub(super) struct Inflight {
    /// Host address of the status byte (in the mapping the request was parsed in, which the
    /// worker keeps alive until the request completes).
    pub(super) status: usize,
    pub(super) used_len: u32,
    /// Its pieces on the layout's devices (targets: device indices). A path error holds the
    /// request for resubmission; a piece we cancelled (a queue pair aborted or lost to a
    /// controller reset) submits it again at once; a media or request error fails it.
    pub(super) pieces: Fanout,
    /// Already reported as timed out.
    pub(super) timed_out: bool,
    /// The timeout sweep during which it was submitted.
    pub(super) sweep: u32,
    /// For the statistics: what it is, its data length, when it was taken (`now_ticks`).
    pub(super) kind: OpKind,
    pub(super) bytes: u32,
    pub(super) taken: u64,
}

impl Inflight {
    /// A request with status byte at host address `status` that will report `used_len`
    /// bytes written when it completes, `pending` device pieces, and no failure yet,
    /// submitted during timeout sweep `sweep`.
    #[inline]
    pub(super) fn new(status: usize, used_len: u32, pending: u32, sweep: u32) -> Self {
        Inflight {
            status,
            used_len,
            pieces: Fanout::new(pending),
            timed_out: false,
            sweep,
            kind: OpKind::Other,
            bytes: 0,
            taken: 0,
        }
    }

    /// Whether no piece failed in a way that decides the request's status.
    #[inline]
    pub(super) fn ok(&self) -> bool {
        self.pieces.ok()
    }

    /// The status byte the request completes with.
    #[inline]
    pub(super) fn status_code(&self) -> u8 {
        if self.pieces.ok() {
            VIRTIO_BLK_S_OK as u8
        } else {
            VIRTIO_BLK_S_IOERR as u8
        }
    }
}

/// The bytes a read or write request reports written to the guest: the data of a read, and
/// the status byte.
#[inline]
pub(super) fn used_len(write: bool, len: u64) -> u32 {
    if write {
        1
    } else {
        (len as u32).saturating_add(1)
    }
}

/// What a slot keeps beyond [`Inflight`], in storage reused from request to request (so a
/// request is neither allocated nor moved as a whole on the path).
///
/// Holds raw iovec pointers into guest memory, so it is not `Send` by default.
#[derive(Default)]
pub(super) struct SlotBufs {
    /// Device pieces (device index, device offset, length, write), for error reports.
    pub(super) pieces: SmallVec<[(u16, u64, u64, bool); 2]>,
    /// The iovec array of a read or write submitted as one piece (`submit_one`, the common
    /// case: the request's own array, moved in whole).
    pub(super) iov: IoVecs,
    /// Per-device-piece iovec arrays of any other request (`submit`). The device holds raw
    /// pointers into `iov` or `parts`, so neither is touched until the slot's request has
    /// completed (`slot_bufs` never grows).
    pub(super) parts: SmallVec<[IoVecs; 1]>,
}

// SAFETY: the iovec pointers in `iov` and `parts` point into a guest mapping the worker keeps
// alive while the slot's request is in flight (`host_of`, then `retired_maps`); only the one
// worker thread that owns the slot ever dereferences them (through the device queue), and the
// whole worker moves to its thread as one. Guest memory behind them is shared, never `&`'d.
unsafe impl Send for SlotBufs {}

/// Where a head is between being taken from the ring and completed into the used ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HeadState {
    /// Not the worker's: completed, or never taken.
    Free,
    /// Its pieces are at the devices (its [`Inflight`] is in the table).
    Submitted,
    /// A path error: waiting for its device's health to change, then dispatched again.
    Held,
    /// Cancelled by us (a queue pair lost to a reset): submitted again at the next round.
    Cancelled,
}

/// Every request taken and not completed, by head (module doc).
pub(super) struct InflightTable {
    state: Vec<HeadState>,
    slots: Vec<Option<Inflight>>,
    bufs: Vec<SlotBufs>,
    /// Held and cancelled heads, in the order they got there.
    held: Vec<u16>,
    cancelled: Vec<u16>,
    /// Path errors each head has been held for since it last completed.
    retries: Vec<u8>,
    /// Heads a journal replay resubmitted and that have not completed yet.
    replaying: Vec<bool>,
    replay_left: usize,
    submitted: usize,
}

impl InflightTable {
    /// A table for a ring of `size` heads.
    pub(super) fn new(size: usize) -> InflightTable {
        InflightTable {
            state: vec![HeadState::Free; size],
            slots: (0..size).map(|_| None).collect(),
            bufs: (0..size).map(|_| SlotBufs::default()).collect(),
            held: Vec::new(),
            cancelled: Vec::new(),
            retries: vec![0; size],
            replaying: vec![false; size],
            replay_left: 0,
            submitted: 0,
        }
    }

    /// Heads the table has room for (the ring's size).
    pub(super) fn len(&self) -> usize {
        self.state.len()
    }

    /// `head`'s state (`Submitted` for a head beyond the ring: never offered to a device).
    #[inline]
    pub(super) fn state(&self, head: u16) -> HeadState {
        self.state
            .get(head as usize)
            .copied()
            .unwrap_or(HeadState::Submitted)
    }

    /// Whether `head` is still the worker's (or out of range): a head offered again while
    /// busy is a guest's error, never submitted twice.
    #[inline]
    pub(super) fn busy(&self, head: u16) -> bool {
        self.state(head) != HeadState::Free
    }

    /// Requests at the devices.
    #[inline]
    pub(super) fn submitted(&self) -> usize {
        self.submitted
    }

    /// Whether any request taken from the ring has not been completed to the guest: at a
    /// device, held or cancelled.
    #[inline]
    pub(super) fn unsettled(&self) -> bool {
        self.submitted > 0 || !self.held.is_empty() || !self.cancelled.is_empty()
    }

    /// The storage of free `head`'s pieces and iovec arrays, to fill before [`Self::submit`].
    #[inline]
    pub(super) fn bufs_mut(&mut self, head: u16) -> &mut SlotBufs {
        debug_assert_eq!(self.state(head), HeadState::Free);
        &mut self.bufs[head as usize]
    }

    /// `head`'s pieces and iovec arrays.
    #[inline]
    pub(super) fn bufs(&self, head: u16) -> &SlotBufs {
        &self.bufs[head as usize]
    }

    /// Free `head` goes to the devices with record `inf`.
    #[inline]
    pub(super) fn submit(&mut self, head: u16, inf: Inflight) {
        let h = head as usize;
        debug_assert_eq!(self.state[h], HeadState::Free);
        self.state[h] = HeadState::Submitted;
        self.slots[h] = Some(inf);
        self.submitted += 1;
    }

    /// The records of submitted requests and every head's pieces, for counting device
    /// completions down (the records change; the pieces are read).
    #[inline]
    pub(super) fn records(&mut self) -> (&mut [Option<Inflight>], &[SlotBufs]) {
        (&mut self.slots, &self.bufs)
    }

    /// Submitted `head`'s last piece came back: its record, the head free again (the caller
    /// completes it, or holds or cancels it).
    #[inline]
    pub(super) fn finish(&mut self, head: u16) -> Option<Inflight> {
        let h = head as usize;
        let inf = self.slots.get_mut(h)?.take()?;
        self.state[h] = HeadState::Free;
        self.submitted -= 1;
        Some(inf)
    }

    /// Holds `head` (just finished, or stopped at the health gate) for its device's health
    /// to change.
    pub(super) fn hold(&mut self, head: u16) {
        debug_assert_eq!(self.state(head), HeadState::Free);
        self.state[head as usize] = HeadState::Held;
        self.held.push(head);
    }

    /// `head` (just finished) was cancelled by us: it is submitted again at the next round.
    pub(super) fn cancel(&mut self, head: u16) {
        debug_assert_eq!(self.state(head), HeadState::Free);
        self.state[head as usize] = HeadState::Cancelled;
        self.cancelled.push(head);
    }

    /// Whether any head is held.
    #[inline]
    pub(super) fn any_held(&self) -> bool {
        !self.held.is_empty()
    }

    /// Whether any head was cancelled.
    #[inline]
    pub(super) fn any_cancelled(&self) -> bool {
        !self.cancelled.is_empty()
    }

    /// The held heads, free again, to be dispatched again.
    pub(super) fn take_held(&mut self) -> Vec<u16> {
        let heads = std::mem::take(&mut self.held);
        for &h in &heads {
            self.state[h as usize] = HeadState::Free;
        }
        heads
    }

    /// The cancelled heads, free again, to be submitted again.
    pub(super) fn take_cancelled(&mut self) -> Vec<u16> {
        let heads = std::mem::take(&mut self.cancelled);
        for &h in &heads {
            self.state[h as usize] = HeadState::Free;
        }
        heads
    }

    /// Every submitted request's record, the heads free again (a reset that resubmits them,
    /// a stop that fails them).
    pub(super) fn take_submitted(&mut self) -> Vec<(u16, Inflight)> {
        let mut out = Vec::with_capacity(self.submitted);
        for h in 0..self.slots.len() {
            if let Some(inf) = self.finish(h as u16) {
                out.push((h as u16, inf));
            }
        }
        out
    }

    /// Each submitted request's record with its pieces (the timeout sweep).
    pub(super) fn each_submitted(&mut self, mut f: impl FnMut(&mut Inflight, &SlotBufs)) {
        for (slot, bufs) in self.slots.iter_mut().zip(&self.bufs) {
            if let Some(inf) = slot {
                f(inf, bufs);
            }
        }
    }

    /// Counts a path error against `head`: whether it may be held again (fewer than `max`
    /// so far), and how many it had.
    pub(super) fn retry(&mut self, head: u16, max: u32) -> (bool, u8) {
        let r = &mut self.retries[head as usize];
        let had = *r;
        if (had as u32) < max {
            *r += 1;
            return (true, had);
        }
        (false, had)
    }

    /// `head` completed: its path errors are forgotten.
    #[inline]
    pub(super) fn clear_retries(&mut self, head: u16) {
        self.retries[head as usize] = 0;
    }

    /// A journal replay resubmits `head` (counted once).
    pub(super) fn start_replay(&mut self, head: u16) {
        if let Some(r) = self.replaying.get_mut(head as usize).filter(|r| !**r) {
            *r = true;
            self.replay_left += 1;
        }
    }

    /// `head` completed; returns whether a replay still has heads to complete.
    pub(super) fn end_replay(&mut self, head: u16) -> bool {
        if let Some(r) = self.replaying.get_mut(head as usize).filter(|r| **r) {
            *r = false;
            self.replay_left -= 1;
        }
        self.replay_left > 0
    }

    /// Whether a replay still has heads to complete.
    pub(super) fn replay_pending(&self) -> bool {
        self.replay_left > 0
    }

    #[cfg(test)]
    pub(super) fn held(&self) -> &[u16] {
        &self.held
    }

    #[cfg(test)]
    pub(super) fn retries(&self, head: u16) -> u8 {
        self.retries[head as usize]
    }
}

/// Writes a request's status byte.
#[inline]
pub(super) fn write_status(at: usize, status: u8) {
    if at != 0 {
        // SAFETY: `at` is a request's `status_host`, one byte `HostMap::host` found in a
        // region when it was parsed; that map stays `host_of` or in `retired_maps` until the
        // request completes (`refresh_host`). Written as a value (the guest may read it).
        unsafe { std::ptr::write_volatile(at as *mut u8, status) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inf() -> Inflight {
        Inflight::new(0, 1, 1, 0)
    }

    /// Only the table moves a head, and every taken head is one of: submitted, held,
    /// cancelled. A busy head is never offered again; the stop's question is one call.
    #[test]
    fn a_head_moves_through_explicit_states() {
        let mut t = InflightTable::new(4);
        assert!(!t.busy(0) && !t.unsettled());
        assert!(t.busy(4), "beyond the ring is never free");
        t.submit(0, inf());
        t.submit(1, inf());
        assert_eq!((t.state(0), t.submitted()), (HeadState::Submitted, 2));
        assert!(t.busy(0) && t.unsettled());
        // Finished with a path error: held, still the worker's, still unsettled.
        assert!(t.finish(0).is_some());
        assert_eq!(t.finish(0).map(|_| ()), None, "finished once");
        t.hold(0);
        assert!(t.busy(0) && t.any_held() && t.unsettled());
        // Cancelled by us: the same, on the other list.
        t.finish(1).unwrap();
        t.cancel(1);
        assert_eq!(t.state(1), HeadState::Cancelled);
        assert_eq!(t.submitted(), 0);
        assert!(t.unsettled(), "held and cancelled heads are not settled");
        assert_eq!(t.take_held(), vec![0]);
        assert_eq!(t.take_cancelled(), vec![1]);
        assert!(!t.busy(0) && !t.busy(1) && !t.unsettled());
        // A reset takes every submitted record at once.
        t.submit(2, inf());
        t.submit(3, inf());
        let taken: Vec<u16> = t.take_submitted().into_iter().map(|(h, _)| h).collect();
        assert_eq!(taken, vec![2, 3]);
        assert!(!t.unsettled());
    }

    #[test]
    fn retries_and_replays_are_counted_per_head() {
        let mut t = InflightTable::new(2);
        assert_eq!(t.retry(0, 2), (true, 0));
        assert_eq!(t.retry(0, 2), (true, 1));
        assert_eq!(t.retry(0, 2), (false, 2));
        t.clear_retries(0);
        assert_eq!(t.retries(0), 0);
        t.start_replay(0);
        t.start_replay(0);
        t.start_replay(1);
        assert!(t.replay_pending());
        assert!(t.end_replay(0), "head 1 still replaying");
        assert!(!t.end_replay(1));
        assert!(!t.end_replay(1), "counted once");
        assert!(!t.replay_pending());
    }
}
