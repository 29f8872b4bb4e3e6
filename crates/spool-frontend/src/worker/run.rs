//! The worker thread's loop: a poll round (device resets asked for, layout and memory-map
//! changes, memory faults, device health, taking and submitting requests, reaping, guest
//! notification), and after `poll_idle` without work, sleeping in epoll on the kick, wake
//! and device completion eventfds.
//!
//! Knows nothing of how a request becomes device commands or what failures do to it.

use std::io::Read;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use virtio_queue::Queue;
use vmm_sys_util::epoll::EpollEvent;

use super::recovery::StopKind;
use super::{QueueWorker, MAX_RETIRED_MAPS, TOKEN_DEVICE, TOKEN_GROUP, TOKEN_KICK, TOKEN_WAKE};
use crate::hostmem::HostMap;
use crate::qos::{Cost, VolumeQos};
use crate::request::{self, GuestMemory, Op};
use crate::stats::QueueState;

/// How long a thread whose volume is ahead of its fair share steps aside before looking
/// again (once per poll round of its group, however many of its queues stepped aside).
pub(super) const SHARE_PAUSE: Duration = Duration::from_micros(50);

/// Longest sleep of a throttled worker, so that a lowered or lifted limit, a stop or a
/// reset is seen well within 100 ms.
const MAX_THROTTLED_SLEEP_MS: u64 = 10;

/// What a request costs the volume's buckets: reads and writes their bytes; flush, discard
/// and write-zeroes are writes of no bytes; GET_ID is free.
#[inline]
fn qos_cost(req: &request::Request) -> Option<Cost> {
    match req.op {
        Op::Read => Some(Cost::Read(req.len)),
        Op::Write => Some(Cost::Write(req.len)),
        Op::Flush | Op::Discard(_) | Op::WriteZeroes { .. } => Some(Cost::Write(0)),
        Op::GetId => None,
    }
}

/// How often the scheduler took this thread's core while it could still run (involuntary
/// context switches, `getrusage(RUSAGE_THREAD)`): a thread wanted the core we were polling.
#[derive(Default)]
pub(super) struct Preemptions(i64);

impl Preemptions {
    /// Whether this thread was preempted since the last look. One syscall, looked at only
    /// every 64 idle poll rounds.
    pub(super) fn since_last_look(&mut self) -> bool {
        self.count_since_last_look() != 0
    }

    /// How many times this thread was preempted since the last look.
    pub(super) fn count_since_last_look(&mut self) -> u64 {
        let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage fills the struct we pass, which lives on our stack.
        if unsafe { libc::getrusage(libc::RUSAGE_THREAD, ru.as_mut_ptr()) } != 0 {
            return 0;
        }
        // SAFETY: getrusage succeeded, so it initialised the struct.
        let n = unsafe { ru.assume_init() }.ru_nivcsw;
        n.saturating_sub(std::mem::replace(&mut self.0, n)) as u64
    }
}

impl QueueWorker {
    /// What a queue does once, on its thread, before its first poll round.
    pub(super) fn start(&mut self) {
        tracing::debug!(volume = %self.volume, queue = self.index, "worker started");
        self.set_device_events(false);
        // Completions a previous process put in the used ring just before it died may not
        // have been signalled: one (possibly spurious) interrupt lets the guest see them.
        self.tel
            .stats
            .queue(self.index)
            .set_state(QueueState::Running);
        self.tel
            .stats
            .queue(self.index)
            .set_size(self.ring.vq.size());
        self.follow_priority();
        self.ring.signal_guest();
        self.replay_journal();
    }

