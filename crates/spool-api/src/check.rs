//! `pool_check` on the wire (docs/pool-check.md): what the check of the pool's metadata
//! against itself and the live allocators found.

use serde::{Deserialize, Serialize};

/// `pool_check`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckReport {
    /// Volumes in the table.
    pub volumes: usize,
    /// Thin maps read from the devices (volumes', snapshots').
    pub maps: usize,
    /// Bytes of the table's extents (volumes' data, mirror copies, maps).
    pub extent_bytes: u64,
    /// Distinct chunks the thin maps name, and how many of them more than one map names.
    pub chunks: u64,
    pub shared_chunks: u64,
    /// Bytes taken in the allocators that nothing names.
    pub leaked_bytes: u64,
    /// What is wrong, one line each; empty when the pool is consistent.
    pub problems: Vec<String>,
    /// What could not be checked and why (a missing device).
    pub skipped: Vec<String>,
}
