//! Per-worker asynchronous device queues.
//!
//! A [`DeviceQueue`] is owned by exactly one I/O worker: no lock is taken on submit or reap.
//! [`UringQueue`] is the io_uring implementation for files and block devices; the userspace
//! NVMe driver and the null/fault-injection devices fill the same trait.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use io_uring::{opcode, squeue, types, IoUring};

/// One contiguous piece of caller memory (same layout as `struct iovec`).
pub type IoVec = libc::iovec;

/// One device operation. Offsets and lengths are device bytes.
#[derive(Debug, Clone, Copy)]
pub enum DeviceIo {
    /// Read `len` bytes at `offset` into the `iovcnt` buffers at `iov`.
    Read {
        offset: u64,
        len: u64,
        iov: *const IoVec,
        iovcnt: u32,
    },
    /// Write `len` bytes at `offset` from the `iovcnt` buffers at `iov`.
    Write {
        offset: u64,
        len: u64,
        iov: *const IoVec,
        iovcnt: u32,
    },
    /// Make every completed write durable (fdatasync).
    Flush,
    /// The range's contents are no longer needed (they may read back as zeroes or not).
    Discard { offset: u64, len: u64 },
    /// The range must read back as zeroes.
    WriteZeroes { offset: u64, len: u64 },
}

impl DeviceIo {
    /// A write (`write`) or a read of `len` bytes at `offset`, from or into the `iovcnt`
    /// buffers at `iov`.
    #[inline]
    pub fn data(write: bool, offset: u64, len: u64, iov: *const IoVec, iovcnt: u32) -> Self {
        if write {
            DeviceIo::Write {
                offset,
                len,
                iov,
                iovcnt,
            }
        } else {
            DeviceIo::Read {
                offset,
                len,
                iov,
                iovcnt,
            }
        }
    }
}

/// A device's submission/completion queue owned by one worker.
pub trait DeviceQueue: Send {
    /// Queues `io`; its completion is reported by [`DeviceQueue::reap`] with `tag`.
    /// `tag` must be below 2^62.
    ///
    /// # Safety
    /// For reads and writes, the iovec array and every buffer it describes must stay valid
    /// (mapped, not freed, not otherwise written for reads) until the completion for `tag`
    /// has been reaped.
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64);
    /// Hands queued operations to the device.
    fn kick(&mut self) -> std::io::Result<()>;
    /// Calls `done(tag, result)` for each finished operation; `result` is the byte count
    /// (or 0) on success and a negative errno on failure. Returns how many were reaped.
    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize;
    /// A descriptor that becomes readable when completions are waiting.
    fn completion_fd(&self) -> RawFd;
    /// Resets the readiness of [`DeviceQueue::completion_fd`] (after a wake-up).
    fn ack_completion_event(&self);
    /// Whether completions signal [`DeviceQueue::completion_fd`]. A polling worker turns this
    /// off (it would only cost a kernel wake-up per completion) and on before it sleeps.
    fn set_completion_events(&mut self, _enabled: bool) {}
    /// True when completions are found only by polling (the userspace NVMe driver has no
    /// interrupts): the worker must not sleep while such a queue has operations in flight.
    fn polled(&self) -> bool {
        false
    }
    /// Operations submitted and not yet reaped.
    fn in_flight(&self) -> usize;
    /// Completes every operation the queue can give up on (hung commands) with
    /// `-ECANCELED` on the next reap, as a controller reset aborts its commands. Operations
    /// already handed to the kernel cannot be taken back and complete normally. Returns how
    /// many were aborted.
    fn abort(&mut self) -> usize {
        0
    }
    /// The device was declared failed: give up even what `abort` cannot take back (an
    /// operation a network storage holds for ever), completing it with -ECANCELED, as long
    /// as nothing of the caller's buffers is touched afterwards. Returns how many. By
    /// default the same as `abort`.
    fn abandon(&mut self) -> usize {
        self.abort()
    }
}

