//! The metrics endpoint and `volume stats` through the real spoold and the real libblkio
//! client: what a scrape reports matches what the client itself counted, during load (never
//! ahead of it) and after it (exactly); a worker restart keeps the scrape target; bad
//! requests get HTTP errors, not a dead endpoint. And every counter that only moves on a rare
//! event moves when that event happens: journal recoveries and resubmissions after worker
//! kills (matching the worker's log), QoS throttling (only for the capped volume), device
//! errors and resets after an injected fault (matching `device_health`), upgrades.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::load::{Load, BLK};
use common::{spoolctl, Spoold};
use serde_json::json;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// (status line, headers + body) of one HTTP/1.0 request.
fn http(port: u16, request_line: &str) -> (String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "{request_line} HTTP/1.0\r\nHost: spool\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.lines().next().unwrap_or_default().to_string();
    (status, out)
}

fn scrape(port: u16) -> String {
    let (status, out) = http(port, "GET /metrics");
    assert!(status.contains("200"), "{status}\n{out}");
    assert!(
        out.contains("Content-Type: application/openmetrics-text"),
        "{out}"
    );
    out
}

/// A scrape that shows `series` (the keeper tells a new worker its restart report just after
/// the worker serves, so a scrape right after a restart may not have it yet).
fn scrape_with(port: u16, series: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let m = scrape(port);
        if m.lines().any(|l| l.starts_with(series)) || std::time::Instant::now() > deadline {
            return m;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The value of the sample whose name and labels are exactly `series`.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}

fn requests(text: &str, op: &str) -> u64 {
    sample(
        text,
        &format!("spool_volume_requests_total{{volume=\"m\",op=\"{op}\"}}"),
    ) as u64
}

#[test]
fn scrapes_match_the_clients_own_counts_and_survive_a_worker_restart() {
    let port = free_port();
    let d = Spoold::start(&format!(
        r#"
[metrics]
listen = "127.0.0.1:{port}"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[volumes]]
name = "m"
size = "32M"
num_queues = 1
"#
    ));
    let (load, t) = Load::start(d.socket("m"), 16 << 20);
    // Under load: every scrape answers, and never reports more than the client has seen
    // (plus what is in flight: at most one round of 8).
    let mut last = 0;
    for _ in 0..5 {
        load.wait_progress(64);
        let m = scrape(port);
        let done = requests(&m, "read") + requests(&m, "write");
        // The queue's polling thread, while the client is connected.
        assert!(
            m.contains("spool_thread_cpu_seconds_total{thread=\"q0-m\"}"),
            "{m}"
        );
        assert!(done >= last, "a counter went backwards: {done} < {last}");
        // The virtqueue size the client negotiated, as the worker logged it.
        let log = d.log();
        let size: f64 = log
            .lines()
            .find(|l| l.contains("queue started volume=m"))
            .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("size=")))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no queue start in the log: {log}"));
        assert!(size >= 2.0);
        assert_eq!(
            sample(&m, "spool_volume_queue_size{volume=\"m\"}"),
            size,
            "{m}"
        );
        assert!(
            done <= load.ok() + 8,
            "{done} reported, client saw {}",
            load.ok()
        );
        last = done;
    }
    load.stop.store(true, Ordering::Release);
    t.join().unwrap();
    assert_eq!(load.errors(), 0);
    // Workers publish their counts every 1024 poll rounds and before they sleep: within a
    // millisecond or so the scrape is exact.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let mut m = scrape(port);
    while requests(&m, "read") + requests(&m, "write") < load.ok()
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
        m = scrape(port);
    }
    let (reads, writes) = (requests(&m, "read"), requests(&m, "write"));
    assert_eq!(reads + writes, load.ok(), "{m}");
    assert_eq!(
        reads, writes,
        "the workload reads back every block it writes"
    );
    let series = |name: &str, op: &str| format!("{name}{{volume=\"m\",op=\"{op}\"}}");
    assert_eq!(
        sample(&m, &series("spool_volume_bytes_total", "read")),
        (reads * BLK as u64) as f64
    );
    assert_eq!(
        sample(&m, &series("spool_volume_bytes_total", "write")),
        (writes * BLK as u64) as f64
    );
    assert_eq!(
        sample(&m, &series("spool_volume_errors_total", "write")),
        0.0
    );
    assert_eq!(
        sample(&m, &series("spool_volume_latency_seconds_count", "read")),
        reads as f64
    );
    assert_eq!(
        sample(
            &m,
            "spool_volume_latency_seconds_bucket{le=\"+Inf\",volume=\"m\",op=\"write\"}"
        ),
        writes as f64
    );
    assert!(sample(&m, &series("spool_volume_latency_seconds_sum", "write")) > 0.0);
    assert_eq!(sample(&m, "spool_volume_in_flight{volume=\"m\"}"), 0.0);
    assert!(m.contains("spool_device_state{device="), "{m}");
    assert!(m.trim_end().ends_with("# EOF"), "{m}");

    // `volume stats` says the same.
    let (ok, out, err) = spoolctl(&d, &["--json", "volume", "stats", "m"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["read"]["ops"], reads);
    assert_eq!(v[0]["write"]["bytes"], writes * BLK as u64);
    assert!(v[0]["write"]["p99_us"].as_u64().unwrap() >= v[0]["write"]["p50_us"].as_u64().unwrap());
    let (ok, out, err) = spoolctl(&d, &["volume", "stats"]);
    assert!(
        ok && out.contains("READ p50/p99") && out.contains(&reads.to_string()),
        "{out}{err}"
    );
    let (ok, out, err) = spoolctl(
        &d,
        &[
            "volume",
            "stats",
            "--watch",
            "--count",
            "1",
            "--interval",
            "0.2",
        ],
    );
    assert!(ok && out.contains("R IOPS"), "{out}{err}");
    let (ok, _, err) = spoolctl(&d, &["volume", "stats", "nope"]);
    assert!(!ok && err.contains("nope"), "{err}");

    // HTTP errors, and the endpoint still answers after them.
    assert!(http(port, "GET /nope").0.contains("404"));
    assert!(http(port, "POST /metrics").0.contains("405"));
    let mut junk = TcpStream::connect(("127.0.0.1", port)).unwrap();
    junk.write_all(b"\x00\xff garbage\r\n\r\n").unwrap();
    drop(junk);

    // A worker restart: the same port answers at once (the keeper kept the socket), the
    // counters start again, and the restart is counted.
    d.kill_worker();
    let m = scrape_with(port, "spool_restarts_total{kind=\"crash-restart\"} ");
    assert!(requests(&m, "write") < writes, "{m}");
    assert_eq!(
        sample(&m, "spool_restarts_total{kind=\"crash-restart\"}"),
        1.0,
        "{m}"
    );
    assert!(m.contains(
        "spool_last_restart_phase_seconds{kind=\"crash-restart\",phase=\"wake standby\"}"
    ));
}

