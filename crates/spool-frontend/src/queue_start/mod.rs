//! Starting one virtqueue: from what the frontend configured to a running worker.
//!
//! build the queue (size, ring addresses translated and validated, the ring's indices read)
//! → open the queue's journal and decide where it resumes (the journal, not SET_VRING_BASE,
//! decides; a replay record marks what is being resubmitted) → the queue's limits → spawn
//! the worker.
//!
//! Owns: these steps and their errors, and the one decision of where a queue resumes
//! (`resume`). Must not know: the vhost-user protocol (the session
//! hands over a [`QueueConfig`]), how the worker serves requests.

use std::fs::File;
use std::sync::Arc;

use arc_swap::{ArcSwap, ArcSwapOption};
use virtio_queue::{Queue, QueueT};

use crate::blk_config;
use crate::memory::GuestMemory;
use crate::request::{Limits, SECTOR};
use crate::worker::{WorkerHandle, WorkerSpec};
use crate::VolumeContext;
use spool_journal::{Journal, MemoryId, ReplayRecord, RingAddrs};

mod resume;

pub use resume::{resume, ring_indices, ResumeFrom, RingView};

/// Largest virtqueue we accept (libblkio and QEMU use up to 1024; the spec allows 32768).
pub const MAX_QUEUE_SIZE: u16 = 32768;

/// What the frontend configured for one queue (front-end virtual addresses of the rings).
pub struct QueueConfig<'a> {
    pub index: u16,
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    /// SET_VRING_BASE (or 0).
    pub base: u16,
    pub kick: Option<&'a File>,
    pub call: Arc<ArcSwapOption<File>>,
    pub event_idx: bool,
    /// The session was restored in a new process (no SET_VRING_BASE was sent to it).
    pub restored: bool,
    /// The memory object holding the rings (None: unknown).
    pub memory: Option<MemoryId>,
}

/// Why a queue did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The frontend's configuration cannot be honoured.
    #[error("queue {index}: {why}")]
    Invalid { index: u16, why: String },
    #[error("queue {index}: {source}")]
    Journal {
        index: u16,
        #[source]
        source: spool_journal::Error,
    },
    #[error("queue {index}: cannot start worker: {source}")]
    Worker {
        index: u16,
        #[source]
        source: std::io::Error,
    },
}

/// Where a queue resumes, and what it must resubmit or fail first.
struct Resumption {
    /// The journal recovered the queue (Algorithm 2) rather than starting it afresh.
    recovered: bool,
    journal: Option<Journal>,
    next_avail: u16,
    resubmit: Vec<u16>,
    poison: Vec<u16>,
    replay: Option<ReplayRecord>,
}

/// Starts queue `cfg.index` of `ctx`'s volume on guest memory `mem`: the steps above.
pub fn start_queue(
    ctx: &VolumeContext,
    cfg: QueueConfig<'_>,
    mem: Arc<ArcSwap<GuestMemory>>,
    vva_to_gpa: impl Fn(u64) -> Option<u64>,
) -> Result<WorkerHandle, StartError> {
    let index = cfg.index;
    let invalid = |why: String| StartError::Invalid { index, why };
    let (mut q, view) = build_queue(&cfg, &mem, vva_to_gpa)?;
    let r = resume_queue(ctx, &cfg, view)?;
    if !cfg.restored && !r.recovered {
        check_base(ctx, index, view, cfg.base);
    }
    q.set_next_avail(r.next_avail);
    let kick = cfg
        .kick
        .and_then(|k| k.try_clone().ok())
        .ok_or_else(|| invalid("kick fd missing".into()))?;
    let layout = ctx.layout();
    let limits = queue_limits(&layout.load());
    let spec = WorkerSpec {
        index,
        queue: q,
        journal: r.journal,
        resubmit: r.resubmit,
        mem,
        kick,
        call: cfg.call.clone(),
        layout,
        limits,
        serial: ctx.serial(),
        poll_idle: ctx.settings().poll_idle,
        io_timeout: ctx.settings().io_timeout,
        request_retries: ctx.settings().request_retries,
        volume: ctx.name().to_string(),
        fault: ctx.fault().clone(),
        abandoned: ctx.abandoned_counter(),
        clock: ctx.settings().clock.clone(),
        replay: r.replay,
        poison: r.poison,
        qos: ctx.qos().clone(),
        stats: ctx.stats().clone(),
        share: ctx.share().clone(),
        share_group: ctx.settings().share_group.clone(),
        fair_share: ctx.settings().fair_share,
        witness: ctx.settings().write_witness.clone(),
    };
    let worker_error = |source| StartError::Worker { index, source };
    let w = match ctx.poll_group(index).map_err(worker_error)? {
        Some(group) => WorkerHandle::spawn_in(&group, spec),
        None => WorkerHandle::spawn(spec),
    }
    .map_err(worker_error)?;
    tracing::info!(volume = %ctx.name(), queue = index, size = cfg.size, next_avail = r.next_avail, used_idx = view.used_idx, "queue started");
    Ok(w)
}