/// A boxed queue is a queue: what lets a wrapper (fault injection) stack on the queue of any
/// backend, whose type it does not know.
impl<Q: DeviceQueue + ?Sized> DeviceQueue for Box<Q> {
    #[inline]
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        // SAFETY: the caller's guarantee is passed on unchanged.
        unsafe { (**self).submit(io, tag) }
    }

    #[inline]
    fn kick(&mut self) -> std::io::Result<()> {
        (**self).kick()
    }

    #[inline]
    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        (**self).reap(done)
    }

    fn completion_fd(&self) -> RawFd {
        (**self).completion_fd()
    }

    fn ack_completion_event(&self) {
        (**self).ack_completion_event()
    }

    fn set_completion_events(&mut self, enabled: bool) {
        (**self).set_completion_events(enabled)
    }

    #[inline]
    fn polled(&self) -> bool {
        (**self).polled()
    }

    #[inline]
    fn in_flight(&self) -> usize {
        (**self).in_flight()
    }

    fn abort(&mut self) -> usize {
        (**self).abort()
    }

    fn abandon(&mut self) -> usize {
        (**self).abandon()
    }
}

/// Hands every completion already known (tag, result) to `done`; returns how many.
pub fn drain_done(q: &mut VecDeque<(u64, i32)>, done: &mut dyn FnMut(u64, i32)) -> usize {
    let n = q.len();
    while let Some((t, r)) = q.pop_front() {
        done(t, r);
    }
    n
}

/// A fresh non-blocking eventfd, the completion descriptor of a device queue.
pub fn completion_eventfd() -> std::io::Result<std::fs::File> {
    // SAFETY: eventfd takes no pointers; the result is checked before use.
    let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if efd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `efd` is a fresh descriptor we exclusively own.
    Ok(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(efd) }))
}

/// A new epoll descriptor (for a queue composed of other queues: its completion descriptor).
pub fn epoll_new() -> std::io::Result<OwnedFd> {
    // SAFETY: epoll_create1 takes no pointers; the result is checked.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we exclusively own.
    Ok(unsafe { OwnedFd::from_raw_fd(ep) })
}

/// Makes `ep` readable while `fd` is.
pub fn epoll_watch(ep: RawFd, fd: RawFd) -> std::io::Result<()> {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: fd as u64,
    };
    // SAFETY: `ev` is a valid epoll_event for the duration of the call.
    if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

const KIND_SHIFT: u32 = 62;
const KIND_PLAIN: u64 = 0;
const KIND_ZERO_RANGE: u64 = 1;
const KIND_DISCARD: u64 = 2;

/// io_uring queue over a file or block device.
pub struct UringQueue {
    ring: IoUring,
    buffered: RawFd,
    direct: Option<RawFd>,
    align: u64,
    overflow: VecDeque<squeue::Entry>,
    in_flight: usize,
    event: std::fs::File,
    /// Write-zeroes commands in flight, by their own id (not the caller's tag: one request
    /// may zero several ranges under one tag), so an EOPNOTSUPP can fall back to punching
    /// exactly that command's range: id -> (tag, offset, len).
    zero_ranges: HashMap<u64, (u64, u64, u64)>,
    next_zero_id: u64,
}

/// Which of the queue's descriptors a request goes to.
#[derive(Clone, Copy)]
enum Which {
    Buffered,
    Direct,
}

/// Builds a read or write entry of the queue `q`, without an iovec array when there is a
/// single buffer (the kernel then has none to copy in and check).
///
/// The files are deliberately not registered with the ring (`IORING_REGISTER_FILES`): a ring
/// is torn down asynchronously after its process dies, and its registered files, with the
/// device's lock, outlived a killed worker long enough for the next one to find the device
/// "in use by another process" (test `data_survives_restart_and_kill`).
macro_rules! rw_entry {
    ($q:expr, $which:expr, $iov:expr, $iovcnt:expr, $offset:expr, $vec:ident, $one:ident) => {{
        let fd = match $which {
            Which::Buffered => $q.buffered,
            Which::Direct => $q.direct.unwrap_or($q.buffered),
        };
        if $iovcnt == 1 {
            // SAFETY: `iovcnt == 1` valid iovec (the `submit` contract); the iovec array is our
            // caller's memory, not the guest's, so a shared reference to it is fine.
            let v = unsafe { &*$iov };
            opcode::$one::new(types::Fd(fd), v.iov_base as _, v.iov_len as u32)
                .offset($offset)
                .build()
        } else {
            opcode::$vec::new(types::Fd(fd), $iov, $iovcnt)
                .offset($offset)
                .build()
        }
    }};
}

