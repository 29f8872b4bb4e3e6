//! A mirror queue's flushes: sent to every device of a usable leg, and what a leg that
//! missed one (its device failed the flush, or was not healthy to be sent it) then is.
//!
//! Owns: submitting a flush, settling its result. Must not know: the data path's writes
//! (the regions they left unflushed are `Regions`').

use super::{busy, MirrorQueue, FLUSH_SLOT, SLOT_BITS};
use crate::op::Op;
use spool_devices::DeviceIo;

impl MirrorQueue {
    /// A flush the devices `devices` (a bit per index) failed and others took: 0 once, in
    /// each region, the legs whose part of it lies on those devices are stale wherever
    /// another is current, else a path error. A leg over several devices missed the flush
    /// only where it lies on a device that missed it: elsewhere its device took it (tier-2
    /// torture: a grown leg's new device failed a flush, and the leg was counted as missing
    /// it in regions that only it held, on its other device, that had taken it).
    fn missed_flush(&self, devices: u64, flush: u32) -> i32 {
        let sh = &self.shared;
        let all = sh.all_slots();
        let missed_in = |r: usize| {
            let (off, len) = sh.region_range(r);
            all & sh.usable(u64::MAX, off, len) & !sh.usable(!devices, off, len)
        };
        let legs = (sh.spec.legs.iter())
            .filter(|l| {
                l.pieces
                    .iter()
                    .any(|p| p.device < 64 && devices & (1u64 << p.device) != 0)
            })
            .fold(0, |m, l| m | crate::bitmap::stale(l.slot));
        match sh.regions.missed_flush(all, legs, flush, &missed_in) {
            true => 0,
            false => -libc::EIO,
        }
    }

    pub(super) fn submit_flush(&mut self, i: usize) -> bool {
        // A leg's device not healthy now is skipped: it missed the flush (see `flush_failed`).
        let (mut devices, mut skipped) = (Vec::new(), 0u64);
        let pieces = self.shared.spec.legs.iter().flat_map(|l| &l.pieces);
        for p in pieces.filter(|p| p.device != crate::MISSING) {
            if self.healthy & (1 << p.device) == 0 {
                skipped |= 1u64.checked_shl(p.device as u32).unwrap_or(0);
            } else if !devices.contains(&p.device) {
                devices.push(p.device);
            }
        }
        let Some(op) = self.ops[i].as_mut() else {
            return false;
        };
        op.flush = self.shared.regions.flush_submitted();
        op.flush_failed = skipped;
        for &d in &devices {
            op.pieces.issue();
            let tag = ((i as u64) << SLOT_BITS) | FLUSH_SLOT as u64;
            // SAFETY: a flush carries no buffers.
            unsafe { self.queues[d].submit(DeviceIo::Flush, tag) };
            busy(&mut self.outstanding, &mut self.progress, d);
        }
        !devices.is_empty()
    }

    /// The result of flush `op`, whose devices `failed` (target bits) failed it.
    pub(super) fn settle_flush(&self, op: &Op, failed: u8) -> i32 {
        if failed == 0 && op.flush_failed == 0 {
            (self.shared.regions).flushed(self.shared.all_slots(), op.flush);
            return 0;
        }
        // Durable on one leg is durable: the failed devices were reported (their monitor
        // resets or isolates them), and the legs on them are stale wherever another leg is
        // current (they may lose what the flush did not cover).
        match op.pieces.any_succeeded() {
            true => self.missed_flush(op.flush_failed, op.flush),
            false => op.pieces.first_error(),
        }
    }
}
