//! When a chunk taken out of a thin volume's map may go back to the pool: once no I/O that
//! could have read the old mapping is still on its way to the device.
//!
//! Two phases, as sleepable RCU does it: each queue counts the requests it has on devices
//! per phase. A request enters the current phase before it reads the map and leaves it
//! when its last piece completes. The allocator clears map entries, moves to the next phase
//! (`flip`), and gives their chunks back to the pool, where another volume may get them,
//! only once no queue has a request left in the old phase (`drained`, polled: never waited
//! on). Requests that read the map after the entries were cleared saw the holes.
//!
//! Owns: the phase, the per-queue counters. Must not know: maps, devices, virtio.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One queue's requests on devices, per phase parity.
#[derive(Debug, Default)]
pub(crate) struct Readers {
    counts: [AtomicU64; 2],
}

/// The phase and every queue's counters.
#[derive(Debug, Default)]
pub(crate) struct Grace {
    phase: AtomicU64,
    readers: Mutex<Vec<Arc<Readers>>>,
}

impl Grace {
    /// A queue's counters, registered until the queue drops them.
    pub(crate) fn register(&self) -> Arc<Readers> {
        let r = Arc::new(Readers::default());
        let mut all = self.readers.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|r| Arc::strong_count(r) > 1);
        all.push(r.clone());
        r
    }

    /// Enters the current phase (before reading the map); returns it for [`Grace::leave`].
    #[inline]
    pub(crate) fn enter(&self, r: &Readers) -> u64 {
        loop {
            let p = self.phase.load(Ordering::SeqCst);
            r.counts[(p & 1) as usize].fetch_add(1, Ordering::SeqCst);
            // A phase change between the load and the count would let the allocator miss
            // us: count again in the new phase.
            if self.phase.load(Ordering::SeqCst) == p {
                return p;
            }
            r.counts[(p & 1) as usize].fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Leaves phase `p` (the request's last piece completed).
    #[inline]
    pub(crate) fn leave(&self, r: &Readers, p: u64) {
        r.counts[(p & 1) as usize].fetch_sub(1, Ordering::Release);
    }

    /// Starts a grace period: from now on requests count in the next phase. Returns the
    /// phase that must drain ([`Grace::drained`]) before what was unmapped before this call
    /// may be reused. One grace period at a time: the allocator flips again only once the
    /// previous one drained (the two parities would mix otherwise).
    pub(crate) fn flip(&self) -> u64 {
        self.phase.fetch_add(1, Ordering::SeqCst)
    }

    /// Whether no request of phase `old` is left on a device. SeqCst, as the readers'
    /// increments are: a reader that counted itself before the flip is seen here, and one
    /// that counted itself after it sees the new phase (and the cleared map entries).
    pub(crate) fn drained(&self, old: u64) -> bool {
        let parity = (old & 1) as usize;
        let readers = self.readers.lock().unwrap_or_else(|p| p.into_inner());
        readers
            .iter()
            .all(|r| r.counts[parity].load(Ordering::SeqCst) == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grace_period_outlasts_requests_that_entered_before_it_only() {
        let g = Grace::default();
        let r = g.register();
        let p = g.enter(&r);
        let old = g.flip();
        assert!(!g.drained(old), "a request of the old phase is still out");
        // A request entering after the flip counts in the new phase: not waited for.
        let p2 = g.enter(&r);
        g.leave(&r, p);
        assert!(g.drained(old));
        let old2 = g.flip();
        assert!(!g.drained(old2));
        g.leave(&r, p2);
        assert!(g.drained(old2));
    }
}
