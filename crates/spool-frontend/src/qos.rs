//! Per-volume I/O caps in the data path: token buckets shared by every queue (worker
//! thread) of one volume, without a lock.
//!
//! Owns: [`VolumeQos`], one bucket per limit of a [`QosLimits`] (total, read and write IOPS
//! and bytes per second), their refill, charging and reconfiguration, and the rule that
//! says when a worker may take a request (no bucket in debt). Time is a parameter
//! (nanoseconds since the volume's epoch), so tests drive it without sleeping.
//!
//! Must not know: virtqueues, requests or devices (the worker tells it the class and the
//! bytes of what it took), nor where the limits come from (the pool's layout).
//!
//! A bucket keeps its tokens as time: one unit is 2^-20 ns of the bucket's rate, so a
//! refill adds the elapsed nanoseconds exactly (no division) and the depth is the burst
//! allowance in the same unit; a charge converts the request's cost with a per-bucket
//! factor computed when the limits are set. A worker may take while every bucket holds
//! ≥ 0; the request's cost may put a bucket into debt, which the refill pays back before
//! anything else is taken, so the rate over time is exact.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use spool_pool::QosLimits;

/// Fixed-point fraction bits of a bucket's unit (a unit is 2^-FRAC ns of its rate).
const FRAC: u32 = 20;
const NS_PER_SEC: u128 = 1_000_000_000;
/// Largest cost one charge may carry (far above any request; keeps sums from overflowing).
const MAX_COST: i64 = i64::MAX / 8;

/// The buckets, by index.
const IOPS: usize = 0;
const READ_IOPS: usize = 1;
const WRITE_IOPS: usize = 2;
const BPS: usize = 3;
const READ_BPS: usize = 4;
const WRITE_BPS: usize = 5;

/// What a taken request costs: its class and its data bytes. Flush, discard and
/// write-zeroes are writes of 0 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cost {
    Read(u64),
    Write(u64),
}

#[derive(Debug, Default)]
struct Bucket {
    /// Units (2^-FRAC ns of the rate) the bucket holds; negative is debt.
    tokens: AtomicI64,
    /// Units one op (IOPS bucket) or one byte (bandwidth bucket) costs; 0 = limit off.
    unit_cost: AtomicU64,
    /// Most units the bucket holds (the burst allowance).
    depth: AtomicI64,
}

impl Bucket {
    #[inline]
    fn charge(&self, amount: u64) {
        let unit = self.unit_cost.load(Ordering::Relaxed);
        if unit != 0 {
            let cost = (amount as u128 * unit as u128).min(MAX_COST as u128) as i64;
            self.tokens.fetch_sub(cost, Ordering::Relaxed);
        }
    }

    #[inline]
    fn refill(&self, add: i64) {
        if self.unit_cost.load(Ordering::Relaxed) == 0 {
            // A charge that raced with switching this limit off must not leave a debt
            // nothing would pay back.
            if self.tokens.load(Ordering::Relaxed) != 0 {
                self.tokens.store(0, Ordering::Relaxed);
            }
            return;
        }
        let depth = self.depth.load(Ordering::Relaxed);
        let _ = self
            .tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                (t < depth).then(|| t.saturating_add(add).min(depth))
            });
    }

    /// Debt in nanoseconds (0 when not in debt or off).
    #[inline]
    fn debt_ns(&self) -> u64 {
        let t = self.tokens.load(Ordering::Relaxed);
        if t >= 0 {
            0
        } else {
            (t.unsigned_abs() >> FRAC) + 1
        }
    }

    /// Sets the rate (per second, 0 = off) and the burst; tokens keep their meaning (the
    /// same number of ops or bytes), clamped to the new depth. A bucket switched on starts
    /// full.
    fn configure(&self, rate: u64, burst_ms: u32) {
        let old = self.unit_cost.load(Ordering::Relaxed);
        if rate == 0 {
            self.unit_cost.store(0, Ordering::Relaxed);
            self.tokens.store(0, Ordering::Relaxed);
            return;
        }
        let unit = ((NS_PER_SEC << FRAC) / rate as u128).max(1) as u64;
        let depth = ((burst_ms as i64) * 1_000_000) << FRAC;
        self.depth.store(depth, Ordering::Relaxed);
        if old == 0 {
            self.tokens.store(depth, Ordering::Relaxed);
        } else {
            let _ = self
                .tokens
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                    let t = (t as i128 * unit as i128 / old as i128)
                        .clamp(-(MAX_COST as i128), depth as i128);
                    Some(t as i64)
                });
        }
        self.unit_cost.store(unit, Ordering::Relaxed);
    }
}

