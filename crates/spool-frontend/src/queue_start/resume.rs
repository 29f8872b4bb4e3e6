//! Where a starting queue resumes, decided from its journal in one place: recover it with
//! Algorithm 2, or start a fresh generation at the frontend's base (or, in a restored
//! process that got no SET_VRING_BASE, where the journal or the used ring says). Run once at
//! queue start, never on the data path.

use std::sync::atomic::Ordering;

use spool_journal::{Journal, MemoryId, RingAddrs};
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
    /// The memory object holding the rings (None: unknown).
    pub memory: Option<MemoryId>,
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
        let same_memory = same_memory(journal, &view, from);
        let same_ring = h.queue_size == size && h.rings == view.rings && same_memory;
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
             (queue size {} vs {size}, rings match: {}, same frontend memory: {same_memory}, \
             indices consistent: {consistent}); they cannot belong to this guest's ring, \
             starting a fresh generation",
            journal.path().display(),
            h.queue_size,
            h.rings == view.rings
        ));
        journal.new_generation(size, view.rings, frontend_base, view.used_idx)?;
        journal.set_frontend_memory(view.memory);
        return Ok(Resume {
            next_avail: frontend_base,
            resubmit: vec![],
            recovered: false,
            note,
        });
    }
    journal.new_generation(size, view.rings, frontend_base, view.used_idx)?;
    journal.set_frontend_memory(view.memory);
    Ok(Resume {
        next_avail: frontend_base,
        resubmit: vec![],
        recovered: false,
        note: None,
    })
}

/// Whether the journal was written for this frontend's memory. A fresh connection from
/// another frontend process (a migration's destination, a restarted VM) has its guest memory
/// in another object, even when its rings sit at the same guest addresses: the journal's
/// requests are not its own, whatever the indices say. A restored session keeps the very
/// same memory. Unknown on either side: the index check alone decides, as before the journal
/// recorded it.
fn same_memory(journal: &Journal, view: &RingView, from: ResumeFrom) -> bool {
    match (from, journal.frontend_memory(), view.memory) {
        (ResumeFrom::Frontend(_), Some(j), Some(v)) => j == v,
        _ => true,
    }
}

/// Reads the avail and used indices of a ring.
pub fn ring_indices(q: &Queue, mem: &GuestMemory) -> Result<(u16, u16), RingError> {
    Ok((
        q.avail_idx(mem.map(), Ordering::Acquire)?.0,
        q.used_idx(mem.map(), Ordering::Acquire)?.0,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const RINGS: RingAddrs = RingAddrs {
        desc: 0x1000,
        avail: 0x2000,
        used: 0x3000,
    };

    /// A journal whose last session (frontend memory `old`) took head 3 at avail index 0 and
    /// never completed it.
    fn journal_with_work(dir: &std::path::Path, old: Option<MemoryId>) -> Journal {
        let (mut j, _) = Journal::open_or_create(dir, uuid::Uuid::new_v4(), 0, 8).unwrap();
        j.new_generation(8, RINGS, 0, 0).unwrap();
        j.set_frontend_memory(old);
        j.take_begin(3, 0);
        j.take_mark_inflight(3, 0);
        j.take_finish();
        j
    }

    /// A ring at the same addresses whose indices the journal's are consistent with (one
    /// request posted, none used), in memory `memory`.
    fn view(memory: Option<MemoryId>) -> RingView {
        RingView {
            rings: RINGS,
            size: 8,
            avail_idx: 1,
            used_idx: 0,
            memory,
        }
    }

    const OLD: MemoryId = MemoryId { dev: 5, ino: 100 };
    const NEW: MemoryId = MemoryId { dev: 5, ino: 200 };

    #[test]
    fn a_new_frontend_with_the_same_ring_layout_never_gets_the_old_sessions_requests() {
        let d = tempfile::tempdir().unwrap();
        let mut j = journal_with_work(d.path(), Some(OLD));
        let r = resume(
            &mut j,
            view(Some(NEW)),
            ResumeFrom::Frontend(0),
            &mut |_| {},
        )
        .unwrap();
        assert!(!r.recovered, "{r:?}");
        assert!(r.resubmit.is_empty());
        assert_eq!(r.next_avail, 0, "the frontend's base decides");
        assert!(!j.has_work());
        assert_eq!(j.frontend_memory(), Some(NEW));
    }

    #[test]
    fn the_same_frontend_reconnecting_gets_its_requests_resubmitted() {
        let d = tempfile::tempdir().unwrap();
        let mut j = journal_with_work(d.path(), Some(OLD));
        // QEMU sends the used index as its base after a backend death.
        let r = resume(
            &mut j,
            view(Some(OLD)),
            ResumeFrom::Frontend(0),
            &mut |_| {},
        )
        .unwrap();
        assert!(r.recovered);
        assert_eq!(r.resubmit, vec![3]);
        assert_eq!(r.next_avail, 1);
    }

    #[test]
    fn without_a_recorded_memory_the_indices_decide_as_before() {
        for (old, new) in [(None, Some(NEW)), (Some(OLD), None)] {
            let d = tempfile::tempdir().unwrap();
            let mut j = journal_with_work(d.path(), old);
            let r = resume(&mut j, view(new), ResumeFrom::Frontend(0), &mut |_| {}).unwrap();
            assert!(r.recovered, "{old:?} {new:?}");
            assert_eq!(r.resubmit, vec![3]);
        }
    }

    #[test]
    fn a_restored_session_recovers_whatever_the_memory_says() {
        let d = tempfile::tempdir().unwrap();
        let mut j = journal_with_work(d.path(), Some(OLD));
        let r = resume(&mut j, view(Some(NEW)), ResumeFrom::Restored, &mut |_| {}).unwrap();
        assert!(r.recovered);
        assert_eq!(r.resubmit, vec![3]);
    }
}
