//! A virtqueue together with its cross-process journal: Algorithm 1 of Spool, step by step,
//! around the ring operations, and the start-up decision of where a queue resumes.
//!
//! Steps (paper numbering): 1 pop a head from the avail ring; 2–5 one 64-bit store of
//! {START, last_avail+1, head}; 6 head INFLIGHT; 7 FINISHED; 8 submit (the worker); 9 the
//! device completes (the worker); 10 journal used index + 1; 11 head DONE; 12–13 used ring
//! element and used index (one `add_used`); 14 head NONE. With the journal switched off
//! (Spool-NoJ, for the overhead benchmark) only the ring operations remain.

use std::sync::atomic::Ordering;

use spool_journal::{Journal, RingAddrs};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};

use crate::request::GuestMemory;

/// A point between two steps of Algorithm 1 (for crash-point tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// 1: head popped from the avail ring (process state only).
    Popped,
    /// 2–5: aux = {START, last_avail + 1, head}.
    TakeBegun,
    /// 6: head INFLIGHT.
    MarkedInflight,
    /// 7: transaction FINISHED.
    TakeFinished,
    /// 10: journal used index incremented.
    CompleteBegun,
    /// 11: head DONE.
    MarkedDone,
    /// 12–13: used element and used index written to the ring.
    UsedAdded,
    /// 14: head NONE.
    MarkedNone,
}

/// Errors of the ring itself (a broken or hostile guest ring).
pub type RingError = virtio_queue::Error;

/// The virtqueue and its journal, owned by one worker.
pub struct JournaledQueue {
    pub queue: Queue,
    pub journal: Option<Journal>,
}

impl JournaledQueue {
    /// Takes the next available request (steps 1–7). The chain is returned after the request
    /// is recorded INFLIGHT, so there is no window where it is taken but not recorded.
    pub fn pop<'m>(
        &mut self,
        mem: &'m GuestMemory,
        hook: &mut impl FnMut(Step),
    ) -> Result<Option<DescriptorChain<&'m GuestMemory>>, RingError> {
        let chain = match self.queue.iter(mem)?.next() {
            Some(c) => c,
            None => return Ok(None),
        };
        hook(Step::Popped);
        if let Some(j) = &self.journal {
            let head = chain.head_index();
            j.take_begin(head);
            hook(Step::TakeBegun);
            j.take_mark_inflight(head);
            hook(Step::MarkedInflight);
            j.take_finish();
            hook(Step::TakeFinished);
        }
        Ok(Some(chain))
    }

    /// Completes `head` to the guest (steps 10–14). The status byte and data must already be
    /// in guest memory.
    pub fn complete(
        &mut self,
        mem: &GuestMemory,
        head: u16,
        len: u32,
        hook: &mut impl FnMut(Step),
    ) -> Result<(), RingError> {
        if let Some(j) = &self.journal {
            j.complete_begin();
            hook(Step::CompleteBegun);
            j.complete_mark_done(head);
            hook(Step::MarkedDone);
        }
        self.queue.add_used(mem, head, len)?;
        hook(Step::UsedAdded);
        if let Some(j) = &self.journal {
            j.complete_mark_none(head);
            hook(Step::MarkedNone);
        }
        Ok(())
    }
}

/// Where a starting queue resumes, as decided from its journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// Next avail index to take.
    pub next_avail: u16,
    /// Heads taken before the restart and never completed, oldest first: resubmit them.
    pub resubmit: Vec<u16>,
    /// The journal's state was recovered (Algorithm 2 ran) rather than started afresh.
    pub recovered: bool,
    /// What happened, for the log.
    pub note: Option<String>,
}

/// What the ring currently says (read from guest memory).
#[derive(Debug, Clone, Copy)]
pub struct RingView {
    pub rings: RingAddrs,
    pub size: u16,
    pub avail_idx: u16,
    pub used_idx: u16,
}

