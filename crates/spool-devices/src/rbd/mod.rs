//! The RBD backend: a Ceph RBD image as a device (`rbd:POOL/IMAGE`), through librbd's
//! asynchronous C API (issue 20; docs/ceph.md). Ceph is the distributed engine: replication,
//! placement and recovery are the cluster's; this backend only moves requests.
//!
//! A daemon keeps one cluster connection per (ceph.conf, client id) in its [`CephClusters`],
//! shared by every image it opens through a [`Ceph`] ([`Cluster`]); connecting is the slow
//! part (a monitor round trip and authentication), so it is done once per process. Before the
//! process exits it closes them ([`CephClusters::close`]): librados' threads must not outlive
//! `exit(3)`. (The registry is the daemon's, passed down through the pool's and the devices'
//! open options; only the loaded librados/librbd symbols, `ffi`, are per process, as the
//! library itself is.) Images
//! spoold creates have the layering feature only: without exclusive-lock, a worker restarted
//! after a crash does not wait for the dead process's lock to time out. librbd's cache is off: a write is complete when the
//! OSDs have it, not when this process's memory does (a killed worker loses nothing).
//!
//! Owns: the connection registry type (and its closing), opening (and creating) images, synchronous
//! metadata I/O, the probe. The data path is [`queue::RbdQueue`].
//! Must not know: health cells and fault injection (the [`crate::Device`] wrapper), pools.

mod claim;
mod ffi;
mod queue;
mod snapshots;

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::backend::{check_range, BackendInfo, PoolDevice, Probe};
use crate::queue::DeviceQueue;
use crate::{Error, Result};

pub use queue::RbdQueue;
pub use snapshots::RbdSnapshot;

/// Where the cluster is and who we are to it (config `[ceph]`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CephOptions {
    /// The cluster's ceph.conf (monitors; the keyring is found as Ceph finds it).
    pub conf: PathBuf,
    /// The client id (`admin` is `client.admin`).
    pub id: String,
}

impl Default for CephOptions {
    fn default() -> Self {
        CephOptions {
            conf: PathBuf::from("/etc/ceph/ceph.conf"),
            id: "admin".into(),
        }
    }
}

/// The cluster `rbd:` devices are on, and the daemon's connections to reach it through.
#[derive(Debug, Clone, Default)]
pub struct Ceph {
    pub options: CephOptions,
    pub clusters: Arc<CephClusters>,
}

impl Ceph {
    /// The cluster `options` names, reached through `clusters`.
    pub fn new(options: CephOptions, clusters: Arc<CephClusters>) -> Ceph {
        Ceph { options, clusters }
    }
}

/// How long a health probe waits for the cluster to answer a read.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// A connected librados cluster handle.
#[derive(Debug)]
pub(crate) struct Cluster {
    handle: ffi::rados_t,
}

// SAFETY: librados cluster handles are thread-safe (the library's own locking); the handle
// is only shut down in Drop, when no image of it is left (images hold an Arc).
unsafe impl Send for Cluster {}
// SAFETY: as above.
unsafe impl Sync for Cluster {}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: the handle was connected by `connect` and nothing uses it any more.
        unsafe { (ffi::loaded().rados_shutdown)(self.handle) };
    }
}

fn cstring(path: &Path, what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Invalid {
        path: path.display().to_string(),
        msg: format!("{what} contains a NUL byte"),
    })
}

/// A librados/librbd return code as an error.
fn rc(path: &Path, what: &'static str, r: i64) -> Result<i64> {
    if r < 0 {
        Err(Error::io(
            path,
            what,
            std::io::Error::from_raw_os_error(-r as i32),
        ))
    } else {
        Ok(r)
    }
}

