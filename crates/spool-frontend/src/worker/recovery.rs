//! What failures do to requests (docs/failures.md): a failed piece marks its request
//! (held on a path error, cancelled by us, failed on a media or request error); a settled
//! request is completed, held for a health change (retried up to `request_retries`), or
//! submitted again at once (cancelled). Device health changes abort hung commands and
//! re-dispatch what is held; the timeout sweep reports requests in flight past `io_timeout`;
//! a device reset resubmits every INFLIGHT head; the quiesce shared by reset and stop waits
//! for the devices to let go of our buffers and quarantines commands that never come back.
//!
//! Knows nothing of how requests are split into pieces or how the ring is read.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spool_devices::fanout::PieceAt;
use spool_devices::{DeviceHealth, ErrorClass, ErrorReport, FaultEffect, HealthState, Signal};
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_IOERR;
use vmm_sys_util::epoll::{ControlOperation, EpollEvent};

use super::inflight::{write_status, Inflight};
use super::{QueueWorker, MIN_DRAIN, STOP_DRAIN, TIMEOUT_SWEEPS};
use crate::ratelimit::{LogLimit, Verdict};
use crate::request::{self, GuestMemory, SECTOR};

/// Why a queue stops, which decides what becomes of the requests it still holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum StopKind {
    /// The frontend stops the ring (GET_VRING_BASE, SET_VRING_ENABLE 0, a disconnect, a
    /// reset, spoold shutting down): every request taken ends in the used ring first.
    Frontend,
    /// The queue goes to the next worker process with its connection (an upgrade's
    /// handoff): what is held stays INFLIGHT in the journal for that worker to resubmit.
    Handoff,
}

/// What [`QueueWorker::quiesce`] does with completions while it waits for the devices.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Quiesce {
    /// Complete them to the guest as usual (stopping: what does not complete stays INFLIGHT
    /// in the journal for the next process).
    Complete,
    /// Drop them (a device reset: every INFLIGHT head is resubmitted afterwards).
    Discard,
}

/// Marks `inf` for a piece that failed with `errno` (positive), and reports the failure to
/// the device's health cell unless we cancelled the piece ourselves (the fan-out engine's
/// merge). `piece` is the failed piece (device, offset, length, write) when known.
#[cold]
pub(super) fn note_piece_error(
    inf: &mut Inflight,
    errno: i32,
    piece: Option<&(u16, u64, u64, bool)>,
    health: &DeviceHealth,
    log: &mut LogLimit,
    volume: &str,
    tag: u64,
) {
    let class = ErrorClass::of_errno(errno);
    if let Verdict::Log { suppressed } = log.check() {
        tracing::warn!(volume = %volume, head = tag, errno, class = class.name(), suppressed, "device I/O failed");
    }
    let &(d, offset, len, write) = piece.unwrap_or(&(0, 0, 0, false));
    let at = PieceAt {
        target: u8::try_from(d).unwrap_or(u8::MAX),
        offset,
        len,
        write,
    };
    inf.pieces.piece_failed(errno, at, health);
}

impl QueueWorker {
    /// Decides what becomes of a request whose last piece came back: its used length when it
    /// is to be completed (its status byte written), `None` when it was held for a health
    /// change (a path error, retried up to `request_retries` times, then failed) or queued to
    /// be submitted again at once (cancelled by us).
    #[inline]
    pub(super) fn settle(&mut self, head: u16, inf: Inflight) -> Option<u32> {
        if inf.pieces.path_failed() && inf.ok() {
            let (again, retries) = self.inflight.retry(head, self.request_retries);
            if again {
                self.inflight.hold(head);
                return None;
            }
            tracing::error!(volume = %self.volume, head, retries, "request keeps failing after device resets; failing it");
            write_status(inf.status, VIRTIO_BLK_S_IOERR as u8);
        } else if inf.pieces.cancelled() && inf.ok() {
            // Our own cancellation is no failure of the request: no retry counted. Held
            // requests wait for a health change; these would wait forever if the change they
            // follow has already been seen (a queue pair replaced after a controller reset
            // the worker had already acted on).
            self.inflight.cancel(head);
            return None;
        } else {
            write_status(inf.status, inf.status_code());
        }
        self.inflight.clear_retries(head);
        Some(inf.used_len)
    }

