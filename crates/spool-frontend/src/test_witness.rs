//! Test hook (docs/upgrade.md, "Test hooks"; only with the `test-hooks` feature): the write
//! witness. With `SPOOL_TEST_WRITE_MAP=PATH` (an existing file of at least [`SIZE`] bytes),
//! every guest page this process writes (a completed request's device-writable buffers and
//! status byte, the used ring: the ranges the dirty log is marked with, whether or not a log
//! is on) is recorded there: one little-endian u64 per 4 KiB page of the first 4 GiB of
//! guest memory, 0 for a page never written, else `1 << 32 | crc32c` of the page as it was
//! right after spoold's write. The migration test compares the guest's RAM on both sides of a
//! migration; for a page that came over wrong, the witness tells whether the source still
//! held what spoold wrote there (spoold's write was not carried: its dirty log missed it) or
//! something the guest wrote since (QEMU's own tracking missed the guest's write).
//!
//! Owns: the witness file's mapping and its records. Must not know: virtio (the worker says
//! which ranges it wrote).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::hostmem::HostMap;

/// Bytes of a witness file: one u64 per page of 4 GiB.
pub const SIZE: usize = (4 << 30) / PAGE as usize * 8;
const PAGE: u64 = 4096;

/// The process's witness, mapped on first use.
pub struct Witness {
    slots: *const AtomicU64,
    pages: u64,
}

// SAFETY: the mapping is shared memory accessed only through atomics, alive for the process.
unsafe impl Send for Witness {}
// SAFETY: as above.
unsafe impl Sync for Witness {}

/// The witness `SPOOL_TEST_WRITE_MAP` names, or None.
pub fn witness() -> Option<&'static Witness> {
    static W: OnceLock<Option<Witness>> = OnceLock::new();
    W.get_or_init(|| {
        use std::os::fd::AsRawFd;
        let path = std::env::var_os("SPOOL_TEST_WRITE_MAP")?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .ok()?;
        if file.metadata().ok()?.len() < SIZE as u64 {
            return None;
        }
        // SAFETY: a new shared mapping at a kernel-chosen address of a file at least SIZE
        // bytes long (checked above); kept for the life of the process (never unmapped).
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
        (p != libc::MAP_FAILED).then(|| Witness {
            slots: p.cast(),
            pages: SIZE as u64 / 8,
        })
    })
    .as_ref()
}

impl Witness {
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
            // SAFETY: `p < pages`, the number of u64 slots in the mapping, alive for ever.
            unsafe { &*self.slots.add(p as usize) }.store(v, Ordering::Relaxed);
        }
    }
}
