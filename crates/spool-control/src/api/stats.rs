//! The wire form of `volume_stats`: a volume's I/O counters and latency, converted from the
//! frontend's [`spool_frontend::stats::VolumeStatsSnapshot`] so that it can change without
//! changing the wire.

use serde::{Deserialize, Serialize};
use spool_frontend::stats::{OpTotals, VolumeStatsSnapshot, LATENCY_BUCKETS};
use uuid::Uuid;

/// `volume_stats`: every volume, or one.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct VolumeStatsParams {
    pub id: Option<String>,
}

/// Completed requests of one kind.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OpStats {
    pub ops: u64,
    pub bytes: u64,
    pub errors: u64,
    /// Mean latency, µs (0 without requests).
    pub mean_us: f64,
    /// Upper bounds of the latency buckets (powers of two µs) holding the median and the
    /// 99th percentile; `null` without requests.
    pub p50_us: Option<u64>,
    pub p99_us: Option<u64>,
    /// Requests per latency bucket, bucket i counting those ≤ 2^i µs (the last one: slower).
    pub buckets: Vec<u64>,
}

impl From<&OpTotals> for OpStats {
    fn from(t: &OpTotals) -> Self {
        OpStats {
            ops: t.ops,
            bytes: t.bytes,
            errors: t.errors,
            mean_us: if t.ops == 0 {
                0.0
            } else {
                t.latency_sum_ns as f64 / t.ops as f64 / 1e3
            },
            p50_us: t.quantile_us(0.5),
            p99_us: t.quantile_us(0.99),
            buckets: t.buckets[..LATENCY_BUCKETS].to_vec(),
        }
    }
}

/// One volume's counters since this worker process started.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct VolumeStats {
    pub volume: String,
    pub uuid: Uuid,
    pub read: OpStats,
    pub write: OpStats,
    /// Flush, discard, write-zeroes, GET_ID.
    pub other: OpStats,
    /// Chains the parser refused (completed with an error status).
    pub rejected: u64,
    pub in_flight: u64,
    pub queues: u16,
    /// The negotiated virtqueue size (the largest of the served queues; 0: no frontend).
    #[serde(default)]
    pub queue_size: u64,
    /// Requests resubmitted from the journal, and queues recovered from it, since start.
    pub resubmitted: u64,
    pub journal_recoveries: u64,
    /// Poll rounds in which the volume's I/O limits held requests back.
    pub qos_throttled_rounds: u64,
    /// Seconds since these counters started (the worker process's start).
    pub uptime_s: f64,
}

impl VolumeStats {
    pub fn new(
        volume: String,
        uuid: Uuid,
        queues: u16,
        s: &VolumeStatsSnapshot,
        uptime_s: f64,
    ) -> Self {
        VolumeStats {
            volume,
            uuid,
            read: (&s.ops[0]).into(),
            write: (&s.ops[1]).into(),
            other: (&s.ops[2]).into(),
            rejected: s.rejected,
            in_flight: s.in_flight,
            queues,
            queue_size: s.queue_size,
            resubmitted: s.resubmitted,
            journal_recoveries: s.recoveries,
            qos_throttled_rounds: s.throttled_rounds,
            uptime_s,
        }
    }
}
