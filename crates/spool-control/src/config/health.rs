//! `[health]`: failure handling settings (docs/failures.md) and their defaults.

use std::path::PathBuf;

use serde::Deserialize;

use super::{Base, ConfigError};

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHealth {
    media_errors_to_fail: Option<u32>,
    io_timeout_ms: Option<u64>,
    reset_timeout_ms: Option<u64>,
    poll_interval_ms: Option<u64>,
    request_retries: Option<u32>,
    worker_watchdog_ms: Option<u64>,
    hook: Option<String>,
    #[serde(default)]
    spares: Vec<PathBuf>,
}

/// Failure handling (docs/failures.md).
#[derive(Debug, Clone, PartialEq)]
pub struct HealthConfig {
    pub media_errors_to_fail: u32,
    pub io_timeout_ms: u64,
    pub reset_timeout_ms: u64,
    pub poll_interval_ms: u64,
    pub request_retries: u32,
    /// The keeper restarts a worker whose queue threads stop making progress for this long
    /// (0: never). Default: twice `io_timeout_ms`, at least 10 s, so that no wait bounded by
    /// the I/O timeout is taken for a wedge.
    pub worker_watchdog_ms: u64,
    /// Shell command run on every health event.
    pub hook: Option<String>,
    /// Blank devices (paths) that automatically replace a failed or removed device, first
    /// existing one first: a spare file, or a block device that appears when hot-plugged.
    pub spares: Vec<PathBuf>,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            media_errors_to_fail: 1,
            io_timeout_ms: 30_000,
            reset_timeout_ms: 10_000,
            poll_interval_ms: 1_000,
            request_retries: 3,
            worker_watchdog_ms: 60_000,
            hook: None,
            spares: Vec::new(),
        }
    }
}

pub(super) fn health(h: &RawHealth, base: &Base) -> Result<HealthConfig, ConfigError> {
    let d = HealthConfig::default();
    let positive = |v: Option<u64>, def: u64, what| match v {
        Some(0) => Err(ConfigError::NotPositive(what)),
        Some(v) => Ok(v),
        None => Ok(def),
    };
    Ok(HealthConfig {
        media_errors_to_fail: positive(
            h.media_errors_to_fail.map(u64::from),
            d.media_errors_to_fail as u64,
            "media_errors_to_fail",
        )? as u32,
        io_timeout_ms: positive(h.io_timeout_ms, d.io_timeout_ms, "io_timeout_ms")?,
        reset_timeout_ms: positive(h.reset_timeout_ms, d.reset_timeout_ms, "reset_timeout_ms")?,
        poll_interval_ms: positive(h.poll_interval_ms, d.poll_interval_ms, "poll_interval_ms")?,
        request_retries: h.request_retries.unwrap_or(d.request_retries),
        worker_watchdog_ms: h
            .worker_watchdog_ms
            .unwrap_or_else(|| (2 * h.io_timeout_ms.unwrap_or(d.io_timeout_ms)).max(10_000)),
        hook: h.hook.clone().filter(|s| !s.trim().is_empty()),
        spares: h.spares.iter().map(|p| base.abs(p)).collect(),
    })
}
