//! One worker's queue on a mirror: a request becomes pieces on the legs' device queues, and
//! the pieces' results become the request's.
//!
//! Writes (and write-zeroes; discards are written as zeroes so the legs stay identical) go to
//! every usable leg after their regions' intent bits are durable, and succeed when one leg
//! took the whole write: a leg that failed, or was not usable, is marked stale in those
//! regions (durably, before the completion) and the background thread copies them later.
//! Reads go to one leg holding current data in every region they touch, in turn, and move to
//! the next such leg when one fails (a media error also marks the range stale on the failed
//! leg, so it is rewritten from a good copy). A flush goes to every device of a usable leg.
//! With no usable leg holding every acknowledged write of its range a request fails with a
//! path error (`ENOLINK`), which the worker holds until the mirror's health changes (the
//! mirror is resetting until such a leg is usable again), or, when no such leg is left on a
//! device that may come back, with `ENOMEDIUM` (failed, not held).
//!
//! Owns: request splitting over legs, per-request results, the leg device queues' epochs.
//! Must not know: virtio, the pool.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::bitmap::stale;
use super::op::{piece_io, Kind, Op};
use super::regions::Entry;
use super::Shared;

mod flush;
mod mixed;
use spool_devices::epoll_watch as watch;
use spool_devices::fanout::{split, Fanout, PieceAt};
use spool_devices::{DeviceIo, DeviceQueue, ErrorReport, Signal};

/// A leg device with commands outstanding and no completion this long is hung (on `abort`).
const HUNG: Duration = Duration::from_millis(100);

/// Sub-operation tags: op index << 2 | slot (slot 3: a flush, which is per device).
const SLOT_BITS: u64 = 2;
const FLUSH_SLOT: u8 = 3;

/// A worker's queue on a mirror (see the module doc).
pub struct MirrorQueue {
    shared: Arc<Shared>,
    queues: Vec<Box<dyn DeviceQueue>>,
    epochs: Vec<u64>,
    /// Devices healthy as of the last epoch check.
    healthy: u64,
    ops: Vec<Option<Op>>,
    free: Vec<usize>,
    done: VecDeque<(u64, i32)>,
    /// Writes waiting for the copy to let their regions go (see `Regions::enter`).
    waiting: VecDeque<usize>,
    in_flight: usize,
    next_read: u8,
    /// Ops whose last piece came back in this reap (kept to reuse its allocation).
    finished: Vec<usize>,
    /// Readable when any leg queue has completions or `event` was signalled.
    epoll: OwnedFd,
    /// Signalled for completions decided without a device (no usable leg).
    event: Arc<File>,
    /// Commands outstanding per device, and when each device last completed one (or became
    /// busy): what tells a hung leg device.
    outstanding: Vec<u32>,
    progress: Vec<Instant>,
}

// SAFETY: the raw iovec pointers in `ops` belong to the caller of `submit`, which keeps them
// valid until completion (`DeviceQueue::submit`); one worker thread at a time uses the queue.
unsafe impl Send for MirrorQueue {}

impl MirrorQueue {
    pub(crate) fn new(shared: Arc<Shared>, depth: u32) -> std::io::Result<MirrorQueue> {
        let epoll = spool_devices::epoll_new()?;
        let event = spool_devices::completion_eventfd()?;
        let mut queues = Vec::new();
        let mut epochs = Vec::new();
        for d in &shared.spec.devices {
            // A leg device that cannot be had (a remote leg's link down as the worker
            // reopens its queues) drops out of the requests, not the mirror with it.
            let q = d.open_queue(depth).or_else(|e| {
                tracing::warn!(mirror = %shared.spec.name, device = %d.path().display(), error = %e, "a leg device's queue cannot be opened: the leg fails its commands until it is reopened");
                d.health().report(ErrorReport {
                    signal: Signal::Errno(libc::ENOTCONN),
                    offset: 0,
                    len: 0,
                    write: false,
                });
                super::gone::GoneQueue::new().map(|q| Box::new(q) as Box<dyn DeviceQueue>)
            })?;
            watch(epoll.as_raw_fd(), q.completion_fd())?;
            epochs.push(d.health().load().1);
            queues.push(q);
        }
        watch(epoll.as_raw_fd(), event.as_raw_fd())?;
        let healthy = shared.healthy();
        let n = queues.len();
        Ok(MirrorQueue {
            shared,
            queues,
            epochs,
            healthy,
            ops: Vec::new(),
            free: Vec::new(),
            done: VecDeque::new(),
            waiting: VecDeque::new(),
            in_flight: 0,
            next_read: 0,
            finished: Vec::new(),
            outstanding: vec![0; n],
            progress: vec![Instant::now(); n],
            epoll,
            event: Arc::new(event),
        })
    }

