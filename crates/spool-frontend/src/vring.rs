//! A virtqueue together with its cross-process journal: Algorithm 1 of Spool, step by step,
//! around the ring operations, and the start-up decision of where a queue resumes.
//!
//! Steps (paper numbering): 1 pop a head from the avail ring; 2–5 one 64-bit store of
//! {START, last_avail+1, head}; 6 head INFLIGHT; 7 FINISHED, once for a poll round's batch
//! of takes (each take's START also finishes the one before); 8 submit (the worker); 9 the
//! device completes (the worker); then for a batch of n completions: 10 the journal's used
//! index moves by n; 11 each head DONE; 12–13 the used elements, then one used index store
//! publishing them all; 14 each head NONE. With the journal switched off (Spool-NoJ, for the
//! overhead benchmark) only the ring operations remain.
//!
//! The split ring itself is read and written here, through a [`HostMap`], rather than through
//! virtio-queue's iterators and `add_used`: those go through vm-memory's generic accessors
//! on every index, ring slot and descriptor, which callgrind showed to be the largest cost of
//! a request (docs/benchmarks/request-path.md). virtio-queue's [`Queue`] still holds the
//! queue's configuration and validity check, and does notification suppression (its
//! `next_avail`/`next_used` are kept current here).

use std::sync::atomic::{fence, Ordering};

use spool_journal::{Journal, RingAddrs};
use virtio_bindings::virtio_ring::VRING_DESC_F_NEXT;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};

use crate::hostmem::HostMap;
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
    /// 7: transaction FINISHED (once per batch of takes: [`JournaledQueue::finish_takes`]).
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
    /// Used elements added since the last [`JournaledQueue::needs_notification`].
    pub num_added: u16,
    /// The rings' host addresses under the last host map used.
    hosts: RingHosts,
    /// The avail index as last read from the ring, and the next avail index at the time:
    /// the requests between them were published, so the index (a cache line the guest keeps
    /// writing) is read again only once they are taken, or when the next avail index moved
    /// outside that window (set from outside, as on a restart).
    shadow_avail: u16,
    shadow_from: u16,
    /// A take's transaction is open in the journal (steps 2–6 done, step 7 not yet).
    take_open: bool,
}

/// Host addresses of the three rings under one [`HostMap`] (0 where a ring does not lie in
/// one region: its accesses then go through the map). Valid while that map is: it is only
/// used with the map whose id it records. Keyed by map id alone because a queue's size and
/// ring addresses never change for a `JournaledQueue` (`Session::maybe_start` builds a new
/// one; the size is checked there to be a power of two <= 32768).
#[derive(Debug, Default, Clone, Copy)]
struct RingHosts {
    map: u64,
    desc: usize,
    avail: usize,
    used: usize,
}

/// Reads a little-endian u16 at host address `h` in one access when aligned.
///
/// # Safety
/// `h..h + 2` must lie in live guest memory.
#[inline]
unsafe fn rd16(h: usize) -> u16 {
    // SAFETY: `h..h+2` is mapped per the contract; read once as a value, never through a
    // reference (the guest may be writing it).
    u16::from_le(unsafe {
        if h.is_multiple_of(2) {
            std::ptr::read_volatile(h as *const u16)
        } else {
            std::ptr::read_unaligned(h as *const u16)
        }
    })
}

/// Used ring header (flags, idx) and element sizes.
const USED_HEADER: u64 = 4;
const USED_ELEM: u64 = 8;
/// Avail ring header (flags, idx) and element sizes.
const AVAIL_HEADER: u64 = 4;
const AVAIL_ELEM: u64 = 2;
/// How far ahead of the request being taken its descriptor entry is prefetched.
pub const PREFETCH_DESC: u16 = 8;
/// How far ahead the header and next descriptor are (their addresses are read from the
/// descriptor entry prefetched earlier).
pub const PREFETCH_DATA: u16 = 4;

/// Position of free-running ring index `idx` in a ring of `size` entries. A split ring's size
/// is a power of two (virtio-queue refuses any other), so this is a mask, not a division.
#[inline(always)]
fn ring_pos(idx: u16, size: u16) -> u64 {
    debug_assert!(size.is_power_of_two());
    (idx & size.wrapping_sub(1)) as u64
}

