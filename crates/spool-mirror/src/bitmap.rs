//! The write-intent bitmap of one mirrored volume: one byte per region of the volume, in a
//! file mapped shared (md's external bitmap, one byte instead of one bit so that every change
//! is a single atomic store).
//!
//! A region's byte says: [`INTENT`] (a write may be in flight there: after a crash the legs
//! may differ); for each leg slot, whether that leg missed an acknowledged write or was never
//! copied there ([`stale`]); and whether the region is *out of sync* and which leg serves its
//! reads until it is resynced ([`out_of_sync`]: md's resync after an unclean stop, where the
//! legs may differ only in writes no one saw complete, so every leg not stale there holds
//! every acknowledged write). A bit set to 1 is made durable (`msync`) before the write it
//! guards goes out; bits are cleared lazily and never synced (a lost clear only costs a
//! resync).
//! The header records, per slot, which leg its stale bits belong to, so a rebuild resumes
//! after a restart instead of starting over.
//!
//! Owns: the file format and its validation. Must not know: legs, devices, queues.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// A write may be in flight in the region.
pub const INTENT: u8 = 0x80;
/// The out-of-sync field: 0 (in sync) or the slot + 1 of the leg that serves the region's
/// reads until it is resynced.
pub const SYNC_SOURCE: u8 = 0x30;
const SYNC_SHIFT: u32 = 4;
/// Header bytes before the region bytes (one page).
const HEADER: usize = 4096;
/// Written by this version. Version 1 (no out-of-sync field) is read too: its regions are
/// all in sync. A version-1 daemon finds a version-2 bitmap unusable and resyncs everything
/// (so a downgrade is safe, not quick).
const MAGIC: [u8; 8] = *b"SPOOLMB2";
const MAGIC_V1: [u8; 8] = *b"SPOOLMB1";

/// The stale bit of leg slot `slot` (0..3).
#[inline]
pub const fn stale(slot: u8) -> u8 {
    1 << slot
}

/// The out-of-sync field of a region whose reads leg `slot` serves.
#[inline]
pub const fn out_of_sync(slot: u8) -> u8 {
    (slot + 1) << SYNC_SHIFT
}

/// The leg serving reads of an out-of-sync region whose byte is `byte` (None: in sync).
#[inline]
pub const fn sync_source(byte: u8) -> Option<u8> {
    match (byte & SYNC_SOURCE) >> SYNC_SHIFT {
        0 => None,
        s => Some(s - 1),
    }
}

/// How a bitmap was found when opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// A valid bitmap of this volume (grown if the volume grew).
    Kept,
    /// None, or an unusable one (another geometry, damaged): every region's state is unknown.
    Fresh,
}

/// One mirrored volume's region bytes, mapped shared.
pub struct Bitmap {
    /// `HEADER + regions` bytes, mapped shared read-write.
    base: *mut u8,
    map_len: usize,
    regions: usize,
    /// Kept open for msync's sake only; the mapping outlives nothing.
    _file: Option<File>,
    /// Syncs made, and the time they took (ns): what the intent bits cost the data path.
    syncs: AtomicU64,
    sync_ns: AtomicU64,
}

// SAFETY: the mapping is only accessed through atomics (`byte`, `slot_id`), and it lives as
// long as the `Bitmap`; the raw pointer is what makes the type not automatically Send/Sync.
unsafe impl Send for Bitmap {}
// SAFETY: as above: every access to the shared bytes is atomic.
unsafe impl Sync for Bitmap {}

impl std::fmt::Debug for Bitmap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bitmap({} regions)", self.regions)
    }
}

impl Bitmap {
    /// Opens (or creates) the bitmap at `path` for `regions` regions of `1 << region_shift`
    /// bytes, or keeps it in anonymous memory (no crash safety) when `path` is `None`.
    pub fn open(
        path: Option<&Path>,
        regions: usize,
        region_shift: u32,
    ) -> std::io::Result<(Bitmap, Found)> {
        let map_len = HEADER + regions;
        let (file, found) = match path {
            // Memory only (tests): nothing survives the process, nothing is in doubt.
            None => (None, Found::Kept),
            Some(p) => {
                if let Some(dir) = p.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(p)?;
                let found = check_header(&f, regions, region_shift)?;
                if found == Found::Fresh {
                    f.set_len(0)?;
                }
                if (f.metadata()?.len() as usize) < map_len {
                    f.set_len(map_len as u64)?;
                }
                (Some(f), found)
            }
        };
        let base = map_shared(file.as_ref(), map_len)?;
        let b = Bitmap {
            base,
            map_len,
            regions,
            _file: file,
            syncs: AtomicU64::new(0),
            sync_ns: AtomicU64::new(0),
        };
        if found == Found::Fresh || b._file.is_none() {
            b.write_header(regions, region_shift);
        } else {
            // A grown volume: record the new region count (and this version).
            b.header_u64(16).store(regions as u64, Ordering::Relaxed);
            b.header_u64(0)
                .store(u64::from_le_bytes(MAGIC), Ordering::Relaxed);
        }
        Ok((b, found))
    }

