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
//! "Busy" means a queue of the volume has requests in flight or waiting in its ring, or the
//! volume lingers: a volume whose queues ran deep (more than one request in flight) and then
//! drained is presumed to come back, and stays busy for [`LINGER`]. Its client was most
//! likely only off its core (a client that shares cores with others drains its queues every
//! time the scheduler takes it off); treating that as idleness let the others run free and
//! made it forfeit its lag on return, so weights did not hold (1:2:4 came out 71% off with
//! spoold on one core and the clients on the other). A client at QD1 does not linger: its
//! ring is empty between any two requests, and holding the others to its pace would waste
//! what it leaves.
//!
//! Only where cores are shared. A volume ahead of another gives way only when its own
//! thread lost its core to other threads recently ([`CONTENDED_HOLD`]; each thread looks at
//! its own preemptions and run-queue wait and reports it with
//! [`VolumeShare::set_contended`]): then the time it gives up can go to the others. (Asking
//! the slower volume's thread too missed, now and then, a heavy volume that waited less,
//! and 1:2:4 came out up to 14.5% off on one shared core.) With a core per
//! busy volume thread nobody waits for a core, and holding a volume back would only cost it
//! (on a 16-core host, 8 volumes lost 15% of their throughput and saw 4-5× the p99 for
//! nothing: issue 33). A shared device that saturates is not seen: its volumes share by the
//! device's own queueing.
//!
//! Owns: [`ShareGroup`] (the volumes of one process) and [`VolumeShare`] (one volume's
//! weight, clock, busy queues and when its thread last lost its core). Must not know: rings,
//! devices.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

/// The weight of a volume that names none.
pub const DEFAULT_WEIGHT: u32 = 100;
/// Largest weight (and the smallest is 1).
pub const MAX_WEIGHT: u32 = 10_000;
/// Virtual time of one request at the default weight.
const UNIT: u64 = 1 << 16;
/// How many requests (at the default weight) a volume may run ahead of the slowest busy one:
/// enough to keep a queue's pipeline full between checks, small against a second of service.
pub const WINDOW: u64 = 256;
/// How long a volume whose queues ran deep stays busy after they drained (a few of the
/// scheduler's time slices: about how long a client waits for a core on a busy machine).
pub const LINGER: Duration = Duration::from_millis(4);
/// The `state` bit of a lingering volume (the rest of `state` counts its busy queues).
const LINGERING: u32 = 1 << 31;
/// How long a volume counts as sharing a core after its thread last found it shared (its
/// thread clears the report after this long of windows without contention).
pub const CONTENDED_HOLD: Duration = Duration::from_millis(250);

/// One volume's share.
#[derive(Debug)]
pub struct VolumeShare {
    weight: AtomicU32,
    vclock: AtomicU64,
    /// Busy queues, plus [`LINGERING`]: one word, so that a queue becoming busy and the
    /// linger ending cannot both count the volume in or out of the group's `busy`.
    state: AtomicU32,
    /// When it began to linger (ns since [`epoch`]).
    idle_at: AtomicU64,
    /// Its thread found its core shared within [`CONTENDED_HOLD`].
    contended: AtomicBool,
}

impl VolumeShare {
    fn new(weight: u32) -> Self {
        VolumeShare {
            weight: AtomicU32::new(clamp(weight)),
            vclock: AtomicU64::new(0),
            state: AtomicU32::new(0),
            idle_at: AtomicU64::new(0),
            // Presumed shared until its thread has looked (a start is no time to run free).
            contended: AtomicBool::new(true),
        }
    }

    /// What its thread found: its core shared (preempted again and again, or waiting to
    /// run) within [`CONTENDED_HOLD`], or not.
    pub fn set_contended(&self, contended: bool) {
        if self.contended.load(Ordering::Relaxed) != contended {
            self.contended.store(contended, Ordering::Relaxed);
        }
    }

    fn contended(&self) -> bool {
        self.contended.load(Ordering::Relaxed)
    }

    pub fn weight(&self) -> u32 {
        self.weight.load(Ordering::Relaxed)
    }

