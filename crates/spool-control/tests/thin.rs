//! Thin volumes (docs/thin.md) through the real spoold and the real libblkio client: a
//! volume larger than the pool takes chunks only where it is written, through worker
//! SIGKILLs (the journal resubmits writes that were waiting for a chunk) and a restart;
//! holes read zeroes; discards and write-zeroes of whole chunks give them back; a full pool
//! holds a write, then fails it with an error and a log line, and serves it again once space
//! is freed; deleting the volume gives back everything it had; a corrupt map refuses that
//! volume only, saying why. A real guest verifies fio's writes through worker kills and gives
//! space back with `blkdiscard`.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use blkio::ReqFlags;
use common::{
    assert_pool_checks_clean, connect, kill_workers_holding_a_write, pattern, spoolctl,
    write_rounds_until, Client_, Spoold, BS, RECOVERED,
};
use serde_json::json;

const MIB: u64 = 1 << 20;

fn config() -> String {
    // Appended to `[pool]` (min_extent = "1M": 1 MiB chunks).
    r#"
thin_full_wait_ms = 600
[[devices]]
path = "@DIR@/d0.img"
create_size = "48M"
[[volumes]]
name = "thin"
size = "1G"
num_queues = 2
thin = true
[[volumes]]
name = "plain"
size = "8M"
"#
    .into()
}

fn mapped(d: &Spoold) -> u64 {
    mapped_of(d, "thin")
}

fn pool_free(d: &Spoold) -> u64 {
    d.rpc("pool_show", json!({})).unwrap()["free"]
        .as_u64()
        .unwrap()
}

/// Waits (up to 10 s) for the pool's free space to be `want`: chunks unmapped by a discard
/// go back once their grace period is over, a few milliseconds after the discard completed.
fn wait_free(d: &Spoold, want: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while pool_free(d) != want && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(pool_free(d), want);
}

/// Waits (up to 10 s) for a "pool-space" event whose reason contains `what`; returns it.
fn wait_event(d: &Spoold, what: &str) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let e = d.rpc("events_list", json!({"wait_ms": 500})).unwrap();
        let found = e["events"].as_array().unwrap().iter().find_map(|e| {
            let reason = e["reason"].as_str()?;
            (e["kind"] == "pool-space" && reason.contains(what)).then(|| reason.to_string())
        });
        if let Some(r) = found {
            return r;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no pool-space event with {what:?}: {e}"
        );
    }
}

/// Sends a discard (or write-zeroes) on queue 0 and waits for its result.
fn trim(c: &mut Client_, zeroes: bool, offset: u64, len: u64) -> i32 {
    if zeroes {
        c.queues[0].write_zeroes(offset, len, 7, ReqFlags::empty());
    } else {
        c.queues[0].discard(offset, len, 7, ReqFlags::empty());
    }
    c.wait(0, 1)[0].1
}

