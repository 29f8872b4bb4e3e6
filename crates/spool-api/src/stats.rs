//! The wire form of `volume_stats`: a volume's I/O counters and latency (the daemon converts
//! the frontend's counters, so that they can change without changing the wire).

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Latency buckets on the wire: bucket i counts requests of at most 2^i µs, the last one
/// the slower ones too.
pub const LATENCY_BUCKETS: usize = 24;

/// The latency below which a fraction `q` of the requests counted in `buckets` completed
/// (a bucket's bound), µs; `None` without requests.
pub fn quantile_us(buckets: &[u64], q: f64) -> Option<u64> {
    let total: u64 = buckets.iter().sum();
    if total == 0 {
        return None;
    }
    let want = ((total as f64) * q).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (i, n) in buckets.iter().enumerate() {
        seen += n;
        if seen >= want {
            return Some(1u64 << i);
        }
    }
    Some(1u64 << (buckets.len().max(1) - 1))
}

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

#[cfg(test)]
mod tests {
    #[test]
    fn quantiles_are_bucket_bounds() {
        let mut b = [0u64; super::LATENCY_BUCKETS];
        assert_eq!(super::quantile_us(&b, 0.5), None);
        b[0] = 99;
        b[12] = 1;
        assert_eq!(super::quantile_us(&b, 0.5), Some(1));
        assert_eq!(super::quantile_us(&b, 0.99), Some(1));
        assert_eq!(super::quantile_us(&b, 1.0), Some(4096));
    }
}