impl UringQueue {
    /// Creates a ring of `depth` entries over the given descriptors. The descriptors must
    /// outlive the queue (the owning device is kept alive by the caller).
    pub fn new(
        buffered: RawFd,
        direct: Option<RawFd>,
        align: u64,
        depth: u32,
    ) -> std::io::Result<Self> {
        // No IORING_SETUP_COOP_TASKRUN: completions of punted requests must wake a worker
        // that sleeps in epoll on the ring's eventfd, which cooperative task running does not
        // promise; it measured no faster here either.
        let ring = IoUring::builder().build(depth.clamp(8, 4096))?;
        let event = completion_eventfd()?;
        ring.submitter().register_eventfd(event.as_raw_fd())?;
        Ok(UringQueue {
            ring,
            buffered,
            direct,
            align,
            overflow: VecDeque::new(),
            in_flight: 0,
            event,
            zero_ranges: HashMap::new(),
            next_zero_id: 0,
        })
    }

    fn pick_fd(&self, offset: u64, len: u64, iov: *const IoVec, iovcnt: u32) -> Which {
        if self.direct.is_none() {
            return Which::Buffered;
        }
        let a = self.align;
        if !offset.is_multiple_of(a) || !len.is_multiple_of(a) {
            return Which::Buffered;
        }
        // SAFETY: `iovcnt` valid iovecs (the `submit` contract); the array is the worker's
        // (`SlotBufs`), not guest memory, and is not written while this borrow lives.
        let iovs = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
        if iovs
            .iter()
            .all(|v| (v.iov_base as u64).is_multiple_of(a) && (v.iov_len as u64).is_multiple_of(a))
        {
            Which::Direct
        } else {
            Which::Buffered
        }
    }

    fn push(&mut self, e: squeue::Entry) {
        self.in_flight += 1;
        if !self.overflow.is_empty() {
            self.overflow.push_back(e);
            return;
        }
        // SAFETY: every entry built by this queue references memory the submit() caller keeps
        // alive until its completion is reaped (the trait's contract) or no memory at all.
        if unsafe { self.ring.submission().push(&e) }.is_err() {
            self.overflow.push_back(e);
        }
    }

    fn fallocate(&self, offset: u64, len: u64, mode: i32, user_data: u64) -> squeue::Entry {
        fallocate_entry(self.buffered, offset, len, mode, user_data)
    }
}

fn fallocate_entry(fd: RawFd, offset: u64, len: u64, mode: i32, user_data: u64) -> squeue::Entry {
    {
        opcode::Fallocate::new(types::Fd(fd), len)
            .offset(offset)
            .mode(mode)
            .build()
            .user_data(user_data)
    }
}

