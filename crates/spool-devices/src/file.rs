//! Opening a regular file or block device as a pool device.
//!
//! Every device is opened twice: a buffered descriptor (always) and an O_DIRECT descriptor
//! (when the file system accepts it). Aligned I/O goes through the direct descriptor; I/O
//! whose offset, length or memory is not aligned to the device's direct-I/O alignment uses the
//! buffered one, so no bounce buffer is ever needed. Linux keeps the two coherent: a direct
//! read or write first writes back and invalidates the page cache of its range.

use std::fs::{File, OpenOptions as StdOpenOptions};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use std::sync::Arc;

use crate::{DeviceHealth, Error, FaultSet, FaultyQueue, Result, SECTOR_SIZE};

/// What kind of object backs a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// A regular file (sparse files are fine).
    File,
    /// A block device node.
    Block,
    /// Namespace 1 of an NVMe controller driven by Spool's userspace driver over VFIO
    /// (path `nvme:DDDD:BB:DD.F`).
    Nvme,
    /// The null device (nothing stored; metadata kept in an anonymous memfd for the life of
    /// the process): benchmarks only.
    Null(crate::NullReads),
}

/// How to open a device.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Create a regular file of this size if `path` does not exist.
    pub create_size: Option<u64>,
    /// Never use O_DIRECT (for tests and file systems where it misbehaves).
    pub no_direct: bool,
}

/// An open pool device.
#[derive(Debug)]
pub struct FileDevice {
    path: PathBuf,
    kind: DeviceKind,
    size: u64,
    buffered: File,
    direct: Option<File>,
    direct_align: u64,
    /// The file system cannot do non-blocking I/O (tmpfs): io_uring would punt every request
    /// to a kernel worker thread, so queues run inline instead.
    inline_io: bool,
    /// Injected faults, applied in front of every queue of this device.
    faults: Arc<FaultSet>,
    /// The state the data path obeys (the health monitor moves it).
    health: Arc<DeviceHealth>,
    /// The controller, for NVMe devices (then `buffered` is an empty placeholder memfd and
    /// every access goes through the controller).
    nvme: Option<Arc<spool_nvme::Controller>>,
    /// Last SMART critical-warning byte read from the controller, and when (NVMe only).
    smart_cache: std::sync::Mutex<(u8, Option<std::time::Instant>)>,
}

/// What [`FileDevice::nvme_status`] reports.
#[derive(Debug, Clone)]
pub struct NvmeStatus {
    pub pci: String,
    pub model: String,
    pub serial: String,
    pub firmware: String,
    pub version: String,
    pub lba_size: u64,
    pub blocks: u64,
    pub io_queues: u16,
    pub max_transfer: u64,
    /// Controller resets this process did (0 after a re-attach to a live controller).
    pub resets: u64,
    /// This process took the controller over live (no reset) from the previous worker.
    pub attached: bool,
    pub zero_copy_requests: u64,
    pub bounced_requests: u64,
    /// Zero-copy requests described by an SGL.
    pub sgl_requests: u64,
    /// Controller SGL support (0 none, 1 any alignment, 2 dword-aligned).
    pub sgl: u8,
    pub flush_commands: u64,
    pub deallocate_commands: u64,
    pub write_zeroes_commands: u64,
    pub gone: bool,
    pub smart: Option<spool_nvme::SmartLog>,
    /// Newest Error Information log entries (at most 4).
    pub error_log: Vec<spool_nvme::controller::ErrorLogEntry>,
}

/// What a health probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// The device answered a read.
    Ok,
    /// The device is gone (why).
    Gone(String),
    /// The read failed with this errno.
    Failed(i32),
}

const TMPFS_MAGIC: i64 = 0x0102_1994;

fn on_tmpfs(f: &File) -> bool {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: fstatfs fills the statfs struct we pass, which lives on our stack.
    let r = unsafe { libc::fstatfs(f.as_raw_fd(), st.as_mut_ptr()) };
    // SAFETY: fstatfs succeeded, so it initialised the struct.
    r == 0 && unsafe { st.assume_init() }.f_type == TMPFS_MAGIC
}

