//! Thin volumes in the pool, on real files: chunks taken through the volume's device queue
//! are found again (and marked taken) after a reopen, deleting gives everything back, and
//! tables that misdescribe a thin volume are refused.

use super::tests::{opts, spec};
use super::*;

fn write(dev: &spool_devices::Device, offset: u64, data: &mut [u8]) -> i32 {
    super::snapshot_tests::io(dev, true, offset, data)
}

#[test]
fn chunks_are_the_volumes_across_a_reopen_and_come_back_at_delete() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 9), spec(d.path(), "b", 9)];
    let free0;
    {
        let mut p = Pool::open(&specs, opts()).unwrap();
        free0 = p.info().free;
        let v = p.create_thin_volume("t", 1 << 30, false, 1, false).unwrap();
        let t = v.thin.unwrap();
        assert_eq!((t.chunk, t.mapped, t.map_bytes), (1 << 20, 0, 1 << 20));
        assert_eq!(p.info().thin_provisioned, 1 << 30);
        let l = p.layout("t").unwrap();
        assert_eq!((l.size, l.discard_alignment), (1 << 30, 1 << 20));
        let mut data = vec![7u8; 4096];
        for at in [0, 5 << 20, 900 << 20] {
            assert_eq!(write(&l.devices[0], at, &mut data), 0);
        }
        assert_eq!(p.volume("t").unwrap().thin.unwrap().mapped, 3 << 20);
        assert_eq!(p.info().free, free0 - (4 << 20));
        // A thick volume allocated now must not land on the thin volume's chunks.
        p.create_volume("v", 6 << 20, false, 1).unwrap();
    }
    let mut p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(p.volume("t").unwrap().thin.unwrap().mapped, 3 << 20);
    assert_eq!(p.info().free, free0 - (10 << 20));
    // Growing: within what the map holds (a 1 MiB map extent: 32768 chunks of 1 MiB), the
    // new chunks holes, no space taken; and it survives a reopen.
    let max = p.volume("t").unwrap().thin.unwrap().max_size;
    assert_eq!(max, 32 << 30);
    let e = p
        .resize_volume("t", max + (1 << 20))
        .unwrap_err()
        .to_string();
    assert!(e.contains("can grow up to"), "{e}");
    p.resize_volume("t", 20 << 30).unwrap();
    assert_eq!(p.info().free, free0 - (10 << 20));
    let l = p.layout("t").unwrap();
    assert_eq!((l.size, l.devices[0].size()), (20 << 30, 20 << 30));
    let mut data = vec![8u8; 4096];
    assert_eq!(write(&l.devices[0], (20 << 30) - 4096, &mut data), 0);
    drop((p, l));
    let mut p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(p.volume("t").unwrap().size, 20 << 30);
    assert_eq!(p.volume("t").unwrap().thin.unwrap().mapped, 4 << 20);
    p.delete_volume("t").unwrap();
    assert_eq!(p.info().free, free0 - (6 << 20));
    drop(p);
    let p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(p.info().free, free0 - (6 << 20));
}

#[test]
fn tables_that_misdescribe_a_thin_volume_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 9)];
    let mut p = Pool::open(&specs, opts()).unwrap();
    p.create_thin_volume("t", 64 << 30, false, 1, false)
        .unwrap();
    let good = p.table.clone();
    assert_eq!(good.format_version(), 6);
    assert_eq!(good.validate(), Ok(()));
    let mut bad = good.clone();
    bad.volumes[0].thin.as_mut().unwrap().chunk = 4096;
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("chunk size"));
    let mut bad = good.clone();
    bad.volumes[0].size = 1 << 50;
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("map holds"));
    let mut bad = good.clone();
    bad.volumes[0].rbd = Some(metadata::RbdImage {
        pool: "rbd".into(),
        image: "i".into(),
        created: true,
    });
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("RBD image"));
    let mut bad = good.clone();
    bad.volumes[0].extents = bad.volumes[0].thin.as_ref().unwrap().map.clone();
    assert!(bad.validate().is_err());
}

