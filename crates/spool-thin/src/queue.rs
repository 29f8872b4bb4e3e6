//! One worker's queue on a thin volume: each request looked up in the chunk map and sent on
//! to the queues of the pool devices holding its chunks.
//!
//! Reads of holes are zero-filled here; writes that touch a hole wait (parked, not on any
//! device) until the allocator has mapped every chunk they touch, then go out like any
//! other; discards and write-zeroes give whole chunks back through the allocator and pass
//! their partial chunks on to the devices (a hole needs nothing). A request enters the grace
//! period before it reads the map and leaves it when its last device piece completes, so no
//! chunk it may be writing goes back to the pool before then. Errors of a pool device are
//! reported to that device's health cell and returned as they came; a device not in the
//! pool, or isolated, fails its pieces with `ENOMEDIUM`.
//!
//! Owns: request splitting over chunks, per-request results, the pool devices' queues
//! (opened on first use). Must not know: virtio, the pool.

use std::collections::VecDeque;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use spool_devices::iov::split_iov;
use spool_devices::{DeviceIo, DeviceQueue, ErrorReport, IoVec, Signal};

use crate::grace::Readers;
use crate::shared::{Mailbox, Note, Shared, Unmap};

/// One request of the worker's, spread over chunks.
struct Op {
    tag: u64,
    io: DeviceIo,
    /// Device pieces outstanding.
    pending: u32,
    /// An unmap asked of the allocator and not answered yet.
    unmapping: bool,
    /// Waiting for chunks to be allocated.
    parked: bool,
    err: i32,
    /// The grace phase while pieces are on devices.
    phase: Option<u64>,
    /// Iovec arrays of pieces that split the request's own (kept until completion).
    split: Vec<Box<[IoVec]>>,
}

/// A worker's queue on a thin volume (see the module doc).
pub struct ThinQueue {
    shared: Arc<Shared>,
    depth: u32,
    readers: Arc<Readers>,
    mailbox: Arc<Mailbox>,
    /// Pool device queues by the map's device index (opened on first use), and their
    /// devices.
    queues: Vec<Option<Box<dyn DeviceQueue>>>,
    devs: Vec<Option<Arc<spool_devices::Device>>>,
    /// The pool devices' health epochs this queue last saw.
    epochs: Vec<u64>,
    ops: Vec<Option<Op>>,
    free: Vec<usize>,
    parked: Vec<usize>,
    done: VecDeque<(u64, i32)>,
    in_flight: usize,
    completion_events: bool,
    epoll: OwnedFd,
}

// SAFETY: the raw iovec pointers in `ops` belong to the caller of `submit`, which keeps them
// valid until completion (`DeviceQueue::submit`); one worker thread at a time uses the queue.
unsafe impl Send for ThinQueue {}

impl ThinQueue {
    pub(crate) fn new(shared: Arc<Shared>, depth: u32) -> std::io::Result<ThinQueue> {
        let epoll = spool_devices::epoll_new()?;
        let mailbox = Arc::new(Mailbox::new()?);
        spool_devices::epoll_watch(epoll.as_raw_fd(), mailbox.event.as_raw_fd())?;
        Ok(ThinQueue {
            readers: shared.grace.register(),
            shared,
            depth,
            mailbox,
            queues: Vec::new(),
            devs: Vec::new(),
            epochs: Vec::new(),
            ops: Vec::new(),
            free: Vec::new(),
            parked: Vec::new(),
            done: VecDeque::new(),
            in_flight: 0,
            completion_events: true,
            epoll,
        })
    }

    /// The queue of pool device `d`, opened on first use; a negative errno when the device
    /// is not in the pool, isolated, or its queue cannot be opened.
    #[inline]
    fn queue(&mut self, d: usize) -> Result<&mut Box<dyn DeviceQueue>, i32> {
        if self.queues.get(d).is_some_and(Option::is_some) {
            let dev = self.devs[d].as_ref().expect("opened with its device");
            if dev.health().state().isolated() {
                return Err(-libc::ENOMEDIUM);
            }
            return Ok(self.queues[d].as_mut().expect("checked above"));
        }
        self.open(d)
    }

