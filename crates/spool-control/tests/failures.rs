//! Device failure handling (issue 6, the paper's §6 and Figure 12) with the real spoold and
//! the real libblkio client on file devices.
//!
//! What is simulated, and why: file devices cannot have media or link errors on demand, so
//! those come from spoold's own fault-injection layer (`device_inject`, a product feature
//! like SPDK's error bdev), which fails or holds operations in front of the real io_uring
//! queue; SMART data does not exist for files, so the critical-warning byte is injected too.
//! Hot-removal is real: the backing file is deleted.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::load::{Load, BLK, DEPTH};
use common::*;
use serde_json::{json, Value};

const VOL: u64 = 16 << 20;

fn config(extra_health: &str) -> String {
    format!(
        r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[devices]]
path = "@DIR@/d1.img"
create_size = "64M"
[[volumes]]
name = "vol1"
size = "16M"
num_queues = 1
[[volumes]]
name = "vol2"
size = "16M"
num_queues = 1
[health]
io_timeout_ms = 300
reset_timeout_ms = 1500
poll_interval_ms = 50
{extra_health}
"#
    )
}

/// The device (UUID, path) a volume lives on.
fn device_of(s: &Spoold, vol: &str) -> (String, String) {
    loop {
        let v = s.rpc("volume_show", json!({"id": vol})).unwrap();
        let devs = v["devices"].as_array().unwrap();
        assert_eq!(devs.len(), 1, "{vol} should sit on one device: {v}");
        let uuid = devs[0].as_str().unwrap().to_string();
        let list = s.rpc("device_list", json!({})).unwrap();
        // A replacement between the two calls: ask again.
        if let Some(d) = list
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["uuid"] == json!(uuid))
        {
            return (uuid, d["path"].as_str().unwrap().to_string());
        }
    }
}

fn health(s: &Spoold, dev: &str) -> Value {
    s.rpc("device_health", json!({"id": dev})).unwrap()[0].clone()
}