impl FileDevice {
    /// A null device of `size` bytes named `name`. Its pool metadata lives in memory only.
    pub fn open_null(name: &str, size: u64, reads: crate::NullReads) -> Result<Self> {
        let path = PathBuf::from(format!("null:{name}"));
        if size == 0 || !size.is_multiple_of(SECTOR_SIZE) {
            return Err(Error::Invalid {
                path: path.display().to_string(),
                msg: format!("size {size} is not a positive multiple of 512"),
            });
        }
        let f = memfd(&format!("spool-null-{name}"), &path)?;
        f.set_len(size)
            .map_err(|e| Error::io(&path, "set size", e))?;
        Ok(FileDevice {
            path,
            kind: DeviceKind::Null(reads),
            size,
            buffered: f,
            direct: None,
            direct_align: 0,
            inline_io: false,
            faults: Arc::new(FaultSet::for_device()),
            health: Arc::default(),
            nvme: None,
            smart_cache: Default::default(),
        })
    }

    /// Opens an NVMe controller at PCI address `bdf` (bound to vfio-pci) and uses its
    /// namespace 1. VFIO gives one process the device at a time, which is the lock.
    pub fn open_nvme(bdf: &str) -> Result<Self> {
        let path = PathBuf::from(format!("nvme:{bdf}"));
        let ctrl = spool_nvme::Controller::open(bdf).map_err(|e| Error::Invalid {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
        let size = ctrl.size();
        let placeholder = memfd("spool-nvme-placeholder", &path)?;
        Ok(FileDevice {
            path,
            kind: DeviceKind::Nvme,
            size,
            buffered: placeholder,
            direct: None,
            direct_align: 0,
            inline_io: false,
            faults: Arc::new(FaultSet::for_device()),
            health: Arc::default(),
            nvme: Some(ctrl),
            smart_cache: Default::default(),
        })
    }

    /// What the NVMe driver knows about this device (None for other kinds): identify data,
    /// queue and copy counters, and a fresh SMART log when the controller answers.
    pub fn nvme_status(&self) -> Option<NvmeStatus> {
        use std::sync::atomic::Ordering::Relaxed;
        let c = self.nvme.as_ref()?;
        let i = c.info();
        let ns = c.namespace();
        Some(NvmeStatus {
            pci: c.bdf().to_string(),
            model: i.model.clone(),
            serial: i.serial.clone(),
            firmware: i.firmware.clone(),
            version: format!("{}.{}", i.version.0, i.version.1),
            lba_size: ns.lba_size,
            blocks: ns.blocks,
            io_queues: i.io_queues,
            max_transfer: i.max_transfer,
            resets: c.resets(),
            attached: c.attached(),
            zero_copy_requests: c.zero_copy_requests.load(Relaxed),
            bounced_requests: c.bounced_requests.load(Relaxed),
            sgl_requests: c.sgl_requests.load(Relaxed),
            sgl: i.sgl,
            flush_commands: c.flush_commands.load(Relaxed),
            deallocate_commands: c.deallocate_commands.load(Relaxed),
            write_zeroes_commands: c.write_zeroes_commands.load(Relaxed),
            gone: c.is_gone(),
            smart: if c.is_gone() {
                None
            } else {
                c.smart_log().ok()
            },
            error_log: if c.is_gone() {
                Vec::new()
            } else {
                c.error_log(4).unwrap_or_default()
            },
        })
    }

    /// The NVMe controller behind this device, if it is one.
    pub fn nvme(&self) -> Option<&Arc<spool_nvme::Controller>> {
        self.nvme.as_ref()
    }

    /// The SMART critical-warning bits: the controller's (read at most once a second) or, for
    /// other devices, the simulated byte of fault injection; both when set.
    pub fn smart_warning(&self) -> u8 {
        let injected = self.faults.smart_warning();
        let Some(c) = &self.nvme else {
            return injected;
        };
        let mut cache = self.smart_cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache
            .1
            .is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(1))
        {
            match c.smart_log() {
                Ok(log) => cache.0 = log.critical_warning,
                Err(e) => {
                    tracing::debug!(device = %self.path.display(), error = %e, "cannot read the SMART log")
                }
            }
            cache.1 = Some(std::time::Instant::now());
        }
        cache.0 | injected
    }

    /// Opens (and with `create_size`, creates) a device and takes an exclusive lock on it.
    /// A path `nvme:DDDD:BB:DD.F` opens an NVMe controller through VFIO.
    pub fn open(path: &Path, opts: &OpenOptions) -> Result<Self> {
        if let Some(bdf) = path.to_str().and_then(|p| p.strip_prefix("nvme:")) {
            return Self::open_nvme(bdf);
        }
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match opts.create_size {
                Some(size) => {
                    if size == 0 || size % SECTOR_SIZE != 0 {
                        return Err(Error::Invalid {
                            path: path.display().to_string(),
                            msg: format!("size {size} is not a positive multiple of 512"),
                        });
                    }
                    let f = StdOpenOptions::new()
                        .read(true)
                        .write(true)
                        .create_new(true)
                        .open(path)
                        .map_err(|e| Error::io(path, "create", e))?;
                    f.set_len(size)
                        .map_err(|e| Error::io(path, "set size", e))?;
                    f.metadata().map_err(|e| Error::io(path, "stat", e))?
                }
                None => return Err(Error::io(path, "open", e)),
            },
            Err(e) => return Err(Error::io(path, "stat", e)),
        };
        let ft = meta.file_type();
        let kind = if ft.is_file() {
            DeviceKind::File
        } else if ft.is_block_device() {
            DeviceKind::Block
        } else {
            return Err(Error::Invalid {
                path: path.display().to_string(),
                msg: "not a regular file or a block device".into(),
            });
        };
        let buffered = StdOpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| Error::io(path, "open", e))?;
        // SAFETY: flock on a descriptor we own; no memory is involved.
        if unsafe { libc::flock(buffered.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(Error::Busy {
                    path: path.display().to_string(),
                });
            }
            return Err(Error::io(path, "lock", err));
        }
        let size = match kind {
            DeviceKind::File => meta.len(),
            DeviceKind::Block | DeviceKind::Null(_) | DeviceKind::Nvme => {
                block_device_size(&buffered).map_err(|e| Error::io(path, "BLKGETSIZE64", e))?
            }
        };
        let size = size - size % SECTOR_SIZE;
        let (direct, direct_align) = if opts.no_direct {
            (None, 0)
        } else {
            probe_direct(path)
        };
        tracing::debug!(path = %path.display(), size, direct = direct.is_some(), direct_align, "device opened");
        let inline_io = kind == DeviceKind::File && on_tmpfs(&buffered);
        Ok(FileDevice {
            path: path.to_path_buf(),
            kind,
            size,
            buffered,
            direct,
            direct_align,
            inline_io,
            faults: Arc::new(FaultSet::for_device()),
            health: Arc::default(),
            nvme: None,
            smart_cache: Default::default(),
        })
    }

    /// Path the device was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// File or block device.
    pub fn kind(&self) -> DeviceKind {
        self.kind
    }

    /// Usable size in bytes (a multiple of 512).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Alignment O_DIRECT I/O needs, or `None` when only buffered I/O is available.
    pub fn direct_align(&self) -> Option<u64> {
        self.direct.as_ref().map(|_| self.direct_align)
    }

    /// Buffered descriptor (always available).
    pub fn buffered_fd(&self) -> RawFd {
        self.buffered.as_raw_fd()
    }

    /// O_DIRECT descriptor when the file system supports it.
    pub fn direct_fd(&self) -> Option<RawFd> {
        self.direct.as_ref().map(|f| f.as_raw_fd())
    }

    /// Synchronous read used for metadata (never on the data path).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        if let Some(c) = &self.nvme {
            let (start, data) = self.nvme_read_covering(c, offset, buf.len() as u64)?;
            let at = (offset - start) as usize;
            buf.copy_from_slice(&data[at..at + buf.len()]);
            return Ok(());
        }
        self.buffered
            .read_exact_at(buf, offset)
            .map_err(|e| Error::io(&self.path, "read", e))
    }

    /// Synchronous, durable write used for metadata (never on the data path).
    pub fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        if let Some(c) = &self.nvme {
            let lba = c.namespace().lba_size;
            let (start, mut data) =
                if offset.is_multiple_of(lba) && (buf.len() as u64).is_multiple_of(lba) {
                    (offset, buf.to_vec())
                } else {
                    // Read-modify-write of the partial blocks at either end.
                    self.nvme_read_covering(c, offset, buf.len() as u64)?
                };
            let at = (offset - start) as usize;
            data[at..at + buf.len()].copy_from_slice(buf);
            return c
                .write_durable(start, &data)
                .map_err(|e| self.nvme_error("write", e));
        }
        self.buffered
            .write_all_at(buf, offset)
            .map_err(|e| Error::io(&self.path, "write", e))?;
        self.buffered
            .sync_data()
            .map_err(|e| Error::io(&self.path, "fdatasync", e))
    }

    /// Makes a range read back as zeroes, durably (used when extents change owner, so a new
    /// volume never sees an old tenant's data). Punches a hole where the device supports it,
    /// writes zeroes otherwise.
    pub fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        self.check_range(offset, len)?;
        if let Some(c) = &self.nvme {
            let lba = c.namespace().lba_size;
            if offset.is_multiple_of(lba) && len.is_multiple_of(lba) {
                return c
                    .zero_durable(offset, len)
                    .map_err(|e| self.nvme_error("write zeroes", e));
            }
            return self.write_at_durable(&vec![0u8; len as usize], offset);
        }
        // SAFETY: fallocate on a descriptor we own takes integers only (`check_range` bounded
        // the range above); no memory is involved.
        let r = unsafe {
            libc::fallocate(
                self.buffered.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r != 0 {
            let zero = vec![0u8; 1 << 20];
            let mut done = 0;
            while done < len {
                let n = (len - done).min(zero.len() as u64) as usize;
                self.buffered
                    .write_all_at(&zero[..n], offset + done)
                    .map_err(|e| Error::io(&self.path, "zero", e))?;
                done += n as u64;
            }
        }
        self.buffered
            .sync_data()
            .map_err(|e| Error::io(&self.path, "fdatasync", e))
    }

    /// Reads the whole blocks covering `[offset, offset+len)`; returns their start and bytes.
    fn nvme_read_covering(
        &self,
        c: &spool_nvme::Controller,
        offset: u64,
        len: u64,
    ) -> Result<(u64, Vec<u8>)> {
        let lba = c.namespace().lba_size;
        let start = offset / lba * lba;
        let end = (offset + len).div_ceil(lba) * lba;
        let mut data = vec![0u8; (end - start) as usize];
        c.read(start, &mut data)
            .map_err(|e| self.nvme_error("read", e))?;
        Ok((start, data))
    }

    fn nvme_error(&self, what: &'static str, e: spool_nvme::Error) -> Error {
        Error::Io {
            path: self.path.display().to_string(),
            what,
            source: std::io::Error::new(
                std::io::Error::from_raw_os_error(e.errno()).kind(),
                e.to_string(),
            ),
        }
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(Error::Invalid {
                path: self.path.display().to_string(),
                msg: format!("access {offset}+{len} beyond device size {}", self.size),
            }),
        }
    }

    /// True when queues on this device run inline rather than through io_uring (tmpfs).
    pub fn inline_io(&self) -> bool {
        self.inline_io
    }

    /// Opens a queue on this device for one worker: io_uring, or inline on tmpfs, behind
    /// the device's fault injection.
    pub fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn crate::DeviceQueue>> {
        let f = self.faults.clone();
        if let Some(c) = &self.nvme {
            return Ok(Box::new(FaultyQueue::new(
                crate::nvme::NvmeQueue::new(c.clone(), depth)?,
                f,
            )));
        }
        if let DeviceKind::Null(reads) = self.kind {
            return Ok(Box::new(FaultyQueue::new(crate::NullQueue::new(reads)?, f)));
        }
        if self.inline_io {
            return Ok(Box::new(FaultyQueue::new(
                crate::InlineQueue::new(self.buffered_fd())?,
                f,
            )));
        }
        Ok(Box::new(FaultyQueue::new(
            crate::UringQueue::new(
                self.buffered_fd(),
                self.direct_fd(),
                self.direct_align,
                depth,
            )?,
            f,
        )))
    }

    /// The device's fault-injection rules.
    pub fn faults(&self) -> &Arc<FaultSet> {
        &self.faults
    }

    /// The device's health cell.
    pub fn health(&self) -> &Arc<DeviceHealth> {
        &self.health
    }

    /// Resets the device's controller when there is one to reset (NVMe): the first step of a
    /// reset episode, before probing. `None` for devices without a controller of ours.
    pub fn reset_controller(&self) -> Option<std::result::Result<(), String>> {
        self.nvme
            .as_ref()
            .map(|c| c.reset().map_err(|e| e.to_string()))
    }

    /// The periodic check of a device not being reset: is it still there? For NVMe this is
    /// the kernel's removal request and the registers (no I/O: a probe read would queue behind
    /// whatever the controller is stuck on and stall the monitor); for other devices, a probe.
    pub fn presence(&self) -> Probe {
        if let Some(c) = &self.nvme {
            if c.removal_requested() {
                c.release("the kernel asked for the device back (hot removal)");
                return Probe::Gone(
                    "hot removal: the kernel asked for the device back; released it".into(),
                );
            }
            if c.is_gone() {
                return Probe::Gone(
                    "the controller's registers read all ones or faulted (removed)".into(),
                );
            }
            return Probe::Ok;
        }
        self.probe()
    }

    /// Asks the device whether it still answers: injected probe faults first, then (files)
    /// whether the file still has a name, then a 4 KiB read at offset 0 (the metadata area,
    /// which every pool device has).
    pub fn probe(&self) -> Probe {
        if let Some(e) = self.faults.probe_fault() {
            return match crate::ErrorClass::of_errno(e) {
                crate::ErrorClass::Gone => Probe::Gone(format!(
                    "injected: {}",
                    std::io::Error::from_raw_os_error(e)
                )),
                _ => Probe::Failed(e),
            };
        }
        if let Some(c) = &self.nvme {
            if let gone @ Probe::Gone(_) = self.presence() {
                return gone;
            }
            let csts = c.csts();
            if csts & spool_nvme::spec::CSTS_CFS != 0 {
                return Probe::Failed(libc::EIO);
            }
            let mut buf = vec![0u8; 4096.min(self.size as usize)];
            return match c.read(0, &mut buf) {
                Ok(()) => Probe::Ok,
                Err(spool_nvme::Error::Gone(why)) => Probe::Gone(why),
                Err(e) => Probe::Failed(e.errno()),
            };
        }
        if self.kind == DeviceKind::File {
            match self.buffered.metadata() {
                Ok(m) if std::os::unix::fs::MetadataExt::nlink(&m) == 0 => {
                    return Probe::Gone("the backing file was deleted".into())
                }
                Ok(_) => {}
                Err(e) => return Probe::Failed(e.raw_os_error().unwrap_or(libc::EIO)),
            }
        }
        let mut buf = vec![0u8; 4096.min(self.size as usize)];
        match self.buffered.read_at(&mut buf, 0) {
            Ok(_) => Probe::Ok,
            Err(e) => {
                let errno = e.raw_os_error().unwrap_or(libc::EIO);
                if crate::ErrorClass::of_errno(errno) == crate::ErrorClass::Gone {
                    Probe::Gone(e.to_string())
                } else {
                    Probe::Failed(errno)
                }
            }
        }
    }
}

