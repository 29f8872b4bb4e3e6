//! A thin volume read and written synchronously, outside the data path: what receiving the
//! volume from another host writes with (docs/transfer.md), while no frontend runs it. Each
//! call goes through a queue of the thin device like a guest's request, so writes allocate
//! chunks (or wait for space as a guest's do), and write-zeroes of whole chunks leave holes.
//!
//! Owns: one queue for these calls, opened on first use; turning any byte range into
//! page-aligned commands (reading the pages an unaligned write covers in part first).
//! Must not know: NBD, who else may write the volume (the caller makes sure no one does).

use std::sync::Mutex;
use std::time::Duration;

use spool_devices::{run_one, AlignedBuf, DeviceIo, IoVec};

use std::sync::Arc;

use crate::shared::Shared;
use crate::ThinQueue;

/// The unit the commands are aligned to.
const PAGE: u64 = 4096;

/// A command that has not come back after this long is aborted (it may be waiting for
/// space past the full-pool bound, or on a hung device).
const ABORT_AFTER: Duration = Duration::from_secs(60);

/// The queue of the calls and their buffer, once opened; closed for good when the device
/// shuts down (a call after that fails rather than open a queue on a stopped device).
#[derive(Default)]
pub(crate) struct SyncIo(Mutex<SyncState>);

#[derive(Default)]
enum SyncState {
    #[default]
    NotOpen,
    Open(Box<(ThinQueue, AlignedBuf)>),
    Closed,
}

impl std::fmt::Debug for SyncIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SyncIo")
    }
}

impl SyncIo {
    /// Drops the queue (the device is shutting down).
    pub(crate) fn close(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = SyncState::Closed;
    }
}

fn failed(shared: &Shared, what: &'static str, errno: i32) -> spool_devices::Error {
    spool_devices::Error::io(
        &shared.spec.path,
        what,
        std::io::Error::from_raw_os_error(errno),
    )
}

/// The thin device's synchronous calls: its shared state and the calls' queue.
pub(crate) struct SyncCalls<'a>(pub(crate) &'a Arc<Shared>, pub(crate) &'a SyncIo);

impl SyncCalls<'_> {
    /// Runs `f` with the calls' queue and buffer, opening the queue on first use.
    fn with_sync_queue<R>(
        &self,
        f: impl FnOnce(&mut ThinQueue, &mut AlignedBuf) -> spool_devices::Result<R>,
    ) -> spool_devices::Result<R> {
        let mut g = self.1 .0.lock().unwrap_or_else(|p| p.into_inner());
        if let SyncState::NotOpen = *g {
            let q = ThinQueue::new(self.0.clone(), 4)
                .map_err(|e| spool_devices::Error::io(&self.0.spec.path, "open a queue", e))?;
            *g = SyncState::Open(Box::new((q, AlignedBuf::default())));
        }
        match &mut *g {
            SyncState::Open(open) => f(&mut open.0, &mut open.1),
            _ => Err(failed(self.0, "open a queue", libc::ESHUTDOWN)),
        }
    }

    /// Reads or writes `buf` (page-aligned, whole pages) at page-aligned `offset`.
    fn rw_pages(
        &self,
        q: &mut ThinQueue,
        write: bool,
        offset: u64,
        buf: &mut [u8],
    ) -> spool_devices::Result<()> {
        let iov = IoVec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        let io = DeviceIo::data(write, offset, buf.len() as u64, &iov, 1);
        // SAFETY: `iov` and `buf` outlive the call, which returns once the command is
        // reaped; the queue is this call's alone (under the lock).
        match unsafe { run_one(q, io, ABORT_AFTER) } {
            r if r >= 0 => Ok(()),
            r => Err(failed(self.0, if write { "write" } else { "read" }, -r)),
        }
    }

    /// One command without data (a flush, a write-zeroes).
    fn run_bare(
        &self,
        q: &mut ThinQueue,
        io: DeviceIo,
        what: &'static str,
    ) -> spool_devices::Result<()> {
        // SAFETY: the command points at no buffer.
        match unsafe { run_one(q, io, ABORT_AFTER) } {
            r if r >= 0 => Ok(()),
            r => Err(failed(self.0, what, -r)),
        }
    }

    /// The pages covering `[offset, offset + len)`, checked against the size.
    fn pages(&self, offset: u64, len: u64) -> spool_devices::Result<(u64, u64)> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.0.size.load(std::sync::atomic::Ordering::Acquire))
            .ok_or_else(|| failed(self.0, "range", libc::EINVAL))?;
        Ok((offset / PAGE * PAGE, end.div_ceil(PAGE) * PAGE))
    }

    /// Reads `buf.len()` bytes at `offset` (holes read as zeroes).
    pub(crate) fn read(&self, buf: &mut [u8], offset: u64) -> spool_devices::Result<()> {
        let (start, end) = self.pages(offset, buf.len() as u64)?;
        self.with_sync_queue(|q, a| {
            let pages = a.get((end - start) as usize);
            self.rw_pages(q, false, start, pages)?;
            let at = (offset - start) as usize;
            buf.copy_from_slice(&pages[at..at + buf.len()]);
            Ok(())
        })
    }

    /// Writes `buf` at `offset`, durably: chunks are allocated for it as for a guest's
    /// write. The pages it covers in part are read first and written back whole.
    pub(crate) fn write(&self, buf: &[u8], offset: u64) -> spool_devices::Result<()> {
        let (start, end) = self.pages(offset, buf.len() as u64)?;
        self.with_sync_queue(|q, a| {
            let pages = a.get((end - start) as usize);
            let n = pages.len();
            if offset != start {
                self.rw_pages(q, false, start, &mut pages[..PAGE as usize])?;
            }
            if offset + buf.len() as u64 != end && (n as u64 > PAGE || offset == start) {
                self.rw_pages(q, false, end - PAGE, &mut pages[n - PAGE as usize..])?;
            }
            let at = (offset - start) as usize;
            pages[at..at + buf.len()].copy_from_slice(buf);
            self.rw_pages(q, true, start, pages)?;
            self.run_bare(q, DeviceIo::Flush, "flush")
        })
    }

    /// Makes `[offset, offset + len)` read back as zeroes, durably: whole chunks become
    /// holes, the rest is written with zeroes.
    pub(crate) fn zero(&self, offset: u64, len: u64) -> spool_devices::Result<()> {
        self.pages(offset, len)?;
        let (inner_start, inner_end) = (offset.div_ceil(PAGE) * PAGE, (offset + len) / PAGE * PAGE);
        if inner_start >= inner_end {
            return self.zero_bytes(offset, len);
        }
        if offset != inner_start {
            self.zero_bytes(offset, inner_start - offset)?;
        }
        if offset + len != inner_end {
            self.zero_bytes(inner_end, offset + len - inner_end)?;
        }
        self.with_sync_queue(|q, _| {
            let io = DeviceIo::WriteZeroes {
                offset: inner_start,
                len: inner_end - inner_start,
            };
            self.run_bare(q, io, "write-zeroes")?;
            self.run_bare(q, DeviceIo::Flush, "flush")
        })
    }

    /// Writes zeroes over a few bytes (the unaligned edges of a write-zeroes): only in the
    /// chunks mapped now, since a hole reads zeroes already and writing there would
    /// allocate a chunk for nothing.
    fn zero_bytes(&self, offset: u64, len: u64) -> spool_devices::Result<()> {
        for (c, _, n, at) in crate::map::chunk_pieces(self.0.spec.chunk, offset, len) {
            if self.0.map.get(c).is_some() {
                self.write(&vec![0; n as usize], offset + at)?;
            }
        }
        Ok(())
    }
}
