//! Frontend layer: serves pool volumes to VMs over vhost-user-blk.
//!
//! Owns: the vhost-user protocol (via the rust-vmm `vhost` crate's request-handler trait),
//! guest memory mapping, virtio-blk request parsing and validation, and the polling I/O
//! workers that own their virtqueues and device queues.
//!
//! Must not know: how the pool allocates extents or stores metadata (it only reads a
//! [`VolumeLayout`]), how devices implement I/O (it only uses `DeviceQueue`), or anything of
//! the control plane (config files, RPC).

mod backing;
pub mod blk_config;
pub mod dirty_log;
pub mod hostmem;
pub mod memory;
pub mod qos;
mod queue_start;
pub mod ratelimit;
pub mod request;
mod server;
mod session;
pub mod share;
pub mod stats;
pub mod vring;
pub mod witness;
pub mod worker;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use spool_pool::VolumeLayout;

pub use server::{listen_key, session_key, AdmissionHold, Restore, VolumeServer};
pub use session::{
    RestoreClock, RestoreError, Session, SessionState, MAX_QUEUE_SIZE, SESSION_STATE_FORMAT,
};

/// Where a server deposits what must outlive this process (the keeper, in spoold): named
/// values with descriptors. The store gets its own copies of the descriptors.
pub trait StateStore: Send + Sync {
    /// Stores (replaces) `key`. An error means the store still holds the previous value
    /// (or none): the caller must not rely on it.
    fn put(&self, key: &str, value: String, fds: &[std::os::fd::RawFd]) -> std::io::Result<()>;
    /// Forgets every key starting with `prefix`.
    fn remove(&self, prefix: &str) -> std::io::Result<()>;
}

/// What this process measures of its own (re)start, shared by every volume's server and
/// workers and read by the daemon for its restart-phase report: a handle passed down in
/// [`FrontendSettings`], not a process global.
#[derive(Debug, Default)]
pub struct StartClock {
    restore: std::sync::Mutex<RestoreClock>,
    first_completion: std::sync::OnceLock<std::time::SystemTime>,
}

impl StartClock {
    pub(crate) fn add_restore(&self, c: RestoreClock) {
        let mut t = self.restore.lock().unwrap_or_else(|p| p.into_inner());
        t.map_memory += c.map_memory;
        t.recover_queues += c.recover_queues;
    }

