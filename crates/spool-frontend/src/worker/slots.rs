//! The in-flight table's entries: [`Inflight`] (a request between submission and completion)
//! and [`SlotBufs`] (its device pieces and iovec arrays, storage reused from request to
//! request), and writing a request's status byte.
//!
//! Knows nothing of devices' health, the ring or the journal.

use smallvec::SmallVec;
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;

use crate::request::IoVecs;
use crate::stats::OpKind;

/// A request between submission to the devices and completion to the guest.
pub(super) struct Inflight {
    /// Host address of the status byte (in the mapping the request was parsed in, which the
    /// worker keeps alive until the request completes).
    pub(super) status: usize,
    pub(super) used_len: u32,
    pub(super) pending: u32,
    pub(super) status_code: u8,
    /// A piece failed with a path error: hold the request for resubmission, do not complete it.
    pub(super) held: bool,
    /// A piece was cancelled by us (a queue pair aborted or lost to a controller reset):
    /// submit the request again at once, nothing is wrong with it or the device.
    pub(super) cancelled: bool,
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
            pending,
            status_code: VIRTIO_BLK_S_OK as u8,
            held: false,
            cancelled: false,
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
        self.status_code == VIRTIO_BLK_S_OK as u8
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