    #[cold]
    fn open(&mut self, d: usize) -> Result<&mut Box<dyn DeviceQueue>, i32> {
        let dev = self.shared.device(d).ok_or(-libc::ENOMEDIUM)?;
        if dev.health().state().isolated() {
            return Err(-libc::ENOMEDIUM);
        }
        if self.queues.len() <= d {
            self.queues.resize_with(d + 1, || None);
            self.devs.resize_with(d + 1, || None);
            self.epochs.resize(d + 1, 0);
        }
        let mut q = dev.open_queue(self.depth).map_err(|e| {
            tracing::error!(device = %dev.path().display(), error = %e, "opening a queue for a thin volume failed");
            -libc::EIO
        })?;
        spool_devices::epoll_watch(self.epoll.as_raw_fd(), q.completion_fd())
            .map_err(|_| -libc::EIO)?;
        q.set_completion_events(self.completion_events);
        self.epochs[d] = dev.health().load().1;
        self.devs[d] = Some(dev);
        self.queues[d] = Some(q);
        Ok(self.queues[d].as_mut().expect("opened above"))
    }

    /// Sends request `idx` on (or parks it, or finishes it).
    fn dispatch(&mut self, idx: usize) {
        let io = self.ops[idx].as_ref().expect("live op").io;
        match io {
            DeviceIo::Read {
                offset,
                len,
                iov,
                iovcnt,
            } => self.dispatch_data(idx, false, offset, len, iov, iovcnt),
            DeviceIo::Write {
                offset,
                len,
                iov,
                iovcnt,
            } => self.dispatch_data(idx, true, offset, len, iov, iovcnt),
            DeviceIo::Flush => self.dispatch_flush(idx),
            DeviceIo::Discard { offset, len } | DeviceIo::WriteZeroes { offset, len } => {
                self.dispatch_trim(idx, offset, len)
            }
        }
    }

    /// The chunk pieces of `[offset, offset + len)`: (chunk, offset within it, length,
    /// offset within the request).
    fn pieces(&self, offset: u64, len: u64) -> Vec<(u64, u64, u64, u64)> {
        let chunk = self.shared.spec.chunk;
        let mut out = Vec::with_capacity(1);
        let mut done = 0;
        while done < len {
            let pos = offset + done;
            let within = pos % chunk;
            let n = (chunk - within).min(len - done);
            out.push((pos / chunk, within, n, done));
            done += n;
        }
        out
    }

    fn dispatch_data(
        &mut self,
        idx: usize,
        write: bool,
        offset: u64,
        len: u64,
        iov: *const IoVec,
        iovcnt: u32,
    ) {
        let chunk = self.shared.spec.chunk;
        if len > 0 && offset / chunk == (offset + len - 1) / chunk {
            return self.dispatch_one(idx, write, offset, len, iov, iovcnt);
        }
        let phase = self.shared.grace.enter(&self.readers);
        let pieces = self.pieces(offset, len);
        let found: Vec<Option<(usize, u64)>> =
            pieces.iter().map(|p| self.shared.map.get(p.0)).collect();
        if write && found.iter().any(Option::is_none) {
            self.shared.grace.leave(&self.readers, phase);
            for (p, f) in pieces.iter().zip(&found) {
                if f.is_none() {
                    self.shared.request_chunk(p.0, &self.mailbox);
                }
            }
            self.ops[idx].as_mut().expect("live op").parked = true;
            self.parked.push(idx);
            return;
        }
        self.op(idx).phase = Some(phase);
        // SAFETY: the caller of `submit` keeps the iovec array valid until completion.
        let iovs = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
        let whole = pieces.len() == 1;
        for (&(_, within, n, at), f) in pieces.iter().zip(&found) {
            let Some((d, off)) = *f else {
                zero_fill(iovs, at, n);
                continue;
            };
            let (piov, pcnt) = if whole {
                (iov, iovcnt)
            } else {
                let s = split_iov(iovs, at, n);
                let r = (s.as_ptr(), s.len() as u32);
                self.op(idx).split.push(s);
                r
            };
            match self.queue(d) {
                Ok(q) => {
                    // SAFETY: the pieces' iovecs point into the caller's buffers, valid until
                    // the request completes; split arrays live in the op until then.
                    unsafe {
                        q.submit(
                            DeviceIo::data(write, off + within, n, piov, pcnt),
                            idx as u64,
                        )
                    };
                    self.op(idx).pending += 1;
                }
                Err(e) => self.op(idx).err = e,
            }
        }
        self.maybe_finish(idx);
    }

