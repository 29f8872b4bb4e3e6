//! Devices layer: the physical block devices a pool is built from.
//!
//! Owns: the [`PoolDevice`] trait and its backends, each in its own module (files and block
//! devices: size, O_DIRECT probe, exclusive lock; NVMe controllers through Spool's userspace
//! driver; Ceph RBD images through librbd; the null device), synchronous metadata I/O, the per-worker asynchronous
//! [`DeviceQueue`] that moves data between a device and caller-supplied memory (io_uring or
//! inline for files, queue pairs for NVMe), and [`Device`], the wrapper that stacks fault
//! injection in front of every queue and a health cell (the state the data path obeys) on
//! any backend.
//!
//! Must not know: virtio, vhost-user, volumes, extents or pool metadata. Offsets here are
//! device byte offsets; the pool maps volume offsets onto them.

mod backend;
mod completions;
mod device;
pub mod fanout;
mod fault;
mod file;
mod file_map;
mod health;
mod inline;
pub mod iov;
mod nbd;
mod null;
mod nvme;
mod queue;
mod rbd;
mod slots;
mod sync_queue;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod write_log;

pub use backend::{
    BackendInfo, ControllerStatus, ErrorLogRecord, OpenOptions, PoolDevice, Probe, SmartHealth,
};
pub use device::Device;
pub use fault::{FaultEffect, FaultOps, FaultRule, FaultSet, FaultStatus, FaultyQueue, MetaOp};
pub use file::FileBackend;
pub use health::{DeviceHealth, ErrorClass, ErrorReport, HealthState, Signal};
pub use inline::InlineQueue;
pub use nbd::{NbdBackend, NbdQueue};

/// Whether `s` is an NBD URI a device opens: `nbd://`, `nbd+unix://`, and the same over TLS
/// (`nbds://`, `nbds+unix://`).
pub fn is_nbd_uri(s: &str) -> bool {
    ["nbd://", "nbd+unix://", "nbds://", "nbds+unix://"]
        .iter()
        .any(|p| s.starts_with(p))
}
pub use null::{NullBackend, NullQueue, NullReads};
pub use nvme::NvmeBackend;
pub use rbd::{
    Ceph, CephClusters, CephConnections, CephOptions, RbdBackend, RbdQueue, RbdSnapshot,
};
pub use slots::Slots;
pub use write_log::{Logged, WriteLog};
/// Backend state kept alive across worker restarts: descriptors a backend deposits with the
/// daemon's keeper and gets back in the next worker (NVMe controllers, re-attached without a
/// reset; the null devices' metadata, so a benchmark pool keeps its volumes). The daemon
/// makes a [`handoff::Handoff`], supplies its [`handoff::Keeper`], offers back what the
/// previous worker left under [`handoff::PREFIXES`], and opens devices with it
/// ([`OpenOptions::handoff`]).
pub mod handoff {
    pub use spool_nvme::handoff::{Handoff, Keeper, PREFIX, PREFIXES};
}

/// Makes `[addr, addr+len)` of this process reachable by DMA from every NVMe controller, so
/// requests into it are zero copy (called for guest memory when a vhost-user frontend maps
/// it). Harmless, and cheap, when no NVMe device is in use.
pub fn register_dma_memory(addr: u64, len: u64) -> std::result::Result<(), spool_nvme::Error> {
    spool_nvme::register_memory(addr, len)
}

/// Undoes [`register_dma_memory`]; no request may still point into the range.
pub fn unregister_dma_memory(addr: u64, len: u64) {
    spool_nvme::unregister_memory(addr, len)
}
pub use queue::{
    completion_eventfd, drain_done, epoll_new, epoll_watch, DeviceIo, DeviceQueue, IoVec,
    UringQueue,
};
pub use sync_queue::{run_one, AlignedBuf};

/// Errors of the devices layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {what}: {source}")]
    Io {
        path: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {msg}")]
    Invalid { path: String, msg: String },
    #[error("{path}: {msg}")]
    Controller { path: String, msg: String },
    #[error("{path}: device is in use by another process (it is locked); stop the other spoold or pick another device")]
    Busy { path: String },
}

impl Error {
    /// An I/O error of `what` on the device at `path`.
    pub fn io(path: &std::path::Path, what: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            path: path.display().to_string(),
            what,
            source,
        }
    }
}

/// Result type of the devices layer.
pub type Result<T> = std::result::Result<T, Error>;

/// The sector size every offset and length of the data path is a multiple of.
pub const SECTOR_SIZE: u64 = 512;
