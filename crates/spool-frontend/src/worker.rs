//! One polling I/O worker per virtqueue.
//!
//! The worker thread owns its [`Queue`], its in-flight table and one [`DeviceQueue`] per device
//! the volume lives on: nothing on the data path is shared or locked. It polls the avail ring
//! and the device completions; after `poll_idle` without work it re-enables guest
//! notifications and sleeps in epoll on the kick eventfd, the device completion eventfds and
//! its own wake eventfd (event-driven mode). All per-queue state lives in [`QueueWorker`], the
//! seam where the journal hooks in.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arc_swap::Cache;
use arc_swap::{ArcSwap, ArcSwapOption};
use smallvec::SmallVec;
use spool_devices::{DeviceIo, DeviceQueue, ErrorClass, ErrorReport, HealthState, IoVec, Signal};
use spool_pool::VolumeLayout;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::hostmem::HostMap;
use crate::ratelimit::{self, LogLimit, Verdict};
use crate::request::{self, GuestMemory, IoVecs, Limits, Op, Request, ID_LEN, SECTOR};
use crate::vring::JournaledQueue;
use spool_journal::Journal;
use spool_journal::ReplayRecord;

/// What a worker needs to start.
pub struct WorkerSpec {
    pub index: u16,
    pub queue: Queue,
    /// The queue's journal (None: Spool-NoJ, for the overhead benchmark only).
    pub journal: Option<Journal>,
    /// Heads the journal says were taken and never completed: resubmitted first.
    pub resubmit: Vec<u16>,
    pub mem: Arc<ArcSwap<GuestMemory>>,
    pub kick: File,
    pub call: Arc<ArcSwapOption<File>>,
    pub layout: Arc<ArcSwap<VolumeLayout>>,
    pub limits: Limits,
    pub serial: [u8; ID_LEN],
    pub poll_idle: Duration,
    pub io_timeout: Duration,
    pub request_retries: u32,
    pub volume: String,
    /// Raised when the frontend's memory faulted under this worker: the session must end.
    pub fault: Arc<crate::SessionFault>,
    /// Counts device commands this worker gave up on and quarantined (see `quarantine_stuck`).
    pub abandoned: Arc<AtomicU64>,
    /// The replay record of `resubmit` (see `spool_journal::ReplayRecord`).
    pub replay: Option<ReplayRecord>,
    /// Heads that crashed the previous process while it replayed them: failed, not replayed.
    pub poison: Vec<u16>,
}

/// A replay in progress: the journal's record and its crash mark's registration, withdrawn
/// before the record (and the mark's memory) goes away.
struct ReplayGuard {
    slot: Option<usize>,
    _record: ReplayRecord,
}

impl ReplayGuard {
    fn new(record: ReplayRecord) -> Self {
        // SAFETY: the mark lives in the record's mapping, which `_record` keeps until this
        // guard is dropped, after `Drop` withdrew the registration.
        let slot = unsafe { spool_sigbus::mark_on_crash(record.crash_mark()) };
        ReplayGuard {
            slot,
            _record: record,
        }
    }
}

impl Drop for ReplayGuard {
    fn drop(&mut self) {
        if let Some(s) = self.slot.take() {
            spool_sigbus::unmark_on_crash(s);
        }
    }
}

/// Handle to a running worker.
pub struct WorkerHandle {
    stop: Arc<AtomicBool>,
    reset: Arc<AtomicBool>,
    wake: EventFd,
    thread: Option<JoinHandle<Queue>>,
}

impl WorkerHandle {
    /// Starts a worker thread.
    pub fn spawn(spec: WorkerSpec) -> std::io::Result<WorkerHandle> {
        let stop = Arc::new(AtomicBool::new(false));
        let reset = Arc::new(AtomicBool::new(false));
        let wake = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?;
        let worker = QueueWorker::new(spec, stop.clone(), reset.clone(), wake.try_clone()?)?;
        let name = format!("q{}-{}", worker.index, worker.volume);
        let thread = std::thread::Builder::new()
            .name(name.chars().take(15).collect())
            .spawn(move || worker.run())?;
        Ok(WorkerHandle {
            stop,
            reset,
            wake,
            thread: Some(thread),
        })
    }

    /// The device-reset hook: the worker abandons what its device queues hold (waiting until
    /// the device no longer touches the buffers), reopens them, and resubmits every request
    /// the journal records as INFLIGHT. The guest sees latency, not errors.
    pub fn device_reset(&self) {
        self.reset.store(true, Ordering::Release);
        let _ = self.wake.write(1);
    }

    /// Stops the worker after the requests it holds have completed (bounded wait), and gives
    /// the queue back (its `next_avail` is what GET_VRING_BASE reports).
    pub fn stop(mut self) -> Option<Queue> {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        self.thread.take().and_then(|t| t.join().ok())
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.store(true, Ordering::Release);
            let _ = self.wake.write(1);
            let _ = t.join();
        }
    }
}

/// A request between submission to the devices and completion to the guest.
struct Inflight {
    /// Host address of the status byte (in the mapping the request was parsed in, which the
    /// worker keeps alive until the request completes).
    status: usize,
    used_len: u32,
    pending: u32,
    status_code: u8,
    /// A piece failed with a path error: hold the request for resubmission, do not complete it.
    held: bool,
    /// A piece was cancelled by us (a queue pair aborted or lost to a controller reset):
    /// submit the request again at once, nothing is wrong with it or the device.
    cancelled: bool,
    /// Already reported as timed out.
    timed_out: bool,
    /// The timeout sweep during which it was submitted.
    sweep: u32,
}

