//! The guest memory table a vhost-user frontend gives us (SET_MEM_TABLE, ADD_MEM_REG,
//! REM_MEM_REG), mapped once and published to the workers through an [`ArcSwap`] (workers
//! read it through an `arc_swap::Cache`: one atomic load per poll round).
//!
//! Workers load the current map per round and keep every map they took requests under until
//! those requests complete, so a region removed while I/O into it is in flight stays mapped
//! until that I/O completes.

use std::fs::File;
use std::sync::Arc;

use arc_swap::ArcSwap;
use vhost::vhost_user::message::VhostUserMemoryRegion;
use vm_memory::{FileOffset, GuestAddress, GuestRegionMmap};

use crate::request::GuestMemory;

/// Most memory slots we accept (GET_MAX_MEM_SLOTS).
pub const MAX_MEM_SLOTS: u64 = 509;

#[derive(Debug, Clone)]
struct Mapping {
    gpa: u64,
    size: u64,
    /// Frontend's virtual address of the region (vring addresses are given in these).
    vva: u64,
    /// Offset of the region in its file.
    offset: u64,
    region: Arc<GuestRegionMmap<()>>,
    /// Keeps the region mapped for device DMA (zero-copy NVMe) while the table holds it.
    _dma: Arc<DmaRegistration>,
}

/// The region's registration for device DMA, undone when the table lets go of the region. A
/// command still in flight into a region the frontend removed then fails on the IOMMU
/// instead of touching memory that is no longer the guest's.
#[derive(Debug)]
struct DmaRegistration {
    addr: u64,
    len: u64,
}

impl DmaRegistration {
    fn new(region: &GuestRegionMmap<()>) -> Self {
        use vm_memory::GuestMemoryRegion;
        let addr = region.as_ptr() as u64;
        let len = region.len();
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
}

impl Default for MemoryTable {
    fn default() -> Self {
        MemoryTable {
            maps: Vec::new(),
            shared: Arc::new(ArcSwap::from_pointee(GuestMemory::default())),
        }
    }
}

/// Why a memory table message was refused.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("memory region gpa={gpa:#x} size={size:#x} cannot be mapped: {why}")]
    Map { gpa: u64, size: u64, why: String },
    #[error("memory regions overlap or are invalid: {0}")]
    Layout(String),
    #[error("too many memory regions (at most {MAX_MEM_SLOTS})")]
    TooMany,
    #[error("no memory region at gpa={0:#x} to remove")]
    NotFound(u64),
}

fn map(r: &VhostUserMemoryRegion, file: File) -> Result<Mapping, MemoryError> {
    let size = usize::try_from(r.memory_size).map_err(|_| MemoryError::Map {
        gpa: r.guest_phys_addr,
        size: r.memory_size,
        why: "size too large".into(),
    })?;
    if size == 0 || r.guest_phys_addr.checked_add(r.memory_size).is_none() {
        return Err(MemoryError::Map {
            gpa: r.guest_phys_addr,
            size: r.memory_size,
            why: "empty or wrapping region".into(),
        });
    }
    let region = GuestRegionMmap::from_range(
        GuestAddress(r.guest_phys_addr),
        size,
        Some(FileOffset::new(file, r.mmap_offset)),
    )
    .map_err(|e| MemoryError::Map {
        gpa: r.guest_phys_addr,
        size: r.memory_size,
        why: e.to_string(),
    })?;
    Ok(Mapping {
        gpa: r.guest_phys_addr,
        size: r.memory_size,
        vva: r.user_addr,
        offset: r.mmap_offset,
        _dma: Arc::new(DmaRegistration::new(&region)),
        region: Arc::new(region),
    })
}

impl MemoryTable {
    /// The map workers read.
    pub fn shared(&self) -> Arc<ArcSwap<GuestMemory>> {
        self.shared.clone()
    }

    fn publish(&mut self, maps: Vec<Mapping>) -> Result<(), MemoryError> {
        let mem = GuestMemory::from_arc_regions(maps.iter().map(|m| m.region.clone()).collect())
            .map_err(|e| MemoryError::Layout(e.to_string()))?;
        self.shared.store(Arc::new(mem));
        self.maps = maps;
        Ok(())
    }

    /// Replaces the whole table (SET_MEM_TABLE).
    pub fn set(
        &mut self,
        regions: &[VhostUserMemoryRegion],
        files: Vec<File>,
    ) -> Result<(), MemoryError> {
        if regions.len() as u64 > MAX_MEM_SLOTS || regions.len() != files.len() {
            return Err(MemoryError::TooMany);
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
        if self.maps.len() as u64 >= MAX_MEM_SLOTS {
            return Err(MemoryError::TooMany);
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
        use std::os::fd::AsRawFd;
        self.maps
            .iter()
            .filter_map(|m| {
                let fd = m.region.file_offset()?.file().as_raw_fd();
                Some((
                    VhostUserMemoryRegion::new(m.gpa, m.size, m.vva, m.offset),
                    fd,
                ))
            })
            .collect()
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