    /// A request within one chunk (nearly all of them): no splitting, no allocation.
    #[inline]
    fn dispatch_one(
        &mut self,
        idx: usize,
        write: bool,
        offset: u64,
        len: u64,
        iov: *const IoVec,
        iovcnt: u32,
    ) {
        let chunk = self.shared.spec.chunk;
        let phase = self.shared.grace.enter(&self.readers);
        match self.shared.map.get(offset / chunk) {
            None if write => {
                self.shared.grace.leave(&self.readers, phase);
                self.shared.request_chunk(offset / chunk, &self.mailbox);
                self.op(idx).parked = true;
                self.parked.push(idx);
            }
            None => {
                self.shared.grace.leave(&self.readers, phase);
                // SAFETY: the caller of `submit` keeps the iovec array valid until completion.
                zero_fill(
                    unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) },
                    0,
                    len,
                );
                self.maybe_finish(idx);
            }
            Some((d, off)) => {
                self.op(idx).phase = Some(phase);
                let at = off + offset % chunk;
                match self.queue(d) {
                    Ok(q) => {
                        // SAFETY: the caller's iovecs, valid until the request completes.
                        unsafe {
                            q.submit(DeviceIo::data(write, at, len, iov, iovcnt), idx as u64)
                        };
                        self.op(idx).pending = 1;
                    }
                    Err(e) => self.op(idx).err = e,
                }
                self.maybe_finish(idx);
            }
        }
    }

    fn dispatch_flush(&mut self, idx: usize) {
        let mut n = 0;
        for q in self.queues.iter_mut().flatten() {
            // SAFETY: a flush carries no buffers.
            unsafe { q.submit(DeviceIo::Flush, idx as u64) };
            n += 1;
        }
        self.op(idx).pending = n;
        self.maybe_finish(idx);
    }

    /// Discard or write-zeroes: whole chunks are unmapped, partial ones passed on.
    fn dispatch_trim(&mut self, idx: usize, offset: u64, len: u64) {
        let chunk = self.shared.spec.chunk;
        let zeroes = matches!(self.op(idx).io, DeviceIo::WriteZeroes { .. });
        let phase = self.shared.grace.enter(&self.readers);
        self.op(idx).phase = Some(phase);
        let (mut first, mut end) = (u64::MAX, 0);
        for (c, within, n, _) in self.pieces(offset, len) {
            if n == chunk {
                first = first.min(c);
                end = end.max(c + 1);
                continue;
            }
            let Some((d, off)) = self.shared.map.get(c) else {
                continue;
            };
            let io = if zeroes {
                DeviceIo::WriteZeroes {
                    offset: off + within,
                    len: n,
                }
            } else {
                DeviceIo::Discard {
                    offset: off + within,
                    len: n,
                }
            };
            match self.queue(d) {
                Ok(q) => {
                    // SAFETY: no buffers.
                    unsafe { q.submit(io, idx as u64) };
                    self.op(idx).pending += 1;
                }
                Err(e) => self.op(idx).err = e,
            }
        }
        if first < end {
            self.op(idx).unmapping = true;
            self.shared.request_unmap(Unmap {
                first,
                end,
                token: idx as u64,
                mailbox: self.mailbox.clone(),
            });
        }
        self.maybe_finish(idx);
    }

    fn op(&mut self, idx: usize) -> &mut Op {
        self.ops[idx].as_mut().expect("live op")
    }

    /// Leaves the grace period once no piece is on a device, and completes the request
    /// once nothing of it is outstanding.
    fn maybe_finish(&mut self, idx: usize) {
        let op = self.ops[idx].as_mut().expect("live op");
        if op.pending > 0 {
            return;
        }
        if let Some(p) = op.phase.take() {
            self.shared.grace.leave(&self.readers, p);
        }
        if op.unmapping || op.parked {
            return;
        }
        let op = self.ops[idx].take().expect("live op");
        self.free.push(idx);
        self.in_flight -= 1;
        self.done.push_back((op.tag, op.err));
    }

    /// Acts on the allocator's notes: failed chunks fail the parked writes that need them,
    /// answered unmaps complete their requests, and every other parked write is tried again.
    fn read_mail(&mut self) {
        if !self.mailbox.has_mail() {
            return;
        }
        let notes = self.mailbox.take();
        for n in notes {
            match n {
                Note::Failed { chunk, errno } => {
                    let cs = self.shared.spec.chunk;
                    for &idx in &self.parked {
                        let op = self.ops[idx].as_mut().expect("parked op");
                        if let DeviceIo::Write { offset, len, .. } = op.io {
                            if (offset / cs..(offset + len).div_ceil(cs)).contains(&chunk) {
                                op.err = errno;
                            }
                        }
                    }
                }
                Note::Unmapped { token, errno } => {
                    let idx = token as usize;
                    let op = self.op(idx);
                    op.unmapping = false;
                    if errno != 0 && op.err == 0 {
                        op.err = errno;
                    }
                    self.maybe_finish(idx);
                }
            }
        }
        let parked = std::mem::take(&mut self.parked);
        let again = !parked.is_empty();
        for idx in parked {
            let op = self.op(idx);
            op.parked = false;
            if op.err != 0 {
                self.maybe_finish(idx);
            } else {
                self.dispatch(idx);
            }
        }
        if again {
            // What went out now was submitted after the worker's kick.
            if let Err(e) = self.kick() {
                tracing::warn!(error = %e, "kicking a thin volume's device queues failed");
            }
        }
    }

    /// Follows the pool devices' health (one load per open queue).
    fn check_epochs(&mut self) {
        let mut moved = false;
        for (d, dev) in self.devs.iter().enumerate() {
            if let Some(dev) = dev {
                let e = dev.health().load().1;
                if e != self.epochs[d] {
                    self.epochs[d] = e;
                    moved = true;
                }
            }
        }
        let thin_reset = self
            .shared
            .health
            .get()
            .is_some_and(|c| c.state() != spool_devices::HealthState::Healthy);
        if moved || thin_reset {
            self.shared.follow_health();
        }
    }
}

