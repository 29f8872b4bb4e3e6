//! The daemon: assembles the pool from the config, serves every volume, and answers the
//! control API (each method's handler is registered in `methods`, next to its module).
//!
//! Owns: the running state (pool, volume servers, health monitor, keeper link) and its
//! start-up steps (`startup`). Must not know: JSON-RPC framing or the socket (`crate::rpc`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use spool_frontend::{
    listen_key, session_key, FrontendSettings, Restore, StateStore, VolumeContext, VolumeServer,
};
use spool_keeper::{KeeperLink, Phase};
use spool_pool::{Pool, VolumeInfo};
use uuid::Uuid;

use crate::config::Config;

mod devices;
mod expected;
mod exports;
mod failures;
mod hello;
mod keeper;
mod kept_keys;
mod methods;
mod mirrors;
mod receive;
mod replica;
mod send;
mod snapshots;
mod startup;
mod stats;
mod status;
mod thin;
mod transfer;
mod volumes;

pub use hello::{answer_proof, hello_proof};
pub use keeper::Keeping;
pub use methods::method_table;
pub use startup::StartError;

/// The running daemon.
pub struct Daemon {
    cfg: Config,
    pool: Mutex<Pool>,
    servers: Mutex<BTreeMap<Uuid, VolumeServer>>,
    settings: FrontendSettings,
    keeping: Option<Keeping>,
    store: Option<Arc<dyn StateStore>>,
    phases: Mutex<Vec<Phase>>,
    /// Device health (docs/failures.md): classification, reset, isolation, events.
    monitor: Arc<spool_health::Monitor>,
    /// Spares already tried (each is used once).
    spares_used: Mutex<Vec<PathBuf>>,
    stopping: AtomicBool,
    /// Volumes stopped with device commands that never completed (count per volume): their
    /// extents stay allocated for the life of this process, so a late write cannot land in
    /// another volume's data.
    quarantined: Mutex<BTreeMap<Uuid, u64>>,
    /// Removed mirror legs' extents the pool holds back, with the layout that last named
    /// them: given back once no queue holds that layout (`mirrors.rs`).
    retiring: Mutex<Vec<mirrors::Retiring>>,
    /// Snapshots served over NBD (`volume export`).
    exports: Mutex<Vec<exports::Exported>>,
    /// Volumes being received over NBD (`volume receive`).
    receiving: Mutex<Vec<receive::Receiving>>,
    /// Volumes expected on the transfer listener (`volume receive NAME --token`).
    expected: Mutex<Vec<expected::Expected>>,
    /// Where the transfer listener listens (once started).
    transfer_at: std::sync::OnceLock<std::net::SocketAddr>,
    /// The replicas' gates, held until each is promoted: their frontends wait.
    replica_holds: Mutex<BTreeMap<Uuid, spool_frontend::AdmissionHold>>,
    /// Replications started here whose destination was not yet told the copy is current.
    replicating: Mutex<BTreeMap<Uuid, replica::Replicating>>,
    /// When each volume's copy on another host was last seen current (Unix seconds).
    last_current: Mutex<BTreeMap<Uuid, f64>>,
    /// When this worker started (the I/O counters' epoch).
    started: std::time::Instant,
}

/// What start-up made before the daemon: the health monitor, what the previous worker kept,
/// how long opening the devices took, and the write witness.
type StartParts = (
    Arc<spool_health::Monitor>,
    Option<Keeping>,
    Phase,
    Option<Arc<spool_frontend::witness::WriteWitness>>,
);

