//! The Prometheus endpoint (`[metrics] listen`, off by default; docs/metrics.md): a small HTTP
//! server (tiny_http) answering `GET /metrics` in the OpenMetrics text format, encoded with
//! the Prometheus project's own Rust client (prometheus-client) from a [`Snapshot`] taken
//! per scrape. Nothing is counted here: the queue workers count (spool-frontend's
//! `stats`), the health monitor counts device errors, the keeper counts restarts; a scrape
//! reads them.
//!
//! Owns: metric names, labels and help, the HTTP answers, reading thread CPU from /proc.
//! Must not know: the daemon (it gets a snapshot function), the data path.

use std::fmt::Write as _;
use std::net::TcpListener;

use crate::api::restart::{KindHistory, STALL_BUCKETS_MS};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use spool_frontend::stats::{LATENCY_BUCKETS, OP_NAMES};

use crate::api::{DeviceHealthReport, OpStats, Status, VolumeStats};

/// Everything one scrape shows.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub volumes: Vec<VolumeStats>,
    pub devices: Vec<DeviceHealthReport>,
    pub status: Status,
    pub space: Space,
    pub replication: Vec<Replication>,
}

/// A volume's replication (docs/replicas.md): a replica here, or one sent elsewhere.
#[derive(Debug, Clone, Default)]
pub struct Replication {
    pub volume: String,
    /// A replica of another host's: whether its primary said it is complete.
    pub replica: Option<bool>,
    /// The epoch it is served under here.
    pub epoch: u64,
    /// Its copy on another host: bytes that copy still lacks, whether it is current, and
    /// when it was last seen current (Unix seconds; 0: not since this worker started).
    pub send: Option<(u64, bool, f64)>,
}

/// The pool's space, and each thin volume's (docs/thin.md).
#[derive(Debug, Clone, Default)]
pub struct Space {
    pub size: u64,
    pub free: u64,
    pub thin_provisioned: u64,
    pub thin_mapped: u64,
    pub thin_shared: u64,
    /// Per thin volume: name, bytes backed by chunks, writes waiting for free space.
    pub thin: Vec<(String, u64, u64)>,
}

type Labels = Vec<(&'static str, String)>;

/// One metric family with rows of (labels, value).
fn family<V>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: impl IntoIterator<Item = (Labels, V)>,
    mut put: impl FnMut(&mut MetricEncoder, V) -> std::fmt::Result,
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in rows {
        if labels.is_empty() {
            put(&mut m, v)?;
        } else {
            put(&mut m.encode_family(&labels)?, v)?;
        }
    }
    Ok(())
}

fn counters(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (Labels, u64)>,
) -> std::fmt::Result {
    family(enc, name, help, MetricType::Counter, rows, |m, v| {
        m.encode_counter::<NoLabelSet, _, u64>(&v, None)
    })
}

fn gauges(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: impl IntoIterator<Item = (Labels, f64)>,
) -> std::fmt::Result {
    family(enc, name, help, MetricType::Gauge, rows, |m, v| {
        m.encode_gauge(&v)
    })
}

/// The histogram of one op kind: bucket i's bound is 2^i µs, the last one +Inf.
fn histogram(m: &mut MetricEncoder, o: &OpStats) -> std::fmt::Result {
    let buckets: Vec<(f64, u64)> = o
        .buckets
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let bound = if i + 1 == LATENCY_BUCKETS {
                f64::MAX
            } else {
                (1u64 << i) as f64 * 1e-6
            };
            (bound, *n)
        })
        .collect();
    let count = o.buckets.iter().sum();
    m.encode_histogram::<NoLabelSet>(o.mean_us * o.ops as f64 * 1e-6, count, &buckets, None)
}

