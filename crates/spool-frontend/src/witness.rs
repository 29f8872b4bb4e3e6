//! The write witness ([`WriteWitness`], config `[debug] write_witness = PATH`; docs/upgrade.md,
//! "Checking a migration page by page"): every guest page this process writes (a completed
//! request's device-writable buffers and status byte, the used ring: the ranges the dirty log
//! is marked with, whether or not a log is on) is recorded in a file of at least [`SIZE`]
//! bytes: one little-endian u64 per 4 KiB page of the first 4 GiB of guest memory, 0 for a
//! page never written, else `1 << 32 | crc32c` of the page as it was right after spoold's
//! write. The migration test compares the guest's RAM on both sides of a migration; for a
//! page that came over wrong, the witness tells whether the source still held what spoold
//! wrote there (spoold's write was not carried: its dirty log missed it) or something the
//! guest wrote since (QEMU's own tracking missed the guest's write).
//!
//! Owns: the witness file's mapping and its records. Must not know: virtio (the worker says
//! which ranges it wrote).

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::hostmem::HostMap;

/// Bytes of a witness file: one u64 per page of 4 GiB.
pub const SIZE: usize = (4 << 30) / PAGE as usize * 8;
const PAGE: u64 = 4096;

/// A witness file, mapped (shared: every worker process of a spoold records into it).
pub struct WriteWitness {
    slots: *const AtomicU64,
    pages: u64,
}

// SAFETY: the mapping is shared memory accessed only through atomics, alive as long as the
// witness (unmapped in Drop, when no worker holds it any more).
unsafe impl Send for WriteWitness {}
// SAFETY: as above.
unsafe impl Sync for WriteWitness {}

impl std::fmt::Debug for WriteWitness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteWitness")
            .field("pages", &self.pages)
            .finish()
    }
}

impl WriteWitness {
    /// Maps the witness file at `path`, which must exist and hold at least [`SIZE`] bytes.
    pub fn open(path: &Path) -> std::io::Result<WriteWitness> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        let len = file.metadata()?.len();
        if len < SIZE as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("a write witness file holds at least {SIZE} bytes; this one {len}"),
            ));
        }
        // SAFETY: a new shared mapping at a kernel-chosen address of a file at least SIZE
        // bytes long (checked above); unmapped only in Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(WriteWitness {
            slots: p.cast(),
            pages: SIZE as u64 / 8,
        })
    }

    /// Records the pages of guest-physical `[gpa, gpa + len)` as they are now.
    pub fn record(&self, host: &HostMap, gpa: u64, len: u64) {
        if len == 0 {
            return;
        }
        let mut page = [0u8; PAGE as usize];
        for p in gpa / PAGE..=(gpa.saturating_add(len - 1) / PAGE) {
            if p >= self.pages || !host.read(p * PAGE, &mut page) {
                continue;
            }
            let v = 1u64 << 32 | crc32c::crc32c(&page) as u64;
            // SAFETY: `p < pages`, the number of u64 slots in the mapping, alive while `self` is.
            unsafe { &*self.slots.add(p as usize) }.store(v, Ordering::Relaxed);
        }
    }
}

impl Drop for WriteWitness {
    fn drop(&mut self) {
        // SAFETY: the mapping `open` made, SIZE bytes; no slot reference outlives `record`.
        unsafe { libc::munmap(self.slots as *mut libc::c_void, SIZE) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_witness_file_must_exist_and_hold_every_page() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w");
        let e = WriteWitness::open(&p).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(SIZE as u64 - 8).unwrap();
        let e = WriteWitness::open(&p).unwrap_err();
        assert!(e.to_string().contains("at least"), "{e}");
        f.set_len(SIZE as u64).unwrap();
        let w = WriteWitness::open(&p).unwrap();
        assert_eq!(w.pages, SIZE as u64 / 8);
        drop(w);
    }
}