fn wait_state(s: &Spoold, dev: &str, want: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let h = health(s, dev);
        if h["state"] == json!(want) {
            return h;
        }
        assert!(Instant::now() < deadline, "device never became {want}: {h}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits (10 s at most) until the device's health report satisfies `ok`; returns it.
fn wait_health(s: &Spoold, dev: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let h = health(s, dev);
        if ok(&h) {
            return h;
        }
        assert!(
            Instant::now() < deadline,
            "device health never as wanted: {h}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

struct Scene {
    s: Spoold,
    dev1: String,
    dev2: String,
    path2: String,
    l1: Arc<Load>,
    l2: Arc<Load>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Scene {
    fn start(extra_health: &str) -> Scene {
        let s = Spoold::start(&config(extra_health));
        let (dev1, _) = device_of(&s, "vol1");
        let (dev2, path2) = device_of(&s, "vol2");
        assert_ne!(dev1, dev2, "the two volumes must sit on different devices");
        let (l1, t1) = Load::start(s.socket("vol1"), VOL);
        let (l2, t2) = Load::start(s.socket("vol2"), VOL);
        l1.wait_progress(200);
        l2.wait_progress(200);
        Scene {
            s,
            dev1,
            dev2,
            path2,
            l1,
            l2,
            threads: vec![t1, t2],
        }
    }

    fn inject(&self, params: Value) {
        let mut p = params;
        p["id"] = json!(self.dev2);
        self.s.rpc("device_inject", p).unwrap();
    }

    /// Asserts that the event log holds an event matching `f`.
    fn has_event(&self, f: impl Fn(&Value) -> bool) {
        let ev = self.s.rpc("events_list", json!({"since": 0})).unwrap();
        assert!(ev["events"].as_array().unwrap().iter().any(f), "{ev}");
    }

    /// Stops the workloads and checks what must hold in every scenario.
    fn finish(mut self) -> Spoold {
        self.l1.stop.store(true, Ordering::Release);
        self.l2.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            t.join()
                .expect("a workload thread failed (a request hung?)");
        }
        assert_eq!(self.l1.errors(), 0, "volume 1 (healthy device) saw errors");
        assert_eq!(self.l1.corrupt(), 0, "volume 1 read corrupt data");
        assert_eq!(self.l2.corrupt(), 0, "volume 2 read corrupt data");
        assert!(self.s.running(), "spoold exited");
        assert_eq!(health(&self.s, &self.dev1)["state"], json!("healthy"));
        self.s
    }
}

#[test]
fn link_errors_are_held_reset_and_resubmitted_without_guest_errors() {
    let sc = Scene::start("");
    // The link is down for 250 ms: commands fail with EIO and so do the monitor's probes.
    sc.inject(json!({"kind": "link-down", "duration_ms": 250}));
    let before = sc.l1.ok();
    // Waited for by its counters, which only go up (the 250 ms of "resetting" can pass
    // between two looks on a loaded host), then healthy again.
    let h = wait_health(&sc.s, &sc.dev2, |h| {
        h["counters"]["resets"].as_u64().unwrap_or(0) >= 1 && h["state"] == json!("healthy")
    });
    assert!(sc.l1.ok() > before, "volume 1 stalled during the reset");
    assert!(h["counters"]["failed_probes"].as_u64().unwrap() >= 1, "{h}");
    // (A write slower than io_timeout_ms on a loaded host may add a reset of its own.)
    let resets = h["counters"]["resets"].as_u64().unwrap();
    sc.l2.wait_progress(200);
    assert_eq!(sc.l2.errors(), 0, "held I/O must not fail");
    // The guest saw latency instead: one round lasted about as long as the link was down.
    assert!(
        sc.l2.max_round_us.load(Ordering::Relaxed) >= 150_000,
        "volume 2's I/O was not held"
    );
    // A transient error on one command: reset, resubmit, no error.
    sc.inject(json!({"kind": "transient", "op": "write"}));
    wait_health(&sc.s, &sc.dev2, |h| {
        h["counters"]["resets"].as_u64().unwrap_or(0) > resets
    });
    sc.l2.wait_progress(100);
    assert_eq!(sc.l2.errors(), 0);
    let s = sc.finish();
    let log = s.log();
    assert!(log.contains("dispatching held requests again"), "{log}");
}

#[test]
fn hung_commands_time_out_and_are_resubmitted() {
    let sc = Scene::start("");
    sc.inject(json!({"kind": "timeout", "count": 2}));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let h = health(&sc.s, &sc.dev2);
        if h["counters"]["timeouts"].as_u64().unwrap() >= 1
            && h["state"] == json!("healthy")
            && h["counters"]["resets"].as_u64().unwrap() >= 1
        {
            break;
        }
        assert!(Instant::now() < deadline, "no timeout/reset seen: {h}");
        std::thread::sleep(Duration::from_millis(10));
    }
    sc.l2.wait_progress(200);
    assert_eq!(
        sc.l2.errors(),
        0,
        "timed-out commands must be retried, not failed"
    );
    sc.finish();
}

/// Media error, then manual replacement: clean errors, then recovery on the new device.
#[test]
fn media_errors_isolate_the_device_until_it_is_replaced() {
    let sc = Scene::start("");
    sc.inject(json!({"kind": "media", "op": "read"}));
    let h = wait_state(&sc.s, &sc.dev2, "failed");
    assert!(h["reason"].as_str().unwrap().contains("media error"), "{h}");
    // Volume 2's I/O now fails cleanly (no hang: the workload's waits would assert).
    sc.l2.wait_errors(50);
    let ok_while_failed = sc.l2.ok();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(sc.l2.ok(), ok_while_failed, "a failed device served I/O");
    sc.l1.wait_progress(200);
    // Events say what happened.
    sc.has_event(|e| e["to"] == json!("failed") && e["device"] == json!(sc.dev2));
    // A healthy device is not replaced without force.
    let new = sc.s.dir.path().join("new.img");
    let err =
        sc.s.rpc(
            "device_replace",
            json!({"old": sc.dev1, "new": new, "create_size": 64 << 20}),
        )
        .unwrap_err();
    assert!(err.message.contains("healthy"), "{}", err.message);
    let r =
        sc.s.rpc(
            "device_replace",
            json!({"old": sc.dev2, "new": new, "create_size": 64 << 20}),
        )
        .unwrap();
    assert_eq!(r["volumes"], json!(["vol2"]), "{r}");
    let e1 = sc.l2.errors();
    sc.l2.wait_progress(300);
    // A few requests in flight at the switch may still fail; then none do.
    let e2 = sc.l2.errors();
    sc.l2.wait_progress(300);
    assert_eq!(sc.l2.errors(), e2, "errors after the replacement");
    assert!(e2 - e1 < 2 * DEPTH as u64, "{e1} -> {e2}");
    let (new_uuid, _) = device_of(&sc.s, "vol2");
    assert_ne!(new_uuid, sc.dev2);
    assert_eq!(health(&sc.s, &new_uuid)["state"], json!("healthy"));
    let list = sc.s.rpc("device_list", json!({})).unwrap();
    assert_eq!(
        list.as_array().unwrap().len(),
        2,
        "old device still listed: {list}"
    );
    sc.finish();
}

/// Hot-removal (the backing file is deleted) with a spare configured: the spare is picked up
/// automatically once it appears (hot-plug), and the volume comes back without any RPC.
#[test]
fn a_removed_device_is_replaced_by_a_hot_plugged_spare() {
    let sc = Scene::start("spares = [\"@DIR@/spare.img\"]");
    std::fs::remove_file(&sc.path2).unwrap();
    let h = wait_state(&sc.s, &sc.dev2, "removed");
    assert!(h["reason"].as_str().unwrap().contains("deleted"), "{h}");
    sc.l2.wait_errors(20);
    // Hot-plug: the spare appears.
    let f = std::fs::File::create(sc.s.dir.path().join("spare.img")).unwrap();
    f.set_len(64 << 20).unwrap();
    drop(f);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (uuid, path) = device_of(&sc.s, "vol2");
        if path.ends_with("spare.img") {
            assert_eq!(health(&sc.s, &uuid)["state"], json!("healthy"));
            break;
        }
        assert!(Instant::now() < deadline, "the spare was not used");
        std::thread::sleep(Duration::from_millis(20));
    }
    sc.l2.wait_progress(100);
    let e = sc.l2.errors();
    sc.l2.wait_progress(300);
    assert_eq!(sc.l2.errors(), e, "errors after the spare took over");
    sc.has_event(|e| e["kind"] == json!("replaced"));
    sc.finish();
}

/// SMART critical warning (wear): isolate; the operator hook is told.
#[test]
fn a_smart_wear_warning_isolates_and_runs_the_hook() {
    let sc = Scene::start("hook = \"echo $SPOOL_EVENT_TO $SPOOL_EVENT_DEVICE >> @DIR@/hook.log\"");
    sc.inject(json!({"kind": "smart", "bits": 4}));
    let h = wait_state(&sc.s, &sc.dev2, "failed");
    assert!(h["reason"].as_str().unwrap().contains("reliability"), "{h}");
    let log = sc.s.dir.path().join("hook.log");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains(&format!("failed {}", sc.dev2)) {
            break;
        }
        assert!(Instant::now() < deadline, "hook did not run: {text:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    sc.l2.wait_errors(20);
    let new = sc.s.dir.path().join("new.img");
    sc.s.rpc(
        "device_replace",
        json!({"old": sc.dev2, "new": new, "create_size": 64 << 20}),
    )
    .unwrap();
    sc.l2.wait_progress(100);
    let e = sc.l2.errors();
    sc.l2.wait_progress(300);
    assert_eq!(sc.l2.errors(), e);
    sc.finish();
}

/// The classification table, row by row: inject, do one write and one read, check what the
/// guest saw and the state the device went to.
#[test]
fn fault_matrix() {
    struct Row {
        name: &'static str,
        inject: Value,
        /// The guest's write result is an error.
        guest_error: bool,
        state: &'static str,
        counter: &'static str,
    }
    let rows = [
        Row {
            name: "EIO (path)",
            inject: json!({"kind": "errno", "errno": "EIO", "op": "write"}),
            guest_error: false,
            state: "healthy",
            counter: "path_errors",
        },
        Row {
            name: "ENOLINK (transport)",
            inject: json!({"kind": "errno", "errno": "ENOLINK", "op": "write"}),
            guest_error: false,
            state: "healthy",
            counter: "path_errors",
        },
        Row {
            name: "ETIMEDOUT",
            inject: json!({"kind": "errno", "errno": "ETIMEDOUT", "op": "write"}),
            guest_error: false,
            state: "healthy",
            counter: "path_errors",
        },
        Row {
            name: "command hang",
            inject: json!({"kind": "timeout", "op": "write"}),
            guest_error: false,
            state: "healthy",
            counter: "timeouts",
        },
        Row {
            name: "ENODATA (medium)",
            inject: json!({"kind": "errno", "errno": "ENODATA", "op": "write"}),
            guest_error: true,
            state: "failed",
            counter: "media_errors",
        },
        Row {
            name: "EILSEQ (protection)",
            inject: json!({"kind": "errno", "errno": "EILSEQ", "op": "write"}),
            guest_error: true,
            state: "failed",
            counter: "media_errors",
        },
        Row {
            name: "ENODEV (offline)",
            inject: json!({"kind": "removed"}),
            guest_error: true,
            state: "removed",
            counter: "gone_errors",
        },
        Row {
            name: "link down past the reset timeout",
            inject: json!({"kind": "link-down", "op": "write"}),
            guest_error: true,
            state: "failed",
            counter: "failed_probes",
        },
        Row {
            name: "EINVAL (request)",
            inject: json!({"kind": "errno", "errno": "EINVAL", "op": "write"}),
            guest_error: true,
            state: "healthy",
            counter: "request_errors",
        },
    ];
    let s = Spoold::start(&config("").replace("reset_timeout_ms = 1500", "reset_timeout_ms = 300"));
    let (dev1, _) = device_of(&s, "vol1");
    let mut c = connect(&s.socket("vol1"), 1, false).unwrap();
    let mut dev = dev1;
    for (i, row) in rows.iter().enumerate() {
        let mut p = row.inject.clone();
        p["id"] = json!(dev);
        s.rpc("device_inject", p).unwrap();
        let data = pattern(i as u64, 0, BLK);
        let t0 = Instant::now();
        let r = c.write_sync(0, 0, &data);
        let took = t0.elapsed();
        assert_eq!(r != 0, row.guest_error, "{}: write returned {r}", row.name);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let h = health(&s, &dev);
            if h["state"] == json!(row.state) && h["counters"][row.counter].as_u64().unwrap() >= 1 {
                break;
            }
            assert!(Instant::now() < deadline, "{}: {h}", row.name);
            std::thread::sleep(Duration::from_millis(10));
        }
        s.rpc("device_clear_faults", json!({"id": dev})).unwrap();
        if row.state == "healthy" {
            // The data is where it belongs (resubmitted writes landed; failed ones did not
            // corrupt anything else).
            if !row.guest_error {
                let (r, back) = c.read_sync(0, 0, BLK);
                assert_eq!((r, back == data), (0, true), "{}", row.name);
            }
        } else {
            // Isolated: the guest gets errors at once, until the device is replaced.
            let (r, _) = c.read_sync(0, 0, BLK);
            assert_ne!(r, 0, "{}: read from an isolated device", row.name);
            let new = s.dir.path().join(format!("r{i}.img"));
            let rep = s
                .rpc(
                    "device_replace",
                    json!({"old": dev, "new": new, "create_size": 64 << 20}),
                )
                .unwrap();
            dev = rep["new"]["uuid"].as_str().unwrap().to_string();
            let deadline = Instant::now() + Duration::from_secs(5);
            while c.write_sync(0, 0, &data) != 0 {
                assert!(Instant::now() < deadline, "{}: no recovery", row.name);
            }
            let (r, back) = c.read_sync(0, 0, BLK);
            assert_eq!((r, back == data), (0, true), "{}", row.name);
        }
        eprintln!(
            "{:<36} guest error {:<5} -> {:<8} ({took:?})",
            row.name,
            r != 0,
            row.state
        );
    }
}

#[test]
fn bad_injection_requests_are_refused_clearly() {
    let s = Spoold::start(&config(""));
    let (dev, _) = device_of(&s, "vol1");
    for (p, needle) in [
        (json!({"id": dev, "kind": "gremlins"}), "must be one of"),
        (json!({"id": dev, "kind": "errno"}), "needs errno"),
        (
            json!({"id": dev, "kind": "errno", "errno": "EWHAT"}),
            "must be a number",
        ),
        (
            json!({"id": dev, "kind": "media", "op": "erase"}),
            "read, write or any",
        ),
        (
            json!({"id": dev, "kind": "media", "offset": 1u64 << 40}),
            "beyond",
        ),
        (json!({"id": "nope", "kind": "media"}), "no device"),
        (json!({"id": dev, "kind": "smart"}), "needs bits"),
    ] {
        let e = s.rpc("device_inject", p.clone()).unwrap_err();
        assert!(e.message.contains(needle), "{p}: {}", e.message);
    }
    let e = s
        .rpc(
            "device_replace",
            json!({"old": dev, "new": "/nonexistent/x.img"}),
        )
        .unwrap_err();
    assert!(e.message.contains("healthy"), "{}", e.message);
    assert_eq!(
        s.rpc("device_faults", json!({"id": dev})).unwrap()["rules"],
        json!([])
    );
}

/// Isolation outlives the worker: a device failed by media errors stays failed after the
/// worker is killed and restarted (the injected fault is gone with the old process, so
/// without the kept state the new worker would serve the volume from the failing device).
#[test]
fn an_isolated_device_stays_isolated_across_a_worker_restart() {
    let s = Spoold::start(&config(""));
    let (dev2, _) = device_of(&s, "vol2");
    s.rpc(
        "device_inject",
        json!({"id": dev2, "kind": "media", "op": "read"}),
    )
    .unwrap();
    let sock = s.socket("vol2");
    let mut c = connect(&sock, 1, false).unwrap();
    assert!(c.read_sync(0, 0, 4096).0 != 0, "the injected media error");
    wait_state(&s, &dev2, "failed");
    s.kill_worker();
    let h = wait_state(&s, &dev2, "failed");
    assert!(h["reason"].as_str().unwrap().contains("media error"), "{h}");
    let ev = s.rpc("events_list", json!({"since": 0})).unwrap();
    assert!(
        ev["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == json!("restored") && e["device"] == json!(dev2)),
        "{ev}"
    );
    // The volume's I/O still fails cleanly (the client stays connected through the restart).
    let mut failed = false;
    for _ in 0..50 {
        if c.read_sync(0, 0, 4096).0 != 0 {
            failed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(failed, "the isolated device served I/O after the restart");
    // Replacing it clears the kept state: a further restart finds it healthy.
    let new = s.dir.path().join("new.img");
    s.rpc(
        "device_replace",
        json!({"old": dev2, "new": new, "create_size": 64 << 20}),
    )
    .unwrap();
    let (new_uuid, _) = device_of(&s, "vol2");
    s.kill_worker();
    assert_eq!(health(&s, &new_uuid)["state"], json!("healthy"));
}
