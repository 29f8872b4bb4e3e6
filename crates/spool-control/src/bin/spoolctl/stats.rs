//! `volume stats`: totals since the worker started, or with `--watch` the rates and latency
//! of each interval (differences of two snapshots), refreshed in place on a terminal.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use spool_api::client::Client;
use spool_api::size::format_size;
use spool_api::stats::quantile_us;
use spool_api::{self as api, OpStats, VolumeStats};

use super::args::Args;
use super::table::{header, table};
use super::CtlError;

fn us(v: Option<u64>) -> String {
    v.map_or("-".into(), |u| format!("≤{u}µs"))
}

/// Totals since the worker started.
pub fn totals(vols: &Vec<VolumeStats>) -> String {
    let mut rows = vec![header(&[
        "VOLUME",
        "READS",
        "WRITES",
        "OTHER",
        "READ",
        "WRITTEN",
        "ERRORS",
        "INFLIGHT",
        "READ p50/p99",
        "WRITE p50/p99",
        "UPTIME",
    ])];
    for v in vols {
        rows.push(vec![
            v.volume.clone(),
            v.read.ops.to_string(),
            v.write.ops.to_string(),
            v.other.ops.to_string(),
            format_size(v.read.bytes),
            format_size(v.write.bytes),
            (v.read.errors + v.write.errors + v.other.errors + v.rejected).to_string(),
            v.in_flight.to_string(),
            format!("{}/{}", us(v.read.p50_us), us(v.read.p99_us)),
            format!("{}/{}", us(v.write.p50_us), us(v.write.p99_us)),
            format!("{:.0}s", v.uptime_s),
        ]);
    }
    table(rows)
}

/// What happened between two snapshots of one op kind.
fn delta(now: &OpStats, then: Option<&OpStats>) -> OpStats {
    let Some(t) = then.filter(|t| t.ops <= now.ops) else {
        return now.clone();
    };
    let buckets: Vec<u64> = now
        .buckets
        .iter()
        .zip(&t.buckets)
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    OpStats {
        ops: now.ops - t.ops,
        bytes: now.bytes.saturating_sub(t.bytes),
        errors: now.errors.saturating_sub(t.errors),
        mean_us: 0.0,
        p50_us: quantile_us(&buckets, 0.5),
        p99_us: quantile_us(&buckets, 0.99),
        buckets,
    }
}

fn rates(now: &[VolumeStats], then: &[VolumeStats], secs: f64) -> String {
    let mut rows = vec![header(&[
        "VOLUME",
        "R IOPS",
        "W IOPS",
        "R/s",
        "W/s",
        "ERR/s",
        "INFLIGHT",
        "R p50/p99",
        "W p50/p99",
    ])];
    for v in now {
        let old = then.iter().find(|o| o.uuid == v.uuid);
        let (r, w) = (
            delta(&v.read, old.map(|o| &o.read)),
            delta(&v.write, old.map(|o| &o.write)),
        );
        let errs = v.read.errors + v.write.errors + v.other.errors
            - old.map_or(0, |o| o.read.errors + o.write.errors + o.other.errors);
        rows.push(vec![
            v.volume.clone(),
            format!("{:.0}", r.ops as f64 / secs),
            format!("{:.0}", w.ops as f64 / secs),
            format_size((r.bytes as f64 / secs) as u64),
            format_size((w.bytes as f64 / secs) as u64),
            format!("{:.0}", errs as f64 / secs),
            v.in_flight.to_string(),
            format!("{}/{}", us(r.p50_us), us(r.p99_us)),
            format!("{}/{}", us(w.p50_us), us(w.p99_us)),
        ]);
    }
    table(rows)
}

/// `volume stats --watch`: a table of each interval's rates until interrupted.
pub fn watch(
    args: &Args,
    id: Option<String>,
    interval: f64,
    count: Option<u64>,
) -> Result<(), CtlError> {
    let every = Duration::from_secs_f64(interval.clamp(0.1, 3600.0));
    let mut c = Client::connect(&args.socket)?;
    let params = api::VolumeStatsParams { id };
    let mut then = c.request::<api::VolumeStatsGet>(&params)?;
    let mut t0 = Instant::now();
    let tty = std::io::stdout().is_terminal();
    for _ in 0..count.unwrap_or(u64::MAX) {
        std::thread::sleep(every);
        let now = c.request::<api::VolumeStatsGet>(&params)?;
        let secs = t0.elapsed().as_secs_f64();
        t0 = Instant::now();
        if args.json {
            println!("{}", serde_json::to_string(&now).unwrap_or_default());
        } else {
            if tty {
                print!("\x1b[H\x1b[2J");
            }
            println!("{}", rates(&now, &then, secs));
        }
        then = now;
    }
    Ok(())
}
