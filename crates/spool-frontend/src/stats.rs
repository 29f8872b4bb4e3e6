//! Per-volume I/O statistics, counted by the queue workers and read by whoever reports them
//! (the daemon's metrics endpoint and `volume_stats`).
//!
//! Each queue index of a volume has its own [`QueueStats`] on its own cache lines, written by
//! the one worker thread serving that queue (plain load + store, no locked instruction) and
//! read by anyone with relaxed loads, so counting costs the data path a few stores per
//! request and no shared cache line. A queue restarted within the process (reconnect, reset)
//! continues its counters; a new worker process starts them at zero (Prometheus treats that as
//! a counter reset).
//!
//! Latency is measured from the poll round that took a request to the poll round that
//! completed it: one clock read per round with work, not two per request, so it is exact to
//! within one round (microseconds under load). The clock is `quanta`'s: the CPU's invariant
//! TSC where the kernel trusts it (about 10 ns a read here, against 30 ns for
//! `clock_gettime`), scaled to nanoseconds only when a request completes; elsewhere it falls
//! back to the monotonic clock.
//!
//! Owns: the counters, the latency histogram's buckets and [`VolumeStatsSnapshot`].
//! Must not know: how they are exported.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::OnceLock;

/// Upper bounds of the latency buckets, in microseconds: 1, 2, 4 … 2^22 (about 4 s); the last
/// bucket counts everything slower.
pub const LATENCY_BUCKETS: usize = 24;

/// The kind of request a counter is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum OpKind {
    Read = 0,
    Write = 1,
    /// Flush, discard, write-zeroes, GET_ID.
    Other = 2,
}

/// Names of the op kinds, by index.
pub const OP_NAMES: [&str; 3] = ["read", "write", "other"];

#[derive(Default)]
struct OpCounters {
    ops: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    /// In clock ticks (nanoseconds when read out).
    latency_sum: AtomicU64,
    buckets: [AtomicU64; LATENCY_BUCKETS],
}

/// One queue's counters (one writer: the queue's worker thread).
#[derive(Default)]
#[repr(align(128))]
pub struct QueueStats {
    ops: [OpCounters; 3],
    /// Chains refused by the parser (completed with an error status).
    rejected: AtomicU64,
    in_flight: AtomicU64,
    /// Requests resubmitted from the journal after a restart.
    resubmitted: AtomicU64,
    /// Queues recovered from their journal (Algorithm 2) rather than started clean.
    recoveries: AtomicU64,
    /// Poll rounds in which the volume's I/O limits stopped the queue from taking requests.
    throttled: AtomicU64,
    /// Poll rounds: the worker's heartbeat.
    rounds: AtomicU64,
    /// The virtqueue's negotiated size while a worker serves it (0 when none does).
    size: AtomicU64,
    /// [`QueueState`] of the queue's worker thread.
    state: AtomicU8,
}

/// What a queue's worker thread is doing, for the watchdog: a running thread that is not
/// asleep must keep counting poll rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueState {
    /// No worker thread (the queue is not started).
    Idle,
    /// Polling: its poll rounds must advance.
    Running,
    /// Asleep in epoll, waiting for a kick, a completion or a timer.
    Asleep,
}

