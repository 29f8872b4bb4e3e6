//! The metrics endpoint and `volume stats` through the real spoold and the real libblkio
//! client: what a scrape reports matches what the client itself counted, during load (never
//! ahead of it) and after it (exactly); a worker restart keeps the scrape target; bad
//! requests get HTTP errors, not a dead endpoint.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::load::{Load, BLK};
use common::{spoolctl, Spoold};

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
    let m = scrape(port);
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
