//! DMA-able memory and the registry of memory the controllers may read and write.
//!
//! Every range a command points at must be mapped into the IOMMU. Two kinds are:
//! - [`DmaBuf`]: memory this driver allocates (queues, PRP lists, identify pages, bounce
//!   buffers), locked and mapped for its whole life;
//! - caller memory registered with [`register_memory`]: the guest memory a vhost-user
//!   frontend shares with us, so commands point straight at guest buffers (zero copy).
//!
//! I/O virtual addresses come from `IovaSpace`, a first-fit allocator of 2 MiB blocks in
//! `[IOVA_BASE, IOVA_END)` = `[4 GiB, 512 GiB)`: clear of the x86 MSI window and of the
//! controller arenas below 4 GiB, and inside the 39-bit aperture every VT-d/AMD-Vi IOMMU
//! offers, rather than reusing process addresses, which a 39-bit IOMMU could not reach. A
//! region's blocks go back to the allocator (coalesced with free neighbours) once the IOMMU
//! has let go of them, so registering and unregistering forever never runs out; a
//! registration that does not fit fails with ENOSPC (the caller falls back to bounce buffers)
//! instead of handing out addresses past the aperture. Registration works before any
//! controller exists: regions are mapped when the first container is opened.
//!
//! Unregistering removes the region's translation first (no lookup returns its IOVA from then
//! on), then unmaps it from the IOMMU, and only then frees its IOVA for reuse. The caller
//! unregisters only once no command can still point into the region, and before it unmaps
//! the memory (the vhost-user frontend does both, see `spool-frontend`'s memory table).
//!
//! Builds on [`crate::vfio`] (the process's container, its `mapping_lock`); vfio does not
//! know this registry: a container's first group calls back into `map_all` through the
//! [`crate::vfio::MapPending`] its opener passes. The registry is process-wide for the same
//! reason the container is: one IOMMU domain serves every controller of the process, and
//! memory is registered (guest memory, by the frontend) independently of any controller.

use std::collections::BTreeMap;
use std::sync::{LazyLock, RwLock};

use crate::vfio::{mapping_lock, Container};
use crate::{Error, Result, PAGE};

/// Start of the IOVA range for registered and driver memory (controller arenas lie below).
pub(crate) const IOVA_BASE: u64 = 1 << 32;
/// End of that range: the smallest aperture an x86 IOMMU gives (39-bit, 3-level VT-d).
pub(crate) const IOVA_END: u64 = 1 << 39;
/// Every region's IOMMU mapping starts on a block of this size (room for 2 MiB IOMMU pages).
const IOVA_ALIGN: u64 = 2 << 20;

/// A first-fit allocator of `align`-sized blocks of I/O virtual addresses in `[base, end)`.
/// Freed ranges are coalesced with free neighbours and handed out again.
#[derive(Debug)]
pub(crate) struct IovaSpace {
    base: u64,
    end: u64,
    align: u64,
    /// Free ranges, start -> length: aligned, disjoint and never adjacent (always coalesced).
    free: BTreeMap<u64, u64>,
    /// Bytes handed out and not yet freed.
    in_use: u64,
}

impl IovaSpace {
    /// The whole of `[base, end)` free; `base`, `end` aligned to `align` (a power of two).
    pub(crate) fn new(base: u64, end: u64, align: u64) -> IovaSpace {
        assert!(
            align.is_power_of_two()
                && base.is_multiple_of(align)
                && end.is_multiple_of(align)
                && base < end
        );
        IovaSpace {
            base,
            end,
            align,
            free: BTreeMap::from([(base, end - base)]),
            in_use: 0,
        }
    }

    /// `len` rounded up to whole blocks (None if that overflows).
    fn blocks(&self, len: u64) -> Option<u64> {
        len.max(1).checked_next_multiple_of(self.align)
    }

    /// The lowest free range of at least `len` bytes (rounded up to whole blocks); its start
    /// is `align`-aligned. Fails with ENOSPC when no free range is large enough.
    pub(crate) fn alloc(&mut self, len: u64) -> Result<u64> {
        let size = self.blocks(len).unwrap_or(u64::MAX);
        let Some((&start, &have)) = self.free.iter().find(|(_, &have)| have >= size) else {
            let largest = self.free.values().copied().max().unwrap_or(0);
            return Err(Error::Os {
                what: format!(
                    "no I/O virtual address space left for {len:#x} bytes of DMA memory \
                     ({:#x} of {:#x} bytes in [{:#x}, {:#x}) in use, largest free range {largest:#x})",
                    self.in_use,
                    self.end - self.base,
                    self.base,
                    self.end
                ),
                source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            });
        };
        self.free.remove(&start);
        if have > size {
            self.free.insert(start + size, have - size);
        }
        self.in_use += size;
        Ok(start)
    }

