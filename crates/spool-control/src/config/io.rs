//! `[io]`: the data path's tunables (polling, NVMe scatter lists, fair share, threads per
//! volume), as written and checked.

use serde::Deserialize;

use super::ConfigError;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawIo {
    pub(super) poll_idle_us: Option<u64>,
    pub(super) nvme_sgl: Option<bool>,
    pub(super) fair_share: Option<bool>,
    pub(super) volume_threads: Option<u32>,
}

/// `[io] volume_threads`: 0 (a thread per queue) to 64 (the most queues a volume has). By
/// default as many as the cores spoold may run on: a volume's queues beyond that would only
/// take turns at the cores, each with a wake-up of its own (docs/qos.md, "Scaling").
pub(super) fn volume_threads(v: Option<u32>) -> Result<usize, ConfigError> {
    match v {
        None => Ok(std::thread::available_parallelism().map_or(1, |n| n.get().min(64))),
        Some(n @ 0..=64) => Ok(n as usize),
        Some(n) => Err(ConfigError::VolumeThreads(n)),
    }
}
