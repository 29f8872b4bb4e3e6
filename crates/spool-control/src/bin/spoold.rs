//! spoold: the Spool storage daemon.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{mpsc, Arc, Mutex};

use clap::Parser;
use spool_control::{config, kept, qemu_command_line, size::format_size, Config, Daemon, Keeping};
use spool_keeper::link::Command;
use spool_keeper::{KeeperConfig, KeeperLink, Phase};

/// Pools this node's devices into logical volumes and serves each to a VM over
/// vhost-user-blk.
///
/// Without --config, runs the embedded default: two sparse 2 GiB files under the state
/// directory, one 1 GiB volume "vol0", sockets under STATE_DIR/vhost.
///
/// spoold runs as two processes: a small keeper that holds every socket, guest-memory and
/// eventfd descriptor, and the worker that serves I/O. If the worker dies the keeper restarts
/// it and VMs stay connected; `spoolctl upgrade` (or SIGUSR2 to the keeper) replaces the
/// worker with a new binary the same way. SIGTERM/SIGINT stop both.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Daemon configuration (TOML). See docs/config.md.
    #[arg(short, long)]
    config: Option<PathBuf>,
    /// State directory for the embedded default config.
    #[arg(long, default_value = "spool-state")]
    state_dir: PathBuf,
    /// Reformat devices whose metadata is foreign, corrupt or of an unknown format. Their data
    /// is lost.
    #[arg(long)]
    force: bool,
    /// Log filter (e.g. info, debug, spool_frontend=trace); RUST_LOG overrides it.
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Print the embedded default config and exit.
    #[arg(long)]
    print_default_config: bool,
    /// Run as a single process, without the descriptor keeper: a crash or restart then makes
    /// every VM reconnect (QEMU's reconnect=1), and `spoolctl upgrade` is unavailable.
    #[arg(long)]
    no_keeper: bool,
    /// Do not keep a standby worker process ready (it takes process start-up off a crash
    /// restart's critical path, for one more idle process).
    #[arg(long)]
    no_standby: bool,
    /// Recovery without spoold: write encrypted volume VOLUME's data key (64 bytes) to
    /// --key-out, unwrapped with the config's [encryption] key, and print the `cryptsetup
    /// open --type plain` line that reads the volume. Reads the metadata of the config's
    /// first device (or --device) without opening the pool; spoold may be running.
    #[arg(long, value_name = "VOLUME", requires = "key_out")]
    export_key: Option<String>,
    /// Where --export-key writes the key (created, mode 0600; never an existing file).
    #[arg(long, value_name = "FILE")]
    key_out: Option<PathBuf>,
    /// The pool device --export-key reads (default: the config's first device).
    #[arg(long, value_name = "PATH")]
    device: Option<PathBuf>,
    /// Upgrade tests only (docs/upgrade.md, "Playing a bad new binary"): as an upgrade
    /// candidate, read session state formats only up to N, as an older binary would.
    #[arg(long, value_name = "N", hide = true)]
    test_max_state_format: Option<u32>,
    /// Upgrade tests only: as an upgrade candidate, fail right after taking over the kept
    /// state, as a broken binary would (the keeper then rolls back).
    #[arg(long, hide = true)]
    test_fail_restore: bool,
}