    /// Whether the queue was asked to stop.
    #[inline]
    pub(super) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Stopping: drains (bounded by its own timeout, not the watchdog's) and gives the queue
    /// back.
    pub(super) fn finish(mut self) -> Queue {
        self.publish_stats();
        self.tel.stats.queue(self.index).set_state(QueueState::Idle);
        self.tel.stats.queue(self.index).set_size(0);
        let kind = if self.handoff.load(Ordering::Acquire) {
            StopKind::Handoff
        } else {
            StopKind::Frontend
        };
        self.drain(kind);
        self.publish_stats();
        self.set_share_idle(false);
        tracing::debug!(volume = %self.volume, queue = self.index, next_avail = self.ring.vq.next_avail(), "worker stopped");
        self.ring.vq.into_queue()
    }

    /// Whether the worker must keep polling although idle: a polled device (userspace NVMe:
    /// no interrupts) with commands outstanding, or nothing would ever wake it for their
    /// completions.
    #[inline]
    pub(super) fn must_poll(&self) -> bool {
        self.dev
            .queues
            .iter()
            .any(|d| d.polled() && d.in_flight() > 0)
    }

    /// Idle for `poll_idle`: the volume no longer holds the others to its share.
    pub(super) fn note_idle(&mut self) {
        if self.inflight.submitted() == 0 && !self.ring.vq.has_avail(&self.guest.host) {
            self.set_share_idle(true);
        }
    }

    /// Whether the next sleep is the throttled kind (a QoS bucket in debt: the guest's
    /// requests wait in its ring, so no kick is asked for).
    #[inline]
    fn sleeps_throttled(&self) -> bool {
        self.pace.throttled.is_some() && !self.broken
    }

    /// Event-driven mode, first half: asks the guest (unless throttled) and the devices to
    /// wake us and checks once more. Returns false when work turned up (the caller then
    /// calls [`Self::after_sleep`] without sleeping).
    pub(super) fn prepare_sleep(&mut self, mem: &Arc<GuestMemory>) -> bool {
        if !self.sleeps_throttled() {
            match self.ring.vq.enable_notification(mem) {
                Ok(true) => return false,
                Ok(false) => {}
                Err(e) => self.fail_queue(&e.to_string()),
            }
        }
        self.set_device_events(true);
        if self.reap(mem) {
            self.set_device_events(false);
            self.notify(mem);
            return false;
        }
        self.sweep_timeouts();
        self.publish_stats();
        self.tel
            .stats
            .queue(self.index)
            .set_state(QueueState::Asleep);
        true
    }

    /// How long this queue may sleep: until a throttled queue may take again (at most
    /// [`MAX_THROTTLED_SLEEP_MS`], so new limits, stop and reset are seen soon), else
    /// [`Self::sleep_ms`].
    pub(super) fn sleep_budget_ms(&self) -> i32 {
        match self.pace.throttled {
            Some(wait_ns) if !self.broken => {
                let ms = wait_ns.div_ceil(1_000_000).clamp(1, MAX_THROTTLED_SLEEP_MS) as i32;
                ms.min(self.sleep_ms())
            }
            _ => self.sleep_ms(),
        }
    }

    /// Event-driven mode, second half: clears what woke the queue (`n` events from its own
    /// epoll, or a look of its own when the thread slept on another), and goes back to
    /// polling with guest notifications and device events off.
    pub(super) fn after_sleep(&mut self, mem: &Arc<GuestMemory>, events: &mut [EpollEvent]) {
        let n = self.epoll.wait(0, events).unwrap_or_default();
        self.clear_events(&events[..n]);
        self.wake_up(mem);
    }

    /// Back to polling after a sleep whose events are cleared.
    fn wake_up(&mut self, mem: &Arc<GuestMemory>) {
        self.tel
            .stats
            .queue(self.index)
            .set_state(QueueState::Running);
        if !self.broken && !self.sleeps_throttled() {
            let _ = self.ring.vq.disable_notification(mem);
        }
        self.set_device_events(false);
    }

    /// Sleeps on this queue's own epoll alone (a thread serving one queue): [`Self::after_sleep`]
    /// without its second look.
    pub(super) fn sleep_alone(
        &mut self,
        mem: &Arc<GuestMemory>,
        wait_ms: i32,
        events: &mut [EpollEvent],
    ) {
        let n = match self.epoll.wait(wait_ms, events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
            Err(e) => {
                tracing::error!(volume = %self.volume, error = %e, "epoll failed");
                std::thread::sleep(Duration::from_millis(1));
                0
            }
        };
        self.clear_events(&events[..n]);
        self.wake_up(mem);
    }

    /// The descriptor of this queue's epoll (kick, wake and device completions): a thread
    /// serving several queues sleeps on an epoll of these.
    pub(super) fn epoll_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.epoll.as_raw_fd()
    }

    /// The checks at the start of each round; returns the memory map to use for it.
    #[inline]
    pub(super) fn begin_round(&mut self) -> Arc<GuestMemory> {
        if self.reset.swap(false, Ordering::AcqRel) {
            self.reset_devices();
        }
        self.refresh_layout();
        let mem = self.guest.mem.load().clone();
        self.check_memory_faults(&mem);
        self.check_health(&mem);
        self.rounds = self.rounds.wrapping_add(1);
        self.tel.tally.round();
        self.tel.now_ticks = 0;
        if self.rounds.is_multiple_of(1024) {
            self.sweep_timeouts();
            self.publish_stats();
        }
        mem
    }

