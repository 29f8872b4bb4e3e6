//! A controller's arena: shared memory (a memfd the keeper holds) with the admin queue and a
//! header a later process reads to re-attach to the live controller.
//!
//! Layout (4 KiB pages): 0 header, 1 admin SQ, 2 admin CQ, 3 admin data buffer. The arena is
//! mapped for DMA at a fixed IOVA below [`crate::dma`]'s range, recorded with the keeper, so
//! the mapping the previous process made stays valid for the next one.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::qpair::Mirror;
use crate::{Error, Result, PAGE};

const MAGIC: u64 = u64::from_le_bytes(*b"SPOOLNV1");
/// Bytes of one arena.
pub(crate) const ARENA_LEN: usize = 4 * PAGE as usize;
const IOVA_FIRST: u64 = 0x8000_0000;
const IOVA_STRIDE: u64 = 0x10_0000;
const SLOTS: u64 = 1024;

/// Page 0.
#[repr(C)]
pub(crate) struct Header {
    magic: AtomicU64,
    /// I/O queue pairs the controller granted (Set Features is allowed once per reset).
    pub io_queues: AtomicU32,
    _reserved: AtomicU32,
    pub admin: Mirror,
    /// I/O queue identifiers that exist on the controller (bit per qid).
    qids: [AtomicU64; 16],
}

impl Header {
    pub fn set_qid(&self, qid: u16, live: bool) {
        let (w, b) = (qid as usize / 64, qid % 64);
        if w < self.qids.len() {
            if live {
                self.qids[w].fetch_or(1 << b, Ordering::AcqRel);
            } else {
                self.qids[w].fetch_and(!(1 << b), Ordering::AcqRel);
            }
        }
    }
    pub fn live_qids(&self) -> Vec<u16> {
        let mut v = Vec::new();
        for (w, word) in self.qids.iter().enumerate() {
            let x = word.load(Ordering::Acquire);
            for b in 0..64 {
                if x & (1 << b) != 0 && (w * 64 + b) != 0 {
                    v.push((w * 64 + b) as u16);
                }
            }
        }
        v
    }
}

static USED: Mutex<Vec<u64>> = Mutex::new(Vec::new());

pub(crate) struct Arena {
    file: File,
    ptr: *mut u8,
    pub iova: u64,
}

// SAFETY: the arena is a shared mapping owned by this value; concurrent users synchronise
// through the controller's locks and the header's atomics.
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

fn map(file: &File) -> Result<*mut u8> {
    // SAFETY: a shared mapping of our memfd of ARENA_LEN bytes; checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            ARENA_LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_POPULATE,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Error::os("mmap the controller arena"));
    }
    Ok(p.cast())
}

impl Arena {
    /// A fresh arena mapped for DMA at a free slot.
    pub fn create(c: &crate::vfio::Container) -> Result<Arena> {
        // SAFETY: memfd_create with a static name; checked.
        let fd = unsafe { libc::memfd_create(c"spool-nvme-arena".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::os("memfd_create for the controller arena"));
        }
        // SAFETY: a fresh descriptor we own.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(ARENA_LEN as u64).map_err(|e| Error::Os {
            what: "size the controller arena".into(),
            source: e,
        })?;
        let ptr = map(&file)?;
        let iova = {
            let mut used = USED.lock().unwrap_or_else(|p| p.into_inner());
            let Some(iova) = (0..SLOTS)
                .map(|i| IOVA_FIRST + i * IOVA_STRIDE)
                .find(|a| !used.contains(a))
            else {
                return Err(Error::Invalid("too many NVMe controllers".into()));
            };
            used.push(iova);
            iova
        };
        let a = Arena { file, ptr, iova };
        // A slot unused in this process may still carry the arena of a controller an earlier
        // worker let go of (hot removal): its mapping goes first.
        c.unmap_dma(iova, ARENA_LEN as u64);
        c.map_dma(ptr as u64, iova, ARENA_LEN as u64)?;
        a.header().magic.store(MAGIC, Ordering::Release);
        Ok(a)
    }

    /// The arena a previous process left (still mapped for DMA at `iova`).
    pub fn restore(file: File, iova: u64) -> Result<Arena> {
        let ptr = map(&file)?;
        let a = Arena { file, ptr, iova };
        if a.header().magic.load(Ordering::Acquire) != MAGIC {
            return Err(Error::Invalid(
                "the kept controller arena has no valid header".into(),
            ));
        }
        USED.lock().unwrap_or_else(|p| p.into_inner()).push(iova);
        Ok(a)
    }

    pub fn header(&self) -> &Header {
        // SAFETY: page 0 of the live mapping holds the header (all-atomic, any bytes valid).
        unsafe { &*self.ptr.cast::<Header>() }
    }

    /// Address and IOVA of page `i`.
    pub fn page(&self, i: usize) -> (*mut u8, u64) {
        assert!(i < ARENA_LEN / PAGE as usize);
        // SAFETY (arithmetic only): inside the mapping.
        (
            self.ptr.wrapping_add(i * PAGE as usize),
            self.iova + i as u64 * PAGE,
        )
    }

    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // The DMA mapping stays: the next worker (or the container's end) owns it.
        // SAFETY: unmapping our own mapping; no queue uses it any more (the controller drops
        // its queues first).
        unsafe { libc::munmap(self.ptr.cast(), ARENA_LEN) };
    }
}
