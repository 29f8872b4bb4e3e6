//! One vhost-user connection: the frontend's negotiated state and the queue workers it starts.
//!
//! Built on the rust-vmm `vhost` crate's low-level request handler trait (not
//! `vhost-user-backend`), so that queue state stays ours: the journal and the upgrade handoff
//! need to own where each ring resumes. Any message we cannot honour returns an error, which
//! makes the connection loop close this connection only. What a restarted process needs to
//! continue the connection (the kept state, snapshot and restore) is in `session/kept.rs`.

use std::fs::File;
use std::io::Write;
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use vhost::vhost_user::message::*;
use vhost::vhost_user::{
    Backend, Error as VhostError, Result as VhostResult, VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;

use spool_devices::{Device, PoolDevice};

use crate::blk_config::{self, VHOST_F_LOG_ALL};
use crate::dirty_log::DirtyLog;
use crate::memory::MemoryTable;
use crate::queue_start::{start_queue, QueueConfig, StartError};
use crate::worker::WorkerHandle;
use crate::VolumeContext;

mod kept;
pub use kept::{RestoreClock, RestoreError, SessionState, SESSION_STATE_FORMAT};

pub use crate::queue_start::MAX_QUEUE_SIZE;

/// How often a session waiting for its workers to finish the rounds they were in when a
/// dirty log was published (`wait_for_workers_on_new_map`) says it still waits: a round
/// takes microseconds, a worker thread preempted on a crowded host some milliseconds; one
/// that never passes is a wedged worker, which the keeper's watchdog replaces.
const PASS_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

#[derive(Default)]
struct Vring {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    base: u16,
    kick: Option<File>,
    call: Arc<ArcSwapOption<File>>,
    err: Option<File>,
    enabled: bool,
    started: bool,
    worker: Option<WorkerHandle>,
    /// How long the last stop of this ring's worker took (its drain), until GET_VRING_BASE
    /// reports it: in a migration, part of the guest's downtime.
    drained_in: Option<std::time::Duration>,
}

/// State of one frontend connection.
pub struct Session {
    ctx: Arc<VolumeContext>,
    acked_features: u64,
    acked_protocol: u64,
    mem: MemoryTable,
    vrings: Vec<Vring>,
    /// The devices this session claimed for this host before its first queue started
    /// (`PoolDevice::claim`: an RBD image other hosts could serve), given back when the
    /// frontend has stopped every queue or gone away. Empty: nothing claimed.
    claimed: Vec<Arc<Device>>,
}

fn invalid(msg: &str, ctx: &VolumeContext) -> VhostError {
    tracing::warn!(volume = %ctx.name(), "vhost-user: {msg}");
    VhostError::InvalidParam
}

impl Session {
    /// A fresh session for a new connection.
    pub fn new(ctx: Arc<VolumeContext>) -> Self {
        let n = ctx.num_queues() as usize;
        // The state deposit carries the connection, three eventfds per queue and one
        // descriptor per region, and the dirty log's, in one message: advertise only slots
        // that fit, so a session is never kept with a stale memory table.
        let fit = (ctx.settings().state_fd_limit as u64).saturating_sub(2 + 3 * n as u64);
        Session {
            mem: MemoryTable::with_limit(fit),
            ctx,
            acked_features: 0,
            acked_protocol: 0,
            vrings: (0..n).map(|_| Vring::default()).collect(),
            claimed: Vec::new(),
        }
    }

    fn vring(&mut self, index: u32) -> VhostResult<&mut Vring> {
        let ctx = self.ctx.clone();
        self.vrings
            .get_mut(index as usize)
            .ok_or_else(|| invalid(&format!("queue index {index} out of range"), &ctx))
    }

    fn protocol_negotiated(&self) -> bool {
        self.acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0
    }

    /// Waits until every running worker finished the round it was in: rounds begun before
    /// the call may still write into guest memory under the map they loaded, without the
    /// dirty log just published. QEMU syncs the log (and sends the pages it names) as soon as
    /// SET_FEATURES or SET_LOG_BASE is answered; a write made after that under the old map
    /// would reach the guest on this host only, so the answer waits for as long as it takes
    /// (warning every [`PASS_WAIT`]): a worker that never passes is wedged, and the keeper's
    /// watchdog replaces the process.
    fn wait_for_workers_on_new_map(&self) {
        let tickets: Vec<_> = self
            .vrings
            .iter()
            .filter_map(|v| v.worker.as_ref())
            .map(|w| (w, w.ask_pass()))
            .collect();
        let start = std::time::Instant::now();
        let mut warned = start;
        while !tickets.iter().all(|(w, t)| w.passed(*t)) {
            if warned.elapsed() >= PASS_WAIT {
                warned = std::time::Instant::now();
                tracing::warn!(volume = %self.ctx.name(), waited_ms = start.elapsed().as_millis() as u64, "a worker has not finished its round for the dirty log yet; the frontend waits for it");
            }
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }

    fn stop_worker(&mut self, index: usize) {
        self.stop_worker_as(index, false);
    }

    /// Stops ring `index`'s worker: for the frontend (every request it took is completed
    /// first) or, with `handoff`, for the next worker process (held requests stay in the
    /// journal).
    fn stop_worker_as(&mut self, index: usize, handoff: bool) {
        let v = &mut self.vrings[index];
        if let Some(w) = v.worker.take() {
            let t = std::time::Instant::now();
            let q = if handoff {
                w.stop_for_handoff()
            } else {
                w.stop()
            };
            if let Some(q) = q {
                v.base = q.next_avail();
            }
            v.drained_in = Some(t.elapsed());
        }
    }

    /// Asks every running worker to take the device-reset path (resubmit from the journal).
    pub fn device_reset(&self) {
        for v in &self.vrings {
            if let Some(w) = &v.worker {
                w.device_reset();
            }
        }
    }

    /// Stops every worker (disconnect, reset): every request taken is completed.
    pub fn stop_all(&mut self) {
        for i in 0..self.vrings.len() {
            self.stop_worker(i);
        }
    }

    /// Stops every worker for an upgrade's handoff, the connection kept for the next
    /// process: what a resetting device holds stays INFLIGHT in the journals.
    pub fn stop_all_for_handoff(&mut self) {
        for i in 0..self.vrings.len() {
            self.stop_worker_as(i, true);
        }
    }

    /// Features the frontend acked (virtio, protocol).
    pub fn acked(&self) -> (u64, u64) {
        (self.acked_features, self.acked_protocol)
    }

    /// Claims the volume's devices for this host before its first queue starts (trusted
    /// when continuing a session an earlier process of this spoold had claimed them for).
    fn claim(&mut self, trusted: bool) -> Result<(), spool_devices::Error> {
        let owner = &self.ctx.settings().owner;
        if !self.claimed.is_empty() || owner.is_empty() {
            return Ok(());
        }
        let layout = self.ctx.layout().load_full();
        let wait = self.ctx.settings().claim_wait;
        for d in &layout.devices {
            if let Err(e) = d.claim(owner, trusted, wait) {
                self.release_claims();
                return Err(e);
            }
            self.claimed.push(d.clone());
        }
        tracing::info!(volume = %self.ctx.name(), trusted, "volume claimed for this host");
        Ok(())
    }

    /// Gives the claims back once no queue runs (the frontend stopped them all, drained, or
    /// went away): another host may serve the volume from now on.
    pub(crate) fn release_claims(&mut self) {
        if self.vrings.iter().any(|v| v.worker.is_some()) {
            return;
        }
        self.ctx.not_serving();
        let owner = &self.ctx.settings().owner;
        if !self.claimed.is_empty() {
            tracing::info!(volume = %self.ctx.name(), "volume claim given back");
        }
        for d in self.claimed.drain(..) {
            if let Err(e) = d.release_claim(owner) {
                tracing::warn!(volume = %self.ctx.name(), error = %e, "cannot give back the claim on a device");
            }
        }
    }

    /// Marks ring `index`'s whole used ring in the dirty log when the frontend logs (after
    /// its worker stopped: the last completions and avail_event are in it).
    fn log_used_ring(&self, index: usize) {
        let v = &self.vrings[index];
        let mem = self.mem.shared().load_full();
        if let (Some(log), Some(used)) = (mem.dirty_log(), self.mem.vva_to_gpa(v.used)) {
            log.mark(used.0, 4 + 8 * v.size as u64 + 2);
        }
    }

    fn maybe_start(&mut self, index: usize, restored: bool) -> VhostResult<()> {
        let v = &self.vrings[index];
        if !v.started || !v.enabled || v.worker.is_some() {
            return Ok(());
        }
        self.ctx.serving();
        if let Err(why) = self.claim(restored) {
            return Err(invalid(
                &format!("volume cannot be served by this host now: {why}"),
                &self.ctx,
            ));
        }
        let v = &self.vrings[index];
        let cfg = QueueConfig {
            index: index as u16,
            size: v.size,
            desc: v.desc,
            avail: v.avail,
            used: v.used,
            base: v.base,
            kick: v.kick.as_ref(),
            call: v.call.clone(),
            event_idx: self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0,
            restored,
            memory: self.mem.memory_id(v.used),
        };
        let mem = &self.mem;
        match start_queue(&self.ctx, cfg, mem.shared(), |a| {
            mem.vva_to_gpa(a).map(|g| g.0)
        }) {
            Ok(w) => {
                self.vrings[index].worker = Some(w);
                Ok(())
            }
            Err(e @ StartError::Journal { .. }) => {
                tracing::error!(volume = %self.ctx.name(), queue = index, "{e}");
                self.release_claims();
                Err(VhostError::InvalidParam)
            }
            Err(e) => {
                self.release_claims();
                Err(invalid(&e.to_string(), &self.ctx))
            }
        }
    }

    fn reset(&mut self) {
        self.stop_all();
        self.release_claims();
        let n = self.vrings.len();
        self.vrings = (0..n).map(|_| Vring::default()).collect();
        self.acked_features = 0;
        if let Err(e) = self.mem.set_logging(false) {
            tracing::warn!(volume = %self.ctx.name(), error = %e, "cannot republish guest memory");
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop_all();
    }
}

impl VhostUserBackendReqHandlerMut for Session {
    fn set_owner(&mut self) -> VhostResult<()> {
        Ok(())
    }

    fn reset_owner(&mut self) -> VhostResult<()> {
        self.reset();
        Ok(())
    }

    fn reset_device(&mut self) -> VhostResult<()> {
        self.reset();
        Ok(())
    }

    fn get_features(&mut self) -> VhostResult<u64> {
        let layout = self.ctx.layout().load();
        Ok(blk_config::features(
            layout.read_only,
            layout.cipher.is_some(),
        ))
    }

    fn set_features(&mut self, features: u64) -> VhostResult<()> {
        let offered = self.get_features()?;
        if features & !offered != 0 {
            return Err(invalid(
                &format!("frontend acked features {features:#x} we did not offer"),
                &self.ctx,
            ));
        }
        self.acked_features = features;
        // QEMU turns VHOST_F_LOG_ALL on for the length of a live migration, queues running.
        let was_logging = self.mem.logging();
        self.mem
            .set_logging(features & VHOST_F_LOG_ALL != 0)
            .map_err(|e| invalid(&e.to_string(), &self.ctx))?;
        if self.mem.logging() && !was_logging {
            self.wait_for_workers_on_new_map();
        }
        if !self.protocol_negotiated() {
            // Without VHOST_USER_F_PROTOCOL_FEATURES rings are enabled from the start.
            for v in &mut self.vrings {
                v.enabled = true;
            }
        }
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy_listening: Option<bool>,
    ) -> VhostResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        self.mem
            .set(ctx, files)
            .map_err(|e| invalid(&e.to_string(), &self.ctx))?;
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VhostResult<()> {
        let ctx = self.ctx.clone();
        if num == 0 || num > MAX_QUEUE_SIZE as u32 || !num.is_power_of_two() {
            return Err(invalid(
                &format!("queue size {num} must be a power of two up to {MAX_QUEUE_SIZE}"),
                &ctx,
            ));
        }
        self.vring(index)?.size = num as u16;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VhostResult<()> {
        // With VHOST_VRING_F_LOG the frontend asks that used-ring writes be logged at guest
        // address `log`: the used ring's own guest address, which the workers mark already.
        let _ = flags;
        let v = self.vring(index)?;
        v.desc = descriptor;
        v.used = used;
        v.avail = available;
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VhostResult<()> {
        let ctx = self.ctx.clone();
        if base > u16::MAX as u32 {
            return Err(invalid("vring base out of range", &ctx));
        }
        self.vring(index)?.base = base as u16;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VhostResult<VhostUserVringState> {
        self.vring(index)?;
        // Stopping drains: every request taken completes (and is logged) before the base is
        // reported, so a migration's destination resumes exactly where this ring ends.
        self.stop_worker(index as usize);
        self.log_used_ring(index as usize);
        self.release_claims();
        let v = &mut self.vrings[index as usize];
        v.started = false;
        // GET_VRING_BASE stops the ring; the kick fd is closed by the frontend.
        v.kick = None;
        let drain_ms = v.drained_in.take().map(|d| d.as_secs_f64() * 1e3);
        tracing::info!(volume = %self.ctx.name(), queue = index, base = v.base, drain_ms, "queue stopped");
        Ok(VhostUserVringState::new(index, v.base as u32))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        let i = index as u32;
        self.vring(i)?;
        self.stop_worker(index as usize);
        let v = &mut self.vrings[index as usize];
        let Some(fd) = fd else {
            return Err(invalid(
                "polling mode kick (no fd) is not supported",
                &self.ctx,
            ));
        };
        v.kick = Some(fd);
        v.started = true;
        self.maybe_start(index as usize, false)
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        let v = self.vring(index as u32)?;
        // QEMU sends the call fd after the kick that started the queue, and again whenever
        // the guest masks or unmasks the queue's vector, so completions made before it (a
        // migration's source draining, the first round here, a round signalling the old fd)
        // may not have been signalled to the guest: one interrupt, possibly spurious, lets
        // it see them. The fd is stored first: a completion after the store signals the new
        // fd itself, one before it is covered by this interrupt. (The other order left a
        // window where a completion signalled only the old fd, which with EVENT_IDX stalls
        // the queue for good: no later completion passes the guest's used_event again.)
        let fd = fd.map(Arc::new);
        v.call.store(fd.clone());
        if let (Some(f), true) = (&fd, v.worker.is_some()) {
            let _ = (&**f).write(&1u64.to_ne_bytes());
        }
        Ok(())
    }

    fn set_vring_err(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        self.vring(index as u32)?.err = fd;
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VhostResult<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::RESET_DEVICE
            | VhostUserProtocolFeatures::LOG_SHMFD)
    }

    fn set_protocol_features(&mut self, features: u64) -> VhostResult<()> {
        let offered = self.get_protocol_features()?.bits();
        if features & !offered != 0 {
            return Err(invalid(
                &format!("frontend acked protocol features {features:#x} we did not offer"),
                &self.ctx,
            ));
        }
        self.acked_protocol = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> VhostResult<u64> {
        Ok(self.vrings.len() as u64)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VhostResult<()> {
        self.vring(index)?.enabled = enable;
        if enable {
            self.maybe_start(index as usize, false)
        } else {
            self.stop_worker(index as usize);
            Ok(())
        }
    }

    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        _flags: VhostUserConfigFlags,
    ) -> VhostResult<Vec<u8>> {
        let l = self.ctx.layout().load();
        let space = blk_config::config_space(l.size, self.vrings.len() as u16, l.discard_alignment);
        let (off, size) = (offset as usize, size as usize);
        let mut out = vec![0u8; size];
        if off < space.len() {
            let n = (space.len() - off).min(size);
            out[..n].copy_from_slice(&space[off..off + n]);
        }
        Ok(out)
    }

    fn set_config(
        &mut self,
        _offset: u32,
        _buf: &[u8],
        _flags: VhostUserConfigFlags,
    ) -> VhostResult<()> {
        // Nothing in our config space is writable (CONFIG_WCE is not offered).
        Ok(())
    }

    fn set_backend_req_fd(&mut self, _backend: Backend) {}

    fn set_gpu_socket(&mut self, _gpu_backend: vhost::vhost_user::GpuBackend) -> VhostResult<()> {
        Err(VhostError::InvalidOperation("gpu socket"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VhostResult<File> {
        Err(VhostError::InvalidOperation("shared objects"))
    }

    fn get_inflight_fd(
        &mut self,
        _inflight: &VhostUserInflight,
    ) -> VhostResult<(VhostUserInflight, File)> {
        Err(VhostError::InvalidOperation("inflight fd"))
    }

    fn set_inflight_fd(&mut self, _inflight: &VhostUserInflight, _file: File) -> VhostResult<()> {
        Err(VhostError::InvalidOperation("inflight fd"))
    }

    fn get_max_mem_slots(&mut self) -> VhostResult<u64> {
        Ok(self.mem.limit())
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        _postcopy_listening: Option<bool>,
    ) -> VhostResult<Option<VhostUserMemoryRegionBase>> {
        self.mem
            .add(region, fd)
            .map_err(|e| invalid(&e.to_string(), &self.ctx))?;
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VhostResult<()> {
        self.mem
            .remove(region)
            .map_err(|e| invalid(&e.to_string(), &self.ctx))
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VhostResult<Option<File>> {
        Err(VhostError::InvalidOperation("device state"))
    }

    fn check_device_state(&mut self) -> VhostResult<()> {
        Err(VhostError::InvalidOperation("device state"))
    }

    fn get_shmem_config(&mut self) -> VhostResult<VhostUserShMemConfig> {
        Err(VhostError::InvalidOperation("shmem"))
    }

    fn set_log_base(&mut self, log: &VhostUserLog, file: File) -> VhostResult<()> {
        let map = DirtyLog::map(file, log.mmap_size, log.mmap_offset)
            .map_err(|e| invalid(&format!("dirty log: {e}"), &self.ctx))?;
        self.mem
            .set_log(map)
            .map_err(|e| invalid(&e.to_string(), &self.ctx))?;
        if self.mem.logging() {
            // A log replaced while logging (QEMU resizes it): marks must go to the new one
            // before QEMU syncs and drops the old one.
            self.wait_for_workers_on_new_map();
        }
        tracing::info!(volume = %self.ctx.name(), size = log.mmap_size, "dirty log set (live migration)");
        Ok(())
    }
}
