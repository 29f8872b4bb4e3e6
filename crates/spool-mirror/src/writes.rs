//! Writes in flight per region of one mirror, as counters in a small file mapped shared next
//! to the write-intent bitmap (`UUID.bitmap.writes`), never synced.
//!
//! What it buys: after a worker is killed or crashes, its successor on the same boot reads
//! exactly which regions had writes in flight (the page cache holds the dead process's last
//! stores, written back or not), so only those are in doubt, not every region written in the
//! last second. After a host crash (another boot id in the file) the counters say nothing and
//! the bitmap's intent bits, durable, decide as before. A new file is made at each open (the
//! old one unlinked first), so a predecessor still finishing writes (an upgrade's) counts on
//! its own inode and never disturbs the successor's counts.
//!
//! Owns: the file format (magic, boot id, region count, one u32 per region). Must not know:
//! legs, the bitmap's bits.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::AtomicU32;

const MAGIC: [u8; 8] = *b"SPOOLWC1";
/// Magic, region count (u64), boot id (the kernel's, 36 characters, zero-padded to 48).
const HEADER: usize = 64;
const BOOT_ID: std::ops::Range<usize> = 16..64;

/// One mirror's counters of writes in flight per region (see the module doc).
pub(crate) struct WriteCounts {
    base: *mut u8,
    map_len: usize,
    regions: usize,
    _file: Option<File>,
}

// SAFETY: the mapping is only accessed through atomics and lives as long as the value; the
// raw pointer is what makes the type not automatically Send/Sync.
unsafe impl Send for WriteCounts {}
// SAFETY: as above: every access to the shared counters is atomic.
unsafe impl Sync for WriteCounts {}

/// The kernel's boot id (empty if it cannot be read: then no file is ever trusted).
fn boot_id() -> [u8; 48] {
    let mut id = [0u8; 48];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let s = s.trim().as_bytes();
        let n = s.len().min(48);
        id[..n].copy_from_slice(&s[..n]);
    }
    id
}

impl WriteCounts {
    /// Per region, whether the process that last used `path` had writes in flight there,
    /// when it can say: the file is whole, of this boot and of `regions` regions. `None` otherwise (no
    /// file, another boot: a host crash or reboot, another geometry).
    pub(crate) fn left_behind(path: &Path, regions: usize) -> Option<Vec<bool>> {
        let f = File::open(path).ok()?;
        let mut h = [0u8; HEADER];
        f.read_exact_at(&mut h, 0).ok()?;
        let boot = boot_id();
        let trusted = h[0..8] == MAGIC
            && u64::from_le_bytes(h[8..16].try_into().ok()?) == regions as u64
            && h[BOOT_ID] == boot[..]
            && boot.iter().any(|&b| b != 0);
        if !trusted {
            return None;
        }
        let mut counts = vec![0u8; regions * 4];
        f.read_exact_at(&mut counts, HEADER as u64).ok()?;
        Some(
            counts
                .chunks_exact(4)
                // The top bits are the clearing and copying flags, not writes.
                .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]) & !super::FLAGS != 0)
                .collect(),
        )
    }

    /// Fresh counters (all zero) for `regions` regions in a new file at `path` (the old one
    /// unlinked first), or in anonymous memory when `path` is `None`.
    pub(crate) fn create(path: Option<&Path>, regions: usize) -> std::io::Result<WriteCounts> {
        let map_len = HEADER + regions.max(1) * 4;
        let file = match path {
            None => None,
            Some(p) => {
                match std::fs::remove_file(p) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(p)?;
                f.set_len(map_len as u64)?;
                let mut h = [0u8; HEADER];
                h[0..8].copy_from_slice(&MAGIC);
                h[8..16].copy_from_slice(&(regions as u64).to_le_bytes());
                h[BOOT_ID].copy_from_slice(&boot_id());
                f.write_all_at(&h, 0)?;
                Some(f)
            }
        };
        let base = super::bitmap::map_shared(file.as_ref(), map_len)?;
        Ok(WriteCounts {
            base,
            map_len,
            regions,
            _file: file,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.regions
    }
}

impl std::ops::Index<usize> for WriteCounts {
    type Output = AtomicU32;

    #[inline]
    fn index(&self, r: usize) -> &AtomicU32 {
        assert!(r < self.regions, "region {r} beyond the write counters");
        // SAFETY: `HEADER + 4 * r` is inside the live mapping and 4-byte aligned (the mapping
        // is page aligned, HEADER a multiple of 4); the counters are only accessed atomically.
        unsafe { &*(self.base.add(HEADER + 4 * r) as *const AtomicU32) }
    }
}

impl Drop for WriteCounts {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `map_len` bytes; nothing refers to it after drop.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.map_len) };
    }
}
