//! Requests over regions current on different legs: leg 1 missed a write of one region and
//! leg 0 a write of the next (each device failed once, before the copy caught up), so no
//! leg holds every acknowledged write of a request across both, and yet each region has a
//! leg that does. Such a request is served, not failed: a read takes each region's part
//! from a leg current there; a write goes to every leg as always and is done when, in each
//! of its regions, a leg still current there took it (tier-2 torture, seed 4).
//!
//! Owns: the mixed read's pieces, the mixed write's rule. Must not know: how the regions
//! came to be so (the bitmap's), the devices' queues (the queue's).

use super::MirrorQueue;
use crate::bitmap::stale;
use crate::op::Op;
use crate::Shared;

/// Whether write `op`, which the legs `failed` failed, is done: in every region of it a
/// leg still current there took it all. The failed legs are marked stale (durably) in each
/// region where one that took it is current, in the same step as that check
/// (`Regions::mark_keeping`): a region is never left with no current leg.
pub(super) fn took(shared: &Shared, op: &Op, failed: u8) -> bool {
    let (first, last) = op.regions;
    let taken = op.issued & !failed;
    let all = (first..=last).fold(true, |all, r| {
        shared.regions.mark_keeping(r, failed, taken).0 & all
    });
    if failed != 0 {
        shared.regions.bitmap.sync(first, last);
    }
    all
}

impl MirrorQueue {
    /// Reads op `i` region by region, each run of regions from one leg readable in all of
    /// them; false (nothing submitted) when some region has no readable leg.
    #[cold]
    pub(super) fn submit_mixed_read(&mut self, i: usize) -> bool {
        let op = self.ops[i].as_ref().expect("live op");
        let (offset, end, (first, last)) = (op.offset, op.offset + op.len, op.regions);
        // (start, end, leg) of each run, in order.
        let mut runs: Vec<(u64, u64, u8)> = Vec::new();
        let mut legs = 0u8;
        for r in first..=last {
            let (r_off, r_len) = self.shared.region_range(r);
            let (a, b) = (r_off.max(offset), (r_off + r_len).min(end));
            let here = self.shared.readable(self.healthy, a, b - a, (r, r));
            if here == 0 {
                return false;
            }
            match runs.last_mut() {
                Some(run) if here & stale(run.2) != 0 => run.1 = b,
                _ => runs.push((a, b, here.trailing_zeros() as u8)),
            }
            legs |= here;
        }
        let op = self.ops[i].as_mut().expect("live op");
        op.issued = legs;
        for (a, b, slot) in runs {
            self.submit_leg_range(i, slot, a, b - a);
        }
        true
    }
}