/// The queue with its size and ring addresses, checked against guest memory, and what the
/// ring says now. The used index the guest sees is authoritative for where completions
/// continue.
fn build_queue(
    cfg: &QueueConfig<'_>,
    mem: &Arc<ArcSwap<GuestMemory>>,
    vva_to_gpa: impl Fn(u64) -> Option<u64>,
) -> Result<(Queue, RingView), StartError> {
    let index = cfg.index;
    let invalid = |why: String| StartError::Invalid { index, why };
    // The ring's size must be known (SET_VRING_NUM) before anything of the ring is used:
    // the journal and the worker's in-flight table are sized by it, and head indices are
    // masked with it.
    if cfg.size == 0 || cfg.size > MAX_QUEUE_SIZE || !cfg.size.is_power_of_two() {
        return Err(invalid(format!(
            "cannot start without a valid size (SET_VRING_NUM {} )",
            if cfg.size == 0 {
                "was never sent".to_string()
            } else {
                format!("gave {}", cfg.size)
            }
        )));
    }
    let tr = |a: u64, what: &str| {
        vva_to_gpa(a)
            .ok_or_else(|| invalid(format!("{what} address {a:#x} is not in guest memory")))
    };
    let rings = RingAddrs {
        desc: tr(cfg.desc, "descriptor")?,
        avail: tr(cfg.avail, "avail")?,
        used: tr(cfg.used, "used")?,
    };
    let mut q = Queue::new(MAX_QUEUE_SIZE).map_err(|e| invalid(format!("{e:?}")))?;
    q.set_size(cfg.size);
    q.set_desc_table_address(Some(rings.desc as u32), Some((rings.desc >> 32) as u32));
    q.set_avail_ring_address(Some(rings.avail as u32), Some((rings.avail >> 32) as u32));
    q.set_used_ring_address(Some(rings.used as u32), Some((rings.used >> 32) as u32));
    q.set_event_idx(cfg.event_idx);
    q.set_ready(true);
    let guard = mem.load_full();
    if !q.is_valid(guard.map()) {
        return Err(invalid(format!(
            "size {} or ring addresses invalid",
            cfg.size
        )));
    }
    let (avail_idx, used_idx) =
        ring_indices(&q, &guard).map_err(|_| invalid("rings unreadable".into()))?;
    if guard.faulted() {
        return Err(invalid(
            "guest memory faulted (its file was truncated?)".into(),
        ));
    }
    q.set_next_used(used_idx);
    let view = RingView {
        rings,
        size: cfg.size,
        avail_idx,
        used_idx,
        memory: cfg.memory,
    };
    Ok((q, view))
}