    /// Number of regions.
    pub fn regions(&self) -> usize {
        self.regions
    }

    /// The byte of region `r`.
    #[inline]
    pub fn byte(&self, r: usize) -> &AtomicU8 {
        assert!(r < self.regions, "region {r} beyond the bitmap");
        // SAFETY: `HEADER + r` is inside the live mapping; AtomicU8 has alignment 1, and
        // every access to the shared bytes goes through atomics.
        unsafe { &*(self.base.add(HEADER + r) as *const AtomicU8) }
    }

    /// The leg identity recorded for `slot`'s stale bits (0: none).
    pub fn slot_id(&self, slot: u8) -> &AtomicU64 {
        self.header_u64(32 + 8 * slot as usize)
    }

    fn header_u64(&self, at: usize) -> &AtomicU64 {
        assert!(at + 8 <= HEADER && at.is_multiple_of(8));
        // SAFETY: inside the header page of the live mapping, 8-byte aligned (the mapping is
        // page aligned), accessed only atomically.
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    fn write_header(&self, regions: usize, region_shift: u32) {
        self.header_u64(0)
            .store(u64::from_le_bytes(MAGIC), Ordering::Relaxed);
        self.header_u64(8)
            .store(region_shift as u64, Ordering::Relaxed);
        self.header_u64(16).store(regions as u64, Ordering::Relaxed);
        self.sync_header();
    }

    /// Makes the header durable.
    pub fn sync_header(&self) {
        self.sync_bytes(0, HEADER);
    }

    /// Makes the bytes of regions `first..=last` durable (the pages holding them).
    pub fn sync(&self, first: usize, last: usize) {
        self.sync_bytes(HEADER + first, HEADER + last + 1);
    }

    /// Syncs made since the bitmap was opened, and the nanoseconds they took.
    pub fn syncs(&self) -> (u64, u64) {
        (
            self.syncs.load(Ordering::Relaxed),
            self.sync_ns.load(Ordering::Relaxed),
        )
    }

    fn sync_bytes(&self, from: usize, to: usize) {
        if self._file.is_none() {
            return;
        }
        let t0 = std::time::Instant::now();
        let page = 4096;
        let start = from / page * page;
        let end = to.min(self.map_len).div_ceil(page) * page;
        // SAFETY: the range lies within our mapping (rounded to pages inside it: the mapping
        // length is rounded up to pages by the kernel).
        let rc = unsafe {
            libc::msync(
                self.base.add(start) as *mut libc::c_void,
                end - start,
                libc::MS_SYNC,
            )
        };
        if rc != 0 {
            tracing::warn!(error = %std::io::Error::last_os_error(), "msync of the mirror write-intent bitmap failed");
        }
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.sync_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

impl Drop for Bitmap {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `map_len` bytes; nothing refers to it after drop.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.map_len) };
    }
}

/// Maps `len` bytes of `file` (or of anonymous memory) shared, read-write; the caller
/// unmaps them (`munmap`) when done.
pub(crate) fn map_shared(file: Option<&File>, len: usize) -> std::io::Result<*mut u8> {
    let (fd, flags) = match file {
        Some(f) => (f.as_raw_fd(), libc::MAP_SHARED),
        None => (-1, libc::MAP_SHARED | libc::MAP_ANONYMOUS),
    };
    // SAFETY: a fresh mapping of `len` bytes of a file we hold open (or anonymous memory);
    // the result is checked before use, and unmapped by its owner's Drop.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(base as *mut u8)
}

/// Whether `f` holds a usable bitmap for `regions` regions of `1 << region_shift` bytes (a
/// bitmap of fewer regions is usable: the volume grew).
fn check_header(f: &File, regions: usize, region_shift: u32) -> std::io::Result<Found> {
    use std::os::unix::fs::FileExt;
    let mut h = [0u8; 24];
    if f.metadata()?.len() < HEADER as u64 || f.read_exact_at(&mut h, 0).is_err() {
        return Ok(Found::Fresh);
    }
    let at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
    let ok = (h[0..8] == MAGIC || h[0..8] == MAGIC_V1)
        && at(8) == region_shift as u64
        && at(16) <= regions as u64
        && f.metadata()?.len() >= HEADER as u64 + at(16);
    Ok(if ok { Found::Kept } else { Found::Fresh })
}
