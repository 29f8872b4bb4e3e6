//! What a new process needs to continue a live connection: [`SessionState`] (the
//! negotiated state, JSON, deposited with the keeper after every message), the snapshot that
//! produces it and the restore that rebuilds a [`Session`] from it (memory mapped again,
//! queues recovered from their journals).

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vhost::vhost_user::message::VhostUserMemoryRegion;

use super::{Session, MAX_QUEUE_SIZE};
use crate::blk_config::VHOST_F_LOG_ALL;
use crate::dirty_log::{DirtyLog, LogError};
use crate::memory::MemoryError;
use crate::VolumeContext;

/// Version of [`SessionState`]; a worker refuses state of a newer format (the upgrade is then
/// refused and the old worker keeps serving). Documented in docs/upgrade.md.
pub const SESSION_STATE_FORMAT: u32 = 2;
/// The format of state without a dirty log, which binaries before format 2 read too.
const FORMAT_WITHOUT_LOG: u32 = 1;

/// Everything a new process needs to continue a live vhost-user connection, besides the
/// descriptors (which travel next to it; fields name their index in that list).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionState {
    pub format: u32,
    pub volume: uuid::Uuid,
    /// Descriptor index of the connected socket.
    pub conn: usize,
    pub acked_features: u64,
    pub acked_protocol: u64,
    pub regions: Vec<RegionState>,
    pub vrings: Vec<VringState>,
    /// A live migration's dirty log (format 2: a binary that could not keep marking it must
    /// refuse the state rather than continue the session without it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<LogState>,
}

/// The frontend's dirty log (SET_LOG_BASE).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogState {
    pub fd: usize,
    pub size: u64,
    pub offset: u64,
}

/// One guest memory region (as in SET_MEM_TABLE).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegionState {
    pub gpa: u64,
    pub size: u64,
    pub vva: u64,
    pub mmap_offset: u64,
    pub fd: usize,
}

/// One virtqueue's negotiated state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VringState {
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    /// Where the queue resumes if the journal cannot say (no journal, or another ring).
    pub base: u16,
    pub enabled: bool,
    pub started: bool,
    pub kick: Option<usize>,
    pub call: Option<usize>,
    pub err: Option<usize>,
}

impl Session {
    /// The state to keep across a restart, and the descriptors it refers to (index 0 is left
    /// for the connection, which the caller owns).
    pub fn snapshot(&self) -> (SessionState, Vec<RawFd>) {
        let mut fds: Vec<RawFd> = vec![-1];
        let mut push = |fd: RawFd| {
            fds.push(fd);
            fds.len() - 1
        };
        let regions = self
            .mem
            .regions()
            .into_iter()
            .map(|(r, fd)| RegionState {
                gpa: r.guest_phys_addr,
                size: r.memory_size,
                vva: r.user_addr,
                mmap_offset: r.mmap_offset,
                fd: push(fd),
            })
            .collect();
        let vrings = self
            .vrings
            .iter()
            .map(|v| VringState {
                size: v.size,
                desc: v.desc,
                avail: v.avail,
                used: v.used,
                base: v.base,
                enabled: v.enabled,
                started: v.started,
                kick: v.kick.as_ref().map(|f| push(f.as_raw_fd())),
                call: v.call.load().as_ref().map(|f| push(f.as_raw_fd())),
                err: v.err.as_ref().map(|f| push(f.as_raw_fd())),
            })
            .collect();
        let log = self.mem.log().map(|l| {
            let (file, size, offset) = l.parts();
            LogState {
                fd: push(file.as_raw_fd()),
                size,
                offset,
            }
        });
        let st = SessionState {
            format: if log.is_some() {
                SESSION_STATE_FORMAT
            } else {
                FORMAT_WITHOUT_LOG
            },
            volume: self.ctx.uuid(),
            conn: 0,
            acked_features: self.acked_features,
            acked_protocol: self.acked_protocol,
            regions,
            vrings,
            log,
        };
        (st, fds)
    }

