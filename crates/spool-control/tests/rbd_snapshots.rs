//! Snapshots and clones of RBD volumes are RBD's own (docs/ceph.md), against a real
//! single-node cluster (scripts/ceph-cluster.sh): a snapshot taken while two queues write
//! holds every write completed before it, whole; the `rbd` tool sees the same snapshots;
//! a clone is an RBD layered clone that serves the snapshot's moment, takes writes of its
//! own and is flattened by `volume inflate`; a snapshot with clones, and an image with
//! snapshots, are not deleted; revert rolls the image back. `#[ignore]`d by default: it
//! needs Ceph (scripts/install-deps.sh); scripts/test.sh runs it.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};

use common::ceph::CephCluster;
use common::{block, connect, pattern, spoolctl, whole_rounds, write_rounds_until, Spoold, BS};

#[test]
#[ignore = "needs Ceph: scripts/test.sh runs it (cargo test -- --include-ignored)"]
fn rbd_volumes_snapshot_and_clone_with_rbds_own_snapshots() {
    let cluster = CephCluster::start("snaps");
    let d = Spoold::start(&format!(
        "[ceph]\nconf = \"{}\"\n[[devices]]\npath = \"@DIR@/d0.img\"\ncreate_size = \"64M\"\n[[volumes]]\nname = \"db\"\nsize = \"32M\"\nnum_queues = 2\nrbd = \"rbd\"\n",
        cluster.conf.display()
    ));
    let ctl = |args: &[&str]| {
        let (ok, out, err) = spoolctl(&d, args);
        assert!(ok, "spoolctl {args:?}: {out}{err}");
        out
    };
    let fails = |args: &[&str], want: &str| {
        let (ok, out, err) = spoolctl(&d, args);
        assert!(!ok && err.contains(want), "spoolctl {args:?}: {out}{err}");
    };
    let wait_disconnected = |v: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while d.rpc("volume_show", serde_json::json!({"id": v})).unwrap()["connected"] == true {
            assert!(std::time::Instant::now() < deadline, "{v} stays connected");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    };

    // s1 is taken while two queues write: it holds whole writes, none after it.
    let mut c = connect(&d.socket("db"), 2, false).unwrap();
    write_rounds_until(&mut c, &|| true, 1);
    let stop = AtomicBool::new(false);
    let rounds = std::thread::scope(|s| {
        let h = s.spawn(|| write_rounds_until(&mut c, &|| stop.load(Ordering::Relaxed), 3));
        std::thread::sleep(std::time::Duration::from_millis(100));
        let out = ctl(&["volume", "snapshot", "db", "s1"]);
        assert!(out.contains("db@s1"), "{out}");
        std::thread::sleep(std::time::Duration::from_millis(100));
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap()
    });
    let far = 16u64 << 20;
    assert_eq!(c.write_sync(0, far, &pattern(77, far, BS)), 0);
    let out = ctl(&["volume", "snapshots", "db"]);
    assert!(out.contains("db@s1") && out.contains(" - "), "{out}");
    let listed = cluster.rbd(&["snap", "ls", "rbd/db"]).unwrap();
    assert!(listed.contains("s1"), "rbd snap ls: {listed}");
    fails(&["volume", "snapshot", "db", "s1"], "exists already");
    fails(&["volume", "snapshot", "db", "a/b"], "must be");
    fails(&["volume", "diff", "db@s1"], "rbd export-diff");

    // A clone serves s1's moment as an RBD layered clone; its writes stay its own.
    let out = ctl(&["--json", "volume", "clone", "db@s1", "c1"]);
    assert!(out.contains("rbd/c1"), "{out}");
    let info = cluster.rbd(&["info", "rbd/c1"]).unwrap();
    assert!(info.contains("parent: rbd/db@s1"), "rbd info: {info}");
    let mut c1 = connect(&d.socket("c1"), 2, false).unwrap();
    let at_s1 = whole_rounds(&mut c1, rounds);
    println!("s1 caught the load at rounds {at_s1:?} (of {rounds})");
    assert!(block(&mut c1, far).iter().all(|&b| b == 0), "after s1");
    // The clone's own write, with a salt no round of the load uses.
    const OWN: u64 = 1_000_005;
    assert_eq!(c1.write_sync(0, 0, &pattern(OWN, 0, BS)), 0);
    assert!(block(&mut c, 0) == pattern(rounds - 1, 0, BS));
    fails(&["snapshot", "delete", "db@s1"], "has clones");
    let out = ctl(&["volume", "inflate", "c1"]);
    assert!(out.contains("depends on no snapshot"), "{out}");
    let info = cluster.rbd(&["info", "rbd/c1"]).unwrap();
    assert!(!info.contains("parent:"), "rbd info after inflate: {info}");
    assert!(block(&mut c1, 0) == pattern(OWN, 0, BS));
    for (b, &r) in at_s1.iter().enumerate().skip(1) {
        let at = b as u64 * BS as u64;
        assert!(
            block(&mut c1, at) == pattern(r, at, BS),
            "block {b} after inflate"
        );
    }
    ctl(&["snapshot", "delete", "db@s1"]);
    assert!(!cluster
        .rbd(&["snap", "ls", "rbd/db"])
        .unwrap()
        .contains("s1"));
    fails(&["snapshot", "delete", "db@s1"], "no snapshot");

    // Revert: refused while connected; then db holds s2's data again.
    ctl(&["volume", "snapshot", "db", "s2"]);
    assert_eq!(c.write_sync(1, far, &pattern(78, far, BS)), 0);
    fails(&["volume", "revert", "db", "s2"], "in use");
    drop(c);
    wait_disconnected("db");
    ctl(&["volume", "revert", "db", "s2"]);
    let mut c = connect(&d.socket("db"), 2, false).unwrap();
    assert!(block(&mut c, far) == pattern(77, far, BS));
    drop((c, c1));
    wait_disconnected("db");
    wait_disconnected("c1");

    // A rollback to a snapshot of another size is refused (it would resize the image).
    ctl(&["volume", "snapshot", "db", "s3"]);
    ctl(&["volume", "resize", "db", "48M"]);
    fails(&["volume", "revert", "db", "s3"], "would resize the image");
    ctl(&["snapshot", "delete", "db@s3"]);

    // An image with snapshots is not deleted, and its volume stays served; without, it is,
    // and so is the clone's.
    fails(&["volume", "delete", "db"], "has snapshots");
    let mut c = connect(&d.socket("db"), 2, false).unwrap();
    assert!(block(&mut c, far) == pattern(77, far, BS));
    drop(c);
    wait_disconnected("db");
    ctl(&["snapshot", "delete", "db@s2"]);
    ctl(&["volume", "delete", "db"]);
    ctl(&["volume", "delete", "c1"]);
    let images = cluster.rbd(&["ls", "rbd"]).unwrap();
    assert!(!images.contains("db") && !images.contains("c1"), "{images}");
}
