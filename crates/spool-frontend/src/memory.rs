//! The guest memory table a vhost-user frontend gives us (SET_MEM_TABLE, ADD_MEM_REG,
//! REM_MEM_REG), mapped once and published to the workers through an [`ArcSwap`] (workers
//! read it through an `arc_swap::Cache`: one atomic load per poll round).
//!
//! Workers load the current map per round and keep every map they took requests under until
//! those requests complete, so a region removed while I/O into it is in flight stays mapped
//! until that I/O completes.

use std::fs::File;
use std::ops::Deref;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::dirty_log::DirtyLog;
use spool_sigbus::Watch;
use vhost::vhost_user::message::VhostUserMemoryRegion;
use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

/// Most memory slots we ever accept (GET_MAX_MEM_SLOTS): QEMU needs a handful (8 to 32 with
/// memory hot-plug), libblkio one per buffer region. A session may be given fewer (see
/// `Session::max_mem_slots`): every region's descriptor must fit in the one state deposit
/// that carries the session across a restart.
pub const MAX_MEM_SLOTS: u64 = 64;

/// Guest memory as the workers see it: the vm-memory map plus the mappings it points into,
/// which stay mapped (and registered for DMA, and watched for SIGBUS) as long as any map
/// that refers to them is alive: a worker keeps the maps it took requests under until those
/// requests complete.
#[derive(Default)]
pub struct GuestMemory {
    mem: GuestMemoryMmap<()>,
    owned: Vec<Arc<OwnedMapping>>,
    /// The migration's dirty log while the frontend has logging on (`VHOST_F_LOG_ALL`).
    log: Option<Arc<DirtyLog>>,
}

impl Deref for GuestMemory {
    type Target = GuestMemoryMmap<()>;
    fn deref(&self) -> &Self::Target {
        &self.mem
    }
}

impl GuestMemory {
    /// Anonymous guest memory at the given ranges (tests and fuzzers).
    pub fn from_ranges(
        ranges: &[(GuestAddress, usize)],
    ) -> Result<Self, vm_memory::mmap::FromRangesError> {
        Ok(GuestMemory {
            mem: GuestMemoryMmap::from_ranges(ranges)?,
            owned: Vec::new(),
            log: None,
        })
    }

    /// This map with an anonymous region of `size` bytes at `at` added (tests: a frontend's
    /// ADD_MEM_REG).
    #[cfg(test)]
    pub(crate) fn with_anon_region(&self, at: GuestAddress, size: usize) -> GuestMemory {
        let r = vm_memory::GuestRegionMmap::from_range(at, size, None).expect("anonymous region");
        GuestMemory {
            mem: self.mem.insert_region(Arc::new(r)).expect("no overlap"),
            owned: Vec::new(),
            log: None,
        }
    }

    /// The vm-memory map (for the `vm_memory::GuestMemory` trait's generic users).
    pub fn map(&self) -> &GuestMemoryMmap<()> {
        &self.mem
    }

    /// Whether any of the frontend's regions in this map faulted (its memfd was truncated or
    /// otherwise pulled away): the session must be failed; the region now reads zeroes.
    pub fn faulted(&self) -> bool {
        self.owned
            .iter()
            .any(|m| m.watch.as_ref().is_some_and(Watch::faulted))
            || self.log.as_ref().is_some_and(|l| l.faulted())
    }

    /// The dirty log to mark what is written into this memory, while a migration logs.
    #[inline]
    pub fn dirty_log(&self) -> Option<&DirtyLog> {
        self.log.as_deref()
    }
}

#[derive(Debug, Clone)]
struct Mapping {
    gpa: u64,
    size: u64,
    /// Frontend's virtual address of the region (vring addresses are given in these).
    vva: u64,
    /// Offset of the region in its file.
    offset: u64,
    region: Arc<GuestRegionMmap<()>>,
    owned: Arc<OwnedMapping>,
}

/// One frontend region mapped by us. Undone in order when the last map referring to it is
/// dropped: the DMA registration first (no device can be handed its IOVA any more), then the
/// SIGBUS watch, then the mapping itself, so no I/O still in flight into it loses its memory
/// and no reused address is ever covered or handed to a device by mistake.
#[derive(Debug)]
struct OwnedMapping {
    addr: usize,
    len: usize,
    file: File,
    watch: Option<Watch>,
    dma: Option<DmaRegistration>,
}