    /// Rebuilds a session from kept state: maps guest memory again, takes the eventfds, and
    /// starts every queue that was running, recovering it from its journal. `files[i]` is
    /// descriptor `i` of the state (each is taken once).
    pub fn restore(
        ctx: Arc<VolumeContext>,
        st: &SessionState,
        files: &mut [Option<File>],
        clock: &mut RestoreClock,
    ) -> Result<Session, RestoreError> {
        if st.format > SESSION_STATE_FORMAT {
            return Err(RestoreError::Format(st.format));
        }
        if st.volume != ctx.uuid() {
            return Err(RestoreError::Volume {
                kept: st.volume,
                here: ctx.uuid(),
            });
        }
        if st.vrings.len() != ctx.num_queues() as usize {
            return Err(RestoreError::Queues {
                kept: st.vrings.len(),
                here: ctx.num_queues(),
            });
        }
        let mut take = |index: usize, what: &'static str| {
            files
                .get_mut(index)
                .and_then(Option::take)
                .ok_or(RestoreError::Missing { index, what })
        };
        let t = std::time::Instant::now();
        let mut s = Session::new(ctx);
        s.acked_features = st.acked_features;
        s.acked_protocol = st.acked_protocol;
        let mut regions = Vec::new();
        let mut rfiles = Vec::new();
        for r in &st.regions {
            regions.push(VhostUserMemoryRegion::new(
                r.gpa,
                r.size,
                r.vva,
                r.mmap_offset,
            ));
            rfiles.push(take(r.fd, "memory region")?);
        }
        s.mem.set(&regions, rfiles)?;
        if let Some(l) = &st.log {
            let log = DirtyLog::map(take(l.fd, "dirty log")?, l.size, l.offset)?;
            s.mem.set_log(log)?;
        }
        s.mem
            .set_logging(st.acked_features & VHOST_F_LOG_ALL != 0)?;
        for (v, vs) in s.vrings.iter_mut().zip(&st.vrings) {
            if vs.size > MAX_QUEUE_SIZE || (vs.size != 0 && !vs.size.is_power_of_two()) {
                return Err(RestoreError::QueueSize(vs.size));
            }
            v.size = vs.size;
            v.desc = vs.desc;
            v.avail = vs.avail;
            v.used = vs.used;
            v.base = vs.base;
            v.enabled = vs.enabled;
            v.started = vs.started;
            v.kick = vs.kick.map(|i| take(i, "kick")).transpose()?;
            v.call
                .store(vs.call.map(|i| take(i, "call")).transpose()?.map(Arc::new));
            v.err = vs.err.map(|i| take(i, "err")).transpose()?;
        }
        clock.map_memory += t.elapsed();
        let t = std::time::Instant::now();
        for i in 0..s.vrings.len() {
            s.maybe_start(i, true)
                .map_err(|why| RestoreError::Queue { index: i, why })?;
        }
        clock.recover_queues += t.elapsed();
        Ok(s)
    }
}

/// Why a kept connection cannot be continued: its state, a descriptor of it, the memory or
/// queues it names, or the connection itself.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("kept session state: {0}")]
    Parse(serde_json::Error),
    #[error("session state format {0} is newer than this binary reads ({SESSION_STATE_FORMAT})")]
    Format(u32),
    #[error("session state belongs to volume {kept}, not {here}")]
    Volume { kept: uuid::Uuid, here: uuid::Uuid },
    #[error("session state has {kept} queues, the volume {here}")]
    Queues { kept: usize, here: u16 },
    #[error("descriptor {index} ({what}) missing from the kept state")]
    Missing { index: usize, what: &'static str },
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("kept queue size {0} is invalid")]
    QueueSize(u16),
    #[error("queue {index} cannot be restarted: {why}")]
    Queue {
        index: usize,
        why: vhost::vhost_user::Error,
    },
    #[error("kept connection descriptor missing")]
    NoConnection,
    #[error("kept connection: {0}")]
    Connection(std::io::Error),
    #[error("session poisoned")]
    Poisoned,
    /// The socket pair that primes the request handler.
    #[error("{0}")]
    Priming(std::io::Error),
    #[error("priming message {code}: {why}")]
    Prime {
        code: u32,
        why: vhost::vhost_user::Error,
    },
    #[error("cannot adopt the kept connection: {0}")]
    Adopt(std::io::Error),
}

/// Where a restore spends its time (for the restart-phase report).
#[derive(Debug, Default, Clone, Copy)]
pub struct RestoreClock {
    pub map_memory: std::time::Duration,
    pub recover_queues: std::time::Duration,
}