/// A fresh anonymous memory file named `name`.
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

fn block_device_size(f: &File) -> std::io::Result<u64> {
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 into the pointer we pass, which lives on our stack.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}

/// Opens `path` with O_DIRECT and finds the smallest alignment a direct read accepts.
fn probe_direct(path: &Path) -> (Option<File>, u64) {
    let f = match StdOpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) => {
            tracing::info!(path = %path.display(), error = %e, "O_DIRECT not available, using buffered I/O");
            return (None, 0);
        }
    };
    let layout = std::alloc::Layout::from_size_align(4096, 4096).expect("constant layout");
    for align in [512u64, 4096] {
        // SAFETY: a fresh 4096-byte, 4096-aligned allocation, freed below; pread writes at most
        // `align` (<= 4096) bytes into it.
        let ok = unsafe {
            let buf = std::alloc::alloc_zeroed(layout);
            if buf.is_null() {
                return (None, 0);
            }
            let r = libc::pread(f.as_raw_fd(), buf.cast(), align as usize, 0);
            std::alloc::dealloc(buf, layout);
            r >= 0
        };
        if ok {
            return (Some(f), align);
        }
    }
    tracing::info!(path = %path.display(), "O_DIRECT reads rejected, using buffered I/O");
    (None, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_open_lock_and_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d0");
        let dev = FileDevice::open(
            &p,
            &OpenOptions {
                create_size: Some(1 << 20),
                no_direct: false,
            },
        )
        .unwrap();
        assert_eq!(dev.size(), 1 << 20);
        assert_eq!(dev.kind(), DeviceKind::File);
        dev.write_at_durable(b"hello", 4096).unwrap();
        let mut b = [0u8; 5];
        dev.read_at(&mut b, 4096).unwrap();
        assert_eq!(&b, b"hello");
        assert!(dev.read_at(&mut b, (1 << 20) - 2).is_err());
        // A second open of the same device is refused while the first holds the lock.
        match FileDevice::open(&p, &OpenOptions::default()) {
            Err(Error::Busy { .. }) => {}
            other => panic!("expected Busy, got {other:?}"),
        }
    }

    #[test]
    fn missing_without_create_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = FileDevice::open(&dir.path().join("nope"), &OpenOptions::default()).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
    }
}
