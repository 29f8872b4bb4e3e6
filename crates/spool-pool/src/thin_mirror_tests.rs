//! Mirrored thin volumes in the pool, on real files: each copy's map and chunks stay on
//! its own devices, writes through the mirror land in every copy, a reopen finds them, a
//! device replace makes its copy anew and the mirror rebuilds it, deleting gives everything
//! back, and tables that misdescribe the copies are refused.

use std::time::{Duration, Instant};

use super::snapshot_tests::io;
use super::tests::{opts, spec};
use super::*;

/// Each copy's map key and devices.
fn copies(p: &Pool, name: &str) -> Vec<(Uuid, Vec<Uuid>)> {
    let v = &p.table.volumes[p.find(name).unwrap()];
    v.leg_maps()
        .map(|(_, m)| (m.uuid, m.devices.clone()))
        .collect()
}

/// The chunks copy `key` of volume `name` names.
fn placements(p: &Pool, name: &str, key: Uuid) -> Vec<spool_thin::map::Placement> {
    let v = &p.table.volumes[p.find(name).unwrap()];
    let dev = p.map_device(v, key).unwrap();
    spool_thin::ThinBackend::of(&dev).unwrap().placements()
}

/// `len` bytes at `at` of copy `key` of volume `name`, read through its own thin device.
fn read_copy(p: &Pool, name: &str, key: Uuid, at: u64, len: usize) -> Vec<u8> {
    let v = &p.table.volumes[p.find(name).unwrap()];
    let mut buf = vec![0u8; len];
    assert_eq!(io(&p.map_device(v, key).unwrap(), false, at, &mut buf), 0);
    buf
}

const AT: [u64; 3] = [0, 5 << 20, 60 << 20];

fn write_pattern(p: &Pool) {
    let l = p.layout("m").unwrap();
    for (i, at) in AT.into_iter().enumerate() {
        let mut data = vec![i as u8 + 1; 8192];
        assert_eq!(io(&l.devices[0], true, at, &mut data), 0);
    }
}

fn assert_pattern(p: &Pool, key: Uuid) {
    for (i, at) in AT.into_iter().enumerate() {
        assert_eq!(read_copy(p, "m", key, at, 8192), vec![i as u8 + 1; 8192]);
    }
}

#[test]
fn each_copy_keeps_its_chunks_on_its_own_devices_across_a_reopen() {
    let d = tempfile::tempdir().unwrap();
    let specs = [
        spec(d.path(), "a", 40),
        spec(d.path(), "b", 40),
        spec(d.path(), "c", 40),
    ];
    let free0;
    {
        let mut p = Pool::open(&specs, opts()).unwrap();
        free0 = p.info().free;
        let v = p
            .create_thin_copies("m", 64 << 20, false, 1, 2, false)
            .unwrap();
        assert_eq!((v.copies, v.legs.len()), (2, 2));
        assert!(v.legs.iter().all(|l| l.synced && l.present));
        assert_eq!(p.table.format_version(), 10);
        let c = copies(&p, "m");
        assert!(c[0].1.iter().all(|d| !c[1].1.contains(d)), "{c:?}");
        assert_eq!(c[0].1.len() + c[1].1.len(), 3, "every device serves a copy");
        write_pattern(&p);
        for (key, own) in &c {
            let chunks = placements(&p, "m", *key);
            assert_eq!(chunks.len(), 3, "one chunk per write, in each copy");
            assert!(
                chunks.iter().all(|ch| own.contains(&ch.device)),
                "{chunks:?}"
            );
            assert_pattern(&p, *key);
        }
        assert_eq!(p.info().thin_mapped, 6 << 20);
        assert_eq!(p.info().thin_provisioned, 128 << 20);
        // Two maps of 1 MiB and three chunks in each copy.
        assert_eq!(p.volume("m").unwrap().allocated, 8 << 20);
        assert_eq!(p.info().free, free0 - (8 << 20));
        let r = p.check();
        assert!(r.problems.is_empty() && r.leaked_bytes == 0, "{r:?}");
        assert_eq!(r.maps, 2);
    }
    let mut p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(p.info().free, free0 - (8 << 20));
    assert_eq!(p.volume("m").unwrap().size, 64 << 20);
    for (key, _) in copies(&p, "m") {
        assert_eq!(placements(&p, "m", key).len(), 3);
        assert_pattern(&p, key);
    }
    let r = p.check();
    assert!(r.problems.is_empty() && r.leaked_bytes == 0, "{r:?}");
    // Not built for mirrored thin volumes yet: refused, saying so.
    for e in [
        p.snapshot_volume("m", "s").unwrap_err(),
        p.remove_leg("m", None).unwrap_err(),
        p.add_leg("m").unwrap_err(),
        p.inflate_volume("m").unwrap_err(),
    ] {
        assert!(
            e.to_string().contains("thin") || e.to_string().contains("copies"),
            "{e}"
        );
    }
    // Growing grows every copy; what is written past the old end is in each.
    let e = p.resize_volume("m", 64 << 30).unwrap_err().to_string();
    assert!(e.contains("can grow up to"), "{e}");
    p.resize_volume("m", 128 << 20).unwrap();
    let l = p.layout("m").unwrap();
    assert_eq!(l.size, 128 << 20);
    let mut data = vec![0x5au8; 8192];
    assert_eq!(io(&l.devices[0], true, (128 << 20) - 8192, &mut data), 0);
    drop(l);
    for (key, _) in copies(&p, "m") {
        assert_eq!(read_copy(&p, "m", key, (128 << 20) - 8192, 8192), data);
    }
    let m = p.mirror("m").unwrap().unwrap();
    let v = m.verify().unwrap();
    assert_eq!((v.regions, v.regions_differing), (128, 0), "{v:?}");
    assert!(m.stop_copying());
    drop(m);
    p.delete_volume("m").unwrap();
    assert_eq!(p.info().free, free0);
    drop(p);
    let p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(p.info().free, free0);
}

