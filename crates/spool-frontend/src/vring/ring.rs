//! Raw access to a split ring in guest memory: little-endian loads at host addresses, ring
//! positions, prefetch hints, and [`ChainWalker`], which walks a request's descriptor chain
//! (one level of indirection, bounded like virtio-queue's own iterator).
//!
//! Knows the split ring's layout only: nothing about the journal, requests or devices.

use virtio_queue::desc::split::Descriptor;

use crate::hostmem::HostMap;

/// Reads a little-endian u16 at host address `h` in one access when aligned.
///
/// # Safety
/// `h..h + 2` must lie in live guest memory.
#[inline]
pub(super) unsafe fn rd16(h: usize) -> u16 {
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
pub(super) const USED_HEADER: u64 = 4;
pub(super) const USED_ELEM: u64 = 8;
/// Avail ring header (flags, idx) and element sizes.
pub(super) const AVAIL_HEADER: u64 = 4;
pub(super) const AVAIL_ELEM: u64 = 2;
/// How far ahead of the request being taken its descriptor entry is prefetched.
pub const PREFETCH_DESC: u16 = 8;
/// How far ahead the header and next descriptor are (their addresses are read from the
/// descriptor entry prefetched earlier).
pub const PREFETCH_DATA: u16 = 4;

/// Position of free-running ring index `idx` in a ring of `size` entries. A split ring's size
/// is a power of two (virtio-queue refuses any other), so this is a mask, not a division.
#[inline(always)]
pub(super) fn ring_pos(idx: u16, size: u16) -> u64 {
    debug_assert!(size.is_power_of_two());
    (idx & size.wrapping_sub(1)) as u64
}

/// Asks the CPU to bring the cache line holding `addr` closer (a hint; no effect on memory).
#[inline(always)]
pub(super) fn prefetch(addr: usize) {
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
    #[inline]
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

    /// [`Self::new`] over a descriptor table already translated to host address
    /// `table_host` (0: read through the map), as [`super::JournaledQueue::chain`] has it.
    #[inline]
    pub(super) fn with_table_host(mut self, table_host: usize) -> Self {
        self.table_host = table_host;
        self
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