impl Drop for OwnedMapping {
    fn drop(&mut self) {
        drop(self.dma.take());
        drop(self.watch.take());
        // SAFETY: our own mapping of `len` bytes at `addr` (made in `map`; `build_raw` regions
        // never unmap it). This is the last `Arc`: every `GuestMemory` (so every `HostMap`
        // user and in-flight request, `retired_maps`) holds one; DMA and watch are gone.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// The region's registration for device DMA, undone when the region is unmapped. A command
/// still in flight into a region the frontend removed keeps it mapped and registered until
/// the command completed.
#[derive(Debug)]
struct DmaRegistration {
    addr: u64,
    len: u64,
}

impl DmaRegistration {
    fn new(addr: u64, len: u64) -> Self {
        if let Err(e) = spool_devices::register_dma_memory(addr, len) {
            // Not fatal: NVMe requests into this region fall back to bounce buffers.
            tracing::warn!(error = %e, "guest memory cannot be mapped for device DMA; NVMe I/O will copy");
        }
        DmaRegistration { addr, len }
    }
}

impl Drop for DmaRegistration {
    fn drop(&mut self) {
        spool_devices::unregister_dma_memory(self.addr, self.len);
    }
}

/// The frontend's memory, as mapped into this process.
pub struct MemoryTable {
    maps: Vec<Mapping>,
    shared: Arc<ArcSwap<GuestMemory>>,
    /// The frontend's dirty log (SET_LOG_BASE), and whether logging is on (VHOST_F_LOG_ALL
    /// acked): workers see the log in the published map only while both hold.
    log: Option<Arc<DirtyLog>>,
    logging: bool,
    /// Most regions this table holds.
    limit: u64,
}

impl Default for MemoryTable {
    fn default() -> Self {
        Self::with_limit(MAX_MEM_SLOTS)
    }
}

/// Why a memory table message was refused.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("memory region gpa={gpa:#x} size={size:#x} cannot be mapped: {why}")]
    Map { gpa: u64, size: u64, why: String },
    #[error("memory regions overlap or are invalid: {0}")]
    Layout(String),
    #[error("too many memory regions (at most {0} for this session)")]
    TooMany(u64),
    #[error("{regions} memory regions but {files} file descriptors")]
    Descriptors { regions: usize, files: usize },
    #[error("no memory region at gpa={0:#x} to remove")]
    NotFound(u64),
}

fn map(r: &VhostUserMemoryRegion, file: File) -> Result<Mapping, MemoryError> {
    let err = |why: String| MemoryError::Map {
        gpa: r.guest_phys_addr,
        size: r.memory_size,
        why,
    };
    let size = usize::try_from(r.memory_size).map_err(|_| err("size too large".into()))?;
    if size == 0 || r.guest_phys_addr.checked_add(r.memory_size).is_none() {
        return Err(err("empty or wrapping region".into()));
    }
    crate::backing::check_backing(&file, r.mmap_offset, r.memory_size)
        .map_err(|e| err(e.to_string()))?;
    let offset =
        libc::off_t::try_from(r.mmap_offset).map_err(|_| err("offset too large".into()))?;
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let flags = libc::MAP_SHARED | libc::MAP_NORESERVE;
    // SAFETY: the kernel picks the address, so nothing is replaced. The frontend chooses fd,
    // offset and size: `check_backing` saw a regular file holding the range, or a block
    // device (not size-checked); a shorter or later-truncated backing raises SIGBUS on
    // access, which the `Watch` below turns into zero pages (fatal if no slot was free).
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            prot,
            flags,
            file.as_raw_fd(),
            offset,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(err(std::io::Error::last_os_error().to_string()));
    }
    let watch = Watch::new(addr as usize, size, 0);
    if !watch.is_watched() {
        // Mapped unwatched, a truncated file would kill the process: refused instead.
        drop(watch);
        // SAFETY: unmapping the mapping made just above, which nothing else refers to.
        unsafe { libc::munmap(addr, size) };
        return Err(err(
            "no SIGBUS watch slot is left in this process (too many guest memory regions)".into(),
        ));
    }
    let owned = Arc::new(OwnedMapping {
        addr: addr as usize,
        len: size,
        file,
        watch: Some(watch),
        dma: Some(DmaRegistration::new(addr as u64, size as u64)),
    });
    // SAFETY: `addr..addr+size` is the mapping made above with these prot and flags (not
    // owned by the region: `OwnedMapping` unmaps it); it stays mapped while `owned` lives,
    // and every `GuestMemory` holding this region holds `owned` too (`publish`).
    let raw = unsafe { MmapRegion::<()>::build_raw(addr.cast(), size, prot, flags) }
        .map_err(|e| err(e.to_string()))?;
    let region = GuestRegionMmap::new(raw, GuestAddress(r.guest_phys_addr))
        .ok_or_else(|| err("region wraps the guest address space".into()))?;
    Ok(Mapping {
        gpa: r.guest_phys_addr,
        size: r.memory_size,
        vva: r.user_addr,
        offset: r.mmap_offset,
        region: Arc::new(region),
        owned,
    })
}

impl MemoryTable {
    /// An empty table holding at most `limit` regions (capped at [`MAX_MEM_SLOTS`]).
    pub fn with_limit(limit: u64) -> Self {
        MemoryTable {
            maps: Vec::new(),
            shared: Arc::new(ArcSwap::from_pointee(GuestMemory::default())),
            log: None,
            logging: false,
            limit: limit.min(MAX_MEM_SLOTS),
        }
    }