/// The stall histogram of one kind of restart (bounds `STALL_BUCKETS_MS`, then +Inf).
fn stall_histogram(m: &mut MetricEncoder, h: &KindHistory) -> std::fmt::Result {
    let buckets: Vec<(f64, u64)> = h
        .stall_buckets
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let bound = STALL_BUCKETS_MS.get(i).map_or(f64::MAX, |ms| ms / 1e3);
            (bound, *n)
        })
        .collect();
    let count = h.stall_buckets.iter().sum();
    m.encode_histogram::<NoLabelSet>(h.stall_sum_ms / 1e3, count, &buckets, None)
}

fn per_op(v: &VolumeStats) -> [(&'static str, &OpStats); 3] {
    [
        (OP_NAMES[0], &v.read),
        (OP_NAMES[1], &v.write),
        (OP_NAMES[2], &v.other),
    ]
}

fn vol(v: &VolumeStats) -> Labels {
    vec![("volume", v.volume.clone())]
}

fn vol_op(v: &VolumeStats, op: &str) -> Labels {
    vec![("volume", v.volume.clone()), ("op", op.to_string())]
}

impl Snapshot {
    fn encode_volumes(&self, enc: &mut DescriptorEncoder) -> std::fmt::Result {
        let rows = |f: fn(&OpStats) -> u64| {
            self.volumes
                .iter()
                .flat_map(move |v| per_op(v).map(|(op, o)| (vol_op(v, op), f(o))))
                .collect::<Vec<_>>()
        };
        counters(enc, "spool_volume_requests", "Requests completed to the guest, by kind (read, write, other: flush, discard, write-zeroes, GET_ID).", rows(|o| o.ops))?;
        counters(
            enc,
            "spool_volume_bytes",
            "Data bytes of completed reads and writes.",
            rows(|o| o.bytes),
        )?;
        counters(
            enc,
            "spool_volume_errors",
            "Requests completed with an error status.",
            rows(|o| o.errors),
        )?;
        let mut m = enc.encode_descriptor(
            "spool_volume_latency_seconds",
            "Request latency, from the poll round that took a request to the one that completed it.",
            None,
            MetricType::Histogram,
        )?;
        for v in &self.volumes {
            for (op, o) in per_op(v) {
                let labels = vol_op(v, op);
                histogram(&mut m.encode_family(&labels)?, o)?;
            }
        }
        let each = |f: fn(&VolumeStats) -> u64| {
            self.volumes
                .iter()
                .map(move |v| (vol(v), f(v)))
                .collect::<Vec<_>>()
        };
        counters(
            enc,
            "spool_volume_rejected_requests",
            "Descriptor chains refused by the request parser (malformed or unsupported).",
            each(|v| v.rejected),
        )?;
        counters(
            enc,
            "spool_volume_resubmitted_requests",
            "Requests resubmitted from the journal after a restart.",
            each(|v| v.resubmitted),
        )?;
        counters(
            enc,
            "spool_volume_journal_recoveries",
            "Queues recovered from their journal rather than started clean.",
            each(|v| v.journal_recoveries),
        )?;
        counters(
            enc,
            "spool_volume_qos_throttled_rounds",
            "Poll rounds in which the volume's I/O limits held requests back.",
            each(|v| v.qos_throttled_rounds),
        )?;
        self.encode_volume_gauges(enc)
    }

    fn encode_volume_gauges(&self, enc: &mut DescriptorEncoder) -> std::fmt::Result {
        let each = |f: fn(&VolumeStats) -> f64| {
            self.volumes
                .iter()
                .map(move |v| (vol(v), f(v)))
                .collect::<Vec<_>>()
        };
        gauges(
            enc,
            "spool_volume_in_flight",
            "Requests taken from the guest and not yet completed.",
            each(|v| v.in_flight as f64),
        )?;
        gauges(
            enc,
            "spool_volume_queues",
            "Virtqueues the volume offers.",
            each(|v| f64::from(v.queues)),
        )?;
        gauges(
            enc,
            "spool_volume_queue_size",
            "Negotiated virtqueue size (descriptors per queue; the largest of the served queues, 0 without a frontend).",
            each(|v| v.queue_size as f64),
        )
    }

    fn encode_devices(&self, enc: &mut DescriptorEncoder) -> std::fmt::Result {
        let dev = |d: &DeviceHealthReport| -> Labels {
            vec![("device", d.device.to_string()), ("path", d.path.clone())]
        };
        let states = ["healthy", "resetting", "failed", "removed"];
        gauges(
            enc,
            "spool_device_state",
            "1 for the device's health state (healthy, resetting, failed, removed), 0 for the others.",
            self.devices.iter().flat_map(|d| {
                states.iter().map(move |s| {
                    let mut l = dev(d);
                    l.push(("state", s.to_string()));
                    (l, if d.state == *s { 1.0 } else { 0.0 })
                })
            }),
        )?;
        counters(
            enc,
            "spool_device_errors",
            "I/O errors reported by the data path, by class.",
            self.devices.iter().flat_map(|d| {
                let c = &d.counters;
                [
                    ("media", c.media_errors),
                    ("path", c.path_errors),
                    ("timeout", c.timeouts),
                    ("gone", c.gone_errors),
                    ("request", c.request_errors),
                ]
                .map(|(class, n)| {
                    let mut l = dev(d);
                    l.push(("class", class.to_string()));
                    (l, n)
                })
            }),
        )?;
        counters(
            enc,
            "spool_device_resets",
            "Device resets (controller resets, reopened queues).",
            self.devices.iter().map(|d| (dev(d), d.counters.resets)),
        )?;
        counters(
            enc,
            "spool_device_failed_probes",
            "Probes of a resetting device that failed.",
            self.devices
                .iter()
                .map(|d| (dev(d), d.counters.failed_probes)),
        )
    }

    fn encode_restarts(&self, enc: &mut DescriptorEncoder) -> std::fmt::Result {
        let s = &self.status;
        let last = s.last_restart.as_ref();
        counters(
            enc,
            "spool_restarts",
            "Worker restarts and upgrades by kind (crash-restart, upgrade, keeper-restart, rollback; -failed: did not complete), as the keeper counted them.",
            last.into_iter()
                .flat_map(|r| r.counts.iter())
                .map(|(k, n)| (vec![("kind", k.clone())], *n)),
        )?;
        let history = last.into_iter().flat_map(|r| r.history.iter());
        let mut m = enc.encode_descriptor(
            "spool_restart_stall_seconds",
            "Stalls of every restart and upgrade so far, by kind, as the keeper measured them.",
            None,
            MetricType::Histogram,
        )?;
        for (kind, h) in history.clone() {
            let labels = vec![("kind", kind.clone())];
            stall_histogram(&mut m.encode_family(&labels)?, h)?;
        }
        family(
            enc,
            "spool_restart_phase_seconds",
            "Each phase's duration summed over every restart and upgrade of a kind.",
            MetricType::Counter,
            history.flat_map(|(kind, h)| {
                h.phase_sum_ms.iter().map(move |(phase, ms)| {
                    (
                        vec![("kind", kind.clone()), ("phase", phase.clone())],
                        ms / 1e3,
                    )
                })
            }),
            |m, v: f64| m.encode_counter::<NoLabelSet, _, f64>(&v, None),
        )?;
        gauges(
            enc,
            "spool_last_restart_stall_seconds",
            "The last restart's or upgrade's stall: from service stopping to the new worker serving.",
            last.map(|r| (vec![("kind", r.kind.clone())], r.stall_ms / 1e3)),
        )?;
        gauges(
            enc,
            "spool_last_restart_phase_seconds",
            "Each phase of the last restart or upgrade.",
            last.into_iter().flat_map(|r| {
                r.phases.iter().map(|p| {
                    (
                        vec![("kind", r.kind.clone()), ("phase", p.name.clone())],
                        p.ms / 1e3,
                    )
                })
            }),
        )?;
        gauges(
            enc,
            "spool_worker_generation",
            "Workers the keeper has started (1: the first).",
            s.keeper
                .as_ref()
                .map(|k| (Labels::new(), k.generation as f64)),
        )?;
        family(
            enc,
            "spool_thread_cpu_seconds",
            "CPU time of the worker process's threads, by thread name (q<N>-<volume>: a queue's polling worker).",
            MetricType::Counter,
            thread_cpu().into_iter().map(|(name, s)| (vec![("thread", name)], s)),
            |m, v: f64| m.encode_counter::<NoLabelSet, _, f64>(&v, None),
        )
    }
}

impl Snapshot {
    fn encode_space(&self, enc: &mut DescriptorEncoder) -> std::fmt::Result {
        let s = &self.space;
        for (name, help, v) in [
            (
                "spool_pool_size_bytes",
                "Bytes of the pool's devices that hold data.",
                s.size,
            ),
            (
                "spool_pool_free_bytes",
                "Bytes no volume, map or chunk holds.",
                s.free,
            ),
            (
                "spool_pool_thin_provisioned_bytes",
                "The sum of thin volumes' sizes (above spool_pool_size_bytes: over-committed).",
                s.thin_provisioned,
            ),
            (
                "spool_pool_thin_mapped_bytes",
                "Bytes thin volumes' chunks take.",
                s.thin_mapped,
            ),
            (
                "spool_pool_thin_shared_bytes",
                "Bytes of chunks named by more than one map (snapshots, clones).",
                s.thin_shared,
            ),
        ] {
            gauges(enc, name, help, [(Labels::new(), v as f64)])?;
        }
        let each = |f: fn(&(String, u64, u64)) -> f64| {
            s.thin
                .iter()
                .map(move |t| (vec![("volume", t.0.clone())], f(t)))
                .collect::<Vec<_>>()
        };
        gauges(
            enc,
            "spool_volume_thin_mapped_bytes",
            "Bytes of a thin volume backed by chunks.",
            each(|t| t.1 as f64),
        )?;
        gauges(
            enc,
            "spool_volume_thin_waiting_writes",
            "Writes to a thin volume held because the pool is full.",
            each(|t| t.2 as f64),
        )
    }
}

/// A replication row's value for one metric, if it has one.
type RowOf = dyn Fn(&Replication) -> Option<f64>;

impl Snapshot {
    fn encode_replication(&self, enc: &mut DescriptorEncoder) -> std::fmt::Result {
        let rows = |f: &RowOf| {
            (self.replication.iter())
                .filter_map(|r| Some((vec![("volume", r.volume.clone())], f(r)?)))
                .collect::<Vec<_>>()
        };
        let families: [(&str, &str, &RowOf); 5] = [
            (
                "spool_volume_replica_complete",
                "On a replica of another host's volume (which runs no VM until promoted): 1 once its primary said the copy here is complete.",
                &|r| r.replica.map(|c| c as u8 as f64),
            ),
            (
                "spool_volume_epoch",
                "The epoch a replica, or a volume promoted from one, is served under here.",
                &|r| Some(r.epoch as f64),
            ),
            (
                "spool_volume_send_behind_bytes",
                "Bytes the volume's copy on another host still lacks.",
                &|r| r.send.map(|s| s.0 as f64),
            ),
            (
                "spool_volume_send_current",
                "1 while the volume's copy on another host holds every write completed here.",
                &|r| r.send.map(|s| s.1 as u8 as f64),
            ),
            (
                "spool_volume_send_last_current_timestamp_seconds",
                "When the volume's copy on another host was last seen current (Unix time; 0: not since this worker started).",
                &|r| r.send.map(|s| s.2),
            ),
        ];
        for (name, help, f) in families {
            gauges(enc, name, help, rows(f))?;
        }
        Ok(())
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        self.encode_volumes(&mut enc)?;
        self.encode_devices(&mut enc)?;
        self.encode_space(&mut enc)?;
        self.encode_replication(&mut enc)?;
        self.encode_restarts(&mut enc)
    }
}

/// CPU seconds per thread name (summed over threads of one name), from /proc/self/task/*/stat.
fn thread_cpu() -> Vec<(String, f64)> {
    // SAFETY: sysconf takes an integer and reads no memory of ours.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let mut by: std::collections::BTreeMap<String, u64> = Default::default();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    for t in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        let f: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // Fields 14 and 15 (utime, stime) are the 12th and 13th after the name.
        let ticks: u64 = [11, 12]
            .iter()
            .filter_map(|&i| f.get(i)?.parse::<u64>().ok())
            .sum();
        *by.entry(name).or_default() += ticks;
    }
    by.into_iter()
        .map(|(n, t)| (n, t as f64 / hz as f64))
        .collect()
}

