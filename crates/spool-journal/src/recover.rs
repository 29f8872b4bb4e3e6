//! Algorithm 2: repairing a journal found on start-up against the ring's used index, and the
//! list of requests to resubmit.
//!
//! Owns: [`Recovery`] (what was found and repaired) and [`RecoveryStep`] (where recovery can be
//! interrupted, for the crash-point tests).
//!
//! Must not know: virtio ring layouts; the caller reads the ring's used index and resubmits.

use std::sync::atomic::{fence, Ordering};

use crate::{pack_aux, unpack_aux, Journal, ReqState, AUX_FINISHED, AUX_START};

/// What Algorithm 2 found and repaired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// Where to continue taking requests from the avail ring.
    pub last_avail: u16,
    /// The used index, synchronised with the ring's.
    pub used_idx: u16,
    /// Heads to resubmit, oldest first (by the avail index they were taken at).
    pub inflight: Vec<u16>,
    /// A START transaction was finished (its request recorded INFLIGHT).
    pub finished_start: bool,
    /// DONE requests rolled back to INFLIGHT (their completion had not reached the ring).
    pub rolled_back: usize,
    /// DONE requests rolled forward to NONE (their completion had reached the ring).
    pub rolled_forward: usize,
}

/// Places Algorithm 2 can be interrupted (for the crash-point tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryStep {
    FinishStartMarked,
    FinishStartState,
    DoneRepaired(u16),
    UsedSynced,
}

impl Journal {
    /// Repairs the journal against the ring's used index and lists the requests to resubmit.
    /// `hook` is called after each repairing store (crash-point tests); it is idempotent to
    /// run recovery again after an interruption.
    pub fn recover(&self, ring_used_idx: u16, hook: &mut dyn FnMut(RecoveryStep)) -> Recovery {
        let mut r = Recovery {
            last_avail: 0,
            used_idx: ring_used_idx,
            inflight: Vec::new(),
            finished_start: false,
            rolled_back: 0,
            rolled_forward: 0,
        };
        // Lines 1-4: finish an interrupted take.
        let (state, last, head) = unpack_aux(self.aux_atomic().load(Ordering::Acquire));
        if state == AUX_START {
            if self.state(head) == ReqState::None {
                self.slot(head).store(
                    ReqState::Inflight as u32 | ((last.wrapping_sub(1) as u32) << 16),
                    Ordering::Relaxed,
                );
                fence(Ordering::Release);
            }
            hook(RecoveryStep::FinishStartMarked);
            self.aux_atomic()
                .store(pack_aux(AUX_FINISHED, last, head), Ordering::Relaxed);
            fence(Ordering::Release);
            hook(RecoveryStep::FinishStartState);
            r.finished_start = true;
        }
        r.last_avail = last;
        // Lines 5-6: DONE requests are rolled forward when their completion reached the ring
        // (journal used index == ring used index), back to INFLIGHT otherwise.
        let jused = self.used_idx();
        let forward = jused == ring_used_idx;
        for h in 0..self.queue_size {
            if self.state(h) == ReqState::Done {
                let s = self.slot(h);
                let v = s.load(Ordering::Relaxed);
                if forward {
                    s.store(0, Ordering::Relaxed);
                    r.rolled_forward += 1;
                } else {
                    s.store((v & !0xff) | ReqState::Inflight as u32, Ordering::Relaxed);
                    r.rolled_back += 1;
                }
                fence(Ordering::Release);
                hook(RecoveryStep::DoneRepaired(h));
            }
        }
        // Line 8: the ring's used index is authoritative.
        self.used_atomic().store(ring_used_idx, Ordering::Relaxed);
        fence(Ordering::Release);
        hook(RecoveryStep::UsedSynced);
        // Line 9: everything INFLIGHT is resubmitted, oldest first.
        let mut inflight: Vec<(u16, u16)> = (0..self.queue_size)
            .filter(|&h| self.state(h) == ReqState::Inflight)
            .map(|h| {
                let taken_at = (self.slot(h).load(Ordering::Relaxed) >> 16) as u16;
                (last.wrapping_sub(taken_at), h)
            })
            .collect();
        inflight.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        r.inflight = inflight.into_iter().map(|(_, h)| h).collect();
        r
    }
}