    /// Follows the leg devices' health: a device whose state changed has its hung commands
    /// aborted (they fail on that leg only), and the usable legs are recomputed.
    #[inline]
    fn check_epochs(&mut self) {
        let mut changed = false;
        for (d, dev) in self.shared.spec.devices.iter().enumerate() {
            let e = dev.health().load().1;
            if e != self.epochs[d] {
                self.epochs[d] = e;
                self.queues[d].abort();
                changed = true;
            }
        }
        if changed {
            self.healthy = self.shared.healthy();
        }
    }

    fn new_op(&mut self, op: Op) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.ops[i] = Some(op);
                i
            }
            None => {
                self.ops.push(Some(op));
                self.ops.len() - 1
            }
        }
    }

    /// Completes `op` without a device (its result is already decided).
    fn finish_now(&mut self, tag: u64, res: i32) {
        self.done.push_back((tag, res));
        let _ = (&*self.event).write(&1u64.to_ne_bytes());
    }

    /// Legs a read of the op may go to (see [`Shared::readable`]).
    fn readable(&self, op: &Op) -> u8 {
        self.shared
            .readable(self.healthy, op.offset, op.len, op.regions)
    }

    /// Why op `i` found no leg to go to: a path error (`ENOLINK`, held by the worker until
    /// the mirror's health changes) while a leg holding every acknowledged write of its range
    /// is on devices that may come back (resetting); `ENOMEDIUM` (the request fails, the
    /// volume serves on) when no such leg is left (regions with no current copy: an
    /// operator's decision, docs/mirror.md).
    #[cold]
    fn no_leg_errno(&self, i: usize) -> i32 {
        let op = self.ops[i].as_ref().expect("live op");
        let alive = self.shared.alive();
        match op.kind {
            Kind::Flush => -libc::ENOLINK,
            _ if self
                .shared
                .current_sets(alive, op.offset, op.len, op.regions)
                & 1
                == 0 =>
            {
                -libc::ENOLINK
            }
            _ => -libc::ENOMEDIUM,
        }
    }

    /// Submits `op`'s range on leg `slot`: one piece per leg piece it touches.
    #[inline]
    fn submit_leg(&mut self, i: usize, slot: u8) {
        let op = self.ops[i].as_ref().expect("live op");
        let (offset, len) = (op.offset, op.len);
        self.submit_leg_range(i, slot, offset, len);
    }

    /// Submits `[offset, offset + len)` of op `i` (within its range) on leg `slot`. (Borrows
    /// the fields apart rather than cloning the shared state's `Arc`: its count is one cache
    /// line every queue of the volume would bounce per request.)
    fn submit_leg_range(&mut self, i: usize, slot: u8, offset: u64, len: u64) {
        let MirrorQueue {
            shared,
            ops,
            queues,
            outstanding,
            progress,
            ..
        } = self;
        let Some(pieces) = shared.leg(slot).map(|l| l.pieces.as_slice()) else {
            return;
        };
        let op = ops[i].as_mut().expect("live op");
        let tag = ((i as u64) << SLOT_BITS) | slot as u64;
        let skip = offset - op.offset;
        split(pieces, offset, len, |device, dev_off, n, at| {
            let io = piece_io(op, dev_off, n, skip + at);
            // SAFETY: buffers and iovec arrays stay valid until this piece is reaped: the
            // caller's by the submit contract, split arrays because `op` keeps them.
            unsafe { queues[device].submit(io, tag) };
            op.pieces.issue();
            busy(outstanding, progress, device);
        });
    }

    /// Reads go to one leg holding current data in every region they touch (or, with none,
    /// region by region: `queue/mixed.rs`).
    fn submit_read(&mut self, i: usize) -> bool {
        let op = self.ops[i].as_ref().expect("live op");
        let mut choices = self.readable(op) & !op.issued;
        if choices == 0 {
            // No leg current in all of it: each region's part from a leg current there.
            return op.issued == 0 && self.submit_mixed_read(i);
        }
        if choices & !self.shared.far != 0 {
            choices &= !self.shared.far;
        }
        let mut slot = self.next_read % 3;
        while choices & stale(slot) == 0 {
            slot = (slot + 1) % 3;
        }
        self.next_read = (slot + 1) % 3;
        self.ops[i].as_mut().expect("live op").issued |= stale(slot);
        self.submit_leg(i, slot);
        true
    }

    /// A write starts only when a leg that is current in all of its regions can take it: a
    /// write that only reached legs still being copied to would be acknowledged with no
    /// readable copy holding it. While the copy holds one of its regions it waits (queued,
    /// not blocking the worker) and is tried again at the next reap.
    fn submit_write(&mut self, i: usize) -> bool {
        let op = self.ops[i].as_ref().expect("live op");
        let writable = self.shared.usable(self.healthy, op.offset, op.len);
        let current = self
            .shared
            .current(self.healthy, op.offset, op.len, op.regions);
        let sets = match current {
            0 => self
                .shared
                .current_sets(self.healthy, op.offset, op.len, op.regions),
            c => 1 << c,
        };
        let required = self
            .shared
            .required
            .load(std::sync::atomic::Ordering::Acquire);
        if sets & 1 != 0 || required & !writable != 0 {
            return false;
        }
        let (first, last) = op.regions;
        let all = self.shared.all_slots();
        match self.shared.regions.enter_write(first, last, all, writable) {
            Entry::NoCurrent => return false,
            Entry::Held => {
                self.waiting.push_back(i);
                // Woken when the copy lets a region go (at once if it did already): the
                // worker does not poll for it meanwhile.
                if !self.shared.regions.wait_for_copy(first, last, &self.event) {
                    let _ = (&*self.event).write(&1u64.to_ne_bytes());
                }
                return true;
            }
            Entry::Entered { sync: true } => self.shared.regions.bitmap.sync(first, last),
            Entry::Entered { sync: false } => {}
        }
        let op = self.ops[i].as_mut().expect("live op");
        op.issued = writable;
        op.current = current;
        for slot in 0..3u8 {
            if writable & stale(slot) != 0 {
                self.submit_leg(i, slot);
            }
        }
        true
    }

    /// Tries the writes waiting for the copy again (those still waiting wait for the next
    /// release of a region the copy holds).
    fn retry_waiting(&mut self) {
        for i in std::mem::take(&mut self.waiting) {
            if !self.submit_write(i) {
                self.fail_unstarted(i);
            }
        }
        let _ = self.kick();
    }

    /// Completes op `i`, which no leg took, with the error that says why.
    fn fail_unstarted(&mut self, i: usize) {
        let res = self.no_leg_errno(i);
        let tag = self.ops[i].take().expect("live op").tag;
        self.free.push(i);
        self.in_flight -= 1;
        self.finish_now(tag, res);
    }

    /// The last piece of op `i` came back: retry a failed read elsewhere, or settle.
    fn settle(&mut self, i: usize) {
        let op = self.ops[i].as_mut().expect("live op");
        op.split.clear();
        let mut read_err = 0;
        if op.kind == Kind::Read && op.pieces.failed_targets() != 0 {
            let (first, last) = op.regions;
            // Repair: the leg's range is rewritten from a good copy by the resync thread;
            // only when another leg holds every acknowledged write there (marking the only
            // copy stale would leave nothing to read: the read fails as on a plain device).
            let media = op.pieces.media_targets();
            if media != 0 {
                let others = self.shared.all_slots() & !media;
                let marked = (first..=last).fold(false, |m, r| {
                    self.shared.regions.mark_keeping(r, media, others).1 | m
                });
                if marked {
                    self.shared.regions.bitmap.sync(first, last);
                }
            }
            read_err = op.pieces.retry();
            if self.submit_read(i) {
                return;
            }
        }
        let op = self.ops[i].take().expect("live op");
        self.free.push(i);
        let failed = op.pieces.failed_targets();
        let res = match op.kind {
            Kind::Read if read_err != 0 => read_err,
            Kind::Read => op.pieces.first_error(),
            Kind::Flush => self.settle_flush(&op, failed),
            // Done when, in each of its regions, a leg still current there took it all (in a
            // range whose regions are current on different legs, a different leg in each:
            // every leg gets the whole write); the legs that failed then missed it (marked
            // stale before the completion). When no leg still current in some region took
            // it (every current leg failed, or the one that took it was made stale meanwhile
            // by a write it missed that the failed one took), the write failed as a whole:
            // its blocks are indeterminate on every leg, as for any failed write, and that
            // region's current legs stay the copy source.
            Kind::Write | Kind::Zeroes => {
                let (first, last) = op.regions;
                let taking_over = self
                    .shared
                    .taking_over
                    .load(std::sync::atomic::Ordering::Acquire);
                let res = if failed & taking_over != 0 {
                    // A leg taking over missed it: failed as a whole, nothing marked (the
                    // legs that go would hold it alone); sent again, it reaches the ones
                    // that stay.
                    self.shared.regions.wrote(first, last);
                    -libc::ENOLINK
                } else if mixed::took(&self.shared, &op, failed) {
                    self.shared.regions.wrote(first, last);
                    // A required leg missed it: held (a path error) until it can take it.
                    let required = self
                        .shared
                        .required
                        .load(std::sync::atomic::Ordering::Acquire);
                    match failed & required {
                        0 => 0,
                        _ => -libc::ENOLINK,
                    }
                } else {
                    match op.pieces.first_error() {
                        0 => -libc::EIO,
                        e => e,
                    }
                };
                self.shared.regions.leave(first, last);
                res
            }
        };
        self.in_flight -= 1;
        self.done.push_back((op.tag, res));
    }
}

