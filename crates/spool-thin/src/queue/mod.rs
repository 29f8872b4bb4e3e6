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

use spool_devices::fanout::{Fanout, PieceAt};
use spool_devices::{DeviceIo, DeviceQueue, IoVec};

use crate::grace::Readers;

mod dispatch;
use crate::shared::{Mailbox, Note, Shared};

/// One request of the worker's, spread over chunks.
struct Op {
    tag: u64,
    io: DeviceIo,
    /// Its pieces on the pool devices (the fan-out engine's count; targets: device
    /// indices), and its first failure, a piece's or not (no queue, no chunk).
    pieces: Fanout,
    /// An unmap asked of the allocator and not answered yet.
    unmapping: bool,
    /// Waiting for chunks to be allocated.
    parked: bool,
    /// Which unmap answer is this request's (slots are reused).
    seq: u32,
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
    /// Chunks this queue asked the allocator for and has no answer about yet.
    requested: std::collections::HashSet<u64>,
    /// Ops whose last piece came back in this reap (kept to reuse its allocation).
    finished: Vec<usize>,
    done: VecDeque<(u64, i32)>,
    in_flight: usize,
    /// The last unmap token's sequence number.
    seq: u32,
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
            requested: Default::default(),
            finished: Vec::new(),
            done: VecDeque::new(),
            in_flight: 0,
            seq: 0,
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

    fn op(&mut self, idx: usize) -> &mut Op {
        self.ops[idx].as_mut().expect("live op")
    }

