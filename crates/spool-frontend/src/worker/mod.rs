//! One polling I/O worker per virtqueue.
//!
//! The worker thread owns its [`Queue`], its in-flight table and one [`DeviceQueue`] per device
//! the volume lives on: nothing on the data path is shared or locked. It polls the avail ring
//! and the device completions; after `poll_idle` without work it re-enables guest
//! notifications and sleeps in epoll on the kick eventfd, the device completion eventfds and
//! its own wake eventfd (event-driven mode). All per-queue state lives in [`QueueWorker`], the
//! seam where the journal hooks in.
//!
//! Layout, one job per file, all of them `impl QueueWorker`:
//! - `run`: the poll loop, taking requests (checked against the volume's QoS buckets when
//!   it has limits), sleeping in epoll, guest notifications, memory-map changes;
//! - `inflight`: the in-flight table: every request taken and not completed, its state
//!   (submitted, held, cancelled), pieces, retries and replay (`InflightTable`);
//! - `dispatch`: a taken request to device pieces (splitting across devices, slicing
//!   iovecs), the health gate, submission;
//! - `complete`: reaping device completions and completing requests to the guest;
//! - `recovery`: what failures do to requests (held, cancelled, retried), device health
//!   changes, the timeout sweep, device reset, the quiesce shared by reset and stop, and
//!   quarantining commands that never complete;
//! - `replay`: requests resubmitted from the journal at start (and poisoned ones);
//! - `guest`, `pacing`, `telemetry`: parts of a worker's state kept apart from the rest
//!   (the guest memory maps it holds; its I/O limits and fair share; its statistics,
//!   restart clock and rate-limited warnings).
//!
//! How the journal makes a restart invisible: docs/journal-format.md; how failures are
//! handled: docs/failures.md.
//!
//! **Must not know:** the vhost-user protocol, the keeper, how devices do their I/O.

mod complete;
mod devices;
mod dispatch;
mod group;
mod guest;
mod inflight;
mod pacing;
mod recovery;
mod replay;
mod ring;
mod run;
mod sweep;
mod telemetry;
#[cfg(test)]
mod tests;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::Cache;
use arc_swap::{ArcSwap, ArcSwapOption};
use spool_devices::DeviceQueue;
use spool_journal::{Journal, ReplayRecord};
use spool_pool::VolumeLayout;
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::hostmem::HostMap;
use crate::qos::{is_limited, VolumeQos};
use crate::request::{GuestMemory, Limits, ID_LEN, SECTOR};
use crate::share::{ShareGroup, VolumeShare};
use crate::stats::VolumeStats;
use crate::vring::JournaledQueue;
use devices::WorkerDevices;
pub use group::PollGroup;
use guest::GuestMaps;
use inflight::InflightTable;
use pacing::Pacing;
use replay::ReplayGuard;
use ring::Ring;
use sweep::TimeoutSweep;
use telemetry::Telemetry;

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
    /// Where the first completion of the process is recorded.
    pub clock: Arc<crate::StartClock>,
    /// The replay record of `resubmit` (see `spool_journal::ReplayRecord`).
    pub replay: Option<ReplayRecord>,
    /// Heads that crashed the previous process while it replayed them: failed, not replayed.
    pub poison: Vec<u16>,
    /// The volume's token buckets, shared by its queues (used only while the layout sets
    /// limits).
    pub qos: Arc<VolumeQos>,
    /// The volume's counters; this worker writes those of queue `index`.
    pub stats: Arc<VolumeStats>,
    /// The volume's fair share and the group it shares with.
    pub share: Arc<VolumeShare>,
    pub share_group: Arc<ShareGroup>,
    /// Hold the volume to its share (`[io] fair_share`).
    pub fair_share: bool,
    /// Where every guest page the worker writes is recorded (`[debug] write_witness`).
    pub witness: Option<Arc<crate::witness::WriteWitness>>,
}

