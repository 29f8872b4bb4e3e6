//! One vhost-user connection: the frontend's negotiated state and the queue workers it starts.
//!
//! Built on the rust-vmm `vhost` crate's low-level request handler trait (not
//! `vhost-user-backend`), so that queue state stays ours: the journal and the upgrade handoff
//! need to own where each ring resumes. Any message we cannot honour returns an error, which
//! makes the connection loop close this connection only. What a restarted process needs to
//! continue the connection (the kept state, snapshot and restore) is in `session/kept.rs`.

use std::fs::File;
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use vhost::vhost_user::message::*;
use vhost::vhost_user::{
    Backend, Error as VhostError, Result as VhostResult, VhostUserBackendReqHandlerMut,
};
use vhost::VhostUserMemoryRegionBase;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};

use crate::blk_config;
use crate::memory::MemoryTable;
use crate::request::{Limits, SECTOR};
use crate::vring::{resume, ring_indices, RingView};
use crate::worker::{WorkerHandle, WorkerSpec};
use crate::VolumeContext;
use spool_journal::{Journal, RingAddrs};

mod kept;
pub use kept::{RestoreClock, SessionState, SESSION_STATE_FORMAT};

/// Largest virtqueue we accept (libblkio and QEMU use up to 1024; the spec allows 32768).
pub const MAX_QUEUE_SIZE: u16 = 32768;

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
}

