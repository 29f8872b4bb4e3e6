//! Writes by memory copy into a shared mapping of a tmpfs device file.
//!
//! Every `write(2)` to a tmpfs file takes the file's inode lock, so the worker threads of
//! several volumes carved from one device file wrote one at a time, and the waiters spun on
//! the lock (perf: `rwsem_spin_on_owner`). Three threads writing 4 KiB blocks to one tmpfs
//! file managed 69K writes/s with `pwrite` against 622K/s by copying into a `MAP_SHARED`
//! mapping of it (a C loop on this 2-core machine). The mapping is of the same page cache the
//! descriptor reads and writes, so reads (`preadv`, which takes no lock on tmpfs and does not
//! fill holes), zeroing and metadata I/O through the descriptor see the copies at once.
//!
//! A store into the mapping faults (SIGBUS) when tmpfs has no page left for it or the file
//! was truncated under us. The mapping is watched by spool-sigbus, which covers it with
//! anonymous memory; a copy checks the watch afterwards, and a copy that may have gone into
//! the cover (or any after it) is done again with `pwritev`, which reports the error (ENOSPC)
//! or writes the data. From then on every write of the device takes the descriptor. A copy
//! whose source faulted (a frontend truncated its guest memory, covered with zeroes by the
//! frontend's watch) fails with EFAULT, as `pwritev` from that memory did, rather than store
//! the zeroes as the guest's data.
//!
//! Owns: the mapping and its watch. Must not know: queues, requests, volumes.

use std::os::fd::RawFd;
use std::sync::atomic::{fence, Ordering};

/// A shared, writable mapping of a whole device file.
#[derive(Debug)]
pub struct FileMap {
    base: *mut u8,
    len: usize,
    watch: Option<spool_sigbus::Watch>,
}

// SAFETY: the mapping is plain shared memory, never referenced as Rust data: stores go
// through raw pointers in `write`, from any thread, like concurrent `pwrite`s of the file.
unsafe impl Send for FileMap {}
// SAFETY: as above; `&FileMap` only hands out copies into the mapping.
unsafe impl Sync for FileMap {}

