//! Mirrored volumes in the pool table, on real (temporary) files.

use super::tests::{newest_slot_version, opts, spec};
use super::*;
use crate::mirror::largest_mirror;

/// `(logical start, logical end, device)` of every extent of every leg of `v`.
fn leg_spans(p: &Pool, v: &str) -> Vec<Vec<(u64, u64, Uuid)>> {
    let e = &p.table.volumes[p.find(v).unwrap()];
    e.legs
        .iter()
        .map(|l| {
            let mut at = 0;
            l.extents
                .iter()
                .map(|x| {
                    let len = p.table.min_extent << x.order;
                    at += len;
                    (at - len, at, x.device)
                })
                .collect()
        })
        .collect()
}

/// Three 20 MiB devices.
fn three(d: &Path) -> [DeviceSpec; 3] {
    [spec(d, "a", 20), spec(d, "b", 20), spec(d, "c", 20)]
}

/// Asserts that no two legs share a device at any logical byte.
fn assert_distinct(p: &Pool, v: &str) {
    let legs = leg_spans(p, v);
    for (i, a) in legs.iter().enumerate() {
        for b in &legs[i + 1..] {
            for x in a {
                for y in b {
                    let overlap = x.0 < y.1 && y.0 < x.1;
                    assert!(!(overlap && x.2 == y.2), "legs share {} at {}", x.2, x.0);
                }
            }
        }
    }
}

#[test]
fn mirrored_volumes_keep_each_copy_on_another_device_and_survive_reopen() {
    let d = tempfile::tempdir().unwrap();
    let specs = three(d.path());
    let before = {
        let mut p = Pool::open(&specs, opts()).unwrap();
        let free = p.info().free;
        let v = p.create_volume_copies("m", 5 << 20, false, 1, 2).unwrap();
        assert_eq!((v.copies, v.legs.len(), v.allocated), (2, 2, 10 << 20));
        assert!(v.legs.iter().all(|l| l.synced && l.present));
        assert_eq!(p.info().free, free - (10 << 20));
        assert_distinct(&p, "m");
        // Grown: the new extents of each leg avoid the other legs' devices too.
        let v = p.resize_volume("m", 9 << 20).unwrap();
        assert_eq!(v.allocated, 18 << 20);
        assert_distinct(&p, "m");
        p.create_volume_copies("t", 2 << 20, false, 1, 3).unwrap();
        assert_distinct(&p, "t");
        assert_eq!(leg_spans(&p, "t").len(), 3);
        p.volumes()
    };
    assert_eq!(newest_slot_version(&specs[0].path), 3);
    let mut p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(
        serde_json::to_value(&before).unwrap(),
        serde_json::to_value(p.volumes()).unwrap()
    );
    let free = p.info().free;
    p.delete_volume("t").unwrap();
    assert_eq!(p.info().free, free + (6 << 20));
    // Plain volumes alone go back to format 1.
    p.delete_volume("m").unwrap();
    assert_eq!(newest_slot_version(&specs[0].path), 1);
}

#[test]
fn a_mirror_the_pool_cannot_hold_is_refused_with_the_reason() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 10), spec(d.path(), "b", 4)];
    let mut p = Pool::open(&specs, opts()).unwrap();
    let e = p
        .create_volume_copies("m", 1 << 20, false, 1, 3)
        .unwrap_err()
        .to_string();
    assert!(e.contains("3-way mirror needs 3 devices"), "{e}");
    let e = p
        .create_volume_copies("m", 1 << 20, false, 1, 4)
        .unwrap_err()
        .to_string();
    assert!(e.contains("1 to 3 copies"), "{e}");
    // 9 MiB free on a, 3 MiB on b: 4 MiB twice fits in bytes but not on distinct devices,
    // and the refusal says so.
    let free = p.info().free;
    let e = p
        .create_volume_copies("m", 4 << 20, false, 1, 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("fits now is about 3 MiB"), "{e}");
    assert_eq!(p.info().free, free, "a refused mirror keeps nothing");
    assert!(p.table.volumes.is_empty());
    p.create_volume_copies("m", 2 << 20, false, 1, 2).unwrap();
}

