//! A mirrored thin volume's copy rebuilt from another asks the source's map what it never
//! wrote instead of reading it (issue 57): those pieces are not read, not counted against
//! the rate, and written to a target only where the target holds data of its own.

use std::time::{Duration, Instant};

use super::snapshot_tests::{io, reap_one};
use super::tests::{opts, spec};
use super::*;
use std::sync::Arc;

use spool_devices::{Device, DeviceIo, FaultEffect, FaultOps, FaultRule};

const MIB: u64 = 1 << 20;

fn pool(d: &std::path::Path) -> Pool {
    let specs = [spec(d, "a", 40), spec(d, "b", 40)];
    let o = PoolOptions {
        mirror_dir: Some(d.to_path_buf()),
        ..opts()
    };
    Pool::open(&specs, o).unwrap()
}

/// Waits until every leg of "m" is current in its mirror and synced in the table.
fn caught_up(p: &mut Pool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        p.settle_mirrors().unwrap();
        let m = p.mirror("m").unwrap().unwrap().progress();
        let synced = p.volume("m").unwrap().legs.iter().all(|l| l.synced);
        if synced && m.legs.iter().all(|l| l.state == "current") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the copy did not catch up: {m:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The thin device of copy `i` of "m".
fn copy_device(p: &Pool, i: usize) -> Arc<Device> {
    let v = &p.table.volumes[p.find("m").unwrap()];
    let key = v.leg_maps().nth(i).unwrap().1.uuid;
    p.map_device(v, key).unwrap()
}

fn discard(dev: &Device, offset: u64, len: u64) -> i32 {
    let mut q = dev.open_queue(4).unwrap();
    // SAFETY: a discard names no memory.
    unsafe { q.submit(DeviceIo::Discard { offset, len }, 1) };
    reap_one(&mut *q)
}

/// A copy made anew (a device replaced) is rebuilt from the other: only the three chunks the
/// source mapped are read and copied; the rest is holes on both, neither read nor written. Before, every hole was read, sent as write-zeroes and paced at `resync_rate`.
#[test]
fn a_new_copy_is_rebuilt_from_what_the_source_wrote_only() {
    let d = tempfile::tempdir().unwrap();
    let mut p = pool(d.path());
    p.create_thin_copies("m", 64 * MIB, false, 1, 2, false)
        .unwrap();
    let l = p.layout("m").unwrap();
    for (i, at) in [0, 5 * MIB, 60 * MIB].into_iter().enumerate() {
        let mut data = vec![i as u8 + 1; 8192];
        assert_eq!(io(&l.devices[0], true, at, &mut data), 0);
    }
    drop(l);
    let old = p.table.volumes[p.find("m").unwrap()]
        .leg_maps()
        .nth(1)
        .unwrap()
        .1
        .devices[0];
    p.replace_device(&old.to_string(), &spec(d.path(), "c", 40), true)
        .unwrap();
    caught_up(&mut p);
    let m = p.mirror("m").unwrap().unwrap();
    let progress = m.progress();
    let source = copy_device(&p, 0);
    let mapped = spool_thin::ThinBackend::of(&source).unwrap().allocated();
    assert!(
        (3 * 8192..=12 * MIB).contains(&mapped),
        "three chunks written: {mapped}"
    );
    assert_eq!(
        progress.unwritten_bytes,
        64 * MIB - mapped,
        "the holes were read: {progress:?}"
    );
    // The mapped chunks' zero pieces go as write-zeroes (a hole on the new copy takes
    // nothing); no hole of the source does.
    assert!(progress.zeroed_bytes < mapped, "{progress:?}");
    let new = copy_device(&p, 1);
    let thin = spool_thin::ThinBackend::of(&new).unwrap();
    assert_eq!(thin.allocated(), mapped, "the holes stay holes");
    for (i, at) in [0, 5 * MIB, 60 * MIB].into_iter().enumerate() {
        let mut back = vec![0u8; 8192];
        assert_eq!(io(&new, false, at, &mut back), 0);
        assert_eq!(back, vec![i as u8 + 1; 8192], "at {at}");
    }
    let v = m.verify().unwrap();
    assert_eq!((v.regions_differing, v.regions_skipped), (0, 0), "{v:?}");
    assert!(m.stop_copying());
}

/// The source's hole over a chunk the target still holds (it missed the discard that
/// unmapped it on the source) is written to the target as zeroes: skipping a hole is only
/// for a target that never wrote there either. Skipping it would leave the discarded data
/// readable from the target.
#[test]
fn a_hole_the_target_missed_is_written_to_it_as_zeroes() {
    let d = tempfile::tempdir().unwrap();
    let mut p = pool(d.path());
    p.create_thin_copies("m", 16 * MIB, false, 1, 2, false)
        .unwrap();
    let l = p.layout("m").unwrap();
    let mut data = vec![0x5a; 4 * MIB as usize];
    assert_eq!(io(&l.devices[0], true, 4 * MIB, &mut data), 0);
    let target = copy_device(&p, 1);
    target.faults().add(FaultRule {
        effect: FaultEffect::Errno(5),
        ops: FaultOps::Write,
        offset: 0,
        len: u64::MAX,
        count: Some(1),
        duration: None,
        fails_probe: false,
    });
    assert_eq!(
        discard(&l.devices[0], 4 * MIB, 4 * MIB),
        0,
        "copy 0 took it"
    );
    drop(l);
    caught_up(&mut p);
    let m = p.mirror("m").unwrap().unwrap();
    // Every piece went to the copy that held data there: none is counted as free.
    assert_eq!(m.progress().unwritten_bytes, 0, "{:?}", m.progress());
    let mut back = vec![1u8; 4 * MIB as usize];
    assert_eq!(io(&target, false, 4 * MIB, &mut back), 0);
    assert!(
        back.iter().all(|&b| b == 0),
        "the discarded data is still there"
    );
    let v = m.verify().unwrap();
    assert_eq!((v.regions_differing, v.regions_skipped), (0, 0), "{v:?}");
    assert!(m.stop_copying());
}
