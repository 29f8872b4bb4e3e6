//! The file / block-device backend: a regular file or a block device node as a pool device.
//!
//! Every device is opened twice: a buffered descriptor (always) and an O_DIRECT descriptor
//! (when the file system accepts it). Aligned I/O goes through the direct descriptor; I/O
//! whose offset, length or memory is not aligned to the device's direct-I/O alignment uses the
//! buffered one, so no bounce buffer is ever needed. Linux keeps the two coherent: a direct
//! read or write first writes back and invalidates the page cache of its range. Files on
//! tmpfs get inline queues instead of io_uring (see [`crate::InlineQueue`]).
//!
//! Owns: creating, sizing and locking (`flock`) the file, the O_DIRECT probe, metadata I/O
//! with `pread`/`pwrite` + `fdatasync`, zeroing by punching holes, the probe by read.
//! Must not know: health cells and fault injection (the [`crate::Device`] wrapper), NVMe.

use std::fs::{File, OpenOptions as StdOpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::{check_range, check_size, BackendInfo, OpenOptions, PoolDevice, Probe};
use crate::file_map::FileMap;
use crate::{DeviceQueue, Error, Result, SECTOR_SIZE};

/// A regular file or block device opened as a pool device.
#[derive(Debug)]
pub struct FileBackend {
    path: PathBuf,
    /// A block device node (else a regular file; sparse files are fine).
    block: bool,
    size: u64,
    buffered: File,
    direct: Option<File>,
    direct_align: u64,
    /// The file system cannot do non-blocking I/O (tmpfs): io_uring would punt every request
    /// to a kernel worker thread, so queues run inline instead.
    inline_io: bool,
    /// With `inline_io`: the file mapped shared, for the inline queues' reads and writes (no
    /// inode lock, no per-page lookups; see [`crate::file_map`]).
    map: Option<Arc<FileMap>>,
}

const TMPFS_MAGIC: i64 = 0x0102_1994;

fn on_tmpfs(f: &File) -> bool {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: fstatfs fills the statfs struct we pass, which lives on our stack.
    let r = unsafe { libc::fstatfs(f.as_raw_fd(), st.as_mut_ptr()) };
    // SAFETY: fstatfs succeeded, so it initialised the struct.
    r == 0 && unsafe { st.assume_init() }.f_type == TMPFS_MAGIC
}

impl FileBackend {
    /// Opens (and with `create_size`, creates) a file or block device and takes an exclusive
    /// lock on it.
    pub fn open(path: &Path, opts: &OpenOptions) -> Result<Self> {
        let meta = stat_or_create(path, opts.create_size)?;
        let ft = meta.file_type();
        let block = if ft.is_file() {
            false
        } else if ft.is_block_device() {
            true
        } else {
            return Err(Error::Invalid {
                path: path.display().to_string(),
                msg: "not a regular file or a block device".into(),
            });
        };
        let buffered = open_locked(path, opts.lock_wait)?;
        let size = if block {
            block_device_size(&buffered).map_err(|e| Error::io(path, "BLKGETSIZE64", e))?
        } else {
            meta.len()
        };
        let size = size - size % SECTOR_SIZE;
        let (direct, direct_align) = if opts.no_direct {
            (None, 0)
        } else {
            probe_direct(path)
        };
        if let Some(d) = &direct {
            lock_direct(path, d, opts.lock_wait)?;
        }
        tracing::debug!(path = %path.display(), size, direct = direct.is_some(), direct_align, "device opened");
        let inline_io = !block && on_tmpfs(&buffered);
        let map = if inline_io {
            FileMap::new(buffered.as_raw_fd(), size).map(Arc::new)
        } else {
            None
        };
        Ok(FileBackend {
            path: path.to_path_buf(),
            block,
            size,
            buffered,
            direct,
            direct_align,
            inline_io,
            map,
        })
    }

    fn fdatasync(&self) -> Result<()> {
        self.buffered
            .sync_data()
            .map_err(|e| Error::io(&self.path, "fdatasync", e))
    }
}

impl PoolDevice for FileBackend {
    fn path(&self) -> &Path {
        &self.path
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            backend: if self.block { "block" } else { "file" },
            direct_align: self.direct.as_ref().map(|_| self.direct_align),
            inline_io: self.inline_io,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(&self.path, self.size, offset, buf.len() as u64)?;
        self.buffered
            .read_exact_at(buf, offset)
            .map_err(|e| Error::io(&self.path, "read", e))
    }

    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(&self.path, self.size, offset, buf.len() as u64)?;
        self.buffered
            .write_all_at(buf, offset)
            .map_err(|e| Error::io(&self.path, "write", e))?;
        self.fdatasync()
    }

    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        check_range(&self.path, self.size, offset, len)?;
        if let Some(m) = &self.map {
            m.forget(offset, len);
        }
        zero_file_range(&self.buffered, &self.path, offset, len)
    }

    /// io_uring, or inline on tmpfs. The queues borrow the descriptors, which live as long
    /// as the backend (the pool keeps its devices for as long as any worker runs).
    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        let buffered = self.buffered.as_raw_fd();
        if self.inline_io {
            return Ok(Box::new(crate::InlineQueue::with_map(
                buffered,
                self.map.clone(),
            )?));
        }
        Ok(Box::new(crate::UringQueue::new(
            buffered,
            self.direct.as_ref().map(|f| f.as_raw_fd()),
            self.direct_align,
            depth,
        )?))
    }

    /// Files: whether the file still has a name; then a 4 KiB read at offset 0 (the metadata
    /// area, which every pool device has).
    fn probe(&self) -> Probe {
        if !self.block {
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

/// Makes `[offset, offset+len)` of `f` read back as zeroes, durably: punches a hole where the
/// file system supports it, writes zeroes otherwise. The caller has bounded the range.
pub(crate) fn zero_file_range(f: &File, path: &Path, offset: u64, len: u64) -> Result<()> {
    // SAFETY: fallocate on a descriptor we own takes integers only (the caller bounded the
    // range); no memory is involved.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
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
            f.write_all_at(&zero[..n], offset + done)
                .map_err(|e| Error::io(path, "zero", e))?;
            done += n as u64;
        }
    }
    f.sync_data().map_err(|e| Error::io(path, "fdatasync", e))
}