#[test]
fn replacing_a_device_marks_only_its_leg_for_rebuild() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 10), spec(d.path(), "b", 10)];
    let mut p = Pool::open(&specs, opts()).unwrap();
    p.create_volume_copies("m", 4 << 20, false, 1, 2).unwrap();
    let spans = leg_spans(&p, "m");
    let on_b = spans.iter().position(|l| l[0].2 != spans[0][0].2).unwrap();
    let b = spans[on_b][0].2;
    let r = p
        .replace_device(&b.to_string(), &spec(d.path(), "c", 10), true)
        .unwrap();
    assert_eq!(r.volumes, vec!["m".to_string()]);
    let v = p.volume("m").unwrap();
    let synced: Vec<bool> = v.legs.iter().map(|l| l.synced).collect();
    assert_eq!(synced.iter().filter(|s| !**s).count(), 1, "{synced:?}");
    assert!(!v.legs[on_b].synced);
    assert_distinct(&p, "m");
    // The table with an unsynced leg is valid and reopens.
    drop(p);
    let specs = [spec(d.path(), "a", 10), spec(d.path(), "c", 10)];
    let p = Pool::open(&specs, opts()).unwrap();
    assert!(!p.volume("m").unwrap().legs[on_b].synced);
}

#[test]
fn hostile_leg_tables_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 10), spec(d.path(), "b", 10)];
    let mut p = Pool::open(&specs, opts()).unwrap();
    p.create_volume_copies("m", 2 << 20, false, 1, 2).unwrap();
    let good = p.table.clone();
    type Break = fn(&mut metadata::PoolTable);
    let cases: Vec<(Break, &str)> = vec![
        (
            |t| t.volumes[0].legs[1].extents[0].device = t.volumes[0].legs[0].extents[0].device,
            "distinct devices",
        ),
        (
            |t| t.volumes[0].legs[1].slot = t.volumes[0].legs[0].slot,
            "repeated",
        ),
        (|t| t.volumes[0].legs[1].slot = 7, "out of range"),
        (|t| t.volumes[0].copies = 0, "not mirrored"),
        (|t| t.volumes[0].copies = 9, "copies 9"),
        (
            |t| t.volumes[0].legs.iter_mut().for_each(|l| l.synced = false),
            "no synced leg",
        ),
        (
            |t| t.volumes[0].extents = t.volumes[0].legs[0].extents.clone(),
            "outside its legs",
        ),
        (
            |t| {
                t.volumes[0].legs[1].extents.pop();
            },
            "leg 1",
        ),
        (|t| t.volumes[0].legs.clear(), "0 legs"),
    ];
    for (break_it, want) in cases {
        let mut t = good.clone();
        break_it(&mut t);
        let e = t.validate().unwrap_err().to_string();
        assert!(e.contains(want), "wanted '{want}' in: {e}");
    }
}

