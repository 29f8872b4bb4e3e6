//! The named steps of `Daemon::start`, in the order it runs them: prepare the directories,
//! open the pool (taking over kept NVMe controllers), start the health monitor, carry kept
//! device isolation over, ensure the configured volumes and their I/O limits, serve them,
//! let go of what was kept for volumes that are gone.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use spool_frontend::witness::WriteWitness;
use spool_keeper::Phase;
use spool_pool::{DeviceSpec, Pool, PoolOptions};

use super::keeper::{DeviceKeeper, Keeping};
use super::Daemon;
use crate::api::HealthEventKind;
use crate::config::{Config, HealthConfig};
use crate::kept::{self, KeptHealth};

/// Why spoold could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{}: cannot {what}: {source}", .path.display())]
    Dir {
        path: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
    #[error(transparent)]
    Journal(#[from] spool_journal::Error),
    #[error("config lists no devices; add at least one [[devices]] entry")]
    NoDevices,
    #[error("[tls]: {0}")]
    Tls(std::io::Error),
    #[error(transparent)]
    Pool(#[from] spool_pool::Error),
    #[error("volume {name}: {source}")]
    Volume {
        name: String,
        source: spool_pool::Error,
    },
    #[error("debug.write_witness {}: {source}", .path.display())]
    Witness {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The write witness `[debug] write_witness` names, mapped (docs/upgrade.md).
pub(super) fn write_witness(cfg: &Config) -> Result<Option<Arc<WriteWitness>>, StartError> {
    let Some(path) = &cfg.write_witness else {
        return Ok(None);
    };
    let w = WriteWitness::open(path).map_err(|source| StartError::Witness {
        path: path.clone(),
        source,
    })?;
    tracing::warn!(path = %path.display(), "recording every guest page written in a write witness (a debugging aid)");
    Ok(Some(Arc::new(w)))
}

/// Whether `p` is on tmpfs (where a journal belongs: shared memory without writeback).
fn on_tmpfs(p: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_bytes()) else {
        return false;
    };
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: statfs reads the NUL-terminated path and fills the struct on our stack.
    let r = unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) };
    // SAFETY: statfs succeeded, so it initialised the struct.
    r == 0 && unsafe { st.assume_init() }.f_type == 0x0102_1994
}

fn mkdir_private(p: &Path) -> Result<(), StartError> {
    let err = |what| {
        move |source| StartError::Dir {
            path: p.to_path_buf(),
            what,
            source,
        }
    };
    std::fs::create_dir_all(p).map_err(err("create directory"))?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700))
        .map_err(err("set permissions"))
}

/// Step 1: private state and socket directories, a private journal directory, devices listed.
pub(super) fn prepare(cfg: &Config) -> Result<(), StartError> {
    mkdir_private(&cfg.state_dir)?;
    mkdir_private(&cfg.socket_dir)?;
    match &cfg.journal_dir {
        Some(dir) => {
            // Not merely created: a directory another local user made first is refused.
            spool_journal::ensure_private_dir(dir)?;
            if !on_tmpfs(dir) {
                tracing::warn!(dir = %dir.display(), "journal directory is not on tmpfs: page writeback of the shared journal pages will stall I/O for milliseconds (use /dev/shm)");
            }
        }
        None => tracing::warn!(
            "journal disabled: in-flight I/O is NOT protected across restarts (benchmark mode)"
        ),
    }
    if cfg.devices.is_empty() {
        return Err(StartError::NoDevices);
    }
    load_tls(cfg)
}

/// `[tls] dir`: its server credentials checked (exports load them again when they start,
/// so renewed certificates are taken without a restart), its client ones set for `nbds://`
/// connections. A directory with neither is refused.
fn load_tls(cfg: &Config) -> Result<(), StartError> {
    let Some(dir) = &cfg.tls else { return Ok(()) };
    let server = dir.join("server-cert.pem").exists();
    if server {
        spool_nbd::tls::ServerTls::load(dir).map_err(StartError::Tls)?;
    }
    let client = dir.join("ca-cert.pem").exists();
    if client {
        let c = spool_nbd::tls::ClientTls::load(dir).map_err(StartError::Tls)?;
        spool_nbd::tls::set_client(c);
    }
    if !server && !client {
        return Err(StartError::Tls(std::io::Error::other(format!(
            "{} holds neither server-cert.pem nor ca-cert.pem (QEMU's tls-creds-x509 layout: docs/security.md)",
            dir.display()
        ))));
    }
    tracing::info!(dir = %dir.display(), server, client, "TLS credentials loaded");
    Ok(())
}

