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
//! Reads copy out of the mapping too, where `preadv` spent more than the copy itself in
//! per-page lookups (a C loop on this machine, one thread: 4 KiB random reads 263K/s with
//! `preadv`, 739K/s by copy; 128 KiB sequential 17K/s and 36K/s). A read fault on a tmpfs
//! hole allocates a page, though, which would fill a thin device with zeroes for a guest that
//! merely reads it, so a read copies only over pages known to hold data: a bitmap, one bit per
//! page, set by copies written here and by `mincore` (one call for a request over pages not
//! known yet); zeroing clears it ([`FileMap::forget`]). Anything else is read with `preadv`,
//! which leaves holes alone. A read whose source faulted (the file truncated under us) is done
//! again with `preadv`; one whose destination faulted (truncated guest memory) fails with
//! EFAULT, as `preadv` into it did.
//!
//! What it costs: the worker's page tables map every page it read or wrote, and a killed
//! worker's exit unmaps them before its descriptors (and the device's `flock`) go, so a
//! restart after a kill waits for that: about 300 ns a page here (a C loop: 60 ms for
//! 768 MiB all mapped, on a loaded machine), the kind of cost its mappings of guest memory
//! already had. Page tables take 0.2% of what is mapped.
//!
//! Owns: the mapping, its watch, which pages are known to hold data. Must not know: queues,
//! requests, volumes.

use std::ops::RangeInclusive;
use std::os::fd::RawFd;
use std::sync::atomic::{fence, AtomicU64, Ordering};

/// The page the bitmap and `mincore` count in (x86-64 and aarch64 Linux with 4 KiB pages;
/// [`FileMap::new`] declines other page sizes).
const PAGE: usize = 4096;

/// Most pages one `mincore` call looks at (its result vector lives on the stack).
const MINCORE_PAGES: usize = 256;

/// A shared, writable mapping of a whole device file, and which of its pages hold data.
#[derive(Debug)]
pub struct FileMap {
    base: *mut u8,
    len: usize,
    watch: Option<spool_sigbus::Watch>,
    /// One bit per page: set when the page is known to hold data (a read may copy from it
    /// without allocating it).
    present: Box<[AtomicU64]>,
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
        // SAFETY: sysconf takes an integer.
        if unsafe { libc::sysconf(libc::_SC_PAGESIZE) } != PAGE as libc::c_long {
            return None;
        }
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
            present: (0..len.div_ceil(PAGE).div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
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
        // SAFETY: the caller's contract.
        let (iov, start, total) = unsafe { self.span(offset, iov, iovcnt) }?;
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
        // A source that faulted (a frontend truncated its guest memory) was covered with
        // zeroes, and the copy took them: the write fails, as `pwritev` failed with EFAULT,
        // rather than storing zeroes as the guest's data.
        if let Some(verdict) = self.faulted_under(iov) {
            return verdict;
        }
        if total > 0 {
            self.mark(pages(start, total));
        }
        Some(total as i32)
    }

    /// Copies `[offset, offset + total)` of the file into the `iovcnt` buffers of `iov`.
    /// Some(bytes read), or Some(-EFAULT) when a destination buffer is in a watched mapping
    /// a fault hit, or None when the caller must read through the descriptor instead: the
    /// range is not inside the mapping, covers a page not known to hold data (a hole, whose
    /// read fault would allocate it), or a fault hit the mapping.
    ///
    /// # Safety
    /// `iov` points to `iovcnt` iovecs over writable buffers that stay valid for the call.
    pub unsafe fn read(&self, offset: u64, iov: *const libc::iovec, iovcnt: usize) -> Option<i32> {
        // SAFETY: the caller's contract.
        let (iov, start, total) = unsafe { self.span(offset, iov, iovcnt) }?;
        if total == 0 || !self.holds_data(pages(start, total)) {
            return None;
        }
        let mut at = start;
        for v in iov {
            // SAFETY: `[at, at + iov_len)` is inside the mapping (bounded by `total` above) and
            // its pages hold data (no read fault allocates one); the destination is the
            // caller's writable buffer, never a mapping of a device file, so they cannot
            // overlap. A fault on either side is covered by its watch (checked below).
            unsafe {
                std::ptr::copy_nonoverlapping(self.base.add(at), v.iov_base as *mut u8, v.iov_len)
            };
            at += v.iov_len;
        }
        // A fault that covered the mapping under this copy gave us the cover's bytes: the read
        // is done again through the descriptor, which tells the truth. A destination that
        // faulted fails the read, as `preadv` into it did.
        if let Some(verdict) = self.faulted_under(iov) {
            return verdict;
        }
        Some(total as i32)
    }

