//! The daemon: assembles the pool from the config, serves every volume, and executes the
//! control operations the RPC layer hands it.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use spool_frontend::{
    listen_key, session_key, FrontendSettings, Restore, StateStore, VolumeContext, VolumeServer,
};
use spool_keeper::{KeeperLink, Phase, Restored};
use spool_pool::{DeviceSpec, Pool, PoolOptions, VolumeInfo};
use uuid::Uuid;

use crate::config::{Config, SizeValue, DEFAULT_QUEUES};
use crate::rpc::RpcError;

mod failures;

/// The running daemon.
pub struct Daemon {
    cfg: Config,
    pool: Mutex<Pool>,
    servers: Mutex<BTreeMap<Uuid, VolumeServer>>,
    settings: FrontendSettings,
    keeping: Option<Keeping>,
    store: Option<Arc<dyn StateStore>>,
    phases: Mutex<Vec<Phase>>,
    /// Device health (DESIGN.md §6): classification, reset, isolation, events.
    monitor: Arc<spool_health::Monitor>,
    /// Spares already tried (each is used once).
    spares_used: Mutex<Vec<PathBuf>>,
    stopping: std::sync::atomic::AtomicBool,
    /// Volumes stopped with device commands that never completed (count per volume): their
    /// extents stay allocated for the life of this process, so a late write cannot land in
    /// another volume's data.
    quarantined: Mutex<BTreeMap<Uuid, u64>>,
}

/// The worker's keeper: where state is deposited, and what the previous worker left.
pub struct Keeping {
    pub link: Arc<KeeperLink>,
    pub restored: Mutex<Restored>,
}

impl Keeping {
    fn take(&self, key: &str) -> Option<(String, Vec<std::fs::File>)> {
        self.restored
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(key)
    }
}

/// The keeper as the frontend's state store.
struct KeeperStore(Arc<KeeperLink>);

impl StateStore for KeeperStore {
    fn put(&self, key: &str, value: String, fds: &[std::os::fd::RawFd]) -> Result<(), String> {
        self.0.put(key, value, fds).map_err(|e| e.to_string())
    }
    fn remove(&self, prefix: &str) -> Result<(), String> {
        self.0.remove(prefix).map_err(|e| e.to_string())
    }
}

/// The keeper as the NVMe driver's descriptor store.
struct NvmeKeeper(Arc<KeeperLink>);

impl spool_devices::nvme_handoff::Keeper for NvmeKeeper {
    fn put(&self, key: &str, value: String, fds: &[std::os::fd::RawFd]) {
        if let Err(e) = self.0.put(key, value, fds) {
            tracing::error!(
                key,
                "cannot deposit an NVMe controller with the keeper: {e}; a crash now resets it"
            );
        }
    }
    fn remove(&self, key: &str) {
        if let Err(e) = self.0.remove(key) {
            tracing::error!(key, "keeper: {e}");
        }
    }
}

/// Keeper key prefix of kept device health states (`health/UUID`).
pub const HEALTH_PREFIX: &str = "health/";

/// Keeper key of the RPC listening socket.
pub const RPC_LISTEN_KEY: &str = "rpc/listen";
/// Keeper key naming the state formats the running worker writes.
pub const FORMAT_KEY: &str = "meta/state-format";

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

fn mkdir_private(p: &Path) -> Result<(), String> {
    std::fs::create_dir_all(p)
        .map_err(|e| format!("{}: cannot create directory: {e}", p.display()))?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("{}: cannot set permissions: {e}", p.display()))
}

