//! Integration tests: the real spoold binary driven by the real libblkio client
//! (`virtio-blk-vhost-user` driver) over its vhost-user-blk sockets.

mod common;

use common::{connect, pattern, Spoold};
use serde_json::json;

const TWO_DEVICES: &str = r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "40M"

[[devices]]
path = "@DIR@/d1.img"
create_size = "40M"

[[volumes]]
name = "a"
size = "16M"
num_queues = 4

[[volumes]]
name = "b"
size = "16M"
num_queues = 4
"#;

/// Writes a pattern through every queue (many requests in flight per queue), reads it back
/// through other queues, and checks the two volumes on shared devices are isolated.
#[test]
fn patterns_through_several_queues_and_isolation() {
    let d = Spoold::start(TWO_DEVICES);
    let mut a = connect(&d.socket("a"), 4, false).unwrap();
    let mut b = connect(&d.socket("b"), 4, false).unwrap();
    assert_eq!(a.capacity, 16 << 20);
    let bs = 64 * 1024;
    // Volume a: blocks 0..64 (4 MiB), 16 per queue, all in flight at once.
    for q in 0..4 {
        for i in 0..16 {
            let blk = q * 16 + i;
            let off = (blk * bs) as u64;
            a.buf(blk * bs, bs).copy_from_slice(&pattern(1, off, bs));
            a.write(q, off, blk * bs, bs, blk);
        }
    }
    for q in 0..4 {
        let done = a.wait(q, 16);
        assert!(done.iter().all(|&(_, r)| r == 0), "{done:?}");
    }
    // Volume b: same offsets, different content.
    for blk in 0..8 {
        let off = (blk * bs) as u64;
        assert_eq!(b.write_sync(blk % 4, off, &pattern(2, off, bs)), 0);
    }
    // Read a back through a different queue than it was written on.
    for blk in 0..64usize {
        let off = (blk * bs) as u64;
        let (r, data) = a.read_sync((blk + 1) % 4, off, bs);
        assert_eq!(r, 0);
        assert!(
            data == pattern(1, off, bs),
            "volume a block {blk} corrupted"
        );
    }
    for blk in 0..8usize {
        let off = (blk * bs) as u64;
        let (r, data) = b.read_sync(blk % 4, off, bs);
        assert_eq!(r, 0);
        assert!(
            data == pattern(2, off, bs),
            "volume b block {blk} shows someone else's data"
        );
    }
    // Never-written space of b reads as zeroes.
    let (r, data) = b.read_sync(0, 8 << 20, bs);
    assert_eq!(r, 0);
    assert!(data.iter().all(|&x| x == 0));
    // Out-of-range access is refused, not wrapped around.
    let (r, _) = a.read_sync(0, (16 << 20) - 512, 4096);
    assert!(r < 0, "read past the end must fail, got {r}");
}

/// A volume larger than one device spans both; I/O across the boundary is correct.
#[test]
fn volume_spanning_two_devices() {
    let d = Spoold::start(
        r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "10M"
[[devices]]
path = "@DIR@/d1.img"
create_size = "10M"
[[volumes]]
name = "wide"
size = "12M"
num_queues = 1
"#,
    );
    let v = d.rpc("volume_show", json!({"id": "wide"})).unwrap();
    assert_eq!(v["devices"].as_array().unwrap().len(), 2, "{v}");
    let mut c = connect(&d.socket("wide"), 1, false).unwrap();
    // 3 MiB write starting 1 MiB before the 8 MiB extent boundary.
    let off = 7u64 << 20;
    let data = pattern(7, off, 3 << 20);
    assert_eq!(c.write_sync(0, off, &data), 0);
    let (r, back) = c.read_sync(0, off, 3 << 20);
    assert_eq!(r, 0);
    assert!(back == data);
    // The extent map says where those bytes are: read them from the device files.
    let devices = d.rpc("device_list", json!({})).unwrap();
    let path_of = |uuid: &serde_json::Value| {
        let dev = devices
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["uuid"] == *uuid);
        dev.unwrap()["path"].as_str().unwrap().to_string()
    };
    let map = v["extent_map"].as_array().unwrap();
    let covered: u64 = map.iter().map(|e| e["len"].as_u64().unwrap()).sum();
    assert!(covered >= 12 << 20, "{v}");
    let mut found = 0;
    for e in map {
        let (vo, len) = (
            e["volume_offset"].as_u64().unwrap(),
            e["len"].as_u64().unwrap(),
        );
        let (from, to) = (off.max(vo), (off + (3 << 20)).min(vo + len));
        if from >= to {
            continue;
        }
        let file = std::fs::File::open(path_of(&e["device"])).unwrap();
        let mut buf = vec![0u8; (to - from) as usize];
        let at = e["offset"].as_u64().unwrap() + from - vo;
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, at).unwrap();
        assert!(
            buf[..] == data[(from - off) as usize..(to - off) as usize],
            "{e}"
        );
        found += to - from;
    }
    assert_eq!(found, 3 << 20, "the map covers the written range: {v}");
}

