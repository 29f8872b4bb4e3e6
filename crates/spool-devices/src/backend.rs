//! The [`PoolDevice`] trait: what any storage under a pool must do, and the plain types its
//! methods speak in ([`Probe`], [`BackendInfo`], [`ControllerStatus`], [`OpenOptions`]).
//!
//! Owns: the contract every backend (file/block, NVMe, null, NBD, RBD, and spool-mirror's
//! mirror composed of others) fills, with defaults for the capabilities only some have (a controller to reset,
//! SMART warnings, a controller status). The trait is object safe and assumes no file
//! descriptor, so a backend may be built from other `PoolDevice`s.
//!
//! Must not know: health cells and fault injection (the [`crate::Device`] wrapper stacks
//! those on any backend), nor which backends exist.

use std::path::Path;

use crate::{DeviceQueue, Error, FaultRule, Result};

/// A storage backend a pool can be built on.
///
/// Metadata I/O (`read_at`, `write_at_durable`, `zero_range`) is synchronous and never on the
/// data path; the data path goes through the per-worker queues of [`PoolDevice::open_queue`].
pub trait PoolDevice: Send + Sync + std::fmt::Debug {
    /// The name the device was opened by (a path, `nvme:BDF`, `null:NAME`, ...).
    fn path(&self) -> &Path;

    /// Usable size in bytes (a multiple of 512).
    fn size(&self) -> u64;

    /// What the backend is and how its queues do I/O.
    fn info(&self) -> BackendInfo;

    /// Synchronous read used for metadata (never on the data path).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;

    /// Synchronous, durable write used for metadata (never on the data path).
    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()>;

    /// Makes a range read back as zeroes, durably (used when extents change owner, so a new
    /// volume never sees an old tenant's data).
    fn zero_range(&self, offset: u64, len: u64) -> Result<()>;

    /// Gives the device up for good: requests in flight on its queues fail now rather than
    /// when (if ever) the device answers. For a remote leg being dropped, whose writes no
    /// longer matter; what a request already sent does there is not known. Default: nothing
    /// (local devices answer or fail by themselves).
    fn abort(&self) {}

    /// Whether every byte of `[offset, offset + len)` is known to read back as zeroes
    /// because it was never written (a thin device's unmapped chunks), so a copy need not
    /// read it. `false` when not known, the default: a plain device answers only by reading.
    fn known_unwritten(&self, _offset: u64, _len: u64) -> bool {
        false
    }

    /// Opens a queue on this device for one worker.
    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn DeviceQueue>>;

    /// Asks the device whether it still answers (the health monitor's probe while resetting).
    fn probe(&self) -> Probe;

    /// The periodic check of a device not being reset: is it still there? `None` (the
    /// default) means "probe it"; a backend whose probe could queue behind a stuck device
    /// answers from cheaper evidence instead (NVMe: the kernel's removal request and the
    /// registers), and then injected probe faults do not apply.
    fn presence(&self) -> Option<Probe> {
        None
    }

    /// The SMART critical-warning bits (NVMe log page 02h, byte 0); 0 when the device has
    /// no SMART log.
    fn smart_warning(&self) -> u8 {
        0
    }

    /// Resets the device's controller when there is one of ours to reset: the first step of
    /// a reset episode, before probing. `None` for devices without one.
    fn reset_controller(&self) -> Option<Result<()>> {
        None
    }

    /// What the device's controller reports (identify data, counters, logs), for devices
    /// driven by a controller of ours; `None` otherwise.
    fn controller_status(&self) -> Option<ControllerStatus> {
        None
    }