    /// Acts on device health changes: a device that started resetting has its hung commands
    /// aborted (they come back as path errors and are held); when any device leaves the
    /// resetting state, held requests are dispatched again (submitted if their devices are
    /// healthy, failed if isolated, held again if still resetting).
    #[inline]
    pub(super) fn check_health(&mut self, mem: &Arc<GuestMemory>) {
        let mut changed = false;
        for d in 0..self.dev.queues.len() {
            let (state, epoch) = self.dev.layout.devices[d].health().load();
            if epoch != self.dev.seen_epochs[d] {
                self.dev.seen_epochs[d] = epoch;
                tracing::debug!(volume = %self.volume, queue = self.index, device = d, state = state.name(), "device health changed");
                if state == HealthState::Failed {
                    // Isolated: what it still holds will never be served; give it up (a
                    // network device's operations included) so the requests fail cleanly.
                    self.dev.queues[d].abandon();
                } else {
                    self.dev.queues[d].abort();
                }
                changed = true;
            }
        }
        if changed {
            self.health_changed(mem);
        }
    }

    #[cold]
    fn health_changed(&mut self, mem: &Arc<GuestMemory>) {
        self.reap(mem);
        if self.inflight.any_held() && !self.held_all_resetting() {
            let heads = self.inflight.take_held();
            tracing::info!(volume = %self.volume, queue = self.index, count = heads.len(), "dispatching held requests again");
            for h in heads {
                self.resubmit_head(h, mem);
            }
        }
    }

    /// Whether every device is resetting (then nothing held can make progress).
    fn held_all_resetting(&self) -> bool {
        (0..self.dev.queues.len())
            .all(|d| self.dev.layout.devices[d].health().state() == HealthState::Resetting)
    }

    /// Reports requests in flight for longer than the I/O timeout (once each).
    pub(super) fn sweep_timeouts(&mut self) {
        let Some(sweep) = self.sweep.due(self.inflight.submitted() > 0) else {
            return;
        };
        let (layout, devices) = (&self.dev.layout, &self.dev.queues);
        let (volume, index) = (&self.volume, self.index);
        self.inflight.each_submitted(|inf, bufs| {
            if inf.timed_out || sweep.wrapping_sub(inf.sweep) <= TIMEOUT_SWEEPS {
                return;
            }
            inf.timed_out = true;
            for &(d, offset, len, write) in &bufs.pieces {
                if let Some(dev) = layout.devices.get(d as usize) {
                    if devices[d as usize].in_flight() > 0 {
                        tracing::warn!(volume = %volume, queue = index, device = d, offset, "request timed out");
                        dev.health().report(ErrorReport {
                            signal: Signal::Timeout,
                            offset,
                            len,
                            write,
                        });
                    }
                }
            }
        });
    }

    /// Re-parses a journaled request from its descriptor chain and submits it again.
    pub(super) fn resubmit_head(&mut self, head: u16, mem: &Arc<GuestMemory>) {
        self.refresh_host(mem);
        let walker = self.ring.vq.chain(&self.guest.host, head);
        let parsed = request::parse(head, walker, &self.guest.host, &self.limits);
        self.dispatch(parsed, mem);
    }