/// Handle to a running worker (a queue served by a [`PollGroup`]'s thread).
pub struct WorkerHandle {
    stop: Arc<AtomicBool>,
    /// Set before `stop` for an upgrade's handoff (see `recovery::StopKind`).
    handoff: Arc<AtomicBool>,
    reset: Arc<AtomicBool>,
    wake: EventFd,
    group: PollGroup,
    /// Where the queue comes back once stopped (None once taken).
    back: Option<Receiver<Queue>>,
}

impl WorkerHandle {
    /// Starts a worker on a thread of its own.
    pub fn spawn(spec: WorkerSpec) -> std::io::Result<WorkerHandle> {
        let name = format!("q{}-{}", spec.index, spec.volume);
        let group = PollGroup::new(&name, spec.share_group.clone())?;
        Self::spawn_in(&group, spec)
    }

    /// Starts a worker in `group`: its thread serves this queue next to the group's others.
    pub fn spawn_in(group: &PollGroup, spec: WorkerSpec) -> std::io::Result<WorkerHandle> {
        let stop = Arc::new(AtomicBool::new(false));
        let reset = Arc::new(AtomicBool::new(false));
        let wake = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?;
        let worker = QueueWorker::new(spec, stop.clone(), reset.clone(), wake.try_clone()?)?;
        let handoff = worker.handoff.clone();
        let back = group.join(worker)?;
        Ok(WorkerHandle {
            stop,
            handoff,
            reset,
            wake,
            group: group.handle(),
            back: Some(back),
        })
    }

    /// The device-reset hook: the worker abandons what its device queues hold (waiting until
    /// the device no longer touches the buffers), reopens them, and resubmits every request
    /// the journal records as INFLIGHT. The guest sees latency, not errors.
    pub fn device_reset(&self) {
        self.reset.store(true, Ordering::Release);
        let _ = self.wake.write(1);
    }

    /// Asks the worker's thread to finish the round it is in and pass the top of its loop
    /// (waking it if it sleeps); returns the ticket [`Self::passed`] takes. After the pass,
    /// every write the worker makes into guest memory uses a memory map published before the
    /// ask: a dirty log turned on by then marks it.
    pub fn ask_pass(&self) -> u64 {
        let ticket = self.group.ask_pass();
        let _ = self.wake.write(1);
        ticket
    }

    /// Whether the worker's thread passed since the ask that gave `ticket`.
    pub fn passed(&self, ticket: u64) -> bool {
        self.group.passed(ticket)
    }

    /// Stops the worker once every request it took is completed into the used ring (held
    /// ones waited for up to the drain window, then failed: docs/failures.md), and gives the
    /// queue back: its `next_avail` is what GET_VRING_BASE reports, and no request below it
    /// is left unanswered.
    pub fn stop(mut self) -> Option<Queue> {
        self.stop_and_wait()
    }

    /// Stops the worker for an upgrade's handoff, the connection staying open: requests
    /// held for a resetting device stay INFLIGHT in the journal for the next worker (which
    /// resubmits them) instead of being waited for.
    pub fn stop_for_handoff(mut self) -> Option<Queue> {
        self.handoff.store(true, Ordering::Release);
        self.stop_and_wait()
    }

    fn stop_and_wait(&mut self) -> Option<Queue> {
        let back = self.back.take()?;
        self.stop.store(true, Ordering::Release);
        self.group.attend();
        let _ = self.wake.write(1);
        back.recv().ok()
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        let _ = self.stop_and_wait();
    }
}