    /// After a copy between the mapping and `iov`: None when no fault touched either. Else
    /// Some(None) when one hit the mapping (the caller must go through the descriptor), or
    /// Some(Some(-EFAULT)) when one hit a buffer of `iov` (a frontend truncated its guest
    /// memory, covered with zeroes by its watch). One load for the buffers unless a fault
    /// ever happened in this process.
    fn faulted_under(&self, iov: &[libc::iovec]) -> Option<Option<i32>> {
        // The copy's loads and stores before the check (`spool_sigbus::hit` is set before a
        // cover): a fault under this copy is seen.
        fence(Ordering::SeqCst);
        if self.broken() {
            return Some(None);
        }
        let hit = spool_sigbus::hits() != 0
            && iov
                .iter()
                .any(|v| spool_sigbus::hit_in(v.iov_base as usize, v.iov_len));
        hit.then_some(Some(-libc::EFAULT))
    }

    /// The `iovcnt` iovecs at `iov`, where they start in the mapping and their total length;
    /// None when the mapping is broken or the range is not inside it.
    ///
    /// # Safety
    /// `iov` points to `iovcnt` valid iovecs that outlive the returned slice.
    unsafe fn span<'a>(
        &self,
        offset: u64,
        iov: *const libc::iovec,
        iovcnt: usize,
    ) -> Option<(&'a [libc::iovec], usize, usize)> {
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
        Some((iov, start, total))
    }

    /// Forgets that the pages touching `[offset, offset + len)` hold data: called before they
    /// are zeroed (a punched hole), so that no read copies from them until they are known
    /// again. A read racing the zeroing may still fault one of them back in, as a read racing
    /// a write reads either.
    pub fn forget(&self, offset: u64, len: u64) {
        let Ok(start) = usize::try_from(offset) else {
            return;
        };
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| start.checked_add(l))
            .map_or(self.len, |e| e.min(self.len));
        if start >= end {
            return;
        }
        for_words(pages(start, end - start), |w, mask| {
            self.present[w].fetch_and(!mask, Ordering::Relaxed);
        });
    }

    /// Whether every page in `pages` holds data: known from the bitmap, or else asked of the
    /// kernel (`mincore`: in the page cache, which for tmpfs means not a hole and not swapped
    /// out) and remembered.
    fn holds_data(&self, pages: RangeInclusive<usize>) -> bool {
        let mut known = true;
        for_words(pages.clone(), |w, mask| {
            known &= self.present[w].load(Ordering::Relaxed) & mask == mask;
        });
        if known {
            return true;
        }
        let mut resident = [0u8; MINCORE_PAGES];
        let (first, last) = (*pages.start(), *pages.end());
        let mut p = first;
        while p <= last {
            let n = (last + 1 - p).min(MINCORE_PAGES);
            // SAFETY: pages `[p, p + n)` lie in our mapping (`read` bounded the range; the last
            // page of a mapping is whole), and the kernel writes `n` bytes into `resident`, which
            // has room for `MINCORE_PAGES`.
            let r = unsafe {
                libc::mincore(
                    self.base.add(p * PAGE).cast(),
                    n * PAGE,
                    resident.as_mut_ptr(),
                )
            };
            if r != 0 || resident[..n].iter().any(|b| b & 1 == 0) {
                return false;
            }
            p += n;
        }
        self.mark(pages);
        true
    }

    /// Remembers that every page in `pages` holds data.
    fn mark(&self, pages: RangeInclusive<usize>) {
        for_words(pages, |w, mask| {
            // A load first: pages written over and over keep their word's cache line shared.
            if self.present[w].load(Ordering::Relaxed) & mask != mask {
                self.present[w].fetch_or(mask, Ordering::Relaxed);
            }
        });
    }
}