/// Asks the CPU to bring the cache line holding `addr` closer (a hint; no effect on memory).
#[inline(always)]
fn prefetch(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing into the program and never faults, whatever the
    // address (mapped or not); SSE is part of the x86_64 baseline.
    #[allow(unused_unsafe)]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

impl JournaledQueue {
    /// A queue (and journal) with nothing added since the last notification check.
    pub fn new(queue: Queue, journal: Option<Journal>) -> Self {
        JournaledQueue {
            queue,
            journal,
            num_added: 0,
            shadow_avail: 0,
            shadow_from: 0,
            take_open: false,
            hosts: RingHosts::default(),
        }
    }

    /// The rings' host addresses under `mem` (translated once per memory map).
    #[inline(always)]
    fn hosts(&mut self, mem: &HostMap) -> RingHosts {
        if self.hosts.map == mem.id() && mem.id() != 0 {
            return self.hosts;
        }
        self.translate_rings(mem)
    }

    #[cold]
    fn translate_rings(&mut self, mem: &HostMap) -> RingHosts {
        let size = self.queue.size() as u64;
        let q = &self.queue;
        self.hosts = RingHosts {
            map: mem.id(),
            desc: mem.host(q.desc_table(), 16 * size).unwrap_or(0),
            avail: mem
                .host(q.avail_ring(), AVAIL_HEADER + AVAIL_ELEM * size + 2)
                .unwrap_or(0),
            used: mem
                .host(q.used_ring(), USED_HEADER + USED_ELEM * size + 2)
                .unwrap_or(0),
        };
        self.hosts
    }

    /// Reads the avail index (once per batch: `pop` takes the published requests without
    /// reading it again) and warms the cache for the first requests it publishes; call
    /// [`Self::prefetch_ahead`] before taking each request to keep warming ahead of it.
    ///
    /// The descriptor entries and the request headers were last written by the guest's CPU:
    /// fetched one after another as each request is taken, their misses add up; asked for a
    /// few requests ahead (the descriptor entry [`PREFETCH_DESC`] requests ahead, then the
    /// line the head descriptor points at — the header, or an indirect table — and the next
    /// descriptor [`PREFETCH_DATA`] ahead), they overlap. A hint only: nothing read here is
    /// trusted or kept (everything is read again, and checked, when taken), and a prefetch
    /// never faults, whatever the address.
    pub fn prefetch(&mut self, mem: &HostMap) {
        let h = self.hosts(mem);
        if h.avail == 0 || h.desc == 0 {
            return;
        }
        if !matches!(self.read_avail_idx(h, mem), Ok(true)) {
            return; // nothing new, or a bad index `pop` reports
        }
        for k in 0..PREFETCH_DESC {
            self.prefetch_desc(h, k);
        }
        for k in 0..PREFETCH_DATA {
            self.prefetch_data(h, mem, k);
        }
    }

    /// Reads the avail index; when it publishes requests not yet taken, they become the
    /// window `pop` takes from without reading the index again (true). An index further
    /// ahead than the ring holds is an error.
    fn read_avail_idx(&mut self, h: RingHosts, mem: &HostMap) -> Result<bool, RingError> {
        let size = self.queue.size();
        let next = self.queue.next_avail();
        let idx = if h.avail != 0 {
            // SAFETY: `h.avail != 0`: `translate_rings` found the avail ring's `4 + 2*size + 2`
            // bytes in one region of `mem` (`HostMap::host`); the index is at +2.
            unsafe { rd16(h.avail + 2) }
        } else {
            mem.read_u16(self.queue.avail_ring() + 2)
                .ok_or(RingError::InvalidAvailRingIndex)?
        };
        if idx == next {
            return Ok(false);
        }
        if idx.wrapping_sub(next) > size {
            // The guest published more requests than the ring holds.
            return Err(RingError::InvalidAvailRingIndex);
        }
        (self.shadow_from, self.shadow_avail) = (next, idx);
        // The ring slots and the descriptors are read after the index that published them.
        fence(Ordering::Acquire);
        Ok(true)
    }

    /// Keeps [`Self::prefetch`]'s warming ahead of the request about to be taken.
    #[inline]
    pub fn prefetch_ahead(&mut self, mem: &HostMap) {
        let h = self.hosts(mem);
        if h.avail == 0 || h.desc == 0 {
            return;
        }
        self.prefetch_desc(h, PREFETCH_DESC);
        self.prefetch_data(h, mem, PREFETCH_DATA);
    }

    /// The head of the request `k` places after the next one to take, when it is published
    /// (as far as the last avail index read says).
    #[inline]
    fn published_head(&self, h: RingHosts, k: u16) -> Option<u16> {
        let size = self.queue.size();
        let at = self.queue.next_avail().wrapping_add(k);
        if at.wrapping_sub(self.shadow_from) >= self.shadow_avail.wrapping_sub(self.shadow_from) {
            return None;
        }
        let slot = AVAIL_HEADER + AVAIL_ELEM * ring_pos(at, size);
        // SAFETY: `ring_pos` masks with `size - 1`, so `slot + 2 <= 4 + 2*size`, inside the
        // avail ring `translate_rings` found in one region (callers return on `h.avail == 0`).
        let head = unsafe { rd16(h.avail + slot as usize) };
        (head < size).then_some(head)
    }

    #[inline]
    fn prefetch_desc(&self, h: RingHosts, k: u16) {
        if let Some(head) = self.published_head(h, k) {
            prefetch(h.desc + head as usize * 16);
        }
    }

    #[inline]
    fn prefetch_data(&self, h: RingHosts, mem: &HostMap, k: u16) {
        let Some(head) = self.published_head(h, k) else {
            return;
        };
        let d = h.desc + head as usize * 16;
        // SAFETY: `head < size` (`published_head`), so `d..d+16` is inside the `16*size` bytes
        // `translate_rings` found in one region (callers return on `h.desc == 0`); read as
        // values, and only used as prefetch hints (which never fault).
        let (addr, flags, next_desc) = unsafe {
            (
                u64::from_le(std::ptr::read_unaligned(d as *const u64)),
                u16::from_le(std::ptr::read_unaligned((d + 12) as *const u16)),
                u16::from_le(std::ptr::read_unaligned((d + 14) as *const u16)),
            )
        };
        if let Some(at) = mem.host(addr, 1) {
            prefetch(at);
        }
        if flags & VRING_DESC_F_NEXT as u16 != 0 && next_desc < self.queue.size() {
            prefetch(h.desc + next_desc as usize * 16);
        }
    }

    /// Takes the head of the next available request (steps 1–6), recorded INFLIGHT before it
    /// is returned, so there is no window where it is taken but not recorded. Walk its chain
    /// with [`ChainWalker`]. Step 7 follows for the whole batch of takes
    /// ([`JournaledQueue::finish_takes`]).
    pub fn pop(
        &mut self,
        mem: &HostMap,
        hook: &mut impl FnMut(Step),
    ) -> Result<Option<u16>, RingError> {
        let h = self.hosts(mem);
        let next = self.queue.next_avail();
        let published =
            next.wrapping_sub(self.shadow_from) < self.shadow_avail.wrapping_sub(self.shadow_from);
        if !published && !self.read_avail_idx(h, mem)? {
            return Ok(None);
        }
        let q = &mut self.queue;
        let size = q.size();
        let avail = q.avail_ring();
        let slot = AVAIL_HEADER + AVAIL_ELEM * ring_pos(next, size);
        let head = if h.avail != 0 {
            // SAFETY: `h.avail != 0`: the avail ring's `4 + 2*size + 2` bytes lie in one region
            // (`translate_rings`) and `slot + 2 <= 4 + 2*size` (`ring_pos` masks). Read once
            // into `head`, which is checked `< size` below before any use.
            unsafe { rd16(h.avail + slot as usize) }
        } else {
            mem.read_u16(avail + slot)
                .ok_or(RingError::InvalidAvailRingIndex)?
        };
        if head >= size {
            return Err(RingError::InvalidDescriptorIndex);
        }
        q.set_next_avail(next.wrapping_add(1));
        hook(Step::Popped);
        if let Some(j) = &self.journal {
            j.take_begin(head, next);
            hook(Step::TakeBegun);
            j.take_mark_inflight(head, next);
            hook(Step::MarkedInflight);
            self.take_open = true;
        }
        Ok(Some(head))
    }

    /// Step 7 for the takes since the last call: each take's step 2–5 store already finished
    /// the one before it, so one FINISHED store covers a batch of takes
    /// ([`Journal::take_finish`]). Call it after a poll round's takes; completions call it
    /// themselves before their first step, as a completed head must not stay named by an
    /// open transaction.
    #[inline]
    pub fn finish_takes(&mut self, hook: &mut impl FnMut(Step)) {
        if std::mem::take(&mut self.take_open) {
            if let Some(j) = &self.journal {
                j.take_finish();
                hook(Step::TakeFinished);
            }
        }
    }

    /// The descriptor chain of a taken head.
    pub fn chain<'m>(&mut self, mem: &'m HostMap, head: u16) -> ChainWalker<'m> {
        let h = self.hosts(mem);
        let mut w = ChainWalker::new(mem, self.queue.desc_table(), self.queue.size(), head);
        w.table_host = h.desc;
        w
    }

    /// Completes `head` to the guest (steps 10–14). The status byte and data must already be
    /// in guest memory.
    pub fn complete(
        &mut self,
        mem: &HostMap,
        head: u16,
        len: u32,
        hook: &mut impl FnMut(Step),
    ) -> Result<(), RingError> {
        self.complete_batch(mem, &[(head, len)], hook)
    }

    /// Completes every `(head, used length)` of `done` to the guest with one used-index
    /// update (steps 10–14 for the batch as a whole): the journal's used index moves by the
    /// batch's size, every head is marked DONE, the elements are written, one release store
    /// of the used index publishes them all, then every head is marked free. The guest sees
    /// all of the batch or none of it, and so does recovery (Algorithm 2 rolls all DONE heads
    /// forward when the ring's used index matches the journal's, all back otherwise). One
    /// index store per batch instead of one per request also spares the cache line the
    /// guest polls from bouncing between the cores for every completion.
    pub fn complete_batch(
        &mut self,
        mem: &HostMap,
        done: &[(u16, u32)],
        hook: &mut impl FnMut(Step),
    ) -> Result<(), RingError> {
        let size = self.queue.size();
        if done.is_empty() {
            return Ok(());
        }
        if done.len() > size as usize || done.iter().any(|&(h, _)| h >= size) {
            return Err(RingError::InvalidDescriptorIndex);
        }
        let n = done.len() as u16;
        self.finish_takes(hook);
        if let Some(j) = &self.journal {
            j.complete_begin_n(n);
            hook(Step::CompleteBegun);
            for &(head, _) in done {
                j.complete_mark_done(head);
                hook(Step::MarkedDone);
            }
        }
        // Steps 12-13: the elements, then (released after them) the index that publishes them.
        let h = self.hosts(mem);
        let used = self.queue.used_ring();
        let first = self.queue.next_used();
        let next = first.wrapping_add(n);
        for (i, &(head, len)) in done.iter().enumerate() {
            let mut elem = [0u8; USED_ELEM as usize];
            elem[..4].copy_from_slice(&(head as u32).to_le_bytes());
            elem[4..].copy_from_slice(&len.to_le_bytes());
            let at = USED_HEADER + USED_ELEM * ring_pos(first.wrapping_add(i as u16), size);
            if h.used != 0 {
                // SAFETY: `h.used != 0`: the used ring's `4 + 8*size + 2` bytes lie in one
                // region (`translate_rings`) and `at + 8 <= 4 + 8*size` (`ring_pos` masks);
                // written as bytes, never through references (the guest reads them).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        elem.as_ptr(),
                        (h.used + at as usize) as *mut u8,
                        elem.len(),
                    )
                };
            } else if !mem.write(used + at, &elem) {
                return Err(RingError::InvalidDescriptorIndex);
            }
        }
        fence(Ordering::Release);
        if h.used != 0 {
            // SAFETY: `h.used + 2..+4` is inside the used ring `translate_rings` found in one
            // region; one aligned store where possible (the guest reads it concurrently).
            unsafe {
                let p = h.used + 2;
                if p.is_multiple_of(2) {
                    std::ptr::write_volatile(p as *mut u16, next.to_le());
                } else {
                    std::ptr::write_unaligned(p as *mut u16, next.to_le());
                }
            }
        } else if !mem.write_u16(used + 2, next) {
            return Err(RingError::InvalidDescriptorIndex);
        }
        self.queue.set_next_used(next);
        self.num_added = self.num_added.wrapping_add(n);
        hook(Step::UsedAdded);
        if let Some(j) = &self.journal {
            for &(head, _) in done {
                j.complete_mark_none(head);
                hook(Step::MarkedNone);
            }
        }
        Ok(())
    }

    /// Whether the guest wants an interrupt for what was added since the last call
    /// (VIRTIO_F_EVENT_IDX: only when the used index passed its `used_event`; otherwise
    /// always), as virtio-queue decides it.
    pub fn needs_notification(&mut self, mem: &HostMap) -> bool {
        // The used ring writes before the read of the guest's event index.
        fence(Ordering::SeqCst);
        let added = std::mem::take(&mut self.num_added);
        if !self.queue.event_idx_enabled() {
            return true;
        }
        let h = self.hosts(mem);
        let at = AVAIL_HEADER + AVAIL_ELEM * self.queue.size() as u64;
        let used_event = if h.avail != 0 {
            // SAFETY: `h.avail != 0`: `used_event` at `4 + 2*size` is inside the `4 + 2*size
            // + 2` bytes `translate_rings` found in one region; read once as a value.
            unsafe { rd16(h.avail + at as usize) }
        } else {
            match mem.read_u16(self.queue.avail_ring() + at) {
                Some(v) => v,
                None => return true,
            }
        };
        let used = self.queue.next_used();
        let old = used.wrapping_sub(added);
        used.wrapping_sub(used_event).wrapping_sub(1) < used.wrapping_sub(old)
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

/// Walks the descriptor chain starting at `head`: for every request taken, and for
/// resubmitting a journaled request whose avail ring slot may since have been reused. Bounded
/// like virtio-queue's own iterator: at most `queue_size` descriptors per table, one level of
/// indirection; it ends at the first descriptor that cannot be read.
pub struct ChainWalker<'m> {
    mem: &'m HostMap,
    table: u64,
    /// Host address of the whole current table when known (0: read through `mem`).
    table_host: usize,
    table_len: u16,
    next: Option<u16>,
    ttl: u16,
    indirect_done: bool,
}