// Epoll tokens in a queue's epoll: its kick and wake eventfds, each device's completions
// (`TOKEN_DEVICE + index`), and its poll group's wake eventfd.
const TOKEN_KICK: u64 = 0;
const TOKEN_WAKE: u64 = 1;
const TOKEN_DEVICE: u64 = 2;
const TOKEN_GROUP: u64 = u64::MAX;
/// Most earlier memory maps a worker keeps for requests still in flight under them (QEMU
/// changes its table a few times at boot and on memory hot-plug, with little I/O in flight).
const MAX_RETIRED_MAPS: usize = 16;
/// How long the drain on stop (and on a device reset) waits for device completions before
/// giving up.
#[cfg(not(test))]
const STOP_DRAIN: Duration = Duration::from_secs(5);
/// Short in unit tests, whose scripted commands that never complete would wait it out.
#[cfg(test)]
const STOP_DRAIN: Duration = Duration::from_millis(20);
/// The least a drain waits inside a window another queue of its thread opened (see
/// `recovery::drain_deadline`).
const MIN_DRAIN: Duration = Duration::from_millis(250);
/// Most requests a round takes from the ring when every device of the volume does its I/O
/// inline (tmpfs files) and the thread has its core to itself: such a request is done by the
/// time it is submitted, and the guest sees it when the round completes it. Taking a whole
/// QD32 batch in one round kept 32 done requests from the guest until the last was copied, and
/// the guest from refilling its ring meanwhile: the thread then idled while the client woke
/// (4K random read QD32, one queue: 339K IOPS taking everything, 551K taking 4 per round, 514K
/// taking 8). Where the cores are contended (the thread is preempted), the same small batches
/// cost more wake-ups than they save, so the round takes everything (see `group.rs`).
const INLINE_TAKE_BUDGET: u64 = 4;
/// A sweep runs every `io_timeout / TIMEOUT_SWEEPS`; a request seen in flight by more than
/// `TIMEOUT_SWEEPS` sweeps has been in flight for at least `io_timeout`.
const TIMEOUT_SWEEPS: u32 = 4;

/// Opens a device queue for device index `d` in tests (a scripted queue instead of the
/// layout device's own).
#[cfg(test)]
pub(super) type QueueFactory =
    Box<dyn FnMut(usize) -> std::io::Result<Box<dyn DeviceQueue>> + Send>;

/// The per-queue state: the virtqueue, its in-flight table, and its device queues.
pub struct QueueWorker {
    index: u16,
    volume: String,
    /// The virtqueue and its eventfds (see [`Ring`]).
    ring: Ring,
    /// The guest's memory as this worker maps it.
    guest: GuestMaps,
    resubmit: Vec<u16>,
    reset: Arc<AtomicBool>,
    /// The volume's layout and a queue per device (see [`WorkerDevices`]).
    dev: WorkerDevices,
    /// Every request taken and not completed, with its state (see [`InflightTable`]).
    inflight: InflightTable,
    limits: Limits,
    serial: [u8; ID_LEN],
    poll_idle: Duration,
    stop: Arc<AtomicBool>,
    /// The stop is an upgrade's handoff (see `recovery::StopKind`).
    handoff: Arc<AtomicBool>,
    wake: EventFd,
    epoll: Epoll,
    broken: bool,
    request_retries: u32,
    /// When requests in flight are checked for timeouts (see [`TimeoutSweep`]).
    sweep: TimeoutSweep,
    rounds: u32,
    /// `spool_sigbus::faults()` when last checked, and where to report a fault of ours.
    seen_faults: u64,
    fault: Arc<crate::SessionFault>,
    abandoned: Arc<AtomicU64>,
    /// While heads resubmitted from the journal have not completed (the in-flight table
    /// counts them), the record that says so should this process crash before they are.
    replay: Option<ReplayGuard>,
    poison: Vec<u16>,
    /// The volume's I/O limits and fair share, as this queue applies them.
    pace: Pacing,
    /// What the worker counts and reports: statistics, restart timing, rate-limited warnings.
    tel: Telemetry,
    /// The drain window this queue's thread shares between its queues (see
    /// `recovery::quiesce`).
    drain_window: Arc<std::sync::Mutex<Option<Instant>>>,
}

