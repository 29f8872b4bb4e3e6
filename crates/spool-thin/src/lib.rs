//! Thin volumes: a volume whose chunks are taken from the pool on first write (docs/thin.md).
//!
//! A thin volume is one more device under the data path, as a mirror is: [`ThinBackend`]
//! is a `PoolDevice` of the volume's size whose queues ([`ThinQueue`]) look each request up
//! in the volume's chunk map ([`map`]) and send it on to the pool devices that hold its
//! chunks. Reads of a hole fill the caller's buffers with zeroes. A write to a hole waits
//! for the allocator thread ([`alloc`]), which takes a chunk from the pool through
//! [`ChunkSource`], zeroes it, writes the map entry durably and only then publishes it: an
//! acknowledged write is always found again after a crash. Discards and write-zeroes of
//! whole chunks give the chunks back, after a grace period ([`grace`]) that outlasts every
//! request that could still be using the old mapping.
//!
//! Owns: the map format, allocation on write, unmapping, the thin device's health (it
//! follows the pool devices it uses). Must not know: virtio, the pool table, where free
//! space comes from (the pool's buddy allocators answer through [`ChunkSource`]).

pub mod alloc;
mod backend;
mod evict;
mod grace;
mod handoff;
pub mod map;
mod queue;
mod relocate;
mod share;
mod shared;
mod snapshot;
mod sync_io;

use std::sync::Arc;

use uuid::Uuid;

pub use backend::{LoadedMap, MapScan, ScanProblem, ThinBackend};
pub use queue::ThinQueue;
pub use relocate::MapMove;
pub use share::SharedChunks;
pub use shared::{SnapshotSpec, ThinSpec};

use spool_devices::Device;

/// Errors of the thin layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Device(#[from] spool_devices::Error),
    #[error("thin volume map is corrupt: {0}")]
    Corrupt(String),
    #[error("thin volume map cannot be read: {0}")]
    Unreadable(String),
    #[error("cannot start the thin volume's allocator: {0}")]
    Thread(std::io::Error),
    #[error("cannot take the snapshot: {0}")]
    Snapshot(String),
    #[error("cannot revert to the snapshot: {0}")]
    Revert(String),
    #[error("cannot forget the chunks on the replaced device: {0}")]
    Evict(String),
    #[error("cannot move the thin volume's map: {0}")]
    Relocate(String),
    /// As [`Error::Relocate`], but the allocator may still write the new place: it must
    /// stay taken (until a restart).
    #[error("cannot move the thin volume's map: {0}")]
    RelocateAbandoned(String),
}

/// Where a thin volume's chunks come from: the pool's free space.
pub trait ChunkSource: Send + Sync + std::fmt::Debug {
    /// Takes a free chunk of the pool's chunk size out of the free space: the device's UUID,
    /// the device and the chunk's byte offset on it. `None` when no device has room.
    fn take(&self) -> Option<(Uuid, Arc<Device>, u64)>;

    /// Gives a chunk taken with [`ChunkSource::take`] back to the free space.
    fn give_back(&self, device: Uuid, offset: u64);

    /// The pool's table of chunks named by more than one map.
    fn shared_chunks(&self) -> &SharedChunks;

    /// `n` chunks taken with [`ChunkSource::take`] are settled: published in their map,
    /// given back, or left taken after a failed map write. Until then the source counts
    /// them as in flight (a device leaving the pool waits for them).
    fn settled(&self, _n: usize) {}
}

#[cfg(test)]
mod tests;
