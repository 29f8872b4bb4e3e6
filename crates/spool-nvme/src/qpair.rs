//! One submission/completion queue pair, polled by phase tag.
//!
//! Owned by exactly one thread (a worker, or the admin path under its lock). Commands are
//! written to the SQ and the tail doorbell is rung once per batch ([`QueuePair::ring`]);
//! completions are found by the phase bit flipping in the CQ, and the CQ head doorbell is
//! written once per poll. At most `depth - 1` commands are outstanding, so the SQ can never
//! overflow whatever order the controller fetches in.

use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::spec::{Cqe, Sqe, Status};
use crate::{DmaBuf, Result};

/// A finished command.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    pub cid: u16,
    pub status: Status,
    pub dw0: u32,
}

/// A queue's ring positions as kept in shared memory, so the next process can re-attach
/// to the live queue (the admin queue, in the controller's arena). The tail is written
/// before the doorbell is rung, so it never lags behind what the controller was told.
#[repr(C)]
#[derive(Default)]
pub struct Mirror {
    pub sq_tail: AtomicU32,
    pub cq_head: AtomicU32,
    /// Expected phase tag (1 or 0).
    pub phase: AtomicU32,
    pub outstanding: AtomicU32,
}

/// Ring memory: owned, or inside a caller's shared arena.
enum Mem {
    Owned(DmaBuf),
    Shared { ptr: *mut u8, iova: u64 },
}

impl Mem {
    fn as_ptr(&self) -> *mut u8 {
        match self {
            Mem::Owned(b) => b.as_ptr(),
            Mem::Shared { ptr, .. } => *ptr,
        }
    }
    fn iova(&self) -> u64 {
        match self {
            Mem::Owned(b) => b.iova(),
            Mem::Shared { iova, .. } => *iova,
        }
    }
}

pub struct QueuePair {
    pub qid: u16,
    /// The controller generation (resets so far) the queue was created in; a reset destroys
    /// every queue of older generations.
    pub generation: u64,
    depth: u16,
    sq: Mem,
    cq: Mem,
    mirror: Option<*const Mirror>,
    sq_tail: u16,
    rung_tail: u16,
    cq_head: u16,
    phase: bool,
    sq_doorbell: *mut u32,
    cq_doorbell: *mut u32,
    free_cids: Vec<u16>,
    busy: Vec<bool>,
}