/// What a slot keeps beyond [`Inflight`], in storage reused from request to request (so a
/// request is neither allocated nor moved as a whole on the path).
///
/// Holds raw iovec pointers into guest memory, so it is not `Send` by default.
#[derive(Default)]
struct SlotBufs {
    /// Device pieces (device index, device offset, length, write), for error reports.
    pieces: SmallVec<[(u16, u64, u64, bool); 2]>,
    /// The iovec array of a read or write submitted as one piece (`submit_one`, the common
    /// case: the request's own array, moved in whole).
    iov: IoVecs,
    /// Per-device-piece iovec arrays of any other request (`submit`). The device holds raw
    /// pointers into `iov` or `parts`, so neither is touched until the slot's request has
    /// completed (`slot_bufs` never grows).
    parts: SmallVec<[IoVecs; 1]>,
}

// SAFETY: the iovec pointers in `iov` and `parts` point into a guest mapping the worker keeps
// alive while the slot's request is in flight (`host_of`, then `retired_maps`); only the one
// worker thread that owns the slot ever dereferences them (through the device queue), and the
// whole worker moves to its thread as one. Guest memory behind them is shared, never `&`'d.
unsafe impl Send for SlotBufs {}

/// Writes a request's status byte.
/// Logs a failed device I/O, rate-limited (a guest can make every request fail).
#[cold]
#[inline(never)]
fn note_io_error(log: &mut LogLimit, volume: &str, tag: u64, errno: i32, class: ErrorClass) {
    if let Verdict::Log { suppressed } = log.check() {
        tracing::warn!(volume = %volume, head = tag, errno, class = class.name(), suppressed, "device I/O failed");
    }
}

#[inline]
fn write_status(at: usize, status: u8) {
    if at != 0 {
        // SAFETY: `at` is a request's `status_host`, one byte `HostMap::host` found in a
        // region when it was parsed; that map stays `host_of` or in `retired_maps` until the
        // request completes (`refresh_host`). Written as a value (the guest may read it).
        unsafe { std::ptr::write_volatile(at as *mut u8, status) };
    }
}

const TOKEN_KICK: u64 = 0;
const TOKEN_WAKE: u64 = 1;
const TOKEN_DEVICE: u64 = 2;
/// Most earlier memory maps a worker keeps for requests still in flight under them (QEMU
/// changes its table a few times at boot and on memory hot-plug, with little I/O in flight).
const MAX_RETIRED_MAPS: usize = 16;
/// How long the drain on stop waits for device completions before giving up.
const STOP_DRAIN: Duration = Duration::from_secs(5);

/// The per-queue state: the virtqueue, its in-flight table, and its device queues.
pub struct QueueWorker {
    index: u16,
    volume: String,
    vq: JournaledQueue,
    /// Host addresses of `host_of`, the guest memory map the worker last loaded.
    host: HostMap,
    host_of: Option<Arc<GuestMemory>>,
    /// Earlier memory maps, kept mapped until the requests taken under them have completed
    /// (devices and status bytes point into them).
    retired_maps: Vec<Arc<GuestMemory>>,
    resubmit: Vec<u16>,
    reset: Arc<AtomicBool>,
    /// The frontend's current memory map (one atomic load to check per round).
    mem: Cache<Arc<ArcSwap<GuestMemory>>, Arc<GuestMemory>>,
    kick: File,
    call: Arc<ArcSwapOption<File>>,
    layout_src: Arc<ArcSwap<VolumeLayout>>,
    /// `layout_src` as checked every round (one atomic load).
    layout_now: Cache<Arc<ArcSwap<VolumeLayout>>, Arc<VolumeLayout>>,
    layout: Arc<VolumeLayout>,
    devices: Vec<Box<dyn DeviceQueue>>,
    slots: Vec<Option<Inflight>>,
    /// Per slot: its pieces and iovec arrays (see [`SlotBufs`]).
    slot_bufs: Vec<SlotBufs>,
    in_flight: usize,
    limits: Limits,
    serial: [u8; ID_LEN],
    poll_idle: Duration,
    stop: Arc<AtomicBool>,
    wake: EventFd,
    epoll: Epoll,
    need_notify: bool,
    broken: bool,
    /// Whether this worker completed a request yet (the restart report's "first I/O").
    served_one: bool,
    /// Requests held while a device resets (taken, journaled INFLIGHT, not submitted).
    held: Vec<u16>,
    /// Requests whose device commands we cancelled, to submit again on the next round.
    cancelled: Vec<u16>,
    /// The health epoch of each device this worker last acted on.
    seen_epochs: Vec<u64>,
    /// Resubmissions after path errors, per head.
    retries: Vec<u8>,
    request_retries: u32,
    io_timeout: Duration,
    /// Timeout sweeps: a request in flight across `TIMEOUT_SWEEPS` of them has timed out.
    sweep: u32,
    last_sweep: Instant,
    rounds: u32,
    /// Guest-triggered warnings, rate-limited per worker (a guest must not flood the log).
    dup_log: LogLimit,
    io_err_log: LogLimit,
    /// `spool_sigbus::faults()` when last checked, and where to report a fault of ours.
    seen_faults: u64,
    fault: Arc<crate::SessionFault>,
    abandoned: Arc<AtomicU64>,
    /// Heads resubmitted from the journal and not completed yet (`replaying`, by head), and
    /// the record that says so should this process crash before they are.
    replay: Option<ReplayGuard>,
    replaying: Vec<bool>,
    replay_left: usize,
    poison: Vec<u16>,
}

/// A sweep runs every `io_timeout / TIMEOUT_SWEEPS`; a request seen in flight by more than
/// `TIMEOUT_SWEEPS` sweeps has been in flight for at least `io_timeout`.
const TIMEOUT_SWEEPS: u32 = 4;

