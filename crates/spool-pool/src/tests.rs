//! Pool tests on real (temporary) files.

use super::*;
use metadata::METADATA_AREA;

pub(crate) fn spec(dir: &Path, name: &str, mib: u64) -> DeviceSpec {
    DeviceSpec {
        path: dir.join(name),
        create_size: Some(mib << 20),
        null: None,
    }
}

pub(crate) fn opts() -> PoolOptions {
    PoolOptions {
        min_extent: 1 << 20,
        ..Default::default()
    }
}

/// [`opts`] with mirrors' bitmaps kept in `dir`.
pub(crate) fn mirror_opts(dir: &std::path::Path) -> PoolOptions {
    PoolOptions {
        mirror_dir: Some(dir.to_path_buf()),
        ..opts()
    }
}

#[test]
fn volumes_survive_reopen_exactly() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 17), spec(d.path(), "b", 9)];
    let (before, pool_uuid) = {
        let mut p = Pool::open(&specs, opts()).unwrap();
        p.create_volume("v1", 5 << 20, false, 2).unwrap();
        p.create_volume("v2", (3 << 20) + 512, true, 1).unwrap();
        p.resize_volume("v1", 12 << 20).unwrap();
        p.create_volume("gone", 1 << 20, false, 1).unwrap();
        p.delete_volume("gone").unwrap();
        (p.volumes(), p.info().uuid)
    };
    // Reopen with the device paths in the other order: devices are found by UUID.
    let specs_rev = [specs[1].clone(), specs[0].clone()];
    let p = Pool::open(&specs_rev, opts()).unwrap();
    assert_eq!(p.info().uuid, pool_uuid);
    let after = p.volumes();
    assert_eq!(
        serde_json::to_value(&before).unwrap(),
        serde_json::to_value(&after).unwrap()
    );
    let l = p.layout("v1").unwrap();
    assert_eq!(l.size, 12 << 20);
    assert!(l.segments.iter().map(|s| s.len).sum::<u64>() >= 12 << 20);
}

#[test]
fn volumes_span_devices_and_never_overlap() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 5), spec(d.path(), "b", 5)];
    let mut p = Pool::open(&specs, opts()).unwrap();
    // Each device has 4 MiB of data area: a 6 MiB volume must span both.
    let v = p.create_volume("big", 6 << 20, false, 1).unwrap();
    assert_eq!(v.devices.len(), 2);
    let w = p.create_volume("small", 2 << 20, false, 1).unwrap();
    assert!(p.create_volume("nospace", 1 << 20, false, 1).is_err());
    let mut ranges = Vec::new();
    for id in ["big", "small"] {
        let l = p.layout(id).unwrap();
        for s in &l.segments {
            ranges.push((
                l.devices[s.device].path().to_path_buf(),
                s.offset,
                s.offset + s.len,
            ));
        }
    }
    for (i, a) in ranges.iter().enumerate() {
        assert!(a.1 >= METADATA_AREA);
        for b in &ranges[i + 1..] {
            assert!(
                a.0 != b.0 || a.2 <= b.1 || b.2 <= a.1,
                "{a:?} overlaps {b:?}"
            );
        }
    }
    assert_eq!(w.allocated, 2 << 20);
    p.delete_volume(&v.uuid.to_string()).unwrap();
    p.delete_volume("small").unwrap();
    assert_eq!(p.info().free, 8 << 20);
}

#[test]
fn map_splits_at_segment_boundaries() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 5), spec(d.path(), "b", 5)];
    let mut p = Pool::open(&specs, opts()).unwrap();
    p.create_volume("v", 6 << 20, false, 1).unwrap();
    let l = p.layout("v").unwrap();
    let mut pieces = Vec::new();
    l.map((4 << 20) - 512, 1024, |dev, off, len, at| {
        pieces.push((dev, off, len, at))
    });
    assert_eq!(pieces.len(), 2);
    assert_eq!(pieces[0].2 + pieces[1].2, 1024);
    assert_eq!(pieces[1].3, 512);
    assert_ne!(pieces[0].0, pieces[1].0);
    // The one-segment shortcut refuses the range that spans two segments ...
    assert_eq!(l.map_one((4 << 20) - 512, 1024), None);
    // ... and agrees with `map` on every range inside one, up to the segment's last byte.
    let size = l.size;
    for (offset, len) in [
        (0, 512),
        ((4 << 20) - 1024, 512),
        ((4 << 20) - 512, 512),
        (4 << 20, 4096),
        (size - 4096, 4096),
    ] {
        let mut one = Vec::new();
        l.map(offset, len, |dev, off, n, _| one.push((dev, off, n)));
        assert_eq!(one.len(), 1, "{offset} {len}");
        assert_eq!(l.map_one(offset, len), Some((one[0].0, one[0].1)));
    }
    assert_eq!(
        l.map_one(l.segments.last().map_or(0, |s| s.logical + s.len), 512),
        None
    );
}

