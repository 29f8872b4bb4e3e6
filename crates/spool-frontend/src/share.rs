//! Weighted fair sharing between the volumes one process serves (issue 18; docs/qos.md):
//! volumes that are busy at the same time get service in proportion to their weights, so a
//! volume at QD128 cannot take the cores and devices from one at QD1, and one with weight 2
//! gets twice the service of one with weight 1. Work-conserving: a volume alone, or whose
//! neighbours are idle, runs at full speed.
//!
//! The model is start-time fair queuing over virtual time, kept without a central queue:
//! each volume has a virtual clock that advances by `UNIT × 100 / weight` per request taken
//! (a request is one unit of service: the queue workers' cost is per request). A worker takes
//! from its ring only while its volume's clock is no more than [`WINDOW`] requests' worth
//! ahead of the slowest busy volume's; otherwise it leaves the requests in the guest's ring and
//! yields its core, which is what lets the others catch up when they share one. A volume that
//! becomes busy again starts at the slowest busy clock, so being idle earns no credit.
//!
//! "Busy" means a queue of the volume has requests in flight or waiting in its ring.
//!
//! Owns: [`ShareGroup`] (the volumes of one process) and [`VolumeShare`] (one volume's
//! weight, clock and busy queues). Must not know: rings, devices, time.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

/// The weight of a volume that names none.
pub const DEFAULT_WEIGHT: u32 = 100;
/// Largest weight (and the smallest is 1).
pub const MAX_WEIGHT: u32 = 10_000;
/// Virtual time of one request at the default weight.
const UNIT: u64 = 1 << 16;
/// How many requests (at the default weight) a volume may run ahead of the slowest busy one:
/// enough to keep a queue's pipeline full between checks, small against a second of service.
pub const WINDOW: u64 = 64;

/// One volume's share.
#[derive(Debug)]
pub struct VolumeShare {
    weight: AtomicU32,
    vclock: AtomicU64,
    busy_queues: AtomicU32,
}

impl VolumeShare {
    fn new(weight: u32) -> Self {
        VolumeShare {
            weight: AtomicU32::new(clamp(weight)),
            vclock: AtomicU64::new(0),
            busy_queues: AtomicU32::new(0),
        }
    }

    pub fn weight(&self) -> u32 {
        self.weight.load(Ordering::Relaxed)
    }

    /// Takes effect for the next request taken.
    pub fn set_weight(&self, w: u32) {
        self.weight.store(clamp(w), Ordering::Relaxed);
    }

    fn busy(&self) -> bool {
        self.busy_queues.load(Ordering::Relaxed) > 0
    }

    /// Charges `n` requests taken.
    #[inline]
    pub fn charge(&self, n: u64) {
        let per = UNIT * DEFAULT_WEIGHT as u64 / self.weight() as u64;
        self.vclock.fetch_add(n * per, Ordering::Relaxed);
    }

    fn vclock(&self) -> u64 {
        self.vclock.load(Ordering::Relaxed)
    }
}

fn clamp(w: u32) -> u32 {
    if w == 0 {
        DEFAULT_WEIGHT
    } else {
        w.min(MAX_WEIGHT)
    }
}

/// The volumes of one process, as the workers see them (lock-free to read).
#[derive(Debug, Default)]
pub struct ShareGroup {
    members: ArcSwap<Vec<Arc<VolumeShare>>>,
    change: Mutex<()>,
    /// Volumes with a busy queue.
    busy: AtomicU32,
    /// Queue workers of the process not asleep in epoll (see [`Self::crowded`]).
    awake: AtomicU32,
}

/// The cores this process may run on (its affinity mask), asked once.
fn cores() -> u32 {
    static CORES: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| {
        std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1)
    })
}

impl ShareGroup {
    /// A worker is awake (it started, or woke from epoll).
    #[inline]
    pub fn wake(&self) {
        self.awake.fetch_add(1, Ordering::Relaxed);
    }

    /// A worker goes to sleep in epoll (or stops).
    #[inline]
    pub fn doze(&self) {
        self.awake.fetch_sub(1, Ordering::Relaxed);
    }