    /// Gives back `[start, start+len)` (`len` rounded up as in [`IovaSpace::alloc`]), merged
    /// with the free ranges either side. Refuses (false, nothing changed) a range that was not
    /// handed out: outside the space, unaligned, or overlapping a free range.
    pub(crate) fn free(&mut self, start: u64, len: u64) -> bool {
        let Some(size) = self.blocks(len) else {
            return false;
        };
        let Some(end) = start.checked_add(size) else {
            return false;
        };
        if !start.is_multiple_of(self.align) || start < self.base || end > self.end {
            return false;
        }
        let prev = self.free.range(..start).next_back().map(|(&s, &l)| (s, l));
        let next = self.free.range(start..).next().map(|(&s, &l)| (s, l));
        if prev.is_some_and(|(s, l)| s + l > start) || next.is_some_and(|(s, _)| s < end) {
            return false;
        }
        let (mut from, mut to) = (start, end);
        if let Some((s, _)) = prev.filter(|&(s, l)| s + l == start) {
            self.free.remove(&s);
            from = s;
        }
        if let Some((s, l)) = next.filter(|&(s, _)| s == end) {
            self.free.remove(&s);
            to = s + l;
        }
        self.free.insert(from, to - from);
        self.in_use -= size;
        true
    }

    /// Bytes handed out and not freed.
    #[cfg(test)]
    fn in_use(&self) -> u64 {
        self.in_use
    }

