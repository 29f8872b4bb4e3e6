//! Thin volumes' space as the operator sees it (docs/thin.md): the metrics' pool and volume
//! gauges, and health events (kind "pool-space") when free space falls below 20%, 10% and 5%
//! of the pool while thin volumes may still take chunks, when it rises above them again, and
//! when writes start and stop waiting for space.
//!
//! Owns: the thresholds and what was last told. Must not know: how chunks are allocated.

use uuid::Uuid;

use super::Daemon;
use crate::metrics::Space;

/// Free space (percent of the pool) below which an event says so.
const LEVELS: [u64; 3] = [20, 10, 5];

/// What the last report told.
#[derive(Debug, Default)]
pub(super) struct SpaceWatch {
    /// How many of [`LEVELS`] free space was below.
    level: usize,
    /// Writes were waiting for space.
    waiting: bool,
}

impl Daemon {
    /// The pool's space and its thin volumes'.
    pub(crate) fn space(&self) -> Space {
        let (info, volumes) = {
            let pool = self.pool();
            (pool.info(), pool.volumes())
        };
        Space {
            size: info.size,
            free: info.free,
            thin_provisioned: info.thin_provisioned,
            thin_mapped: info.thin_mapped,
            thin_shared: info.thin_shared,
            thin: volumes
                .into_iter()
                .filter_map(|v| Some((v.name, v.thin?)))
                .map(|(n, t)| (n, t.mapped, t.waiting_for_space))
                .collect(),
        }
    }

    /// Records a "pool-space" event when free space crossed a level or writes started or
    /// stopped waiting for space (only while thin volumes exist).
    pub(super) fn report_thin_space(&self, seen: &mut SpaceWatch) {
        let s = self.space();
        if s.thin.is_empty() {
            *seen = SpaceWatch::default();
            return;
        }
        let percent = s.free.saturating_mul(100) / s.size.max(1);
        let level = LEVELS.iter().filter(|&&l| percent < l).count();
        let pool = self.pool().name().to_string();
        let over = s.thin_provisioned.saturating_mul(100) / s.size.max(1);
        if level != seen.level {
            let reason = match level > seen.level {
                true => format!(
                    "pool {pool}: {percent}% free ({} of {} bytes); thin volumes promise {over}% of the pool: writes to unallocated chunks wait, then fail, when it is full (add a device or free space)",
                    s.free, s.size
                ),
                false => format!("pool {pool}: {percent}% free again ({} of {} bytes)", s.free, s.size),
            };
            self.monitor.note(Uuid::nil(), &pool, "pool-space", reason);
            seen.level = level;
        }
        let waiting: Vec<String> = s
            .thin
            .iter()
            .filter(|t| t.2 > 0)
            .map(|t| format!("{} ({} writes)", t.0, t.2))
            .collect();
        if waiting.is_empty() == seen.waiting {
            let reason = match waiting.is_empty() {
                false => format!(
                    "pool {pool} is full: writes of thin volumes wait for free space: {}",
                    waiting.join(", ")
                ),
                true => format!("pool {pool}: no thin volume's write waits for space any more"),
            };
            self.monitor.note(Uuid::nil(), &pool, "pool-space", reason);
            seen.waiting = !waiting.is_empty();
        }
    }
}
