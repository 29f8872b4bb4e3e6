//! spool-bench: an fio-like load generator for vhost-user-blk backends (spoold,
//! qemu-storage-daemon, ...) built on the real libblkio client.
//!
//! One thread per queue, each keeping `iodepth` requests in flight; reports IOPS, MiB/s,
//! latency (mean, p50, p99, p99.9) and, with `--server-pid`, the server's CPU time per I/O.

mod ab;
mod hist;

use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use blkio::{Blkio, Completion, ReqFlags};
use clap::{Parser, ValueEnum};
use serde::Serialize;

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

fn run(args: &Args) -> Result<Report, String> {
    fn e(what: &'static str) -> impl Fn(blkio::Error) -> String {
        move |err| format!("{what}: {}", err.message())
    }
    let mut b = Blkio::new("virtio-blk-vhost-user").map_err(e("libblkio"))?;
    b.set_str("path", &args.socket).map_err(e("path"))?;
    b.connect().map_err(e("connect"))?;
    if args.poll {
        b.set_i32("num-queues", 0).map_err(e("num-queues"))?;
        b.set_i32("num-poll-queues", args.queues as i32)
            .map_err(e("num-poll-queues"))?;
    } else {
        b.set_i32("num-queues", args.queues as i32)
            .map_err(e("num-queues"))?;
    }
    let out = b.start().map_err(e("start"))?;
    let queues = if args.poll {
        out.poll_queues
    } else {
        out.queues
    };
    let capacity = b.get_u64("capacity").map_err(e("capacity"))?;
    let span = args.size.unwrap_or(capacity.min(1 << 30)).min(capacity) / args.bs as u64;
    if span == 0 {
        return Err("device smaller than one block".into());
    }
    let per_queue = args.bs * args.iodepth;
    let region = b
        .alloc_mem_region(per_queue * args.queues)
        .map_err(e("alloc"))?;
    b.map_mem_region(&region).map_err(e("map"))?;
    let base = region.addr;
    let cpu0 = args.server_pid.and_then(cpu_ticks);
    let start = Instant::now();
    let warm = Duration::from_secs_f64(args.warmup);
    let stop = warm + Duration::from_secs_f64(args.runtime);
    type PerQueue = (u64, u64, hist::LatHist, Option<Vec<[u32; 2]>>, u64);
    let warm = if args.fill { Duration::ZERO } else { warm };
    let results: Vec<PerQueue> = std::thread::scope(|s| {
        let handles: Vec<_> = queues
            .into_iter()
            .enumerate()
            .map(|(qi, mut q)| {
                s.spawn(move || {
                    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (qi as u64 + 1));
                    let share_start = qi as u64 * span / args.queues as u64;
                    let share_end = (qi as u64 + 1) * span / args.queues as u64;
                    // With --fill the first submit takes share_start itself.
                    let mut seq = if args.fill {
                        share_start.wrapping_sub(1)
                    } else {
                        share_start % span
                    };
                    let mut offs = vec![(0u64, false); args.iodepth];
                    let mut mismatches = 0u64;
                    let mut in_flight = 0usize;
                    let mut issued = vec![Instant::now(); args.iodepth];
                    let mut lats = hist::LatHist::default();
                    // Per millisecond: [successful, failed] completions.
                    let mut timeline: Option<Vec<[u32; 2]>> = args
                        .timeline
                        .as_ref()
                        .map(|_| vec![[0u32; 2]; (stop.as_millis() as usize) + 10_000]);
                    let (mut ios, mut errors) = (0u64, 0u64);
                    let mut comps: Vec<MaybeUninit<Completion>> =
                        (0..args.iodepth).map(|_| MaybeUninit::uninit()).collect();
                    let writes_since_flush = std::cell::Cell::new(0u32);
                    // Per slot, its buffer cut into `--iovecs` contiguous pieces.
                    let iovs: Vec<Vec<libc::iovec>> = (0..args.iodepth)
                        .map(|slot| {
                            let buf = base + qi * per_queue + slot * args.bs;
                            let n = args.iovecs;
                            (0..n)
                                .map(|i| {
                                    let from = i * args.bs / n;
                                    let to = (i + 1) * args.bs / n;
                                    libc::iovec {
                                        iov_base: (buf + from) as *mut libc::c_void,
                                        iov_len: to - from,
                                    }
                                })
                                .collect()
                        })
                        .collect();
                    // Issues the next request in `slot`; false when --fill has covered its share.
                    let submit = |q: &mut blkio::Blkioq,
                                  slot: usize,
                                  rng: &mut Rng,
                                  seq: &mut u64,
                                  offs: &mut Vec<(u64, bool)>|
                     -> bool {
                        if args.fsync > 0 && writes_since_flush.get() >= args.fsync {
                            writes_since_flush.set(0);
                            offs[slot] = (0, true);
                            q.flush(slot, ReqFlags::empty());
                            return true;
                        }
                        let blk = if args.fill {
                            *seq = seq.wrapping_add(1);
                            if *seq >= share_end {
                                return false;
                            }
                            *seq
                        } else {
                            match args.rw {
                                Rw::Read | Rw::Write => {
                                    *seq = (*seq + 1) % span;
                                    *seq
                                }
                                Rw::Trim | Rw::Zero => {
                                    *seq = (*seq + 1) % span;
                                    *seq
                                }
                                _ => rng.next() % span,
                            }
                        };
                        let write = match args.rw {
                            Rw::Write | Rw::Randwrite | Rw::Trim | Rw::Zero => true,
                            Rw::Randrw => (rng.next() % 100) as u32 >= args.rwmixread,
                            _ => false,
                        };
                        let buf = (base + qi * per_queue + slot * args.bs) as *mut u8;
                        let off = blk * args.bs as u64;
                        offs[slot] = (off, write);
                        if write {
                            writes_since_flush.set(writes_since_flush.get() + 1);
                        }
                        if args.rw == Rw::Trim {
                            q.discard(off, args.bs as u64, slot, ReqFlags::empty());
                        } else if args.rw == Rw::Zero {
                            q.write_zeroes(off, args.bs as u64, slot, ReqFlags::empty());
                        } else if write {
                            if args.verify {
                                // SAFETY: this slot's bs bytes of the mapped region belong to
                                // this thread and no request is using them now.
                                let b = unsafe { std::slice::from_raw_parts_mut(buf, args.bs) };
                                fill_pattern(b, args.seed, off);
                            }
                            if args.iovecs > 1 {
                                let v = &iovs[slot];
                                q.writev(off, v.as_ptr(), v.len() as u32, slot, ReqFlags::empty());
                            } else {
                                q.write(off, buf, args.bs, slot, ReqFlags::empty());
                            }
                        } else if args.iovecs > 1 {
                            let v = &iovs[slot];
                            q.readv(off, v.as_ptr(), v.len() as u32, slot, ReqFlags::empty());
                        } else {
                            q.read(off, buf, args.bs, slot, ReqFlags::empty());
                        }
                        true
                    };
                    for (slot, t) in issued.iter_mut().enumerate() {
                        *t = Instant::now();
                        if submit(&mut q, slot, &mut rng, &mut seq, &mut offs) {
                            in_flight += 1;
                        }
                    }
                    loop {
                        if args.fill && in_flight == 0 {
                            break;
                        }
                        let n = match q.do_io(&mut comps, 1, None, None) {
                            Ok(n) => n,
                            Err(_) => {
                                errors += 1;
                                break;
                            }
                        };
                        let now = Instant::now();
                        let since = now - start;
                        let ms = since.as_millis() as usize;
                        for c in &comps[..n] {
                            // SAFETY: do_io initialised the first n completions.
                            let c = unsafe { c.assume_init_ref() };
                            let slot = c.user_data;
                            in_flight -= 1;
                            let (off, write) = offs[slot];
                            if args.verify && !write && c.ret == 0 {
                                // SAFETY: the read into this slot's buffer has completed.
                                let b = unsafe {
                                    std::slice::from_raw_parts(
                                        (base + qi * per_queue + slot * args.bs) as *const u8,
                                        args.bs,
                                    )
                                };
                                let good = if args.expect_zeroes {
                                    b.iter().all(|&x| x == 0)
                                } else {
                                    check_pattern(b, args.seed, off)
                                };
                                if !good {
                                    if mismatches < 5 {
                                        eprintln!(
                                            "spool-bench: verify: wrong data at offset {off}"
                                        );
                                    }
                                    mismatches += 1;
                                }
                            }
                            if let Some(cell) = timeline.as_mut().and_then(|tl| tl.get_mut(ms)) {
                                cell[usize::from(c.ret != 0)] += 1;
                            }
                            if since >= warm {
                                ios += 1;
                                if c.ret != 0 {
                                    errors += 1;
                                }
                                lats.record((now - issued[slot]).as_nanos() as u64);
                            }
                            if since < stop || args.fill {
                                issued[slot] = Instant::now();
                                if submit(&mut q, slot, &mut rng, &mut seq, &mut offs) {
                                    in_flight += 1;
                                }
                            }
                        }
                        if since >= stop && !args.fill {
                            // Drain what is still in flight, uncounted.
                            let outstanding = args.iodepth - n;
                            let mut left = outstanding;
                            while left > 0 {
                                match q.do_io(
                                    &mut comps,
                                    1,
                                    Some(&mut Duration::from_secs(5)),
                                    None,
                                ) {
                                    Ok(0) | Err(_) => break,
                                    Ok(m) => left = left.saturating_sub(m),
                                }
                            }
                            break;
                        }
                    }
                    (ios, errors, lats, timeline, mismatches)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread"))
            .collect()
    });
    let elapsed = if args.fill {
        start.elapsed().as_secs_f64()
    } else {
        args.runtime
    };
    let mismatches: u64 = results.iter().map(|r| r.4).sum();
    let cpu1 = args.server_pid.and_then(cpu_ticks);
    let ios: u64 = results.iter().map(|r| r.0).sum();
    let errors: u64 = results.iter().map(|r| r.1).sum();
    if let Some(path) = &args.timeline {
        let len = results
            .iter()
            .filter_map(|r| r.3.as_ref().map(Vec::len))
            .max()
            .unwrap_or(0);
        let mut total = vec![[0u64; 2]; len];
        for r in &results {
            for (i, c) in r.3.iter().flatten().enumerate() {
                total[i][0] += c[0] as u64;
                total[i][1] += c[1] as u64;
            }
        }
        let end = (start.elapsed().as_millis() as usize).min(len);
        let csv: String = std::iter::once("ms,completions,errors\n".to_string())
            .chain(
                total[..end]
                    .iter()
                    .enumerate()
                    .map(|(i, [ok, err])| format!("{i},{ok},{err}\n")),
            )
            .collect();
        std::fs::write(path, csv).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let mut lats = hist::LatHist::default();
    for r in &results {
        lats.merge(&r.2);
    }
    let pct = |p: f64| lats.quantile_ns(p) as f64 / 1000.0;
    let mean = lats.mean_ns() / 1000.0;
    // SAFETY: sysconf takes no pointers.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let total_secs = start.elapsed().as_secs_f64();
    let server_cpu_us_per_io = match (cpu0, cpu1) {
        // The server's CPU over the whole run (warm-up included) per I/O of the whole run,
        // estimated from the measured rate.
        (Some(a), Some(b)) if ios > 0 => {
            let all_ios = ios as f64 * total_secs / elapsed;
            Some((b - a) as f64 / hz * 1e6 / all_ios)
        }
        _ => None,
    };
    Ok(Report {
        label: args.label.clone(),
        rw: args.rw,
        bs: args.bs,
        iodepth: args.iodepth,
        queues: args.queues,
        runtime_s: elapsed,
        ios,
        iops: ios as f64 / elapsed,
        mib_s: ios as f64 * args.bs as f64 / elapsed / (1 << 20) as f64,
        lat_mean_us: mean,
        lat_p50_us: pct(0.50),
        lat_p99_us: pct(0.99),
        lat_p999_us: pct(0.999),
        lat_max_us: lats.max_ns() as f64 / 1000.0,
        errors,
        mismatches,
        server_cpu_us_per_io,
    })
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