/// Metadata and data survive a graceful restart and a SIGKILL of spoold.
#[test]
fn data_survives_restart_and_kill() {
    let mut d = Spoold::start(TWO_DEVICES);
    let created = d
        .rpc(
            "volume_create",
            json!({"name": "c", "size": "8M", "num_queues": 2}),
        )
        .unwrap();
    {
        let mut c = connect(&d.socket("c"), 2, false).unwrap();
        for i in 0..16u64 {
            assert_eq!(
                c.write_sync((i % 2) as usize, i * 65536, &pattern(3, i * 65536, 65536)),
                0
            );
        }
        c.queues[0].flush(9, blkio::ReqFlags::empty());
        assert_eq!(c.wait(0, 1)[0].1, 0);
    }
    for how in ["graceful", "kill"] {
        if how == "graceful" {
            d.stop();
        } else {
            d.kill();
        }
        d.spawn();
        let v = d.rpc("volume_show", json!({"id": "c"})).unwrap();
        assert_eq!(v["uuid"], created["uuid"], "{how}");
        assert_eq!(v["extents"], created["extents"], "{how}");
        let mut c = connect(&d.socket("c"), 2, false).unwrap();
        for i in 0..16u64 {
            let (r, data) = c.read_sync(0, i * 65536, 65536);
            assert_eq!(r, 0);
            assert!(
                data == pattern(3, i * 65536, 65536),
                "{how}: block {i} lost"
            );
        }
    }
}

/// A client can disconnect and a new one (a rebooted VM) connects to the same socket.
#[test]
fn socket_keeps_accepting_after_disconnect() {
    let d = Spoold::start(TWO_DEVICES);
    for round in 0..3u64 {
        let mut c = connect(&d.socket("a"), 2, false).unwrap();
        if round > 0 {
            let (r, data) = c.read_sync(1, 0, 4096);
            assert_eq!(r, 0);
            assert!(data == pattern(round - 1, 0, 4096), "round {round}");
        }
        assert_eq!(c.write_sync(0, 0, &pattern(round, 0, 4096)), 0);
    }
}

/// Read-only volumes advertise RO, serve reads and refuse writes.
#[test]
fn read_only_volume() {
    let d = Spoold::start(TWO_DEVICES);
    {
        let mut c = connect(&d.socket("a"), 1, false).unwrap();
        assert_eq!(c.write_sync(0, 4096, &pattern(9, 4096, 4096)), 0);
    }
    d.rpc(
        "volume_create",
        json!({"name": "ro", "size": "4M", "read_only": true}),
    )
    .unwrap();
    // libblkio refuses to open an RO device read-write: proof that RO is advertised.
    let e = connect(&d.socket("ro"), 1, false)
        .err()
        .expect("RO must be advertised");
    assert!(e.message().contains("read-only"), "{}", e.message());
    let mut c = connect(&d.socket("ro"), 1, true).unwrap();
    let (r, data) = c.read_sync(0, 0, 4096);
    assert_eq!(r, 0);
    assert!(data.iter().all(|&x| x == 0));
    assert!(c.write_sync(0, 0, &[1u8; 4096]) < 0);
}

