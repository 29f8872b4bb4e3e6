//! Thin volumes on the wire (docs/thin.md, docs/snapshots.md): a volume's chunks as
//! `volume_show` reports them, snapshots and clones.

use serde::{Deserialize, Serialize};

/// A thin volume's space.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThinInfo {
    /// Bytes per chunk.
    pub chunk: u64,
    /// Bytes of the volume backed by chunks now.
    pub mapped: u64,
    /// Bytes its map takes.
    pub map_bytes: u64,
    /// Writes waiting for free space now (the pool is full).
    pub waiting_for_space: u64,
    /// How large `volume_resize` can make it (what its map holds).
    #[serde(default)]
    pub max_size: u64,
    /// Why the volume is not served (its map cannot be read or is corrupt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `volume_snapshot` and `snapshot_delete`: snapshot `snapshot` of volume `id`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotParams {
    pub id: String,
    pub snapshot: String,
}

/// `volume_snapshot`: take snapshot `snapshot` of volume `id`; with `require_space`, refused
/// when the copies its writes could need after it exceed the pool's free space.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TakeSnapshotParams {
    pub id: String,
    pub snapshot: String,
    #[serde(default)]
    pub require_space: bool,
}

/// `volume_clone`: a new volume `name` from snapshot `snapshot` of volume `id`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloneParams {
    pub id: String,
    pub snapshot: String,
    pub name: String,
}

/// A snapshot of a thin volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub volume: String,
    pub name: String,
    pub uuid: uuid::Uuid,
    /// The volume's size when it was taken.
    pub size: u64,
    /// When it was taken (seconds since the Unix epoch).
    pub created: u64,
    /// Bytes of chunks its map names.
    pub mapped: u64,
    /// Of those, the bytes no other map names (what deleting it gives back).
    pub exclusive: u64,
    /// Why it cannot be used (its map is corrupt): it can only be deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// RBD's own snapshot (docs/ceph.md): `mapped` and `exclusive` are not counted here.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rbd: bool,
    /// In `volume_snapshot`'s answer: the bytes the volume's first writes after it could
    /// need for copies (every chunk it maps), the pool's free bytes when it was taken, and a
    /// warning when the first is larger (writes may then fail for want of space).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copies_could_need: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_free: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

/// `volume_diff`: what differs between snapshot `from` of volume `id` and snapshot `to`
/// (absent: the volume now).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiffParams {
    pub id: String,
    pub from: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
}

/// The ranges that differ, in whole chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffResult {
    /// Bytes per chunk (the unit of the ranges).
    pub chunk: u64,
    /// (offset, length) in bytes, merged, in order.
    pub ranges: Vec<(u64, u64)>,
    /// Their total length.
    pub changed: u64,
}

/// `snapshot_export`: serve snapshot `snapshot` of volume `id` on `nbd` (`unix:PATH` or
/// `HOST:PORT`), with a dirty bitmap against snapshot `since` if given.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportParams {
    pub id: String,
    pub snapshot: String,
    pub nbd: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// Serve a snapshot of an encrypted volume decrypted (plaintext on the socket); refused
    /// without it.
    #[serde(default)]
    pub decrypt: bool,
    /// Serve over TCP without TLS: whoever reaches the address reads the snapshot, and
    /// whoever is on the path sees its data. Refused without it when `[tls]` is not set.
    #[serde(default)]
    pub plaintext: bool,
}

/// A snapshot served over NBD.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportInfo {
    pub volume: String,
    pub snapshot: String,
    /// Where it listens (`unix:PATH` or `HOST:PORT`).
    pub nbd: String,
    /// The NBD URI clients use.
    pub uri: String,
    pub size: u64,
    /// The snapshot its `qemu:dirty-bitmap:BASE` context is against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
}

/// `volume_revert` and `volume_inflate`: how many chunk entries changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangedChunks {
    pub volume: String,
    pub chunks: u64,
}