/// While it is sent a thin volume has two legs without extents: a synced local one standing
/// for its map, and the remote one (format version 9); no other legs, copies or extents.
#[test]
fn a_thin_volume_being_sent_has_exactly_its_maps_leg_and_the_remote_one() {
    let d = tempfile::tempdir().unwrap();
    let mut p = Pool::open(&[spec(d.path(), "a", 9)], opts()).unwrap();
    p.create_thin_volume("t", 64 << 20, false, 1, false)
        .unwrap();
    let mut sent = p.table.clone();
    let v = &mut sent.volumes[0];
    v.make_mirrored();
    v.legs.push(metadata::LegEntry {
        slot: 1,
        synced: false,
        extents: Vec::new(),
        remote: Some(metadata::RemoteLeg {
            uri: "nbd://host:10809/t".into(),
            id: uuid::Uuid::new_v4(),
        }),
        thin: None,
    });
    v.copies = 2;
    assert_eq!(sent.validate(), Ok(()));
    assert_eq!(sent.format_version(), 9);
    let map = sent.volumes[0].thin.as_ref().unwrap().map.clone();
    type Break = Box<dyn Fn(&mut metadata::VolumeEntry)>;
    let cases: Vec<(Break, &str)> = vec![
        (Box::new(|v| v.copies = 3), "legs only while it is sent"),
        (
            Box::new(|v| v.legs[1].remote = None),
            "legs only while it is sent",
        ),
        (
            Box::new(|v| v.legs.truncate(1)),
            "legs only while it is sent",
        ),
        (
            Box::new(move |v| v.legs[0].extents = map.clone()),
            "legs only while it is sent",
        ),
        (
            Box::new(|v| v.legs[0].synced = false),
            "no synced leg on this pool",
        ),
        (Box::new(|v| v.legs[1].slot = 0), "repeated"),
    ];
    for (i, (f, needle)) in cases.iter().enumerate() {
        let mut bad = sent.clone();
        f(&mut bad.volumes[0]);
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains(needle), "case {i}: {e}");
    }
}

#[test]
fn a_refused_map_keeps_the_chunks_it_still_names() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 9)];
    let free0;
    {
        let mut p = Pool::open(&specs, opts()).unwrap();
        free0 = p.info().free;
        p.create_thin_volume("t", 1 << 30, false, 1, false).unwrap();
        let l = p.layout("t").unwrap();
        let mut data = vec![7u8; 4096];
        for at in [0, 5 << 20] {
            assert_eq!(write(&l.devices[0], at, &mut data), 0);
        }
        assert_eq!(p.info().free, free0 - (3 << 20));
    }
    // Entry 0 is the first entry written: flip a bit of it.
    let path = d.path().join("a");
    let mut img = std::fs::read(&path).unwrap();
    let at = img.windows(4).position(|w| w == b"SPTC").unwrap();
    img[at + 20] ^= 1;
    std::fs::write(&path, img).unwrap();
    let mut p = Pool::open(&specs, opts()).unwrap();
    let e = p.layout("t").unwrap_err().to_string();
    assert!(e.contains("entry 0: checksum"), "{e}");
    assert!(p.volume("t").unwrap().thin.unwrap().error.is_some());
    // Entry 5's chunk is still taken; entry 0's is unknown and free (as are the map's
    // other bytes): other volumes get the rest.
    assert_eq!(p.info().free, free0 - (2 << 20));
    let r = p.check();
    assert_eq!(r.problems.len(), 1, "{:#?}", r.problems);
    assert!(r.problems[0].contains("volume 't': a map is corrupt: entry 0: checksum"));
    // Which chunks of a volume not served lie on a device is unknown: no replace under it.
    let dev = p.members[0].uuid.to_string();
    let e = p
        .replace_device(&dev, &spec(d.path(), "n", 9), true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("'t' is not served"), "{e}");
    p.create_volume("v", 4 << 20, false, 1).unwrap();
}

/// With chunks larger than the metadata area (the default 4 MiB against 1 MiB), a chunk's
/// offset is the data area's start plus a multiple of the chunk, not a multiple of it: the
/// map is found again after a reopen, and its snapshots and clones with it.
#[test]
fn chunks_larger_than_the_metadata_area_are_found_again() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 41)];
    let opts = || PoolOptions {
        min_extent: 4 << 20,
        ..opts()
    };
    {
        let mut p = Pool::open(&specs, opts()).unwrap();
        p.create_thin_volume("t", 64 << 20, false, 1, false)
            .unwrap();
        let l = p.layout("t").unwrap();
        assert_eq!(write(&l.devices[0], 8 << 20, &mut vec![7u8; 4096]), 0);
        p.snapshot_volume("t", "s").unwrap();
        p.clone_snapshot("t", "s", "c").unwrap();
    }
    let p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(super::check_tests::assert_clean(&p).shared_chunks, 1);
    for v in ["t", "c"] {
        let t = p.volume(v).unwrap().thin.unwrap();
        assert_eq!((t.mapped, t.error), (4 << 20, None), "{v}");
    }
    assert_eq!(p.snapshots("t").unwrap()[0].mapped, 4 << 20);
}
