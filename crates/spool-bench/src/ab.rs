//! A/B mode (`--compare`): two servers measured by one client in alternating short slices.
//!
//! Separate runs of two servers on a shared machine differ by more than a few percent for
//! reasons that have nothing to do with the servers (which host core a thread lands on, what
//! the neighbours do), so a small difference between them cannot be seen in whole runs. Here
//! one client thread keeps a connection to each server and switches between them every
//! `--slice-ms`, in ABBA order, keeping `iodepth` requests in flight on one side at a time
//! (the other side's server has nothing to do and, if it polls, should be told to sleep
//! soon: spoold's `poll_idle_us`). Each pair of neighbouring slices gives one ratio; the
//! result is the median ratio with a bootstrap 95% interval. Owns only the measurement: it
//! knows nothing about either server.

use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use serde::Serialize;

use crate::error::BenchError;
use crate::{Args, Rng, Rw};

/// One connected server.
struct Side {
    _blkio: Blkio,
    _region: MemoryRegion,
    q: Blkioq,
    base: usize,
    span: u64,
}

/// What one slice measured (warm-up part excluded).
#[derive(Clone, Copy, Default)]
struct Slice {
    iops: f64,
    lat_mean_us: f64,
}

/// Median of the per-pair ratios A/B with a bootstrap 95% interval.
#[derive(Serialize, Debug, Clone, Copy)]
pub struct Ratio {
    pub median: f64,
    pub low: f64,
    pub high: f64,
}

/// Result of an A/B run.
#[derive(Serialize, Debug)]
pub struct AbReport {
    pub label: String,
    pub rw: Rw,
    pub bs: usize,
    pub iodepth: usize,
    pub slice_ms: u64,
    pub pairs: usize,
    pub a: String,
    pub b: String,
    /// Medians over the slices of each side.
    pub a_iops: f64,
    pub b_iops: f64,
    pub a_lat_mean_us: f64,
    pub b_lat_mean_us: f64,
    /// A's IOPS over B's, pair by pair.
    pub iops_ratio: Ratio,
    /// A's mean latency over B's, pair by pair.
    pub lat_ratio: Ratio,
    /// Per pair: [A IOPS, B IOPS, A mean latency µs, B mean latency µs].
    pub slices: Vec<[f64; 4]>,
    pub errors: u64,
}

/// Connects to `socket` and starts its one queue; errors name the socket.
fn open(socket: &str, args: &Args) -> Result<Side, BenchError> {
    connect(socket, args).map_err(|e| BenchError::Socket {
        socket: socket.to_string(),
        source: Box::new(e),
    })
}

fn connect(socket: &str, args: &Args) -> Result<Side, BenchError> {
    let e = BenchError::blkio;
    let mut b = Blkio::new("virtio-blk-vhost-user").map_err(e("libblkio"))?;
    b.set_str("path", socket).map_err(e("path"))?;
    b.connect().map_err(e("connect"))?;
    if args.poll {
        b.set_i32("num-queues", 0).map_err(e("num-queues"))?;
        b.set_i32("num-poll-queues", 1)
            .map_err(e("num-poll-queues"))?;
    } else {
        b.set_i32("num-queues", 1).map_err(e("num-queues"))?;
    }
    let out = b.start().map_err(e("start"))?;
    let q = if args.poll {
        out.poll_queues
    } else {
        out.queues
    }
    .into_iter()
    .next()
    .ok_or(BenchError::NoQueue)?;
    let capacity = b.get_u64("capacity").map_err(e("capacity"))?;
    let span = args.size.unwrap_or(capacity.min(1 << 30)).min(capacity) / args.bs as u64;
    if span == 0 {
        return Err(BenchError::TooSmall);
    }
    let region = b
        .alloc_mem_region(args.bs * args.iodepth)
        .map_err(e("alloc"))?;
    b.map_mem_region(&region).map_err(e("map"))?;
    Ok(Side {
        base: region.addr,
        _region: region,
        _blkio: b,
        q,
        span,
    })
}

impl Side {
    /// Issues a `bs`-byte read or write of block `blk` (modulo the span) from `slot`'s buffer.
    fn issue(&mut self, bs: usize, slot: usize, blk: u64, write: bool) {
        let off = (blk % self.span) * bs as u64;
        let buf = (self.base + slot * bs) as *mut u8;
        if write {
            self.q.write(off, buf, bs, slot, ReqFlags::empty());
        } else {
            self.q.read(off, buf, bs, slot, ReqFlags::empty());
        }
    }
}

/// The next request of the `--rw` pattern: its block (sequential from `seq`, else random)
/// and whether it writes.
fn next_request(args: &Args, rng: &mut Rng, seq: &mut u64) -> (u64, bool) {
    let blk = match args.rw {
        Rw::Read | Rw::Write => {
            *seq += 1;
            *seq
        }
        _ => rng.next(),
    };
    let write = match args.rw {
        Rw::Write | Rw::Randwrite => true,
        Rw::Randrw => (rng.next() % 100) as u32 >= args.rwmixread,
        _ => false,
    };
    (blk, write)
}