#[test]
fn foreign_corrupt_and_newer_devices_are_refused_without_force() {
    let d = tempfile::tempdir().unwrap();
    {
        Pool::open(&[spec(d.path(), "other", 4)], opts()).unwrap();
    }
    {
        Pool::open(&[spec(d.path(), "mine", 4)], opts()).unwrap();
    }
    let both = [spec(d.path(), "mine", 4), spec(d.path(), "other", 4)];
    // An existing pool runs without the foreign device, says why, and does not touch it.
    {
        let p = Pool::open(&both, opts()).unwrap();
        let info = p.info();
        assert_eq!(info.devices.len(), 1);
        assert_eq!(info.left_out.len(), 1, "{:?}", info.left_out);
        assert!(
            info.left_out[0].reason.contains("--force"),
            "{:?}",
            info.left_out
        );
    }
    // Nothing was overwritten: "other" still opens as its own pool.
    Pool::open(&[spec(d.path(), "other", 4)], opts()).unwrap();
    // Garbage where the metadata should be.
    std::fs::write(d.path().join("junk"), vec![0x42u8; 4 << 20]).unwrap();
    let e = Pool::open(&[spec(d.path(), "junk", 4)], opts())
        .err()
        .unwrap();
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    let junk = std::fs::read(d.path().join("junk")).unwrap();
    assert!(
        junk.iter().all(|&b| b == 0x42),
        "refused device was modified"
    );
    // With force, the device is reformatted and joins.
    let p = Pool::open(
        &both,
        PoolOptions {
            force: true,
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(p.info().devices.len(), 2);
}

#[test]
fn torn_metadata_write_keeps_the_pool() {
    let d = tempfile::tempdir().unwrap();
    let s = [spec(d.path(), "a", 8)];
    let generation = {
        let mut p = Pool::open(&s, opts()).unwrap();
        p.create_volume("v", 1 << 20, false, 1).unwrap();
        p.create_volume("w", 1 << 20, false, 1).unwrap();
        p.info().generation
    };
    // Tear the newest copy: the previous generation (without "w") comes back.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.path().join("a"))
        .unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&[0xee; 100], (generation % 2) * metadata::SLOT_SIZE + 100)
        .unwrap();
    let p = Pool::open(&s, opts()).unwrap();
    let names: Vec<_> = p.volumes().into_iter().map(|v| v.name).collect();
    assert_eq!(names, vec!["v"]);
}

#[test]
fn new_volumes_never_see_old_data() {
    let d = tempfile::tempdir().unwrap();
    let mut p = Pool::open(&[spec(d.path(), "a", 3)], opts()).unwrap();
    p.create_volume("old", 1 << 20, false, 1).unwrap();
    let l = p.layout("old").unwrap();
    let dev = l.devices[0].clone();
    dev.write_at_durable(&[0x77; 4096], l.segments[0].offset)
        .unwrap();
    p.delete_volume("old").unwrap();
    p.create_volume("new", 1 << 20, false, 1).unwrap();
    let l2 = p.layout("new").unwrap();
    assert_eq!(l2.segments[0].offset, l.segments[0].offset, "extent reused");
    let mut b = [1u8; 4096];
    dev.read_at(&mut b, l2.segments[0].offset).unwrap();
    assert!(b.iter().all(|&x| x == 0));
}

#[test]
fn bad_arguments_are_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let mut p = Pool::open(&[spec(d.path(), "a", 4)], opts()).unwrap();
    for (name, size, q) in [
        ("", 512, 1),
        ("a/b", 512, 1),
        ("ok", 0, 1),
        ("ok", 1000, 1),
        ("ok", 512, 0),
        ("ok", 512, 65),
    ] {
        let e = p.create_volume(name, size, false, q).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    p.create_volume("ok", 512, false, 1).unwrap();
    assert!(matches!(
        p.create_volume("ok", 512, false, 1),
        Err(Error::VolumeExists(_))
    ));
    assert!(matches!(
        p.resize_volume("ok", 0),
        Err(Error::InvalidArgument(_))
    ));
    p.resize_volume("ok", 4096).unwrap();
    assert!(p
        .resize_volume("ok", 512)
        .unwrap_err()
        .to_string()
        .contains("shrinking"));
    assert!(matches!(
        p.delete_volume("nope"),
        Err(Error::NoSuchVolume(_))
    ));
    let e = p.create_volume("huge", 1 << 40, false, 1).unwrap_err();
    assert!(matches!(e, Error::NoSpace { .. }), "{e}");
    // A failed allocation leaks nothing.
    assert_eq!(p.info().free, p.info().size - (1 << 20));
}

#[test]
fn a_device_that_cannot_be_opened_takes_only_its_volumes_offline() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 9), spec(d.path(), "b", 9)];
    let (on_a, on_b) = {
        let mut p = Pool::open(&specs, opts()).unwrap();
        let v1 = p.create_volume("v1", 4 << 20, false, 1).unwrap();
        let v2 = p.create_volume("v2", 4 << 20, false, 1).unwrap();
        assert_ne!(v1.devices, v2.devices, "one volume per device");
        (v1, v2)
    };
    // Device b is pulled (no create_size: it cannot come back as a blank file).
    std::fs::remove_file(d.path().join("b")).unwrap();
    let specs = [
        specs[0].clone(),
        DeviceSpec {
            create_size: None,
            ..specs[1].clone()
        },
    ];
    let p = Pool::open(&specs, opts()).expect("the pool opens without the pulled device");
    let b_uuid = p
        .info()
        .devices
        .iter()
        .find(|x| !x.present)
        .map(|x| x.uuid)
        .expect("device b is listed as missing");
    let vols = p.volumes();
    for v in [&on_a, &on_b] {
        let now = vols.iter().find(|x| x.name == v.name).unwrap();
        assert_eq!(now.online, !v.devices.contains(&b_uuid), "{}", v.name);
    }
    // With no device at all the pool refuses to open, saying why.
    std::fs::remove_file(d.path().join("a")).unwrap();
    let only_missing = [DeviceSpec {
        create_size: None,
        ..specs[0].clone()
    }];
    let e = match Pool::open(&only_missing, opts()) {
        Ok(_) => panic!("a pool without any device opened"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("No such file"), "{e}");
}

