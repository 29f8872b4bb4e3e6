//! Snapshots and clones of thin volumes (docs/snapshots.md) through the real spoold,
//! spoolctl and the real libblkio client: a snapshot taken while the volume is written holds
//! every write completed before it and whole blocks only; snapshots keep their moment
//! through later writes, worker SIGKILLs and a restart; a clone of each serves exactly the
//! data of its snapshot, and writes to a clone reach no one else.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use common::{
    connect, kill_workers_until_recovered, pattern, spoolctl, write_rounds_until, Client_, Spoold,
    BS,
};

const MIB: u64 = 1 << 20;

const CONFIG: &str = r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "96M"
[[volumes]]
name = "t"
size = "256M"
num_queues = 2
thin = true
"#;

/// Where the test's own marked blocks are: 8 blocks, one every 1.5 MiB from 16 MiB on
/// (away from the 4 MiB the load writes).
fn marks() -> Vec<u64> {
    (0..8).map(|i| 16 * MIB + i * 3 * MIB / 2).collect()
}

fn ctl(d: &Spoold, args: &[&str]) -> String {
    let (ok, out, err) = spoolctl(d, args);
    assert!(ok, "spoolctl {args:?}: {out}{err}");
    out
}

fn block(c: &mut Client_, off: u64) -> Vec<u8> {
    let (r, data) = c.read_sync(0, off, BS);
    assert_eq!(r, 0);
    data
}

/// Every block the load wrote holds one whole write of some round below `rounds`.
fn whole_rounds(c: &mut Client_, rounds: u64) -> Vec<u64> {
    (0..64u64)
        .map(|b| {
            let data = block(c, b * BS as u64);
            (0..rounds)
                .find(|&r| data == pattern(r, b * BS as u64, BS))
                .unwrap_or_else(|| panic!("block {b} holds no whole write of any round"))
        })
        .collect()
}

#[test]
fn snapshots_keep_their_moment_through_load_kills_and_a_restart_and_clones_serve_it() {
    let mut d = Spoold::prepared(CONFIG);
    d.spawn();
    let d0 = Arc::new(d);
    let mut c = connect(&d0.socket("t"), 2, false).unwrap();
    for &m in &marks() {
        assert_eq!(c.write_sync(0, m, &pattern(1001, m, BS)), 0);
    }
    // s1 is taken while the volume is being written.
    let stop = AtomicBool::new(false);
    let (rounds, took) = std::thread::scope(|s| {
        let h = s.spawn(|| write_rounds_until(&mut c, &|| stop.load(Ordering::Relaxed), 3));
        std::thread::sleep(std::time::Duration::from_millis(50));
        let t = Instant::now();
        let out = ctl(&d0, &["volume", "snapshot", "t", "s1"]);
        let took = t.elapsed();
        assert!(out.contains("snapshot t@s1 taken"), "{out}");
        std::thread::sleep(std::time::Duration::from_millis(50));
        stop.store(true, Ordering::Relaxed);
        (h.join().unwrap(), took)
    });
    println!("spoolctl volume snapshot under load took {took:?} (after {rounds} rounds)");
    for &m in &marks()[..4] {
        assert_eq!(c.write_sync(1, m, &pattern(1002, m, BS)), 0);
    }
    ctl(&d0, &["volume", "snapshot", "t", "s2"]);
    let (ok, _, err) = spoolctl(&d0, &["volume", "snapshot", "t", "s2"]);
    assert!(!ok && err.contains("already"), "{err}");
    // More writes through worker kills: none of them reach the snapshots.
    let killer = kill_workers_until_recovered(d0.clone(), 2, 8);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let h = s.spawn(|| write_rounds_until(&mut c, &|| stop.load(Ordering::Relaxed), 4));
        killer.join().unwrap();
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap()
    });
    drop(c);
    let mut d = Arc::into_inner(d0).expect("the killer is done");

    // Clones of each serve their snapshot's moment.
    ctl(&d, &["volume", "clone", "t@s1", "c1"]);
    ctl(&d, &["volume", "clone", "t@s2", "c2"]);
    let mut c1 = connect(&d.socket("c1"), 2, false).unwrap();
    assert_eq!(c1.capacity, 256 * MIB);
    for &m in &marks() {
        assert!(block(&mut c1, m) == pattern(1001, m, BS), "c1 at {m}");
    }
    let at_s1 = whole_rounds(&mut c1, rounds);
    println!("s1 caught the load at rounds {at_s1:?}");
    let mut c2 = connect(&d.socket("c2"), 2, false).unwrap();
    for (i, &m) in marks().iter().enumerate() {
        let salt = if i < 4 { 1002 } else { 1001 };
        assert!(block(&mut c2, m) == pattern(salt, m, BS), "c2 at {m}");
    }
    assert!(
        whole_rounds(&mut c2, rounds) == vec![rounds - 1; 64],
        "s2 came after the load's last round"
    );
    // A write to a clone reaches no one else.
    let m0 = marks()[0];
    assert_eq!(c1.write_sync(0, m0, &pattern(7, m0, BS)), 0);
    assert!(block(&mut c2, m0) == pattern(1002, m0, BS));
    let out = ctl(&d, &["volume", "snapshots", "t"]);
    assert!(out.contains("t@s1") && out.contains("t@s2"), "{out}");
    drop((c1, c2));

    // Across a restart: the snapshots, the clones and what they share.
    d.stop();
    d.spawn();
    let mut c1 = connect(&d.socket("c1"), 2, false).unwrap();
    assert!(block(&mut c1, m0) == pattern(7, m0, BS));
    assert!(whole_rounds(&mut c1, rounds) == at_s1);
    let mut t = connect(&d.socket("t"), 2, false).unwrap();
    assert!(block(&mut t, m0) == pattern(1002, m0, BS));
    assert_eq!(t.write_sync(0, m0, &pattern(8, m0, BS)), 0);
    assert!(block(&mut c1, m0) == pattern(7, m0, BS));
    drop((c1, t));
    let out = ctl(&d, &["snapshot", "delete", "t@s1"]);
    assert!(out.contains("deleted snapshot t@s1"), "{out}");
    let (ok, _, err) = spoolctl(&d, &["snapshot", "delete", "t@s1"]);
    assert!(!ok && err.contains("no snapshot"), "{err}");
    let (ok, _, err) = spoolctl(&d, &["volume", "clone", "t", "x"]);
    assert!(!ok && err.contains("VOLUME@SNAPSHOT"), "{err}");
    let mut c2 = connect(&d.socket("c2"), 2, false).unwrap();
    assert!(block(&mut c2, marks()[5]) == pattern(1001, marks()[5], BS));
}