/// One more command outstanding on device `d` (its progress clock starts when it was idle).
#[inline]
fn busy(outstanding: &mut [u32], progress: &mut [Instant], d: usize) {
    outstanding[d] += 1;
    if outstanding[d] == 1 {
        progress[d] = Instant::now();
    }
}

impl DeviceQueue for MirrorQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        self.check_epochs();
        let (kind, offset, len, iov, iovcnt) = match io {
            DeviceIo::Read {
                offset,
                len,
                iov,
                iovcnt,
            } => (Kind::Read, offset, len, iov, iovcnt),
            DeviceIo::Write {
                offset,
                len,
                iov,
                iovcnt,
            } => (Kind::Write, offset, len, iov, iovcnt),
            DeviceIo::Discard { offset, len } | DeviceIo::WriteZeroes { offset, len } => {
                (Kind::Zeroes, offset, len, std::ptr::null(), 0)
            }
            DeviceIo::Flush => (Kind::Flush, 0, 0, std::ptr::null(), 0),
        };
        self.in_flight += 1;
        if len > 0
            && offset
                .checked_add(len)
                .is_none_or(|end| end > self.shared.spec.size)
        {
            self.in_flight -= 1;
            return self.finish_now(tag, -libc::EINVAL);
        }
        let fenced = self
            .shared
            .regions
            .fenced
            .load(std::sync::atomic::Ordering::Acquire);
        if kind != Kind::Read && fenced {
            self.in_flight -= 1;
            return self.finish_now(tag, -libc::EROFS);
        }
        let regions = self.shared.regions.span(offset, len);
        let i = self.new_op(Op {
            tag,
            kind,
            offset,
            len,
            iov,
            iovcnt,
            regions,
            pieces: Fanout::default(),
            issued: 0,
            current: 0,
            split: Vec::new(),
            flush_failed: 0,
            flush: 0,
        });
        let started = match kind {
            Kind::Read => self.submit_read(i),
            Kind::Write | Kind::Zeroes => self.submit_write(i),
            Kind::Flush => self.submit_flush(i),
        };
        if !started {
            self.fail_unstarted(i);
        }
    }

    fn kick(&mut self) -> std::io::Result<()> {
        for q in &mut self.queues {
            q.kick()?;
        }
        Ok(())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        self.check_epochs();
        if !self.waiting.is_empty() {
            self.retry_waiting();
        }
        let mut finished = std::mem::take(&mut self.finished);
        for d in 0..self.queues.len() {
            let (ops, shared) = (&mut self.ops, &self.shared);
            let mut reaped = 0;
            self.queues[d].reap(&mut |sub, res| {
                reaped += 1;
                let (i, slot) = ((sub >> SLOT_BITS) as usize, (sub & 3) as u8);
                let Some(Some(op)) = ops.get_mut(i) else {
                    return;
                };
                if res < 0 && slot == FLUSH_SLOT {
                    op.flush_failed |= 1u64.checked_shl(d as u32).unwrap_or(0);
                }
                if res < 0 {
                    // Where on the device, as the worker reports a plain volume's pieces (a
                    // flush has no range).
                    let (offset, len) = match slot {
                        FLUSH_SLOT => (0, 0),
                        _ => device_range(shared, slot, d, op.offset, op.len),
                    };
                    let at = PieceAt {
                        target: slot,
                        offset,
                        len,
                        write: op.kind != Kind::Read,
                    };
                    op.pieces
                        .piece_failed(-res, at, shared.spec.devices[d].health());
                }
                if op.pieces.piece_back(res >= 0) {
                    finished.push(i);
                }
            });
            if reaped > 0 {
                self.outstanding[d] = self.outstanding[d].saturating_sub(reaped);
                self.progress[d] = Instant::now();
            }
        }
        if !finished.is_empty() {
            for &i in &finished {
                self.settle(i);
            }
            for q in &mut self.queues {
                let _ = q.kick();
            }
            finished.clear();
        }
        self.finished = finished;
        spool_devices::drain_done(&mut self.done, done)
    }

    fn completion_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    fn ack_completion_event(&self) {
        for q in &self.queues {
            q.ack_completion_event();
        }
        let mut buf = [0u8; 8];
        let _ = (&*self.event).read(&mut buf);
    }

    fn set_completion_events(&mut self, enabled: bool) {
        for q in &mut self.queues {
            q.set_completion_events(enabled);
        }
    }

    fn polled(&self) -> bool {
        self.queues.iter().any(|q| q.polled())
    }

    fn in_flight(&self) -> usize {
        self.in_flight + self.done.len()
    }

    /// The worker aborts after its timeout sweep reported a request hung (or the mirror's
    /// health changed): only leg devices with commands outstanding and no completion for
    /// [`HUNG`] are aborted, and reported as timed out to their own health cell (the monitor
    /// resets them); their commands come back cancelled and count as that leg failing.
    fn abort(&mut self) -> usize {
        // Writes waiting for the copy hold nothing of a device: given back at once, to be
        // submitted again.
        let mut n = self.waiting.len();
        for i in std::mem::take(&mut self.waiting) {
            let tag = self.ops[i].take().expect("live op").tag;
            self.free.push(i);
            self.in_flight -= 1;
            self.finish_now(tag, -libc::ECANCELED);
        }
        for d in 0..self.queues.len() {
            if self.outstanding[d] > 0 && self.progress[d].elapsed() >= HUNG {
                self.shared.spec.devices[d].health().report(ErrorReport {
                    signal: Signal::Timeout,
                    offset: 0,
                    len: 0,
                    write: false,
                });
                n += self.queues[d].abort();
            }
        }
        n
    }
}

/// The first range of device `d` that leg `slot` maps volume bytes `[offset, offset + len)`
/// onto, as (device offset, length); `(0, 0)` when none does.
fn device_range(shared: &Shared, slot: u8, d: usize, offset: u64, len: u64) -> (u64, u64) {
    let end = offset + len;
    let pieces = shared.leg(slot).map(|l| l.pieces.as_slice()).unwrap_or(&[]);
    pieces
        .iter()
        .filter(|p| p.device == d && p.logical < end && offset < p.logical + p.len)
        .map(|p| {
            let from = offset.max(p.logical);
            let to = end.min(p.logical + p.len);
            (p.offset + (from - p.logical), to - from)
        })
        .next()
        .unwrap_or((0, 0))
}