    /// The backend as `Any`, for a backend that offers more than this trait (a thin volume's
    /// allocation counts, an RBD image's resize and snapshots) to find itself under a
    /// [`crate::Device`] (`ThinBackend::of`, [`crate::RbdBackend::of`]); `None` by default.
    /// The trait itself names no backend.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// Claims a device that other hosts can open too (an RBD image) for `owner`, one spoold,
    /// before serving from it: fails while another owner holds it after waiting up to
    /// `wait`. `trusted`: the owner is known to hold it already (a session continued from an
    /// earlier process), so only count the claim. Devices of this host alone have nothing
    /// to claim (the default).
    fn claim(&self, _owner: &str, _trusted: bool, _wait: std::time::Duration) -> Result<()> {
        Ok(())
    }

    /// Gives back one [`PoolDevice::claim`]; the last one lets other hosts in.
    fn release_claim(&self, _owner: &str) -> Result<()> {
        Ok(())
    }
}

/// How to open a device.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Create a regular file of this size if `path` does not exist.
    pub create_size: Option<u64>,
    /// Never use O_DIRECT (for tests and file systems where it misbehaves).
    pub no_direct: bool,
    /// NVMe: never describe scatter lists by SGLs (config `[io] nvme_sgl = false`); lists
    /// PRPs cannot describe then go through bounce buffers.
    pub no_nvme_sgl: bool,
    /// Fault rules armed from the moment the device opens (the config's `[[faults]]`: a
    /// crash rule must be armed before the first request a restarted worker replays).
    pub faults: Vec<FaultRule>,
    /// The Ceph cluster `rbd:POOL/IMAGE` devices are on (config `[ceph]`), and the daemon's
    /// connections to it.
    pub ceph: crate::Ceph,
    /// Where backends keep what the next worker takes over (NVMe controllers, null devices'
    /// metadata), and what the previous one left: the daemon's. The default keeps nothing.
    pub handoff: std::sync::Arc<crate::handoff::Handoff>,
    /// How long a file device's lock may stay taken before the open fails with `Busy`: a
    /// worker taking over from a killed one waits out the kernel's teardown of the dead
    /// process's descriptors (io_uring requests still in flight keep its file, and with it
    /// the lock, for a moment). Zero: fail at once.
    pub lock_wait: std::time::Duration,
}

/// What a backend is, as far as callers above the devices layer care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendInfo {
    /// Short name of the backend: "file", "block", "nvme", "null", ...
    pub backend: &'static str,
    /// Alignment O_DIRECT I/O needs, or `None` when the backend does no direct file I/O.
    pub direct_align: Option<u64>,
    /// Queues do their I/O synchronously in the worker (files on tmpfs).
    pub inline_io: bool,
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

/// What [`PoolDevice::controller_status`] reports (an NVMe controller's today).
#[derive(Debug, Clone)]
pub struct ControllerStatus {
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
    pub smart: Option<SmartHealth>,
    /// Newest error log entries (at most 4).
    pub error_log: Vec<ErrorLogRecord>,
}

/// The SMART / health information a controller reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmartHealth {
    pub critical_warning: u8,
    /// Kelvin.
    pub temperature: u16,
    pub available_spare: u8,
    pub percentage_used: u8,
    pub media_errors: u64,
    pub error_log_entries: u64,
}

/// One entry of a controller's error log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorLogRecord {
    pub error_count: u64,
    pub sqid: u16,
    pub cid: u16,
    /// The command's status, as text.
    pub status: String,
    pub lba: u64,
    pub nsid: u32,
}

/// Refuses an access beyond `size` (the shared bound check of the backends' metadata I/O).
pub(crate) fn check_range(path: &Path, size: u64, offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::Invalid {
            path: path.display().to_string(),
            msg: format!("access {offset}+{len} beyond device size {size}"),
        }),
    }
}

/// Refuses a size that is not a positive multiple of 512.
pub(crate) fn check_size(path: &Path, size: u64) -> Result<()> {
    if size == 0 || !size.is_multiple_of(crate::SECTOR_SIZE) {
        return Err(Error::Invalid {
            path: path.display().to_string(),
            msg: format!("size {size} is not a positive multiple of 512"),
        });
    }
    Ok(())
}
