//! The takeover that ends adding copies to a thin volume: a write that the copies miss once
//! they were found current must not be acknowledged on the own map alone, which is given up
//! (issue 53: `finish_thin_copies` checked, committed and retired the own map while queues of
//! the old layout still wrote through it).

use std::time::{Duration, Instant};

use super::snapshot_tests::io;
use super::tests::{opts, spec};
use super::*;

/// A fault on each copy's thin device: its next write fails (EIO).
fn fail_next_copy_writes(p: &Pool, name: &str) {
    let v = &p.table.volumes[p.find(name).unwrap()];
    for (_, m) in v.leg_maps() {
        p.map_device(v, m.uuid)
            .unwrap()
            .faults()
            .add(spool_devices::FaultRule {
                effect: spool_devices::FaultEffect::Errno(5),
                ops: spool_devices::FaultOps::Write,
                offset: 0,
                len: u64::MAX,
                count: Some(1),
                duration: None,
                fails_probe: false,
            });
    }
}

/// The copies are current and the takeover commits while a queue of the old layout (the
/// own map's leg beside the copies) still writes. Its next write fails on both copies and
/// lands on the own map only: it is a path error (the worker sends it again, through the
/// new layout), never a success the new layout cannot read back. Before, it was
/// acknowledged, and the volume then read the old data there.
#[test]
fn a_write_both_copies_miss_during_the_takeover_is_not_acknowledged() {
    let d = tempfile::tempdir().unwrap();
    let specs = [
        spec(d.path(), "a", 40),
        spec(d.path(), "b", 40),
        spec(d.path(), "c", 40),
    ];
    let o = PoolOptions {
        mirror_dir: Some(d.path().to_path_buf()),
        ..opts()
    };
    let mut p = Pool::open(&specs, o).unwrap();
    p.create_thin_volume("m", 16 << 20, false, 1, false)
        .unwrap();
    let old = p.layout("m").unwrap();
    let mut first = vec![1u8; 8192];
    assert_eq!(io(&old.devices[0], true, 0, &mut first), 0);
    drop(old);
    p.add_leg("m").unwrap();
    // The old layout: the own map's leg beside the copies (its mirror rebuilds them).
    let old = p.layout("m").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !p.volume("m").unwrap().legs.iter().all(|l| l.synced) {
        assert!(Instant::now() < deadline, "the copies were not rebuilt");
        std::thread::sleep(Duration::from_millis(20));
        p.settle_mirrors().unwrap();
    }
    assert_eq!(p.finish_thin_copies().unwrap(), vec!["m".to_string()]);
    fail_next_copy_writes(&p, "m");
    let mut second = vec![2u8; 8192];
    let r = io(&old.devices[0], true, 0, &mut second);
    let new = p.layout("m").unwrap();
    if r != 0 {
        assert_eq!(r, -67, "held as a path error (ENOLINK)");
        // The worker sends it again, through the new layout.
        assert_eq!(io(&new.devices[0], true, 0, &mut second), 0);
    }
    let mut back = vec![0u8; 8192];
    assert_eq!(io(&new.devices[0], false, 0, &mut back), 0);
    assert_eq!(back, vec![2u8; 8192], "an acknowledged write was lost");
}