/// Why a volume could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("one of its devices is missing")]
    Offline,
    #[error(transparent)]
    Layout(#[from] spool_pool::Error),
    #[error("{}: {source}", .path.display())]
    Socket {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl Daemon {
    /// Assembles the pool, creates the volumes the config asks for, and serves every volume.
    /// RBD devices connect to their cluster through `ceph` (the caller closes it before the
    /// process exits).
    pub fn start(
        cfg: Config,
        force: bool,
        keeping: Option<Keeping>,
        ceph: Arc<spool_devices::CephClusters>,
    ) -> Result<Arc<Daemon>, StartError> {
        startup::prepare(&cfg)?;
        let write_witness = startup::write_witness(&cfg)?;
        let t_open = std::time::Instant::now();
        let pool = startup::open_pool(&cfg, force, keeping.as_ref(), ceph)?;
        let open_devices = Phase::new("open devices", t_open.elapsed());
        let monitor = startup::start_monitor(&cfg.health, &pool);
        if let Some(k) = &keeping {
            startup::carry_isolation_over(k, &monitor);
        }
        let parts = (monitor, keeping, open_devices, write_witness);
        let d = Arc::new(Daemon::new(cfg, pool, parts));
        d.keep_state_format();
        d.keep_keks();
        d.ensure_volumes()?;
        d.apply_configured_qos()?;
        d.serve_volumes();
        d.restore_receiving();
        d.restore_expected();
        d.restore_replications();
        d.restore_exports();
        d.release_unserved_kept();
        d.start_spare_watcher();
        d.start_mirror_settler();
        Ok(d)
    }

    fn new(cfg: Config, pool: Pool, parts: StartParts) -> Daemon {
        let (monitor, keeping, open_devices, write_witness) = parts;
        let store = keeping
            .as_ref()
            .map(|k| Arc::new(keeper::KeeperStore(k.link.clone())) as Arc<dyn StateStore>);
        Daemon {
            settings: FrontendSettings {
                poll_idle: Duration::from_micros(cfg.poll_idle_us),
                journal_dir: cfg.journal_dir.clone(),
                io_timeout: Duration::from_millis(cfg.health.io_timeout_ms),
                request_retries: cfg.health.request_retries,
                state_fd_limit: spool_keeper::proto::MAX_FDS,
                clock: Arc::default(),
                share_group: Arc::default(),
                fair_share: cfg.fair_share,
                volume_threads: cfg.volume_threads,
                // One spoold, the same across its restarts and upgrades: its pool.
                owner: format!("pool {}", pool.info().uuid),
                claim_wait: Duration::from_millis(cfg.ceph_claim_wait_ms),
                write_witness,
            },
            monitor,
            spares_used: Mutex::new(Vec::new()),
            quarantined: Mutex::new(BTreeMap::new()),
            retiring: Mutex::new(Vec::new()),
            exports: Mutex::default(),
            receiving: Mutex::default(),
            expected: Mutex::default(),
            transfer_at: std::sync::OnceLock::new(),
            replica_holds: Mutex::new(BTreeMap::new()),
            replicating: Mutex::new(BTreeMap::new()),
            last_current: Mutex::new(BTreeMap::new()),
            started: std::time::Instant::now(),
            stopping: AtomicBool::new(false),
            cfg,
            pool: Mutex::new(pool),
            servers: Mutex::new(BTreeMap::new()),
            keeping,
            store,
            phases: Mutex::new(vec![open_devices]),
        }
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

    /// Starts serving `v`, continuing the connection the previous worker kept for it.
    fn serve(&self, v: &VolumeInfo) -> Result<(), ServeError> {
        if !v.online {
            return Err(ServeError::Offline);
        }
        let layout = self.pool().layout(&v.uuid.to_string())?;
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
        let path = self.socket_path(&v.name);
        // Another host's replica: no frontend comes in before it is promoted.
        let (server, hold) = match v.replica {
            Some(_) => VolumeServer::start_held(&path, ctx, self.store.clone(), restore)
                .map(|(s, h)| (s, Some(h))),
            None => VolumeServer::start(&path, ctx, self.store.clone(), restore).map(|s| (s, None)),
        }
        .map_err(|source| ServeError::Socket { path, source })?;
        self.servers().insert(v.uuid, server);
        if let Some(h) = hold {
            self.hold_replica(v, h);
        }
        Ok(())
    }

    /// Configured devices the pool runs without, and why.
    pub fn left_out(&self) -> Vec<spool_pool::LeftOut> {
        self.pool().info().left_out
    }

    /// Volumes with their socket paths, for the start-up banner.
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

    /// Stops serving for a handoff to a new process: every queue drains and stops, the final
    /// state goes to the keeper; no socket is closed for the frontends.
    pub fn detach(&self) {
        let servers = std::mem::take(&mut *self.servers());
        for (_, s) in servers {
            s.detach();
        }
        self.pool().quiesce_mirrors();
    }

    /// Stops every server (workers drain their in-flight requests first).
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
        self.monitor.stop();
        let servers = std::mem::take(&mut *self.servers());
        for (_, s) in servers {
            s.shutdown();
        }
        self.pool().quiesce_mirrors();
    }
}