    /// The device-reset path: drain what the device queues hold without completing it to the
    /// guest, reopen them, and resubmit every request the journal (or, without a journal,
    /// the in-flight table) says is outstanding.
    pub(super) fn reset_devices(&mut self) {
        self.injected_reset_fault();
        let mut waiting = self.inflight.take_held();
        waiting.append(&mut self.inflight.take_cancelled());
        let journaled = self.ring.vq.journaled_inflight();
        self.quiesce(Quiesce::Discard);
        let submitted = self.inflight.take_submitted();
        let heads: Vec<u16> = match journaled {
            Some(heads) => heads,
            None => submitted.iter().map(|&(h, _)| h).chain(waiting).collect(),
        };
        self.reopen_device_queues();
        let mem = self.guest.mem.load().clone();
        tracing::info!(volume = %self.volume, queue = self.index, resubmitted = heads.len(), "device reset: resubmitting in-flight requests");
        for h in heads {
            self.resubmit_head(h, &mem);
        }
    }

    /// A fault injected on the reset path of one of this volume's devices (docs/failures.md,
    /// `reset-panic` and `reset-wedge`): this queue thread panics here with its requests in
    /// flight, or stops here for good, as a bug on this path would.
    fn injected_reset_fault(&self) {
        for d in &self.dev.layout.devices {
            match d.faults().check_reset() {
                Some(FaultEffect::PanicOnReset) => {
                    panic!("fault injection: reset-panic on {}", d.path().display())
                }
                Some(FaultEffect::WedgeOnReset) => {
                    tracing::warn!(volume = %self.volume, queue = self.index, device = %d.path().display(), "fault injection: reset-wedge; this queue thread stops here");
                    loop {
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                }
                _ => {}
            }
        }
    }

    /// Closes every device queue and opens new ones on the current layout (which may have
    /// changed underneath: a replaced device).
    fn reopen_device_queues(&mut self) {
        for q in self.dev.queues.drain(..) {
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                q.completion_fd(),
                EpollEvent::default(),
            );
        }
        self.dev.seen_epochs.clear();
        let cur = self.dev.src.load_full();
        self.limits.capacity_sectors = cur.size / SECTOR;
        self.dev.layout = cur;
        self.follow_qos();
        if let Err(e) = self.open_device_queues() {
            tracing::error!(volume = %self.volume, error = %e, "cannot reopen device queues after reset");
        }
    }

    /// Settles what the queue took before handing it back, as `kind` says: a frontend's
    /// stop completes every request into the used ring (see [`Self::settle_all`]); a
    /// handoff to the next worker (a journaled queue) completes what the devices finish in
    /// the window and leaves the rest INFLIGHT in the journal, which that worker resubmits.
    pub(super) fn drain(&mut self, kind: StopKind) {
        if kind == StopKind::Handoff && self.ring.vq.journaled_inflight().is_some() {
            self.quiesce(Quiesce::Complete);
        } else {
            self.settle_all();
        }
    }

    /// Whether a request taken from the ring has not been completed to the guest: in flight
    /// at a device, held for a resetting device, or cancelled and not submitted again.
    fn unsettled(&self) -> bool {
        self.inflight.unsettled()
    }

    /// A frontend's stop (docs/failures.md, "Stopping a queue"): the base it is answered
    /// with is a promise that every request below it is in the used ring, so nothing taken
    /// may be left behind. Until the drain window ([`STOP_DRAIN`]) closes, runs the rounds'
    /// recovery without taking new requests: completions, health changes (held requests
    /// dispatched again once their device is back), resets, cancelled requests submitted
    /// again, timeouts reported. Past the window, what the devices still hold is aborted
    /// (and quarantined if it does not come back), and every request still not completed is
    /// failed with an I/O error status. The guest sees latency first, an error only past
    /// the window; the journal is left with no INFLIGHT head.
    fn settle_all(&mut self) {
        let deadline = self.drain_deadline();
        while self.unsettled() && Instant::now() < deadline {
            if self.reset.swap(false, Ordering::AcqRel) {
                self.reset_devices();
            }
            let mem = self.guest.mem.load().clone();
            self.check_health(&mem);
            for d in 0..self.dev.queues.len() {
                let _ = self.dev.queues[d].kick();
            }
            let mut progress = self.reap(&mem);
            if self.inflight.any_cancelled() {
                for h in self.inflight.take_cancelled() {
                    self.resubmit_head(h, &mem);
                }
                progress = true;
            }
            self.sweep_timeouts();
            self.notify(&mem);
            if !progress {
                // Held requests wait for the health monitor (milliseconds at best).
                let pause = if self.inflight.submitted() > 0 {
                    50
                } else {
                    500
                };
                std::thread::sleep(Duration::from_micros(pause));
            }
        }
        if !self.unsettled() {
            *self.drain_window.lock().unwrap_or_else(|e| e.into_inner()) = None;
            return;
        }
        // Past the window: abort, give aborted commands MIN_DRAIN to come back, give up or
        // quarantine those that do not; then fail everything not completed.
        if self.inflight.submitted() > 0 {
            self.quiesce_until(Quiesce::Complete, Instant::now() + MIN_DRAIN);
        }
        self.fail_unsettled();
    }