    /// The free ranges, lowest first.
    #[cfg(test)]
    fn free_ranges(&self) -> Vec<(u64, u64)> {
        self.free.iter().map(|(&s, &l)| (s, l)).collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Region {
    vaddr: u64,
    len: u64,
    /// IOVA of byte `vaddr` (same offset in its page as `vaddr`).
    iova: u64,
    /// Bytes of the IOMMU mapping: whole pages from `vaddr`'s page on.
    map_len: u64,
    /// Mapped into the container (false while no controller is open).
    mapped: bool,
}

impl Region {
    /// First byte of the IOMMU mapping (page aligned).
    fn map_vaddr(&self) -> u64 {
        self.vaddr & !(PAGE - 1)
    }
    /// IOVA of [`Region::map_vaddr`]: the start of the region's IOVA blocks.
    fn map_iova(&self) -> u64 {
        self.iova - (self.vaddr - self.map_vaddr())
    }
}

/// Registered regions (disjoint, by start address) and the IOVA space they are placed in.
struct Registry {
    regions: BTreeMap<u64, Region>,
    space: IovaSpace,
}

impl Registry {
    fn new(base: u64, end: u64) -> Registry {
        Registry {
            regions: BTreeMap::new(),
            space: IovaSpace::new(base, end, IOVA_ALIGN),
        }
    }

    /// Records `[vaddr, vaddr+len)` (not mapped yet) at a fresh IOVA. `None` if exactly this
    /// range is registered already; an error if it overlaps another registered range, does
    /// not fit in the address space, or no IOVA range is left for it.
    fn add(&mut self, vaddr: u64, len: u64) -> Result<Option<Region>> {
        if self.regions.get(&vaddr).is_some_and(|r| r.len == len) {
            return Ok(None);
        }
        let map_vaddr = vaddr & !(PAGE - 1);
        let Some(map_end) = vaddr
            .checked_add(len)
            .and_then(|e| e.checked_next_multiple_of(PAGE))
        else {
            return Err(Error::Invalid(format!(
                "DMA memory [{vaddr:#x}, +{len:#x}) runs past the end of the address space"
            )));
        };
        if let Some(o) = self.overlapping(vaddr, vaddr + len) {
            return Err(Error::Invalid(format!(
                "DMA memory [{vaddr:#x}, +{len:#x}) overlaps the registered [{:#x}, +{:#x})",
                o.vaddr, o.len
            )));
        }
        let map_len = map_end - map_vaddr;
        let block = self.space.alloc(map_len)?;
        let r = Region {
            vaddr,
            len,
            iova: block + (vaddr - map_vaddr),
            map_len,
            mapped: false,
        };
        self.regions.insert(vaddr, r);
        Ok(Some(r))
    }

    /// A registered region sharing a byte with `[from, to)`. Regions are disjoint, so only
    /// the last one starting before `to` can.
    fn overlapping(&self, from: u64, to: u64) -> Option<&Region> {
        self.regions
            .range(..to)
            .next_back()
            .map(|(_, r)| r)
            .filter(|r| r.vaddr + r.len > from)
    }

    fn set_mapped(&mut self, vaddr: u64) {
        if let Some(r) = self.regions.get_mut(&vaddr) {
            r.mapped = true;
        }
    }

    /// Forgets exactly `[vaddr, vaddr+len)`: no lookup translates into it any more. Its IOVA
    /// stays allocated until [`Registry::release`] (after the IOMMU unmap).
    fn remove(&mut self, vaddr: u64, len: u64) -> Option<Region> {
        if self.regions.get(&vaddr)?.len != len {
            return None;
        }
        self.regions.remove(&vaddr)
    }

    /// Frees the IOVA range of a removed region, which the IOMMU no longer maps.
    fn release(&mut self, r: &Region) -> bool {
        self.space.free(r.map_iova(), r.map_len)
    }

    /// The IOVA of `[vaddr, vaddr+len)` when the whole range lies in one registered, mapped
    /// region (never for a range only partly registered, or spanning two regions).
    fn translate(&self, vaddr: u64, len: u64) -> Option<u64> {
        let end = vaddr.checked_add(len)?;
        let (_, r) = self.regions.range(..=vaddr).next_back()?;
        (r.mapped && end <= r.vaddr + r.len).then(|| r.iova + (vaddr - r.vaddr))
    }
}

static REGISTRY: LazyLock<RwLock<Registry>> =
    LazyLock::new(|| RwLock::new(Registry::new(IOVA_BASE, IOVA_END)));

fn registry() -> std::sync::RwLockWriteGuard<'static, Registry> {
    REGISTRY.write().unwrap_or_else(|p| p.into_inner())
}

/// Makes `[vaddr, vaddr+len)` reachable by every controller of this process. Idempotent for
/// the same range. Fails if the range overlaps another registered range, if no IOVA range is
/// left for it (ENOSPC), or if a container exists and the IOMMU refuses the mapping.
pub fn register_memory(vaddr: u64, len: u64) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let _g = mapping_lock();
    let Some(r) = registry().add(vaddr, len)? else {
        return Ok(());
    };
    // Not mapped yet, so not translated: the registry lock is not held across the ioctl.
    if let Some(c) = Container::current() {
        if let Err(e) = c.map_dma(r.map_vaddr(), r.map_iova(), r.map_len) {
            // A failed VFIO_IOMMU_MAP_DMA leaves nothing of the range mapped.
            let mut reg = registry();
            reg.remove(vaddr, len);
            reg.release(&r);
            return Err(e);
        }
        registry().set_mapped(vaddr);
    }
    Ok(())
}

/// Forgets a range given to [`register_memory`] and unmaps it from the IOMMU. The caller
/// guarantees no command still points into it, and unmaps the memory only afterwards.
///
/// The translation goes first, so no lookup returns the region's IOVA once this has begun;
/// the IOVA is reused only after the IOMMU unmapped it (never, if the unmap fails).
pub fn unregister_memory(vaddr: u64, len: u64) {
    let _g = mapping_lock();
    let Some(r) = registry().remove(vaddr, len) else {
        return;
    };
    let unmapped =
        !r.mapped || Container::current().is_none_or(|c| c.unmap_dma(r.map_iova(), r.map_len));
    if !unmapped {
        tracing::warn!(
            iova = r.map_iova(),
            size = r.map_len,
            "IOVA range left out of use: the IOMMU did not unmap it"
        );
    } else if !registry().release(&r) {
        tracing::error!(
            iova = r.map_iova(),
            size = r.map_len,
            "IOVA range freed twice or never allocated (registry bookkeeping bug)"
        );
    }
}