    /// Time spent so far restoring kept sessions (summed over volumes).
    pub fn restore(&self) -> RestoreClock {
        *self.restore.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn note_first_completion(&self) {
        let _ = self.first_completion.set(std::time::SystemTime::now());
    }

    /// When this process first completed a request to a guest (None before that).
    pub fn first_completion(&self) -> Option<std::time::SystemTime> {
        self.first_completion.get().copied()
    }
}

/// Tunables of the data path.
#[derive(Debug, Clone)]
pub struct FrontendSettings {
    /// How long a worker keeps polling after its last request before it sleeps on the kick
    /// eventfd (0 = purely event-driven; large = always polling).
    pub poll_idle: Duration,
    /// Directory of the per-queue journals (a tmpfs such as /dev/shm). `None` runs without
    /// a journal (the paper's Spool-NoJ): only for measuring the journal's overhead.
    pub journal_dir: Option<PathBuf>,
    /// A request on a device longer than this is reported as a timeout (a path error: the
    /// device is reset and the request resubmitted).
    pub io_timeout: Duration,
    /// How often one request is resubmitted after path errors before it fails on its own.
    pub request_retries: u32,
    /// Most descriptors one [`StateStore::put`] carries (the keeper's per-message limit):
    /// bounds the memory slots a session is offered.
    pub state_fd_limit: usize,
    /// Where servers and workers record restore time and the first completion.
    pub clock: Arc<StartClock>,
    /// The volumes sharing this process's cores and devices by weight (one per daemon).
    pub share_group: Arc<share::ShareGroup>,
    /// Whether workers hold their volume to its fair share (docs/qos.md).
    pub fair_share: bool,
    /// How many threads serve one volume's queues (queue `i` is served by thread
    /// `i % volume_threads`, so a volume with fewer queues has fewer threads); 0: a thread per
    /// queue (docs/qos.md, "Scaling").
    pub volume_threads: usize,
    /// Who claims devices that other hosts can open too (`PoolDevice::claim`: RBD images)
    /// before serving from them: one spoold, the same across its restarts (spoold uses its
    /// pool's UUID). Empty: claim nothing.
    pub owner: String,
    /// How long a queue start waits for another host to give a claimed device back (a
    /// migration's source draining) before the frontend is refused.
    pub claim_wait: Duration,
    /// Where workers record every guest page they write (`[debug] write_witness`), if
    /// anywhere.
    pub write_witness: Option<Arc<witness::WriteWitness>>,
}

impl Default for FrontendSettings {
    fn default() -> Self {
        FrontendSettings {
            poll_idle: Duration::from_micros(50),
            journal_dir: Some(PathBuf::from("/dev/shm/spool")),
            io_timeout: Duration::from_secs(30),
            request_retries: 3,
            state_fd_limit: 250,
            clock: Arc::default(),
            share_group: Arc::default(),
            fair_share: true,
            volume_threads: 0,
            owner: String::new(),
            claim_wait: Duration::from_secs(10),
            write_witness: None,
        }
    }
}

/// What every connection of one volume shares: its current layout (swapped on resize or
/// when its limits change), its QoS buckets and the settings.
pub struct VolumeContext {
    name: String,
    layout: Arc<ArcSwap<VolumeLayout>>,
    /// The layouts replaced, while someone (a queue) may still hold them.
    replaced: std::sync::Mutex<Vec<std::sync::Weak<VolumeLayout>>>,
    qos: Arc<qos::VolumeQos>,
    settings: FrontendSettings,
    fault: Arc<SessionFault>,
    abandoned: Arc<std::sync::atomic::AtomicU64>,
    stats: Arc<stats::VolumeStats>,
    share: Arc<share::VolumeShare>,
    /// The threads serving the volume's queues (`settings.volume_threads` of them, started
    /// as their first queue starts).
    groups: std::sync::Mutex<Vec<Option<worker::PollGroup>>>,
    /// What must end before a frontend's queue of the volume starts (a transfer writing
    /// the volume: docs/transfer.md), run once at the next queue start; and whether a
    /// frontend's queues run (from the first start to the stop of the last).
    before_serving: std::sync::Mutex<(Vec<BeforeServing>, bool)>,
}

/// Run once before a frontend's queue of a volume starts ([`VolumeContext::on_serving`]).
pub type BeforeServing = Box<dyn FnOnce() + Send>;

impl Drop for VolumeContext {
    fn drop(&mut self) {
        self.settings.share_group.leave(&self.share);
    }
}

/// How a worker tells the volume's serving thread that the session must end: the frontend's
/// memory faulted under it (a truncated memfd). The serving thread watches the eventfd and
/// closes that connection only.
#[derive(Debug)]
pub struct SessionFault {
    efd: Option<vmm_sys_util::eventfd::EventFd>,
}

impl SessionFault {
    fn new() -> Self {
        SessionFault {
            efd: vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).ok(),
        }
    }

    /// Asks the serving thread to close the connection.
    pub fn raise(&self) {
        if let Some(e) = &self.efd {
            let _ = e.write(1);
        }
    }

    /// Whether it was raised since the last call (clears it).
    pub fn take(&self) -> bool {
        self.efd.as_ref().is_some_and(|e| e.read().is_ok())
    }

    /// The eventfd to watch (None if it could not be created: faults then only stop the
    /// queue, and the connection stays open until the frontend closes it).
    pub fn fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.efd.as_ref().map(|e| e.as_raw_fd())
    }
}

impl VolumeContext {
    /// Context for a volume.
    pub fn new(layout: VolumeLayout, settings: FrontendSettings) -> Arc<Self> {
        let layout_queues = layout.num_queues;
        let share = settings
            .share_group
            .join(layout.qos.map_or(0, |q| q.weight));
        Arc::new(VolumeContext {
            name: layout.name.clone(),
            qos: Arc::new(qos::VolumeQos::new(layout.qos.as_ref())),
            layout: Arc::new(ArcSwap::from_pointee(layout)),
            replaced: Default::default(),
            settings,
            fault: Arc::new(SessionFault::new()),
            abandoned: Arc::default(),
            stats: Arc::new(stats::VolumeStats::new(layout_queues)),
            share,
            groups: Default::default(),
            before_serving: Default::default(),
        })
    }

    /// Registers `f` to run, once, before a frontend's next queue start on this volume
    /// (before its claim and its first request): what writes the volume behind the guest's
    /// back ends there. Refused (`f` given back) while a frontend's queues run.
    pub fn on_serving(&self, f: BeforeServing) -> Result<(), BeforeServing> {
        let mut s = self
            .before_serving
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if s.1 {
            return Err(f);
        }
        s.0.push(f);
        Ok(())
    }

    /// A queue is about to start: from now on the frontend's queues run; runs what
    /// [`Self::on_serving`] registered.
    pub(crate) fn serving(&self) {
        let hooks = {
            let mut s = self
                .before_serving
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            s.1 = true;
            std::mem::take(&mut s.0)
        };
        for f in hooks {
            f();
        }
    }