impl DeviceQueue for UringQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        debug_assert!(tag < (1 << KIND_SHIFT));
        let plain = tag | (KIND_PLAIN << KIND_SHIFT);
        let e = match io {
            DeviceIo::Read {
                offset,
                len,
                iov,
                iovcnt,
            } => {
                let which = self.pick_fd(offset, len, iov, iovcnt);
                rw_entry!(self, which, iov, iovcnt, offset, Readv, Read).user_data(plain)
            }
            DeviceIo::Write {
                offset,
                len,
                iov,
                iovcnt,
            } => {
                let which = self.pick_fd(offset, len, iov, iovcnt);
                rw_entry!(self, which, iov, iovcnt, offset, Writev, Write).user_data(plain)
            }
            DeviceIo::Flush => opcode::Fsync::new(types::Fd(self.buffered))
                .flags(types::FsyncFlags::DATASYNC)
                .build()
                .user_data(plain),
            DeviceIo::Discard { offset, len } => self.fallocate(
                offset,
                len,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                tag | (KIND_DISCARD << KIND_SHIFT),
            ),
            DeviceIo::WriteZeroes { offset, len } => {
                let id = self.next_zero_id;
                self.next_zero_id = (id + 1) & ((1 << KIND_SHIFT) - 1);
                self.zero_ranges.insert(id, (tag, offset, len));
                self.fallocate(
                    offset,
                    len,
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                    id | (KIND_ZERO_RANGE << KIND_SHIFT),
                )
            }
        };
        self.push(e);
    }

    fn kick(&mut self) -> std::io::Result<()> {
        while let Some(e) = self.overflow.front() {
            // SAFETY: as in push(): the entry's memory is kept alive by the submit() caller.
            if unsafe { self.ring.submission().push(e) }.is_err() {
                break;
            }
            self.overflow.pop_front();
        }
        if self.ring.submission().is_empty() {
            return Ok(());
        }
        match self.ring.submit() {
            Ok(_) => Ok(()),
            Err(e)
                if e.raw_os_error() == Some(libc::EBUSY)
                    || e.raw_os_error() == Some(libc::EAGAIN) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        let mut n = 0;
        let mut retry = Vec::new();
        let fd = self.buffered;
        for cqe in self.ring.completion() {
            let ud = cqe.user_data();
            let mut tag = ud & ((1 << KIND_SHIFT) - 1);
            let kind = ud >> KIND_SHIFT;
            let mut res = cqe.result();
            match kind {
                KIND_ZERO_RANGE => {
                    let Some((t, offset, len)) = self.zero_ranges.remove(&tag) else {
                        // Every write-zeroes command is recorded at submit; not reached.
                        self.in_flight -= 1;
                        continue;
                    };
                    tag = t;
                    if res == -libc::EOPNOTSUPP || res == -libc::EINVAL {
                        // tmpfs and some block devices lack ZERO_RANGE; a punched hole reads
                        // back as zeroes on files, and as zeroes on block devices too (the
                        // kernel zeroes or unmaps with zeroing guaranteed).
                        retry.push(fallocate_entry(
                            fd,
                            offset,
                            len,
                            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                            tag | (KIND_PLAIN << KIND_SHIFT),
                        ));
                        continue;
                    }
                }
                KIND_DISCARD if res == -libc::EOPNOTSUPP => res = 0, // discard is advisory
                _ => {}
            }
            self.in_flight -= 1;
            n += 1;
            done(tag, res);
        }
        for e in retry {
            self.in_flight -= 1; // push() counts it again
            self.push(e);
        }
        n
    }

    fn completion_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    fn set_completion_events(&mut self, enabled: bool) {
        if enabled {
            self.ring.completion().enable_eventfd();
        } else {
            self.ring.completion().disable_eventfd();
        }
    }

    fn ack_completion_event(&self) {
        use std::io::Read;
        let mut buf = [0u8; 8];
        let _ = (&self.event).read(&mut buf);
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Device, OpenOptions};

    fn wait_all(q: &mut dyn DeviceQueue) -> Vec<(u64, i32)> {
        let mut out = Vec::new();
        q.kick().unwrap();
        while q.in_flight() > 0 {
            q.reap(&mut |t, r| out.push((t, r)));
            q.kick().unwrap();
            std::thread::yield_now();
        }
        out
    }

    #[test]
    fn read_write_flush_zero_discard_through_the_ring() {
        // /tmp is a disk file system here (io_uring); /dev/shm is tmpfs (inline queue).
        let disk = tempfile::tempdir().unwrap();
        exercise(disk.path(), false);
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        exercise(shm.path(), true);
    }

    #[test]
    fn multi_range_write_zeroes_falls_back_on_each_range() {
        // tmpfs has no FALLOC_FL_ZERO_RANGE: each range falls back to a punched hole. One
        // request's ranges share a tag; the fallback used to punch only the last one and
        // fail the others (issue 15, finding 10).
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = shm.path().join("d");
        std::fs::write(&path, vec![0xaau8; 1 << 20]).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let mut q = UringQueue::new(f.as_raw_fd(), None, 512, 8).unwrap();
        let ranges = [(0u64, 4096u64), (65536, 8192), (262144, 4096)];
        for &(offset, len) in &ranges {
            // SAFETY: no memory is referenced.
            unsafe { q.submit(DeviceIo::WriteZeroes { offset, len }, 7) };
        }
        let r = wait_all(&mut q);
        assert_eq!(r, vec![(7, 0); 3], "every range completes, successfully");
        let back = std::fs::read(&path).unwrap();
        for &(offset, len) in &ranges {
            let s = &back[offset as usize..(offset + len) as usize];
            assert!(s.iter().all(|&b| b == 0), "range at {offset} not zeroed");
        }
        assert_eq!(back[4096], 0xaa, "nothing else zeroed");
        assert_eq!(back[65536 + 8192], 0xaa, "nothing else zeroed");
        drop(q);
        drop(f);
    }

    fn exercise(dir: &std::path::Path, expect_inline: bool) {
        let dev = Device::open(
            &dir.join("d"),
            &OpenOptions {
                create_size: Some(1 << 20),
                ..Default::default()
            },
        )
        .unwrap();
        if expect_inline {
            assert!(dev.inline_io(), "tmpfs must use the inline queue");
        }
        let mut q = dev.open_queue(4).unwrap();
        // Unaligned buffer on purpose: must take the buffered path and still work.
        let mut data = vec![0xabu8; 8193];
        let iov = [IoVec {
            iov_base: data[1..].as_mut_ptr().cast(),
            iov_len: 8192,
        }];
        // SAFETY: `data` and `iov` outlive wait_all().
        unsafe {
            q.submit(
                DeviceIo::Write {
                    offset: 8192,
                    len: 8192,
                    iov: iov.as_ptr(),
                    iovcnt: 1,
                },
                1,
            );
            q.submit(DeviceIo::Flush, 2);
        }
        let mut r = wait_all(&mut *q);
        r.sort();
        assert_eq!(r, vec![(1, 8192), (2, 0)]);
        let mut back = vec![0u8; 8192];
        dev.read_at(&mut back, 8192).unwrap();
        assert!(back.iter().all(|&b| b == 0xab));
        // SAFETY: no memory is referenced.
        unsafe {
            q.submit(
                DeviceIo::WriteZeroes {
                    offset: 8192,
                    len: 4096,
                },
                3,
            );
            q.submit(
                DeviceIo::Discard {
                    offset: 12288,
                    len: 4096,
                },
                4,
            );
        }
        let mut r = wait_all(&mut *q);
        r.sort();
        assert_eq!(r, vec![(3, 0), (4, 0)]);
        dev.read_at(&mut back[..4096], 8192).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 0));
        // Many more submissions than ring entries: the overflow queue carries them.
        let mut bufs = vec![[0u8; 512]; 64];
        let iovs: Vec<IoVec> = bufs
            .iter_mut()
            .map(|b| IoVec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: 512,
            })
            .collect();
        for (i, v) in iovs.iter().enumerate() {
            // SAFETY: `bufs` and `iovs` outlive wait_all().
            unsafe {
                q.submit(
                    DeviceIo::Read {
                        offset: 8192 + 512 * (i as u64 % 16),
                        len: 512,
                        iov: v,
                        iovcnt: 1,
                    },
                    100 + i as u64,
                )
            };
        }
        let r = wait_all(&mut *q);
        assert_eq!(r.len(), 64);
        assert!(r.iter().all(|&(_, res)| res == 512));
    }
}