    /// Takes effect for the next request taken.
    pub fn set_weight(&self, w: u32) {
        self.weight.store(clamp(w), Ordering::Relaxed);
    }

    fn busy(&self) -> bool {
        self.state.load(Ordering::Relaxed) != 0
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

/// Nanoseconds since the first call (a process-wide monotonic clock).
fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
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
    /// Volumes with a busy queue (or lingering).
    busy: AtomicU32,
    /// The latest clock of a volume that went idle: where a volume that becomes busy while
    /// no other is starts, so a clock left behind while others ran alone earns no credit
    /// (a writer starting at 0 next to a reader that had run alone held the reader back
    /// until it had caught up millions of requests).
    floor: AtomicU64,
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
        if s.state.swap(0, Ordering::AcqRel) != 0 {
            self.busy.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The slowest busy volume's clock other than `me`'s (None: no other volume is busy).
    /// Ends the linger of volumes whose [`LINGER`] is over.
    fn slowest_other(&self, me: &VolumeShare) -> Option<u64> {
        let mut now = None;
        self.members
            .load()
            .iter()
            .filter(|m| !std::ptr::eq(m.as_ref(), me) && self.still_busy(m, &mut now))
            .map(|m| m.vclock())
            .min()
    }

    /// Whether `m` is busy, ending its linger if it is over (`now` is read once, and only
    /// when some volume lingers).
    fn still_busy(&self, m: &VolumeShare, now: &mut Option<u64>) -> bool {
        match m.state.load(Ordering::Acquire) {
            0 => false,
            LINGERING => {
                let t = *now.get_or_insert_with(now_ns);
                let since = m.idle_at.load(Ordering::Relaxed);
                if t.saturating_sub(since) < LINGER.as_nanos() as u64 {
                    return true;
                }
                if m.state
                    .compare_exchange(LINGERING, 0, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    self.floor.fetch_max(m.vclock(), Ordering::Relaxed);
                    self.busy.fetch_sub(1, Ordering::AcqRel);
                    return false;
                }
                // A queue of it became busy meanwhile.
                true
            }
            _ => true,
        }
    }

    /// Whether `me` may take requests now: yes unless its thread shares its core and it is
    /// more than a window ahead of a busy volume (see the module doc). One relaxed load when
    /// no other volume is busy, two when its own thread has a core of its own.
    #[inline]
    pub fn may_take(&self, me: &VolumeShare) -> bool {
        if self.busy.load(Ordering::Relaxed) <= u32::from(me.busy()) {
            return true;
        }
        if !me.contended() {
            return true;
        }
        match self.slowest_other(me) {
            Some(min) => me.vclock() <= min + WINDOW * UNIT,
            None => true,
        }
    }

    /// A queue of `me` became busy (requests waiting or in flight).
    pub fn queue_busy(&self, me: &VolumeShare) {
        let before = me
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                Some((s & !LINGERING) + 1)
            })
            .unwrap_or_else(|s| s);
        if before == 0 {
            // Idle time earns no credit: start no further back than the slowest busy clock,
            // or where the last volume to go idle left off.
            let start = self
                .slowest_other(me)
                .unwrap_or_else(|| self.floor.load(Ordering::Relaxed));
            me.vclock.fetch_max(start, Ordering::Relaxed);
            self.busy.fetch_add(1, Ordering::AcqRel);
        }
        // From lingering: still counted, and its clock kept (the others were held to it).
    }