#[test]
fn copies_are_added_and_removed_online_and_the_last_complete_one_stays() {
    let d = tempfile::tempdir().unwrap();
    let specs = three(d.path());
    let mut p = Pool::open(&specs, opts()).unwrap();
    let free = p.info().free;
    p.create_volume("v", 4 << 20, false, 1).unwrap();
    // A plain volume becomes a 2-way mirror; the new copy is not synced until rebuilt.
    let v = p.add_leg("v").unwrap();
    assert_eq!((v.copies, v.legs.len()), (2, 2));
    assert_eq!((v.legs[0].synced, v.legs[1].synced), (true, false));
    assert_distinct(&p, "v");
    let v = p.add_leg("v").unwrap();
    assert_eq!(v.legs.len(), 3);
    assert_distinct(&p, "v");
    let e = p.add_leg("v").unwrap_err().to_string();
    assert!(e.contains("already has 3 copies"), "{e}");
    // Removing: an unsynced copy goes first; the last synced one never.
    let v = p.remove_leg("v", None).unwrap();
    assert_eq!(v.legs.iter().filter(|l| l.synced).count(), 1);
    let e = p.remove_leg("v", Some(0)).unwrap_err().to_string();
    assert!(e.contains("only complete copy"), "{e}");
    // Slot 1 was the unsynced copy removed first; slot 2 is the one left.
    let e = p.remove_leg("v", Some(1)).unwrap_err().to_string();
    assert!(e.contains("no leg 1"), "{e}");
    let v = p.remove_leg("v", None).unwrap();
    assert_eq!(
        (v.copies, v.legs.len()),
        (1, 0),
        "one copy left: plain again"
    );
    let e = p.remove_leg("v", None).unwrap_err().to_string();
    assert!(e.contains("not mirrored"), "{e}");
    // The removed copies stay taken while a queue may still write them (the daemon gives
    // them back once none uses the layout that names them), and are not leaked meanwhile.
    assert_eq!(
        p.info().free,
        free - 3 * (4 << 20),
        "freed under the queues"
    );
    let r = p.check();
    assert!(r.problems.is_empty() && r.leaked_bytes == 0, "{r:?}");
    let uuid = p.volume("v").unwrap().uuid;
    let ticket = p.retired_ticket(uuid).expect("retired extents");
    assert_eq!(p.release_retired(uuid, ticket), 2 * (4 << 20));
    assert_eq!(p.retired_ticket(uuid), None);
    assert_eq!(p.info().free, free - (4 << 20), "removed copies are freed");
    drop(p);
    let p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(p.volume("v").unwrap().copies, 1);
}

#[test]
fn legs_on_a_failed_device_move_to_free_space_elsewhere() {
    let d = tempfile::tempdir().unwrap();
    let specs = three(d.path());
    let mut p = Pool::open(&specs, opts()).unwrap();
    p.create_volume_copies("m", 4 << 20, false, 1, 2).unwrap();
    assert!(p.relocate_failed_legs().unwrap().is_empty());
    let spans = leg_spans(&p, "m");
    let failed = spans[1][0].2;
    let member = p.members.iter().find(|m| m.uuid == failed).unwrap();
    member.dev.health().set(spool_devices::HealthState::Failed);
    let moved = p.relocate_failed_legs().unwrap();
    assert_eq!((moved.len(), moved[0].leg), (1, 1), "{moved:?}");
    let v = p.volume("m").unwrap();
    assert!(!v.legs[1].synced && v.legs[0].synced);
    assert!(!v.legs[1].devices.contains(&failed), "{v:?}");
    assert_distinct(&p, "m");
    assert!(v.online);
    // Nothing left on the failed device: nothing more to move.
    assert!(p.relocate_failed_legs().unwrap().is_empty());
}

/// A mirror that does not fit says what each copy needs, what each device has and the
/// largest mirror that fits now, both when the pool's total is short and when only the
/// per-device room is (issue 37: the message counted both copies against the total).
#[test]
fn a_mirror_that_does_not_fit_says_why_and_what_would() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 17), spec(d.path(), "b", 5)];
    let mut p = Pool::open(&specs, opts()).unwrap();
    // 16 MiB and 4 MiB free: enough in total for two copies of 8 MiB, not on two devices.
    let err = p
        .create_volume_copies("m", 8 << 20, false, 1, 2)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("2-way mirror of 8 MiB: each copy needs 8 MiB on a device"),
        "{err}"
    );
    assert!(
        err.contains("has 16 MiB") && err.contains("has 4 MiB"),
        "{err}"
    );
    assert!(err.contains("fits now is about 4 MiB"), "{err}");
    let err = p
        .create_volume_copies("m", 32 << 20, false, 1, 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("fits now is about 4 MiB"), "{err}");
    // What it says fits, fits; nothing was left taken by the refusals.
    assert_eq!(p.info().free, 20 << 20);
    p.create_volume_copies("m", 4 << 20, false, 1, 2).unwrap();
    assert_eq!(largest_mirror(&[10, 10, 10], 2, 1), 15);
    assert_eq!(largest_mirror(&[10, 10, 10], 3, 1), 10);
    assert_eq!(largest_mirror(&[100, 1], 2, 1), 1);
}