/// How this binary plays an older or a broken one (the upgrade tests' hidden flags).
#[derive(Clone, Copy)]
struct Playing {
    /// The newest session state format read.
    max_state_format: u32,
    /// Fail right after taking the kept state.
    fail_restore: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| args.log_level.clone());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let state_dir = std::path::absolute(&args.state_dir).unwrap_or(args.state_dir.clone());
    if args.print_default_config {
        print!("{}", config::embedded_default(&state_dir));
        return ExitCode::SUCCESS;
    }
    let link = match KeeperLink::from_env() {
        Some(Ok(l)) => Some(Arc::new(l)),
        Some(Err(e)) => {
            eprintln!("spoold: error: keeper channel: {e}");
            return ExitCode::FAILURE;
        }
        None => None,
    };
    let config_path = args.config.clone();
    let load = move || match &config_path {
        Some(p) => Config::load(p),
        None => Config::parse(&config::embedded_default(&state_dir), &state_dir),
    };
    let cfg = match load() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("spoold: error: {e}");
            if let Some(l) = &link {
                let _ = l.failed(&e.to_string());
            }
            return ExitCode::FAILURE;
        }
    };
    if let (Some(volume), Some(out)) = (&args.export_key, &args.key_out) {
        return export_key(&cfg, volume, out, args.device.as_deref());
    }
    if link.is_none() && !args.no_keeper {
        return keeper(!args.no_standby, cfg.health.worker_watchdog_ms);
    }
    let playing = Playing {
        max_state_format: args
            .test_max_state_format
            .unwrap_or(spool_frontend::SESSION_STATE_FORMAT),
        fail_restore: args.test_fail_restore,
    };
    worker(cfg, &load, args.force, link, playing)
}

/// `--export-key`: the data key to a new private file, and how to open the volume with it.
fn export_key(cfg: &Config, volume: &str, out: &Path, device: Option<&Path>) -> ExitCode {
    let run = || -> Result<(), ExportError> {
        let source = cfg.encryption.as_ref().ok_or(ExportError::NoEncryption)?;
        let kek = source.load()?;
        let dev = device
            .map(Path::to_path_buf)
            .or_else(|| cfg.devices.first().map(|d| d.path.clone()))
            .ok_or(ExportError::NoDevice)?;
        let k = spool_pool::export_key_offline(&dev, volume, &kek)?;
        let write = |why| ExportError::Write {
            path: out.to_path_buf(),
            why,
        };
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(out)
            .map_err(write)?;
        f.write_all(k.key.bytes())
            .and_then(|_| f.sync_all())
            .map_err(write)?;
        println!(
            "wrote the data key of volume {} to {}",
            k.volume,
            out.display()
        );
        match k.contiguous_at {
            Some(at) => println!(
                "cryptsetup open --type plain --cipher {} --key-size 512 --key-file {} --keyfile-size 64 --offset {} --size {} {} {}",
                spool_crypt::CIPHER,
                out.display(),
                at / 512,
                k.size / 512,
                dev.display(),
                k.volume
            ),
            None => println!(
                "the volume is not contiguous on {}: map its extents (spoolctl volume show) with dm-crypt's aes-xts-plain64, each with --skip at its volume offset",
                dev.display()
            ),
        }
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("spoold: error: --export-key: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Why `--export-key` wrote no key.
#[derive(Debug, thiserror::Error)]
enum ExportError {
    #[error("the config has no [encryption] section")]
    NoEncryption,
    #[error(transparent)]
    Kek(#[from] config::KekError),
    #[error("the config names no device: pass --device")]
    NoDevice,
    #[error(transparent)]
    Pool(#[from] spool_pool::Error),
    #[error("{}: {why}", .path.display())]
    Write { path: PathBuf, why: std::io::Error },
}

/// Keeper mode: hold descriptors, run the worker (this same binary) and restart it.
fn keeper(standby: bool, watchdog_ms: u64) -> ExitCode {
    let binary = match std::env::current_exe() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("spoold: error: cannot find my own executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Workers inherit the keeper's working directory, so relative paths keep their meaning
    // for every later worker and upgrade.
    let worker_args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let mut cfg = KeeperConfig::new(binary, worker_args);
    cfg.standby = standby;
    cfg.worker_watchdog = std::time::Duration::from_millis(watchdog_ms);
    spool_keeper::run_keeper(cfg)
}

/// Under a keeper, a panic in any thread of the worker (a bug: guest and operator input are
/// answered with errors, never panics) ends the whole worker. The keeper starts the next one,
/// which continues every vhost-user connection and resubmits from the journal what was in
/// flight: a restart the VMs do not see. A queue thread that died alone would instead leave
/// its requests unanswered forever.
fn end_worker_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        tracing::error!(%info, "a worker thread panicked; ending the worker so that the keeper restarts it");
        std::process::abort();
    }));
}

/// Why an upgrade candidate refuses the state the old worker kept.
#[derive(Debug, thiserror::Error)]
enum PreviewError {
    #[error("{key}: {source}")]
    Format {
        key: String,
        source: serde_json::Error,
    },
    #[error(
        "the running worker writes session state format {have}; this binary reads up to {max}"
    )]
    NewerWorker { have: u32, max: u32 },
    #[error("{key}: unreadable session state: {source}")]
    Session {
        key: String,
        source: serde_json::Error,
    },
    #[error("{key}: session state format {have} is newer than this binary reads ({max})")]
    NewerSession { key: String, have: u32, max: u32 },
}