/// Flush, write-zeroes and discard reach the device.
#[test]
fn flush_write_zeroes_discard() {
    let d = Spoold::start(TWO_DEVICES);
    let mut c = connect(&d.socket("a"), 1, false).unwrap();
    let data = pattern(5, 0, 1 << 20);
    assert_eq!(c.write_sync(0, 0, &data), 0);
    c.queues[0].write_zeroes(65536, 65536, 1, blkio::ReqFlags::empty());
    assert_eq!(c.wait(0, 1)[0].1, 0);
    c.queues[0].flush(2, blkio::ReqFlags::empty());
    assert_eq!(c.wait(0, 1)[0].1, 0);
    let (r, back) = c.read_sync(0, 0, 1 << 20);
    assert_eq!(r, 0);
    assert!(back[..65536] == data[..65536]);
    assert!(back[65536..131072].iter().all(|&x| x == 0));
    assert!(back[131072..] == data[131072..]);
    c.queues[0].discard(0, 65536, 3, blkio::ReqFlags::empty());
    assert_eq!(c.wait(0, 1)[0].1, 0);
}

/// Growing a volume while a client is connected: new space is usable without reconnecting
/// once the client learns the new capacity (here: a fresh connection reads it).
#[test]
fn resize_grows_a_served_volume() {
    let d = Spoold::start(TWO_DEVICES);
    let mut c = connect(&d.socket("a"), 1, false).unwrap();
    assert_eq!(c.write_sync(0, 0, &pattern(6, 0, 4096)), 0);
    let v = d
        .rpc("volume_resize", json!({"id": "a", "size": "24M"}))
        .unwrap();
    assert_eq!(v["size"], json!(24u64 << 20));
    // The running queue accepts I/O beyond the old end right away.
    assert_eq!(c.write_sync(0, 20 << 20, &pattern(6, 20 << 20, 4096)), 0);
    drop(c);
    let mut c = connect(&d.socket("a"), 1, false).unwrap();
    assert_eq!(c.capacity, 24 << 20);
    let (r, data) = c.read_sync(0, 20 << 20, 4096);
    assert_eq!(r, 0);
    assert!(data == pattern(6, 20 << 20, 4096));
}

/// The device-reset path: while requests are in flight, the device's queues are torn down and
/// everything the journal records as INFLIGHT is resubmitted. The client sees no error and
/// every write lands.
#[test]
fn device_reset_resubmits_in_flight_requests_from_the_journal() {
    let d = Spoold::start(TWO_DEVICES);
    let dev = d.rpc("volume_show", json!({"id": "a"})).unwrap()["devices"][0]
        .as_str()
        .unwrap()
        .to_string();
    let mut c = connect(&d.socket("a"), 2, false).unwrap();
    // The first reset finds a write in flight for certain: one write hangs in the device
    // (an injected fault, once) until a reset aborts it. Resets at random moments alone
    // could all find the queue idle.
    d.rpc(
        "device_inject",
        json!({"id": dev, "kind": "timeout", "op": "write", "count": 1}),
    )
    .unwrap();
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let done = std::sync::Arc::new(AtomicUsize::new(0));
    let resets = {
        let (stop, done, rpc) = (stop.clone(), done.clone(), d.rpc_path());
        let dev = dev.clone();
        std::thread::spawn(move || {
            let mut client = spool_control::rpc::Client::connect(&rpc).unwrap();
            // Once the write hangs (the rule was hit: its hit count is up, or it is spent).
            loop {
                let f = client.call("device_faults", json!({"id": dev})).unwrap();
                let rules = f["rules"].as_array().cloned().unwrap_or_default();
                if rules.is_empty() || rules[0]["hits"].as_u64().unwrap_or(0) > 0 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            while !stop.load(Ordering::Relaxed) {
                let r = client.call("device_reset", json!({"id": dev})).unwrap();
                assert!(
                    r["volumes"].as_array().unwrap().contains(&json!("a")),
                    "{r}"
                );
                done.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(15));
            }
        })
    };
    // At least 20 rounds, and on until at least 6 resets happened during them.
    let rounds = common::write_rounds_until(&mut c, &|| done.load(Ordering::Relaxed) >= 6, 20);
    assert!(rounds >= 20);
    stop.store(true, Ordering::Relaxed);
    resets.join().unwrap();
    let log = d.log();
    assert!(
        log.lines()
            .any(|l| l.contains("device reset: resubmitting") && !l.contains("resubmitted=0")),
        "no reset ever caught a request in flight: the test did not exercise resubmission"
    );
}