impl CephClusters {
    /// The connection for `opts`, made on first use.
    fn get(&self, opts: &CephOptions, path: &Path) -> Result<Arc<Cluster>> {
        let mut reg = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if reg.closed {
            return Err(Error::Invalid {
                path: path.display().to_string(),
                msg: "this process is exiting: its ceph connections are closed".into(),
            });
        }
        let all = reg.clusters.get_or_insert_with(HashMap::new);
        if let Some(c) = all.get(opts).and_then(Weak::upgrade) {
            return Ok(c);
        }
        let c = Arc::new(Cluster::connect(opts, path)?);
        all.insert(opts.clone(), Arc::downgrade(&c));
        Ok(c)
    }
}

impl Cluster {
    fn connect(opts: &CephOptions, path: &Path) -> Result<Cluster> {
        ffi::api().map_err(|e| Error::Invalid {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
        let name = cstring(path, "ceph client id", &format!("client.{}", opts.id))?;
        let conf = cstring(path, "ceph.conf path", &opts.conf.display().to_string())?;
        let mut handle: ffi::rados_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the strings are NUL-terminated and outlive the call.
        let r = unsafe {
            (ffi::loaded().rados_create2)(&mut handle, c"ceph".as_ptr(), name.as_ptr(), 0)
        };
        rc(path, "rados_create2", r as i64)?;
        let c = Cluster { handle };
        // SAFETY: a created handle and a NUL-terminated path.
        let r = unsafe { (ffi::loaded().rados_conf_read_file)(c.handle, conf.as_ptr()) };
        if r < 0 {
            return Err(Error::Invalid {
                path: path.display().to_string(),
                msg: format!(
                    "cannot read ceph config {}: {}",
                    opts.conf.display(),
                    std::io::Error::from_raw_os_error(-r)
                ),
            });
        }
        // A cluster that cannot be reached fails the start-up in bounded time. No librbd
        // cache: a write it acknowledged from this process's memory would be lost with a
        // killed worker, and no restart may lose a completed write.
        for (k, v) in [
            (c"client_mount_timeout", c"30"),
            (c"rados_mon_op_timeout", c"30"),
            (c"rbd_cache", c"false"),
            // Writes copied when submitted: a write given up (`RbdQueue::abandon`) must not
            // read guest memory later.
            (c"rbd_disable_zero_copy_writes", c"true"),
            // An operation sent with an old OSD map (a standby's warm connection, idle while
            // an OSD restarted at a new address) waits until it is called laggy and the map
            // is asked for: 10 s by default, checked every 5 s, which was a worker
            // takeover's whole stall after an OSD restart (docs/ceph.md). 1 s and 1 s.
            (c"objecter_timeout", c"1"),
            (c"objecter_tick_interval", c"1"),
        ] {
            // SAFETY: a created handle; static NUL-terminated strings.
            unsafe { (ffi::loaded().rados_conf_set)(c.handle, k.as_ptr(), v.as_ptr()) };
        }
        // SAFETY: a configured handle.
        let r = unsafe { (ffi::loaded().rados_connect)(c.handle) };
        rc(path, "connect to the ceph cluster", r as i64)?;
        Ok(c)
    }
}

/// A daemon's cluster connections (one per [`CephOptions`]), and whether it has closed them
/// for good ([`CephClusters::close`]).
#[derive(Debug, Default)]
struct Registry {
    clusters: Option<HashMap<CephOptions, Weak<Cluster>>>,
    closed: bool,
}

/// A daemon's cluster connections: made on first use, shared by every image opened through
/// the same registry, shut down when the last image of one closes, and all closed for good
/// before the process exits ([`CephClusters::close`]).
#[derive(Debug, Default)]
pub struct CephClusters {
    registry: Mutex<Registry>,
    /// Connections [`Ceph::warm_up`] made, kept until [`CephClusters::close`].
    warm: Mutex<Vec<Arc<Cluster>>>,
}

impl Ceph {
    /// Connects to the cluster ahead of need and keeps the connection until the registry is
    /// closed, so that the first image opened later does not wait for it (a standby worker
    /// does this while it waits to take over).
    pub fn warm_up(&self) -> Result<()> {
        let c = self.clusters.get(&self.options, Path::new("rbd:"))?;
        self.clusters
            .warm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(c);
        Ok(())
    }

    /// The connection images are opened through.
    fn cluster(&self, path: &Path) -> Result<Arc<Cluster>> {
        self.clusters.get(&self.options, path)
    }
}

/// How [`CephClusters::close`] left a daemon's cluster connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CephConnections {
    /// Every one is shut down (`rados_shutdown`), `any` if there were some: the process may
    /// exit normally.
    Closed { any: bool },
    /// One is still in use (an image open, a connection being made): librados' threads keep
    /// running, and `exit(3)` would run the library's static destructors under them (a
    /// SIGSEGV at exit, Ceph tracker 36732). The process must leave with `_exit(2)`.
    InUse,
}

impl CephClusters {
    /// Shuts down every connection of the registry that no image uses any more, and makes any
    /// later connection attempt through it fail (the process is exiting). Call it once nothing
    /// is served.
    pub fn close(&self) -> CephConnections {
        let mut reg = match self.registry.try_lock() {
            Ok(r) => r,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            // A connection is being made (`rados_connect`, up to `client_mount_timeout`): it
            // cannot be shut down until it returns, and it must not be waited for.
            Err(std::sync::TryLockError::WouldBlock) => return CephConnections::InUse,
        };
        reg.closed = true;
        // The last handle of a connection shuts it down (`Cluster`'s Drop).
        drop(std::mem::take(
            &mut *self.warm.lock().unwrap_or_else(|e| e.into_inner()),
        ));
        match &reg.clusters {
            Some(all) if all.values().any(|c| c.strong_count() > 0) => CephConnections::InUse,
            all => CephConnections::Closed {
                any: all.as_ref().is_some_and(|a| !a.is_empty()),
            },
        }
    }
}

/// An open image (with its pool's I/O context and the connection it came from).
#[derive(Debug)]
pub(crate) struct Image {
    handle: ffi::rbd_image_t,
    ioctx: ffi::rados_ioctx_t,
    cluster: Arc<Cluster>,
}

// SAFETY: librbd image handles are thread-safe for I/O (the library serializes internally);
// closed only in Drop, when no queue holds the image any more (queues hold an Arc).
unsafe impl Send for Image {}
// SAFETY: as above.
unsafe impl Sync for Image {}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: opened by `RbdBackend::open`; no queue or completion refers to it any more
        // (each in-flight completion's context holds an Arc of the image's queue state, and
        // queues hold the image).
        unsafe {
            (ffi::loaded().rbd_close)(self.handle);
            (ffi::loaded().rados_ioctx_destroy)(self.ioctx);
        }
    }
}

