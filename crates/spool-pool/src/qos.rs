//! Per-volume I/O limits (QoS caps) as the pool table keeps them.
//!
//! Owns: the persisted shape of the limits and their validation. Must not know: how the
//! data path enforces them (the frontend's token buckets), nor time.

use serde::{Deserialize, Serialize};

/// Largest rate a limit may name (per second): far above any device, small enough that
/// bucket arithmetic in nanoseconds cannot overflow.
pub const MAX_RATE: u64 = 1 << 40;
/// Longest burst allowance, in milliseconds.
pub const MAX_BURST_MS: u32 = 60_000;
/// Burst allowance when none is given: how long a volume that was idle may run at any
/// speed before its rates apply (QEMU's throttle groups default to one second too).
pub const DEFAULT_BURST_MS: u32 = 1000;

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn default_burst() -> u32 {
    DEFAULT_BURST_MS
}

/// A volume's I/O limits, per second; 0 leaves that limit off. Reads and writes are capped
/// separately and together; flushes, discards and write-zeroes count as writes for IOPS
/// (a discard of a whole volume is one operation) and carry no bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosLimits {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_iops: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_iops: u64,
    /// Bytes per second.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_bps: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_bps: u64,
    /// Burst allowance: each limit's bucket holds this many milliseconds of its rate.
    #[serde(default = "default_burst")]
    pub burst_ms: u32,
    /// Fair-share weight against the other busy volumes (1..=10000; 0: the default, 100).
    #[serde(default, skip_serializing_if = "is_zero32")]
    pub weight: u32,
    /// Scheduling class of the volume's worker threads.
    #[serde(default, skip_serializing_if = "Priority::is_normal")]
    pub priority: Priority,
}

/// Which volumes go first for the CPU when volumes compete for it (LeapIO's idea: serve the
/// latency-sensitive before the batch).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Worker threads at the kernel's normal priority.
    #[default]
    Normal,
    /// Never held back by the fair share; its workers run at the normal CPU priority.
    Latency,
    /// Worker threads behind the others (`SCHED_BATCH`, lowest CFS weight): they never
    /// preempt a woken thread and yield the CPU to anyone else who wants it.
    Batch,
}

impl Priority {
    pub fn is_normal(&self) -> bool {
        *self == Priority::Normal
    }

    pub fn name(&self) -> &'static str {
        match self {
            Priority::Normal => "normal",
            Priority::Latency => "latency",
            Priority::Batch => "batch",
        }
    }

    /// "normal", "latency" or "batch".
    pub fn parse(s: &str) -> Option<Priority> {
        [Priority::Normal, Priority::Latency, Priority::Batch]
            .into_iter()
            .find(|p| p.name() == s)
    }
}

fn is_zero32(v: &u32) -> bool {
    *v == 0
}

/// Largest fair-share weight.
pub const MAX_WEIGHT: u32 = 10_000;

impl Default for QosLimits {
    fn default() -> Self {
        QosLimits {
            iops: 0,
            read_iops: 0,
            write_iops: 0,
            bps: 0,
            read_bps: 0,
            write_bps: 0,
            burst_ms: DEFAULT_BURST_MS,
            weight: 0,
            priority: Priority::Normal,
        }
    }
}

impl QosLimits {
    /// Whether no limit is set (the same as no QoS at all).
    pub fn is_unlimited(&self) -> bool {
        self.rates().iter().all(|(_, r)| *r == 0)
    }

    /// No limit and the default weight: nothing worth keeping.
    pub fn is_default(&self) -> bool {
        self.is_unlimited() && self.weight == 0 && self.priority.is_normal()
    }

    /// Each limit by name, as spoolctl and the RPC spell them.
    pub fn rates(&self) -> [(&'static str, u64); 6] {
        [
            ("iops", self.iops),
            ("read_iops", self.read_iops),
            ("write_iops", self.write_iops),
            ("bps", self.bps),
            ("read_bps", self.read_bps),
            ("write_bps", self.write_bps),
        ]
    }

    /// Checks every rate and the burst allowance; says which one is wrong.
    pub fn validate(&self) -> Result<(), InvalidLimit> {
        for (name, rate) in self.rates() {
            if rate > MAX_RATE {
                return Err(InvalidLimit::Rate { name, rate });
            }
        }
        if self.weight > MAX_WEIGHT {
            return Err(InvalidLimit::Weight(self.weight));
        }
        if !(1..=MAX_BURST_MS).contains(&self.burst_ms) {
            return Err(InvalidLimit::BurstMs(self.burst_ms));
        }
        Ok(())
    }
}

/// Which limit is out of range, and its value (the text is what users see).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidLimit {
    #[error("{name} {rate} is above the largest limit {MAX_RATE}")]
    Rate { name: &'static str, rate: u64 },
    #[error("weight {0} must be between 1 and {MAX_WEIGHT}")]
    Weight(u32),
    #[error("burst_ms {0} must be between 1 and {MAX_BURST_MS}")]
    BurstMs(u32),
}
