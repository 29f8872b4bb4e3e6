//! Latency histogram: constant memory and a few instructions per sample, however long the run.
//!
//! Log-linear buckets (as HdrHistogram and fio do): exact below 1 024 ns, then 64 buckets per
//! power of two, so a percentile read from it is within 1/64 (1.6%) of the true sample. The
//! mean and the maximum are kept exactly. Owns only the arithmetic of latencies.

/// Values below this are counted exactly, one bucket per nanosecond.
const LINEAR: u64 = 1024;
/// Buckets per power of two above `LINEAR` (a power of two itself).
const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;
/// Powers of two above `LINEAR` covered: up to 2^64 ns.
const OCTAVES: u64 = 64 - 10;

/// A histogram of latencies in nanoseconds.
#[derive(Clone)]
pub struct LatHist {
    buckets: Vec<u64>,
    count: u64,
    sum_ns: u128,
    max_ns: u64,
}

impl Default for LatHist {
    fn default() -> Self {
        LatHist {
            buckets: vec![0; (LINEAR + OCTAVES * SUB) as usize],
            count: 0,
            sum_ns: 0,
            max_ns: 0,
        }
    }
}

fn bucket(ns: u64) -> usize {
    if ns < LINEAR {
        return ns as usize;
    }
    let e = 63 - ns.leading_zeros(); // >= 10
    let sub = (ns >> (e - SUB_BITS)) & (SUB - 1);
    (LINEAR + (e as u64 - 10) * SUB + sub) as usize
}

/// The smallest value that falls in bucket `b`.
fn lower_bound(b: usize) -> u64 {
    let b = b as u64;
    if b < LINEAR {
        return b;
    }
    let e = (b - LINEAR) / SUB + 10;
    let sub = (b - LINEAR) % SUB;
    (1 << e) | (sub << (e - SUB_BITS as u64))
}

impl LatHist {
    /// Counts one sample.
    #[inline]
    pub fn record(&mut self, ns: u64) {
        self.buckets[bucket(ns)] += 1;
        self.count += 1;
        self.sum_ns += ns as u128;
        self.max_ns = self.max_ns.max(ns);
    }

    /// Adds another histogram's samples (one per client thread).
    pub fn merge(&mut self, other: &LatHist) {
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.count += other.count;
        self.sum_ns += other.sum_ns;
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    /// Mean in nanoseconds (0 without samples).
    pub fn mean_ns(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_ns as f64 / self.count as f64
        }
    }

    pub fn max_ns(&self) -> u64 {
        self.max_ns
    }

    /// The `p` quantile (0..=1) in nanoseconds: the lower bound of the bucket holding the
    /// sample of that rank, never above the maximum (0 without samples).
    pub fn quantile_ns(&self, p: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((self.count as f64 * p) as u64).min(self.count - 1);
        let mut seen = 0u64;
        for (b, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen > rank {
                return lower_bound(b).min(self.max_ns);
            }
        }
        self.max_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_exact_below_1024_and_within_1_64_above() {
        for ns in [0u64, 1, 500, 1023] {
            assert_eq!(lower_bound(bucket(ns)), ns);
        }
        let mut last = 0;
        for ns in (1024u64..5_000_000)
            .step_by(997)
            .chain([u64::MAX / 3, u64::MAX])
        {
            let b = bucket(ns);
            assert!(b >= last, "buckets grow with the value");
            last = b;
            let lo = lower_bound(b);
            assert!(
                lo <= ns && (ns - lo) as f64 <= ns as f64 / 64.0,
                "{ns} in bucket from {lo}"
            );
        }
        assert!(bucket(u64::MAX) < LatHist::default().buckets.len());
    }

    #[test]
    fn quantiles_mean_and_max_match_the_samples() {
        let mut h = LatHist::default();
        let mut samples: Vec<u64> = (1..=100_000u64)
            .map(|i| (i * 7919) % 250_000 + 300)
            .collect();
        for &s in &samples {
            h.record(s);
        }
        samples.sort_unstable();
        for p in [0.5, 0.99, 0.999] {
            let exact = samples[(samples.len() as f64 * p) as usize] as f64;
            let got = h.quantile_ns(p) as f64;
            assert!(
                (exact - got).abs() <= exact / 64.0,
                "p{p}: {got} vs {exact}"
            );
        }
        let mean = samples.iter().sum::<u64>() as f64 / samples.len() as f64;
        assert!((h.mean_ns() - mean).abs() < 1e-6);
        assert_eq!(h.max_ns(), *samples.last().unwrap());
        let mut two = LatHist::default();
        two.record(10);
        two.merge(&h);
        assert_eq!(two.count, h.count + 1);
        assert_eq!(LatHist::default().quantile_ns(0.5), 0);
    }
}