/// A copy that missed a write (its device resetting) is stale there while the other holds
/// it alone; the table still calls both synced. Removing the one that holds it is refused
/// (it used to be removed, and the volume then read the stale copy's old data: the torture
/// tester's tier 2), and a removal that names no leg takes the stale one.
#[test]
fn a_copy_that_alone_holds_a_write_is_not_removed() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 40), spec(d.path(), "b", 40)];
    let mut p = Pool::open(&specs, super::tests::mirror_opts(d.path())).unwrap();
    let v = p.create_volume_copies("v", 4 << 20, false, 1, 2).unwrap();
    assert!(v.legs.iter().all(|l| l.synced), "{v:?}");
    let on = p.table.volumes[p.find("v").unwrap()].legs[1].extents[0].device;
    let dev1 = p.members.iter().find(|m| m.uuid == on).unwrap().dev.clone();
    let layout = p.layout("v").unwrap();
    dev1.health().set(spool_devices::HealthState::Resetting);
    let mut data = vec![7u8; 8192];
    assert_eq!(
        super::snapshot_tests::io(&layout.devices[0], true, 0, &mut data),
        0
    );
    let e = p.remove_leg("v", Some(0)).unwrap_err().to_string();
    assert!(e.contains("holds the only current copy"), "{e}");
    let v = p.remove_leg("v", None).unwrap();
    assert_eq!((v.copies, v.legs.len()), (1, 0), "the stale copy went");
    dev1.health().set(spool_devices::HealthState::Healthy);
    drop(layout);
    let layout = p.layout("v").unwrap();
    let mut back = vec![0u8; 8192];
    layout.read_at(&mut back, 0).unwrap();
    assert_eq!(back, data, "the copy left lost the write");
}

/// A copy removed and another added at once lands on the same extents, in the same slot:
/// its identity (from its extents) was the removed copy's, so the mirror took it for that
/// copy, current wherever the removal had cleared it, and read the removed copy's old data
/// for writes made since (tier 2, a fresh seed). It is a new copy: rebuilt before it is read.
#[test]
fn a_copy_added_where_one_was_removed_is_rebuilt_not_trusted() {
    let d = tempfile::tempdir().unwrap();
    let specs = three(d.path());
    let mut p = Pool::open(&specs, opts()).unwrap();
    p.create_volume_copies("v", 4 << 20, false, 1, 2).unwrap();
    p.add_leg("v").unwrap();
    let caught_up = |p: &mut Pool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let _serving = p.layout("v").unwrap();
        while !p.volume("v").unwrap().legs.iter().all(|l| l.synced) {
            assert!(std::time::Instant::now() < deadline, "never rebuilt");
            std::thread::sleep(std::time::Duration::from_millis(20));
            p.settle_mirrors().unwrap();
        }
    };
    caught_up(&mut p);
    let put = |p: &Pool, byte: u8| {
        let l = p.layout("v").unwrap();
        let mut data = vec![byte; 4 << 20];
        assert_eq!(
            super::snapshot_tests::io(&l.devices[0], true, 0, &mut data),
            0
        );
    };
    put(&p, 0x11);
    let before = leg_spans(&p, "v")[2].clone();
    p.remove_leg("v", Some(2)).unwrap();
    let uuid = p.volume("v").unwrap().uuid;
    let ticket = p.retired_ticket(uuid).expect("retired extents");
    p.release_retired(uuid, ticket);
    put(&p, 0x22);
    p.add_leg("v").unwrap();
    assert_eq!(
        leg_spans(&p, "v")[2],
        before,
        "the same extents, as the test means"
    );
    caught_up(&mut p);
    // Every copy holds the second write (the new one had the first where it was trusted).
    let m = p.mirror("v").unwrap().unwrap();
    let v = m.verify().unwrap();
    assert_eq!((v.regions_differing, v.regions_skipped), (0, 0), "{v:?}");
    assert!(m.stop_copying());
}