/// An RBD image as a pool device.
#[derive(Debug)]
pub struct RbdBackend {
    path: PathBuf,
    /// Grows with [`RbdBackend::resize`].
    size: AtomicU64,
    image: Arc<Image>,
    /// The serving fence: this process's claims on the image (`claim.rs`).
    fence: Arc<claim::Fence>,
}

impl RbdBackend {
    /// Opens `POOL/IMAGE` on the cluster `ceph` names; with `create_size`, creates the image
    /// first when it does not exist.
    pub fn open(spec: &str, ceph: &Ceph, create_size: Option<u64>) -> Result<Self> {
        let (path, pool, name) = parse(spec)?;
        let cluster = ceph.cluster(&path)?;
        let ioctx = pool_context(&cluster, &path, pool)?;
        let cname = cstring(&path, "image name", name)?;
        let handle = match open_image(ioctx, &cname) {
            Err(r) if r == -libc::ENOENT && create_size.is_some() => {
                let size = create_size.unwrap_or_default();
                let mut order = 0;
                // SAFETY: a valid I/O context, a NUL-terminated name, an out-pointer.
                let r = unsafe {
                    (ffi::loaded().rbd_create2)(
                        ioctx,
                        cname.as_ptr(),
                        size,
                        ffi::RBD_FEATURE_LAYERING,
                        &mut order,
                    )
                };
                if r >= 0 {
                    tracing::info!(image = %spec, size, "created RBD image");
                }
                if r < 0 {
                    Err(r)
                } else {
                    open_image(ioctx, &cname)
                }
            }
            other => other,
        };
        let handle = match handle {
            Ok(h) => h,
            Err(r) => {
                // SAFETY: created above, used by nothing else.
                unsafe { (ffi::loaded().rados_ioctx_destroy)(ioctx) };
                return Err(Error::io(
                    &path,
                    "open RBD image",
                    std::io::Error::from_raw_os_error(-r),
                ));
            }
        };
        let image = Arc::new(Image {
            handle,
            ioctx,
            cluster,
        });
        let mut size = 0u64;
        // SAFETY: an open image and an out-pointer to a local.
        rc(&path, "get the image size", unsafe {
            (ffi::loaded().rbd_get_size)(image.handle, &mut size)
        } as i64)?;
        let size = size - size % crate::SECTOR_SIZE;
        crate::backend::check_size(&path, size)?;
        Ok(RbdBackend {
            fence: claim::Fence::new(image.clone(), path.clone()),
            path,
            size: AtomicU64::new(size),
            image,
        })
    }
}

