//! One submission/completion queue pair, polled by phase tag.
//!
//! Owned by exactly one thread (a worker, or the admin path under its lock). Commands are
//! written to the SQ and the tail doorbell is rung once per batch ([`QueuePair::ring`]);
//! completions are found by the phase bit flipping in the CQ, and the CQ head doorbell is
//! written once per poll. At most `depth - 1` commands are outstanding, so the SQ can never
//! overflow whatever order the controller fetches in.

use std::sync::atomic::{fence, Ordering};

use crate::spec::{Cqe, Sqe, Status};
use crate::{DmaBuf, Result};

/// A finished command.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    pub cid: u16,
    pub status: Status,
    pub dw0: u32,
}

pub struct QueuePair {
    pub qid: u16,
    depth: u16,
    sq: DmaBuf,
    cq: DmaBuf,
    sq_tail: u16,
    rung_tail: u16,
    cq_head: u16,
    phase: bool,
    sq_doorbell: *mut u32,
    cq_doorbell: *mut u32,
    free_cids: Vec<u16>,
    busy: Vec<bool>,
}

// SAFETY: the doorbell pointers point into the controller's BAR mapping, which outlives every
// queue pair (the controller owns both and drops queues first); a queue pair is used by one
// thread at a time.
unsafe impl Send for QueuePair {}

impl QueuePair {
    /// Allocates the rings for queue `qid` with `depth` entries. `bar` is the controller's
    /// register mapping, `stride` its doorbell stride in bytes.
    pub fn new(qid: u16, depth: u16, bar: *mut u8, stride: usize) -> Result<QueuePair> {
        let depth = depth.max(2);
        let sq = DmaBuf::new(depth as usize * 64)?;
        let cq = DmaBuf::new(depth as usize * 16)?;
        let base = crate::spec::REG_DOORBELLS + 2 * qid as usize * stride;
        Ok(QueuePair {
            qid,
            depth,
            sq,
            cq,
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
        })
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
            if self.busy.get(cqe.cid as usize).copied().unwrap_or(false) {
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
            // SAFETY: the CQ head doorbell of this queue, inside the live BAR mapping.
            unsafe { self.cq_doorbell.write_volatile(self.cq_head as u32) };
        }
        n
    }
}