#[test]
fn a_pool_with_too_few_devices_says_so() {
    let d = tempfile::tempdir().unwrap();
    let mut p = Pool::open(&[spec(d.path(), "a", 40)], opts()).unwrap();
    let e = p
        .create_thin_copies("m", 64 << 20, false, 1, 2, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs 2 devices"), "{e}");
    assert!(p.table.volumes.is_empty());
}

#[test]
fn replacing_a_device_makes_its_copy_anew_and_the_mirror_rebuilds_it() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 40), spec(d.path(), "b", 40)];
    let o = PoolOptions {
        mirror_dir: Some(d.path().to_path_buf()),
        ..opts()
    };
    let mut p = Pool::open(&specs, o.clone()).unwrap();
    p.create_thin_copies("m", 64 << 20, false, 1, 2, false)
        .unwrap();
    write_pattern(&p);
    let before = copies(&p, "m");
    let (old_key, old) = (before[1].0, before[1].1[0]);
    let rep = p
        .replace_device(&old.to_string(), &spec(d.path(), "c", 40), true)
        .unwrap();
    let r = &rep;
    assert_eq!(r.volumes, vec!["m".to_string()]);
    let after = copies(&p, "m");
    assert_eq!(after[0], before[0], "the other copy is untouched");
    assert_ne!(after[1].0, old_key, "a new map");
    assert_eq!(after[1].1, vec![r.new.uuid]);
    let v = p.volume("m").unwrap();
    assert!(v.legs[0].synced && !v.legs[1].synced, "{:?}", v.legs);
    // The new copy starts empty; reads through the mirror still find every write.
    assert!(placements(&p, "m", after[1].0).is_empty());
    let l = p.layout("m").unwrap();
    for (i, at) in AT.into_iter().enumerate() {
        let mut buf = vec![0u8; 8192];
        assert_eq!(io(&l.devices[0], false, at, &mut buf), 0);
        assert_eq!(buf, vec![i as u8 + 1; 8192]);
    }
    // The rebuild copies the data, and the holes as holes.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !p.volume("m").unwrap().legs[1].synced {
        assert!(Instant::now() < deadline, "the copy was not rebuilt");
        std::thread::sleep(Duration::from_millis(50));
        p.settle_mirrors().unwrap();
    }
    assert_pattern(&p, after[1].0);
    assert_eq!(placements(&p, "m", after[1].0).len(), 3);
    let m = p.mirror("m").unwrap().unwrap().verify().unwrap();
    assert_eq!((m.regions_differing, m.regions_skipped), (0, 0), "{m:?}");
    // The old map is held until no queue uses it; then it and its chunks go back.
    let ticket = p.retired_ticket(v.uuid).expect("the old map is held");
    drop(l);
    p.release_retired(v.uuid, ticket);
    let r = p.check();
    assert!(r.problems.is_empty() && r.leaked_bytes == 0, "{r:?}");
    let kept = (p.table.devices.iter())
        .find(|d| d.uuid != rep.new.uuid)
        .unwrap();
    let kept = std::path::PathBuf::from(&kept.last_path);
    // The mirror's copying thread holds the devices until it has stopped.
    assert!(p.mirror("m").unwrap().unwrap().stop_copying());
    drop(p);
    let name = kept.file_name().unwrap().to_str().unwrap();
    let specs = [spec(d.path(), name, 40), spec(d.path(), "c", 40)];
    let p = Pool::open(&specs, o).unwrap();
    for (key, _) in copies(&p, "m") {
        assert_pattern(&p, key);
    }
    let r = p.check();
    assert!(r.problems.is_empty() && r.leaked_bytes == 0, "{r:?}");
}