impl Daemon {
    /// Assembles the pool, creates the volumes the config asks for, and serves every volume.
    pub fn start(
        cfg: Config,
        force: bool,
        keeping: Option<Keeping>,
    ) -> Result<Arc<Daemon>, String> {
        mkdir_private(&cfg.state_dir)?;
        mkdir_private(&cfg.socket_dir)?;
        match &cfg.journal_dir {
            Some(dir) => {
                // Not merely created: a directory another local user made first is refused.
                spool_journal::ensure_private_dir(dir).map_err(|e| e.to_string())?;
                if !on_tmpfs(dir) {
                    tracing::warn!(dir = %dir.display(), "journal directory is not on tmpfs: page writeback of the shared journal pages will stall I/O for milliseconds (use /dev/shm)");
                }
            }
            None => tracing::warn!(
                "journal disabled: in-flight I/O is NOT protected across restarts (benchmark mode)"
            ),
        }
        if cfg.devices.is_empty() {
            return Err("config lists no devices; add at least one [[devices]] entry".into());
        }
        let specs: Vec<DeviceSpec> = cfg
            .devices
            .iter()
            .map(|d| DeviceSpec {
                path: d.path.clone(),
                create_size: d.create_size,
                null: d.null,
            })
            .collect();
        let t_open = std::time::Instant::now();
        if let Some(k) = &keeping {
            // NVMe controllers stay up across workers: the driver deposits its VFIO
            // descriptors and queue arenas with the keeper and takes over what the previous
            // worker left (see spool_nvme::handoff).
            use spool_devices::nvme_handoff as h;
            h::set_keeper(Arc::new(NvmeKeeper(k.link.clone())));
            let keys = k.restored.lock().unwrap_or_else(|p| p.into_inner()).keys();
            for key in keys.into_iter().filter(|key| key.starts_with(h::PREFIX)) {
                if let Some((value, files)) = k.take(&key) {
                    h::offer(key, value, files);
                }
            }
        }
        let pool = Pool::open(
            &specs,
            PoolOptions {
                name: cfg.pool_name.clone(),
                min_extent: cfg.min_extent,
                force,
                no_direct: cfg.no_direct,
                nvme_sgl: cfg.nvme_sgl,
                // The crash-test hook, read once here (see `FaultRule::crash_on_write_from_env`).
                startup_faults: spool_devices::FaultRule::crash_on_write_from_env()
                    .into_iter()
                    .collect(),
            },
        )
        .map_err(|e| e.to_string())?;
        let open_devices = t_open.elapsed();
        let store: Option<Arc<dyn StateStore>> = keeping
            .as_ref()
            .map(|k| Arc::new(KeeperStore(k.link.clone())) as Arc<dyn StateStore>);
        let h = &cfg.health;
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
        if let Some(k) = &keeping {
            // Isolation outlives the worker: a device the previous worker failed or found
            // removed stays isolated (its state is kept with the keeper under health/UUID).
            let keys = k.restored.lock().unwrap_or_else(|p| p.into_inner()).keys();
            for key in keys
                .into_iter()
                .filter(|key| key.starts_with(HEALTH_PREFIX))
            {
                let Some((value, _)) = k.take(&key) else {
                    continue;
                };
                let kept: Option<(uuid::Uuid, spool_devices::HealthState, String)> = (|| {
                    let v: Value = serde_json::from_str(&value).ok()?;
                    let uuid = key.strip_prefix(HEALTH_PREFIX)?.parse().ok()?;
                    let state = match v["state"].as_str()? {
                        "failed" => spool_devices::HealthState::Failed,
                        "removed" => spool_devices::HealthState::Removed,
                        _ => return None,
                    };
                    Some((uuid, state, v["reason"].as_str().unwrap_or("").to_string()))
                })(
                );
                match kept {
                    Some((uuid, state, reason)) => {
                        if monitor.restore(uuid, state, &reason) {
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
            let link = k.link.clone();
            monitor.subscribe(move |ev| {
                let key = format!("{HEALTH_PREFIX}{}", ev.device);
                match (ev.kind.as_str(), ev.to) {
                    ("state", Some(to @ ("failed" | "removed"))) => {
                        let v = json!({"state": to, "reason": ev.reason}).to_string();
                        if let Err(e) = link.put(&key, v, &[]) {
                            tracing::error!(
                                key,
                                "cannot keep the device state with the keeper: {e}"
                            );
                        }
                    }
                    ("state", Some("healthy")) | ("replaced", _) => {
                        let _ = link.remove(&key);
                    }
                    _ => {}
                }
            });
        }
        let d = Arc::new(Daemon {
            settings: FrontendSettings {
                poll_idle: Duration::from_micros(cfg.poll_idle_us),
                journal_dir: cfg.journal_dir.clone(),
                io_timeout: Duration::from_millis(h.io_timeout_ms),
                request_retries: h.request_retries,
                state_fd_limit: spool_keeper::proto::MAX_FDS,
                clock: Arc::default(),
            },
            monitor,
            spares_used: Mutex::new(Vec::new()),
            quarantined: Mutex::new(BTreeMap::new()),
            stopping: std::sync::atomic::AtomicBool::new(false),
            cfg,
            pool: Mutex::new(pool),
            servers: Mutex::new(BTreeMap::new()),
            keeping,
            store,
            phases: Mutex::new(vec![Phase::new("open devices", open_devices)]),
        });
        if let Some(s) = &d.store {
            if let Err(e) = s.put(
                FORMAT_KEY,
                json!({"session": spool_frontend::SESSION_STATE_FORMAT}).to_string(),
                &[],
            ) {
                tracing::error!("cannot deposit the state format with the keeper: {e}");
            }
        }
        {
            let mut pool = d.pool();
            for v in &d.cfg.volumes {
                match pool.volume(&v.name) {
                    Ok(have) if have.size < v.size => {
                        pool.resize_volume(&v.name, v.size)
                            .map_err(|e| e.to_string())?;
                    }
                    Ok(have) if have.size > v.size => tracing::warn!(
                        volume = %v.name, have = have.size, config = v.size,
                        "volume is larger than the config says; volumes never shrink"
                    ),
                    Ok(_) => {}
                    Err(_) => {
                        pool.create_volume(&v.name, v.size, v.read_only, v.num_queues)
                            .map_err(|e| format!("volume {}: {e}", v.name))?;
                    }
                }
            }
        }
        let t_serve = std::time::Instant::now();
        let vols = d.pool().volumes();
        for v in vols {
            if let Err(e) = d.serve(&v) {
                tracing::error!(volume = %v.name, error = %e, "volume not served");
            }
        }
        let clock = d.settings.clock.restore();
        {
            let mut ph = d.phases.lock().unwrap_or_else(|p| p.into_inner());
            ph.push(Phase::new("map guest memory", clock.map_memory));
            ph.push(Phase::new(
                "recover journals, start queues",
                clock.recover_queues,
            ));
            ph.push(Phase::new(
                "serve volumes (other)",
                t_serve
                    .elapsed()
                    .saturating_sub(clock.map_memory + clock.recover_queues),
            ));
        }
        // Whatever the previous worker kept for volumes that no longer exist is let go.
        if let (Some(k), Some(s)) = (&d.keeping, &d.store) {
            let left = k.restored.lock().unwrap_or_else(|p| p.into_inner()).keys();
            for key in left.into_iter().filter(|k| k.starts_with("vol/")) {
                tracing::warn!(key = %key, "kept state of a volume that is not served; releasing it");
                let _ = k.take(&key);
                if let Err(e) = s.remove(&key) {
                    tracing::error!(key = %key, "keeper: {e}");
                }
            }
        }
        d.start_spare_watcher();
        Ok(d)
    }

    fn pool(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn servers(&self) -> MutexGuard<'_, BTreeMap<Uuid, VolumeServer>> {
        self.servers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The daemon's configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Where a volume's vhost-user socket lives.
    pub fn socket_path(&self, name: &str) -> PathBuf {
        self.cfg.socket_dir.join(format!("{name}.sock"))
    }

    fn serve(&self, v: &VolumeInfo) -> Result<(), String> {
        if !v.online {
            return Err("one of its devices is missing".into());
        }
        let layout = self
            .pool()
            .layout(&v.uuid.to_string())
            .map_err(|e| e.to_string())?;
        let ctx = VolumeContext::new(layout, self.settings.clone());
        let restore = match &self.keeping {
            Some(k) => Restore {
                listener: k.take(&listen_key(v.uuid)).and_then(|(_, f)| {
                    f.into_iter().next().map(|f| {
                        std::os::unix::net::UnixListener::from(std::os::fd::OwnedFd::from(f))
                    })
                }),
                session: k.take(&session_key(v.uuid)),
            },
            None => Restore::default(),
        };
        let server =
            VolumeServer::start(&self.socket_path(&v.name), ctx, self.store.clone(), restore)
                .map_err(|e| format!("{}: {e}", self.socket_path(&v.name).display()))?;
        self.servers().insert(v.uuid, server);
        Ok(())
    }

    /// Volumes with their socket paths, for the start-up banner.
    /// Configured devices the pool runs without, and why.
    pub fn left_out(&self) -> Vec<spool_pool::LeftOut> {
        self.pool().info().left_out
    }

    pub fn volumes(&self) -> Vec<(VolumeInfo, Option<PathBuf>)> {
        let servers = self.servers();
        self.pool()
            .volumes()
            .into_iter()
            .map(|v| {
                let p = servers.get(&v.uuid).map(|s| s.path().to_path_buf());
                (v, p)
            })
            .collect()
    }

    /// Phases of this process's start (for the restart report).
    pub fn start_phases(&self) -> Vec<Phase> {
        self.phases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The keeper link, when running under one.
    pub fn keeper(&self) -> Option<&Arc<KeeperLink>> {
        self.keeping.as_ref().map(|k| &k.link)
    }

    /// What the keeper left for the RPC socket.
    pub fn take_kept_rpc_listener(&self) -> Option<std::os::unix::net::UnixListener> {
        let (_, f) = self.keeping.as_ref()?.take(RPC_LISTEN_KEY)?;
        let f = f.into_iter().next()?;
        Some(std::os::unix::net::UnixListener::from(
            std::os::fd::OwnedFd::from(f),
        ))
    }

    /// Deposits the RPC listening socket with the keeper.
    pub fn keep_rpc_listener(&self, l: &std::os::unix::net::UnixListener) {
        if let Some(s) = &self.store {
            use std::os::fd::AsRawFd;
            if let Err(e) = s.put(RPC_LISTEN_KEY, "{}".into(), &[l.as_raw_fd()]) {
                tracing::error!("cannot deposit the RPC socket with the keeper: {e}");
            }
        }
    }

    /// Stops serving for a handoff to a new process: every queue drains and stops, the final
    /// state goes to the keeper; no socket is closed for the frontends.
    pub fn detach(&self) {
        let servers = std::mem::take(&mut *self.servers());
        for (_, s) in servers {
            s.detach();
        }
    }

    /// Stops every server (workers drain their in-flight requests first).
    pub fn shutdown(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Release);
        self.monitor.stop();
        let servers = std::mem::take(&mut *self.servers());
        for (_, s) in servers {
            s.shutdown();
        }
    }

    fn volume_json(&self, v: &VolumeInfo) -> Value {
        let servers = self.servers();
        let s = servers.get(&v.uuid);
        let mut j = serde_json::to_value(v).unwrap_or(Value::Null);
        j["socket"] = json!(s.map(|s| s.path().display().to_string()));
        j["connected"] = json!(s.is_some_and(|s| s.connected()));
        if let Some(n) = self.quarantined_io(v.uuid) {
            j["quarantined_io"] = json!(n);
        }
        j
    }

    /// Device commands of a stopped volume that never completed, if any.
    fn quarantined_io(&self, volume: Uuid) -> Option<u64> {
        self.quarantined
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&volume)
            .copied()
    }

    /// `daemon_upgrade`: asks the keeper to replace this worker with `binary` (default: the
    /// same binary); the keeper answers on `conn` when the new worker serves or rolls back.
    pub fn upgrade(
        &self,
        params: Value,
        id: Option<Value>,
        conn: Option<&std::os::unix::net::UnixStream>,
    ) -> Result<(), RpcError> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct P {
            binary: Option<PathBuf>,
        }
        let p: P = params_of(params)?;
        let Some(link) = self.keeper() else {
            return Err(RpcError::app(
                "spoold runs without a keeper (--no-keeper): a live upgrade needs the keeper; restart spoold without --no-keeper",
            ));
        };
        let binary = match p.binary {
            Some(b) => {
                let b = std::path::absolute(&b).unwrap_or(b);
                let meta = std::fs::metadata(&b).map_err(|e| {
                    RpcError::invalid_params(format!("binary {}: {e}", b.display()))
                })?;
                if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
                    return Err(RpcError::invalid_params(format!(
                        "binary {} is not an executable file",
                        b.display()
                    )));
                }
                Some(b.display().to_string())
            }
            None => None,
        };
        use std::os::fd::AsRawFd;
        link.upgrade(binary, id, conn.map(|c| c.as_raw_fd()))
            .map_err(|e| RpcError::app(format!("cannot reach the keeper: {e}")))
    }

    fn status(&self) -> Value {
        let info = self.keeping.as_ref().map(|k| {
            k.restored
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .info
                .clone()
        });
        let first_io_ms = info.as_ref().and_then(|i| {
            let t = self.settings.clock.first_completion()?;
            let us = t.duration_since(std::time::UNIX_EPOCH).ok()?.as_micros() as u64;
            (i.restart_began_us > 0 && i.reason != "first-start")
                .then(|| us.saturating_sub(i.restart_began_us) as f64 / 1e3)
        });
        json!({
            "pid": std::process::id(),
            "version": env!("CARGO_PKG_VERSION"),
            "binary": std::env::current_exe().ok().map(|p| p.display().to_string()),
            "keeper": info.as_ref().map(|i| json!({
                "pid": i.keeper_pid,
                "generation": i.generation,
                "start_reason": i.reason,
            })),
            "start_phases": self.start_phases(),
            "first_io_after_restart_ms": first_io_ms,
            "last_restart": self.keeper().and_then(|l| l.last_report()),
            "state_format": {"session": spool_frontend::SESSION_STATE_FORMAT},
        })
    }

    /// Executes one RPC method.
    pub fn call(&self, method: &str, params: Value) -> Result<Value, RpcError> {
        if let Some(r) = self.call_failures(method, &params) {
            return r;
        }
        match method {
            "daemon_status" => {
                no_params(&params)?;
                Ok(self.status())
            }
            "daemon_upgrade" => Err(RpcError::app(
                "daemon_upgrade is answered on the RPC connection by the keeper",
            )),
            "pool_show" => {
                no_params(&params)?;
                Ok(serde_json::to_value(self.pool().info()).unwrap_or(Value::Null))
            }
            "device_list" => {
                no_params(&params)?;
                Ok(serde_json::to_value(self.pool().devices()).unwrap_or(Value::Null))
            }
            "device_add" => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct P {
                    path: PathBuf,
                    create_size: Option<SizeValue>,
                    #[serde(default)]
                    force: bool,
                }
                let p: P = params_of(params)?;
                let create_size = opt_size(p.create_size, "create_size")?;
                let info = self
                    .pool()
                    .add_device(
                        &DeviceSpec {
                            path: p.path,
                            create_size,
                            null: None,
                        },
                        p.force,
                    )
                    .map_err(RpcError::app)?;
                Ok(serde_json::to_value(info).unwrap_or(Value::Null))
            }
            "volume_list" => {
                no_params(&params)?;
                let vols = self.pool().volumes();
                Ok(Value::Array(
                    vols.iter().map(|v| self.volume_json(v)).collect(),
                ))
            }
            "volume_show" => {
                let p: IdParam = params_of(params)?;
                let v = self.pool().volume(&p.id).map_err(RpcError::app)?;
                Ok(self.volume_json(&v))
            }
            "volume_create" => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct P {
                    name: String,
                    size: SizeValue,
                    #[serde(default)]
                    read_only: bool,
                    num_queues: Option<u16>,
                }
                let p: P = params_of(params)?;
                let size = size_arg(&p.size, "size")?;
                let v = self
                    .pool()
                    .create_volume(
                        &p.name,
                        size,
                        p.read_only,
                        p.num_queues.unwrap_or(DEFAULT_QUEUES),
                    )
                    .map_err(RpcError::app)?;
                if let Err(e) = self.serve(&v) {
                    return Err(RpcError::app(format!("volume created but not served: {e}")));
                }
                Ok(self.volume_json(&v))
            }
            "volume_delete" => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct P {
                    id: String,
                    #[serde(default)]
                    force: bool,
                }
                let p: P = params_of(params)?;
                let v = self.pool().volume(&p.id).map_err(RpcError::app)?;
                let stuck = |n: u64| {
                    RpcError::app(format!(
                        "volume '{}' is stopped, but {n} device command(s) into it never completed (a hung device): its extents stay allocated until spoold restarts, so a late write cannot land in another volume; delete it again after a restart",
                        v.name
                    ))
                };
                if let Some(n) = self.quarantined_io(v.uuid) {
                    return Err(stuck(n));
                }
                let server = self.servers().remove(&v.uuid);
                if let Some(s) = server {
                    if s.connected() && !p.force {
                        self.servers().insert(v.uuid, s);
                        return Err(RpcError::app(format!(
                            "volume '{}' is in use by a connected client; stop the VM first, or pass force=true (spoolctl volume delete --force) to disconnect it",
                            v.name
                        )));
                    }
                    let ctx = s.context().clone();
                    s.shutdown();
                    let n = ctx.abandoned_io();
                    if n > 0 {
                        self.quarantined
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(v.uuid, n);
                        tracing::error!(volume = %v.name, commands = n, "volume stopped with device commands that never completed; its extents are quarantined until restart");
                        return Err(stuck(n));
                    }
                }
                let v = self
                    .pool()
                    .delete_volume(&v.uuid.to_string())
                    .map_err(RpcError::app)?;
                Ok(serde_json::to_value(v).unwrap_or(Value::Null))
            }
            "volume_resize" => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct P {
                    id: String,
                    size: SizeValue,
                }
                let p: P = params_of(params)?;
                let size = size_arg(&p.size, "size")?;
                let (v, layout) = {
                    let mut pool = self.pool();
                    let v = pool.resize_volume(&p.id, size).map_err(RpcError::app)?;
                    let l = pool.layout(&v.uuid.to_string()).map_err(RpcError::app)?;
                    (v, l)
                };
                if let Some(s) = self.servers().get(&v.uuid) {
                    s.context().update_layout(layout);
                }
                Ok(self.volume_json(&v))
            }
            _ => Err(RpcError::method_not_found(method)),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IdParam {
    id: String,
}

fn no_params(p: &Value) -> Result<(), RpcError> {
    match p {
        Value::Null => Ok(()),
        Value::Object(m) if m.is_empty() => Ok(()),
        Value::Array(a) if a.is_empty() => Ok(()),
        _ => Err(RpcError::invalid_params("this method takes no parameters")),
    }
}

fn params_of<T: for<'de> Deserialize<'de>>(p: Value) -> Result<T, RpcError> {
    let p = if p.is_null() { json!({}) } else { p };
    serde_json::from_value(p).map_err(|e| RpcError::invalid_params(e.to_string()))
}

fn opt_size(s: Option<SizeValue>, what: &str) -> Result<Option<u64>, RpcError> {
    s.map(|s| size_arg(&s, what)).transpose()
}

fn size_arg(s: &SizeValue, what: &str) -> Result<u64, RpcError> {
    match s {
        SizeValue::Bytes(n) => Ok(*n),
        SizeValue::Text(t) => {
            crate::size::parse_size(t).map_err(|e| RpcError::invalid_params(format!("{what}: {e}")))
        }
    }
}
