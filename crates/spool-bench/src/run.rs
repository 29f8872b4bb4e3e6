//! The fio-like run: connects to one server with libblkio, keeps `iodepth` requests in flight
//! on each queue (one thread per queue) for the runtime or, with `--fill`, over the span
//! once, and turns what the threads saw into a [`Report`] (and the `--timeline` CSV).
//!
//! Owns: the per-queue load loop ([`QueueLoad`]), the `--verify` checks of read data, the
//! server's CPU time per I/O.
//!
//! Must not know: the A/B mode (`ab.rs`), how a report is printed.

use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, ReqFlags};

use crate::error::BenchError;
use crate::{check_pattern, cpu_ticks, fill_pattern, hist, Args, Report, Rng, Rw};

/// What one queue's thread counted.
struct QueueResult {
    ios: u64,
    errors: u64,
    lats: hist::LatHist,
    /// Per millisecond: [successful, failed] completions (with `--timeline`).
    timeline: Option<Vec<[u32; 2]>>,
    mismatches: u64,
}

/// Where a run's clock stands: `warm` and `stop` count from `start`.
#[derive(Clone, Copy)]
struct Clock {
    start: Instant,
    warm: Duration,
    stop: Duration,
}

/// One queue's load: its share of the span, its slots' buffers and what it counted so far.
struct QueueLoad<'a> {
    args: &'a Args,
    clock: Clock,
    span: u64,
    share_end: u64,
    /// This queue's slot buffers: slot `i` is `bufs + i * bs`.
    bufs: usize,
    rng: Rng,
    seq: u64,
    /// Per slot: the offset of its request and whether it writes.
    offs: Vec<(u64, bool)>,
    issued: Vec<Instant>,
    /// Per slot, its buffer cut into `--iovecs` contiguous pieces.
    iovs: Vec<Vec<libc::iovec>>,
    writes_since_flush: u32,
    in_flight: usize,
    out: QueueResult,
}

