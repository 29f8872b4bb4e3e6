//! spool-bench: an fio-like load generator for vhost-user-blk backends (spoold,
//! qemu-storage-daemon, ...) built on the real libblkio client.
//!
//! One thread per queue, each keeping `iodepth` requests in flight; reports IOPS, MiB/s,
//! latency (mean, p50, p99, p99.9) and, with `--server-pid`, the server's CPU time per I/O.

//!
//! `run.rs` is the load itself, `ab.rs` the A/B mode, `hist.rs` the latency histogram; this
//! file owns the command line, the `--verify` pattern and printing the reports.

mod ab;
mod error;
mod hist;
mod run;

use clap::{Parser, ValueEnum};
use serde::Serialize;

use run::run;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Rw {
    Read,
    Write,
    Randread,
    Randwrite,
    Randrw,
    /// Discard (deallocate) each block.
    Trim,
    /// Write zeroes to each block (no data transferred).
    Zero,
}

/// Drive a vhost-user-blk socket with libblkio and report throughput and latency.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// vhost-user-blk socket.
    #[arg(long)]
    socket: String,
    /// Access pattern.
    #[arg(long, value_enum, default_value = "randread")]
    rw: Rw,
    /// Percentage of reads for randrw.
    #[arg(long, default_value_t = 70)]
    rwmixread: u32,
    /// Block size in bytes.
    #[arg(long, default_value_t = 4096)]
    bs: usize,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = 32)]
    iodepth: usize,
    /// Queues (one client thread each).
    #[arg(long, default_value_t = 1)]
    queues: usize,
    /// Seconds to run (after warm-up).
    #[arg(long, default_value_t = 5.0)]
    runtime: f64,
    /// Seconds of warm-up not counted.
    #[arg(long, default_value_t = 0.5)]
    warmup: f64,
    /// Bytes of the device to use (default: all of it, at most 1 GiB).
    #[arg(long)]
    size: Option<u64>,
    /// Use libblkio poll queues (busy-polling client) instead of interrupt-driven ones.
    #[arg(long)]
    poll: bool,
    /// PID of the server process, to report its CPU time per I/O.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Label for the result.
    #[arg(long, default_value = "")]
    label: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Connect and start the queues, then issue no request for warm-up + runtime seconds:
    /// what a connected guest doing no I/O costs the server (measure its CPU meanwhile).
    #[arg(long)]
    idle: bool,
    /// Write a completion timeline (CSV: millisecond since start, successful and failed
    /// completions in it) for
    /// stall plots; restarts show up as gaps.
    #[arg(long)]
    timeline: Option<std::path::PathBuf>,
    /// Verify data: writes store a pattern that depends only on `--seed` and the byte offset
    /// (so concurrent or repeated writes of a block agree), and every read must return that
    /// pattern exactly. Mismatches are counted and make the exit status non-zero.
    #[arg(long)]
    verify: bool,
    /// Seed of the `--verify` pattern.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write (or with --rw read, read) every block of the span exactly once, sequentially,
    /// then stop (instead of running for --runtime). With --verify: lay the pattern down, or
    /// check all of it.
    #[arg(long)]
    fill: bool,
    /// With --verify: reads must return zeroes (after --rw zero) instead of the pattern.
    #[arg(long)]
    expect_zeroes: bool,
    /// Describe each request's buffer with N iovecs (pieces of bs/N bytes, not sector or page
    /// aligned) instead of one: exercises servers' scatter-gather paths.
    #[arg(long, default_value_t = 1)]
    iovecs: usize,
    /// Issue a flush after every N writes on each queue (like fio's fsync=N).
    #[arg(long, default_value_t = 0)]
    fsync: u32,
    /// A/B mode: a second vhost-user-blk socket (B; --socket is A). One client thread
    /// switches between the two every --slice-ms for --runtime seconds (ABBA order) and
    /// reports A/B ratios of IOPS and mean latency, median over the pairs of slices with a
    /// bootstrap 95% interval: small differences between two servers, which separate runs on
    /// a shared machine cannot show. One queue; read, write, randread, randwrite or randrw.
    #[arg(long, value_name = "SOCKET")]
    compare: Option<String>,
    /// Length of one A/B slice in milliseconds (the first fifth is not counted).
    #[arg(long, default_value_t = 100)]
    slice_ms: u64,
}

/// The 8-byte word of the `--verify` pattern at byte offset `off` (a multiple of 8).
fn pattern_word(seed: u64, off: u64) -> u64 {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ off.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 29)
}