fn copy(t: &mut metadata::PoolTable, i: usize) -> &mut metadata::LegMap {
    t.volumes[0].legs[i].thin.as_mut().unwrap()
}

#[test]
fn tables_that_misdescribe_the_copies_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 40), spec(d.path(), "b", 40)];
    let mut p = Pool::open(&specs, opts()).unwrap();
    p.create_thin_copies("m", 64 << 20, false, 1, 2, false)
        .unwrap();
    p.create_volume("v", 4 << 20, false, 1).unwrap();
    let good = p.table.clone();
    assert_eq!(good.validate(), Ok(()));
    let refused = |f: &dyn Fn(&mut metadata::PoolTable), why: &str| {
        let mut bad = good.clone();
        f(&mut bad);
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains(why), "{why}: {e}");
    };
    refused(
        &|t| {
            let d = copy(t, 0).devices[0];
            copy(t, 1).devices.push(d);
        },
        "named twice",
    );
    refused(
        &|t| {
            let e = copy(t, 0).map[0];
            copy(t, 1).map = vec![e];
        },
        "not one of its own",
    );
    refused(&|t| copy(t, 1).devices.clear(), "names 0 devices");
    refused(
        &|t| copy(t, 1).devices = vec![Uuid::from_u128(7)],
        "unknown device",
    );
    refused(&|t| copy(t, 1).uuid = Uuid::nil(), "not its own");
    refused(&|t| copy(t, 1).uuid = t.volumes[0].uuid, "used twice");
    refused(&|t| copy(t, 1).uuid = t.volumes[1].uuid, "UUID");
    refused(&|t| t.volumes[0].size = 1 << 50, "map holds");
    refused(
        &|t| {
            let e = copy(t, 0).map.clone();
            t.volumes[0].thin.as_mut().unwrap().map = e;
        },
        "one standing for its own map while they are added",
    );
    // Copies being added: a leg standing for the own map, and no snapshots.
    refused(
        &|t| {
            let e = copy(t, 0).map.clone();
            t.volumes[0].thin.as_mut().unwrap().map = e;
            t.volumes[0]
                .legs
                .push(metadata::LegEntry::local(2, true, Vec::new()));
            t.volumes[0]
                .thin
                .as_mut()
                .unwrap()
                .snapshots
                .push(metadata::ThinSnapshot {
                    name: "s".into(),
                    uuid: Uuid::new_v4(),
                    size: 1 << 20,
                    created: 0,
                    map: Vec::new(),
                });
        },
        "no snapshots",
    );
    refused(
        &|t| t.volumes[0].thin.as_mut().unwrap().origin = Some("a@b".into()),
        "no origin once its copies are added",
    );
    refused(
        &|t| t.volumes[0].legs[1].thin = None,
        "each with a map of its own",
    );
    refused(
        &|t| {
            let mut leg = t.volumes[0].legs[1].clone();
            leg.thin.as_mut().unwrap().uuid = Uuid::new_v4();
            t.volumes[1].make_mirrored();
            t.volumes[1].copies = 2;
            t.volumes[1]
                .legs
                .push(metadata::LegEntry { slot: 1, ..leg });
        },
        "not thin",
    );
}