#[test]
fn devices_added_at_run_time_are_found_again_without_being_configured() {
    let d = tempfile::tempdir().unwrap();
    let configured = [spec(d.path(), "a", 9)];
    {
        let mut p = Pool::open(&configured, opts()).unwrap();
        p.add_device(&spec(d.path(), "added", 9), false).unwrap();
        // Big enough that it must use both devices.
        p.create_volume("v", 12 << 20, false, 1).unwrap();
    }
    let p = Pool::open(&configured, opts()).unwrap();
    let info = p.info();
    assert_eq!(info.devices.len(), 2);
    assert!(info.devices.iter().all(|x| x.present), "{:?}", info.devices);
    assert!(p.volumes()[0].online);
}

#[test]
fn a_device_that_grew_keeps_its_extents_and_the_table_learns_its_size() {
    let d = tempfile::tempdir().unwrap();
    let s = [spec(d.path(), "a", 5)];
    {
        let mut p = Pool::open(&s, opts()).unwrap();
        p.create_volume("v", 4 << 20, false, 1).unwrap();
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(d.path().join("a"))
        .unwrap()
        .set_len(9 << 20)
        .unwrap();
    {
        let mut p = Pool::open(&s, opts()).unwrap();
        assert_eq!(p.info().devices[0].size, 9 << 20);
        // The new space is used, and the table written with it opens again.
        p.create_volume("w", 4 << 20, false, 1).unwrap();
    }
    let p = Pool::open(&s, opts()).unwrap();
    assert_eq!(p.volumes().len(), 2);
    assert_eq!(p.info().free, 0);
}

/// The format version byte of the newest metadata slot on the device at `path`.
pub(crate) fn newest_slot_version(path: &Path) -> u32 {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).unwrap();
    let mut best = (0u64, 0u32);
    for slot in 0..2u64 {
        let mut h = [0u8; 24];
        f.read_exact_at(&mut h, slot * metadata::SLOT_SIZE).unwrap();
        let generation = u64::from_le_bytes(h[16..24].try_into().unwrap());
        if generation >= best.0 {
            best = (generation, u32::from_le_bytes(h[8..12].try_into().unwrap()));
        }
    }
    best.1
}

