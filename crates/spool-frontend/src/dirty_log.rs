//! The dirty-page log of a live migration (vhost-user `VHOST_F_LOG_ALL`, `SET_LOG_BASE` with
//! `VHOST_USER_PROTOCOL_F_LOG_SHMFD`): shared memory from the frontend holding one bit per
//! 4 KiB page of guest-physical memory. While the frontend has logging on, every byte this
//! process writes into guest memory (data read for the guest, status bytes, GET_ID strings,
//! used-ring entries and indexes) marks its pages, so QEMU sends them again before the
//! destination runs the guest.
//!
//! Owns: the log mapping (checked against its file, watched for SIGBUS like guest memory) and
//! the marking. Must not know: virtio (the workers say which ranges they wrote).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU8, Ordering};

use spool_sigbus::Watch;

/// Bytes of guest memory per log bit (`VHOST_LOG_PAGE`).
pub const LOG_PAGE: u64 = 4096;
/// The largest log accepted: one bit per page of a 32 TiB guest.
pub const MAX_LOG_SIZE: u64 = 1 << 30;

/// Why a frontend's dirty log cannot be mapped.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("log size {0:#x} must be between 1 byte and {MAX_LOG_SIZE:#x}")]
    Size(u64),
    #[error(transparent)]
    Backing(#[from] crate::backing::BackingError),
    #[error("cannot map the log: {0}")]
    Map(std::io::Error),
    #[error("no SIGBUS watch slot is left in this process")]
    NoWatch,
}

/// A frontend's dirty log, mapped.
#[derive(Debug)]
pub struct DirtyLog {
    addr: usize,
    /// Length of the mapping (from `map_offset`).
    len: usize,
    /// Bytes of log at `addr + skip`.
    size: u64,
    skip: usize,
    file: File,
    offset: u64,
    watch: Option<Watch>,
}

// SAFETY: the mapping is shared memory written only through atomics; the struct owns it.
unsafe impl Send for DirtyLog {}
// SAFETY: as above.
unsafe impl Sync for DirtyLog {}

impl DirtyLog {
    /// Maps `size` bytes of `file` from `offset` (SET_LOG_BASE's `mmap_size`, `mmap_offset`).
    pub fn map(file: File, size: u64, offset: u64) -> Result<DirtyLog, LogError> {
        if size == 0 || size > MAX_LOG_SIZE {
            return Err(LogError::Size(size));
        }
        let page = crate::backing::page_size();
        let map_offset = offset - offset % page;
        let skip = (offset - map_offset) as usize;
        crate::backing::check_backing(&file, map_offset, size + skip as u64)?;
        let len = size as usize + skip;
        // SAFETY: the kernel picks the address, so nothing is replaced. The file was seen
        // to hold the whole range; one cut short later raises SIGBUS, which the watch below
        // turns into zero pages (and `faulted`, which ends the session).
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                map_offset as libc::off_t,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(LogError::Map(std::io::Error::last_os_error()));
        }
        let watch = Watch::new(addr as usize, len, 0);
        if !watch.is_watched() {
            drop(watch);
            // SAFETY: the mapping made just above, which nothing else refers to.
            unsafe { libc::munmap(addr, len) };
            return Err(LogError::NoWatch);
        }
        Ok(DirtyLog {
            addr: addr as usize,
            len,
            size,
            skip,
            file,
            offset,
            watch: Some(watch),
        })
    }

    /// Marks the pages of guest-physical `[gpa, gpa + len)` dirty. Pages past the log's end
    /// are not the frontend's to migrate and are left alone.
    #[inline]
    pub fn mark(&self, gpa: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = gpa / LOG_PAGE;
        let last = gpa.saturating_add(len - 1) / LOG_PAGE;
        let base = self.addr + self.skip;
        // The writes being marked must be visible before a bit is found set and left alone:
        // x86 lets a store pass a later load, so without the fence QEMU could clear a bit we
        // just saw set (its sync's atomic exchange) and copy the page before our write
        // reached memory, leaving the write unsent and unmarked.
        std::sync::atomic::fence(Ordering::SeqCst);
        for page in first..=last {
            let byte = page / 8;
            if byte >= self.size {
                break;
            }
            // SAFETY: `byte < size`, and `addr + skip .. + size` is our mapping (alive while
            // `self` is). QEMU clears bits with atomic exchanges while we set them: both
            // sides access the bytes atomically.
            let cell = unsafe { &*((base + byte as usize) as *const AtomicU8) };
            let bit = 1u8 << (page % 8);
            if cell.load(Ordering::Relaxed) & bit == 0 {
                cell.fetch_or(bit, Ordering::Relaxed);
            }
        }
    }

    /// Whether the log's file was cut short under us: the session must end (the marks since
    /// then were lost).
    pub fn faulted(&self) -> bool {
        self.watch.as_ref().is_some_and(Watch::faulted)
    }

    /// The descriptor, size and offset, as SET_LOG_BASE gave them (for the kept state).
    pub fn parts(&self) -> (&File, u64, u64) {
        (&self.file, self.size, self.offset)
    }
}

impl Drop for DirtyLog {
    fn drop(&mut self) {
        drop(self.watch.take());
        // SAFETY: our own mapping of `len` bytes at `addr`, unwatched above; the last
        // reference is gone (workers hold the log through their memory map's `Arc`).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    fn log_file(size: usize) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![0u8; size]).unwrap();
        f
    }

    fn bits(f: &mut File) -> Vec<u8> {
        let mut v = Vec::new();
        f.rewind().unwrap();
        f.read_to_end(&mut v).unwrap();
        v
    }

    #[test]
    fn marks_every_page_a_range_touches_and_nothing_else() {
        let f = log_file(4096);
        let mut view = f.try_clone().unwrap();
        let log = DirtyLog::map(f, 16, 0).unwrap();
        log.mark(4095, 2); // pages 0 and 1
        log.mark(10 * LOG_PAGE + 100, 1); // page 10
        log.mark(64 * LOG_PAGE, 3 * LOG_PAGE); // pages 64..=66
        log.mark(200 * LOG_PAGE, 0); // nothing
        log.mark(1 << 40, 4096); // past the log: ignored
        let b = bits(&mut view);
        assert_eq!(b[0], 0b0000_0011);
        assert_eq!(b[1], 0b0000_0100);
        assert_eq!(b[8], 0b0000_0111);
        let set: u32 = b.iter().map(|x| x.count_ones()).sum();
        assert_eq!(set, 6, "{:?}", &b[..16]);
    }

    #[test]
    fn a_log_at_an_offset_is_marked_there() {
        let f = log_file(8192);
        let mut view = f.try_clone().unwrap();
        let log = DirtyLog::map(f, 64, 4096 + 8).unwrap();
        log.mark(0, 1);
        let b = bits(&mut view);
        assert_eq!(b[4096 + 8], 1);
        assert_eq!(b.iter().map(|x| x.count_ones()).sum::<u32>(), 1);
    }

    #[test]
    fn a_log_its_file_cannot_hold_is_refused() {
        assert!(DirtyLog::map(log_file(100), 4096, 0).is_err());
        assert!(DirtyLog::map(log_file(4096), 0, 0).is_err());
        assert!(DirtyLog::map(log_file(4096), MAX_LOG_SIZE + 1, 0).is_err());
        assert!(DirtyLog::map(log_file(4096), 8, u64::MAX - 4).is_err());
    }
}