/// Keeps `iodepth` requests in flight on `side` for `dur`, then lets them finish. Counts the
/// completions after `warm`.
fn slice(
    side: &mut Side,
    args: &Args,
    rng: &mut Rng,
    dur: Duration,
    warm: Duration,
) -> (Slice, u64) {
    let mut comps: Vec<MaybeUninit<Completion>> =
        (0..args.iodepth).map(|_| MaybeUninit::uninit()).collect();
    let mut issued = vec![Instant::now(); args.iodepth];
    let mut seq = 0u64;
    let start = Instant::now();
    let (from, end) = (start + warm, start + dur);
    for (slot, t) in issued.iter_mut().enumerate() {
        let (blk, write) = next_request(args, rng, &mut seq);
        *t = Instant::now();
        side.issue(args.bs, slot, blk, write);
    }
    let mut in_flight = args.iodepth;
    let (mut ios, mut lat_ns, mut errors) = (0u64, 0u128, 0u64);
    while in_flight > 0 {
        let n = match side
            .q
            .do_io(&mut comps, 1, Some(&mut Duration::from_secs(5)), None)
        {
            Ok(0) | Err(_) => {
                errors += in_flight as u64;
                break;
            }
            Ok(n) => n,
        };
        let now = Instant::now();
        for c in &comps[..n] {
            // SAFETY: do_io initialised the first n completions.
            let c = unsafe { c.assume_init_ref() };
            let slot = c.user_data;
            in_flight -= 1;
            if c.ret != 0 {
                errors += 1;
            }
            if now >= from && now < end {
                ios += 1;
                lat_ns += (now - issued[slot]).as_nanos();
            }
            if now < end {
                let (blk, write) = next_request(args, rng, &mut seq);
                issued[slot] = Instant::now();
                side.issue(args.bs, slot, blk, write);
                in_flight += 1;
            }
        }
    }
    let secs = (dur - warm).as_secs_f64();
    let s = Slice {
        iops: ios as f64 / secs,
        lat_mean_us: if ios > 0 {
            lat_ns as f64 / ios as f64 / 1000.0
        } else {
            0.0
        },
    };
    (s, errors)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Median of `xs` with a bootstrap 95% interval (2000 resamples, fixed seed).
fn median_ci(xs: &[f64]) -> Ratio {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut meds: Vec<f64> = (0..2000)
        .map(|_| {
            let mut r: Vec<f64> = (0..xs.len())
                .map(|_| xs[(rng.next() % xs.len() as u64) as usize])
                .collect();
            median(&mut r)
        })
        .collect();
    meds.sort_by(f64::total_cmp);
    Ratio {
        median: median(&mut xs.to_vec()),
        low: meds[50],
        high: meds[1949],
    }
}

/// Runs the A/B measurement: `--socket` is A, `--compare` is B.
pub fn run_ab(args: &Args, b_socket: &str) -> Result<AbReport, BenchError> {
    let mut a = open(&args.socket, args)?;
    let mut b = open(b_socket, args)?;
    let dur = Duration::from_millis(args.slice_ms);
    // The first part of each slice is not counted: the server just switched to may be
    // waking up from its sleep.
    let warm = dur / 5;
    let pairs = ((args.runtime * 1000.0 / (2 * args.slice_ms) as f64).round() as usize).max(2);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut errors = 0;
    // One unmeasured slice on each side first (caches, the servers' first requests).
    for side in [&mut a, &mut b] {
        errors += slice(side, args, &mut rng, dur, warm).1;
    }
    let mut slices = Vec::with_capacity(pairs);
    for p in 0..pairs {
        // ABBA: a drift during the run counts against each side equally.
        let (sa, sb) = if p % 2 == 0 {
            let (sa, ea) = slice(&mut a, args, &mut rng, dur, warm);
            let (sb, eb) = slice(&mut b, args, &mut rng, dur, warm);
            errors += ea + eb;
            (sa, sb)
        } else {
            let (sb, eb) = slice(&mut b, args, &mut rng, dur, warm);
            let (sa, ea) = slice(&mut a, args, &mut rng, dur, warm);
            errors += ea + eb;
            (sa, sb)
        };
        slices.push([sa.iops, sb.iops, sa.lat_mean_us, sb.lat_mean_us]);
    }
    let valid: Vec<&[f64; 4]> = slices
        .iter()
        .filter(|s| s.iter().all(|&x| x > 0.0))
        .collect();
    if valid.is_empty() {
        return Err(BenchError::NoPairs { errors });
    }
    let col = |i: usize| -> Vec<f64> { valid.iter().map(|s| s[i]).collect() };
    let iops_ratio: Vec<f64> = valid.iter().map(|s| s[0] / s[1]).collect();
    let lat_ratio: Vec<f64> = valid.iter().map(|s| s[2] / s[3]).collect();
    Ok(AbReport {
        label: args.label.clone(),
        rw: args.rw,
        bs: args.bs,
        iodepth: args.iodepth,
        slice_ms: args.slice_ms,
        pairs: valid.len(),
        a: args.socket.clone(),
        b: b_socket.to_string(),
        a_iops: median(&mut col(0)),
        b_iops: median(&mut col(1)),
        a_lat_mean_us: median(&mut col(2)),
        b_lat_mean_us: median(&mut col(3)),
        iops_ratio: median_ci(&iops_ratio),
        lat_ratio: median_ci(&lat_ratio),
        slices,
        errors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_interval() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        let xs: Vec<f64> = (0..101).map(|i| 0.95 + i as f64 * 0.001).collect();
        let r = median_ci(&xs);
        assert!((r.median - 1.0).abs() < 1e-9);
        assert!(
            r.low < 1.0 && r.high > 1.0 && r.low > 0.98 && r.high < 1.02,
            "{r:?}"
        );
    }
}