    /// One poll round: takes and submits what the guest published, kicks the devices, reaps
    /// them, submits cancelled requests again, notifies the guest. Returns whether there was
    /// any work.
    #[inline]
    pub(super) fn poll_round(&mut self, mem: &Arc<GuestMemory>) -> bool {
        let mut work = self.poll_avail(mem);
        for d in 0..self.dev.queues.len() {
            if let Err(e) = self.dev.queues[d].kick() {
                tracing::error!(volume = %self.volume, error = %e, "device submit failed");
            }
        }
        work |= self.reap(mem);
        if self.inflight.any_cancelled() {
            // Through the health gate again: submitted, held (device resetting) or
            // failed (device isolated).
            for h in self.inflight.take_cancelled() {
                self.resubmit_head(h, mem);
            }
            work = true;
        }
        self.notify(mem);
        work
    }

    /// How long sleeping in epoll may last: until the next timeout sweep is due while
    /// requests are in flight, 5 ms while requests are held, else a second.
    fn sleep_ms(&self) -> i32 {
        if self.inflight.submitted() > 0 {
            self.sweep.interval_ms()
        } else if self.inflight.any_held() {
            5
        } else {
            1000
        }
    }

    /// Clears what woke the queue: reads its kick and wake eventfds, acks device events.
    fn clear_events(&mut self, events: &[EpollEvent]) {
        let mut buf = [0u8; 8];
        for ev in events {
            match ev.data() {
                TOKEN_KICK => {
                    let _ = (&self.ring.kick).read(&mut buf);
                }
                TOKEN_WAKE => {
                    let _ = self.wake.read();
                }
                // A queue joined the thread: the group reads its eventfd with the joiners.
                TOKEN_GROUP => {}
                t => {
                    let d = (t - TOKEN_DEVICE) as usize;
                    if let Some(q) = self.dev.queues.get(d) {
                        q.ack_completion_event();
                    }
                }
            }
        }
    }

    fn set_device_events(&mut self, enabled: bool) {
        for d in &mut self.dev.queues {
            d.set_completion_events(enabled);
        }
    }

    /// A fault in guest memory (the frontend truncated its memfd under us) was survived by
    /// the SIGBUS handler, which put zeroes where the region was: this session's memory is
    /// gone, so its queue stops and the session is ended. One relaxed load per round when no
    /// fault happened anywhere in the process.
    #[inline]
    fn check_memory_faults(&mut self, mem: &Arc<GuestMemory>) {
        let now = spool_sigbus::faults();
        if now == self.seen_faults {
            return;
        }
        self.seen_faults = now;
        if mem.faulted() || self.guest.retired_maps.iter().any(|m| m.faulted()) {
            tracing::error!(volume = %self.volume, queue = self.index, "the frontend's memory faulted under the worker (its file was truncated?); ending the session");
            self.fail_queue("guest memory faulted");
            self.fault.raise();
        }
    }

    pub(super) fn fail_queue(&mut self, why: &str) {
        if !self.broken {
            tracing::error!(volume = %self.volume, queue = self.index, error = why, "virtqueue is broken; ignoring it until the guest resets the device");
            self.broken = true;
        }
    }

    /// Takes every available request from the ring and submits it. Returns true if any.
    #[inline]
    fn poll_avail(&mut self, mem: &Arc<GuestMemory>) -> bool {
        if self.broken {
            return false;
        }
        let any = self.take_and_submit(mem);
        // Algorithm 1 step 7, once for the round's batch of takes.
        self.ring.vq.finish_takes(&mut |_| {});
        any
    }