impl<'m> ChainWalker<'m> {
    /// A walker over the chain at `head` of the descriptor table at `desc_table`.
    pub fn new(mem: &'m HostMap, desc_table: u64, queue_size: u16, head: u16) -> Self {
        ChainWalker {
            mem,
            table: desc_table,
            table_host: 0,
            table_len: queue_size,
            next: (head < queue_size).then_some(head),
            ttl: queue_size,
            indirect_done: false,
        }
    }
}

impl ChainWalker<'_> {
    /// Entry `i` of the current table (`i < table_len`).
    #[inline]
    fn read(&self, i: u16) -> Option<Descriptor> {
        let mut raw = [0u8; 16];
        if self.table_host != 0 {
            // SAFETY: `i < table_len` (`next`), and `table_host` is only nonzero for a table
            // of `table_len` entries in one region (`HostMap::host(table, 16 * table_len)` in
            // `translate_rings` or `enter_indirect`); copied once (the guest may rewrite it).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (self.table_host + i as usize * 16) as *const u8,
                    raw.as_mut_ptr(),
                    16,
                )
            };
        } else {
            let addr = self.table.checked_add(i as u64 * 16)?;
            if !self.mem.read(addr, &mut raw) {
                return None;
            }
        }
        Some(Descriptor::new(
            u64::from_le_bytes(raw[0..8].try_into().expect("8 bytes")),
            u32::from_le_bytes(raw[8..12].try_into().expect("4 bytes")),
            u16::from_le_bytes(raw[12..14].try_into().expect("2 bytes")),
            u16::from_le_bytes(raw[14..16].try_into().expect("2 bytes")),
        ))
    }

    /// Follows descriptor `d`, which refers to an indirect table (at most one per chain,
    /// a whole number of entries, at most 2^16 of them), and returns that table's first
    /// entry. The table is translated once when it lies in one region.
    #[inline(never)]
    fn enter_indirect(&mut self, d: Descriptor) -> Option<Descriptor> {
        if self.indirect_done
            || !d.len().is_multiple_of(16)
            || d.len() == 0
            || d.len() / 16 > u16::MAX as u32
        {
            return None;
        }
        self.indirect_done = true;
        self.table = d.addr().0;
        self.table_host = self.mem.host(self.table, d.len() as u64).unwrap_or(0);
        self.table_len = (d.len() / 16) as u16;
        self.ttl = self.table_len;
        self.next = Some(0);
        self.next()
    }
}

impl Iterator for ChainWalker<'_> {
    type Item = Descriptor;

    #[inline]
    fn next(&mut self) -> Option<Descriptor> {
        let i = self.next.take()?;
        if self.ttl == 0 || i >= self.table_len {
            return None;
        }
        self.ttl -= 1;
        let d = self.read(i)?;
        if d.refers_to_indirect_table() {
            return self.enter_indirect(d);
        }
        if d.has_next() {
            self.next = Some(d.next());
        }
        Some(d)
    }
}

#[cfg(test)]
mod crash_tests;