/// `POOL/IMAGE` as (device path, pool, image).
fn parse(spec: &str) -> Result<(PathBuf, &str, &str)> {
    let path = PathBuf::from(format!("rbd:{spec}"));
    match spec.split_once('/') {
        Some((p, n)) if !p.is_empty() && !n.is_empty() && !n.contains('/') => Ok((path, p, n)),
        _ => Err(Error::Invalid {
            path: path.display().to_string(),
            msg: "an RBD image is named POOL/IMAGE".into(),
        }),
    }
}

/// An I/O context on `pool` (the caller destroys it).
fn pool_context(cluster: &Cluster, path: &Path, pool: &str) -> Result<ffi::rados_ioctx_t> {
    let cpool = cstring(path, "pool name", pool)?;
    let mut ioctx: ffi::rados_ioctx_t = std::ptr::null_mut();
    // SAFETY: a connected cluster, a NUL-terminated name, an out-pointer to a local.
    let r =
        unsafe { (ffi::loaded().rados_ioctx_create)(cluster.handle, cpool.as_ptr(), &mut ioctx) };
    if r < 0 {
        return Err(Error::Invalid {
            path: path.display().to_string(),
            msg: format!(
                "cannot open ceph pool {pool}: {}",
                std::io::Error::from_raw_os_error(-r)
            ),
        });
    }
    Ok(ioctx)
}

fn open_image(
    ioctx: ffi::rados_ioctx_t,
    name: &CString,
) -> std::result::Result<ffi::rbd_image_t, i32> {
    let mut image: ffi::rbd_image_t = std::ptr::null_mut();
    // SAFETY: a valid I/O context, a NUL-terminated name, an out-pointer; no snapshot.
    let r = unsafe { (ffi::loaded().rbd_open)(ioctx, name.as_ptr(), &mut image, std::ptr::null()) };
    if r < 0 {
        Err(r)
    } else {
        Ok(image)
    }
}

impl RbdBackend {
    /// The RBD backend under `dev`, if it is one (resizing, snapshots and clones of the image
    /// are the pool's).
    pub fn of(dev: &crate::Device) -> Option<&RbdBackend> {
        dev.backend().as_any()?.downcast_ref()
    }