/// Step 2: opens the pool's devices; NVMe controllers the previous worker kept are taken over
/// (the driver deposits its VFIO descriptors and queue arenas with the keeper).
pub(super) fn open_pool(
    cfg: &Config,
    force: bool,
    keeping: Option<&Keeping>,
    ceph: Arc<spool_devices::CephClusters>,
) -> Result<Pool, StartError> {
    let specs: Vec<DeviceSpec> = cfg
        .devices
        .iter()
        .map(|d| DeviceSpec {
            path: d.path.clone(),
            create_size: d.create_size,
            null: d.null,
        })
        .collect();
    let handoff = Arc::new(spool_devices::handoff::Handoff::default());
    if let Some(k) = keeping {
        handoff.set_keeper(Arc::new(DeviceKeeper(k.link.clone())));
        for prefix in spool_devices::handoff::PREFIXES {
            for key in k.keys(prefix) {
                if let Some((value, files)) = k.take(&key) {
                    handoff.offer(key, value, files);
                }
            }
        }
    }
    let opts = PoolOptions {
        name: cfg.pool_name.clone(),
        min_extent: cfg.min_extent,
        force,
        no_direct: cfg.no_direct,
        nvme_sgl: cfg.nvme_sgl,
        startup_faults: cfg.faults.clone(),
        mirror_dir: Some(cfg.state_dir.join("mirror")),
        resync_rate: cfg.resync_rate,
        ceph: spool_devices::Ceph::new(cfg.ceph.clone(), ceph),
        handoff,
        // Taking over from a killed or stopped worker: its descriptors, and with them the
        // devices' locks, may outlive it for a moment (io_uring teardown is asynchronous).
        // A first start waits too: a spoold killed whole (keeper and workers, as an OOM kill
        // or a cgroup kill does) and started again at once is a first start to its new
        // keeper, and its dead worker's writes may still be in flight. Not waiting left a
        // volume unserved for the new worker's whole life ("one of its devices is missing",
        // its stale socket refusing VMs; tier 2, about one whole-daemon kill in 150). A
        // second spoold on the same devices is refused 2 s later than before.
        lock_wait: Duration::from_secs(2),
        kek: load_kek(cfg),
        other_keks: keeping.map(super::kept_keys::take).unwrap_or_default(),
        thin_full_wait: cfg.thin_full_wait,
    };
    Ok(Pool::open(&specs, opts)?)
}

/// The key-encryption key from `[encryption]`. One that cannot be read is logged and left
/// out: spoold serves every other volume, and each encrypted one is refused with the reason.
pub(super) fn load_kek(cfg: &Config) -> Option<Arc<spool_crypt::Kek>> {
    let source = cfg.encryption.as_ref()?;
    match source.load() {
        Ok(k) => {
            tracing::info!(kek = %k.id(), "key-encryption key loaded from the {source}");
            Some(Arc::new(k))
        }
        Err(e) => {
            tracing::error!(
                "cannot load the key-encryption key: {e}; encrypted volumes are not served"
            );
            None
        }
    }
}

/// Step 3: the health monitor, watching every device of the pool.
pub(super) fn start_monitor(h: &HealthConfig, pool: &Pool) -> Arc<spool_health::Monitor> {
    let monitor = spool_health::Monitor::start(spool_health::Policy {
        media_errors_to_fail: h.media_errors_to_fail,
        io_timeout: Duration::from_millis(h.io_timeout_ms),
        reset_timeout: Duration::from_millis(h.reset_timeout_ms),
        poll_interval: Duration::from_millis(h.poll_interval_ms),
        request_retries: h.request_retries,
        hook: h.hook.clone(),
    });
    for (uuid, dev) in pool.device_handles() {
        monitor.watch(uuid, dev);
    }
    monitor
}