impl FileMap {
    /// Maps the first `len` bytes of `fd` shared and writable. None when the mapping or its
    /// watch cannot be had: the device then writes through the descriptor, as before.
    pub fn new(fd: RawFd, len: u64) -> Option<FileMap> {
        let len = usize::try_from(len).ok().filter(|&l| l > 0)?;
        // SAFETY: a new shared mapping of a descriptor we hold; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            tracing::debug!(error = %std::io::Error::last_os_error(), "device file not mapped; writes take the descriptor");
            return None;
        }
        let mut map = FileMap {
            base: p.cast(),
            len,
            watch: None,
        };
        let watch = spool_sigbus::Watch::new(p as usize, len, 0);
        if !watch.is_watched() {
            return None;
        }
        map.watch = Some(watch);
        Some(map)
    }

    /// Whether a fault hit the mapping: its contents may be dummy memory now.
    pub fn broken(&self) -> bool {
        self.watch.as_ref().is_none_or(|w| w.hit())
    }

    /// Copies the `iovcnt` buffers of `iov` to `offset` of the file. Some(bytes written), or
    /// Some(-EFAULT) when a source buffer is in a watched mapping a fault hit (its bytes are
    /// the cover's), or None when the caller must write through the descriptor instead: the
    /// range is not inside the mapping, or a fault hit it (before or during this copy).
    ///
    /// # Safety
    /// `iov` points to `iovcnt` iovecs over readable buffers that stay valid for the call.
    pub unsafe fn write(&self, offset: u64, iov: *const libc::iovec, iovcnt: usize) -> Option<i32> {
        if self.broken() {
            return None;
        }
        // SAFETY: the caller's contract: `iovcnt` valid iovecs.
        let iov = unsafe { std::slice::from_raw_parts(iov, iovcnt) };
        let total = iov
            .iter()
            .try_fold(0usize, |t, v| t.checked_add(v.iov_len))?;
        let start = usize::try_from(offset).ok()?;
        if start.checked_add(total)? > self.len || total > i32::MAX as usize {
            return None;
        }
        let mut at = start;
        for v in iov {
            // SAFETY: `[at, at + iov_len)` is inside the mapping (bounded by `total` above),
            // which stays mapped while `self` lives; the source is the caller's readable
            // buffer. The two cannot overlap: guest memory and buffers are never mappings of a
            // device file. A fault on the destination is covered by the watch (checked below).
            unsafe {
                std::ptr::copy_nonoverlapping(v.iov_base as *const u8, self.base.add(at), v.iov_len)
            };
            at += v.iov_len;
        }
        // The stores before the check (`spool_sigbus::hit`): a fault that covered the mapping
        // under this copy is seen, and the write is done again through the descriptor.
        fence(Ordering::SeqCst);
        if self.broken() {
            return None;
        }
        // A source that faulted (a frontend truncated its guest memory) was covered with
        // zeroes, and the copy took them: the write fails, as `pwritev` failed with EFAULT,
        // rather than storing zeroes as the guest's data. One load unless a fault ever
        // happened in this process.
        if spool_sigbus::hits() != 0
            && iov
                .iter()
                .any(|v| spool_sigbus::hit_in(v.iov_base as usize, v.iov_len))
        {
            return Some(-libc::EFAULT);
        }
        Some(total as i32)
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // Unwatched first, so the handler never covers an address after it is unmapped.
        drop(self.watch.take());
        // SAFETY: our own mapping of `len` bytes, no longer watched; the queues that copy into
        // it hold the `Arc` this lives in, so none is using it.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;

    fn rw(path: &std::path::Path) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .unwrap()
    }

    /// A 1 MiB file on tmpfs, mapped.
    fn mapped_file() -> (tempfile::TempDir, std::fs::File, FileMap) {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let f = rw(&dir.path().join("d"));
        f.set_len(1 << 20).unwrap();
        let m = FileMap::new(f.as_raw_fd(), 1 << 20).expect("mapped");
        (dir, f, m)
    }

    fn iov(b: &[u8]) -> libc::iovec {
        libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        }
    }

    /// Copies land in the file (read back through the descriptor); ranges outside the
    /// mapping are left to the descriptor.
    #[test]
    fn copies_are_the_files_bytes_and_out_of_range_writes_are_declined() {
        let (_dir, f, m) = mapped_file();
        let (a, b) = (vec![1u8; 3000], vec![2u8; 1096]);
        let v = [iov(&a), iov(&b)];
        // SAFETY: two iovecs over live buffers.
        assert_eq!(unsafe { m.write(8192, v.as_ptr(), 2) }, Some(4096));
        let mut back = vec![0u8; 4096];
        f.read_exact_at(&mut back, 8192).unwrap();
        assert!(back[..3000].iter().all(|&x| x == 1) && back[3000..].iter().all(|&x| x == 2));
        // SAFETY: as above.
        assert_eq!(unsafe { m.write((1 << 20) - 100, v.as_ptr(), 2) }, None);
        assert!(!m.broken());
    }

    /// A source buffer in watched memory that faults while it is copied (a frontend that
    /// truncated its guest memory): the write fails with EFAULT, as `pwritev` did, instead of
    /// completing with the cover's zeroes as the guest's data (the failed write's blocks are
    /// undefined, as after a `pwritev` cut short by the fault).
    #[test]
    fn a_source_that_faults_fails_the_write_with_efault() {
        let (dir, _f, m) = mapped_file();
        let guest = rw(&dir.path().join("guest"));
        guest.set_len(8192).unwrap();
        // SAFETY: a new shared mapping of a file we hold; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                guest.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let watch = spool_sigbus::Watch::new(p as usize, 8192, 0);
        assert!(watch.is_watched());
        guest.set_len(0).unwrap();
        let v = [libc::iovec {
            iov_base: p,
            iov_len: 4096,
        }];
        // SAFETY: one iovec over our mapping; its pages are gone, and the load's SIGBUS is
        // covered by the watch.
        assert_eq!(unsafe { m.write(0, v.as_ptr(), 1) }, Some(-libc::EFAULT));
        assert!(watch.faulted() && !m.broken());
        drop(watch);
        // SAFETY: our mapping (now the cover), no longer watched.
        unsafe { libc::munmap(p, 8192) };
    }

    /// A file truncated under the mapping: the copy faults, the watch covers it, and the
    /// write is declined (the caller's `pwritev` then reports or writes it), as is every
    /// write after it.
    #[test]
    fn a_copy_that_faults_is_declined_and_so_is_every_later_one() {
        let (_dir, f, m) = mapped_file();
        let a = vec![7u8; 4096];
        let v = [iov(&a)];
        // SAFETY: one iovec over a live buffer.
        assert_eq!(unsafe { m.write(0, v.as_ptr(), 1) }, Some(4096));
        f.set_len(4096).unwrap();
        // SAFETY: as above; the store beyond the file's end raises SIGBUS, which the watch
        // covers.
        assert_eq!(unsafe { m.write(65536, v.as_ptr(), 1) }, None);
        assert!(m.broken());
        // SAFETY: as above.
        assert_eq!(unsafe { m.write(0, v.as_ptr(), 1) }, None);
    }
}