impl QueueWorker {
    fn new(
        spec: WorkerSpec,
        stop: Arc<AtomicBool>,
        reset: Arc<AtomicBool>,
        wake: EventFd,
    ) -> std::io::Result<Self> {
        let mut w = Self::assemble(spec, stop, reset, wake)?;
        w.open_device_queues()?;
        Ok(w)
    }

    /// The worker with no device queue open yet.
    fn assemble(
        spec: WorkerSpec,
        stop: Arc<AtomicBool>,
        reset: Arc<AtomicBool>,
        wake: EventFd,
    ) -> std::io::Result<Self> {
        let layout = spec.layout.load_full();
        let qos_seen = layout.qos;
        let qos = is_limited(qos_seen.as_ref()).then(|| spec.qos.clone());
        let size = spec.queue.size() as usize;
        let epoll = Epoll::new()?;
        let watch = |fd, token| {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )
        };
        watch(spec.kick.as_raw_fd(), TOKEN_KICK)?;
        watch(wake.as_raw_fd(), TOKEN_WAKE)?;
        Ok(QueueWorker {
            index: spec.index,
            volume: spec.volume,
            ring: Ring {
                vq: JournaledQueue::new(spec.queue, spec.journal),
                kick: spec.kick,
                call: spec.call,
                need_notify: false,
            },
            resubmit: spec.resubmit,
            reset,
            dev: WorkerDevices::new(spec.layout, layout),
            inflight: InflightTable::new(size),
            limits: spec.limits,
            serial: spec.serial,
            poll_idle: spec.poll_idle,
            stop,
            handoff: Arc::default(),
            wake,
            epoll,
            broken: false,
            request_retries: spec.request_retries,
            sweep: TimeoutSweep::new(spec.io_timeout.max(Duration::from_millis(4))),
            rounds: 0,
            seen_faults: spool_sigbus::faults(),
            fault: spec.fault,
            abandoned: spec.abandoned,
            replay: spec.replay.map(ReplayGuard::new),
            poison: spec.poison,
            drain_window: Arc::default(),
            guest: GuestMaps {
                host: HostMap::default(),
                host_of: None,
                retired_maps: Vec::new(),
                mem: Cache::new(spec.mem),
            },
            tel: Telemetry::new(spec.stats, spec.clock, spec.witness),
            pace: Pacing {
                qos_shared: spec.qos,
                qos,
                qos_seen,
                throttled: None,
                share: spec.share,
                share_group: spec.share_group,
                fair_share: spec.fair_share,
                priority: spool_pool::Priority::Normal,
                stepped_aside: false,
                take_budget: u64::MAX,
                contended: false,
                share_busy: false,
                share_deep: false,
            },
        })
    }

    /// Opens queues for devices the layout gained (a grown volume may span new devices; the
    /// pool keeps existing device indices stable).
    fn open_device_queues(&mut self) -> std::io::Result<()> {
        // From the layout, whether or not every queue below opens.
        let inline = |d: &Arc<spool_devices::Device>| d.inline_io();
        self.dev.inline =
            !self.dev.layout.devices.is_empty() && self.dev.layout.devices.iter().all(inline);
        self.set_contended(self.pace.contended);
        let depth = (self.inflight.len() as u32 * 2).max(64);
        while self.dev.queues.len() < self.dev.layout.devices.len() {
            let d = self.dev.queues.len();
            let mut q = self.dev.open_queue(d, depth)?;
            self.epoll.ctl(
                ControlOperation::Add,
                q.completion_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_DEVICE + d as u64),
            )?;
            q.set_completion_events(false);
            self.dev.queues.push(q);
            self.dev
                .seen_epochs
                .push(self.dev.layout.devices[d].health().load().1);
        }
        Ok(())
    }

    /// Whether the thread's cores are contended: bounds what a round takes from the ring on
    /// inline devices (see [`INLINE_TAKE_BUDGET`]).
    pub(super) fn set_contended(&mut self, contended: bool) {
        self.pace.contended = contended;
        self.pace.take_budget = if self.dev.inline && !contended {
            INLINE_TAKE_BUDGET
        } else {
            u64::MAX
        };
    }

    /// Follows the volume's layout: a grown volume's new devices get queues; a device
    /// replaced under an existing index resets every queue. One atomic load when unchanged.
    #[inline]
    fn refresh_layout(&mut self) {
        let cur = self.dev.now.load();
        if Arc::ptr_eq(cur, &self.dev.layout) {
            return;
        }
        let cur = cur.clone();
        // A device replaced under an existing index: its queue (and whatever is in flight on
        // the old device) must go; the reset path reopens every queue on the new layout. So
        // must an encrypted volume's when its segments moved (a grown volume): each queue's
        // tweaks come from them.
        let replaced = self
            .dev
            .layout
            .devices
            .iter()
            .zip(cur.devices.iter())
            .any(|(a, b)| !Arc::ptr_eq(a, b))
            || (cur.cipher.is_some() && cur.segments != self.dev.layout.segments);
        if replaced {
            drop(cur);
            self.reset_devices();
            return;
        }
        self.limits.capacity_sectors = cur.size / SECTOR;
        self.dev.layout = cur;
        self.follow_qos();
        if let Err(e) = self.open_device_queues() {
            tracing::error!(volume = %self.volume, queue = self.index, error = %e, "cannot open device queue for grown volume");
        }
    }

    /// Follows the layout's I/O limits: reconfigures the shared buckets when they changed
    /// (idempotent: every queue of the volume may do it; `update_layout` already has) and
    /// turns the take loop's checks on or off.
    fn follow_qos(&mut self) {
        if self.pace.qos_seen == self.dev.layout.qos {
            return;
        }
        self.pace.qos_seen = self.dev.layout.qos;
        let limits = self.pace.qos_seen.as_ref();
        self.pace
            .qos_shared
            .configure(limits, self.pace.qos_shared.now());
        self.pace.qos = is_limited(limits).then(|| self.pace.qos_shared.clone());
        self.pace.throttled = None;
        tracing::debug!(volume = %self.volume, queue = self.index, limits = ?limits, "I/O limits changed");
        self.follow_priority();
    }

    /// Puts this worker thread in its volume's scheduling class when it changed.
    pub(super) fn follow_priority(&mut self) {
        let p = self.dev.layout.qos.map(|q| q.priority).unwrap_or_default();
        if p != self.pace.priority {
            self.pace.priority = p;
            set_thread_priority(p, &self.volume);
        }
    }

    /// The frontend's current memory map.
    #[inline]
    pub(super) fn current_memory(&mut self) -> Arc<GuestMemory> {
        self.guest.mem.load().clone()
    }
}

/// Puts the calling thread in scheduling class `p` (docs/qos.md, "Priority classes"): batch
/// as `SCHED_BATCH` at nice 19, latency and normal as `SCHED_OTHER` at nice 0. Raising the
/// latency class above normal was measured to hurt: a polling worker at a higher priority
/// takes the core from its own client. Failures are logged; the thread keeps running as it
/// was.
fn set_thread_priority(p: spool_pool::Priority, volume: &str) {
    use spool_pool::Priority;
    let (policy, nice) = match p {
        Priority::Normal => (libc::SCHED_OTHER, 0),
        Priority::Latency => (libc::SCHED_OTHER, 0),
        Priority::Batch => (libc::SCHED_BATCH, 19),
    };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is on our stack for the call's duration
    // and only read. No memory is shared with anyone.
    let r1 = unsafe { libc::sched_setscheduler(0, policy, &param) };
    // SAFETY: integers only; on Linux PRIO_PROCESS with a thread id sets that thread's nice.
    let r2 = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) };
    if r1 != 0 || r2 != 0 {
        let e = std::io::Error::last_os_error();
        tracing::warn!(volume = %volume, priority = p.name(), "cannot set the worker thread's scheduling class: {e}");
    }
}