// SAFETY: the doorbell pointers point into the controller's BAR mapping, and shared ring and
// mirror memory into its arena, both of which outlive every queue pair (the controller owns
// them and drops queues first); a queue pair is used by one thread at a time.
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// Allocates the rings for queue `qid` with `depth` entries. `bar` is the controller's
    /// register mapping, `stride` its doorbell stride in bytes.
    pub fn new(qid: u16, depth: u16, bar: *mut u8, stride: usize) -> Result<QueuePair> {
        let depth = depth.max(2);
        let sq = Mem::Owned(DmaBuf::new(depth as usize * 64)?);
        let cq = Mem::Owned(DmaBuf::new(depth as usize * 16)?);
        Ok(Self::with_memory(qid, depth, sq, cq, None, bar, stride))
    }

    /// A queue whose rings live in shared memory (`sq`/`cq`: address and IOVA, room for
    /// `depth` entries) and whose positions are mirrored in `mirror`. With `resume`, the
    /// positions are taken from the mirror (a live queue a previous process left); otherwise
    /// the queue starts empty and the CQ is cleared.
    ///
    /// # Safety
    /// The memory behind `sq`, `cq` and `mirror` must stay mapped, and be used by nothing
    /// else, for the life of the queue pair.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn in_shared_memory(
        qid: u16,
        depth: u16,
        sq: (*mut u8, u64),
        cq: (*mut u8, u64),
        mirror: *const Mirror,
        resume: bool,
        bar: *mut u8,
        stride: usize,
    ) -> QueuePair {
        let mut q = Self::with_memory(
            qid,
            depth,
            Mem::Shared {
                ptr: sq.0,
                iova: sq.1,
            },
            Mem::Shared {
                ptr: cq.0,
                iova: cq.1,
            },
            Some(mirror),
            bar,
            stride,
        );
        // SAFETY: the caller guarantees `mirror` is live.
        let m = unsafe { &*mirror };
        if resume {
            q.sq_tail = (m.sq_tail.load(Ordering::Acquire) % depth as u32) as u16;
            q.rung_tail = q.sq_tail;
            q.cq_head = (m.cq_head.load(Ordering::Acquire) % depth as u32) as u16;
            q.phase = m.phase.load(Ordering::Acquire) & 1 == 1;
        } else {
            // SAFETY: the CQ memory holds `depth` 16-byte entries (caller's guarantee).
            unsafe { std::ptr::write_bytes(cq.0, 0, depth as usize * 16) };
            m.sq_tail.store(0, Ordering::Release);
            m.cq_head.store(0, Ordering::Release);
            m.phase.store(1, Ordering::Release);
            m.outstanding.store(0, Ordering::Release);
        }
        q
    }

    fn with_memory(
        qid: u16,
        depth: u16,
        sq: Mem,
        cq: Mem,
        mirror: Option<*const Mirror>,
        bar: *mut u8,
        stride: usize,
    ) -> QueuePair {
        let base = crate::spec::REG_DOORBELLS + 2 * qid as usize * stride;
        QueuePair {
            qid,
            generation: 0,
            depth,
            sq,
            cq,
            mirror,
            sq_tail: 0,
            rung_tail: 0,
            cq_head: 0,
            phase: true,
            // SAFETY (pointer arithmetic only): doorbells of qid lie inside BAR0, whose size
            // the controller checked against the number of queues it creates.
            sq_doorbell: bar.wrapping_add(base).cast(),
            cq_doorbell: bar.wrapping_add(base + stride).cast(),
            free_cids: (0..depth - 1).rev().collect(),
            busy: vec![false; depth as usize],
        }
    }

    fn mirror(&self) -> Option<&Mirror> {
        // SAFETY: `in_shared_memory`'s contract keeps the mirror live for our life.
        self.mirror.map(|m| unsafe { &*m })
    }

    /// Re-attaching to a live queue: tells the controller the tail again (a process that
    /// died between writing the tail and ringing the doorbell leaves it behind) and consumes
    /// the completions of the commands the previous process left outstanding. Returns how
    /// many it consumed, or `None` if they did not all arrive within `timeout`.
    pub fn resume(&mut self, timeout: Duration) -> Option<usize> {
        let left = self
            .mirror()
            .map_or(0, |m| m.outstanding.load(Ordering::Acquire)) as usize;
        fence(Ordering::SeqCst);
        // SAFETY: the SQ tail doorbell of this queue, inside the live BAR mapping.
        unsafe { self.sq_doorbell.write_volatile(self.sq_tail as u32) };
        let deadline = Instant::now() + timeout;
        let mut got = 0;
        while got < left {
            got += self.consume(&mut |_| {}, true);
            if got < left {
                if Instant::now() > deadline {
                    return None;
                }
                std::thread::yield_now();
            }
        }
        if let Some(m) = self.mirror() {
            m.outstanding.store(0, Ordering::Release);
        }
        Some(got)
    }

    pub fn depth(&self) -> u16 {
        self.depth
    }
    pub fn sq_iova(&self) -> u64 {
        self.sq.iova()
    }
    pub fn cq_iova(&self) -> u64 {
        self.cq.iova()
    }
    /// Commands that can still be submitted.
    pub fn free(&self) -> usize {
        self.free_cids.len()
    }
    /// Commands submitted and not completed.
    pub fn outstanding(&self) -> usize {
        self.depth as usize - 1 - self.free_cids.len()
    }

    /// The command identifier the next [`QueuePair::push`] will use.
    pub fn peek_cid(&self) -> Option<u16> {
        self.free_cids.last().copied()
    }

    /// Places `sqe` in the SQ with a fresh command identifier (returned), or `None` when
    /// `depth - 1` commands are already outstanding. The controller sees it after
    /// [`QueuePair::ring`].
    pub fn push(&mut self, mut sqe: Sqe) -> Option<u16> {
        let cid = self.free_cids.pop()?;
        sqe.set_cid(cid);
        self.busy[cid as usize] = true;
        // SAFETY: sq_tail < depth, and the SQ holds depth 64-byte entries; the controller
        // does not read this slot (it is past the last rung tail).
        unsafe {
            self.sq
                .as_ptr()
                .cast::<Sqe>()
                .add(self.sq_tail as usize)
                .write_volatile(sqe)
        };
        self.sq_tail = (self.sq_tail + 1) % self.depth;
        if let Some(m) = self.mirror() {
            m.outstanding
                .store(self.outstanding() as u32, Ordering::Release);
            m.sq_tail.store(self.sq_tail as u32, Ordering::Release);
        }
        Some(cid)
    }

    /// Tells the controller about the commands pushed since the last ring.
    pub fn ring(&mut self) {
        if self.sq_tail == self.rung_tail {
            return;
        }
        // The entries must be visible in memory before the doorbell write reaches the device.
        fence(Ordering::SeqCst);
        // SAFETY: the SQ tail doorbell of this queue, inside the live BAR mapping.
        unsafe { self.sq_doorbell.write_volatile(self.sq_tail as u32) };
        self.rung_tail = self.sq_tail;
    }

    /// Calls `done` for every new completion; returns how many.
    pub fn poll(&mut self, done: &mut dyn FnMut(Completion)) -> usize {
        self.consume(done, false)
    }

    /// Consumes new CQ entries; with `foreign`, entries of commands this process did not
    /// submit are counted too (re-attach), otherwise they are ignored with a warning.
    fn consume(&mut self, done: &mut dyn FnMut(Completion), foreign: bool) -> usize {
        let mut n = 0;
        let mut consumed = false;
        loop {
            // SAFETY: cq_head < depth and the CQ holds depth 16-byte entries; the controller
            // writes entries, so every read is volatile.
            let slot = unsafe { self.cq.as_ptr().cast::<Cqe>().add(self.cq_head as usize) };
            // SAFETY: as above.
            let status = unsafe { std::ptr::addr_of!((*slot).status).read_volatile() };
            if (status & 1 == 1) != self.phase {
                break;
            }
            fence(Ordering::Acquire);
            // SAFETY: as above; the phase bit says the controller finished writing the entry.
            let cqe = unsafe { slot.read_volatile() };
            self.cq_head += 1;
            if self.cq_head == self.depth {
                self.cq_head = 0;
                self.phase = !self.phase;
            }
            consumed = true;
            if foreign {
                n += 1;
            } else if self.busy.get(cqe.cid as usize).copied().unwrap_or(false) {
                self.busy[cqe.cid as usize] = false;
                self.free_cids.push(cqe.cid);
                n += 1;
                done(Completion {
                    cid: cqe.cid,
                    status: Status::from_cqe(cqe.status),
                    dw0: cqe.dw0,
                });
            } else {
                tracing::warn!(
                    qid = self.qid,
                    cid = cqe.cid,
                    "completion for a command that is not outstanding; ignored"
                );
            }
        }
        if consumed {
            if let Some(m) = self.mirror() {
                m.cq_head.store(self.cq_head as u32, Ordering::Release);
                m.phase.store(self.phase as u32, Ordering::Release);
                if !foreign {
                    m.outstanding
                        .store(self.outstanding() as u32, Ordering::Release);
                }
            }
            // SAFETY: the CQ head doorbell of this queue, inside the live BAR mapping.
            unsafe { self.cq_doorbell.write_volatile(self.cq_head as u32) };
        }
        n
    }
}