/// The metadata of `path`, creating it as a file of `create_size` bytes when it does not
/// exist and a size is given.
fn stat_or_create(path: &Path, create_size: Option<u64>) -> Result<std::fs::Metadata> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match create_size {
            Some(size) => {
                check_size(path, size)?;
                // Owner only, whatever the umask: it will hold volumes' data (a plain
                // volume's in the clear).
                let f = StdOpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(path)
                    .map_err(|e| Error::io(path, "create", e))?;
                f.set_len(size)
                    .map_err(|e| Error::io(path, "set size", e))?;
                f.metadata().map_err(|e| Error::io(path, "stat", e))
            }
            None => Err(Error::io(path, "open", e)),
        },
        Err(e) => Err(Error::io(path, "stat", e)),
    }
}

/// Opens the buffered descriptor and takes the exclusive lock that keeps a second spoold off
/// the device.
fn open_locked(path: &Path, lock_wait: std::time::Duration) -> Result<File> {
    let buffered = StdOpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(path, "open", e))?;
    let deadline = std::time::Instant::now() + lock_wait;
    // SAFETY: flock on a descriptor we own; no memory is involved.
    while unsafe { libc::flock(buffered.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(Error::io(path, "lock", err));
        }
        if std::time::Instant::now() >= deadline {
            return Err(Error::Busy {
                path: path.display().to_string(),
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    Ok(buffered)
}

/// Takes a write lock (an open-file-description lock on byte 0) on the O_DIRECT descriptor,
/// waiting up to `lock_wait` for a predecessor's to go. The buffered descriptor's `flock` goes
/// when a killed worker's descriptors are closed, but the O_DIRECT descriptor lives on while
/// its io_uring still has reads and writes in flight (the ring's teardown is asynchronous):
/// a successor that served at once could see such a late write land over a newer one, or a
/// late read land in a guest buffer it had already filled with a newer read. This lock is
/// released only when that descriptor is, so the successor waits for the last of them.
/// (flock and OFD locks do not interact; two flocks of one process on two descriptors would.)
fn lock_direct(path: &Path, direct: &File, lock_wait: std::time::Duration) -> Result<()> {
    let deadline = std::time::Instant::now() + lock_wait;
    loop {
        // SAFETY: an all-zero `flock` is a valid value of the C struct; the fields we need
        // are set below.
        let mut l: libc::flock = unsafe { std::mem::zeroed() };
        l.l_type = libc::F_WRLCK as libc::c_short;
        l.l_whence = libc::SEEK_SET as libc::c_short;
        l.l_start = 0;
        l.l_len = 1;
        // SAFETY: F_OFD_SETLK reads the `flock` we pass, which lives on our stack for the
        // call, on a descriptor we own; no other memory is involved.
        if unsafe { libc::fcntl(direct.as_raw_fd(), libc::F_OFD_SETLK, &l) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if !matches!(err.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) {
            // A file system without OFD locks: the buffered flock alone keeps other spoolds off.
            tracing::debug!(path = %path.display(), error = %err, "no lock on the O_DIRECT descriptor");
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(Error::Busy {
                path: path.display().to_string(),
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
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
        let dev = crate::Device::open(
            &p,
            &OpenOptions {
                create_size: Some(1 << 20),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(dev.size(), 1 << 20);
        assert_eq!(dev.info().backend, "file");
        // Created for the owner only, whatever the umask (it holds volumes' data).
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        dev.write_at_durable(b"hello", 4096).unwrap();
        let mut b = [0u8; 5];
        dev.read_at(&mut b, 4096).unwrap();
        assert_eq!(&b, b"hello");
        assert!(dev.read_at(&mut b, (1 << 20) - 2).is_err());
        // A second open of the same device is refused while the first holds the lock.
        match crate::Device::open(&p, &OpenOptions::default()) {
            Err(Error::Busy { .. }) => {}
            other => panic!("expected Busy, got {other:?}"),
        }
        // With `lock_wait`, it waits for the holder to let go (a dead worker's teardown).
        let holder = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            drop(dev);
        });
        let waiting = OpenOptions {
            lock_wait: std::time::Duration::from_secs(5),
            ..Default::default()
        };
        crate::Device::open(&p, &waiting).expect("the lock, once the holder let go");
        holder.join().unwrap();
    }

    #[test]
    fn missing_without_create_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = crate::Device::open(&dir.path().join("nope"), &OpenOptions::default()).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
    }
}