/// Step 4: isolation outlives the worker. A device the previous worker failed or found
/// removed stays isolated (its state is kept under `health/UUID`), and from now on every
/// isolation is kept and every recovery or replacement forgotten.
pub(super) fn carry_isolation_over(k: &Keeping, monitor: &spool_health::Monitor) {
    for key in k.keys(kept::HEALTH_PREFIX) {
        let Some((value, _)) = k.take(&key) else {
            continue;
        };
        match KeptHealth::parse(&key, &value) {
            Some((uuid, h)) => {
                if monitor.restore(uuid, h.state.health_state(), &h.reason) {
                    // Still isolated: keep it kept.
                    let _ = k.link.put(&key, value, &[]);
                } else {
                    let _ = k.link.remove(&key);
                }
            }
            None => {
                tracing::warn!(key = %key, "unreadable kept device state; dropped");
                let _ = k.link.remove(&key);
            }
        }
    }
    // An isolation is kept before the state is set: a worker that dies right after a
    // device failed (a kill, a crash on the failure's path) leaves it failed.
    let link = k.link.clone();
    monitor.record_isolations(move |device, state, reason| {
        let key = kept::health_key(device);
        let Some(state) = kept::IsolatedState::from_name(state.name()) else {
            return;
        };
        let reason = reason.to_string();
        if let Err(e) = link.put(&key, KeptHealth { reason, state }.to_value(), &[]) {
            tracing::error!(key, "cannot keep the device state with the keeper: {e}");
        }
    });
    let link = k.link.clone();
    monitor.subscribe(move |ev| {
        let key = kept::health_key(ev.device);
        match HealthEventKind::parse(&ev.kind) {
            Some(HealthEventKind::State) if ev.to == Some("healthy") => {
                let _ = link.remove(&key);
            }
            Some(HealthEventKind::Replaced) => {
                let _ = link.remove(&key);
            }
            _ => {}
        }
    });
}

impl Daemon {
    /// Step 5: tells the keeper which state formats this worker writes (an upgrade candidate
    /// checks them before the handoff).
    pub(super) fn keep_state_format(&self) {
        if let Some(s) = &self.store {
            let format = serde_json::to_string(&kept::StateFormat::current()).unwrap_or_default();
            if let Err(e) = s.put(kept::FORMAT_KEY, format, &[]) {
                tracing::error!("cannot deposit the state format with the keeper: {e}");
            }
        }
    }

    /// Step 5: hands the pool's key-encryption keys to the next worker (`kept_keys`).
    pub(super) fn keep_keks(&self) {
        if let Some(s) = &self.store {
            super::kept_keys::keep(&**s, &self.pool().keks());
        }
    }