/// Maps every registered region not mapped yet into a container that has just been opened.
/// The caller holds [`mapping_lock`].
pub(crate) fn map_all(c: &Container) -> Result<()> {
    let pending: Vec<Region> = REGISTRY
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .regions
        .values()
        .filter(|r| !r.mapped)
        .copied()
        .collect();
    for r in pending {
        c.map_dma(r.map_vaddr(), r.map_iova(), r.map_len)?;
        registry().set_mapped(r.vaddr);
    }
    Ok(())
}

/// After taking a previous worker's container over: every region is marked unmapped (no
/// lookup translates any more), every mapping in `[IOVA_BASE, IOVA_END)` (the previous
/// worker's, and any this process made since it opened the container) is unmapped, and every
/// registered region is mapped again at its own IOVA.
pub(crate) fn remap_all_after_takeover(c: &Container) -> Result<()> {
    let _g = mapping_lock();
    for r in registry().regions.values_mut() {
        r.mapped = false;
    }
    c.unmap_range(IOVA_BASE, IOVA_END);
    map_all(c)
}

/// The I/O virtual address of `[vaddr, vaddr+len)`, when the whole range lies in one
/// registered, mapped region.
pub fn translate(vaddr: u64, len: u64) -> Option<u64> {
    REGISTRY
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .translate(vaddr, len)
}

/// A page-aligned, locked buffer mapped into the IOMMU for its whole life.
pub struct DmaBuf {
    ptr: *mut u8,
    len: usize,
    iova: u64,
}

// SAFETY: the buffer is plain memory owned by this value; sharing the pointer between
// threads is as safe as sharing a Vec's, and users synchronise access themselves.
unsafe impl Send for DmaBuf {}
// SAFETY: as above; `&DmaBuf` only hands out raw pointers and the IOVA.
unsafe impl Sync for DmaBuf {}

impl DmaBuf {
    /// A zeroed buffer of at least `len` bytes (rounded up to whole pages). Needs an open
    /// controller (a container to map into).
    pub fn new(len: usize) -> Result<DmaBuf> {
        let len = (len.max(1) as u64).div_ceil(PAGE) as usize * PAGE as usize;
        // SAFETY: an anonymous private mapping; no existing memory is affected. The result
        // is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::os(format!("mmap {len} bytes of DMA memory")));
        }
        let ptr = ptr.cast::<u8>();
        if let Err(e) = register_memory(ptr as u64, len as u64) {
            // SAFETY: unmapping the mapping created above, which nothing else references.
            unsafe { libc::munmap(ptr.cast(), len) };
            return Err(e);
        }
        let Some(iova) = translate(ptr as u64, len as u64) else {
            unregister_memory(ptr as u64, len as u64);
            // SAFETY: as above.
            unsafe { libc::munmap(ptr.cast(), len) };
            return Err(Error::Invalid(
                "DMA memory needs an open controller (no VFIO container yet)".into(),
            ));
        };
        Ok(DmaBuf { ptr, len, iova })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The address the device uses for byte 0.
    pub fn iova(&self) -> u64 {
        self.iova
    }
    /// The buffer's bytes. The caller must not let a device write them concurrently.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is a live mapping of `len` bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// The buffer's bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` gives exclusive access from the CPU side.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        unregister_memory(self.ptr as u64, self.len as u64);
        // SAFETY: the mapping was created in `new` and nothing else references it: its owner
        // drops it only after every command using it completed, and it is unregistered, so
        // no new command can be given its IOVA. (Should the IOMMU unmap have failed, the
        // IOMMU keeps its pages pinned and its IOVA stays out of use, so no device reaches
        // memory this address is reused for.)
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB2: u64 = IOVA_ALIGN;

    /// A private registry (the global one is shared with the other tests of this process).
    fn registry_for_test() -> Registry {
        Registry::new(IOVA_BASE, IOVA_END)
    }

    /// Registers and "maps" a region, as `register_memory` does with a container open.
    fn add_mapped(reg: &mut Registry, vaddr: u64, len: u64) -> Result<Region> {
        let r = reg.add(vaddr, len)?.expect("a new region");
        reg.set_mapped(vaddr);
        Ok(r)
    }

    /// Unregisters as `unregister_memory` does, the IOMMU unmap succeeding.
    fn remove_and_release(reg: &mut Registry, vaddr: u64, len: u64) {
        let r = reg.remove(vaddr, len).expect("registered");
        assert!(reg.release(&r));
    }