/// Waits until every copy of "m" is synced in the table, and the copies added to it are
/// finished (its own map given up).
fn rebuilt_and_finished(p: &mut Pool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        p.settle_mirrors().unwrap();
        if !p.finish_thin_copies().unwrap().is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "the copies were not rebuilt");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn copies_added_to_a_thin_volume_and_to_a_clone_take_over_from_its_own_map() {
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
    let mut p = Pool::open(&specs, o.clone()).unwrap();
    let free0 = p.info().free;
    // A clone of a snapshot, written since: its chunks are partly the snapshot's.
    p.create_thin_volume("src", 64 << 20, false, 1, false)
        .unwrap();
    let l = p.layout("src").unwrap();
    let mut old = vec![9u8; 8192];
    assert_eq!(io(&l.devices[0], true, 30 << 20, &mut old), 0);
    drop(l);
    p.snapshot_volume("src", "s").unwrap();
    p.clone_snapshot("src", "s", "m").unwrap();
    write_pattern(&p);
    let e = p.add_leg("src").unwrap_err().to_string();
    assert!(e.contains("snapshots"), "{e}");
    let v = p.add_leg("m").unwrap();
    assert_eq!((v.copies, v.legs.len()), (2, 3), "{:?}", v.legs);
    assert!(v.legs[0].synced && !v.legs[1].synced && !v.legs[2].synced);
    let e = p.add_leg("m").unwrap_err().to_string();
    assert!(e.contains("copies already"), "{e}");
    // Served meanwhile from the clone's own map.
    let l = p.layout("m").unwrap();
    let mut buf = vec![0u8; 8192];
    assert_eq!(io(&l.devices[0], false, 30 << 20, &mut buf), 0);
    assert_eq!(buf, old, "the origin's data, through the clone");
    rebuilt_and_finished(&mut p);
    let v = p.volume("m").unwrap();
    assert_eq!(v.legs.len(), 2, "{:?}", v.legs);
    assert!(v.legs.iter().all(|l| l.synced));
    let m = &p.table.volumes[p.find("m").unwrap()];
    let t = m.thin.as_ref().unwrap();
    assert!(t.map.is_empty() && t.origin.is_none(), "{t:?}");
    assert_eq!(p.table.format_version(), 10);
    let c = copies(&p, "m");
    assert!(c[0].1.iter().all(|d| !c[1].1.contains(d)), "{c:?}");
    for (key, own) in &c {
        assert_pattern(&p, *key);
        assert_eq!(read_copy(&p, "m", *key, 30 << 20, 8192), old);
        let chunks = placements(&p, "m", *key);
        assert!(
            chunks.iter().all(|ch| own.contains(&ch.device)),
            "{chunks:?}"
        );
        assert_eq!(
            chunks.len(),
            4,
            "the written chunks and the origin's, each once"
        );
    }
    // The own map goes once unused (its names counted till then); the snapshot keeps its.
    let r = p.check();
    assert!(r.problems.is_empty(), "while the own map is retired: {r:?}");
    let ticket = p.retired_ticket(m.uuid).expect("the own map is held");
    drop(l);
    let uuid = m.uuid;
    assert!(p.mirror("m").unwrap().unwrap().stop_copying());
    p.release_retired(uuid, ticket);
    let r = p.check();
    assert!(r.problems.is_empty() && r.leaked_bytes == 0, "{r:?}");
    let snap = p.snapshot_image("src", "s", None).unwrap();
    drop(snap);
    drop(p);
    let mut p = Pool::open(&specs, o).unwrap();
    for (key, _) in copies(&p, "m") {
        assert_pattern(&p, key);
    }
    let r = p.check();
    assert!(r.problems.is_empty() && r.leaked_bytes == 0, "{r:?}");
    p.delete_volume("m").unwrap();
    p.delete_volume("src").unwrap();
    assert_eq!(p.info().free, free0);
}