#[test]
fn qos_limits_persist_and_need_format_version_2_only_while_set() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 17)];
    let limits = QosLimits {
        iops: 2000,
        write_bps: 50 << 20,
        burst_ms: 250,
        ..Default::default()
    };
    {
        let mut p = Pool::open(&specs, opts()).unwrap();
        p.create_volume("v", 4 << 20, false, 1).unwrap();
        assert_eq!(newest_slot_version(&specs[0].path), 1);
        let info = p.set_qos("v", Some(limits)).unwrap();
        assert_eq!(info.qos, Some(limits));
        assert_eq!(p.layout("v").unwrap().qos, Some(limits));
    }
    // An older spoold (format 1 only) must refuse this table rather than drop the limits.
    assert_eq!(newest_slot_version(&specs[0].path), 2);
    let mut p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(p.volume("v").unwrap().qos, Some(limits));
    // All rates 0 is no QoS at all, and the table goes back to format 1.
    let cleared = p.set_qos("v", Some(QosLimits::default())).unwrap();
    assert_eq!(cleared.qos, None);
    assert_eq!(p.layout("v").unwrap().qos, None);
    assert_eq!(newest_slot_version(&specs[0].path), 1);
    let bad = QosLimits {
        burst_ms: 0,
        iops: 1,
        ..Default::default()
    };
    let e = p.set_qos("v", Some(bad)).unwrap_err().to_string();
    assert!(e.contains("burst_ms"), "{e}");
    let e = p.set_qos("nope", Some(limits)).unwrap_err().to_string();
    assert!(e.contains("nope"), "{e}");
}

/// The next write of `dev`'s pool table fails (EIO), reaching nothing.
fn fail_next_table_write(dev: &spool_devices::Device) {
    dev.faults().add(spool_devices::FaultRule {
        effect: spool_devices::FaultEffect::Errno(5),
        ops: spool_devices::FaultOps::MetaWrite,
        offset: 0,
        len: METADATA_AREA,
        count: Some(1),
        duration: None,
        fails_probe: false,
    });
}

/// A table commit that fails on one member after another took it is rolled back: the
/// operation failed, and a restart does not open the table it failed to commit. (It used to
/// leave the first member with the new table: a volume whose create had failed came back
/// at the next start, over extents this process had given back.)
#[test]
fn a_commit_that_fails_part_way_is_rolled_back() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 64), spec(d.path(), "b", 64)];
    {
        let mut p = Pool::open(&specs, opts()).unwrap();
        p.create_volume("kept", 4 << 20, false, 1).unwrap();
        let last = p.members.iter().rfind(|m| !m.isolated()).unwrap();
        fail_next_table_write(&last.dev);
        let e = p.create_volume("lost", 8 << 20, false, 1).unwrap_err();
        assert!(e.to_string().contains("nothing changed"), "{e}");
        assert!(p.layout("lost").is_err());
        // The pool goes on: the next commit lands on both.
        p.create_volume("next", 2 << 20, false, 1).unwrap();
    }
    let p = Pool::open(&specs, opts()).unwrap();
    let names: Vec<String> = p.volumes().into_iter().map(|v| v.name).collect();
    assert_eq!(names, vec!["kept".to_string(), "next".to_string()]);
    // A restart right after the failure opens the table before it too.
    drop(p);
    {
        let mut p = Pool::open(&specs, opts()).unwrap();
        let last = p.members.iter().rfind(|m| !m.isolated()).unwrap();
        fail_next_table_write(&last.dev);
        p.create_volume("lost", 8 << 20, false, 1).unwrap_err();
    }
    let p = Pool::open(&specs, opts()).unwrap();
    assert!(p.layout("lost").is_err(), "a failed create came back");
    assert_eq!(p.volumes().len(), 2);
}

/// A commit whose outcome cannot be known (the only member's write failed: the record may
/// be on it or not) holds what it would have freed until a restart, so that neither table
/// finds its extents in another volume.
#[test]
fn an_unsure_commit_holds_what_it_frees_until_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 64)];
    let mut p = Pool::open(&specs, opts()).unwrap();
    let free = p.info().free;
    fail_next_table_write(&p.members[0].dev);
    let e = p.create_volume("maybe", 8 << 20, false, 1).unwrap_err();
    assert!(e.to_string().contains("may or may not"), "{e}");
    assert_eq!(
        p.info().free,
        free - (8 << 20),
        "its extents were given back"
    );
    // Later commits succeed; what the unsure one named stays out of reach until a restart.
    p.create_volume("b", 4 << 20, false, 1).unwrap();
    assert_eq!(p.info().free, free - (12 << 20));
    drop(p);
    let p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(p.info().free, free - (4 << 20));
    assert!(p.layout("maybe").is_err());
}
