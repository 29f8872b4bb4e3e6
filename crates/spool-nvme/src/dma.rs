//! DMA-able memory and the registry of memory the controllers may read and write.
//!
//! Every range a command points at must be mapped into the IOMMU. Two kinds are:
//! - [`DmaBuf`]: memory this driver allocates (queues, PRP lists, identify pages, bounce
//!   buffers), locked and mapped for its whole life;
//! - caller memory registered with [`register_memory`]: the guest memory a vhost-user
//!   frontend shares with us, so commands point straight at guest buffers (zero copy).
//!
//! I/O virtual addresses are handed out by a bump allocator above 4 GiB (clear of the x86
//! MSI window and of any IOMMU's 39-bit aperture limit) rather than reusing process
//! addresses, which a 39-bit IOMMU could not reach. Registration works before any
//! controller exists: regions are mapped when the first container is opened.

use std::sync::{Mutex, RwLock};

use crate::{Error, Result, PAGE};

#[derive(Debug, Clone, Copy)]
struct Region {
    vaddr: u64,
    len: u64,
    iova: u64,
    /// Mapped into the container (false while no controller is open).
    mapped: bool,
}

#[derive(Default)]
struct Registry {
    regions: Vec<Region>,
    next_iova: u64,
}

static REGISTRY: RwLock<Registry> = RwLock::new(Registry {
    regions: Vec::new(),
    next_iova: 0,
});
/// Serialises map/unmap ioctls against container creation.
static MAPPING: Mutex<()> = Mutex::new(());

/// Start of the IOVA range for registered and driver memory (controller arenas lie below).
pub(crate) const IOVA_BASE: u64 = 1 << 32;
/// End of that range (within a 39-bit IOMMU).
pub(crate) const IOVA_END: u64 = 1 << 39;
const IOVA_ALIGN: u64 = 2 << 20;

/// Makes `[vaddr, vaddr+len)` reachable by every controller of this process. Idempotent for
/// the same range. Fails only if a container exists and the IOMMU refuses the mapping.
pub fn register_memory(vaddr: u64, len: u64) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let _g = MAPPING.lock().unwrap_or_else(|p| p.into_inner());
    let mut reg = REGISTRY.write().unwrap_or_else(|p| p.into_inner());
    if reg.regions.iter().any(|r| r.vaddr == vaddr && r.len == len) {
        return Ok(());
    }
    if reg.next_iova == 0 {
        reg.next_iova = IOVA_BASE;
    }
    let start = vaddr & !(PAGE - 1);
    let end = (vaddr + len).div_ceil(PAGE) * PAGE;
    let iova = reg.next_iova + (vaddr - start);
    let mut r = Region {
        vaddr,
        len,
        iova,
        mapped: false,
    };
    if let Some(c) = crate::vfio::Container::current() {
        c.map_dma(start, reg.next_iova, end - start)?;
        r.mapped = true;
    }
    reg.next_iova += (end - start).div_ceil(IOVA_ALIGN) * IOVA_ALIGN;
    reg.regions.push(r);
    Ok(())
}

/// Forgets a range given to [`register_memory`] and unmaps it from the IOMMU. The caller
/// guarantees no command still points into it.
pub fn unregister_memory(vaddr: u64, len: u64) {
    let _g = MAPPING.lock().unwrap_or_else(|p| p.into_inner());
    let mut reg = REGISTRY.write().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = reg
        .regions
        .iter()
        .position(|r| r.vaddr == vaddr && r.len == len)
    {
        let r = reg.regions.swap_remove(i);
        if r.mapped {
            if let Some(c) = crate::vfio::Container::current() {
                let start = r.vaddr & !(PAGE - 1);
                let end = (r.vaddr + r.len).div_ceil(PAGE) * PAGE;
                c.unmap_dma(r.iova - (r.vaddr - start), end - start);
            }
        }
    }
}

/// Maps every registered region into a container that has just been opened.
pub(crate) fn map_all(c: &crate::vfio::Container) -> Result<()> {
    let mut reg = REGISTRY.write().unwrap_or_else(|p| p.into_inner());
    for r in reg.regions.iter_mut().filter(|r| !r.mapped) {
        let start = r.vaddr & !(PAGE - 1);
        let end = (r.vaddr + r.len).div_ceil(PAGE) * PAGE;
        c.map_dma(start, r.iova - (r.vaddr - start), end - start)?;
        r.mapped = true;
    }
    Ok(())
}

pub(crate) fn mapping_lock() -> std::sync::MutexGuard<'static, ()> {
    MAPPING.lock().unwrap_or_else(|p| p.into_inner())
}

/// The I/O virtual address of `[vaddr, vaddr+len)`, when the whole range lies in one
/// registered, mapped region.
pub fn translate(vaddr: u64, len: u64) -> Option<u64> {
    let reg = REGISTRY.read().unwrap_or_else(|p| p.into_inner());
    reg.regions
        .iter()
        .find(|r| r.mapped && vaddr >= r.vaddr && vaddr + len <= r.vaddr + r.len)
        .map(|r| r.iova + (vaddr - r.vaddr))
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
        // SAFETY: the mapping was created in `new` and is no longer mapped for the device.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_translates_within_regions_only() {
        // No container exists in unit tests: regions are recorded but not mapped, so they do
        // not translate yet (a command must never point at unmapped memory).
        register_memory(0x7000_0000_1000, 0x10_0000).unwrap();
        assert_eq!(translate(0x7000_0000_1000, 4096), None);
        let mut reg = REGISTRY.write().unwrap();
        for r in reg.regions.iter_mut() {
            r.mapped = true;
        }
        drop(reg);
        let base = translate(0x7000_0000_1000, 4096).unwrap();
        assert!(base >= IOVA_BASE);
        assert_eq!(translate(0x7000_0000_2000, 4096), Some(base + 0x1000));
        assert_eq!(
            translate(0x7000_0010_0000, 0x2000),
            None,
            "runs past the end"
        );
        assert_eq!(translate(0x6fff_ffff_f000, 4096), None);
        unregister_memory(0x7000_0000_1000, 0x10_0000);
        assert_eq!(translate(0x7000_0000_1000, 4096), None);
    }
}