    /// Leaves the grace period once no piece is on a device, and completes the request
    /// once nothing of it is outstanding.
    fn maybe_finish(&mut self, idx: usize) {
        let op = self.ops[idx].as_mut().expect("live op");
        if op.pieces.pending() > 0 {
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
        self.done.push_back((op.tag, op.pieces.first_error()));
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
                Note::Mapped { chunk } => {
                    self.requested.remove(&chunk);
                }
                Note::Failed { chunk, errno } => {
                    self.requested.remove(&chunk);
                    for &idx in &self.parked {
                        let op = self.ops[idx].as_mut().expect("parked op");
                        if op_chunks(&op.io, self.shared.spec.chunk).contains(&chunk) {
                            op.pieces.set_failure(errno);
                        }
                    }
                }
                Note::Unmapped { token, errno } => {
                    let idx = (token >> 32) as usize;
                    // A token of a request cancelled since (its slot free or reused) is
                    // ignored.
                    let Some(op) = self.ops.get_mut(idx).and_then(Option::as_mut) else {
                        continue;
                    };
                    if !op.unmapping || op.seq != token as u32 {
                        continue;
                    }
                    op.unmapping = false;
                    op.pieces.note_failure(errno);
                    self.maybe_finish(idx);
                }
            }
        }
        // Parked writes go out once every chunk they touch is mapped (or fail); the others
        // keep waiting, and ask again for a hole nobody asked for (one that was mapped and
        // then discarded again before they looked).
        let mut again = false;
        for idx in std::mem::take(&mut self.parked) {
            let op = self.ops[idx].as_ref().expect("parked op");
            let holes = self.blocked(&op.io);
            if op.pieces.first_error() == 0 && !holes.is_empty() {
                for c in holes {
                    self.ask(c);
                }
                self.parked.push(idx);
                continue;
            }
            let op = self.op(idx);
            op.parked = false;
            if op.pieces.first_error() != 0 {
                self.maybe_finish(idx);
            } else {
                again = true;
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

    /// Asks the allocator for chunk `c` unless this queue already did and has had no answer.
    pub(super) fn ask(&mut self, c: u64) {
        if self.requested.insert(c) {
            self.shared.request_chunk(c, &self.mailbox);
        }
    }

    /// Completes every parked write with `ECANCELED` (they touched no buffer and no device:
    /// the worker submits them again, or, stopping, fails them); returns how many.
    fn cancel_parked(&mut self) -> usize {
        let parked = std::mem::take(&mut self.parked);
        let n = parked.len();
        for idx in parked {
            let op = self.op(idx);
            op.parked = false;
            op.pieces.set_failure(-libc::ECANCELED);
            self.maybe_finish(idx);
        }
        if n > 0 && self.completion_events {
            self.mailbox.ring();
        }
        n
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
        if moved || thin_reset || self.shared.copy_lost() {
            self.shared.follow_health();
        }
    }
}

/// Where read or write `io`'s piece on pool device `d` went (the first, when several did),
/// as the map names its chunks now: what a failed piece's health report says. (0, 0) for
/// the rest, as for a plain volume's (a trim's whole chunks go to the allocator, not to a
/// device), and for a chunk the map no longer names.
#[cold]
fn piece_at(shared: &Shared, io: &DeviceIo, d: usize) -> PieceAt {
    let (offset, len, write) = match *io {
        DeviceIo::Read { offset, len, .. } => (offset, len, false),
        DeviceIo::Write { offset, len, .. } => (offset, len, true),
        _ => (0, 0, false),
    };
    let chunk = shared.spec.chunk;
    let mut at = PieceAt {
        target: u8::try_from(d).unwrap_or(u8::MAX),
        offset: 0,
        len: 0,
        write,
    };
    let on_d = crate::map::chunk_pieces(chunk, offset, len).find_map(|(c, within, n, _)| {
        let (dev, off) = shared.map.get(c)?;
        (dev == d).then_some((off + within, n))
    });
    if let Some((offset, len)) = on_d {
        (at.offset, at.len) = (offset, len);
    }
    at
}

/// The chunks a write or write-zeroes touches (none for other requests).
fn op_chunks(io: &DeviceIo, chunk: u64) -> std::ops::Range<u64> {
    match *io {
        DeviceIo::Write { offset, len, .. } | DeviceIo::WriteZeroes { offset, len } => {
            offset / chunk..(offset + len).div_ceil(chunk)
        }
        _ => 0..0,
    }
}

impl ThinQueue {
    /// The chunks the allocator must map or copy before `io` may go out: a write's holes
    /// and shared chunks, the shared chunks a write-zeroes covers in part.
    fn blocked(&self, io: &DeviceIo) -> Vec<u64> {
        let (chunk, map) = (self.shared.spec.chunk, &self.shared.map);
        match *io {
            DeviceIo::Write { .. } => op_chunks(io, chunk)
                .filter(|&c| map.get_for_write(c).is_none())
                .collect(),
            DeviceIo::WriteZeroes { offset, len } => op_chunks(io, chunk)
                .filter(|&c| {
                    let whole = c * chunk >= offset && (c + 1) * chunk <= offset + len;
                    !whole && map.is_shared(c)
                })
                .collect(),
            _ => Vec::new(),
        }
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
            pieces: Fanout::default(),
            unmapping: false,
            parked: false,
            seq: 0,
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
        let mut finished = std::mem::take(&mut self.finished);
        for d in 0..self.queues.len() {
            let Some(q) = self.queues[d].as_mut() else {
                continue;
            };
            let (ops, shared) = (&mut self.ops, &self.shared);
            let dev = &self.devs[d];
            q.reap(&mut |sub, res| {
                let op = ops[sub as usize].as_mut().expect("piece of a live op");
                if res < 0 {
                    match dev {
                        Some(dev) => {
                            let at = piece_at(shared, &op.io, d);
                            op.pieces.piece_failed(-res, at, dev.health());
                        }
                        None => op.pieces.note_failure(res),
                    }
                }
                if op.pieces.piece_back(res >= 0) {
                    finished.push(sub as usize);
                }
            });
        }
        for &idx in &finished {
            self.maybe_finish(idx);
        }
        finished.clear();
        self.finished = finished;
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

    /// Aborts the pool devices' hung commands, and cancels the writes parked for a chunk
    /// (a stop or a reset must not wait `full_wait` for them).
    fn abort(&mut self) -> usize {
        let n: usize = self.queues.iter_mut().flatten().map(|q| q.abort()).sum();
        n + self.cancel_parked()
    }

    fn abandon(&mut self) -> usize {
        let n: usize = self.queues.iter_mut().flatten().map(|q| q.abandon()).sum();
        n + self.cancel_parked()
    }
}