/// The pages `[start, start + len)` touches (`len` > 0).
fn pages(start: usize, len: usize) -> RangeInclusive<usize> {
    start / PAGE..=(start + len - 1) / PAGE
}

/// Calls `f(word, mask)` for each bitmap word `pages` touches, with the bits of those pages.
fn for_words(pages: RangeInclusive<usize>, mut f: impl FnMut(usize, u64)) {
    let (mut p, last) = (*pages.start(), *pages.end());
    while p <= last {
        let (w, bit) = (p / 64, p % 64);
        let n = (last + 1 - p).min(64 - bit);
        let mask = if n == 64 {
            u64::MAX
        } else {
            ((1u64 << n) - 1) << bit
        };
        f(w, mask);
        p += n;
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
    use std::path::Path;

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

    /// A frontend's guest memory as the worker sees it after the frontend truncated it: a
    /// watched shared mapping whose pages are gone (any access raises SIGBUS, which the
    /// watch covers).
    struct TruncatedGuest {
        p: *mut libc::c_void,
        watch: Option<spool_sigbus::Watch>,
    }

    impl TruncatedGuest {
        fn new(dir: &Path) -> TruncatedGuest {
            let guest = rw(&dir.join("guest"));
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
            TruncatedGuest {
                p,
                watch: Some(watch),
            }
        }

        fn faulted(&self) -> bool {
            self.watch.as_ref().is_some_and(|w| w.faulted())
        }

        /// Its first page.
        fn iov(&self) -> libc::iovec {
            libc::iovec {
                iov_base: self.p,
                iov_len: 4096,
            }
        }
    }

    impl Drop for TruncatedGuest {
        fn drop(&mut self) {
            // Unwatched first, so the handler never covers an address after it is unmapped.
            drop(self.watch.take());
            // SAFETY: our mapping (now the cover after a fault), no longer watched.
            unsafe { libc::munmap(self.p, 8192) };
        }
    }

    /// A source buffer in watched memory that faults while it is copied (a frontend that
    /// truncated its guest memory): the write fails with EFAULT, as `pwritev` did, instead of
    /// completing with the cover's zeroes as the guest's data (the failed write's blocks are
    /// undefined, as after a `pwritev` cut short by the fault).
    #[test]
    fn a_source_that_faults_fails_the_write_with_efault() {
        let (dir, _f, m) = mapped_file();
        let guest = TruncatedGuest::new(dir.path());
        let v = [guest.iov()];
        // SAFETY: one iovec over our mapping; its pages are gone, and the load's SIGBUS is
        // covered by the watch.
        assert_eq!(unsafe { m.write(0, v.as_ptr(), 1) }, Some(-libc::EFAULT));
        assert!(guest.faulted() && !m.broken());
    }

    fn iov_mut(b: &mut [u8]) -> libc::iovec {
        libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        }
    }

    /// Bytes of tmpfs memory the file holds.
    fn allocated(f: &std::fs::File) -> u64 {
        std::os::unix::fs::MetadataExt::blocks(&f.metadata().unwrap()) * 512
    }

    /// Reads copy the file's bytes, written through the descriptor or the mapping, into
    /// several buffers; a read over a hole (or partly over one) is declined and allocates
    /// nothing, and stays declined until the page holds data.
    #[test]
    fn reads_copy_the_files_bytes_and_leave_holes_alone() {
        let (_dir, f, m) = mapped_file();
        f.write_all_at(&[5u8; 8192], 8192).unwrap();
        let before = allocated(&f);
        let (mut a, mut b) = (vec![0u8; 1000], vec![0u8; 7192]);
        let v = [iov_mut(&mut a), iov_mut(&mut b)];
        // SAFETY: two iovecs over live, writable buffers.
        assert_eq!(unsafe { m.read(8192, v.as_ptr(), 2) }, Some(8192));
        assert!(a.iter().chain(&b).all(|&x| x == 5));
        let mut c = vec![1u8; 4096];
        let v = [iov_mut(&mut c)];
        for hole in [0u64, 16384, 65536, (1 << 20) - 4096] {
            // SAFETY: one iovec over a live, writable buffer.
            assert_eq!(unsafe { m.read(hole, v.as_ptr(), 1) }, None, "at {hole}");
        }
        let mut d = vec![1u8; 8192];
        // SAFETY: one iovec over a live, writable buffer; its second page is a hole.
        assert_eq!(
            unsafe { m.read(12288, [iov_mut(&mut d)].as_ptr(), 1) },
            None
        );
        assert_eq!(allocated(&f), before, "a declined read allocated pages");
        assert!(c.iter().all(|&x| x == 1));
        let w = vec![9u8; 4096];
        // SAFETY: one iovec over a live buffer.
        assert_eq!(unsafe { m.write(65536, [iov(&w)].as_ptr(), 1) }, Some(4096));
        // SAFETY: one iovec over a live, writable buffer.
        assert_eq!(unsafe { m.read(65536, v.as_ptr(), 1) }, Some(4096));
        assert!(c.iter().all(|&x| x == 9));
        // SAFETY: as above; beyond the mapping.
        assert_eq!(unsafe { m.read(1 << 20, v.as_ptr(), 1) }, None);
    }

    /// Zeroed pages are forgotten: a read of a punched hole is declined (and allocates
    /// nothing) although the page held data before.
    #[test]
    fn a_punched_hole_is_forgotten() {
        let (_dir, f, m) = mapped_file();
        let w = vec![3u8; 8192];
        // SAFETY: one iovec over a live buffer.
        assert_eq!(unsafe { m.write(0, [iov(&w)].as_ptr(), 1) }, Some(8192));
        let mut c = vec![0u8; 4096];
        let v = [iov_mut(&mut c)];
        // SAFETY: one iovec over a live, writable buffer.
        assert_eq!(unsafe { m.read(4096, v.as_ptr(), 1) }, Some(4096));
        m.forget(4096, 4096);
        crate::file::zero_file_range(&f, Path::new("t"), 4096, 4096).unwrap();
        let before = allocated(&f);
        // SAFETY: as above.
        assert_eq!(unsafe { m.read(4096, v.as_ptr(), 1) }, None);
        assert_eq!(allocated(&f), before);
        // SAFETY: as above; page 0 still holds data.
        assert_eq!(unsafe { m.read(0, v.as_ptr(), 1) }, Some(4096));
    }

    /// A read whose source page was truncated away under the mapping takes the cover's bytes:
    /// it is declined (the descriptor then reads the truth), as is every later one; a read
    /// into guest memory that faulted fails with EFAULT.
    #[test]
    fn reads_that_fault_are_declined_or_fail_with_efault() {
        let (dir, f, m) = mapped_file();
        let w = vec![4u8; 8192];
        // SAFETY: one iovec over a live buffer.
        assert_eq!(unsafe { m.write(65536, [iov(&w)].as_ptr(), 1) }, Some(8192));
        let guest = TruncatedGuest::new(dir.path());
        let v = [guest.iov()];
        // SAFETY: one iovec over our mapping; its pages are gone, and the store's SIGBUS is
        // covered by the watch.
        assert_eq!(unsafe { m.read(65536, v.as_ptr(), 1) }, Some(-libc::EFAULT));
        assert!(guest.faulted() && !m.broken());
        drop(guest);

        f.set_len(4096).unwrap();
        let mut c = vec![0u8; 4096];
        let v = [iov_mut(&mut c)];
        // SAFETY: one iovec over a live, writable buffer; the page is known to hold data but
        // is beyond the file's end now, and the load's SIGBUS is covered by the watch.
        assert_eq!(unsafe { m.read(65536, v.as_ptr(), 1) }, None);
        assert!(m.broken());
        // SAFETY: as above.
        assert_eq!(unsafe { m.read(0, v.as_ptr(), 1) }, None);
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
