//! Where a starting queue resumes, decided from its journal in one place: recover it with
//! Algorithm 2, or start a fresh generation at the frontend's base (or, in a restored
//! process that got no SET_VRING_BASE, where the journal or the used ring says). Run once at
//! queue start, never on the data path.

use std::sync::atomic::Ordering;

use spool_journal::{Journal, RingAddrs};
use virtio_queue::{Queue, QueueT};

use crate::request::GuestMemory;
use crate::vring::RingError;

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

/// Where the frontend says a queue resumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeFrom {
    /// SET_VRING_BASE gave this avail index (0 when it was not sent).
    Frontend(u16),
    /// A restarted process continuing a kept session: no SET_VRING_BASE comes. Where the
    /// journal's ring is this ring, the journal knows the next avail index (even with nothing
    /// in flight); otherwise the used index the guest sees.
    Restored,
}

/// Decides how a queue resumes: recover with Algorithm 2 when the journal describes
/// unfinished work of this very ring; otherwise start a fresh generation at the frontend's
/// base. The journal, not the frontend's SET_VRING_BASE, decides where to resume.
pub fn resume(
    journal: &mut Journal,
    view: RingView,
    from: ResumeFrom,
    hook: &mut dyn FnMut(spool_journal::RecoveryStep),
) -> Result<Resume, spool_journal::Error> {
    let size = view.size;
    let frontend_base = match from {
        ResumeFrom::Frontend(base) => base,
        ResumeFrom::Restored => {
            let h = journal.header();
            if h.rings == view.rings && h.queue_size == size {
                journal.last_avail()
            } else {
                view.used_idx
            }
        }
    };
    if journal.has_work() {
        let h = journal.header();
        let last = journal.last_avail();
        let jused = journal.used_idx();
        let same_ring = h.queue_size == size && h.rings == view.rings;
        // The journal's used index leads the ring's by the batch being completed, if any
        // (at most the queue size: `JournaledQueue::complete_batch`).
        let consistent = jused.wrapping_sub(view.used_idx) <= size
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
        q.avail_idx(mem.map(), Ordering::Acquire)?.0,
        q.used_idx(mem.map(), Ordering::Acquire)?.0,
    ))
}