    /// Most regions this table holds (GET_MAX_MEM_SLOTS).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The map workers read.
    pub fn shared(&self) -> Arc<ArcSwap<GuestMemory>> {
        self.shared.clone()
    }

    fn publish(&mut self, maps: Vec<Mapping>) -> Result<(), MemoryError> {
        let mem =
            GuestMemoryMmap::from_arc_regions(maps.iter().map(|m| m.region.clone()).collect())
                .map_err(|e| MemoryError::Layout(e.to_string()))?;
        let owned = maps.iter().map(|m| m.owned.clone()).collect();
        let log = self.log.clone().filter(|_| self.logging);
        self.shared.store(Arc::new(GuestMemory { mem, owned, log }));
        self.maps = maps;
        Ok(())
    }

    /// Takes the frontend's dirty log (SET_LOG_BASE), replacing any earlier one.
    pub fn set_log(&mut self, log: DirtyLog) -> Result<(), MemoryError> {
        self.log = Some(Arc::new(log));
        self.republish()
    }

    /// Publishes the current regions again (the log changed). Without regions there is
    /// nothing to publish: the next table carries the log.
    fn republish(&mut self) -> Result<(), MemoryError> {
        if self.maps.is_empty() {
            return Ok(());
        }
        self.publish(self.maps.clone())
    }

    /// Turns logging on or off (VHOST_F_LOG_ALL in SET_FEATURES). Off forgets the log: the
    /// frontend sends a new one before it logs again.
    pub fn set_logging(&mut self, on: bool) -> Result<(), MemoryError> {
        if on == self.logging && (on || self.log.is_none()) {
            return Ok(());
        }
        self.logging = on;
        if !on {
            self.log = None;
        }
        self.republish()
    }

    /// The dirty log the frontend gave, if any (logging on or not).
    pub fn log(&self) -> Option<&Arc<DirtyLog>> {
        self.log.as_ref()
    }

    /// Whether the frontend has logging on and gave a log.
    pub fn logging(&self) -> bool {
        self.logging && self.log.is_some()
    }

    /// Replaces the whole table (SET_MEM_TABLE).
    pub fn set(
        &mut self,
        regions: &[VhostUserMemoryRegion],
        files: Vec<File>,
    ) -> Result<(), MemoryError> {
        if regions.len() as u64 > self.limit {
            return Err(MemoryError::TooMany(self.limit));
        }
        if regions.len() != files.len() {
            return Err(MemoryError::Descriptors {
                regions: regions.len(),
                files: files.len(),
            });
        }
        let mut maps = regions
            .iter()
            .zip(files)
            .map(|(r, f)| map(r, f))
            .collect::<Result<Vec<_>, _>>()?;
        maps.sort_by_key(|m| m.gpa);
        self.publish(maps)
    }

    /// Adds one region (ADD_MEM_REG).
    pub fn add(&mut self, r: &VhostUserMemoryRegion, file: File) -> Result<(), MemoryError> {
        if self.maps.len() as u64 >= self.limit {
            return Err(MemoryError::TooMany(self.limit));
        }
        let mut maps = self.maps.clone();
        maps.push(map(r, file)?);
        maps.sort_by_key(|m| m.gpa);
        self.publish(maps)
    }

    /// Removes one region (REM_MEM_REG).
    pub fn remove(&mut self, r: &VhostUserMemoryRegion) -> Result<(), MemoryError> {
        let mut maps = self.maps.clone();
        let i = maps
            .iter()
            .position(|m| m.gpa == r.guest_phys_addr && m.size == r.memory_size)
            .ok_or(MemoryError::NotFound(r.guest_phys_addr))?;
        maps.remove(i);
        self.publish(maps)
    }

    /// Translates a frontend virtual address (as in SET_VRING_ADDR) to a guest address.
    pub fn vva_to_gpa(&self, vva: u64) -> Option<GuestAddress> {
        self.maps
            .iter()
            .find(|m| vva >= m.vva && vva - m.vva < m.size)
            .map(|m| GuestAddress(m.gpa + (vva - m.vva)))
    }

    /// The table as the frontend sent it, with each region's file (for the keeper: a restarted
    /// process maps the same files again).
    pub fn regions(&self) -> Vec<(VhostUserMemoryRegion, std::os::fd::RawFd)> {
        self.maps
            .iter()
            .map(|m| {
                (
                    VhostUserMemoryRegion::new(m.gpa, m.size, m.vva, m.offset),
                    m.owned.file.as_raw_fd(),
                )
            })
            .collect()
    }

    /// The object (memfd or file) holding the frontend's virtual address `vva`: it tells a
    /// reconnecting frontend from a new one (see `spool_journal::MemoryId`).
    pub fn memory_id(&self, vva: u64) -> Option<spool_journal::MemoryId> {
        let m = self
            .maps
            .iter()
            .find(|m| vva >= m.vva && vva - m.vva < m.size)?;
        spool_journal::MemoryId::of(&m.owned.file)
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.maps.len()
    }

    /// True without regions.
    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }
}