/// A copy's device pulled while spoold was down: the pool opens, the volume is served from
/// the other copy, the rest of the pool allocates as before (only that copy's devices are
/// kept out), and a replace makes the copy anew.
#[test]
fn a_copy_whose_device_is_gone_at_open_costs_only_that_copy() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 40), spec(d.path(), "b", 40)];
    let o = PoolOptions {
        mirror_dir: Some(d.path().to_path_buf()),
        ..opts()
    };
    let gone = {
        let mut p = Pool::open(&specs, o.clone()).unwrap();
        p.create_thin_copies("m", 64 << 20, false, 1, 2, false)
            .unwrap();
        write_pattern(&p);
        assert!(p.mirror("m").unwrap().unwrap().stop_copying());
        copies(&p, "m")[1].1[0]
    };
    let gone_path = (d.path().join("a"), d.path().join("b"));
    let p = Pool::open(&specs, o.clone()).unwrap();
    let name = |u: Uuid| {
        let e = p.table.devices.iter().find(|x| x.uuid == u).unwrap();
        std::path::PathBuf::from(&e.last_path)
    };
    let (pulled, kept) = match name(gone) == gone_path.0 {
        true => (gone_path.0, gone_path.1),
        false => (gone_path.1, gone_path.0),
    };
    drop(p);
    std::fs::remove_file(&pulled).unwrap();
    let specs = [
        DeviceSpec {
            path: kept.clone(),
            create_size: None,
            null: None,
        },
        DeviceSpec {
            path: pulled,
            create_size: None,
            null: None,
        },
    ];
    let mut p = Pool::open(&specs, o).unwrap();
    let v = p.volume("m").unwrap();
    assert!(v.online, "{v:?}");
    assert!(v.thin.unwrap().error.unwrap().contains("missing"));
    let l = p.layout("m").unwrap();
    for (i, at) in AT.into_iter().enumerate() {
        let mut buf = vec![0u8; 8192];
        assert_eq!(io(&l.devices[0], false, at, &mut buf), 0);
        assert_eq!(buf, vec![i as u8 + 1; 8192]);
    }
    // Not frozen: a thin volume takes chunks, a thick one extents, on the kept device.
    p.create_thin_volume("t", 8 << 20, false, 1, false).unwrap();
    p.create_volume("v", 4 << 20, false, 1).unwrap();
    let lt = p.layout("t").unwrap();
    let mut data = vec![5u8; 4096];
    assert_eq!(io(&lt.devices[0], true, 0, &mut data), 0);
    drop((l, lt));
    let rep = p
        .replace_device(&gone.to_string(), &spec(d.path(), "c", 40), true)
        .unwrap();
    assert!(rep.volumes.contains(&"m".to_string()), "{rep:?}");
    // The new layout (the daemon publishes it) opens the mirror that rebuilds the copy.
    drop(p.layout("m").unwrap());
    rebuilt(&mut p);
    for (key, _) in copies(&p, "m") {
        assert_pattern(&p, key);
    }
    assert!(p.mirror("m").unwrap().unwrap().stop_copying());
}

/// Waits until every copy of "m" is synced in the table.
fn rebuilt(p: &mut Pool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !p.volume("m").unwrap().legs.iter().all(|l| l.synced) {
        assert!(Instant::now() < deadline, "the copy was not rebuilt");
        std::thread::sleep(Duration::from_millis(50));
        p.settle_mirrors().unwrap();
    }
}