fn fill_pattern(buf: &mut [u8], seed: u64, off: u64) {
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&pattern_word(seed, off + i as u64 * 8).to_le_bytes());
    }
}

fn check_pattern(buf: &[u8], seed: u64, off: u64) -> bool {
    buf.chunks_exact(8)
        .enumerate()
        .all(|(i, w)| w == pattern_word(seed, off + i as u64 * 8).to_le_bytes())
}

#[derive(Serialize, Debug)]
struct Report {
    label: String,
    rw: Rw,
    bs: usize,
    iodepth: usize,
    queues: usize,
    runtime_s: f64,
    ios: u64,
    iops: f64,
    mib_s: f64,
    lat_mean_us: f64,
    lat_p50_us: f64,
    lat_p99_us: f64,
    lat_p999_us: f64,
    /// The slowest request: during a restart, the stall the client saw.
    lat_max_us: f64,
    errors: u64,
    /// Reads that did not return the `--verify` pattern.
    mismatches: u64,
    server_cpu_us_per_io: Option<f64>,
}

fn cpu_ticks(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

pub(crate) struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if args.iodepth == 0
        || args.queues == 0
        || args.bs == 0
        || args.bs % 512 != 0
        || args.iovecs == 0
        || args.iovecs > args.bs
    {
        eprintln!("spool-bench: error: iodepth, queues and iovecs must be >= 1, bs a multiple of 512, iovecs at most bs");
        return std::process::ExitCode::FAILURE;
    }
    if let Some(b) = &args.compare {
        return compare(&args, b);
    }
    match run(&args) {
        Ok(r) => {
            if args.json {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
            } else {
                println!(
                    "{:<20} {:>9} bs={:<7} qd={:<3} q={} iops={:>10.0} {:>8.1} MiB/s lat mean={:.1}us p50={:.1} p99={:.1} p99.9={:.1} errors={}{}{}",
                    r.label,
                    format!("{:?}", r.rw).to_lowercase(),
                    r.bs,
                    r.iodepth,
                    r.queues,
                    r.iops,
                    r.mib_s,
                    r.lat_mean_us,
                    r.lat_p50_us,
                    r.lat_p99_us,
                    r.lat_p999_us,
                    r.errors,
                    if args.verify { format!(" mismatches={}", r.mismatches) } else { String::new() },
                    r.server_cpu_us_per_io.map(|c| format!(" server_cpu={c:.2}us/io")).unwrap_or_default()
                );
            }
            if r.errors > 0 || r.mismatches > 0 {
                return std::process::ExitCode::FAILURE;
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("spool-bench: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// `--compare`: the A/B mode ([`ab`]).
fn compare(args: &Args, b: &str) -> std::process::ExitCode {
    let unsupported = [
        (args.queues != 1, "--queues other than 1"),
        (args.verify, "--verify"),
        (args.fill, "--fill"),
        (args.timeline.is_some(), "--timeline"),
        (args.iovecs != 1, "--iovecs"),
        (args.fsync != 0, "--fsync"),
        (matches!(args.rw, Rw::Trim | Rw::Zero), "--rw trim/zero"),
        (args.slice_ms < 10, "--slice-ms below 10"),
        (
            args.socket == b,
            "the same socket twice (a server serves a volume to one client)",
        ),
    ];
    if let Some((_, what)) = unsupported.iter().find(|(bad, _)| *bad) {
        eprintln!("spool-bench: error: --compare does not support {what}");
        return std::process::ExitCode::FAILURE;
    }
    match ab::run_ab(args, b) {
        Ok(r) => {
            if args.json {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
            } else {
                println!(
                    "{} {:?} bs={} qd={}: {} pairs of {} ms slices\n  A {}: {:.0} IOPS, mean {:.2} us\n  B {}: {:.0} IOPS, mean {:.2} us\n  A/B IOPS {:.4} [{:.4}, {:.4}], A/B latency {:.4} [{:.4}, {:.4}] (median, 95% interval)",
                    r.label,
                    r.rw,
                    r.bs,
                    r.iodepth,
                    r.pairs,
                    r.slice_ms,
                    r.a,
                    r.a_iops,
                    r.a_lat_mean_us,
                    r.b,
                    r.b_iops,
                    r.b_lat_mean_us,
                    r.iops_ratio.median,
                    r.iops_ratio.low,
                    r.iops_ratio.high,
                    r.lat_ratio.median,
                    r.lat_ratio.low,
                    r.lat_ratio.high,
                );
            }
            if r.errors > 0 {
                eprintln!("spool-bench: {} requests failed", r.errors);
                return std::process::ExitCode::FAILURE;
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("spool-bench: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