    #[test]
    fn registry_translates_within_regions_only() {
        // No container exists in unit tests: regions are recorded but not mapped, so they do
        // not translate yet (a command must never point at unmapped memory).
        register_memory(0x7000_0000_1000, 0x10_0000).unwrap();
        assert_eq!(translate(0x7000_0000_1000, 4096), None);
        registry().set_mapped(0x7000_0000_1000);
        let base = translate(0x7000_0000_1000, 4096).unwrap();
        assert!(base >= IOVA_BASE);
        assert_eq!(translate(0x7000_0000_2000, 4096), Some(base + 0x1000));
        assert_eq!(
            translate(0x7000_0010_0000, 0x2000),
            None,
            "runs past the end"
        );
        assert_eq!(translate(0x6fff_ffff_f000, 4096), None);
        assert_eq!(translate(u64::MAX - 10, 100), None, "wraps around");
        unregister_memory(0x7000_0000_1000, 0x10_0000);
        assert_eq!(translate(0x7000_0000_1000, 4096), None);
    }

    #[test]
    fn register_unregister_cycles_never_exhaust_the_iova_space() {
        // A frontend looping ADD_MEM_REG/REM_MEM_REG with 1 GiB regions: 100000 cycles are
        // 100 TiB of IOVAs, 200 times the whole space; a bump allocator ran out after 508.
        let mut reg = registry_for_test();
        let mut first = None;
        for i in 0..100_000u64 {
            let vaddr = 0x7f00_0000_0000 + (i % 7) * 2 * GIB + 0x1000;
            let r = add_mapped(&mut reg, vaddr, GIB).unwrap_or_else(|e| panic!("cycle {i}: {e}"));
            assert!(r.map_iova() >= IOVA_BASE && r.map_iova() + r.map_len <= IOVA_END);
            assert_eq!(
                *first.get_or_insert(r.iova),
                r.iova,
                "cycle {i}: IOVA reused"
            );
            assert_eq!(reg.translate(vaddr, 4096), Some(r.iova));
            remove_and_release(&mut reg, vaddr, GIB);
        }
        assert_eq!(reg.space.in_use(), 0);
        assert_eq!(reg.space.free_ranges(), [(IOVA_BASE, IOVA_END - IOVA_BASE)]);

        // The same through the public functions (no container: nothing is mapped, but the
        // IOVAs are allocated and freed the same way).
        for i in 0..100_000u64 {
            let vaddr = 0x7e00_0000_0000 + (i % 7) * 2 * GIB;
            register_memory(vaddr, GIB).unwrap_or_else(|e| panic!("cycle {i}: {e}"));
            unregister_memory(vaddr, GIB);
        }
    }

    #[test]
    fn exhaustion_is_a_clear_error() {
        let mut reg = registry_for_test();
        let total = IOVA_END - IOVA_BASE;
        // Fill the space with 100 GiB regions: 5 fit in 508 GiB, the sixth does not.
        for i in 0..5 {
            add_mapped(&mut reg, 0x1000_0000_0000 + i * 200 * GIB, 100 * GIB).unwrap();
        }
        let e = reg
            .add(0x1000_0000_0000 + 5 * 200 * GIB, 100 * GIB)
            .unwrap_err();
        assert_eq!(e.errno(), libc::ENOSPC, "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("no I/O virtual address space left"),
            "unclear: {msg}"
        );
        assert_eq!(
            reg.regions.len(),
            5,
            "a failed registration is not recorded"
        );
        assert_eq!(reg.translate(0x1000_0000_0000 + 5 * 200 * GIB, 4096), None);
        // What is left (8 GiB) still serves smaller regions, and never past the end.
        let r = add_mapped(&mut reg, 0x2000_0000_0000, 8 * GIB).unwrap();
        assert_eq!(r.map_iova() + r.map_len, IOVA_END);
        assert_eq!(reg.space.in_use(), total);
        assert_eq!(
            reg.add(0x2100_0000_0000, 4096).unwrap_err().errno(),
            libc::ENOSPC
        );
        // A region larger than the whole space, or one whose end overflows, fails cleanly.
        let mut empty = registry_for_test();
        assert_eq!(
            empty.add(0x1000, total + 1).unwrap_err().errno(),
            libc::ENOSPC
        );
        assert_eq!(
            empty.add(0x1000, u64::MAX - 0x1000).unwrap_err().errno(),
            libc::EINVAL
        );
        assert_eq!(
            empty.add(u64::MAX - 0x10, 0x8).unwrap_err().errno(),
            libc::EINVAL,
            "page-rounded end overflows"
        );
        // Freeing makes room again.
        remove_and_release(&mut reg, 0x1000_0000_0000 + 2 * 200 * GIB, 100 * GIB);
        add_mapped(&mut reg, 0x1000_0000_0000 + 5 * 200 * GIB, 100 * GIB).unwrap();
    }