    /// Completes every request still taken with an I/O error status: held and cancelled
    /// heads (re-read from their chains), and requests whose commands a device never gave
    /// back (quarantined: their memory maps stay alive, so their status bytes can be written).
    #[cold]
    fn fail_unsettled(&mut self) {
        let mem = self.guest.mem.load().clone();
        self.refresh_host(&mem);
        let ioerr = VIRTIO_BLK_S_IOERR as u8;
        let mut done: Vec<(u16, u32)> = Vec::new();
        for (h, inf) in self.inflight.take_submitted() {
            write_status(inf.status, ioerr);
            done.push((h, 1));
        }
        let mut taken = self.inflight.take_held();
        taken.append(&mut self.inflight.take_cancelled());
        for head in taken {
            let walker = self.ring.vq.chain(&self.guest.host, head);
            match request::parse(head, walker, &self.guest.host, &self.limits) {
                Ok(req) => write_status(req.status_host, ioerr),
                Err(rej) => {
                    if let Some(a) = rej.status_addr {
                        self.guest.host.write(a.0, &[ioerr]);
                    }
                }
            }
            self.inflight.clear_retries(head);
            done.push((head, 1));
        }
        tracing::error!(volume = %self.volume, queue = self.index, failed = done.len(), window_ms = STOP_DRAIN.as_millis() as u64, "queue stopped while requests were still held or in flight past the drain window: failed them with an I/O error");
        self.complete_used_batch(&mem, &done);
        self.notify(&mem);
    }

    /// Makes the devices let go of our buffers: aborts what they hold (hung commands), waits
    /// up to [`STOP_DRAIN`] for their completions (completing them to the guest or dropping
    /// them, as `mode` says), and quarantines the commands that still did not come back.
    fn quiesce(&mut self, mode: Quiesce) {
        let deadline = self.drain_deadline();
        self.quiesce_until(mode, deadline);
    }