    /// No queue of the volume runs any more (the frontend stopped them all, or went away).
    pub(crate) fn not_serving(&self) {
        self.before_serving
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .1 = false;
    }

    /// Volume name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The volume's layout, as workers see it.
    pub fn layout(&self) -> Arc<ArcSwap<VolumeLayout>> {
        self.layout.clone()
    }

    /// Publishes a new layout (after a resize, a replaced device, new I/O limits); running
    /// workers pick it up on their next poll round. New limits apply to the volume's
    /// buckets at once, keeping what they hold.
    /// A layout older (by its pool generation) than the one the queues have is dropped: it
    /// was made before a change and published after it.
    pub fn update_layout(&self, layout: VolumeLayout) {
        let new = Arc::new(layout);
        let before = self
            .layout
            .rcu(|cur| match new.generation >= cur.generation {
                true => new.clone(),
                false => cur.clone(),
            });
        if before.generation > new.generation {
            tracing::info!(volume = %self.name, generation = new.generation, newer = before.generation, "a layout made before the one in use was published late; dropped");
            return;
        }
        self.qos.configure(new.qos.as_ref(), self.qos.now());
        self.share.set_weight(new.qos.map_or(0, |q| q.weight));
        let mut replaced = self.replaced.lock().unwrap_or_else(|p| p.into_inner());
        replaced.retain(|w| w.strong_count() > 0);
        replaced.push(Arc::downgrade(&before));
    }

    /// Whether a layout made before pool generation `generation` may still be in use here:
    /// the one the queues are given, or one replaced that someone holds (each queue drops
    /// its layout only after its requests on that layout's devices are done). Once not,
    /// no queue of the volume can reach what a commit of that generation took out.
    pub fn holds_layout_older_than(&self, generation: u64) -> bool {
        if self.layout.load().generation < generation {
            return true;
        }
        let mut replaced = self.replaced.lock().unwrap_or_else(|p| p.into_inner());
        replaced.retain(|w| w.strong_count() > 0);
        replaced
            .iter()
            .filter_map(|w| w.upgrade())
            .any(|l| l.generation < generation)
    }

    /// The thread that serves queue `index`: None when each queue has a thread of its own
    /// (`volume_threads` = 0).
    pub(crate) fn poll_group(&self, index: u16) -> std::io::Result<Option<worker::PollGroup>> {
        let n = self.settings.volume_threads;
        if n == 0 {
            return Ok(None);
        }
        let slot = index as usize % n;
        let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        if groups.len() < n {
            groups.resize_with(n, || None);
        }
        if groups[slot].is_none() {
            // Named after the first queue it serves: "q0-web" serves queues 0, n, 2n...
            let name = format!("q{slot}-{}", self.name);
            groups[slot] = Some(worker::PollGroup::new(
                &name,
                self.settings.share_group.clone(),
            )?);
        }
        Ok(groups[slot].as_ref().map(|g| g.handle()))
    }

    /// The token buckets every queue of the volume shares (inactive without limits).
    pub fn qos(&self) -> &Arc<qos::VolumeQos> {
        &self.qos
    }

    /// Number of queues offered.
    pub fn num_queues(&self) -> u16 {
        self.layout.load().num_queues
    }

    /// GET_ID serial: the volume UUID's first 20 characters.
    pub fn serial(&self) -> [u8; request::ID_LEN] {
        let mut s = [0u8; request::ID_LEN];
        let u = self.layout.load().uuid.simple().to_string();
        let n = u.len().min(s.len());
        s[..n].copy_from_slice(&u.as_bytes()[..n]);
        s
    }

    /// The volume's UUID.
    pub fn uuid(&self) -> uuid::Uuid {
        self.layout.load().uuid
    }

    /// Data-path settings.
    pub fn settings(&self) -> &FrontendSettings {
        &self.settings
    }

    /// Device commands of this volume that never completed and were quarantined: while any
    /// exist, the volume's extents must not be given to another volume (a late write would
    /// land in its data).
    pub fn abandoned_io(&self) -> u64 {
        self.abandoned.load(std::sync::atomic::Ordering::Acquire)
    }

    pub(crate) fn abandoned_counter(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.abandoned.clone()
    }

    /// The volume's I/O counters (per queue; `snapshot` sums them).
    pub fn stats(&self) -> &Arc<stats::VolumeStats> {
        &self.stats
    }

    /// The volume's fair share (weight, virtual clock) in the process's group.
    pub fn share(&self) -> &Arc<share::VolumeShare> {
        &self.share
    }

    /// The signal that ends the current session after a fault in its memory.
    pub fn fault(&self) -> &Arc<SessionFault> {
        &self.fault
    }
}

#[cfg(test)]
mod context_tests;