impl<'a> QueueLoad<'a> {
    fn new(args: &'a Args, clock: Clock, qi: usize, span: u64, bufs: usize) -> Self {
        let share_start = qi as u64 * span / args.queues as u64;
        let share_end = (qi as u64 + 1) * span / args.queues as u64;
        // With --fill the first submit takes share_start itself.
        let seq = if args.fill {
            share_start.wrapping_sub(1)
        } else {
            share_start % span
        };
        let iovs = (0..args.iodepth)
            .map(|slot| {
                let buf = bufs + slot * args.bs;
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
        QueueLoad {
            args,
            clock,
            span,
            share_end,
            bufs,
            rng: Rng(0x9e37_79b9_7f4a_7c15 ^ (qi as u64 + 1)),
            seq,
            offs: vec![(0u64, false); args.iodepth],
            issued: vec![Instant::now(); args.iodepth],
            iovs,
            writes_since_flush: 0,
            in_flight: 0,
            out: QueueResult {
                ios: 0,
                errors: 0,
                lats: hist::LatHist::default(),
                timeline: args
                    .timeline
                    .as_ref()
                    .map(|_| vec![[0u32; 2]; (clock.stop.as_millis() as usize) + 10_000]),
                mismatches: 0,
            },
        }
    }

    /// The next block of the `--rw` pattern; `None` when `--fill` has covered this share.
    fn next_block(&mut self) -> Option<u64> {
        let args = self.args;
        if args.fill {
            self.seq = self.seq.wrapping_add(1);
            if self.seq >= self.share_end {
                return None;
            }
            return Some(self.seq);
        }
        Some(match args.rw {
            Rw::Read | Rw::Write | Rw::Trim | Rw::Zero => {
                self.seq = (self.seq + 1) % self.span;
                self.seq
            }
            _ => self.rng.next() % self.span,
        })
    }

    /// Issues the next request in `slot`; false when `--fill` has covered its share.
    fn submit(&mut self, q: &mut Blkioq, slot: usize) -> bool {
        let args = self.args;
        if args.fsync > 0 && self.writes_since_flush >= args.fsync {
            self.writes_since_flush = 0;
            self.offs[slot] = (0, true);
            q.flush(slot, ReqFlags::empty());
            return true;
        }
        let Some(blk) = self.next_block() else {
            return false;
        };
        let write = match args.rw {
            Rw::Write | Rw::Randwrite | Rw::Trim | Rw::Zero => true,
            Rw::Randrw => (self.rng.next() % 100) as u32 >= args.rwmixread,
            _ => false,
        };
        let buf = (self.bufs + slot * args.bs) as *mut u8;
        let off = blk * args.bs as u64;
        self.offs[slot] = (off, write);
        if write {
            self.writes_since_flush += 1;
        }
        if args.rw == Rw::Trim {
            q.discard(off, args.bs as u64, slot, ReqFlags::empty());
        } else if args.rw == Rw::Zero {
            q.write_zeroes(off, args.bs as u64, slot, ReqFlags::empty());
        } else if write {
            if args.verify {
                // SAFETY: this slot's bs bytes of the mapped region belong to this thread and
                // no request is using them now.
                let b = unsafe { std::slice::from_raw_parts_mut(buf, args.bs) };
                fill_pattern(b, args.seed, off);
            }
            if args.iovecs > 1 {
                let v = &self.iovs[slot];
                q.writev(off, v.as_ptr(), v.len() as u32, slot, ReqFlags::empty());
            } else {
                q.write(off, buf, args.bs, slot, ReqFlags::empty());
            }
        } else if args.iovecs > 1 {
            let v = &self.iovs[slot];
            q.readv(off, v.as_ptr(), v.len() as u32, slot, ReqFlags::empty());
        } else {
            q.read(off, buf, args.bs, slot, ReqFlags::empty());
        }
        true
    }

    /// With `--verify`, checks the data a completed read of `slot` at `off` returned.
    fn verify_read(&mut self, slot: usize, off: u64) {
        let args = self.args;
        // SAFETY: the read into this slot's buffer has completed.
        let b = unsafe {
            std::slice::from_raw_parts((self.bufs + slot * args.bs) as *const u8, args.bs)
        };
        let good = if args.expect_zeroes {
            b.iter().all(|&x| x == 0)
        } else {
            check_pattern(b, args.seed, off)
        };
        if !good {
            if self.out.mismatches < 5 {
                eprintln!("spool-bench: verify: wrong data at offset {off}");
            }
            self.out.mismatches += 1;
        }
    }

    /// Counts one completion seen at `now` (`since` the start) and refills its slot while
    /// the run lasts.
    fn complete(&mut self, q: &mut Blkioq, c: &Completion, now: Instant, since: Duration) {
        let args = self.args;
        let slot = c.user_data;
        self.in_flight -= 1;
        let (off, write) = self.offs[slot];
        if args.verify && !write && c.ret == 0 {
            self.verify_read(slot, off);
        }
        let ms = since.as_millis() as usize;
        if let Some(cell) = self.out.timeline.as_mut().and_then(|tl| tl.get_mut(ms)) {
            cell[usize::from(c.ret != 0)] += 1;
        }
        if since >= self.clock.warm {
            self.out.ios += 1;
            if c.ret != 0 {
                self.out.errors += 1;
            }
            self.out
                .lats
                .record((now - self.issued[slot]).as_nanos() as u64);
        }
        if since < self.clock.stop || args.fill {
            self.issued[slot] = Instant::now();
            if self.submit(q, slot) {
                self.in_flight += 1;
            }
        }
    }

    /// Runs the queue until the runtime is over (then drains it, uncounted) or, with
    /// `--fill`, until its share is covered.
    fn drive(mut self, mut q: Blkioq) -> QueueResult {
        let args = self.args;
        let mut comps: Vec<MaybeUninit<Completion>> =
            (0..args.iodepth).map(|_| MaybeUninit::uninit()).collect();
        for slot in 0..args.iodepth {
            self.issued[slot] = Instant::now();
            if self.submit(&mut q, slot) {
                self.in_flight += 1;
            }
        }
        loop {
            if args.fill && self.in_flight == 0 {
                break;
            }
            let n = match q.do_io(&mut comps, 1, None, None) {
                Ok(n) => n,
                Err(_) => {
                    self.out.errors += 1;
                    break;
                }
            };
            let now = Instant::now();
            let since = now - self.clock.start;
            for c in &comps[..n] {
                // SAFETY: do_io initialised the first n completions.
                let c = unsafe { c.assume_init_ref() };
                self.complete(&mut q, c, now, since);
            }
            if since >= self.clock.stop && !args.fill {
                // Drain what is still in flight, uncounted.
                let mut left = args.iodepth - n;
                while left > 0 {
                    match q.do_io(&mut comps, 1, Some(&mut Duration::from_secs(5)), None) {
                        Ok(0) | Err(_) => break,
                        Ok(m) => left = left.saturating_sub(m),
                    }
                }
                break;
            }
        }
        self.out
    }
}

/// Connects to `args.socket` and starts its queues; returns the client, the queues and the
/// span in blocks.
fn connect(args: &Args) -> Result<(Blkio, Vec<Blkioq>, u64), BenchError> {
    let mut b = Blkio::new("virtio-blk-vhost-user").map_err(BenchError::blkio("libblkio"))?;
    b.set_str("path", &args.socket)
        .map_err(BenchError::blkio("path"))?;
    b.connect().map_err(BenchError::blkio("connect"))?;
    if args.poll {
        b.set_i32("num-queues", 0)
            .map_err(BenchError::blkio("num-queues"))?;
        b.set_i32("num-poll-queues", args.queues as i32)
            .map_err(BenchError::blkio("num-poll-queues"))?;
    } else {
        b.set_i32("num-queues", args.queues as i32)
            .map_err(BenchError::blkio("num-queues"))?;
    }
    let out = b.start().map_err(BenchError::blkio("start"))?;
    let queues = if args.poll {
        out.poll_queues
    } else {
        out.queues
    };
    let capacity = b
        .get_u64("capacity")
        .map_err(BenchError::blkio("capacity"))?;
    let span = args.size.unwrap_or(capacity.min(1 << 30)).min(capacity) / args.bs as u64;
    if span == 0 {
        return Err(BenchError::TooSmall);
    }
    Ok((b, queues, span))
}

pub(crate) fn run(args: &Args) -> Result<Report, BenchError> {
    let (mut b, queues, span) = connect(args)?;
    let per_queue = args.bs * args.iodepth;
    let region = b
        .alloc_mem_region(per_queue * args.queues)
        .map_err(BenchError::blkio("alloc"))?;
    b.map_mem_region(&region)
        .map_err(BenchError::blkio("map"))?;
    let base = region.addr;
    let cpu0 = args.server_pid.and_then(cpu_ticks);
    let start = Instant::now();
    let warm = Duration::from_secs_f64(args.warmup);
    let stop = warm + Duration::from_secs_f64(args.runtime);
    let warm = if args.fill { Duration::ZERO } else { warm };
    let clock = Clock { start, warm, stop };
    if args.idle {
        // Connected, rings started, nothing asked: the queues stay open until we return.
        std::thread::sleep(stop);
        drop(queues);
        let cpu1 = args.server_pid.and_then(cpu_ticks);
        return Ok(report(args, &[], start, args.runtime, cpu0.zip(cpu1)));
    }
    let results: Vec<QueueResult> = std::thread::scope(|s| {
        let handles: Vec<_> = queues
            .into_iter()
            .enumerate()
            .map(|(qi, q)| {
                s.spawn(move || {
                    QueueLoad::new(args, clock, qi, span, base + qi * per_queue).drive(q)
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
    let cpu1 = args.server_pid.and_then(cpu_ticks);
    if let Some(path) = &args.timeline {
        write_timeline(path, &results, start)?;
    }
    Ok(report(args, &results, start, elapsed, cpu0.zip(cpu1)))
}

/// Writes the `--timeline` CSV: completions and errors of all queues per millisecond.
fn write_timeline(
    path: &std::path::Path,
    results: &[QueueResult],
    start: Instant,
) -> Result<(), BenchError> {
    let len = results
        .iter()
        .filter_map(|r| r.timeline.as_ref().map(Vec::len))
        .max()
        .unwrap_or(0);
    let mut total = vec![[0u64; 2]; len];
    for r in results {
        for (i, c) in r.timeline.iter().flatten().enumerate() {
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
    std::fs::write(path, csv).map_err(|source| BenchError::Timeline {
        path: path.display().to_string(),
        source,
    })
}

/// Sums the queues' results into the report; `cpu` is the server's CPU ticks before and
/// after the run.
fn report(
    args: &Args,
    results: &[QueueResult],
    start: Instant,
    elapsed: f64,
    cpu: Option<(u64, u64)>,
) -> Report {
    let mismatches: u64 = results.iter().map(|r| r.mismatches).sum();
    let ios: u64 = results.iter().map(|r| r.ios).sum();
    let errors: u64 = results.iter().map(|r| r.errors).sum();
    let mut lats = hist::LatHist::default();
    for r in results {
        lats.merge(&r.lats);
    }
    let pct = |p: f64| lats.quantile_ns(p) as f64 / 1000.0;
    let mean = lats.mean_ns() / 1000.0;
    // SAFETY: sysconf takes no pointers.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let total_secs = start.elapsed().as_secs_f64();
    let server_cpu_us_per_io = match cpu {
        // The server's CPU over the whole run (warm-up included) per I/O of the whole run,
        // estimated from the measured rate.
        Some((a, b)) if ios > 0 => {
            let all_ios = ios as f64 * total_secs / elapsed;
            Some((b - a) as f64 / hz * 1e6 / all_ios)
        }
        _ => None,
    };
    Report {
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
    }
}