#[test]
fn a_thin_volume_takes_space_on_write_and_gives_it_back() {
    let mut d = Spoold::prepared(&config());
    d.spawn();
    let p = d.rpc("pool_show", json!({})).unwrap();
    assert_eq!(p["thin_provisioned"], 1 << 30, "{p}");
    assert_eq!(p["thin_mapped"], 0, "{p}");
    let (_, out, _) = spoolctl(&d, &["pool", "show"]);
    assert!(out.contains("over-committed"), "{out}");
    assert_eq!(mapped(&d), 0);
    let free0 = pool_free(&d);
    let d = Arc::new(d);

    // Holes read zeroes; the first 4 MiB written through worker kills take 4 chunks.
    let mut c = connect(&d.socket("thin"), 2, false).unwrap();
    assert_eq!(c.capacity, 1 << 30);
    let (r, data) = c.read_sync(0, 900 * MIB, BS);
    assert!(r == 0 && data.iter().all(|&b| b == 0));
    let dev = d.dir.path().join("d0.img");
    let killer = kill_workers_holding_a_write(d.clone(), dev.to_str().unwrap(), 2, 8);
    let stop = AtomicBool::new(false);
    let rounds = std::thread::scope(|s| {
        let h = s.spawn(|| write_rounds_until(&mut c, &|| stop.load(Ordering::Relaxed), 4));
        killer.join().unwrap();
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap()
    });
    assert!(
        d.log().contains(RECOVERED),
        "no kill caught a write in flight"
    );
    assert_eq!(mapped(&d), 4 * MIB);
    assert_pool_checks_clean(&d);
    // One block far away takes one more chunk; the rest of that chunk reads zeroes.
    assert_eq!(
        c.write_sync(1, 700 * MIB + BS as u64, &pattern(7, 0, BS)),
        0
    );
    assert_eq!(mapped(&d), 5 * MIB);
    assert!(c.read_sync(0, 700 * MIB + BS as u64, BS).1 == pattern(7, 0, BS));
    assert!(c.read_sync(0, 700 * MIB, BS).1.iter().all(|&b| b == 0));
    assert_eq!(pool_free(&d), free0 - 5 * MIB);

    // A discard of part of a chunk keeps it; of whole chunks gives them back, as does
    // write-zeroes; they read zeroes after.
    assert_eq!(trim(&mut c, false, 0, 64 << 10), 0);
    assert_eq!(mapped(&d), 5 * MIB);
    assert_eq!(trim(&mut c, false, 2 * MIB, 2 * MIB), 0);
    assert_eq!(trim(&mut c, true, 700 * MIB, MIB), 0);
    assert_eq!(mapped(&d), 2 * MIB);
    // (The chunks unmapped may still be in their grace period: held, not leaked.)
    assert_pool_checks_clean(&d);
    wait_free(&d, free0 - 2 * MIB);
    assert!(c.read_sync(0, 3 * MIB, BS).1.iter().all(|&b| b == 0));
    assert!(c
        .read_sync(0, 700 * MIB + BS as u64, BS)
        .1
        .iter()
        .all(|&b| b == 0));
    let last = rounds - 1;
    assert!(c.read_sync(0, MIB, BS).1 == pattern(last, MIB, BS));
    drop(c);

    // A restart finds the same chunks.
    let mut d = Arc::into_inner(d).unwrap();
    d.stop();
    d.spawn();
    assert_eq!(mapped(&d), 2 * MIB);
    assert_eq!(pool_free(&d), free0 - 2 * MIB);
    let mut c = connect(&d.socket("thin"), 2, false).unwrap();
    assert!(c.read_sync(0, MIB, BS).1 == pattern(last, MIB, BS));
    assert!(c.read_sync(1, 2 * MIB, BS).1.iter().all(|&b| b == 0));

    // Filling the pool: writes to new chunks until one fails after waiting for space.
    let free = pool_free(&d) / MIB;
    let mut failed_at = None;
    for i in 0..free + 2 {
        let r = c.write_sync(0, (100 + i) * MIB, &pattern(i, 0, 4096));
        if r != 0 {
            failed_at = Some(i);
            break;
        }
    }
    assert_eq!(
        failed_at,
        Some(free),
        "the write past the last free chunk fails"
    );
    assert!(d.log().contains("the pool is full"), "{}", d.log());
    assert_eq!(pool_free(&d), 0);
    // The operator is told: free space fell below 20%, 10% and 5% of the pool (one event per
    // settler round that saw a level crossed; at least the last says 0% free).
    let said = wait_event(&d, "0% free");
    assert!(said.contains("thin volumes promise"), "{said}");
    assert_pool_checks_clean(&d);
    // Freeing a chunk lets the same write through (once the chunk is back, after its grace
    // period: a starved allocator could otherwise outlast thin_full_wait_ms).
    assert_eq!(trim(&mut c, false, 100 * MIB, MIB), 0);
    wait_free(&d, MIB);
    assert_eq!(c.write_sync(0, (100 + free) * MIB, &pattern(1, 0, 4096)), 0);
    drop(c);

    // Deleting the volume gives everything back.
    let plain_free = {
        let v = d
            .rpc("volume_delete", json!({"id": "thin", "force": true}))
            .unwrap();
        assert_eq!(v["name"], "thin");
        pool_free(&d)
    };
    assert_eq!(
        plain_free,
        free0 + MIB,
        "the chunks and the map are free again"
    );
}