/// Checks, as an upgrade candidate, that this binary reads every state the old worker kept.
fn validate_preview(entries: &[(String, String)], max: u32) -> Result<(), PreviewError> {
    for (k, v) in entries {
        if k == kept::FORMAT_KEY {
            let f: kept::StateFormat =
                serde_json::from_str(v).map_err(|source| PreviewError::Format {
                    key: k.clone(),
                    source,
                })?;
            if f.session > max {
                return Err(PreviewError::NewerWorker {
                    have: f.session,
                    max,
                });
            }
        } else if k.ends_with(kept::SESSION_SUFFIX) {
            let st: spool_frontend::SessionState =
                serde_json::from_str(v).map_err(|source| PreviewError::Session {
                    key: k.clone(),
                    source,
                })?;
            if st.format > max {
                return Err(PreviewError::NewerSession {
                    key: k.clone(),
                    have: st.format,
                    max,
                });
            }
        }
    }
    Ok(())
}

/// Why the worker stops before serving.
#[derive(Debug, thiserror::Error)]
enum WorkerError {
    /// Already reported (to the keeper, or by it).
    #[error("refused")]
    Reported,
    #[error("keeper: {0}")]
    Keeper(#[from] std::io::Error),
    #[error(transparent)]
    Start(#[from] spool_control::daemon::StartError),
    #[error("RPC socket {}: {source}", .path.display())]
    Rpc {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("metrics endpoint {}: {source}", .addr.map(|a| a.to_string()).unwrap_or_default())]
    Metrics {
        addr: Option<std::net::SocketAddr>,
        source: std::io::Error,
    },
    #[error("transfer listener {}: {source}", .addr.map(|a| a.to_string()).unwrap_or_default())]
    Transfer {
        addr: Option<std::net::SocketAddr>,
        source: std::io::Error,
    },
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    #[error(transparent)]
    Config(#[from] config::ConfigError),
}

impl WorkerError {
    /// What the keeper is told, for errors it must hear about.
    fn keeper_reason(&self) -> Option<String> {
        match self {
            WorkerError::Start(e) => Some(e.to_string()),
            WorkerError::Rpc { source, .. } => Some(source.to_string()),
            WorkerError::Metrics { .. } | WorkerError::Config(_) => Some(self.to_string()),
            _ => None,
        }
    }
}

enum Event {
    Keeper(Command),
    Signal(i32),
}

/// Reads the config (again: a standby worker read it when it started, long before it serves).
type LoadConfig<'a> = &'a dyn Fn() -> Result<Config, config::ConfigError>;

fn worker(
    cfg: Config,
    load: LoadConfig,
    force: bool,
    link: Option<Arc<KeeperLink>>,
    playing: Playing,
) -> ExitCode {
    if link.is_some() {
        end_worker_on_panic();
    }
    // This worker's cluster connections: the pool's RBD devices open through them, and they
    // are closed before the process exits.
    let ceph = Arc::new(spool_devices::CephClusters::default());
    let code = match serve(cfg, load, force, link.as_ref(), playing, &ceph) {
        Ok(()) => 0,
        Err(WorkerError::Reported) => 1,
        Err(e) => {
            eprintln!("spoold: error: {e}");
            if let (Some(l), Some(reason)) = (&link, e.keeper_reason()) {
                let _ = l.failed(&reason);
            }
            1
        }
    };
    leave_ceph(&ceph, code);
    if code == 0 {
        tracing::info!("stopped");
    }
    ExitCode::from(code)
}

/// Ends the worker's use of Ceph before the process exits. While a cluster connection lives,
/// librados runs threads of its own, and `exit(3)` runs the library's static destructors under
/// them: a SIGSEGV at exit (Ceph tracker 36732; it failed a graceful stop in CI). Connections
/// no image uses any more are shut down (after a stop the daemon is gone and its images are
/// closed, so their watches leave the cluster now, not 30 s later); if one is still in use (a
/// handoff leaves its images to the exit, a connection is still being made) the process leaves
/// here with `_exit(2)`, without exit handlers, as Ceph's own tools do.
fn leave_ceph(ceph: &spool_devices::CephClusters, code: u8) {
    let t = std::time::Instant::now();
    match ceph.close() {
        spool_devices::CephConnections::Closed { any: false } => {}
        spool_devices::CephConnections::Closed { any: true } => tracing::info!(
            ms = t.elapsed().as_secs_f64() * 1e3,
            "closed the ceph cluster connection"
        ),
        spool_devices::CephConnections::InUse => {
            tracing::info!("a ceph connection is still in use: leaving without exit handlers");
            use std::io::Write;
            let _ = std::io::stdout().flush();
            let _ = std::io::stderr().flush();
            // SAFETY: _exit(2) takes no pointers; it ends the process without running exit
            // handlers or destructors, which is the point (see above).
            unsafe { libc::_exit(i32::from(code)) }
        }
    }
}

/// Takes over what the previous worker kept (after checking it, as an upgrade candidate).
fn take_over(l: &Arc<KeeperLink>, playing: Playing) -> Result<Keeping, WorkerError> {
    let max = playing.max_state_format;
    if l.is_candidate() && !l.preview(|e| Ok(validate_preview(e, max)?))? {
        return Err(WorkerError::Reported);
    }
    let restored = l.receive_store()?;
    l.set_report(restored.info.last_restart.clone());
    if restored.info.reason != "first-start" {
        tracing::info!(reason = %restored.info.reason, generation = restored.info.generation, kept = restored.keys().len(), "taking over from the previous worker");
    }
    // Only as an upgrade candidate: the keeper's own workers (a first start, a crash restart,
    // the standby, a rollback) are started with the keeper's arguments, never the flag a
    // wrapper adds, but a stray flag on the keeper must not fail every one of them.
    if playing.fail_restore && l.is_candidate() {
        let _ = l.failed("--test-fail-restore is set");
        return Err(WorkerError::Reported);
    }
    Ok(Keeping {
        link: l.clone(),
        restored: Mutex::new(restored),
    })
}

/// Starts the daemon and its RPC socket, reports ready, and serves until told to stop.
fn serve(
    cfg: Config,
    load: LoadConfig,
    force: bool,
    link: Option<&Arc<KeeperLink>>,
    playing: Playing,
    clusters: &Arc<spool_devices::CephClusters>,
) -> Result<(), WorkerError> {
    if cfg.ceph_configured {
        // Connected while a standby waits (or while an upgrade candidate is previewed), not
        // in the restart's stall; the pool's devices find the connection made.
        let ceph = spool_devices::Ceph::new(cfg.ceph.clone(), clusters.clone());
        std::thread::spawn(move || {
            let t = std::time::Instant::now();
            match ceph.warm_up() {
                Ok(()) => tracing::debug!(
                    ms = t.elapsed().as_secs_f64() * 1e3,
                    "connected to the ceph cluster ahead of need"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot connect to the ceph cluster ahead of need")
                }
            }
        });
    }
    let keeping = link.map(|l| take_over(l, playing)).transpose()?;
    // From here on this worker serves: a standby may have waited long for the store, and
    // the config may have changed meanwhile.
    let t_start = std::time::Instant::now();
    let cfg = if keeping.is_some() { load()? } else { cfg };
    let quiet = keeping.as_ref().is_some_and(|k| {
        k.restored
            .lock()
            .map(|r| r.info.reason != "first-start")
            .unwrap_or(false)
    });
    let daemon = Daemon::start(cfg, force, keeping, clusters.clone())?;
    let rpc_path = daemon.config().rpc_socket.clone();
    if let Err(source) = daemon.serve_rpc() {
        daemon.shutdown();
        return Err(WorkerError::Rpc {
            path: rpc_path,
            source,
        });
    }
    if let Err(source) = daemon.serve_metrics() {
        daemon.shutdown();
        return Err(WorkerError::Metrics {
            addr: daemon.config().metrics_listen,
            source,
        });
    }
    if let Err(source) = daemon.serve_transfers() {
        daemon.shutdown();
        return Err(WorkerError::Transfer {
            addr: daemon.config().transfer.as_ref().map(|t| t.listen),
            source,
        });
    }
    if !quiet {
        banner(&daemon, &rpc_path);
    }
    let events = listen(link)?;
    if let Some(l) = link {
        let mut phases = daemon.start_phases();
        phases.push(Phase::new("worker start total", t_start.elapsed()));
        let _ = l.ready(phases);
        daemon.start_progress_reports();
    }
    stop_when_told(&daemon, link, events.recv().ok(), clusters);
    let _ = std::fs::remove_file(&rpc_path);
    Ok(())
}

/// Signals and keeper commands, on one channel.
fn listen(link: Option<&Arc<KeeperLink>>) -> Result<mpsc::Receiver<Event>, WorkerError> {
    let (tx, rx) = mpsc::channel();
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT])
        .map_err(WorkerError::Signals)?;
    let signal_tx = tx.clone();
    std::thread::spawn(move || {
        for sig in signals.forever() {
            if signal_tx.send(Event::Signal(sig)).is_err() {
                return;
            }
        }
    });
    if let Some(l) = link {
        let cmds = l.commands()?;
        std::thread::spawn(move || {
            for c in cmds {
                if tx.send(Event::Keeper(c)).is_err() {
                    return;
                }
            }
        });
    }
    Ok(rx)
}

/// Hands over to the next worker (quiesce: never returns) or drains and stops.
fn stop_when_told(
    daemon: &Daemon,
    link: Option<&Arc<KeeperLink>>,
    event: Option<Event>,
    ceph: &spool_devices::CephClusters,
) {
    match event {
        Some(Event::Keeper(Command::Quiesce)) => {
            let t = std::time::Instant::now();
            tracing::info!("keeper asked for a handoff: stopping queues, keeping connections");
            daemon.detach();
            if let Some(l) = link {
                let _ = l.quiesced(vec![Phase::new("drain and stop queues", t.elapsed())]);
            }
            // Devices and journals are released when this process exits; the keeper hands
            // over once it has.
            leave_ceph(ceph, 0);
            std::process::exit(0);
        }
        Some(Event::Keeper(_)) => {
            tracing::info!("keeper asked to shut down: draining in-flight I/O")
        }
        Some(Event::Signal(sig)) => {
            tracing::info!(signal = sig, "shutting down: draining in-flight I/O")
        }
        None => {}
    }
    if let Some(l) = link {
        let _ = l.exiting();
    }
    daemon.shutdown();
}

fn banner(daemon: &Daemon, rpc_path: &std::path::Path) {
    println!(
        "spoold ready. RPC: {}  (spoolctl --socket {} volume list)",
        rpc_path.display(),
        rpc_path.display()
    );
    for (v, sock) in daemon.volumes() {
        match sock {
            Some(s) => {
                println!(
                    "volume {} ({}, {} queue{}{}): {}",
                    v.name,
                    format_size(v.size),
                    v.num_queues,
                    if v.num_queues == 1 { "" } else { "s" },
                    if v.read_only { ", read-only" } else { "" },
                    s.display()
                );
                println!(
                    "  boot a VM on it:\n  {}",
                    qemu_command_line(&s, &v.name, v.num_queues)
                );
            }
            None => println!("volume {}: OFFLINE (a device is missing)", v.name),
        }
    }
    for l in daemon.left_out() {
        println!("device {} LEFT OUT (not touched): {}", l.path, l.reason);
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
}