/// A device replaced while copies are being added to a thin volume: the copies are given up
/// (their maps retired), and the volume is a thin volume without copies again that lost
/// only its chunks on the replaced device; it can be given copies again.
#[test]
fn a_replace_while_copies_are_added_gives_them_up() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 40), spec(d.path(), "b", 40)];
    let o = PoolOptions {
        mirror_dir: Some(d.path().to_path_buf()),
        ..opts()
    };
    let mut p = Pool::open(&specs, o).unwrap();
    p.create_thin_volume("m", 64 << 20, false, 1, false)
        .unwrap();
    write_pattern(&p);
    let v = p.add_leg("m").unwrap();
    assert_eq!(v.legs.len(), 3);
    let added: Vec<Uuid> = copies(&p, "m").iter().map(|c| c.0).collect();
    let m = &p.table.volumes[p.find("m").unwrap()];
    let uuid = m.uuid;
    let on = |dev: Uuid| {
        placements(&p, "m", uuid)
            .iter()
            .filter(|c| c.device == dev)
            .count()
    };
    let old = copies(&p, "m")[1].1[0];
    let (lost, kept) = (on(old), placements(&p, "m", uuid).len() - on(old));
    let rep = p
        .replace_device(&old.to_string(), &spec(d.path(), "c", 40), true)
        .unwrap();
    assert_eq!(rep.volumes, vec!["m".to_string()]);
    let v = p.volume("m").unwrap();
    assert!(v.legs.is_empty() && v.copies == 1, "{v:?}");
    assert_eq!(
        placements(&p, "m", uuid).len(),
        kept,
        "only the chunks on it are lost"
    );
    assert!(lost + kept == 3);
    // The copies' maps are held until no queue uses them, then given back.
    let ticket = p.retired_ticket(uuid).expect("the copies are held");
    if let Some(m) = p.mirror("m").ok().flatten() {
        assert!(m.stop_copying());
    }
    p.release_retired(uuid, ticket);
    for key in added {
        assert!(p.map_device(&p.table.volumes[0].clone(), key).is_err());
    }
    let r = p.check();
    assert!(r.problems.is_empty() && r.leaked_bytes == 0, "{r:?}");
    // And copies can be added again.
    assert_eq!(p.add_leg("m").unwrap().legs.len(), 3);
    drop(p.layout("m").unwrap());
    rebuilt_and_finished(&mut p);
    assert!(p.mirror("m").unwrap().unwrap().stop_copying());
}

/// A copy whose map reads clean but one of whose devices is gone at open: not served, its
/// chunks on its other device kept taken meanwhile, and given back (pool check clean) once
/// a replace made it anew and no queue uses the old map.
#[test]
fn an_unserved_copys_chunks_go_back_when_it_is_made_anew() {
    let d = tempfile::tempdir().unwrap();
    let names = ["a", "b", "c"];
    let specs: Vec<DeviceSpec> = names.iter().map(|n| spec(d.path(), n, 40)).collect();
    let o = PoolOptions {
        mirror_dir: Some(d.path().to_path_buf()),
        ..opts()
    };
    let (pulled, uuid) = {
        let mut p = Pool::open(&specs, o.clone()).unwrap();
        p.create_thin_copies("m", 64 << 20, false, 1, 2, false)
            .unwrap();
        write_pattern(&p);
        assert!(p.mirror("m").unwrap().unwrap().stop_copying());
        let v = &p.table.volumes[0];
        let (_, two) = v.leg_maps().find(|(_, m)| m.devices.len() == 2).unwrap();
        let pulled = *two
            .devices
            .iter()
            .find(|d| **d != two.map[0].device)
            .unwrap();
        let e = p.table.devices.iter().find(|x| x.uuid == pulled).unwrap();
        (std::path::PathBuf::from(&e.last_path), v.uuid)
    };
    std::fs::remove_file(&pulled).unwrap();
    let specs: Vec<DeviceSpec> = (specs.iter())
        .map(|s| DeviceSpec {
            create_size: None,
            ..s.clone()
        })
        .collect();
    let mut p = Pool::open(&specs, o).unwrap();
    assert!(p.volume("m").unwrap().online);
    let gone = (p.info().devices.iter()).find(|x| !x.present).unwrap().uuid;
    drop(p.layout("m").unwrap());
    p.replace_device(&gone.to_string(), &spec(d.path(), "d", 40), true)
        .unwrap();
    drop(p.layout("m").unwrap());
    rebuilt(&mut p);
    for (key, _) in copies(&p, "m") {
        assert_pattern(&p, key);
    }
    let ticket = p.retired_ticket(uuid).expect("the old map is held");
    assert!(p.mirror("m").unwrap().unwrap().stop_copying());
    p.release_retired(uuid, ticket);
    let r = p.check();
    assert!(r.problems.is_empty() && r.leaked_bytes == 0, "{r:?}");
}
