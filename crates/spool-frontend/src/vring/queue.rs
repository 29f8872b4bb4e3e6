//! [`JournaledQueue`]: the virtqueue and its journal, owned by one worker. Taking a request
//! (Algorithm 1 steps 1–6, and 7 once per batch of takes) and completing a batch (10–14)
//! are journaled in the paper's order around the ring operations.
//!
//! Its fields are private: the worker takes, walks, completes and asks for notifications
//! through methods. Knows nothing of requests, devices or where a queue resumes.

use std::sync::atomic::{fence, Ordering};

use spool_journal::Journal;
use virtio_bindings::virtio_ring::VRING_DESC_F_NEXT;
use virtio_queue::{Queue, QueueT};

use super::ring::{
    prefetch, rd16, ring_pos, AVAIL_ELEM, AVAIL_HEADER, PREFETCH_DATA, PREFETCH_DESC, USED_ELEM,
    USED_HEADER,
};
use super::{ChainWalker, RingError, Step};
use crate::dirty_log::DirtyLog;
use crate::hostmem::HostMap;
use crate::request::GuestMemory;

/// The virtqueue and its journal, owned by one worker.
pub struct JournaledQueue {
    queue: Queue,
    journal: Option<Journal>,
    /// Used elements added since the last [`JournaledQueue::needs_notification`].
    num_added: u16,
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

    /// The queue's size (a power of two).
    #[inline]
    pub fn size(&self) -> u16 {
        self.queue.size()
    }

    /// The next avail index to take (what GET_VRING_BASE reports).
    pub fn next_avail(&self) -> u16 {
        self.queue.next_avail()
    }

    /// Gives the virtqueue back (when its worker stops).
    pub fn into_queue(self) -> Queue {
        self.queue
    }

    /// Asks the guest to notify us of new requests, as virtio-queue does it (with
    /// VIRTIO_F_EVENT_IDX, by publishing `avail_event`). True when requests arrived meanwhile.
    pub fn enable_notification(&mut self, mem: &GuestMemory) -> Result<bool, RingError> {
        self.queue.enable_notification(mem.map())
    }

    /// Asks the guest not to notify us (a polling worker).
    pub fn disable_notification(&mut self, mem: &GuestMemory) -> Result<(), RingError> {
        self.queue.disable_notification(mem.map())
    }

    /// The heads the journal records INFLIGHT, ascending (`None` without a journal). For the
    /// device-reset path, never the data path.
    pub fn journaled_inflight(&self) -> Option<Vec<u16>> {
        let j = self.journal.as_ref()?;
        Some(
            (0..self.queue.size())
                .filter(|&h| j.state(h) == spool_journal::ReqState::Inflight)
                .collect(),
        )
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

    /// Whether the guest has published requests not taken yet (reads the avail index when
    /// the last read showed none; nothing is taken).
    pub fn has_avail(&mut self, mem: &HostMap) -> bool {
        let h = self.hosts(mem);
        let next = self.queue.next_avail();
        next.wrapping_sub(self.shadow_from) < self.shadow_avail.wrapping_sub(self.shadow_from)
            || matches!(self.read_avail_idx(h, mem), Ok(true))
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
        ChainWalker::new(mem, self.queue.desc_table(), self.queue.size(), head)
            .with_table_host(h.desc)
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
    /// Guest address and length of the used ring (flags, index, entries, avail_event): what a
    /// migration's dirty log must cover after the ring was written.
    pub fn used_ring_range(&self) -> (u64, u64) {
        (
            self.queue.used_ring(),
            USED_HEADER + USED_ELEM * self.queue.size() as u64 + 2,
        )
    }

    /// Marks every device-writable buffer of the chain at `head` in `log` (before the chain
    /// is completed: the device has written what it will write).
    pub fn log_chain(&mut self, mem: &HostMap, head: u16, log: &DirtyLog) {
        self.written_by_device(mem, head, |gpa, len| log.mark(gpa, len));
    }

    /// Hands every device-writable buffer (guest address, length) of the chain at `head` to
    /// `f`.
    pub fn written_by_device(&mut self, mem: &HostMap, head: u16, mut f: impl FnMut(u64, u64)) {
        for d in self.chain(mem, head) {
            if d.is_write_only() {
                f(d.addr().0, d.len() as u64);
            }
        }
    }

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