    /// Whether more workers are awake than the process has cores: then a worker with no
    /// work sleeps at once instead of polling for `poll_idle`, because polling would only
    /// take the core from a worker (or a client) that has work. With fewer workers than
    /// cores, polling keeps its latency benefit. One relaxed load.
    #[inline]
    pub fn crowded(&self) -> bool {
        self.awake.load(Ordering::Relaxed) > cores()
    }
    /// A new volume's share in the group (removed with [`Self::leave`]).
    pub fn join(&self, weight: u32) -> Arc<VolumeShare> {
        let s = Arc::new(VolumeShare::new(weight));
        let _g = self.change.lock().unwrap_or_else(|e| e.into_inner());
        let mut v = (**self.members.load()).clone();
        v.push(s.clone());
        self.members.store(Arc::new(v));
        s
    }

    pub fn leave(&self, s: &Arc<VolumeShare>) {
        let _g = self.change.lock().unwrap_or_else(|e| e.into_inner());
        let v: Vec<_> = self
            .members
            .load()
            .iter()
            .filter(|m| !Arc::ptr_eq(m, s))
            .cloned()
            .collect();
        self.members.store(Arc::new(v));
        if s.busy_queues.swap(0, Ordering::AcqRel) > 0 {
            self.busy.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The slowest busy volume's clock other than `me`'s (None: no other volume is busy).
    fn slowest_other(&self, me: &VolumeShare) -> Option<u64> {
        self.members
            .load()
            .iter()
            .filter(|m| !std::ptr::eq(m.as_ref(), me) && m.busy())
            .map(|m| m.vclock())
            .min()
    }

    /// Whether `me` may take requests now. One relaxed load when no other volume is busy.
    #[inline]
    pub fn may_take(&self, me: &VolumeShare) -> bool {
        if self.busy.load(Ordering::Relaxed) <= u32::from(me.busy()) {
            return true;
        }
        match self.slowest_other(me) {
            Some(min) => me.vclock() <= min + WINDOW * UNIT,
            None => true,
        }
    }

    /// A queue of `me` became busy (requests waiting or in flight).
    pub fn queue_busy(&self, me: &VolumeShare) {
        if me.busy_queues.fetch_add(1, Ordering::AcqRel) == 0 {
            // Idle time earns no credit: start no further back than the slowest busy clock.
            if let Some(min) = self.slowest_other(me) {
                me.vclock.fetch_max(min, Ordering::Relaxed);
            }
            self.busy.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// A queue of `me` became idle.
    pub fn queue_idle(&self, me: &VolumeShare) {
        if me.busy_queues.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.busy.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two busy volumes that take whenever allowed, in turns, get requests in the ratio of
    /// their weights; an idle one does not hold anyone back and earns no credit.
    #[test]
    fn busy_volumes_share_by_weight_and_idle_ones_earn_nothing() {
        let g = ShareGroup::default();
        let (a, b, c) = (g.join(100), g.join(300), g.join(100));
        g.queue_busy(&a);
        g.queue_busy(&b);
        let (mut na, mut nb) = (0u64, 0u64);
        for _ in 0..40_000 {
            if g.may_take(&a) {
                a.charge(1);
                na += 1;
            }
            if g.may_take(&b) {
                b.charge(1);
                nb += 1;
            }
        }
        let ratio = nb as f64 / na as f64;
        assert!((2.9..3.1).contains(&ratio), "{na} {nb}");
        // c was idle all along: joining now, it starts at the slowest busy clock.
        g.queue_busy(&c);
        assert!(c.vclock() >= a.vclock().min(b.vclock()));
        assert!(g.may_take(&c));
        // Alone, a volume is never held back, however far ahead.
        g.queue_idle(&b);
        g.queue_idle(&c);
        a.charge(1_000_000);
        assert!(g.may_take(&a));
        g.leave(&b);
        assert_eq!(g.members.load().len(), 2);
    }

    #[test]
    fn weights_are_clamped() {
        let g = ShareGroup::default();
        assert_eq!(g.join(0).weight(), DEFAULT_WEIGHT);
        assert_eq!(g.join(u32::MAX).weight(), MAX_WEIGHT);
    }
}
