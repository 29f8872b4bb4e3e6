//! One request of a mirror queue's worker as the queue tracks it while its pieces are on the
//! legs' devices, and the device operation for each piece.
//!
//! Owns: [`Op`], [`piece_io`]. Must not know: the legs, the regions, the devices' queues.

use spool_devices::fanout::Fanout;
use spool_devices::iov::split_iov;
use spool_devices::{DeviceIo, IoVec};

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Read,
    Write,
    Zeroes,
    Flush,
}

/// One request of the worker's, spread over legs.
pub(super) struct Op {
    pub(super) tag: u64,
    pub(super) kind: Kind,
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) iov: *const IoVec,
    pub(super) iovcnt: u32,
    pub(super) regions: (usize, usize),
    /// Its pieces on the legs' devices (targets: leg slots; a flush's are `FLUSH_SLOT`).
    pub(super) pieces: Fanout,
    /// Slots the request went to (reads: the legs tried so far).
    pub(super) issued: u8,
    /// Writes: the legs current in every region of the write when it was submitted.
    pub(super) current: u8,
    /// Iovec arrays of pieces that split the request's own (kept until completion).
    pub(super) split: Vec<Box<[IoVec]>>,
    /// A flush: the devices (a bit per index) whose flush failed, or that it skipped (not
    /// healthy when it was submitted: such a device may hold completed writes no flush
    /// covered, which a power cut may take, so it missed the flush as surely as one it
    /// failed on; torture seed 9045).
    pub(super) flush_failed: u64,
    /// A flush: its number (`Regions::flush_submitted`).
    pub(super) flush: u32,
}

/// The device operation for `op`'s bytes `[at, at + n)` at device offset `dev_off`; a piece
/// of a read or write that is not the whole request gets its own iovec array, kept in `op`.
pub(super) fn piece_io(op: &mut Op, dev_off: u64, n: u64, at: u64) -> DeviceIo {
    match op.kind {
        Kind::Zeroes => DeviceIo::WriteZeroes {
            offset: dev_off,
            len: n,
        },
        Kind::Flush => DeviceIo::Flush,
        kind if at == 0 && n == op.len => {
            DeviceIo::data(kind == Kind::Write, dev_off, n, op.iov, op.iovcnt)
        }
        kind => {
            // SAFETY: the caller of `submit` keeps `iov[..iovcnt]` valid until completion.
            let iov = unsafe { std::slice::from_raw_parts(op.iov, op.iovcnt as usize) };
            let part = split_iov(iov, at, n);
            // The boxed slice's heap block does not move when the box moves into `split`.
            let io = DeviceIo::data(
                kind == Kind::Write,
                dev_off,
                n,
                part.as_ptr(),
                part.len() as u32,
            );
            op.split.push(part);
            io
        }
    }
}