    #[test]
    fn freed_ranges_are_coalesced_and_reused() {
        let base = IOVA_BASE;
        let mut s = IovaSpace::new(base, base + 16 * MIB2, MIB2);
        let a = s.alloc(MIB2).unwrap();
        let b = s.alloc(2 * MIB2).unwrap();
        let c = s.alloc(1).unwrap();
        let d = s.alloc(MIB2 + 1).unwrap();
        assert_eq!(
            [a, b, c, d],
            [base, base + MIB2, base + 3 * MIB2, base + 4 * MIB2]
        );
        assert_eq!(s.free_ranges(), [(base + 6 * MIB2, 10 * MIB2)]);
        // b, then a: one free range of 3 blocks at the bottom, not two.
        assert!(s.free(b, 2 * MIB2));
        assert!(s.free(a, MIB2));
        assert_eq!(
            s.free_ranges(),
            [(base, 3 * MIB2), (base + 6 * MIB2, 10 * MIB2)]
        );
        // Freeing twice, or what was never handed out, is refused and changes nothing.
        assert!(!s.free(a, MIB2));
        assert!(!s.free(base + 7 * MIB2, MIB2));
        assert!(!s.free(base + MIB2 / 2, MIB2), "unaligned");
        assert!(!s.free(base + 16 * MIB2, MIB2), "past the end");
        assert!(!s.free(base - MIB2, MIB2), "below the start");
        assert_eq!(s.in_use(), 3 * MIB2);
        // The coalesced range takes a 3-block request (first fit, lowest address).
        assert_eq!(s.alloc(3 * MIB2).unwrap(), base);
        assert!(s.free(base, 3 * MIB2));
        // c and d freed: everything merges back into one range.
        assert!(s.free(d, MIB2 + 1));
        assert_eq!(
            s.free_ranges(),
            [(base, 3 * MIB2), (base + 4 * MIB2, 12 * MIB2)]
        );
        assert!(s.free(c, 1));
        assert_eq!(s.free_ranges(), [(base, 16 * MIB2)]);
        assert_eq!(s.in_use(), 0);
        // A request no single free range holds fails even if the total free space would.
        let x = s.alloc(8 * MIB2).unwrap();
        let _y = s.alloc(4 * MIB2).unwrap();
        assert!(s.free(x, 8 * MIB2));
        let _z = s.alloc(MIB2).unwrap(); // splits the 8-block hole: 7 + 4 free, apart
        assert_eq!(s.alloc(8 * MIB2).unwrap_err().errno(), libc::ENOSPC);
        assert_eq!(s.alloc(7 * MIB2).unwrap(), base + MIB2);
    }

    #[test]
    fn lookups_fail_after_unregister_and_for_partly_registered_ranges() {
        let mut reg = registry_for_test();
        let a = 0x7000_0000_0000;
        let ra = add_mapped(&mut reg, a, 0x10_0000).unwrap();
        // b starts right where a ends: contiguous in the process, not in IOVA space.
        let b = a + 0x10_0000;
        let rb = add_mapped(&mut reg, b, 0x10_0000).unwrap();
        assert_ne!(rb.iova, ra.iova + 0x10_0000);
        assert_eq!(
            reg.translate(a + 0xf_f000, 0x1000),
            Some(ra.iova + 0xf_f000)
        );
        assert_eq!(reg.translate(b, 0x1000), Some(rb.iova));
        assert_eq!(reg.translate(a + 0xf_f000, 0x2000), None, "spans a and b");
        assert_eq!(reg.translate(a - 0x1000, 0x2000), None, "starts before a");
        assert_eq!(reg.translate(b + 0xf_f000, 0x2000), None, "runs past b");
        assert_eq!(reg.translate(u64::MAX, 2), None, "wraps around");
        // An unmapped region (no container yet) does not translate.
        let c = a + 0x100_0000;
        reg.add(c, 0x1000).unwrap().unwrap();
        assert_eq!(reg.translate(c, 0x1000), None);

        // Unregistering a: from the removal on (before the IOMMU unmap and the release of
        // the IOVA) nothing translates into it, and a region registered in that window, even
        // the same size at the same (reused) address, gets a different IOVA.
        let gone = reg.remove(a, 0x10_0000).unwrap();
        assert_eq!(reg.translate(a, 0x1000), None);
        assert_eq!(reg.translate(a + 0xf_f000, 0x1000), None);
        let again = add_mapped(&mut reg, a, 0x10_0000).unwrap();
        assert_ne!(
            again.map_iova(),
            gone.map_iova(),
            "IOVA reused before its unmap"
        );
        assert!(reg.release(&gone));
        // Only a range registered exactly as given is removed.
        assert_eq!(reg.remove(b, 0x1000), None);
        assert_eq!(reg.remove(b + 0x1000, 0x0f_f000), None);
        assert_eq!(reg.translate(b, 0x1000), Some(rb.iova));
        remove_and_release(&mut reg, b, 0x10_0000);
        assert_eq!(reg.translate(b, 0x1000), None);
        // The freed IOVA is reused by the next registration.
        let next = add_mapped(&mut reg, 0x7100_0000_0000, 0x1000).unwrap();
        assert_eq!(next.map_iova(), gone.map_iova());
    }