    /// [`Self::quiesce`] with its deadline given.
    fn quiesce_until(&mut self, mode: Quiesce, deadline: Instant) {
        for d in &mut self.dev.queues {
            d.abort();
        }
        while self.quiesce_waiting(mode) && Instant::now() < deadline {
            for d in 0..self.dev.queues.len() {
                let _ = self.dev.queues[d].kick();
            }
            let progress = match mode {
                Quiesce::Complete => {
                    let mem = self.guest.mem.load().clone();
                    let any = self.reap(&mem);
                    self.notify(&mem);
                    any
                }
                Quiesce::Discard => {
                    let mut n = 0;
                    for d in &mut self.dev.queues {
                        n += d.reap(&mut |_, _| {});
                    }
                    n > 0
                }
            };
            if !progress {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        if !self.quiesce_waiting(mode) {
            // Drained in time: the device answers, so the next drain gets a window of its own.
            *self.drain_window.lock().unwrap_or_else(|e| e.into_inner()) = None;
        } else {
            self.abandon_outstanding(mode);
        }
        if mode == Quiesce::Complete && self.inflight.submitted() > 0 {
            tracing::error!(volume = %self.volume, queue = self.index, in_flight = self.inflight.submitted(), "device did not complete requests before stop");
        }
        if mode == Quiesce::Discard || self.inflight.submitted() > 0 {
            self.quarantine_stuck();
        }
    }

    /// Past the drain window: what a device can give up so that it never touches our
    /// buffers again (a network device's operations: a late librbd callback then copies
    /// nothing into guest memory) is given up, and comes back cancelled (completed to the
    /// guest or dropped, as `mode` says); only what cannot be given up is left for
    /// [`Self::quarantine_stuck`]. Without this, a request resubmitted and completed after a
    /// reset could have its buffer, reused by the guest since, overwritten by the first
    /// read's late data.
    #[cold]
    fn abandon_outstanding(&mut self, mode: Quiesce) {
        let mut given_up = 0;
        for d in &mut self.dev.queues {
            if d.in_flight() > 0 {
                given_up += d.abandon();
            }
        }
        if given_up == 0 {
            return;
        }
        tracing::warn!(volume = %self.volume, queue = self.index, operations = given_up, "device operations abandoned after the drain window");
        match mode {
            Quiesce::Complete => {
                let mem = self.guest.mem.load().clone();
                self.reap(&mem);
            }
            Quiesce::Discard => {
                for d in &mut self.dev.queues {
                    d.reap(&mut |_, _| {});
                }
            }
        }
    }

    /// Until when [`Self::quiesce`] waits: [`STOP_DRAIN`] from now, or, when another queue of
    /// this thread opened a drain window that is still open (a device reset reaches every
    /// queue of the volume, and one thread drains its queues one after another), the end of
    /// that window, but at least [`MIN_DRAIN`]: a hung device costs the thread one window,
    /// not one per queue.
    fn drain_deadline(&self) -> Instant {
        let now = Instant::now();
        let mut window = self.drain_window.lock().unwrap_or_else(|e| e.into_inner());
        match *window {
            Some(end) if end > now => end.max(now + MIN_DRAIN),
            _ => *window.insert(now + STOP_DRAIN),
        }
    }

    /// Whether [`Self::quiesce`] still has completions to wait for: requests in flight when
    /// completing them, device commands outstanding when dropping them.
    fn quiesce_waiting(&self, mode: Quiesce) -> bool {
        match mode {
            Quiesce::Complete => self.inflight.submitted() > 0,
            Quiesce::Discard => self.dev.queues.iter().any(|d| d.in_flight() > 0),
        }
    }

    /// Device commands that did not complete even after an abort and a wait may still be
    /// carried out by the device at any time. Their device queues and every guest memory map
    /// they may read or write are kept alive for the life of the process (never unmapped, so
    /// a late completion lands in memory that is still this guest's, never in a reused
    /// address), and the volume is told, so its extents are not handed to anyone else.
    pub(super) fn quarantine_stuck(&mut self) {
        let mut stuck = 0;
        let mut d = 0;
        while d < self.dev.queues.len() {
            let n = self.dev.queues[d].in_flight();
            if n == 0 {
                d += 1;
                continue;
            }
            stuck += n;
            let q = self.dev.queues.remove(d);
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                q.completion_fd(),
                EpollEvent::default(),
            );
            // Deliberately leaked: dropping it would close the queue under the device.
            std::mem::forget(q);
        }
        if stuck == 0 {
            return;
        }
        let current = self.guest.mem.load().clone();
        for m in self
            .guest
            .retired_maps
            .drain(..)
            .chain(self.guest.host_of.clone())
            .chain(std::iter::once(current))
        {
            // Deliberately leaked: keeps the regions mapped (and registered for DMA).
            std::mem::forget(m);
        }
        self.abandoned.fetch_add(stuck as u64, Ordering::AcqRel);
        tracing::error!(volume = %self.volume, queue = self.index, commands = stuck, "device commands never completed: their queue and guest memory are quarantined for the life of the process; the volume's extents stay allocated");
    }
}