    /// A queue of `me` became idle; `deep`: it had more than one request in flight at some
    /// point since it became busy (the last such queue makes the volume linger).
    pub fn queue_idle(&self, me: &VolumeShare, deep: bool) {
        if deep {
            // Before the state says so: whoever sees it lingering sees when it began.
            me.idle_at.store(now_ns(), Ordering::Relaxed);
        }
        let before = me
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                Some(if s == 1 && deep {
                    LINGERING
                } else {
                    s.saturating_sub(1)
                })
            })
            .unwrap_or_else(|s| s);
        if before == 1 && !deep {
            self.floor.fetch_max(me.vclock(), Ordering::Relaxed);
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
        share_cores(&[&a, &b, &c]);
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
        g.queue_idle(&b, false);
        g.queue_idle(&c, false);
        a.charge(1_000_000);
        assert!(g.may_take(&a));
        g.leave(&b);
        assert_eq!(g.members.load().len(), 2);
    }

    /// A volume whose queues ran deep and drained stays busy for `LINGER` (its client was
    /// most likely off its core): the others stay within a window of its clock, and it keeps
    /// its place when it comes back. After `LINGER` it is idle; a QD1 queue is idle at once.
    #[test]
    fn a_deep_volume_that_drains_lingers_then_goes_idle() {
        let g = ShareGroup::default();
        let (a, b) = (g.join(100), g.join(100));
        share_cores(&[&a, &b]);
        g.queue_busy(&a);
        g.queue_busy(&b);
        g.queue_idle(&b, true);
        a.charge(WINDOW + 1);
        assert!(!g.may_take(&a), "a lingering volume holds the others");
        g.queue_busy(&b);
        assert!(
            b.vclock() < a.vclock(),
            "back within LINGER, it keeps its place"
        );
        assert!(g.may_take(&b));
        assert_eq!(g.busy.load(Ordering::Relaxed), 2);
        g.queue_idle(&b, true);
        std::thread::sleep(LINGER + Duration::from_millis(1));
        assert!(g.may_take(&a), "the linger is over");
        assert_eq!(g.busy.load(Ordering::Relaxed), 1);
        g.queue_busy(&b);
        assert!(
            b.vclock() >= a.vclock(),
            "back after LINGER, it earned nothing"
        );
        g.queue_idle(&b, false);
        assert_eq!(
            g.busy.load(Ordering::Relaxed),
            1,
            "a shallow queue does not linger"
        );
        a.charge(10 * WINDOW);
        assert!(g.may_take(&a));
    }

    /// A volume that becomes busy while no other is starts where the last volume to go idle
    /// left off: a clock left behind earns no credit against a volume that ran alone.
    #[test]
    fn a_volume_starting_alone_starts_where_the_last_one_left_off() {
        let g = ShareGroup::default();
        let (v, w) = (g.join(100), g.join(100));
        g.queue_busy(&v);
        v.charge(1_000_000);
        g.queue_idle(&v, false);
        g.queue_busy(&w);
        assert!(w.vclock() >= v.vclock());
        g.queue_busy(&v);
        assert!(g.may_take(&v), "v is not held back by w's old clock");
    }

    /// What the queue threads of these volumes report when they take turns at a core.
    fn share_cores(v: &[&Arc<VolumeShare>]) {
        for s in v {
            s.set_contended(true);
        }
    }

    /// A volume whose thread has a core of its own is never held back, however far ahead
    /// (giving way would only cost it); once its thread reports a shared core it waits for
    /// the slower one, and when the report ends it runs free again.
    #[test]
    fn only_volumes_that_share_cores_are_held_back() {
        let g = ShareGroup::default();
        let (a, b) = (g.join(100), g.join(100));
        g.queue_busy(&a);
        g.queue_busy(&b);
        a.charge(10 * WINDOW);
        assert!(!g.may_take(&a), "presumed shared until its thread looked");
        a.set_contended(false);
        b.set_contended(false);
        assert!(g.may_take(&a), "no shared core: no holding back");
        b.set_contended(true);
        assert!(g.may_take(&a), "a's own core is not shared");
        a.set_contended(true);
        assert!(!g.may_take(&a), "a's core is shared: a waits for b");
        assert!(g.may_take(&b));
        a.set_contended(false);
        assert!(g.may_take(&a), "a's thread has a core of its own again");
    }

    #[test]
    fn weights_are_clamped() {
        let g = ShareGroup::default();
        assert_eq!(g.join(0).weight(), DEFAULT_WEIGHT);
        assert_eq!(g.join(u32::MAX).weight(), MAX_WEIGHT);
    }
}