    /// Step 6: every configured volume exists and is at least as large as configured.
    pub(super) fn ensure_volumes(&self) -> Result<(), StartError> {
        let mut pool = self.pool();
        for v in &self.cfg.volumes {
            match pool.volume(&v.name) {
                // An attached image at its own size (size 0 in the config).
                Ok(_) if v.size == 0 => {}
                Ok(have) if have.size < v.size && have.legs.iter().any(|l| l.remote.is_some()) => {
                    tracing::warn!(
                        volume = %v.name, have = have.size, config = v.size,
                        "volume is smaller than the config says, but it is being sent to another host: not grown until the send ends"
                    )
                }
                Ok(have) if have.size < v.size => {
                    pool.resize_volume(&v.name, v.size)?;
                }
                Ok(have) if have.size > v.size => tracing::warn!(
                    volume = %v.name, have = have.size, config = v.size,
                    "volume is larger than the config says; volumes never shrink"
                ),
                Ok(_) => {}
                Err(_) => {
                    let made = match &v.rbd {
                        Some(r) => spool_pool::RbdTarget::parse(r).and_then(|t| {
                            let size = (v.size > 0).then_some(v.size);
                            pool.create_rbd_volume(&v.name, size, v.read_only, v.num_queues, &t)
                        }),
                        None if v.thin => pool.create_thin_copies(
                            &v.name,
                            v.size,
                            v.read_only,
                            v.num_queues,
                            v.copies,
                            v.encrypt,
                        ),
                        None => pool.create_volume_opts(
                            &v.name,
                            v.size,
                            v.read_only,
                            v.num_queues,
                            v.copies,
                            v.encrypt,
                        ),
                    };
                    made.map_err(|source| StartError::Volume {
                        name: v.name.clone(),
                        source,
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Step 6b: the I/O limits of every volume with a `[volumes.qos]` section, when spoold
    /// itself starts. A worker restart or an upgrade keeps the limits in force (a run-time
    /// `volume_qos` included); a volume without the section keeps what the table holds.
    pub(super) fn apply_configured_qos(&self) -> Result<(), StartError> {
        if self
            .keeping
            .as_ref()
            .is_some_and(|k| k.restored().info.generation > 1)
        {
            return Ok(());
        }
        let mut pool = self.pool();
        for v in &self.cfg.volumes {
            let Some(q) = v.qos else { continue };
            let want = Some(q).filter(|q| !q.is_default());
            if pool.volume(&v.name).ok().map(|have| have.qos) == Some(want) {
                continue;
            }
            pool.set_qos(&v.name, want)
                .map_err(|source| StartError::Volume {
                    name: v.name.clone(),
                    source,
                })?;
            tracing::info!(volume = %v.name, limits = %crate::qos::describe(want.map(crate::wire::ToWire::wire).as_ref()), "I/O limits from the config");
        }
        Ok(())
    }

    /// Step 7: serves every volume (continuing kept connections), all at once: after a
    /// worker restart each volume's guests wait until their own volume is served, so the
    /// last of N volumes served one after the other would wait for all N (issue 33: with 8
    /// busy volumes, 8 times one volume's stall). Records how long mapping guest memory and
    /// recovering journals took (summed over the volumes) and the rest.
    pub(super) fn serve_volumes(&self) {
        let t_serve = Instant::now();
        let vols = self.pool().volumes();
        let n = vols.len();
        std::thread::scope(|s| {
            for v in &vols {
                let spawned = std::thread::Builder::new()
                    .name("spool-serve".into())
                    .spawn_scoped(s, move || self.serve_logged(v));
                if spawned.is_err() {
                    // No thread to spare: serve it from here.
                    self.serve_logged(v);
                }
            }
        });
        // With several volumes the first two are sums over volumes served side by side,
        // and "other" what the wall clock shows beyond them (or nothing).
        let clock = self.settings.clock.restore();
        let other = t_serve
            .elapsed()
            .saturating_sub(clock.map_memory + clock.recover_queues);
        let mut ph = self.phases.lock().unwrap_or_else(|p| p.into_inner());
        ph.push(Phase::new("map guest memory", clock.map_memory));
        ph.push(Phase::new(
            "recover journals, start queues",
            clock.recover_queues,
        ));
        ph.push(Phase::new("serve volumes (other)", other));
        tracing::debug!(
            volumes = n,
            ms = t_serve.elapsed().as_secs_f64() * 1e3,
            "volumes served"
        );
    }

    fn serve_logged(&self, v: &spool_pool::VolumeInfo) {
        if let Err(e) = self.serve(v) {
            tracing::error!(volume = %v.name, error = %e, "volume not served");
        }
    }

    /// Step 8: whatever the previous worker kept for volumes that no longer exist is let go.
    pub(super) fn release_unserved_kept(&self) {
        let (Some(k), Some(s)) = (&self.keeping, &self.store) else {
            return;
        };
        for key in k.keys(kept::VOLUME_PREFIX) {
            tracing::warn!(key = %key, "kept state of a volume that is not served; releasing it");
            let _ = k.take(&key);
            if let Err(e) = s.remove(&key) {
                tracing::error!(key = %key, "keeper: {e}");
            }
        }
    }
}
