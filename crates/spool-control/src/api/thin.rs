//! Thin volumes on the wire (docs/thin.md): a volume's chunks as `volume_show` reports them.

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

impl From<spool_pool::ThinInfo> for ThinInfo {
    fn from(t: spool_pool::ThinInfo) -> Self {
        ThinInfo {
            chunk: t.chunk,
            mapped: t.mapped,
            map_bytes: t.map_bytes,
            waiting_for_space: t.waiting_for_space,
            max_size: t.max_size,
            error: t.error,
        }
    }
}
