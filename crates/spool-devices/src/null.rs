//! The `null` device: completes every request at once without storing anything, to measure the
//! software stack alone (like SPDK's null bdev and qemu-storage-daemon's `null-co`).
//!
//! Reads either leave the guest's buffers untouched (SPDK's null bdev, qsd
//! `read-zeroes=off`) or zero them (qsd `read-zeroes=on`): [`NullReads`] makes the choice
//! explicit so benchmarks compare like with like. Pool metadata written to a null device is
//! kept in an anonymous memfd, so a pool on null devices opens; the memfd is deposited with
//! the keeper (`handoff`), so the next worker opens the same pool and its volumes, and the
//! kept connections carry on across a kill or an upgrade (crash and upgrade benchmarks).
//!
//! Must not know: health cells and fault injection (the [`crate::Device`] wrapper).

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use spool_nvme::handoff::Handoff;

use crate::backend::{check_range, check_size, BackendInfo, PoolDevice, Probe};
use crate::queue::{DeviceIo, DeviceQueue};
use crate::{Error, Result};

/// What a null device does with read buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NullReads {
    /// Never touch them (fastest; data read back is whatever the buffer held).
    #[default]
    Untouched,
    /// Fill them with zeroes (one memory write per byte read).
    Zero,
}

/// Queue of a null device.
pub struct NullQueue {
    reads: NullReads,
    done: VecDeque<(u64, i32)>,
    event: File,
}

impl NullQueue {
    /// A new queue.
    pub fn new(reads: NullReads) -> std::io::Result<Self> {
        Ok(NullQueue {
            reads,
            done: VecDeque::new(),
            event: crate::queue::completion_eventfd()?,
        })
    }
}

impl DeviceQueue for NullQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        let res = match io {
            DeviceIo::Read {
                len, iov, iovcnt, ..
            } => {
                if self.reads == NullReads::Zero {
                    // SAFETY: `iovcnt` valid iovecs (the `submit` contract; the worker's come
                    // from `HostMap::host`/`pieces`, each inside one guest region).
                    for v in unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) } {
                        // SAFETY: each buffer is `iov_len` writable bytes (`submit` contract);
                        // written as bytes, never through a reference to guest memory.
                        unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
                    }
                }
                len.min(i32::MAX as u64) as i32
            }
            DeviceIo::Write { len, .. } => len.min(i32::MAX as u64) as i32,
            _ => 0,
        };
        self.done.push_back((tag, res));
    }

    fn kick(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        crate::queue::drain_done(&mut self.done, done)
    }

    fn completion_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    fn ack_completion_event(&self) {}

    fn in_flight(&self) -> usize {
        self.done.len()
    }
}

/// The null device as a pool backend: its queues store nothing; its metadata lives in a memfd.
#[derive(Debug)]
pub struct NullBackend {
    path: PathBuf,
    size: u64,
    reads: NullReads,
    metadata: File,
}

impl NullBackend {
    /// A null device of `size` bytes named `name` (path `null:NAME`); its metadata is kept
    /// for the next worker through `handoff`.
    pub fn open(name: &str, size: u64, reads: NullReads, handoff: &Handoff) -> Result<Self> {
        let path = PathBuf::from(format!("null:{name}"));
        check_size(&path, size)?;
        let key = format!("{}{name}", spool_nvme::handoff::NULL_PREFIX);
        let kept = handoff
            .take(&key)
            .and_then(|(_, files)| files.into_iter().next())
            .filter(|f| f.metadata().is_ok_and(|m| m.len() == size));
        let metadata = match kept {
            Some(f) => f,
            None => {
                let f = memfd(&format!("spool-null-{name}"), &path)?;
                f.set_len(size)
                    .map_err(|e| Error::io(&path, "set size", e))?;
                f
            }
        };
        handoff.keep(&key, String::new(), &[metadata.as_raw_fd()]);
        Ok(NullBackend {
            path,
            size,
            reads,
            metadata,
        })
    }
}

impl PoolDevice for NullBackend {
    fn path(&self) -> &Path {
        &self.path
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            backend: "null",
            direct_align: None,
            inline_io: false,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(&self.path, self.size, offset, buf.len() as u64)?;
        self.metadata
            .read_exact_at(buf, offset)
            .map_err(|e| Error::io(&self.path, "read", e))
    }

    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(&self.path, self.size, offset, buf.len() as u64)?;
        self.metadata
            .write_all_at(buf, offset)
            .map_err(|e| Error::io(&self.path, "write", e))?;
        self.metadata
            .sync_data()
            .map_err(|e| Error::io(&self.path, "fdatasync", e))
    }

    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        check_range(&self.path, self.size, offset, len)?;
        crate::file::zero_file_range(&self.metadata, &self.path, offset, len)
    }

    fn open_queue(&self, _depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        Ok(Box::new(NullQueue::new(self.reads)?))
    }

    fn probe(&self) -> Probe {
        Probe::Ok
    }
}

/// A fresh anonymous memory file named `name` (`path` names the device in errors).
fn memfd(name: &str, path: &Path) -> Result<File> {
    let cname = std::ffi::CString::new(name).map_err(|_| Error::Invalid {
        path: path.display().to_string(),
        msg: "name contains a NUL byte".into(),
    })?;
    // SAFETY: memfd_create reads the NUL-terminated name we pass; the result is checked.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::io(
            path,
            "memfd_create",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: `fd` is a fresh descriptor we exclusively own.
    Ok(unsafe { File::from_raw_fd(fd) })
}
