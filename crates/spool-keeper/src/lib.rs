//! Descriptor keeper: lets `spoold`'s worker process die or be replaced without the VMs
//! noticing.
//!
//! Owns: the keeper (supervisor) process, its store of named descriptors and state blobs,
//! the channel protocol between keeper and worker (one SOCK_SEQPACKET pair, JSON messages
//! with SCM_RIGHTS descriptors), crash restart and the graceful-upgrade handoff.
//!
//! Must not know: what the descriptors are (sockets, memfds, eventfds are all just files
//! under a key) or what the state blobs say. The worker decides what to keep; the keeper
//! only keeps it, hands it to the next worker and orchestrates who runs.

pub mod link;
pub mod proto;
pub mod supervisor;
pub mod systemd;

pub use link::{KeeperLink, Restored};
pub use proto::{Phase, RestartReport, StartInfo};
pub use supervisor::{run as run_keeper, KeeperConfig};

/// Wall-clock microseconds since the epoch (phases are measured across processes).
pub fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}
