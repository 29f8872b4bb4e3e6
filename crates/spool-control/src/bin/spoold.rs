//! spoold: the Spool storage daemon.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use clap::Parser;
use spool_control::{config, qemu_command_line, rpc, size::format_size, Config, Daemon, Keeping};
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
    let cfg = match &args.config {
        Some(p) => Config::load(p),
        None => Config::parse(&config::embedded_default(&state_dir), &state_dir),
    };
    let cfg = match cfg {
        Ok(c) => c,
        Err(e) => {
            eprintln!("spoold: error: {e}");
            if let Some(l) = &link {
                let _ = l.failed(&e.to_string());
            }
            return ExitCode::FAILURE;
        }
    };
    if link.is_none() && !args.no_keeper {
        return keeper();
    }
    worker(cfg, args.force, link)
}

/// Keeper mode: hold descriptors, run the worker (this same binary) and restart it.
fn keeper() -> ExitCode {
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
    spool_keeper::run_keeper(KeeperConfig::new(binary, worker_args))
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

/// Checks, as an upgrade candidate, that this binary reads every state the old worker kept.
fn validate_preview(entries: &[(String, String)]) -> Result<(), String> {
    // Test hook (docs/upgrade.md): pretend to read only formats up to N, like an older binary.
    let max: u32 = std::env::var("SPOOL_TEST_MAX_STATE_FORMAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(spool_frontend::SESSION_STATE_FORMAT);
    for (k, v) in entries {
        if k == spool_control::daemon::FORMAT_KEY {
            let f: serde_json::Value = serde_json::from_str(v).map_err(|e| format!("{k}: {e}"))?;
            let have = f
                .get("session")
                .and_then(|x| x.as_u64())
                .unwrap_or(u64::MAX);
            if have > max as u64 {
                return Err(format!(
                    "the running worker writes session state format {have}; this binary reads up to {max}"
                ));
            }
        } else if k.ends_with("/session") {
            let st: spool_frontend::SessionState = serde_json::from_str(v)
                .map_err(|e| format!("{k}: unreadable session state: {e}"))?;
            if st.format > max {
                return Err(format!(
                    "{k}: session state format {} is newer than this binary reads ({max})",
                    st.format
                ));
            }
        }
    }
    Ok(())
}

enum Event {
    Keeper(Command),
    Signal(i32),
}

fn worker(cfg: Config, force: bool, link: Option<Arc<KeeperLink>>) -> ExitCode {
    let t_start = std::time::Instant::now();
    if link.is_some() {
        end_worker_on_panic();
    }
    let keeping = match &link {
        None => None,
        Some(l) => {
            if l.is_candidate() {
                match l.preview(validate_preview) {
                    Ok(true) => {}
                    Ok(false) => return ExitCode::FAILURE,
                    Err(e) => {
                        eprintln!("spoold: error: keeper: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            let restored = match l.receive_store() {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("spoold: error: keeper: {e}");
                    return ExitCode::FAILURE;
                }
            };
            l.set_report(restored.info.last_restart.clone());
            if restored.info.reason != "first-start" {
                tracing::info!(reason = %restored.info.reason, generation = restored.info.generation, kept = restored.keys().len(), "taking over from the previous worker");
            }
            // Test hook (docs/upgrade.md): fail after taking the store, to exercise rollback.
            if std::env::var_os("SPOOL_TEST_FAIL_RESTORE").is_some() {
                let _ = l.failed("SPOOL_TEST_FAIL_RESTORE is set");
                return ExitCode::FAILURE;
            }
            Some(Keeping {
                link: l.clone(),
                restored: Mutex::new(restored),
            })
        }
    };
    let quiet = keeping.as_ref().is_some_and(|k| {
        k.restored
            .lock()
            .map(|r| r.info.reason != "first-start")
            .unwrap_or(false)
    });
    let daemon = match Daemon::start(cfg, force, keeping) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("spoold: error: {e}");
            if let Some(l) = &link {
                let _ = l.failed(&e);
            }
            return ExitCode::FAILURE;
        }
    };
    let rpc_path = daemon.config().rpc_socket.clone();
    if let Err(e) = rpc::serve(&rpc_path, daemon.clone()) {
        eprintln!("spoold: error: RPC socket {}: {e}", rpc_path.display());
        if let Some(l) = &link {
            let _ = l.failed(&e.to_string());
        }
        daemon.shutdown();
        return ExitCode::FAILURE;
    }
    if !quiet {
        banner(&daemon, &rpc_path);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    match signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT]) {
        Ok(mut s) => {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for sig in s.forever() {
                    if tx.send(Event::Signal(sig)).is_err() {
                        return;
                    }
                }
            });
        }
        Err(e) => {
            eprintln!("spoold: error: cannot install signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    }
    if let Some(l) = &link {
        match l.commands() {
            Ok(cmds) => {
                std::thread::spawn(move || {
                    for c in cmds {
                        if tx.send(Event::Keeper(c)).is_err() {
                            return;
                        }
                    }
                });
            }
            Err(e) => {
                eprintln!("spoold: error: keeper: {e}");
                return ExitCode::FAILURE;
            }
        }
        let mut phases = daemon.start_phases();
        phases.push(Phase::new("worker start total", t_start.elapsed()));
        let _ = l.ready(phases);
    }
    match rx.recv() {
        Ok(Event::Keeper(Command::Quiesce)) => {
            let t = std::time::Instant::now();
            tracing::info!("keeper asked for a handoff: stopping queues, keeping connections");
            daemon.detach();
            if let Some(l) = &link {
                let _ = l.quiesced(vec![Phase::new("drain and stop queues", t.elapsed())]);
            }
            // Devices and journals are released when this process exits; the keeper hands
            // over once it has.
            std::process::exit(0);
        }
        Ok(Event::Keeper(_)) => tracing::info!("keeper asked to shut down: draining in-flight I/O"),
        Ok(Event::Signal(sig)) => {
            tracing::info!(signal = sig, "shutting down: draining in-flight I/O")
        }
        Err(_) => {}
    }
    if let Some(l) = &link {
        let _ = l.exiting();
    }
    daemon.shutdown();
    let _ = std::fs::remove_file(&rpc_path);
    tracing::info!("stopped");
    ExitCode::SUCCESS
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
