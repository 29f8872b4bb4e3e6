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

/// `ops` failing once with EIO anywhere on a device.
fn fails_once(ops: FaultOps) -> FaultRule {
    FaultRule {
        effect: FaultEffect::Errno(5),
        ops,
        offset: 0,
        len: u64::MAX,
        count: Some(1),
        duration: None,
        fails_probe: false,
    }
}

fn discard(dev: &Device, offset: u64, len: u64) -> i32 {
    let mut q = dev.open_queue(4).unwrap();
    // SAFETY: a discard names no memory.
    unsafe { q.submit(DeviceIo::Discard { offset, len }, 1) };
    reap_one(&mut *q)
}

/// A 16 MiB thin volume "m" of two copies, 4 MiB of 0x5a written at 4 MiB.
fn written_at_4_mib(d: &std::path::Path) -> (Pool, VolumeLayout) {
    let mut p = pool(d);
    p.create_thin_copies("m", 16 * MIB, false, 1, 2, false)
        .unwrap();
    let l = p.layout("m").unwrap();
    let mut data = vec![0x5a; 4 * MIB as usize];
    assert_eq!(io(&l.devices[0], true, 4 * MIB, &mut data), 0);
    (p, l)
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
    let (mut p, l) = written_at_4_mib(d.path());
    let target = copy_device(&p, 1);
    target.faults().add(fails_once(FaultOps::Write));
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

/// A copy whose map block write failed under a whole-chunk discard holds a hole in memory
/// that its device may still name (the block is unsure). The rebuild writes it zeroes in
/// 256 KiB pieces; those must write the block, so that the copy's device says hole too and
/// the chunk it held goes back. (They were taken as needing nothing: the copy's chunk stayed
/// held, and after a restart the copy's map named the discarded data again.)
#[test]
fn a_rebuild_over_a_hole_the_target_is_unsure_of_writes_its_map() {
    let d = tempfile::tempdir().unwrap();
    let (mut p, l) = written_at_4_mib(d.path());
    let v = &p.table.volumes[p.find("m").unwrap()];
    let map_at = v.leg_maps().nth(1).unwrap().1.devices[0];
    let member = p.members.iter().find(|m| m.uuid == map_at).unwrap();
    member.dev.faults().add(fails_once(FaultOps::MetaWrite));
    assert_eq!(
        discard(&l.devices[0], 4 * MIB, 4 * MIB),
        0,
        "copy 0 took it"
    );
    drop(l);
    // The monitor's job, here by hand: the device that failed the write is healthy again.
    let member = p.members.iter().find(|m| m.uuid == map_at).unwrap();
    member.dev.health().set(spool_devices::HealthState::Healthy);
    let target = copy_device(&p, 1);
    target.health().set(spool_devices::HealthState::Healthy);
    let thin = spool_thin::ThinBackend::of(&target).unwrap();
    assert!(
        !thin.unsure_placements().is_empty(),
        "the failed block's chunks are held"
    );
    caught_up(&mut p);
    assert!(
        thin.unsure_placements().is_empty(),
        "the rebuild left the copy's map block unsure"
    );
    assert_eq!(thin.allocated(), 0);
    let m = p.mirror("m").unwrap().unwrap();
    assert!(m.stop_copying());
    drop((m, target));
    drop(p);
    let p = pool(d.path());
    let thin = copy_device(&p, 1);
    let allocated = spool_thin::ThinBackend::of(&thin).unwrap().allocated();
    assert_eq!(
        allocated, 0,
        "after a restart the copy names the chunk again"
    );
}