/// Where the queue resumes (Algorithm 2): without a journal (Spool-NoJ) at the frontend's
/// base, or the used index after a restore; with one, where the journal says.
fn resume_queue(
    ctx: &VolumeContext,
    cfg: &QueueConfig<'_>,
    view: RingView,
) -> Result<Resumption, StartError> {
    let index = cfg.index;
    let Some(dir) = &ctx.settings().journal_dir else {
        return Ok(Resumption {
            recovered: false,
            journal: None,
            next_avail: if cfg.restored {
                view.used_idx
            } else {
                cfg.base
            },
            resubmit: Vec::new(),
            poison: Vec::new(),
            replay: None,
        });
    };
    let journal_err = |source| StartError::Journal { index, source };
    let (mut j, _) =
        Journal::open_or_create(dir, ctx.uuid(), index, cfg.size).map_err(journal_err)?;
    let from = if cfg.restored {
        ResumeFrom::Restored
    } else {
        ResumeFrom::Frontend(cfg.base)
    };
    let r = resume(&mut j, view, from, &mut |_| {}).map_err(journal_err)?;
    if let Some(n) = &r.note {
        tracing::warn!(volume = %ctx.name(), queue = index, "{n}");
    }
    if r.recovered {
        tracing::info!(volume = %ctx.name(), queue = index, next_avail = r.next_avail, used_idx = view.used_idx, inflight = r.resubmit.len(), "recovered queue from its journal");
        ctx.stats().queue(index).recovered();
    }
    let (resubmit, poison, replay) = begin_replay(ctx, index, &mut j, r.resubmit);
    Ok(Resumption {
        recovered: r.recovered,
        journal: Some(j),
        next_avail: r.next_avail,
        resubmit,
        poison,
        replay,
    })
}

/// Checks, on a fresh start (a migration's destination, `cont`, a reconnect), the other side
/// of GET_VRING_BASE's promise (docs/failures.md, "Stopping a queue"): every request below
/// the base is in the used ring, so the used index the guest sees equals the base. Ahead of
/// it, whoever served the ring before took requests it never completed, and the guest waits
/// for them for ever. They cannot be served here: virtio-blk completes out of order, so the
/// rings do not tell which of the heads taken are the lost ones. The log says so, loudly,
/// with the numbers (the migration test fails on it).
fn check_base(ctx: &VolumeContext, index: u16, view: RingView, base: u16) {
    let lost = base.wrapping_sub(view.used_idx);
    if lost == 0 {
        return;
    }
    if lost <= view.size {
        tracing::error!(volume = %ctx.name(), queue = index, base, used_idx = view.used_idx, lost, "requests below the frontend's base were never completed by the backend that took them: the guest waits for them (which they are, the rings cannot tell)");
    } else {
        tracing::error!(volume = %ctx.name(), queue = index, base, used_idx = view.used_idx, size = view.size, "the frontend's base and the used index the guest sees are inconsistent (no backend that completes what it takes leaves them so): starting at the base");
    }
}

/// Records the heads about to be resubmitted; heads whose replay crashed the previous
/// process are failed instead (returned as poison). Returns (resubmit, poison, record).
fn begin_replay(
    ctx: &VolumeContext,
    index: u16,
    j: &mut Journal,
    resubmit: Vec<u16>,
) -> (Vec<u16>, Vec<u16>, Option<ReplayRecord>) {
    if resubmit.is_empty() {
        return (resubmit, Vec::new(), None);
    }
    match j.begin_replay(&resubmit) {
        Ok((rec, true)) => {
            tracing::error!(volume = %ctx.name(), queue = index, heads = ?resubmit, "the previous worker crashed replaying these requests: failing them instead of replaying them again");
            (Vec::new(), resubmit, Some(rec))
        }
        Ok((rec, false)) => (resubmit, Vec::new(), Some(rec)),
        Err(e) => {
            tracing::warn!(volume = %ctx.name(), queue = index, "{e}; replaying without a record (a request that crashes every worker would be replayed again)");
            (resubmit, Vec::new(), None)
        }
    }
}

/// What a queue of this volume accepts.
fn queue_limits(layout: &spool_pool::VolumeLayout) -> Limits {
    Limits {
        capacity_sectors: layout.size / SECTOR,
        read_only: layout.read_only,
        max_data: blk_config::SIZE_MAX as u64 * blk_config::SEG_MAX as u64,
        max_discard_segs: blk_config::MAX_DISCARD_SEG,
        max_discard_sectors: blk_config::MAX_DISCARD_SECTORS,
    }
}
