//! The wire form of mirrored volumes: a volume's copies and their state (inside
//! [`super::Volume`]) and what `volume_verify` found. Mirrors of spool-pool's and
//! spool-devices' report types, so those can change without changing the wire.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// One copy of a mirrored volume.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MirrorLeg {
    pub slot: u8,
    /// Holds a complete copy in the pool table (false while first being rebuilt).
    pub synced: bool,
    /// "current", "catching-up" (being copied to), "unusable" (a device not healthy),
    /// "missing" (a device gone from the pool), or "idle" while the volume is not served.
    pub state: String,
    /// Bytes still to copy to this leg.
    pub stale_bytes: u64,
    pub devices: Vec<Uuid>,
    /// A copy on another host (`volume send`): its NBD URI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
    /// A copy on another host that was current once: every write waits until it took it
    /// (docs/transfer.md, "When the link drops").
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub required: bool,
}

/// A mirrored volume's copies and copying progress.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MirrorStatus {
    /// Copies the volume keeps; fewer current legs: degraded.
    pub copies: u8,
    /// "healthy"; "degraded" (fewer current legs than copies); "rebuilding" (copying to a
    /// usable leg); "resyncing" (regions left out of sync by an unclean stop, every copy
    /// current); "no-current-copy" (some regions have no usable current leg: reads there wait
    /// for a device to come back or an operator to accept a leg); or "offline".
    pub state: String,
    pub legs: Vec<MirrorLeg>,
    /// Copying since it last started: bytes done, bytes left, bytes per second, seconds left.
    pub copied_bytes: u64,
    pub remaining_bytes: u64,
    pub rate: u64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eta_secs: Option<u64>,
    /// Percent of the copying done (100 when nothing is left).
    pub percent: f64,
    /// Regions (of `region_size` bytes) resynced because the daemon was not shut down
    /// cleanly, and regions copied since the volume was opened.
    pub resync_at_open: u64,
    pub regions_copied: u64,
    pub region_size: u64,
    /// Bytes the copy wrote to the other copies as write-zeroes (pieces that read as zeroes:
    /// no data sent) since the volume was opened; a piece written to two copies, or copied
    /// again, counts again. Where a device cannot do write-zeroes, zeroes go as data and are
    /// not counted (but an NBD server without write-zeroes gets them as data from the NBD
    /// client, and those are counted).
    #[serde(default)]
    pub zeroed_bytes: u64,
    /// Bytes the copy found never written on its source nor on the copies it brought up to
    /// date (a thin copy's holes, from the copies' maps) since the volume was opened:
    /// neither read nor written, and not counted against `resync_rate`.
    #[serde(default)]
    pub unwritten_bytes: u64,
    /// Bytes out of sync after an unclean stop (every current leg holds every acknowledged
    /// write there; one serves reads until the resync makes them agree).
    #[serde(default)]
    pub out_of_sync_bytes: u64,
    /// Regions with no usable current leg, and the volume offsets of the first few.
    #[serde(default)]
    pub regions_without_current: u64,
    #[serde(default)]
    pub without_current_offsets: Vec<u64>,
    /// Write-intent bitmap syncs since the worker opened the mirror, and their mean
    /// latency in µs (a write to a quiet region waits for one).
    #[serde(default)]
    pub bitmap_syncs: u64,
    #[serde(default)]
    pub bitmap_sync_us: f64,
}

/// `volume_verify`: the legs compared region by region.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VerifyResult {
    pub volume: String,
    pub regions: u64,
    pub bytes_compared: u64,
    /// Regions not compared because a leg is still being copied there.
    pub regions_skipped: u64,
    /// Regions where current legs differ (0: identical), and the first few offsets.
    pub regions_differing: u64,
    pub first_differences: Vec<u64>,
}
