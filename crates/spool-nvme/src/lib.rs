//! Userspace NVMe driver over VFIO (Spool §3, the part SPDK plays in the paper).
//!
//! Owns: VFIO container/group/device setup ([`vfio`]), DMA-able memory and the registry of
//! caller memory mapped into the IOMMU ([`dma`]), the NVMe register and command formats
//! ([`spec`]), PRP list construction ([`prp`]), submission/completion queue pairs polled by
//! phase tag ([`qpair`]) and the controller life cycle: enable, identify, I/O queue
//! creation, synchronous I/O for metadata, health log pages ([`controller`]).
//!
//! Must not know: pools, volumes, virtio or the worker that drives a queue. It speaks in
//! namespace byte offsets and caller buffers; `spool-devices` wraps it as a pool device.
//!
//! Everything here runs against a real controller only where VFIO exists (inside the TCG test
//! guest against QEMU's emulated NVMe); the pure parts (PRP lists, status decoding, identify
//! parsing) are unit-tested on any machine.

mod arena;
pub mod controller;
pub mod dma;
pub mod handoff;
pub mod prp;
pub mod qpair;
mod sigbus;
pub mod spec;
pub mod vfio;

pub use controller::{Controller, ControllerInfo, NamespaceInfo, SmartLog};
pub use dma::{register_memory, unregister_memory, DmaBuf};
pub use qpair::{Completion, QueuePair};

/// Errors of the NVMe driver.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Os {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("controller {0}: timed out {1}")]
    Timeout(String, &'static str),
    #[error("controller {bdf}: command {what} failed with status {status}")]
    Command {
        bdf: String,
        what: &'static str,
        status: spec::Status,
    },
    #[error("controller {0} is gone (registers read all ones)")]
    Gone(String),
}

impl Error {
    pub(crate) fn os(what: impl Into<String>) -> Self {
        Error::Os {
            what: what.into(),
            source: std::io::Error::last_os_error(),
        }
    }

    /// The errno that best describes this error to a caller speaking errno.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::Invalid(_) => libc::EINVAL,
            Error::Timeout(..) => libc::ETIMEDOUT,
            Error::Command { status, .. } => -status.errno(),
            Error::Gone(_) => libc::ENODEV,
        }
    }
}

/// Result type of the NVMe driver.
pub type Result<T> = std::result::Result<T, Error>;

/// Memory page size the driver programs (CC.MPS = 0).
pub const PAGE: u64 = 4096;