#[test]
fn thin_volumes_are_created_over_rpc_and_refuse_what_they_cannot_do() {
    let mut d = Spoold::prepared(
        r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "32M"
[[devices]]
path = "@DIR@/d1.img"
create_size = "32M"
"#,
    );
    d.spawn();
    let (ok, out, err) = spoolctl(&d, &["volume", "create", "t", "10G", "--thin"]);
    assert!(ok, "{out}{err}");
    let (_, out, _) = spoolctl(&d, &["volume", "show", "t"]);
    assert!(out.contains("thin: 0"), "{out}");
    // A mirrored thin volume: a map per copy, each on a device of its own (tests/mirror.rs
    // has it lose one and grow).
    let (ok, out, err) = spoolctl(
        &d,
        &["volume", "create", "m", "1G", "--thin", "--mirror", "2"],
    );
    assert!(ok, "{out}{err}");
    let v = d.rpc("volume_show", json!({"id": "m"})).unwrap();
    let legs = v["mirror"]["legs"].as_array().unwrap();
    assert_eq!(legs.len(), 2, "{v}");
    assert_ne!(legs[0]["devices"], legs[1]["devices"], "{v}");
    assert_eq!(v["thin"]["map_bytes"], 2 << 20, "{v}");
    let e = d
        .rpc("volume_snapshot", json!({"id": "m", "snapshot": "s"}))
        .unwrap_err();
    assert!(e.message.contains("mirrored thin"), "{e:?}");
    d.rpc("volume_delete", json!({"id": "m"})).unwrap();
    // A thin volume grows (no space taken) up to what its map holds (1 MiB: 32 GiB).
    let v = d
        .rpc("volume_resize", json!({"id": "t", "size": "20G"}))
        .unwrap();
    assert_eq!(v["size"], 20u64 << 30, "{v}");
    assert_eq!(v["thin"]["max_size"], 32u64 << 30, "{v}");
    let e = d
        .rpc("volume_resize", json!({"id": "t", "size": "40G"}))
        .unwrap_err();
    assert!(e.message.contains("can grow up to"), "{e:?}");
    let mut c = connect(&d.socket("t"), 1, false).unwrap();
    assert_eq!(c.capacity, 20 << 30);
    assert_eq!(c.write_sync(0, (20 << 30) - 8192, &pattern(4, 0, 8192)), 0);
    assert_eq!(c.write_sync(0, 5 << 30, &pattern(3, 0, 8192)), 0);
    assert!(c.read_sync(0, 5 << 30, 8192).1 == pattern(3, 0, 8192));
    drop(c);

    // A corrupt map entry: that volume is refused with the reason, the pool still serves.
    let map_dev = {
        let v = d.rpc("volume_show", json!({"id": "t"})).unwrap();
        assert_eq!(v["thin"]["mapped"], 2 << 20, "{v}");
        v
    };
    drop(map_dev);
    d.stop();
    // The map is the first extent the pool handed out on some device: find the entry by
    // its magic and flip a bit of it.
    let mut hit = false;
    for f in ["d0.img", "d1.img"] {
        let path = d.dir.path().join(f);
        let mut img = std::fs::read(&path).unwrap();
        if let Some(at) = img.windows(4).position(|w| w == b"SPTC") {
            img[at + 30] ^= 1;
            std::fs::write(&path, img).unwrap();
            hit = true;
        }
    }
    assert!(hit, "no map entry found on the devices");
    d.spawn();
    let v = d.rpc("volume_show", json!({"id": "t"})).unwrap();
    assert_eq!(v["socket"], serde_json::Value::Null, "{v}");
    let why = v["not_served"].as_str().unwrap_or_default();
    assert!(why.contains("checksum"), "{v}");
    let (ok, out, err) = spoolctl(&d, &["volume", "create", "u", "4M"]);
    assert!(ok, "{out}{err}");
}

/// A real guest on a thin volume four times the size of its device: fio fills 24 MiB, then
/// writes and verifies at random for 6 s while the worker is SIGKILLed every 300–700 ms
/// (writes waiting for their chunks are resubmitted from the journal), then `blkdiscard`
/// gives 8 MiB back in whole chunks and the guest reads them as zeroes. The volume ends with
/// exactly the 16 chunks still written.
#[test]
#[ignore = "needs QEMU and the test guest: scripts/test.sh runs it (cargo test -- --include-ignored)"]
fn a_guest_on_a_thin_volume_verifies_through_kills_and_gives_space_back() {
    let mut d = Spoold::prepared(
        r#"
[io]
poll_idle_us = 20
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[volumes]]
name = "vm"
size = "256M"
num_queues = 2
thin = true
"#,
    );
    d.spawn();
    let free0 = pool_free(&d);
    let d = Arc::new(d);
    let console = d.dir.path().join("thin.console");
    let done = Arc::new(AtomicBool::new(false));
    let killer = {
        let (d, console, done) = (d.clone(), console.clone(), done.clone());
        std::thread::spawn(move || {
            let read = || std::fs::read_to_string(&console).unwrap_or_default();
            while !read().contains("SPOOL-E2E: disk") && !done.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            let mut kills = 0;
            while kills < 8 && !read().contains("SPOOL-E2E: written") {
                std::thread::sleep(std::time::Duration::from_millis(300 + kills * 97 % 400));
                if done.load(Ordering::Relaxed) {
                    break;
                }
                d.kill_worker();
                kills += 1;
            }
            kills
        })
    };
    // The console goes to a file as it comes, so the killer sees the guest's progress.
    let status = common::guest::qemu(&d.socket("vm"), "thin", 2, "spool.runtime=6", 600)
        .stdout(std::fs::File::create(&console).unwrap())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("qemu-system-x86_64 must be installed");
    done.store(true, Ordering::Relaxed);
    let c = std::fs::read_to_string(&console).unwrap_or_default();
    eprintln!("thin guest: qemu {status}");
    let kills = killer.join().unwrap();
    common::guest::assert_pass(&c, &d, "thin");
    assert!(c.contains("holds 0 nonzero bytes"), "{c}");
    assert!(kills > 0, "no worker was killed while the guest wrote");
    eprintln!("thin guest: {kills} worker kills while it wrote");
    assert_eq!(mapped_of(&d, "vm"), 16 * MIB);
    wait_free(&d, free0 - 16 * MIB);
    assert_pool_checks_clean(&d);
}

