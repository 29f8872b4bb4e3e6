//! The torture tester's command line: runs cases seed after seed, prints each outcome, and on
//! a failure shrinks it and prints it as a ready test (to keep in `tests/kept.rs`).

use std::time::{Duration, Instant};

use clap::Parser;
use spool_torture::{run_in_temp, shrink, Case, STEPS};

/// Drive Spool's volume stacks with seeded random work, faults and restarts, against a model.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// First seed (default: from the clock; printed, so the run can be replayed).
    #[arg(long)]
    seed: Option<u64>,
    /// Cases to run (seeds `seed`, `seed + 1`, ...).
    #[arg(long, default_value_t = 20)]
    runs: u64,
    /// Stop starting new cases after this many minutes.
    #[arg(long)]
    minutes: Option<f64>,
    /// Steps per case.
    #[arg(long, default_value_t = STEPS)]
    steps: usize,
    /// Runs spent shrinking a failure (0: print it as it is).
    #[arg(long, default_value_t = 60)]
    shrink_budget: usize,
    /// Go on after a failure (every failure is printed; the exit status says there was one).
    #[arg(long)]
    keep_going: bool,
}

fn main() {
    let args = Args::parse();
    // The pool's own log, only when asked for (RUST_LOG=spool_mirror=debug…): read beside
    // SPOOL_TORTURE_TRACE's steps when a failing case is studied.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let first = args.seed.unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        t.map_or(1, |d| d.as_nanos() as u64 % 1_000_000_007)
    });
    let deadline = args
        .minutes
        .map(|m| Instant::now() + Duration::from_secs_f64(m * 60.0));
    println!(
        "spool-torture: seeds from {first}, {} runs, {} steps each",
        args.runs, args.steps
    );
    let mut failures = 0;
    for seed in first..first.saturating_add(args.runs) {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            println!("time is up");
            break;
        }
        let case = Case::generate(seed, args.steps);
        let w = &case.world;
        let what = format!(
            "seed {seed}: {:?} of {} bytes on {} devices, {} queues",
            w.kind,
            w.size,
            w.devices.len(),
            w.queues
        );
        let t0 = Instant::now();
        match run_in_temp(&case) {
            Ok(s) => println!(
                "{what}: ok ({} requests, {} failed and retried out, {} MiB checked, {} restarts, {} power cuts losing {} writes, {} snapshots, {} reverts/clones/inflates) in {:.1} s",
                s.requests,
                s.failed_requests,
                s.bytes_checked >> 20,
                s.restarts,
                s.power_cuts,
                s.writes_lost,
                s.snapshots,
                s.controls,
                t0.elapsed().as_secs_f64()
            ),
            Err(f) => {
                failures += 1;
                println!("{what}: FAILED at {f}");
                let mut again = |c: &Case| run_in_temp(c).map(|_| ());
                let (small, f, runs) = shrink(&case, f, args.shrink_budget, &mut again);
                println!(
                    "shrunk in {runs} runs to {} steps, failing at {f}; as a test:\n\n{}",
                    small.steps.len(),
                    small.as_test()
                );
                if !args.keep_going {
                    break;
                }
            }
        }
    }
    if failures > 0 {
        std::process::exit(1);
    }
}