#[test]
fn a_taken_metrics_port_is_a_clear_start_up_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let d = Spoold::prepared(&format!(
        "[metrics]\nlisten = \"127.0.0.1:{port}\"\n[[devices]]\npath = \"@DIR@/d0.img\"\ncreate_size = \"64M\"\n"
    ));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_spoold"))
        .args(["--no-keeper", "--config"])
        .arg(&d.config)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!("metrics endpoint 127.0.0.1:{port}")) && err.contains("in use"),
        "{err}"
    );
}

/// A config with the metrics endpoint on `port` and `volumes` (name, queues) of 16 MiB.
fn config(port: u16, volumes: &[(&str, u16)], extra: &str) -> String {
    let mut c = format!(
        "[metrics]\nlisten = \"127.0.0.1:{port}\"\n[[devices]]\npath = \"@DIR@/d0.img\"\ncreate_size = \"96M\"\n{extra}\n"
    );
    for (name, queues) in volumes {
        c += &format!("[[volumes]]\nname = \"{name}\"\nsize = \"16M\"\nnum_queues = {queues}\n");
    }
    c
}

fn per_volume(text: &str, name: &str, volume: &str) -> u64 {
    sample(text, &format!("{name}{{volume=\"{volume}\"}}")) as u64
}

/// What the log since `from` says the new worker did: (queues recovered from their journal,
/// requests resubmitted from it).
fn recovery_in_log(log: &str) -> (u64, u64) {
    let mut recovered = 0;
    let mut resubmitted = 0;
    for l in log.lines() {
        if l.contains("recovered queue from its journal") {
            recovered += 1;
        }
        if l.contains("resubmitting requests recovered from the journal") {
            let n = l
                .split_whitespace()
                .find_map(|w| w.strip_prefix("count=")?.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no count in {l}"));
            resubmitted += n;
        }
    }
    (recovered, resubmitted)
}

/// Worker SIGKILLs under a load: each new worker's journal counters say what its log says,
/// until some kill has caught requests in flight (so both counters have moved).
#[test]
fn journal_recoveries_and_resubmissions_match_the_log_after_worker_kills() {
    let port = free_port();
    let d = Spoold::start(&config(port, &[("m", 1)], ""));
    let (load, t) = Load::start(d.socket("m"), 16 << 20);
    load.wait_progress(64);
    let (mut recovered, mut resubmitted, mut kills) = (0, 0, 0);
    for kill in 0..40 {
        kills = kill;
        if recovered > 0 && resubmitted > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10 + (kill * 17) % 40));
        let from = d.log().len();
        d.kill_worker();
        load.wait_progress(16);
        // The worker logs before it counts: wait until the two agree (and stay so).
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let (logged, m) = loop {
            let logged = recovery_in_log(&d.log()[from..]);
            let m = scrape(port);
            let counted = (
                per_volume(&m, "spool_volume_journal_recoveries_total", "m"),
                per_volume(&m, "spool_volume_resubmitted_requests_total", "m"),
            );
            if counted == logged || std::time::Instant::now() > deadline {
                assert_eq!(counted, logged, "kill {kill}: metrics against the log\n{m}");
                break (logged, m);
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(logged.0 <= 1, "one queue, one recovery per worker: {m}");
        recovered += logged.0;
        resubmitted += logged.1;
    }
    assert!(
        recovered > 0 && resubmitted > 0,
        "no kill caught a request in flight ({recovered} recoveries, {resubmitted} resubmitted)"
    );
    eprintln!("{kills} kills: {recovered} journal recoveries, {resubmitted} requests resubmitted");
    load.stop.store(true, Ordering::Release);
    t.join().unwrap();
    assert_eq!((load.errors(), load.corrupt()), (0, 0));
    // The client is gone: no queue is served, the queue size says so.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while per_volume(&scrape(port), "spool_volume_queue_size", "m") != 0 {
        assert!(std::time::Instant::now() < deadline, "{}", scrape(port));
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// An IOPS cap under load: the capped volume's throttled rounds rise, an uncapped volume's
/// under the same load stay zero; lifting the cap stops the count.
#[test]
fn qos_throttling_is_counted_for_the_capped_volume_only() {
    let port = free_port();
    let d = Spoold::start(&config(port, &[("capped", 1), ("free", 1)], ""));
    let (ok, _, err) = spoolctl(
        &d,
        &[
            "volume", "qos", "capped", "--iops", "400", "--burst", "10ms",
        ],
    );
    assert!(ok, "{err}");
    let (lc, tc) = Load::start(d.socket("capped"), 16 << 20);
    let (lf, tf) = Load::start(d.socket("free"), 16 << 20);
    lc.wait_progress(200);
    lf.wait_progress(200);
    let m = scrape(port);
    let capped = per_volume(&m, "spool_volume_qos_throttled_rounds_total", "capped");
    assert!(
        capped > 0,
        "a capped volume under load was never throttled:\n{m}"
    );
    assert_eq!(
        per_volume(&m, "spool_volume_qos_throttled_rounds_total", "free"),
        0,
        "{m}"
    );
    // Lifting the cap stops the count.
    let (ok, _, err) = spoolctl(&d, &["volume", "qos", "capped", "--clear"]);
    assert!(ok, "{err}");
    lc.wait_progress(100);
    let before = per_volume(
        &scrape(port),
        "spool_volume_qos_throttled_rounds_total",
        "capped",
    );
    assert!(before >= capped);
    lc.wait_progress(200);
    let m = scrape(port);
    assert_eq!(
        per_volume(&m, "spool_volume_qos_throttled_rounds_total", "capped"),
        before,
        "throttled without a cap: {m}"
    );
    for l in [&lc, &lf] {
        l.stop.store(true, Ordering::Release);
    }
    tc.join().unwrap();
    tf.join().unwrap();
    assert_eq!(lc.errors() + lf.errors(), 0);
}

/// An injected path error under load: the device's path-error counter and its reset counter
/// rise and say what `device_health` says; the other classes stay zero.
#[test]
fn device_errors_and_resets_are_counted_by_class() {
    let port = free_port();
    let health = "[health]\nio_timeout_ms = 300\nreset_timeout_ms = 1500\npoll_interval_ms = 50\n";
    let d = Spoold::start(&config(port, &[("m", 1)], health));
    let v = d.rpc("volume_show", json!({"id": "m"})).unwrap();
    let dev = v["devices"][0].as_str().unwrap().to_string();
    let (load, t) = Load::start(d.socket("m"), 16 << 20);
    load.wait_progress(100);
    let labels = |h: &serde_json::Value| {
        format!("device=\"{dev}\",path=\"{}\"", h["path"].as_str().unwrap())
    };
    let h = d.rpc("device_health", json!({"id": dev})).unwrap()[0].clone();
    let m = scrape(port);
    assert_eq!(
        sample(&m, &format!("spool_device_resets_total{{{}}}", labels(&h))),
        0.0
    );
    d.rpc(
        "device_inject",
        json!({"id": dev, "kind": "transient", "op": "write"}),
    )
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let h = loop {
        let h = d.rpc("device_health", json!({"id": dev})).unwrap()[0].clone();
        if h["state"] == json!("healthy") && h["counters"]["resets"].as_u64().unwrap() >= 1 {
            break h;
        }
        assert!(std::time::Instant::now() < deadline, "no reset: {h}");
        std::thread::sleep(Duration::from_millis(10));
    };
    load.wait_progress(50);
    let m = scrape(port);
    let l = labels(&h);
    let class = |c: &str| {
        sample(
            &m,
            &format!("spool_device_errors_total{{{l},class=\"{c}\"}}"),
        )
    };
    assert_eq!(
        class("path"),
        h["counters"]["path_errors"].as_f64().unwrap(),
        "{h}\n{m}"
    );
    assert!(class("path") >= 1.0, "{h}\n{m}");
    for c in ["media", "timeout", "gone", "request"] {
        assert_eq!(class(c), 0.0, "{c}: {m}");
    }
    let resets = sample(&m, &format!("spool_device_resets_total{{{l}}}"));
    assert_eq!(resets, h["counters"]["resets"].as_f64().unwrap(), "{m}");
    assert!(resets >= 1.0);
    assert_eq!(
        sample(&m, &format!("spool_device_state{{{l},state=\"healthy\"}}")),
        1.0
    );
    load.stop.store(true, Ordering::Release);
    t.join().unwrap();
    assert_eq!(
        load.errors(),
        0,
        "a path error is held and resubmitted, not failed"
    );
}

/// Seconds of each phase of a restart report, summed by name.
fn phase_seconds(r: &serde_json::Value) -> std::collections::BTreeMap<String, f64> {
    let mut out = std::collections::BTreeMap::new();
    for p in r["phases"].as_array().unwrap() {
        *out.entry(p["name"].as_str().unwrap().to_string())
            .or_default() += p["ms"].as_f64().unwrap() / 1e3;
    }
    out
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

/// Upgrades under load are counted next to the crash restart before them, and the restart
/// history keeps each kind's stalls and phases: the crash's phases are still there after the
/// upgrades (the last-restart gauges only show the last upgrade).
#[test]
fn upgrades_are_counted_and_each_kinds_stalls_and_phases_kept() {
    let port = free_port();
    let d = Spoold::start(&config(port, &[("m", 1)], ""));
    let (load, t) = Load::start(d.socket("m"), 16 << 20);
    load.wait_progress(64);
    let m = scrape(port);
    assert!(!m.contains("spool_restarts_total{kind=\"upgrade\"}"), "{m}");
    d.kill_worker();
    // The keeper tells the new worker its report just after it serves.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let crash = loop {
        let s = d.status();
        if s["last_restart"]["kind"] == json!("crash-restart") {
            break s["last_restart"].clone();
        }
        assert!(std::time::Instant::now() < deadline, "{s}");
        std::thread::sleep(Duration::from_millis(5));
    };
    load.wait_progress(64);
    let mut upgrades = Vec::new();
    for _ in 0..2 {
        let r = d.upgrade(None).expect("upgrade");
        assert_eq!(r["outcome"], json!("ok"), "{r}");
        upgrades.push(r);
        load.wait_progress(64);
    }
    let m = scrape_with(port, "spool_restarts_total{kind=\"upgrade\"} 2");
    let status = d.status();
    assert_eq!(
        status["last_restart"]["counts"]["upgrade"],
        json!(2),
        "{status}"
    );
    assert_eq!(
        sample(&m, "spool_restarts_total{kind=\"upgrade\"}"),
        2.0,
        "{m}"
    );
    assert_eq!(
        sample(&m, "spool_restarts_total{kind=\"crash-restart\"}"),
        1.0,
        "{m}"
    );
    // The last-restart gauges: the second upgrade.
    let stall = sample(&m, "spool_last_restart_stall_seconds{kind=\"upgrade\"}");
    assert!(
        close(stall, upgrades[1]["stall_ms"].as_f64().unwrap() / 1e3),
        "{m}"
    );
    assert!(
        !m.contains("spool_last_restart_stall_seconds{kind=\"crash-restart\"}"),
        "{m}"
    );
    // The history: a stall histogram per kind, and each kind's phases summed.
    let hist = |what: &str, kind: &str| {
        sample(
            &m,
            &format!("spool_restart_stall_seconds_{what}{{kind=\"{kind}\"}}"),
        )
    };
    assert_eq!(hist("count", "crash-restart"), 1.0, "{m}");
    assert_eq!(hist("count", "upgrade"), 2.0, "{m}");
    let crash_stall = crash["stall_ms"].as_f64().unwrap() / 1e3;
    assert!(
        close(hist("sum", "crash-restart"), crash_stall),
        "{crash}\n{m}"
    );
    let upgrade_stalls: f64 = upgrades
        .iter()
        .map(|r| r["stall_ms"].as_f64().unwrap() / 1e3)
        .sum();
    assert!(close(hist("sum", "upgrade"), upgrade_stalls), "{m}");
    assert_eq!(
        sample(
            &m,
            "spool_restart_stall_seconds_bucket{le=\"+Inf\",kind=\"upgrade\"}"
        ),
        2.0,
        "{m}"
    );
    let crash_phases = phase_seconds(&crash);
    assert!(crash_phases.contains_key("wake standby"), "{crash}");
    for (phase, secs) in &crash_phases {
        let got = sample(
            &m,
            &format!(
                "spool_restart_phase_seconds_total{{kind=\"crash-restart\",phase=\"{phase}\"}}"
            ),
        );
        assert!(close(got, *secs), "{phase}: {got} against {secs}\n{m}");
    }
    let mut upgrade_phases = phase_seconds(&upgrades[0]);
    for (phase, secs) in phase_seconds(&upgrades[1]) {
        *upgrade_phases.entry(phase).or_default() += secs;
    }
    for (phase, secs) in &upgrade_phases {
        let got = sample(
            &m,
            &format!("spool_restart_phase_seconds_total{{kind=\"upgrade\",phase=\"{phase}\"}}"),
        );
        assert!(close(got, *secs), "{phase}: {got} against {secs}\n{m}");
    }
    load.stop.store(true, Ordering::Release);
    t.join().unwrap();
    assert_eq!((load.errors(), load.corrupt()), (0, 0));
}

/// Thin volumes' space: what the pool promises and what chunks take, per volume and in all,
/// as `pool_show` says it.
#[test]
fn scrapes_show_thin_volumes_space() {
    let port = free_port();
    let d = Spoold::start(&format!(
        r#"
[metrics]
listen = "127.0.0.1:{port}"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[volumes]]
name = "t"
size = "1G"
num_queues = 1
thin = true
"#
    ));
    let mut c = common::connect(&d.socket("t"), 1, false).unwrap();
    for at in [0u64, 700 << 20] {
        assert_eq!(c.write_sync(0, at, &common::pattern(1, at, 4096)), 0);
    }
    drop(c);
    let m = scrape(port);
    let p = d.rpc("pool_show", json!({})).unwrap();
    assert_eq!(
        sample(&m, "spool_pool_thin_provisioned_bytes"),
        (1u64 << 30) as f64
    );
    assert_eq!(
        sample(&m, "spool_pool_thin_mapped_bytes"),
        (2u64 << 20) as f64
    );
    assert_eq!(
        sample(&m, "spool_volume_thin_mapped_bytes{volume=\"t\"}"),
        (2u64 << 20) as f64
    );
    assert_eq!(
        sample(&m, "spool_volume_thin_waiting_writes{volume=\"t\"}"),
        0.0
    );
    assert_eq!(
        sample(&m, "spool_pool_free_bytes"),
        p["free"].as_f64().unwrap()
    );
    assert_eq!(
        sample(&m, "spool_pool_size_bytes"),
        p["size"].as_f64().unwrap()
    );
}