/// A volume's token buckets, shared by its workers through an `Arc`. Workers hold it only
/// while the layout sets limits; a volume without limits costs them nothing.
#[derive(Debug)]
pub struct VolumeQos {
    buckets: [Bucket; 6],
    /// Time (ns since `epoch`) up to which the buckets have been refilled.
    last: AtomicU64,
    epoch: Instant,
    /// The limits in force (taken only to reconfigure, never on the data path).
    limits: Mutex<Option<QosLimits>>,
    /// Tests set the clock by hand (0 = the real clock).
    #[cfg(test)]
    manual_now: AtomicU64,
}

impl Default for VolumeQos {
    fn default() -> Self {
        VolumeQos {
            buckets: Default::default(),
            last: AtomicU64::new(0),
            epoch: Instant::now(),
            limits: Mutex::new(None),
            #[cfg(test)]
            manual_now: AtomicU64::new(0),
        }
    }
}

/// Whether `limits` names any limit.
pub fn is_limited(limits: Option<&QosLimits>) -> bool {
    limits.is_some_and(|l| !l.is_unlimited())
}

impl VolumeQos {
    /// Buckets for `limits` (None / all zero: no bucket is on).
    pub fn new(limits: Option<&QosLimits>) -> Self {
        let q = VolumeQos::default();
        q.configure(limits, 0);
        q
    }

    /// Now, in nanoseconds since this volume's epoch (one clock read).
    #[inline]
    pub fn now(&self) -> u64 {
        #[cfg(test)]
        {
            let m = self.manual_now.load(Ordering::Relaxed);
            if m != 0 {
                return m;
            }
        }
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Tests: the clock reads `ns` from now on.
    #[cfg(test)]
    pub(crate) fn set_manual_now(&self, ns: u64) {
        self.manual_now.store(ns.max(1), Ordering::Relaxed);
    }

    /// Applies new limits at time `now`, keeping what each bucket holds (in ops or bytes).
    /// Returns whether anything changed. Cheap and idempotent: every worker that sees a new
    /// layout may call it.
    pub fn configure(&self, limits: Option<&QosLimits>, now: u64) -> bool {
        let mut cur = self.limits.lock().unwrap_or_else(|p| p.into_inner());
        let new = limits.filter(|l| !l.is_unlimited()).copied();
        if *cur == new {
            return false;
        }
        // Account the time elapsed so far at the old rates first.
        self.refill(now);
        let l = new.unwrap_or_default();
        let rates = [
            l.iops,
            l.read_iops,
            l.write_iops,
            l.bps,
            l.read_bps,
            l.write_bps,
        ];
        for (b, rate) in self.buckets.iter().zip(rates) {
            b.configure(rate, l.burst_ms.max(1));
        }
        *cur = new;
        true
    }

    /// Credits the time elapsed since the last refill to every bucket (once: whoever moves
    /// `last` forward refills).
    #[inline]
    pub fn refill(&self, now: u64) {
        let last = self.last.load(Ordering::Relaxed);
        if now <= last
            || self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        // Longer than the longest burst fills any bucket: cap before shifting.
        let elapsed = (now - last).min(spool_pool::qos::MAX_BURST_MS as u64 * 1_000_000);
        let add = (elapsed << FRAC) as i64;
        for b in &self.buckets {
            b.refill(add);
        }
    }

    /// Whether a request may be taken: no bucket is in debt.
    #[inline]
    pub fn may_take(&self) -> bool {
        self.buckets
            .iter()
            .all(|b| b.tokens.load(Ordering::Relaxed) >= 0)
    }

    /// How long until no bucket is in debt, in nanoseconds (0: may take now).
    pub fn wait_ns(&self) -> u64 {
        self.buckets.iter().map(Bucket::debt_ns).max().unwrap_or(0)
    }

    /// Charges a taken request.
    #[inline]
    pub fn charge(&self, cost: Cost) {
        let (ops, bytes, bps) = match cost {
            Cost::Read(n) => (READ_IOPS, n, READ_BPS),
            Cost::Write(n) => (WRITE_IOPS, n, WRITE_BPS),
        };
        self.buckets[IOPS].charge(1);
        self.buckets[ops].charge(1);
        if bytes != 0 {
            self.buckets[BPS].charge(bytes);
            self.buckets[bps].charge(bytes);
        }
    }

    /// Whether any limit is on.
    pub fn is_active(&self) -> bool {
        self.buckets
            .iter()
            .any(|b| b.unit_cost.load(Ordering::Relaxed) != 0)
    }
}

#[cfg(test)]
#[path = "qos_tests.rs"]
mod tests;