impl QueueWorker {
    fn new(
        spec: WorkerSpec,
        stop: Arc<AtomicBool>,
        reset: Arc<AtomicBool>,
        wake: EventFd,
    ) -> std::io::Result<Self> {
        let layout = spec.layout.load_full();
        let size = spec.queue.size() as usize;
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            spec.kick.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_KICK),
        )?;
        epoll.ctl(
            ControlOperation::Add,
            wake.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_WAKE),
        )?;
        let mut w = QueueWorker {
            index: spec.index,
            volume: spec.volume,
            vq: JournaledQueue::new(spec.queue, spec.journal),
            host: HostMap::default(),
            host_of: None,
            retired_maps: Vec::new(),
            resubmit: spec.resubmit,
            reset,
            mem: Cache::new(spec.mem),
            kick: spec.kick,
            call: spec.call,
            layout_now: Cache::new(spec.layout.clone()),
            layout_src: spec.layout,
            layout,
            devices: Vec::new(),
            slots: (0..size).map(|_| None).collect(),
            slot_bufs: (0..size).map(|_| SlotBufs::default()).collect(),
            in_flight: 0,
            limits: spec.limits,
            serial: spec.serial,
            poll_idle: spec.poll_idle,
            stop,
            wake,
            epoll,
            need_notify: false,
            broken: false,
            served_one: false,
            held: Vec::new(),
            cancelled: Vec::new(),
            seen_epochs: Vec::new(),
            retries: vec![0; size],
            request_retries: spec.request_retries,
            io_timeout: spec.io_timeout.max(Duration::from_millis(4)),
            sweep: 0,
            last_sweep: Instant::now(),
            rounds: 0,
            dup_log: ratelimit::guest_warning(),
            io_err_log: ratelimit::guest_warning(),
            seen_faults: spool_sigbus::faults(),
            fault: spec.fault,
            abandoned: spec.abandoned,
            replay: spec.replay.map(ReplayGuard::new),
            replaying: vec![false; size],
            replay_left: 0,
            poison: spec.poison,
        };
        w.open_device_queues()?;
        Ok(w)
    }

    /// Opens queues for devices the layout gained (a grown volume may span new devices; the
    /// pool keeps existing device indices stable).
    fn open_device_queues(&mut self) -> std::io::Result<()> {
        let depth = (self.slots.len() as u32 * 2).max(64);
        while self.devices.len() < self.layout.devices.len() {
            let d = self.devices.len();
            let q = self.layout.devices[d].open_queue(depth)?;
            self.epoll.ctl(
                ControlOperation::Add,
                q.completion_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_DEVICE + d as u64),
            )?;
            let mut q = q;
            q.set_completion_events(false);
            self.devices.push(q);
            self.seen_epochs
                .push(self.layout.devices[d].health().load().1);
        }
        Ok(())
    }

    fn refresh_layout(&mut self) {
        let cur = self.layout_now.load();
        if Arc::ptr_eq(cur, &self.layout) {
            return;
        }
        let cur = cur.clone();
        // A device replaced under an existing index: its queue (and whatever is in flight on
        // the old device) must go; the reset path reopens every queue on the new layout.
        let replaced = self
            .layout
            .devices
            .iter()
            .zip(cur.devices.iter())
            .any(|(a, b)| !Arc::ptr_eq(a, b));
        if replaced {
            drop(cur);
            self.reset_devices();
            return;
        }
        {
            let new = cur;
            self.limits.capacity_sectors = new.size / SECTOR;
            self.layout = new;
            if let Err(e) = self.open_device_queues() {
                tracing::error!(volume = %self.volume, queue = self.index, error = %e, "cannot open device queue for grown volume");
            }
        }
    }

    fn run(mut self) -> Queue {
        tracing::debug!(volume = %self.volume, queue = self.index, "worker started");
        let mut last_work = Instant::now();
        let mut idle_rounds = 0u32;
        let mut events = vec![EpollEvent::default(); 8];
        self.set_device_events(false);
        // Completions a previous process put in the used ring just before it died may not
        // have been signalled: one (possibly spurious) interrupt lets the guest see them.
        if let Some(call) = self.call.load().as_ref() {
            let _ = (&**call).write(&1u64.to_ne_bytes());
        }
        if !self.poison.is_empty() {
            let mem = self.mem.load().clone();
            for head in std::mem::take(&mut self.poison) {
                self.fail_poisoned(head, &mem);
            }
        }
        if !self.resubmit.is_empty() {
            let mem = self.mem.load().clone();
            let heads = std::mem::take(&mut self.resubmit);
            tracing::info!(volume = %self.volume, queue = self.index, count = heads.len(), "resubmitting requests recovered from the journal");
            for &h in &heads {
                if let Some(r) = self.replaying.get_mut(h as usize) {
                    if !*r {
                        *r = true;
                        self.replay_left += 1;
                    }
                }
            }
            for head in heads {
                self.resubmit_head(head, &mem);
            }
        }
        if self.replay_left == 0 {
            self.replay = None;
        }
        loop {
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            if self.reset.swap(false, Ordering::AcqRel) {
                self.reset_devices();
            }
            self.refresh_layout();
            let mem = self.mem.load().clone();
            self.check_memory_faults(&mem);
            self.check_health(&mem);
            self.rounds = self.rounds.wrapping_add(1);
            if self.rounds.is_multiple_of(1024) {
                self.sweep_timeouts();
            }
            let mut work = self.poll_avail(&mem);
            for d in 0..self.devices.len() {
                if let Err(e) = self.devices[d].kick() {
                    tracing::error!(volume = %self.volume, error = %e, "device submit failed");
                }
            }
            work |= self.reap(&mem);
            if !self.cancelled.is_empty() {
                // Through the health gate again: submitted, held (device resetting) or
                // failed (device isolated).
                for h in std::mem::take(&mut self.cancelled) {
                    self.resubmit_head(h, &mem);
                }
                work = true;
            }
            self.notify(&mem);
            if work {
                last_work = Instant::now();
                idle_rounds = 0;
                continue;
            }
            // Reading the clock costs more than a poll round: look only every 64 idle rounds.
            // A polled device (userspace NVMe: no interrupts) with commands outstanding keeps
            // the worker awake, or nothing would ever wake it for their completions.
            idle_rounds += 1;
            if !idle_rounds.is_multiple_of(64)
                || last_work.elapsed() < self.poll_idle
                || self.devices.iter().any(|d| d.polled() && d.in_flight() > 0)
            {
                std::hint::spin_loop();
                continue;
            }
            // Event-driven mode: ask the guest and the devices to wake us, re-check, sleep.
            match self.vq.enable_notification(&mem) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    self.fail_queue(&e.to_string());
                }
            }
            for d in &mut self.devices {
                d.set_completion_events(true);
            }
            if self.reap(&mem) {
                self.set_device_events(false);
                self.notify(&mem);
                continue;
            }
            self.sweep_timeouts();
            let wait_ms = if self.in_flight > 0 {
                (self.io_timeout.as_millis() as u32 / TIMEOUT_SWEEPS).clamp(1, 1000) as i32
            } else if !self.held.is_empty() {
                5
            } else {
                1000
            };
            let n = match self.epoll.wait(wait_ms, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
                Err(e) => {
                    tracing::error!(volume = %self.volume, error = %e, "epoll failed");
                    std::thread::sleep(Duration::from_millis(1));
                    0
                }
            };
            let mut buf = [0u8; 8];
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_KICK => {
                        let _ = (&self.kick).read(&mut buf);
                    }
                    TOKEN_WAKE => {
                        let _ = self.wake.read();
                    }
                    t => {
                        let d = (t - TOKEN_DEVICE) as usize;
                        if let Some(q) = self.devices.get(d) {
                            q.ack_completion_event();
                        }
                    }
                }
            }
            if !self.broken {
                let _ = self.vq.disable_notification(&mem);
            }
            self.set_device_events(false);
            last_work = Instant::now();
        }
        self.drain();
        tracing::debug!(volume = %self.volume, queue = self.index, next_avail = self.vq.next_avail(), "worker stopped");
        self.vq.into_queue()
    }

    fn set_device_events(&mut self, enabled: bool) {
        for d in &mut self.devices {
            d.set_completion_events(enabled);
        }
    }

    /// Completes what is in flight before handing the queue back.
    fn drain(&mut self) {
        let deadline = Instant::now() + STOP_DRAIN;
        // Hung commands are given up (they stay INFLIGHT in the journal for the next process).
        for d in &mut self.devices {
            d.abort();
        }
        while self.in_flight > 0 && Instant::now() < deadline {
            let mem = self.mem.load().clone();
            for d in 0..self.devices.len() {
                let _ = self.devices[d].kick();
            }
            if !self.reap(&mem) {
                std::thread::sleep(Duration::from_micros(50));
            }
            self.notify(&mem);
        }
        if self.in_flight > 0 {
            tracing::error!(volume = %self.volume, queue = self.index, in_flight = self.in_flight, "device did not complete requests before stop");
            self.quarantine_stuck();
        }
    }

    /// Device commands that did not complete even after an abort and a wait may still be
    /// carried out by the device at any time. Their device queues and every guest memory map
    /// they may read or write are kept alive for the life of the process (never unmapped, so
    /// a late completion lands in memory that is still this guest's, never in a reused
    /// address), and the volume is told, so its extents are not handed to anyone else.
    fn quarantine_stuck(&mut self) {
        let mut stuck = 0;
        let mut d = 0;
        while d < self.devices.len() {
            let n = self.devices[d].in_flight();
            if n == 0 {
                d += 1;
                continue;
            }
            stuck += n;
            let q = self.devices.remove(d);
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
        let current = self.mem.load().clone();
        for m in self
            .retired_maps
            .drain(..)
            .chain(self.host_of.clone())
            .chain(std::iter::once(current))
        {
            // Deliberately leaked: keeps the regions mapped (and registered for DMA).
            std::mem::forget(m);
        }
        self.abandoned.fetch_add(stuck as u64, Ordering::AcqRel);
        tracing::error!(volume = %self.volume, queue = self.index, commands = stuck, "device commands never completed: their queue and guest memory are quarantined for the life of the process; the volume's extents stay allocated");
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
        if mem.faulted() || self.retired_maps.iter().any(|m| m.faulted()) {
            tracing::error!(volume = %self.volume, queue = self.index, "the frontend's memory faulted under the worker (its file was truncated?); ending the session");
            self.fail_queue("guest memory faulted");
            self.fault.raise();
        }
    }

    fn fail_queue(&mut self, why: &str) {
        if !self.broken {
            tracing::error!(volume = %self.volume, queue = self.index, error = why, "virtqueue is broken; ignoring it until the guest resets the device");
            self.broken = true;
        }
    }

    /// Takes every available request from the ring and submits it. Returns true if any.
    fn poll_avail(&mut self, mem: &Arc<GuestMemory>) -> bool {
        if self.broken {
            return false;
        }
        let any = self.take_and_submit(mem);
        // Algorithm 1 step 7, once for the round's batch of takes.
        self.vq.finish_takes(&mut |_| {});
        any
    }

    /// [`Self::poll_avail`] up to step 7.
    #[inline]
    fn take_and_submit(&mut self, mem: &Arc<GuestMemory>) -> bool {
        self.refresh_host(mem);
        self.vq.prefetch(&self.host);
        let mut any = false;
        loop {
            self.vq.prefetch_ahead(&self.host);
            // Algorithm 1, steps 1-6: the request is journaled INFLIGHT before we see it.
            let head = match self.vq.pop(&self.host, &mut |_| {}) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    self.fail_queue(&e.to_string());
                    return any;
                }
            };
            any = true;
            let chain = self.vq.chain(&self.host, head);
            let parsed = request::parse(head, chain, &self.host, &self.limits);
            self.dispatch(parsed, mem);
        }
        any
    }

    /// Rebuilds the host map when the frontend's memory table changed.
    #[inline]
    fn refresh_host(&mut self, mem: &Arc<GuestMemory>) {
        if !self.host_of.as_ref().is_some_and(|m| Arc::ptr_eq(m, mem)) {
            self.host = HostMap::new(mem);
            if let Some(old) = self.host_of.replace(mem.clone()) {
                if self.in_flight > 0 {
                    self.retired_maps.push(old);
                    if self.retired_maps.len() > MAX_RETIRED_MAPS {
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

    /// Submits a parsed request, or completes a rejected one with its error status.
    fn dispatch(&mut self, parsed: Result<Request, request::Rejected>, mem: &Arc<GuestMemory>) {
        // A head the guest has not got back yet, offered again (a driver bug or a hostile
        // guest), is dropped: completing it, even with an error status, would complete the
        // request in flight a second time and mark it NONE in the journal while its I/O runs.
        // The original completes once, as it would have.
        match parsed {
            Ok(req) => {
                if self.head_busy(req.head) {
                    return self.note_reposted(req.head);
                }
                match self.one_piece(&req) {
                    Some((d, offset)) => self.submit_one(req, d, offset),
                    None => self.submit(req, mem),
                }
            }
            Err(rej) if self.head_busy(rej.head) => self.note_reposted(rej.head),
            Err(rej) => {
                tracing::debug!(volume = %self.volume, head = rej.head, reason = rej.reason, "request rejected");
                if let Some(a) = rej.status_addr {
                    self.refresh_host(mem);
                    self.host.write(a.0, &[rej.status]);
                }
                self.complete_used(mem, rej.head, 1);
            }
        }
    }

    #[cold]
    #[inline(never)]
    fn note_reposted(&mut self, head: u16) {
        if let Verdict::Log { suppressed } = self.dup_log.check() {
            tracing::warn!(volume = %self.volume, queue = self.index, head, suppressed, "guest re-posted a descriptor head that is still in flight; ignored");
        }
    }

    /// Whether `head` is still the worker's: in flight, held for a resetting device, or
    /// cancelled and waiting to be submitted again (or out of range of the in-flight table).
    #[inline]
    fn head_busy(&self, head: u16) -> bool {
        self.slots.get(head as usize).is_none_or(|s| s.is_some())
            || (!self.held.is_empty() && self.held.contains(&head))
            || (!self.cancelled.is_empty() && self.cancelled.contains(&head))
    }

    /// Acts on device health changes: a device that started resetting has its hung commands
    /// aborted (they come back as path errors and are held); when any device leaves the
    /// resetting state, held requests are dispatched again (submitted if their devices are
    /// healthy, failed if isolated, held again if still resetting).
    fn check_health(&mut self, mem: &Arc<GuestMemory>) {
        let mut changed = false;
        for d in 0..self.devices.len() {
            let (state, epoch) = self.layout.devices[d].health().load();
            if epoch != self.seen_epochs[d] {
                self.seen_epochs[d] = epoch;
                tracing::debug!(volume = %self.volume, queue = self.index, device = d, state = state.name(), "device health changed");
                self.devices[d].abort();
                changed = true;
            }
        }
        if !changed {
            return;
        }
        self.reap(mem);
        if !self.held.is_empty() && !self.held_all_resetting() {
            let heads = std::mem::take(&mut self.held);
            tracing::info!(volume = %self.volume, queue = self.index, count = heads.len(), "dispatching held requests again");
            for h in heads {
                self.resubmit_head(h, mem);
            }
        }
    }

    /// Whether every device is resetting (then nothing held can make progress).
    fn held_all_resetting(&self) -> bool {
        (0..self.devices.len())
            .all(|d| self.layout.devices[d].health().state() == HealthState::Resetting)
    }

    /// Reports requests in flight for longer than the I/O timeout (once each).
    fn sweep_timeouts(&mut self) {
        if self.in_flight == 0 {
            self.last_sweep = Instant::now();
            return;
        }
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < self.io_timeout / TIMEOUT_SWEEPS {
            return;
        }
        self.last_sweep = now;
        self.sweep = self.sweep.wrapping_add(1);
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(slot) = slot else { continue };
            if slot.timed_out || self.sweep.wrapping_sub(slot.sweep) <= TIMEOUT_SWEEPS {
                continue;
            }
            slot.timed_out = true;
            for &(d, offset, len, write) in &self.slot_bufs[i].pieces {
                if let Some(dev) = self.layout.devices.get(d as usize) {
                    if self.devices[d as usize].in_flight() > 0 {
                        tracing::warn!(volume = %self.volume, queue = self.index, device = d, offset, "request timed out");
                        dev.health().report(ErrorReport {
                            signal: Signal::Timeout,
                            offset,
                            len,
                            write,
                        });
                    }
                }
            }
        }
    }

    /// Re-parses a journaled request from its descriptor chain and submits it again.
    fn resubmit_head(&mut self, head: u16, mem: &Arc<GuestMemory>) {
        self.refresh_host(mem);
        let walker = self.vq.chain(&self.host, head);
        let parsed = request::parse(head, walker, &self.host, &self.limits);
        self.dispatch(parsed, mem);
    }

    /// The device-reset path: drain what the device queues hold without completing it to the
    /// guest, reopen them, and resubmit every request the journal (or, without a journal,
    /// the in-flight table) says is outstanding.
    fn reset_devices(&mut self) {
        // Test hook (docs/restart.md): a queue thread that panics with requests in flight.
        if std::env::var_os("SPOOL_TEST_PANIC_ON_DEVICE_RESET").is_some() {
            panic!("SPOOL_TEST_PANIC_ON_DEVICE_RESET is set");
        }
        let mut held = std::mem::take(&mut self.held);
        held.append(&mut self.cancelled);
        let heads: Vec<u16> = match self.vq.journaled_inflight() {
            Some(heads) => heads,
            None => (0..self.slots.len() as u16)
                .filter(|&h| self.slots[h as usize].is_some())
                .chain(held)
                .collect(),
        };
        let deadline = Instant::now() + STOP_DRAIN;
        for d in &mut self.devices {
            d.abort();
        }
        for d in 0..self.devices.len() {
            while self.devices[d].in_flight() > 0 && Instant::now() < deadline {
                let _ = self.devices[d].kick();
                if self.devices[d].reap(&mut |_, _| {}) == 0 {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
        self.quarantine_stuck();
        for s in &mut self.slots {
            *s = None;
        }
        self.in_flight = 0;
        for q in self.devices.drain(..) {
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                q.completion_fd(),
                EpollEvent::default(),
            );
        }
        self.seen_epochs.clear();
        // The layout may have changed underneath (a replaced device): reopen against the
        // current one.
        let cur = self.layout_src.load_full();
        self.limits.capacity_sectors = cur.size / SECTOR;
        self.layout = cur;
        if let Err(e) = self.open_device_queues() {
            tracing::error!(volume = %self.volume, error = %e, "cannot reopen device queues after reset");
        }
        let mem = self.mem.load().clone();
        tracing::info!(volume = %self.volume, queue = self.index, resubmitted = heads.len(), "device reset: resubmitting in-flight requests");
        for h in heads {
            self.resubmit_head(h, &mem);
        }
    }

    /// Counts replayed heads completing; the replay record goes when the last one did.
    #[cold]
    fn replayed(&mut self, done: &[(u16, u32)]) {
        for &(h, _) in done {
            if let Some(r) = self.replaying.get_mut(h as usize).filter(|r| **r) {
                *r = false;
                self.replay_left -= 1;
            }
        }
        if self.replay_left == 0 {
            self.replay = None;
        }
    }

    /// Completes a head that crashed the previous process while it replayed it, with IOERR,
    /// without submitting it again (it would crash this process too).
    #[cold]
    fn fail_poisoned(&mut self, head: u16, mem: &Arc<GuestMemory>) {
        tracing::error!(volume = %self.volume, queue = self.index, head, "request crashed the previous worker while it was replayed; failing it (IOERR) instead of replaying it again");
        self.refresh_host(mem);
        let chain = self.vq.chain(&self.host, head);
        match request::parse(head, chain, &self.host, &self.limits) {
            Ok(req) => write_status(req.status_host, VIRTIO_BLK_S_IOERR as u8),
            Err(rej) => {
                if let Some(a) = rej.status_addr {
                    self.host.write(a.0, &[VIRTIO_BLK_S_IOERR as u8]);
                }
            }
        }
        self.complete_used(mem, head, 1);
    }

    fn complete_used(&mut self, mem: &Arc<GuestMemory>, head: u16, len: u32) {
        self.complete_used_batch(mem, &[(head, len)]);
    }

    /// Completes `(head, used length)` pairs to the guest with one used-index update.
    fn complete_used_batch(&mut self, mem: &Arc<GuestMemory>, done: &[(u16, u32)]) {
        if done.is_empty() {
            return;
        }
        if self.replay_left > 0 {
            self.replayed(done);
        }
        // Algorithm 1, steps 10-14, for the batch as a whole.
        self.refresh_host(mem);
        if let Err(e) = self.vq.complete_batch(&self.host, done, &mut |_| {}) {
            self.fail_queue(&e.to_string());
        }
        self.need_notify = true;
        if !self.served_one {
            self.served_one = true;
            crate::note_first_completion();
        }
    }

    fn submit(&mut self, req: Request, mem: &Arc<GuestMemory>) {
        let head = req.head;
        let slot = head as usize;
        let mut inf = Inflight {
            status: req.status_host,
            used_len: 1,
            pending: 0,
            status_code: VIRTIO_BLK_S_OK as u8,
            held: false,
            cancelled: false,
            timed_out: false,
            sweep: 0,
        };
        let bufs = &mut self.slot_bufs[slot];
        bufs.parts.clear();
        bufs.pieces.clear();
        let mut ios: SmallVec<[(usize, DeviceIo); 4]> = SmallVec::new();
        match &req.op {
            Op::Read | Op::Write => {
                let write = req.op == Op::Write;
                if !write {
                    inf.used_len = (req.len as u32).saturating_add(1);
                }
                let mut pieces: SmallVec<[(usize, u64, u64, u64); 4]> = SmallVec::new();
                self.layout
                    .map(req.sector * SECTOR, req.len, |d, off, len, at| {
                        pieces.push((d, off, len, at))
                    });
                if pieces.len() == 1 {
                    bufs.parts.push(req.iov);
                } else {
                    for &(_, _, len, at) in &pieces {
                        bufs.parts.push(slice_iov(&req.iov, at, len));
                    }
                }
                for (i, &(d, off, len, _)) in pieces.iter().enumerate() {
                    // The arrays are pointed at once the request sits in its slot (below);
                    // until then `iovcnt` says which part.
                    let iov = std::ptr::null();
                    let iovcnt = i as u32;
                    ios.push((
                        d,
                        if write {
                            DeviceIo::Write {
                                offset: off,
                                len,
                                iov,
                                iovcnt,
                            }
                        } else {
                            DeviceIo::Read {
                                offset: off,
                                len,
                                iov,
                                iovcnt,
                            }
                        },
                    ));
                }
            }
            Op::Flush => {
                for d in 0..self.layout.devices.len() {
                    ios.push((d, DeviceIo::Flush));
                }
            }
            Op::GetId => {
                let mut left = &self.serial[..];
                let mut written = 0u32;
                for v in &req.iov {
                    let n = v.iov_len.min(left.len());
                    // SAFETY: `v` comes from `host_iovecs` (each iovec inside one region, by
                    // `HostMap::host`/`pieces`) of `host_of`, which is `mem` here (refreshed
                    // by the caller); n <= v.iov_len. A guest race only changes what it reads.
                    unsafe {
                        std::ptr::copy_nonoverlapping(left.as_ptr(), v.iov_base.cast::<u8>(), n)
                    };
                    left = &left[n..];
                    written += n as u32;
                }
                inf.used_len = written + 1;
            }
            Op::Discard(ranges) | Op::WriteZeroes { ranges, .. } => {
                let zeroes = matches!(req.op, Op::WriteZeroes { .. });
                for r in ranges {
                    self.layout.map(
                        r.sector * SECTOR,
                        r.sectors as u64 * SECTOR,
                        |d, off, len, _| {
                            ios.push((
                                d,
                                if zeroes {
                                    DeviceIo::WriteZeroes { offset: off, len }
                                } else {
                                    DeviceIo::Discard { offset: off, len }
                                },
                            ))
                        },
                    );
                }
            }
        }
        inf.pending = ios.len() as u32;
        // The health gate: one atomic load per piece.
        let mut hold = false;
        for (d, _) in &ios {
            match self.layout.devices[*d].health().state() {
                HealthState::Healthy => {}
                HealthState::Resetting => hold = true,
                HealthState::Failed | HealthState::Removed => {
                    inf.status_code = VIRTIO_BLK_S_IOERR as u8;
                    inf.pending = 0;
                }
            }
        }
        if hold && inf.pending != 0 {
            self.held.push(head);
            return;
        }
        if inf.pending != 0 && ios.iter().any(|(d, _)| *d >= self.devices.len()) {
            // A device queue that could not be reopened (after a reset or a replacement):
            // try again; if it still cannot be had, this request fails cleanly.
            if let Err(e) = self.open_device_queues() {
                tracing::error!(volume = %self.volume, error = %e, "no device queue; failing the request");
                inf.status_code = VIRTIO_BLK_S_IOERR as u8;
                inf.pending = 0;
            }
        }
        if inf.pending == 0 {
            self.refresh_host(mem);
            write_status(inf.status, inf.status_code);
            self.complete_used(mem, head, inf.used_len);
            return;
        }
        for (d, io) in &ios {
            let (offset, len, write) = match *io {
                DeviceIo::Read { offset, len, .. } => (offset, len, false),
                DeviceIo::Write { offset, len, .. } => (offset, len, true),
                DeviceIo::Flush => (0, 0, true),
                DeviceIo::Discard { offset, len } | DeviceIo::WriteZeroes { offset, len } => {
                    (offset, len, true)
                }
            };
            self.slot_bufs[slot]
                .pieces
                .push((*d as u16, offset, len, write));
        }
        inf.sweep = self.sweep;
        self.slots[slot] = Some(inf);
        self.in_flight += 1;
        let parts = &self.slot_bufs[slot].parts;
        for (d, mut io) in ios {
            if let DeviceIo::Read { iov, iovcnt, .. } | DeviceIo::Write { iov, iovcnt, .. } =
                &mut io
            {
                let part = &parts[*iovcnt as usize];
                *iov = part.as_ptr();
                *iovcnt = part.len() as u32;
            }
            // SAFETY: the arrays live in `slot_bufs[slot].parts` (never grown), refilled only
            // for a head `dispatch` found free (`head_busy`: none of its pieces is in a
            // device); each iovec lies in one region of `host_of` (`host_iovecs`; `slice_iov`
            // stays inside), which stays mapped until completion (`retired_maps`).
            unsafe { self.devices[d].submit(io, head as u64) };
        }
    }

    /// Where a read or write goes when it can take [`Self::submit_one`]: one healthy device
    /// with an open queue holds all of it, and its head is free.
    #[inline]
    fn one_piece(&self, req: &Request) -> Option<(usize, u64)> {
        if !matches!(req.op, Op::Read | Op::Write)
            || self
                .slots
                .get(req.head as usize)
                .is_none_or(|s| s.is_some())
        {
            return None;
        }
        let (d, offset) = self.layout.map_one(req.sector * SECTOR, req.len)?;
        (d < self.devices.len() && self.layout.devices[d].health().state() == HealthState::Healthy)
            .then_some((d, offset))
    }

    /// The common case of [`Self::submit`]: a read or write that lies on one healthy device
    /// (one piece, no health hold, no error), without the general path's piece lists.
    #[inline]
    fn submit_one(&mut self, req: Request, d: usize, offset: u64) {
        let head = req.head;
        let slot = head as usize;
        let write = req.op == Op::Write;
        let len = req.len;
        self.slots[slot] = Some(Inflight {
            status: req.status_host,
            used_len: if write {
                1
            } else {
                (len as u32).saturating_add(1)
            },
            pending: 1,
            status_code: VIRTIO_BLK_S_OK as u8,
            held: false,
            cancelled: false,
            timed_out: false,
            sweep: self.sweep,
        });
        self.in_flight += 1;
        let bufs = &mut self.slot_bufs[slot];
        bufs.pieces.clear();
        bufs.pieces.push((d as u16, offset, len, write));
        bufs.iov = req.iov;
        let (iov, iovcnt) = (bufs.iov.as_ptr(), bufs.iov.len() as u32);
        let io = if write {
            DeviceIo::Write {
                offset,
                len,
                iov,
                iovcnt,
            }
        } else {
            DeviceIo::Read {
                offset,
                len,
                iov,
                iovcnt,
            }
        };
        // SAFETY: as in `submit`: the array lives in this slot's buffers, refilled only for
        // a free head (`one_piece` and `head_busy`), untouched until reaped; each iovec lies
        // in one region of `host_of` (`host_iovecs`), mapped until completion.
        unsafe { self.devices[d].submit(io, head as u64) };
    }

    /// Reaps device completions; completes finished requests to the guest.
    fn reap(&mut self, mem: &Arc<GuestMemory>) -> bool {
        self.refresh_host(mem);
        let mut finished: SmallVec<[u16; 32]> = SmallVec::new();
        let mut any = false;
        for d in 0..self.devices.len() {
            let slots = &mut self.slots;
            let bufs = &self.slot_bufs;
            let volume = &self.volume;
            let io_err_log = &mut self.io_err_log;
            let health = self.layout.devices[d].health();
            let n = self.devices[d].reap(&mut |tag, res| {
                let Some(Some(inf)) = slots.get_mut(tag as usize) else {
                    tracing::error!(tag, "completion for a request that is not in flight");
                    return;
                };
                if res < 0 {
                    let errno = -res;
                    let class = ErrorClass::of_errno(errno);
                    note_io_error(io_err_log, volume, tag, errno, class);
                    if errno != libc::ECANCELED {
                        let &(_, offset, len, write) = bufs[tag as usize]
                            .pieces
                            .iter()
                            .find(|p| p.0 as usize == d)
                            .unwrap_or(&(0, 0, 0, false));
                        health.report(ErrorReport {
                            signal: Signal::Errno(errno),
                            offset,
                            len,
                            write,
                        });
                    }
                    match class {
                        _ if errno == libc::ECANCELED => inf.cancelled = true,
                        ErrorClass::Path | ErrorClass::Gone => inf.held = true,
                        ErrorClass::Media | ErrorClass::Request => {
                            inf.status_code = VIRTIO_BLK_S_IOERR as u8
                        }
                    }
                }
                inf.pending -= 1;
                if inf.pending == 0 {
                    finished.push(tag as u16);
                }
            });
            any |= n > 0;
        }
        let mut used: SmallVec<[(u16, u32); 32]> = SmallVec::new();
        for head in finished {
            if let Some(inf) = self.slots[head as usize].take() {
                self.in_flight -= 1;
                let h = head as usize;
                if inf.held && inf.status_code == VIRTIO_BLK_S_OK as u8 {
                    if (self.retries[h] as u32) < self.request_retries {
                        self.retries[h] += 1;
                        self.held.push(head);
                        continue;
                    }
                    tracing::error!(volume = %self.volume, head, retries = self.retries[h], "request keeps failing after device resets; failing it");
                    write_status(inf.status, VIRTIO_BLK_S_IOERR as u8);
                } else if inf.cancelled && inf.status_code == VIRTIO_BLK_S_OK as u8 {
                    // Our own cancellation is no failure of the request: no retry counted.
                    // Held requests wait for a health change; these would wait forever if
                    // the change they follow has already been seen (a queue pair replaced
                    // after a controller reset the worker had already acted on).
                    self.cancelled.push(head);
                    continue;
                } else {
                    write_status(inf.status, inf.status_code);
                }
                self.retries[h] = 0;
                used.push((head, inf.used_len));
            }
        }
        self.complete_used_batch(mem, &used);
        if self.in_flight == 0 && !self.retired_maps.is_empty() {
            // Nothing taken under an earlier memory map is in flight any more.
            self.retired_maps.clear();
        }
        any
    }

    fn notify(&mut self, mem: &Arc<GuestMemory>) {
        if !self.need_notify {
            return;
        }
        self.need_notify = false;
        self.refresh_host(mem);
        match self.vq.needs_notification(&self.host) {
            false => {}
            true => {
                if let Some(call) = self.call.load().as_ref() {
                    let _ = (&**call).write(&1u64.to_ne_bytes());
                }
            }
        }
    }
}

/// The iovecs covering `[at, at + len)` of the data described by `iov`.
fn slice_iov(iov: &[IoVec], at: u64, len: u64) -> IoVecs {
    let mut out = IoVecs::new();
    let mut pos = 0u64;
    let end = at + len;
    for v in iov {
        let vstart = pos;
        let vend = pos + v.iov_len as u64;
        pos = vend;
        if vend <= at || vstart >= end {
            continue;
        }
        let s = at.max(vstart);
        let e = end.min(vend);
        out.push(IoVec {
            iov_base: (v.iov_base as usize + (s - vstart) as usize) as *mut libc::c_void,
            iov_len: (e - s) as usize,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_iov_splits_across_buffers() {
        let v = [
            IoVec {
                iov_base: 0x1000 as *mut _,
                iov_len: 512,
            },
            IoVec {
                iov_base: 0x5000 as *mut _,
                iov_len: 1024,
            },
        ];
        let s = slice_iov(&v, 256, 512);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].iov_base as usize, s[0].iov_len), (0x1100, 256));
        assert_eq!((s[1].iov_base as usize, s[1].iov_len), (0x5000, 256));
        let s = slice_iov(&v, 512, 1024);
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].iov_base as usize, s[0].iov_len), (0x5000, 1024));
    }
}