/// The exposition text of one snapshot.
pub fn render(s: Snapshot) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(s));
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &registry).is_err() {
        out.clear();
        let _ = writeln!(out, "# encoding the metrics failed");
    }
    out
}

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `GET /metrics` on `listener` from a thread, each scrape from `snapshot()`.
pub fn serve(
    listener: TcpListener,
    snapshot: impl Fn() -> Option<Snapshot> + Send + 'static,
) -> std::io::Result<()> {
    let server = tiny_http::Server::from_listener(listener, None)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for req in server.incoming_requests() {
                let (code, body, ctype) = answer(&req, &snapshot);
                let header = tiny_http::Header::from_bytes("Content-Type", ctype)
                    .expect("a constant header is valid");
                let _ = req.respond(
                    tiny_http::Response::from_string(body)
                        .with_status_code(code)
                        .with_header(header),
                );
            }
        })?;
    Ok(())
}

fn answer(
    req: &tiny_http::Request,
    snapshot: &impl Fn() -> Option<Snapshot>,
) -> (u16, String, &'static str) {
    let text = "text/plain; charset=utf-8";
    let path = req.url().split('?').next().unwrap_or("");
    match (req.method(), path) {
        (tiny_http::Method::Get, "/metrics") => match snapshot() {
            Some(s) => (200, render(s), CONTENT_TYPE),
            None => (503, "spoold is stopping\n".into(), text),
        },
        (tiny_http::Method::Get, "/") => (
            200,
            "spoold: metrics at /metrics (OpenMetrics text)\n".into(),
            text,
        ),
        (tiny_http::Method::Get, _) => (404, "not found: try /metrics\n".into(), text),
        _ => (405, "only GET is served\n".into(), text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::StateFormat;

    /// A replica's row says complete and epoch; a sent volume's says how far behind its copy
    /// is, whether it is current and when it last was; volumes with neither have no row.
    #[test]
    fn replication_rows_show_each_side() {
        let status = Status {
            pid: 1,
            version: "0".into(),
            binary: None,
            keeper: None,
            start_phases: Vec::new(),
            first_io_after_restart_ms: None,
            last_restart: None,
            state_format: StateFormat { session: 1 },
        };
        let row = |volume: &str, replica, epoch, send| Replication {
            volume: volume.into(),
            replica,
            epoch,
            send,
        };
        let text = render(Snapshot {
            volumes: Vec::new(),
            devices: Vec::new(),
            status,
            space: Space::default(),
            replication: vec![
                row("r", Some(true), 3, None),
                row("p", None, 0, Some((4096, false, 1700000000.5))),
            ],
        });
        for line in [
            "spool_volume_replica_complete{volume=\"r\"} 1",
            "spool_volume_epoch{volume=\"r\"} 3",
            "spool_volume_epoch{volume=\"p\"} 0",
            "spool_volume_send_behind_bytes{volume=\"p\"} 4096",
            "spool_volume_send_current{volume=\"p\"} 0",
            "spool_volume_send_last_current_timestamp_seconds{volume=\"p\"} 1700000000.5",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
        assert!(!text.contains("spool_volume_replica_complete{volume=\"p\"}"));
    }
}
