//! When a chunk taken out of a thin volume's map may go back to the pool: once no I/O that
//! could have read the old mapping is still on its way to the device.
//!
//! Two phases, as sleepable RCU does it: each queue counts the requests it has on devices
//! per phase. A request enters the current phase before it reads the map and leaves it
//! when its last piece completes. The allocator clears a map entry, moves to the next phase,
//! and waits until no queue has a request left in the old one; only then does the chunk go
//! back to the pool, where another volume may get it. Requests that read the map after the
//! entry was cleared saw the hole.
//!
//! Owns: the phase, the per-queue counters. Must not know: maps, devices, virtio.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

    /// Waits until every request that may have read the map before this call has left the
    /// devices. Called by the allocator thread only (one wait at a time).
    pub(crate) fn wait(&self, stop: &dyn Fn() -> bool) {
        let old = self.phase.fetch_add(1, Ordering::SeqCst);
        let parity = (old & 1) as usize;
        let readers: Vec<Arc<Readers>> = self
            .readers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for r in readers {
            while r.counts[parity].load(Ordering::Acquire) != 0 && !stop() {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_outlasts_requests_that_entered_before_it() {
        use std::sync::atomic::AtomicBool;
        let g = Arc::new(Grace::default());
        let r = g.register();
        let p = g.enter(&r);
        let left = Arc::new(AtomicBool::new(false));
        let (g2, r2, l2) = (g.clone(), r.clone(), left.clone());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            l2.store(true, Ordering::SeqCst);
            g2.leave(&r2, p);
        });
        g.wait(&|| false);
        assert!(
            left.load(Ordering::SeqCst),
            "the wait ended before the request left"
        );
        t.join().unwrap();
        // Nothing on the devices: the next wait ends at once.
        g.wait(&|| false);
    }
}