/// Adds `n` to a counter only this thread writes.
#[inline(always)]
fn bump(a: &AtomicU64, n: u64) {
    a.store(a.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// The bucket of a latency in nanoseconds: the first whose bound (2^i µs) it does not exceed.
#[inline]
pub fn bucket(ns: u64) -> usize {
    let us = ns.div_ceil(1000);
    if us <= 1 {
        return 0;
    }
    ((64 - (us - 1).leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
}

fn clock() -> &'static quanta::Clock {
    static CLOCK: OnceLock<quanta::Clock> = OnceLock::new();
    CLOCK.get_or_init(quanta::Clock::new)
}

/// A reading of the process-wide latency clock (raw ticks; never 0, which means "unset").
#[inline]
pub fn now_ticks() -> u64 {
    clock().raw().max(1)
}

/// Nanoseconds between two [`now_ticks`] readings.
#[inline]
pub fn elapsed_ns(start: u64, end: u64) -> u64 {
    if end <= start {
        return 0;
    }
    clock().delta_as_nanos(start, end)
}

/// Microseconds per tick, fixed point (×2^32), so that a latency's bucket is one multiply.
fn us_per_tick() -> u64 {
    static US: OnceLock<u64> = OnceLock::new();
    *US.get_or_init(|| {
        let ns = clock().delta_as_nanos(1, 1 + (1 << 32));
        (ns / 1000).max(1)
    })
}

/// The bucket of a latency of `ticks` ([`bucket`] in clock ticks).
#[inline]
fn bucket_of_ticks(ticks: u64, us_per_tick: u64) -> usize {
    let us = ((ticks as u128 * us_per_tick as u128) >> 32) as u64 + 1;
    if us <= 1 {
        return 0;
    }
    ((64 - (us - 1).leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
}

/// A worker's counts not yet published: plain integers in the worker's own memory, added to
/// per request (no shared cache line, no atomic), and added to its [`QueueStats`] by
/// [`Self::publish`] every so many poll rounds, before it sleeps and when it stops.
pub struct Tally {
    us_per_tick: u64,
    ops: [u64; 3],
    bytes: [u64; 3],
    errors: [u64; 3],
    ticks: [u64; 3],
    buckets: [[u64; LATENCY_BUCKETS]; 3],
    rounds: u64,
}

impl Default for Tally {
    fn default() -> Self {
        Tally {
            us_per_tick: us_per_tick(),
            ops: [0; 3],
            bytes: [0; 3],
            errors: [0; 3],
            ticks: [0; 3],
            buckets: [[0; LATENCY_BUCKETS]; 3],
            rounds: 0,
        }
    }
}

impl Tally {
    /// A request of `kind`, `bytes` long, `ok` or not, taken at `taken` and completed at
    /// `now` ([`now_ticks`] readings).
    #[inline]
    pub fn add(&mut self, kind: OpKind, bytes: u64, ok: bool, taken: u64, now: u64) {
        let k = kind as usize;
        self.ops[k] += 1;
        self.bytes[k] += bytes;
        self.errors[k] += u64::from(!ok);
        let lat = now.saturating_sub(taken);
        self.ticks[k] += lat;
        self.buckets[k][bucket_of_ticks(lat, self.us_per_tick)] += 1;
    }

    /// One poll round (the worker's heartbeat).
    #[inline]
    pub fn round(&mut self) {
        self.rounds += 1;
    }

    /// Adds the counts to `q` and starts again from zero.
    pub fn publish(&mut self, q: &QueueStats) {
        for (k, c) in q.ops.iter().enumerate() {
            if self.ops[k] == 0 {
                continue;
            }
            bump(&c.ops, std::mem::take(&mut self.ops[k]));
            bump(&c.bytes, std::mem::take(&mut self.bytes[k]));
            bump(&c.errors, std::mem::take(&mut self.errors[k]));
            bump(&c.latency_sum, std::mem::take(&mut self.ticks[k]));
            for (b, n) in c.buckets.iter().zip(&mut self.buckets[k]) {
                if *n > 0 {
                    bump(b, std::mem::take(n));
                }
            }
        }
        bump(&q.rounds, std::mem::take(&mut self.rounds));
    }
}

impl QueueStats {
    /// One completed request, published at once (a [`Tally`] of one).
    pub fn complete(&self, kind: OpKind, bytes: u64, ok: bool, taken: u64, now: u64) {
        let mut t = Tally::default();
        t.add(kind, bytes, ok, taken, now);
        t.publish(self);
    }

    #[inline]
    pub fn rejected(&self) {
        bump(&self.rejected, 1);
    }

    #[inline]
    pub fn set_in_flight(&self, n: u64) {
        self.in_flight.store(n, Ordering::Relaxed);
    }

    pub fn resubmitted(&self, n: u64) {
        bump(&self.resubmitted, n);
    }

    pub fn recovered(&self) {
        bump(&self.recoveries, 1);
    }

    #[inline]
    pub fn throttled(&self) {
        bump(&self.throttled, 1);
    }

    /// Set by the queue's worker thread as it starts (the negotiated size) and stops (0).
    pub fn set_size(&self, size: u16) {
        self.size.store(u64::from(size), Ordering::Relaxed);
    }

    /// The heartbeat: poll rounds so far.
    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Relaxed)
    }

    /// Set by the queue's worker thread as it starts, sleeps, wakes and exits.
    #[inline]
    pub fn set_state(&self, s: QueueState) {
        self.state.store(s as u8, Ordering::Relaxed);
    }

    pub fn state(&self) -> QueueState {
        match self.state.load(Ordering::Relaxed) {
            1 => QueueState::Running,
            2 => QueueState::Asleep,
            _ => QueueState::Idle,
        }
    }
}

/// A volume's counters: one [`QueueStats`] per queue index.
pub struct VolumeStats {
    queues: Box<[QueueStats]>,
    /// Shared by queue indices beyond the volume's count (never reported; keeps the data path
    /// free of a bounds branch that can fail).
    spare: QueueStats,
}

/// Totals of one op kind.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpTotals {
    pub ops: u64,
    pub bytes: u64,
    pub errors: u64,
    pub latency_sum_ns: u64,
    /// Per bucket (not cumulative), bounds 2^i µs.
    pub buckets: [u64; LATENCY_BUCKETS],
}

/// A volume's counters summed over its queues.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VolumeStatsSnapshot {
    /// Indexed by [`OpKind`].
    pub ops: [OpTotals; 3],
    pub rejected: u64,
    pub in_flight: u64,
    pub resubmitted: u64,
    pub recoveries: u64,
    pub throttled_rounds: u64,
    pub rounds: u64,
    /// The largest negotiated size of the volume's served virtqueues (0: none served).
    pub queue_size: u64,
}

impl VolumeStats {
    pub fn new(num_queues: u16) -> VolumeStats {
        // Calibrates the clock now, not on a worker's first request.
        us_per_tick();
        VolumeStats {
            queues: (0..num_queues.max(1))
                .map(|_| QueueStats::default())
                .collect(),
            spare: QueueStats::default(),
        }
    }

    /// The counters of queue `index`.
    pub fn queue(&self, index: u16) -> &QueueStats {
        self.queues.get(index as usize).unwrap_or(&self.spare)
    }

    /// Every queue's heartbeat: (state, poll rounds).
    pub fn heartbeats(&self) -> Vec<(QueueState, u64)> {
        self.queues
            .iter()
            .map(|q| (q.state(), q.rounds()))
            .collect()
    }

    /// Sums every queue's counters (relaxed reads: each counter is exact, a snapshot of
    /// several is not atomic as a whole).
    pub fn snapshot(&self) -> VolumeStatsSnapshot {
        let mut s = VolumeStatsSnapshot::default();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for q in self.queues.iter() {
            for (t, c) in s.ops.iter_mut().zip(&q.ops) {
                t.ops += get(&c.ops);
                t.bytes += get(&c.bytes);
                t.errors += get(&c.errors);
                t.latency_sum_ns += elapsed_ns(0, get(&c.latency_sum));
                for (b, n) in t.buckets.iter_mut().zip(&c.buckets) {
                    *b += get(n);
                }
            }
            s.rejected += get(&q.rejected);
            s.in_flight += get(&q.in_flight);
            s.resubmitted += get(&q.resubmitted);
            s.recoveries += get(&q.recoveries);
            s.throttled_rounds += get(&q.throttled);
            s.rounds += get(&q.rounds);
            s.queue_size = s.queue_size.max(get(&q.size));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_bound_each_latency_from_above() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1000), 0);
        assert_eq!(bucket(1001), 1);
        assert_eq!(bucket(2000), 1);
        assert_eq!(bucket(3000), 2);
        assert_eq!(bucket(1_000_000), 10); // 1 ms ≤ 1024 µs
        assert_eq!(bucket(u64::MAX), LATENCY_BUCKETS - 1);
    }

    #[test]
    fn counts_sum_over_queues_and_quantiles_come_from_buckets() {
        let v = VolumeStats::new(2);
        let ticks_after = |ns: u64| {
            // Readings `ns` apart on the real clock.
            let t0 = now_ticks();
            let deadline = std::time::Instant::now() + std::time::Duration::from_nanos(ns);
            while std::time::Instant::now() < deadline {}
            (t0, now_ticks())
        };
        let (a, b) = ticks_after(3_000);
        let lat = elapsed_ns(a, b);
        assert!((3_000..1_000_000).contains(&lat), "{lat}");
        for i in 0..99 {
            v.queue(i % 2).complete(OpKind::Read, 4096, true, a, a);
        }
        let (c, d) = ticks_after(600_000);
        v.queue(1).complete(OpKind::Read, 4096, false, c, d);
        v.queue(7).complete(OpKind::Write, 1, true, 0, 1); // beyond the count: not reported
        v.queue(0).set_size(128);
        v.queue(1).set_size(256);
        v.queue(7).set_size(1024);
        let s = v.snapshot();
        assert_eq!(s.queue_size, 256);
        assert_eq!(s.ops[0].ops, 100);
        assert_eq!(s.ops[0].bytes, 409_600);
        assert_eq!(s.ops[0].errors, 1);
        assert_eq!(s.ops[1].ops, 0);
        assert_eq!(s.ops[0].buckets[0], 99, "{:?}", s.ops[0].buckets);
        assert_eq!(s.ops[0].buckets[10..].iter().sum::<u64>(), 1);
        assert!(s.ops[1].buckets.iter().all(|&n| n == 0));
    }
}
