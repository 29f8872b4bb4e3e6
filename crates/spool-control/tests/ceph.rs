//! spoold on Ceph RBD (issue 20) against a real single-node cluster (scripts/ceph-cluster.sh):
//! a pool device `rbd:POOL/IMAGE` under the real libblkio client's verifying load, through
//! worker SIGKILLs, upgrades and the OSD stopped and restarted. Every write the client saw
//! complete reads back, no request fails, and the client's one connection is never dropped.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::ceph::CephCluster;
use common::load::Load;
use common::Spoold;
use serde_json::json;

fn config(cluster: &CephCluster, image: &str) -> String {
    format!(
        r#"
[ceph]
conf = "{conf}"
id = "admin"

[[devices]]
path = "rbd:rbd/{image}"
create_size = "512M"

[[volumes]]
name = "a"
size = "64M"
num_queues = 1
"#,
        conf = cluster.conf.display()
    )
}

fn count(env: &str, default: usize) -> usize {
    std::env::var(env)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn an_rbd_pool_survives_worker_kills_upgrades_and_an_osd_restart_under_load() {
    let Some(cluster) = CephCluster::start("e2e") else {
        return;
    };
    let d = Spoold::start(&config(&cluster, "pool0"));
    assert!(
        cluster.rbd(&["ls", "rbd"]).unwrap().contains("pool0"),
        "spoold created the image"
    );
    let (load, t) = Load::start(d.socket("a"), 64 << 20);
    load.wait_progress(64);

    let n = count("SPOOL_WORKER_KILLS", 10);
    let mut stalls = Vec::new();
    for _ in 0..n {
        d.kill_worker();
        load.wait_progress(16);
    }
    for _ in 0..n {
        let r = d.upgrade(None).expect("upgrade");
        assert_eq!(r["outcome"], json!("ok"), "{r}");
        stalls.push(r["stall_ms"].as_f64().unwrap());
        load.wait_progress(16);
    }

    // The OSD goes away under load: requests wait (no error), and resume when it is back.
    cluster.stop_osd();
    std::thread::sleep(Duration::from_millis(500));
    let before = load.ok();
    std::thread::sleep(Duration::from_secs(3));
    let during = load.ok();
    assert!(
        during - before <= 16,
        "{} requests completed while the OSD was down",
        during - before
    );
    let down = Instant::now();
    cluster.start_osd();
    load.wait_progress(64);
    eprintln!(
        "OSD down: {} requests completed in 3 s, resumed {:?} after the restart began",
        during - before,
        down.elapsed()
    );

    load.stop.store(true, Ordering::Release);
    t.join().unwrap();
    assert_eq!(load.errors(), 0, "{}", d.log());
    assert_eq!(load.corrupt(), 0);
    let log = d.log();
    assert_eq!(log.matches("frontend connected").count(), 1, "{log}");
    assert!(log.matches("worker restarted kind=crash-restart").count() >= n);
    let crash: Vec<f64> = log
        .lines()
        .filter(|l| l.contains("kind=crash-restart"))
        .filter_map(|l| {
            l.split("stall_ms=\"")
                .nth(1)?
                .split('"')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    stalls.sort_by(f64::total_cmp);
    eprintln!(
        "{n} worker kills (stalls {crash:?} ms) and {n} upgrades (median {:.1} ms, max {:.1} ms) on RBD under a verifying load: {} requests, no error",
        stalls[stalls.len() / 2],
        stalls[stalls.len() - 1],
        load.ok()
    );
}