    /// [`Self::poll_avail`] up to step 7. A volume without limits pays one `Option` check
    /// per round for QoS; its loop is the plain one (the parsed request goes straight to
    /// `dispatch`, never through a return value: a `Request` is a few hundred bytes).
    #[inline]
    fn take_and_submit(&mut self, mem: &Arc<GuestMemory>) -> bool {
        self.refresh_host(mem);
        // The latency class is never held back (its clock still runs, holding the others).
        // An empty ring is not asked about: an idle poll round would read every busy
        // volume's clock (cache lines their threads write) for nothing.
        if self.pace.fair_share
            && self.pace.priority != spool_pool::Priority::Latency
            && self.ring.vq.has_avail(&self.guest.host)
            && !self.pace.share_group.may_take(&self.pace.share)
        {
            return self.yield_share();
        }
        self.ring.vq.prefetch(&self.guest.host);
        let taken = match &self.pace.qos {
            Some(q) => self.take_limited(mem, q.clone()),
            None => {
                let mut n = 0;
                while n < self.pace.take_budget {
                    let Some(head) = self.pop_head() else { break };
                    n += 1;
                    let (parsed, newer) = self.parse_head(head, mem);
                    self.dispatch(parsed, newer.as_ref().unwrap_or(mem));
                }
                n
            }
        };
        if taken > 0 {
            self.pace.share.charge(taken);
        }
        if self.pace.throttled.is_some() {
            // Held back by its own limits, the volume cannot use a fair share, so it must not
            // hold the others to its pace (a capped QD128 writer held a QD1 reader to the
            // writer's cap: p99 178 µs against 63 µs uncapped). Taking again after the wait
            // makes it busy again, at the slowest busy clock.
            self.set_share_idle(false);
        } else if taken > 0 {
            self.set_share_busy();
            self.pace.share_deep |= self.inflight.submitted() > 1;
        }
        taken > 0
    }

    /// The volume is ahead of its fair share: requests stay in the guest's ring, and the core
    /// goes to whoever else wants it. Returns false (nothing taken).
    #[cold]
    #[inline(never)]
    fn yield_share(&mut self) -> bool {
        if self.ring.vq.has_avail(&self.guest.host) {
            self.set_share_busy();
            // The thread goes off the core for a moment after this round (`SHARE_PAUSE`, once
            // for all its queues; not a yield, which on a busy core hands it straight back and
            // burns it in system calls): about a window's worth of service elsewhere.
            self.pace.stepped_aside = true;
        }
        false
    }

    /// Whether this queue stepped aside for the fair share since the last look (clears it).
    #[inline]
    pub(super) fn take_stepped_aside(&mut self) -> bool {
        std::mem::take(&mut self.pace.stepped_aside)
    }

    /// Adds this thread's counts to the queue's shared counters (see `stats::Tally`).
    pub(super) fn publish_stats(&mut self) {
        let q = self.tel.stats.queue(self.index);
        self.tel.tally.publish(q);
        q.set_in_flight(self.inflight.submitted() as u64);
    }

    /// Tells the share group that this queue became busy.
    #[inline]
    pub(super) fn set_share_busy(&mut self) {
        if !self.pace.share_busy {
            self.pace.share_busy = true;
            self.pace.share_group.queue_busy(&self.pace.share);
        }
    }

    /// Tells the share group that this queue became idle; `may_linger`: whether the volume
    /// may stay busy for a while if the queue ran deep (`share::LINGER`), as a queue whose
    /// client is off its core does. Not when it stops or its own limits hold it.
    #[inline]
    pub(super) fn set_share_idle(&mut self, may_linger: bool) {
        if self.pace.share_busy {
            self.pace.share_busy = false;
            let deep = std::mem::take(&mut self.pace.share_deep) && may_linger;
            self.pace.share_group.queue_idle(&self.pace.share, deep);
        }
    }

    /// Pops the next head the guest published (Algorithm 1, steps 1-6: journaled INFLIGHT
    /// before we look at it); None when the ring is empty (or broken: the queue fails).
    #[inline(always)]
    fn pop_head(&mut self) -> Option<u16> {
        self.ring.vq.prefetch_ahead(&self.guest.host);
        match self.ring.vq.pop(&self.guest.host, &mut |_| {}) {
            Ok(h) => h,
            Err(e) => {
                self.fail_queue(&e.to_string());
                None
            }
        }
    }

    /// The take loop of a volume with limits: one clock read per round refills the shared
    /// buckets; a request is taken only while no bucket is in debt and charged once parsed.
    /// Stopped by debt, it leaves the rest in the guest's avail ring and records how long
    /// until it may take again.
    #[inline(never)]
    fn take_limited(&mut self, mem: &Arc<GuestMemory>, q: Arc<VolumeQos>) -> u64 {
        q.refill(q.now());
        let mut taken = 0;
        while taken < self.pace.take_budget {
            if !q.may_take() {
                self.tel.stats.queue(self.index).throttled();
                self.pace.throttled = Some(q.wait_ns());
                return taken;
            }
            let Some(head) = self.pop_head() else { break };
            taken += 1;
            let (parsed, newer) = self.parse_head(head, mem);
            if let Ok(req) = &parsed {
                if let Some(cost) = qos_cost(req) {
                    q.charge(cost);
                }
            }
            self.dispatch(parsed, newer.as_ref().unwrap_or(mem));
        }
        self.pace.throttled = None;
        taken
    }

