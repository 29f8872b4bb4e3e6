//! spoold: the Spool storage daemon.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use spool_control::{config, qemu_command_line, rpc, size::format_size, Config, Daemon};

/// Pools this node's devices into logical volumes and serves each to a VM over
/// vhost-user-blk.
///
/// Without --config, runs the embedded default: two sparse 2 GiB files under the state
/// directory, one 1 GiB volume "vol0", sockets under STATE_DIR/vhost.
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
    let cfg = match &args.config {
        Some(p) => Config::load(p),
        None => Config::parse(&config::embedded_default(&state_dir), &state_dir),
    };
    let cfg = match cfg {
        Ok(c) => c,
        Err(e) => {
            eprintln!("spoold: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let daemon = match Daemon::start(cfg, args.force) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("spoold: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rpc_path = daemon.config().rpc_socket.clone();
    if let Err(e) = rpc::serve(&rpc_path, daemon.clone()) {
        eprintln!("spoold: error: RPC socket {}: {e}", rpc_path.display());
        daemon.shutdown();
        return ExitCode::FAILURE;
    }
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
    use std::io::Write;
    let _ = std::io::stdout().flush();

    let mut signals = match signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("spoold: error: cannot install signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(sig) = signals.forever().next() {
        tracing::info!(signal = sig, "shutting down: draining in-flight I/O");
    }
    daemon.shutdown();
    let _ = std::fs::remove_file(&rpc_path);
    tracing::info!("stopped");
    ExitCode::SUCCESS
}