    #[test]
    fn registration_is_idempotent_and_refuses_overlaps() {
        let mut reg = registry_for_test();
        let a = 0x7000_0000_0000;
        let r = add_mapped(&mut reg, a, 0x4000).unwrap();
        assert_eq!(reg.add(a, 0x4000).unwrap(), None, "same range again");
        assert_eq!(reg.regions.len(), 1);
        for (v, l) in [(a, 0x2000), (a + 0x3000, 0x2000), (a - 0x1000, 0x2000)] {
            let e = reg.add(v, l).unwrap_err();
            assert!(e.to_string().contains("overlaps"), "{e}");
        }
        assert_eq!(reg.translate(a, 0x4000), Some(r.iova));
        // Touching is not overlapping.
        add_mapped(&mut reg, a + 0x4000, 0x1000).unwrap();
        add_mapped(&mut reg, a - 0x1000, 0x1000).unwrap();
    }

    #[test]
    fn alignment_is_kept() {
        let mut reg = registry_for_test();
        let mut regions = Vec::new();
        for (i, (off, len)) in [
            (0u64, 0x1000u64),
            (0x234, 0x5000),
            (0xfff, 2),
            (0x800, 3 * MIB2 + 0x10),
        ]
        .into_iter()
        .enumerate()
        {
            let vaddr = 0x7000_0000_0000 + i as u64 * GIB + off;
            regions.push(add_mapped(&mut reg, vaddr, len).unwrap());
        }
        // Remove one in the middle and register more: reused blocks keep the same rules.
        let mid = regions.remove(1);
        remove_and_release(&mut reg, mid.vaddr, mid.len);
        for (i, (off, len)) in [(0x10u64, 0x1_0000u64), (0x0, MIB2)]
            .into_iter()
            .enumerate()
        {
            let vaddr = 0x7100_0000_0000 + i as u64 * GIB + off;
            regions.push(add_mapped(&mut reg, vaddr, len).unwrap());
        }
        for r in &regions {
            assert_eq!(r.map_iova() % IOVA_ALIGN, 0, "{r:?}");
            assert_eq!(r.iova % PAGE, r.vaddr % PAGE, "{r:?}");
            assert_eq!(r.map_vaddr() % PAGE, 0);
            assert_eq!(r.map_len % PAGE, 0);
            assert!(r.map_vaddr() + r.map_len >= r.vaddr + r.len);
            assert!(r.map_len < r.len + 2 * PAGE);
            assert!(r.map_iova() >= IOVA_BASE && r.map_iova() + r.map_len <= IOVA_END);
            assert_eq!(reg.translate(r.vaddr, r.len), Some(r.iova));
        }
        // No two regions share an IOVA block.
        let mut blocks: Vec<(u64, u64)> = regions
            .iter()
            .map(|r| {
                (
                    r.map_iova(),
                    r.map_iova() + r.map_len.next_multiple_of(IOVA_ALIGN),
                )
            })
            .collect();
        blocks.sort();
        assert!(blocks.windows(2).all(|w| w[0].1 <= w[1].0), "{blocks:?}");
    }
}