/// Zeroes bytes `[at, at + n)` of what `iov` describes.
fn zero_fill(iov: &[IoVec], at: u64, n: u64) {
    for v in split_iov(iov, at, n).iter() {
        // SAFETY: the caller of `submit` keeps the buffers valid and ours to write until the
        // read completes; `split_iov` stays within them.
        unsafe { std::ptr::write_bytes(v.iov_base as *mut u8, 0, v.iov_len) };
    }
}

impl DeviceQueue for ThinQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        let idx = self.free.pop().unwrap_or_else(|| {
            self.ops.push(None);
            self.ops.len() - 1
        });
        self.ops[idx] = Some(Op {
            tag,
            io,
            pending: 0,
            unmapping: false,
            parked: false,
            err: 0,
            phase: None,
            split: Vec::new(),
        });
        self.in_flight += 1;
        self.dispatch(idx);
        if !self.done.is_empty() && self.completion_events {
            self.mailbox.ring();
        }
    }

    fn kick(&mut self) -> std::io::Result<()> {
        for q in self.queues.iter_mut().flatten() {
            q.kick()?;
        }
        Ok(())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        self.check_epochs();
        self.read_mail();
        let mut finished = Vec::new();
        for d in 0..self.queues.len() {
            let Some(q) = self.queues[d].as_mut() else {
                continue;
            };
            let ops = &mut self.ops;
            let dev = &self.devs[d];
            q.reap(&mut |sub, res| {
                let op = ops[sub as usize].as_mut().expect("piece of a live op");
                if res < 0 {
                    if res != -libc::ECANCELED {
                        if let Some(dev) = dev {
                            dev.health().report(ErrorReport {
                                signal: Signal::Errno(-res),
                                offset: 0,
                                len: 0,
                                write: matches!(op.io, DeviceIo::Write { .. }),
                            });
                        }
                    }
                    if op.err == 0 {
                        op.err = res;
                    }
                }
                op.pending -= 1;
                if op.pending == 0 {
                    finished.push(sub as usize);
                }
            });
        }
        for idx in finished {
            self.maybe_finish(idx);
        }
        let n = self.done.len();
        while let Some((tag, res)) = self.done.pop_front() {
            done(tag, res);
        }
        n
    }

    fn completion_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    fn ack_completion_event(&self) {
        for q in self.queues.iter().flatten() {
            q.ack_completion_event();
        }
        let mut buf = [0u8; 8];
        let _ = (&self.mailbox.event).read(&mut buf);
    }

    fn set_completion_events(&mut self, enabled: bool) {
        self.completion_events = enabled;
        for q in self.queues.iter_mut().flatten() {
            q.set_completion_events(enabled);
        }
    }

    fn polled(&self) -> bool {
        self.queues.iter().flatten().any(|q| q.polled())
    }

    fn in_flight(&self) -> usize {
        self.in_flight + self.done.len()
    }

    fn abort(&mut self) -> usize {
        self.queues.iter_mut().flatten().map(|q| q.abort()).sum()
    }

    fn abandon(&mut self) -> usize {
        self.queues.iter_mut().flatten().map(|q| q.abandon()).sum()
    }
}