/// Decides how a queue resumes: recover with Algorithm 2 when the journal describes
/// unfinished work of this very ring; otherwise start a fresh generation at the frontend's
/// base. The journal, not the frontend's SET_VRING_BASE, decides where to resume.
pub fn resume(
    journal: &mut Journal,
    view: RingView,
    frontend_base: u16,
    hook: &mut dyn FnMut(spool_journal::RecoveryStep),
) -> Result<Resume, spool_journal::Error> {
    let size = view.size;
    if journal.has_work() {
        let h = journal.header();
        let last = journal.last_avail();
        let jused = journal.used_idx();
        let same_ring = h.queue_size == size && h.rings == view.rings;
        let consistent = (jused == view.used_idx || jused == view.used_idx.wrapping_add(1))
            && last.wrapping_sub(view.used_idx) <= size
            && view.avail_idx.wrapping_sub(last) <= size;
        if same_ring && consistent {
            let r = journal.recover(view.used_idx, hook);
            let note = (r.last_avail != frontend_base).then(|| {
                format!(
                    "frontend asked to resume at avail index {frontend_base}, the journal says {}: using the journal",
                    r.last_avail
                )
            });
            return Ok(Resume {
                next_avail: r.last_avail,
                resubmit: r.inflight,
                recovered: true,
                note,
            });
        }
        let pending = (0..h.queue_size)
            .filter(|&x| journal.state(x) != spool_journal::ReqState::None)
            .count();
        let note = Some(format!(
            "journal {} describes {pending} unfinished request(s) of another session or ring \
             (queue size {} vs {size}, rings match: {}, indices consistent: {consistent}); \
             they cannot belong to this guest's ring, starting a fresh generation",
            journal.path().display(),
            h.queue_size,
            h.rings == view.rings
        ));
        journal.new_generation(size, view.rings, frontend_base, view.used_idx)?;
        return Ok(Resume {
            next_avail: frontend_base,
            resubmit: vec![],
            recovered: false,
            note,
        });
    }
    journal.new_generation(size, view.rings, frontend_base, view.used_idx)?;
    Ok(Resume {
        next_avail: frontend_base,
        resubmit: vec![],
        recovered: false,
        note: None,
    })
}

/// Reads the avail and used indices of a ring.
pub fn ring_indices(q: &Queue, mem: &GuestMemory) -> Result<(u16, u16), RingError> {
    Ok((
        q.avail_idx(mem, Ordering::Acquire)?.0,
        q.used_idx(mem, Ordering::Acquire)?.0,
    ))
}

/// Walks the descriptor chain starting at `head` (for resubmitting a journaled request whose
/// avail ring slot may since have been reused). Bounded like virtio-queue's own iterator:
/// at most `queue_size` descriptors per table, one level of indirection.
pub struct ChainWalker<'m> {
    mem: &'m GuestMemory,
    table: GuestAddress,
    table_len: u16,
    next: Option<u16>,
    ttl: u16,
    indirect_done: bool,
}

impl<'m> ChainWalker<'m> {
    /// A walker over the chain at `head` of the descriptor table at `desc_table`.
    pub fn new(mem: &'m GuestMemory, desc_table: GuestAddress, queue_size: u16, head: u16) -> Self {
        ChainWalker {
            mem,
            table: desc_table,
            table_len: queue_size,
            next: (head < queue_size).then_some(head),
            ttl: queue_size,
            indirect_done: false,
        }
    }
}

impl Iterator for ChainWalker<'_> {
    type Item = Descriptor;

    fn next(&mut self) -> Option<Descriptor> {
        let i = self.next.take()?;
        if self.ttl == 0 || i >= self.table_len {
            return None;
        }
        self.ttl -= 1;
        let addr = self.table.checked_add(i as u64 * 16)?;
        let d: Descriptor = self.mem.read_obj(addr).ok()?;
        if d.refers_to_indirect_table() {
            if self.indirect_done
                || !d.len().is_multiple_of(16)
                || d.len() == 0
                || d.len() / 16 > u16::MAX as u32
            {
                return None;
            }
            self.indirect_done = true;
            self.table = d.addr();
            self.table_len = (d.len() / 16) as u16;
            self.ttl = self.table_len;
            self.next = Some(0);
            return self.next();
        }
        if d.has_next() {
            self.next = Some(d.next());
        }
        Some(d)
    }
}

#[cfg(test)]
mod crash_tests;