fn mapped_of(d: &Spoold, volume: &str) -> u64 {
    let v = d.rpc("volume_show", json!({"id": volume})).unwrap();
    v["thin"]["mapped"].as_u64().unwrap()
}

/// `device replace` under a thin volume whose chunks are spread over three devices, with a
/// client connected: the chunks on the replaced device are lost (they read zeroes, as a
/// thick volume's extents there would), every other one keeps its data, a lost chunk takes
/// a new one on its next write, a device holding the map is refused, and `pool check` is
/// clean, also after a restart.
#[test]
fn a_device_replaced_under_a_thin_volume_costs_only_its_chunks() {
    let mut d = Spoold::prepared(
        "[[devices]]\npath = \"@DIR@/d0.img\"\ncreate_size = \"24M\"\n[[devices]]\npath = \"@DIR@/d1.img\"\ncreate_size = \"24M\"\n[[devices]]\npath = \"@DIR@/d2.img\"\ncreate_size = \"24M\"\n[[volumes]]\nname = \"t\"\nsize = \"24M\"\nnum_queues = 1\nthin = true\n",
    );
    d.spawn();
    let mut c = connect(&d.socket("t"), 1, false).unwrap();
    for i in 0..24u64 {
        assert_eq!(c.write_sync(0, i * MIB, &pattern(i, i * MIB, BS)), 0);
    }
    let devices: Vec<String> = (d.rpc("device_list", json!({})).unwrap())
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["uuid"].as_str().unwrap().to_string())
        .collect();
    let new = d.dir.path().join("new.img");
    let mut replaced = None;
    for u in &devices {
        let r = d.rpc(
            "device_replace",
            json!({"old": u, "new": new, "create_size": 24 << 20, "force": true}),
        );
        match r {
            Ok(r) => {
                replaced = Some(r);
                break;
            }
            Err(e) => assert!(e.message.contains("keeps its map"), "{}", e.message),
        }
    }
    let r = replaced.expect("one device holds chunks and no map");
    assert_eq!(r["volumes"], json!(["t"]), "{r}");
    let (mut lost, mut kept) = (Vec::new(), 0);
    for i in 0..24u64 {
        let (res, data) = c.read_sync(0, i * MIB, BS);
        assert_eq!(res, 0, "chunk {i}");
        if data == pattern(i, i * MIB, BS) {
            kept += 1;
        } else {
            assert!(
                data.iter().all(|&b| b == 0),
                "chunk {i} is neither its data nor zeroes"
            );
            lost.push(i);
        }
    }
    assert!(!lost.is_empty() && kept > 0, "lost {lost:?}, kept {kept}");
    let l = lost[0] * MIB;
    assert_eq!(c.write_sync(0, l, &pattern(99, l, BS)), 0);
    assert!(c.read_sync(0, l, BS).1 == pattern(99, l, BS));
    assert_pool_checks_clean(&d);
    drop(c);
    d.stop();
    d.spawn();
    assert_pool_checks_clean(&d);
    let mut c = connect(&d.socket("t"), 1, false).unwrap();
    assert!(c.read_sync(0, l, BS).1 == pattern(99, l, BS));
    for &i in &lost[1..] {
        assert!(
            c.read_sync(0, i * MIB, BS).1.iter().all(|&b| b == 0),
            "chunk {i}"
        );
    }
}
