//! `pool check` on real files: a pool after snapshots, clones, copies on write, reverts and
//! deletes is found consistent; each kind of damage (a leak, a chunk free while named, a
//! wrong sharing count, a corrupt or duplicated map entry, overlapping extents) is found
//! and named.

use std::os::unix::fs::FileExt;

use super::snapshot_tests::io;
use super::tests::{opts, spec};
use super::*;
use spool_thin::ThinBackend;

/// Asserts that `pool check` finds nothing wrong, and returns its report.
pub(crate) fn assert_clean(p: &Pool) -> CheckReport {
    let r = p.check();
    assert!(r.problems.is_empty(), "pool check: {:#?}", r.problems);
    assert_eq!(r.leaked_bytes, 0);
    r
}

fn put(p: &Pool, vol: &str, offset: u64, byte: u8) {
    let l = p.layout(vol).unwrap();
    assert_eq!(io(&l.devices[0], true, offset, &mut vec![byte; 4096]), 0);
}

/// A pool with a thick volume, a thin one with data, a snapshot of it, a clone of the
/// snapshot and a copy on write in each: what every damage below starts from.
fn busy_pool(specs: &[DeviceSpec]) -> Pool {
    let mut p = Pool::open(specs, opts()).unwrap();
    p.create_volume("thick", 3 << 20, false, 1).unwrap();
    p.create_thin_volume("t", 16 << 20, false, 1, false)
        .unwrap();
    for i in 0..4 {
        put(&p, "t", i << 20, i as u8 + 1);
    }
    p.snapshot_volume("t", "s").unwrap();
    p.clone_snapshot("t", "s", "c").unwrap();
    put(&p, "t", 0, 9);
    put(&p, "c", 1 << 20, 8);
    p
}

/// The device file and byte offset of entry `i` of volume `vol`'s own map.
fn map_entry(p: &Pool, vol: &str, i: u64) -> (std::fs::File, u64) {
    let v = &p.table.volumes[p.find(vol).unwrap()];
    let e = &v.thin.as_ref().unwrap().map[0];
    let m = p.members.iter().find(|m| m.uuid == e.device).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.dev.path())
        .unwrap();
    (f, e.offset + 32 * i)
}

fn one_problem(p: &Pool, has: &str) -> CheckReport {
    let r = p.check();
    assert_eq!(r.problems.len(), 1, "{:#?}", r.problems);
    assert!(r.problems[0].contains(has), "{:#?}", r.problems);
    r
}

#[test]
fn a_busy_pool_checks_clean_and_survives_a_reopen_clean() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 33), spec(d.path(), "b", 17)];
    {
        let mut p = busy_pool(&specs);
        p.create_volume_copies("m", 2 << 20, false, 1, 2).unwrap();
        let r = assert_clean(&p);
        assert_eq!((r.volumes, r.maps), (4, 3));
        // t: 4 chunks and its copy of 0; c: its copy of 1; the snapshot shares 1..3 with t,
        // 0 and 2..3 with c.
        assert_eq!((r.chunks, r.shared_chunks), (6, 4));
        assert!(r.skipped.is_empty(), "{:?}", r.skipped);
        assert_eq!(r.extent_bytes, (3 + 3 + 2 * 2) << 20);
    }
    let mut p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(assert_clean(&p).chunks, 6);
    p.revert_volume("t", "s").unwrap();
    assert_clean(&p);
    p.inflate_volume("c").unwrap();
    assert_eq!(assert_clean(&p).shared_chunks, 4);
    p.delete_snapshot("t", "s").unwrap();
    assert_eq!(assert_clean(&p).shared_chunks, 0);
    p.delete_volume("t").unwrap();
    let r = assert_clean(&p);
    assert_eq!((r.volumes, r.chunks), (3, 4));
}

#[test]
fn each_kind_of_damage_is_found_and_named() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 33)];
    let mut p = busy_pool(&specs);
    assert_clean(&p);
    let min = p.table.min_extent;

    // A leak: a block taken that nothing names.
    let m = &p.members[0];
    let off = m.alloc(0).unwrap();
    let r = one_problem(&p, "leaked");
    assert!(r.problems[0].contains(&off.to_string()), "{:?}", r.problems);
    assert_eq!(r.leaked_bytes, min);
    // Held until a restart (a thin map move's new extents after a failed commit): named
    // as held, not leaked, and never given back with a removed copy's extents.
    let vol = p.table.volumes[0].uuid;
    let held = crate::metadata::ExtentEntry {
        device: m.uuid,
        offset: off,
        order: 0,
    };
    p.hold_until_restart(vol, vec![held]);
    assert_clean(&p);
    assert_eq!(p.retired_ticket(vol), None);
    assert_eq!(p.release_retired(vol, u64::MAX), 0);
    assert_clean(&p);
    p.retired = Default::default();
    p.members[0].free(off, 0);
    assert_clean(&p);

    // A chunk a map names, free in the allocator.
    let dev = p.thin_device(&p.table.volumes[p.find("c").unwrap()].clone());
    let (_, placement) = ThinBackend::of(&dev.unwrap()).unwrap().live_entries()[0];
    p.members[0].free(placement.offset, 0);
    one_problem(&p, "handed out twice");
    p.members[0].alloc_at(placement.offset, 0).unwrap();
    assert_clean(&p);

    // A sharing count that says more maps name a chunk than do.
    let shared = p
        .space
        .refs
        .named_by(placement)
        .map(|_| placement)
        .unwrap_or_else(|| {
            let t = p.thin_device(&p.table.volumes[p.find("t").unwrap()].clone());
            ThinBackend::of(&t.unwrap()).unwrap().live_entries()[1].1
        });
    assert!(p.space.refs.named_by(shared).is_some());
    p.space.refs.add(shared);
    one_problem(&p, "the sharing count says 3");
    p.space.refs.release(shared);
    assert_clean(&p);

    // A map entry rotted on the device.
    let (f, at) = map_entry(&p, "t", 0);
    let mut entry = [0u8; 32];
    f.read_exact_at(&mut entry, at).unwrap();
    let mut rotten = entry;
    rotten[30] ^= 1;
    f.write_all_at(&rotten, at).unwrap();
    one_problem(
        &p,
        "volume 't': a map is corrupt: entry 0: checksum mismatch",
    );
    f.write_all_at(&entry, at).unwrap();
    assert_clean(&p);

    // The same chunk named at two entries of a map.
    let t = p.table.volumes[p.find("t").unwrap()].clone();
    let dup = spool_thin::map::encode(t.uuid, 9, Some(shared));
    let (f, at) = map_entry(&p, "t", 9);
    f.write_all_at(&dup, at).unwrap();
    let r = p.check();
    assert!(
        r.problems
            .iter()
            .any(|x| x.contains("volume 'c': chunk 0") && x.contains("is also named at entry 9")),
        "{:#?}",
        r.problems
    );
    f.write_all_at(&[0u8; 32], at).unwrap();
    assert_clean(&p);

    // Two volumes' extents overlapping (the table as a bad write could leave it).
    let saved = p.table.clone();
    let thick = p.find("thick").unwrap();
    let mut other = p.table.volumes[thick].clone();
    other.name = "ghost".into();
    other.uuid = uuid::Uuid::new_v4();
    p.table.volumes.push(other);
    let r = p.check();
    assert!(
        r.problems
            .iter()
            .any(|x| x.contains("volume 'ghost'") && x.contains("overlap volume 'thick'")),
        "{:#?}",
        r.problems
    );
    p.table = saved;
    assert_clean(&p);
}
