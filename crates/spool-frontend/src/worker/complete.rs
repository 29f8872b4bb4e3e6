//! Device completions back to the guest: reaping every device queue, settling each request
//! whose last piece came back (`recovery` decides what a failure makes of it), and
//! completing requests to the used ring in batches (Algorithm 1 steps 10–14, through the
//! [`crate::vring::JournaledQueue`]).
//!
//! Knows nothing of how requests were split or submitted.

use std::sync::Arc;

use smallvec::SmallVec;

use super::QueueWorker;
use crate::request::GuestMemory;
use crate::stats::now_ticks;

impl QueueWorker {
    /// Reaps device completions; completes finished requests to the guest. Returns whether
    /// any device completed anything.
    #[inline]
    pub(super) fn reap(&mut self, mem: &Arc<GuestMemory>) -> bool {
        self.refresh_host(mem);
        let mut finished: SmallVec<[u16; 32]> = SmallVec::new();
        let any = self.reap_devices(&mut finished);
        if finished.is_empty() {
            if self.inflight.submitted() == 0 && !self.guest.retired_maps.is_empty() {
                self.guest.retired_maps.clear();
            }
            return any;
        }
        let now = self.round_now();
        let mut used: SmallVec<[(u16, u32); 32]> = SmallVec::new();
        for head in finished {
            if let Some(inf) = self.inflight.finish(head) {
                let (kind, bytes, taken, ok) = (inf.kind, inf.bytes, inf.taken, inf.ok());
                if let Some(len) = self.settle(head, inf) {
                    used.push((head, len));
                    self.tel.tally.add(kind, bytes as u64, ok, taken, now);
                }
            }
        }
        self.complete_used_batch(mem, &used);
        if self.inflight.submitted() == 0 && !self.guest.retired_maps.is_empty() {
            // Nothing taken under an earlier memory map is in flight any more.
            self.guest.retired_maps.clear();
        }
        any
    }

    /// Takes every device's completions: counts each request's pieces down (a failed piece
    /// marks the request: `note_piece_error`) and lists the requests with none left.
    #[inline]
    fn reap_devices(&mut self, finished: &mut SmallVec<[u16; 32]>) -> bool {
        let mut any = false;
        for d in 0..self.dev.queues.len() {
            let (slots, bufs) = self.inflight.records();
            let volume = &self.volume;
            let io_err_log = &mut self.tel.io_err_log;
            let health = self.dev.layout.devices[d].health();
            let n = self.dev.queues[d].reap(&mut |tag, res| {
                let (head, at) = super::dispatch::tag_piece(tag);
                let Some(Some(inf)) = slots.get_mut(head as usize) else {
                    tracing::error!(tag, "completion for a request that is not in flight");
                    return;
                };
                if res < 0 {
                    let piece = bufs[head as usize]
                        .pieces
                        .get(at)
                        .filter(|p| p.0 as usize == d);
                    super::recovery::note_piece_error(
                        inf,
                        -res,
                        piece,
                        health,
                        io_err_log,
                        volume,
                        head as u64,
                    );
                }
                if inf.pieces.piece_back(res >= 0) {
                    finished.push(head);
                }
            });
            any |= n > 0;
        }
        any
    }

    /// This round's clock, read at most once per round (see `now_ticks`): a request taken and
    /// completed in the same round counts as under a microsecond.
    #[inline]
    pub(super) fn round_now(&mut self) -> u64 {
        if self.tel.now_ticks == 0 {
            self.tel.now_ticks = now_ticks();
        }
        self.tel.now_ticks
    }

    #[inline]
    pub(super) fn complete_used(&mut self, mem: &Arc<GuestMemory>, head: u16, len: u32) {
        self.complete_used_batch(mem, &[(head, len)]);
    }

    /// Completes `(head, used length)` pairs to the guest with one used-index update.
    #[inline]
    pub(super) fn complete_used_batch(&mut self, mem: &Arc<GuestMemory>, done: &[(u16, u32)]) {
        if done.is_empty() {
            return;
        }
        if self.inflight.replay_pending() {
            self.replayed(done);
        }
        // Algorithm 1, steps 10-14, for the batch as a whole.
        self.refresh_host(mem);
        if let Some(log) = mem.dirty_log() {
            for &(head, _) in done {
                self.ring.vq.log_chain(&self.guest.host, head, log);
            }
        }
        if let Some(w) = &self.tel.witness {
            for &(head, _) in done {
                let host = &self.guest.host;
                self.ring
                    .vq
                    .written_by_device(host, head, |gpa, len| w.record(host, gpa, len));
            }
        }
        if let Err(e) = self
            .ring
            .vq
            .complete_batch(&self.guest.host, done, &mut |_| {})
        {
            self.fail_queue(&e.to_string());
        }
        if let Some(log) = mem.dirty_log() {
            let (used, len) = self.ring.vq.used_ring_range();
            log.mark(used, len);
        }
        if let Some(w) = &self.tel.witness {
            let (used, len) = self.ring.vq.used_ring_range();
            w.record(&self.guest.host, used, len);
        }
        self.ring.need_notify = true;
        if !self.tel.served_one {
            self.tel.served_one = true;
            self.tel.clock.note_first_completion();
        }
    }
}