    /// Parses the chain at `head` under `mem`, the map the round began with. A chain naming
    /// memory that map lacks is parsed again under the frontend's newest map, returned with
    /// it: a frontend posts a request only after spoold acknowledged the table holding its
    /// buffers, and spoold publishes a table before acknowledging it, so a request seen in
    /// the ring is always in the newest map, but the round may have loaded the map before
    /// it was published (a libblkio client's first writes, posted right after it added its
    /// buffers' region, were refused so now and then).
    fn parse_head(
        &mut self,
        head: u16,
        mem: &Arc<GuestMemory>,
    ) -> (
        Result<request::Request, request::Rejected>,
        Option<Arc<GuestMemory>>,
    ) {
        let chain = self.ring.vq.chain(&self.guest.host, head);
        let parsed = request::parse(head, chain, &self.guest.host, &self.limits);
        if !matches!(&parsed, Err(r) if r.failure == request::Failure::OutsideMemory) {
            return (parsed, None);
        }
        let newest = self.guest.mem.load().clone();
        if Arc::ptr_eq(&newest, mem) {
            return (parsed, None);
        }
        self.refresh_host(&newest);
        let chain = self.ring.vq.chain(&self.guest.host, head);
        (
            request::parse(head, chain, &self.guest.host, &self.limits),
            Some(newest),
        )
    }

    /// Rebuilds the host map when the frontend's memory table changed.
    #[inline]
    pub(super) fn refresh_host(&mut self, mem: &Arc<GuestMemory>) {
        if !self
            .guest
            .host_of
            .as_ref()
            .is_some_and(|m| Arc::ptr_eq(m, mem))
        {
            self.guest.host = HostMap::new(mem);
            if let Some(old) = self.guest.host_of.replace(mem.clone()) {
                if self.inflight.submitted() > 0 {
                    self.guest.retired_maps.push(old);
                    if self.guest.retired_maps.len() > MAX_RETIRED_MAPS {
                        // Each kept map holds mappings, DMA registrations and SIGBUS watch
                        // slots: a frontend replacing its table over and over while requests
                        // are in flight would exhaust them for every tenant.
                        self.fail_queue("the frontend replaced its memory table too often while requests were in flight");
                        self.fault.raise();
                    }
                }
            }
        }
    }

    /// Tells the guest about completions when it wants to know (once per round at most).
    #[inline]
    pub(super) fn notify(&mut self, mem: &Arc<GuestMemory>) {
        if !self.ring.need_notify {
            return;
        }
        self.ring.need_notify = false;
        self.refresh_host(mem);
        if self.ring.vq.needs_notification(&self.guest.host) {
            self.ring.signal_guest();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Preemptions;

    /// Pins the calling thread to the first CPU it may run on.
    fn pin_first() {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it and
        // CPU_* and sched_setaffinity only read and write that set, on our stack.
        unsafe {
            let mut allowed: libc::cpu_set_t = std::mem::zeroed();
            let size = std::mem::size_of::<libc::cpu_set_t>();
            assert_eq!(libc::sched_getaffinity(0, size, &mut allowed), 0);
            let cpu = (0..libc::CPU_SETSIZE as usize)
                .find(|&c| libc::CPU_ISSET(c, &allowed))
                .expect("some CPU");
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            assert_eq!(libc::sched_setaffinity(0, size, &set), 0);
        }
    }

    /// A polling thread sharing its core with another runnable thread is told so.
    #[test]
    fn preemption_is_seen_when_another_thread_wants_the_core() {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let rival = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                pin_first();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        pin_first();
        let mut p = Preemptions::default();
        p.since_last_look();
        let t = std::time::Instant::now();
        let mut seen = false;
        while !seen && t.elapsed() < std::time::Duration::from_secs(5) {
            std::hint::spin_loop();
            seen = p.since_last_look();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        rival.join().unwrap();
        assert!(
            seen,
            "two spinning threads on one core: the scheduler must switch them"
        );
    }
}