    /// Grows the image to `size` bytes (a multiple of 512; shrinking is refused).
    pub fn resize(&self, size: u64) -> Result<()> {
        crate::backend::check_size(&self.path, size)?;
        if size < self.size() {
            return Err(Error::Invalid {
                path: self.path.display().to_string(),
                msg: format!("shrinking the image to {size} bytes would destroy data"),
            });
        }
        // SAFETY: an open image.
        let r = unsafe { (ffi::loaded().rbd_resize)(self.image.handle, size) };
        rc(&self.path, "resize the image", r as i64)?;
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    /// Whether image `POOL/IMAGE` exists (an error: the cluster or pool cannot be reached).
    pub fn exists(spec: &str, ceph: &Ceph) -> Result<bool> {
        match Self::open(spec, ceph, None) {
            Ok(_) => Ok(true),
            Err(Error::Io { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Removes image `POOL/IMAGE` and its data (no handle of this process may be open on it;
    /// a client elsewhere that still has it open makes this fail with EBUSY).
    pub fn remove(spec: &str, ceph: &Ceph) -> Result<()> {
        let (path, pool, name) = parse(spec)?;
        let cluster = ceph.cluster(&path)?;
        let ioctx = pool_context(&cluster, &path, pool)?;
        let cname = cstring(&path, "image name", name)?;
        // SAFETY: a valid I/O context and a NUL-terminated name.
        let r = unsafe { (ffi::loaded().rbd_remove)(ioctx, cname.as_ptr()) };
        // SAFETY: created above, used by nothing else.
        unsafe { (ffi::loaded().rados_ioctx_destroy)(ioctx) };
        rc(&path, "remove the RBD image", r as i64).map(drop)
    }

    /// Waits until every completed write is durable in the cluster.
    fn flush(&self) -> Result<()> {
        // SAFETY: an open image.
        let r = unsafe { (ffi::loaded().rbd_flush)(self.image.handle) };
        rc(&self.path, "flush", r as i64).map(drop)
    }
}

impl PoolDevice for RbdBackend {
    fn path(&self) -> &Path {
        &self.path
    }

    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            backend: "rbd",
            direct_align: None,
            inline_io: false,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(&self.path, self.size(), offset, buf.len() as u64)?;
        let mut done = 0;
        while done < buf.len() {
            let rest = &mut buf[done..];
            // SAFETY: an open image; `rest` is writable for its length.
            let r = unsafe {
                (ffi::loaded().rbd_read2)(
                    self.image.handle,
                    offset + done as u64,
                    rest.len(),
                    rest.as_mut_ptr().cast::<c_char>(),
                    0,
                )
            };
            let n = rc(&self.path, "read", r as i64)? as usize;
            if n == 0 {
                return Err(Error::io(
                    &self.path,
                    "read",
                    std::io::ErrorKind::UnexpectedEof.into(),
                ));
            }
            done += n;
        }
        Ok(())
    }

    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(&self.path, self.size(), offset, buf.len() as u64)?;
        // SAFETY: an open image; `buf` is readable for its length. librbd writes it all or
        // fails.
        let r = unsafe {
            (ffi::loaded().rbd_write2)(
                self.image.handle,
                offset,
                buf.len(),
                buf.as_ptr().cast::<c_char>(),
                0,
            )
        };
        rc(&self.path, "write", r as i64)?;
        self.flush()
    }

    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        check_range(&self.path, self.size(), offset, len)?;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(1 << 30);
            // SAFETY: an open image; no buffers.
            let r = unsafe {
                (ffi::loaded().rbd_write_zeroes)(self.image.handle, offset + done, n as usize, 0, 0)
            };
            rc(&self.path, "write zeroes", r as i64)?;
            done += n;
        }
        self.flush()
    }

    fn open_queue(&self, _depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        Ok(Box::new(RbdQueue::new(self.image.clone())?))
    }

    /// Presence is the connection itself (an image cannot be unplugged); reads that do not
    /// come back are the workers' timeouts to report.
    fn presence(&self) -> Option<Probe> {
        Some(Probe::Ok)
    }

    /// A read of the first sector, waited for at most [`PROBE_TIMEOUT`] (an unreachable
    /// cluster holds the read, it does not fail it).
    fn claim(&self, owner: &str, trusted: bool, wait: Duration) -> Result<()> {
        self.fence.claim(owner, trusted, wait)
    }

    fn release_claim(&self, owner: &str) -> Result<()> {
        self.fence.release_claim(owner)
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn probe(&self) -> Probe {
        match queue::read_with_timeout(&self.image, 0, 512, PROBE_TIMEOUT) {
            Ok(()) => Probe::Ok,
            Err(e) => Probe::Failed(e),
        }
    }
}