/// State of one frontend connection.
pub struct Session {
    ctx: Arc<VolumeContext>,
    acked_features: u64,
    acked_protocol: u64,
    mem: MemoryTable,
    vrings: Vec<Vring>,
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
        // descriptor per region in one message: advertise only slots that fit, so a session
        // is never kept with a stale memory table.
        let fit = (ctx.settings().state_fd_limit as u64).saturating_sub(1 + 3 * n as u64);
        Session {
            mem: MemoryTable::with_limit(fit),
            ctx,
            acked_features: 0,
            acked_protocol: 0,
            vrings: (0..n).map(|_| Vring::default()).collect(),
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

    fn stop_worker(&mut self, index: usize) {
        let v = &mut self.vrings[index];
        if let Some(w) = v.worker.take() {
            if let Some(q) = w.stop() {
                v.base = q.next_avail();
            }
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

    /// Stops every worker (disconnect, reset).
    pub fn stop_all(&mut self) {
        for i in 0..self.vrings.len() {
            self.stop_worker(i);
        }
    }

    /// Features the frontend acked (virtio, protocol).
    pub fn acked(&self) -> (u64, u64) {
        (self.acked_features, self.acked_protocol)
    }

    fn maybe_start(&mut self, index: usize, restored: bool) -> VhostResult<()> {
        let ctx = self.ctx.clone();
        let event_idx = self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let v = &self.vrings[index];
        if !v.started || !v.enabled || v.worker.is_some() {
            return Ok(());
        }
        // The ring's size must be known (SET_VRING_NUM) before anything of the ring is used:
        // the journal and the worker's in-flight table are sized by it, and head indices are
        // masked with it.
        if v.size == 0 || v.size > MAX_QUEUE_SIZE || !v.size.is_power_of_two() {
            return Err(invalid(
                &format!(
                    "queue {index}: cannot start without a valid size (SET_VRING_NUM {} )",
                    if v.size == 0 {
                        "was never sent".to_string()
                    } else {
                        format!("gave {}", v.size)
                    }
                ),
                &ctx,
            ));
        }
        let tr = |a: u64, what: &str| {
            self.mem.vva_to_gpa(a).ok_or_else(|| {
                invalid(
                    &format!("queue {index}: {what} address {a:#x} is not in guest memory"),
                    &ctx,
                )
            })
        };
        let (desc, avail, used) = (
            tr(v.desc, "descriptor")?,
            tr(v.avail, "avail")?,
            tr(v.used, "used")?,
        );
        let mut q = Queue::new(MAX_QUEUE_SIZE).map_err(|_| VhostError::InvalidParam)?;
        q.set_size(v.size);
        q.set_desc_table_address(Some(desc.0 as u32), Some((desc.0 >> 32) as u32));
        q.set_avail_ring_address(Some(avail.0 as u32), Some((avail.0 >> 32) as u32));
        q.set_used_ring_address(Some(used.0 as u32), Some((used.0 >> 32) as u32));
        q.set_event_idx(event_idx);
        q.set_ready(true);
        let mem = self.mem.shared();
        let guard = mem.load_full();
        if !q.is_valid(guard.map()) {
            return Err(invalid(
                &format!("queue {index}: size {} or ring addresses invalid", v.size),
                &ctx,
            ));
        }
        // The used index the guest sees is authoritative for where completions continue.
        let (avail_idx, used_idx) =
            ring_indices(&q, &guard).map_err(|_| invalid("rings unreadable", &ctx))?;
        if guard.faulted() {
            return Err(invalid(
                &format!("queue {index}: guest memory faulted (its file was truncated?)"),
                &ctx,
            ));
        }
        q.set_next_used(used_idx);
        drop(guard);
        // The journal, not SET_VRING_BASE, decides where the queue resumes (Algorithm 2).
        let mut next_avail = if restored { used_idx } else { v.base };
        let mut resubmit = Vec::new();
        let mut poison = Vec::new();
        let mut replay = None;
        let journal = match &ctx.settings().journal_dir {
            None => None,
            Some(dir) => {
                let (mut j, _) = Journal::open_or_create(dir, ctx.uuid(), index as u16, v.size)
                    .map_err(|e| {
                        tracing::error!(volume = %ctx.name(), queue = index, "{e}");
                        VhostError::InvalidParam
                    })?;
                let view = RingView {
                    rings: RingAddrs {
                        desc: desc.0,
                        avail: avail.0,
                        used: used.0,
                    },
                    size: v.size,
                    avail_idx,
                    used_idx,
                };
                // A restarted process has no SET_VRING_BASE: where the journal's ring is this
                // ring, the journal knows the next avail index (even with nothing in flight).
                let h = j.header();
                let base = if restored && h.rings == view.rings && h.queue_size == v.size {
                    j.last_avail()
                } else if restored {
                    used_idx
                } else {
                    v.base
                };
                let r = resume(&mut j, view, base, &mut |_| {}).map_err(|e| {
                    tracing::error!(volume = %ctx.name(), queue = index, "{e}");
                    VhostError::InvalidParam
                })?;
                if let Some(n) = &r.note {
                    tracing::warn!(volume = %ctx.name(), queue = index, "{n}");
                }
                if r.recovered {
                    tracing::info!(volume = %ctx.name(), queue = index, next_avail = r.next_avail, used_idx, inflight = r.resubmit.len(), "recovered queue from its journal");
                }
                next_avail = r.next_avail;
                resubmit = r.resubmit;
                if !resubmit.is_empty() {
                    match j.begin_replay(&resubmit) {
                        Ok((rec, crashed)) => {
                            if crashed {
                                tracing::error!(volume = %ctx.name(), queue = index, heads = ?resubmit, "the previous worker crashed replaying these requests: failing them instead of replaying them again");
                                poison = std::mem::take(&mut resubmit);
                            }
                            replay = Some(rec);
                        }
                        Err(e) => {
                            tracing::warn!(volume = %ctx.name(), queue = index, "{e}; replaying without a record (a request that crashes every worker would be replayed again)")
                        }
                    }
                }
                Some(j)
            }
        };
        q.set_next_avail(next_avail);
        let layout = ctx.layout();
        let cur = layout.load();
        let limits = Limits {
            capacity_sectors: cur.size / SECTOR,
            read_only: cur.read_only,
            max_data: blk_config::SIZE_MAX as u64 * blk_config::SEG_MAX as u64,
            max_discard_segs: blk_config::MAX_DISCARD_SEG,
            max_discard_sectors: blk_config::MAX_DISCARD_SECTORS,
        };
        drop(cur);
        let kick = v
            .kick
            .as_ref()
            .and_then(|k| k.try_clone().ok())
            .ok_or_else(|| invalid("kick fd missing", &ctx))?;
        let spec = WorkerSpec {
            index: index as u16,
            queue: q,
            journal,
            resubmit,
            mem,
            kick,
            call: v.call.clone(),
            layout,
            limits,
            serial: ctx.serial(),
            poll_idle: ctx.settings().poll_idle,
            io_timeout: ctx.settings().io_timeout,
            request_retries: ctx.settings().request_retries,
            volume: ctx.name().to_string(),
            fault: ctx.fault().clone(),
            abandoned: ctx.abandoned_counter(),
            replay,
            poison,
        };
        let w = WorkerHandle::spawn(spec)
            .map_err(|e| invalid(&format!("cannot start worker: {e}"), &ctx))?;
        tracing::info!(volume = %ctx.name(), queue = index, size = v.size, next_avail, "queue started");
        self.vrings[index].worker = Some(w);
        Ok(())
    }

    fn reset(&mut self) {
        self.stop_all();
        let n = self.vrings.len();
        self.vrings = (0..n).map(|_| Vring::default()).collect();
        self.acked_features = 0;
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
        Ok(blk_config::features(self.ctx.layout().load().read_only))
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
        if flags.contains(VhostUserVringAddrFlags::VHOST_VRING_F_LOG) {
            return Err(invalid("dirty logging is not supported", &self.ctx));
        }
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
        self.stop_worker(index as usize);
        let v = &mut self.vrings[index as usize];
        v.started = false;
        // GET_VRING_BASE stops the ring; the kick fd is closed by the frontend.
        v.kick = None;
        tracing::info!(volume = %self.ctx.name(), queue = index, base = v.base, "queue stopped");
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
        v.call.store(fd.map(Arc::new));
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
            | VhostUserProtocolFeatures::RESET_DEVICE)
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
        let space = blk_config::config_space(l.size, self.vrings.len() as u16);
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

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> VhostResult<()> {
        Err(VhostError::InvalidOperation("dirty logging"))
    }
}
