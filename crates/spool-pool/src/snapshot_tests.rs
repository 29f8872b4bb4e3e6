//! Snapshots and clones in the pool, on real files: a clone reads its snapshot's moment,
//! writes to the origin or the clone copy, everything survives a reopen (the sharing counts
//! rebuilt from the maps), deleting gives back exactly what nothing else names.

use super::tests::{opts, spec};
use super::*;
use spool_devices::{Device, DeviceIo, IoVec};

/// Reads or writes `data` at `offset` of `dev` through one of its queues, and waits.
pub(crate) fn io(dev: &Device, write: bool, offset: u64, data: &mut [u8]) -> i32 {
    let mut q = dev.open_queue(4).unwrap();
    let iov = [IoVec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    }];
    // SAFETY: `data` and `iov` outlive the request, which is waited for below.
    unsafe {
        q.submit(
            DeviceIo::data(write, offset, data.len() as u64, iov.as_ptr(), 1),
            1,
        )
    };
    reap_one(&mut *q)
}

/// Kicks `q` and waits for its one request's result.
pub(crate) fn reap_one(q: &mut dyn spool_devices::DeviceQueue) -> i32 {
    q.kick().unwrap();
    loop {
        let mut got = None;
        q.reap(&mut |_, r| got = Some(r));
        if let Some(r) = got {
            return r;
        }
        std::thread::yield_now();
    }
}

fn put(p: &Pool, vol: &str, offset: u64, byte: u8) {
    let l = p.layout(vol).unwrap();
    assert_eq!(io(&l.devices[0], true, offset, &mut vec![byte; 4096]), 0);
}

fn get(p: &Pool, vol: &str, offset: u64) -> u8 {
    let l = p.layout(vol).unwrap();
    let mut b = vec![0xeeu8; 4096];
    assert_eq!(io(&l.devices[0], false, offset, &mut b), 0);
    assert!(b.iter().all(|&x| x == b[0]), "a mixed block");
    b[0]
}

#[test]
fn a_clone_reads_its_snapshots_moment_and_deletes_give_back_what_nobody_names() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 9)];
    let free0;
    {
        let mut p = Pool::open(&specs, opts()).unwrap();
        free0 = p.info().free;
        p.create_thin_volume("t", 64 << 20, false, 1, false)
            .unwrap();
        put(&p, "t", 0, 1);
        put(&p, "t", 3 << 20, 3);
        let s = p.snapshot_volume("t", "s1").unwrap();
        assert_eq!((s.mapped, s.exclusive), (2 << 20, 0));
        let err = p.snapshot_volume("t", "s1").unwrap_err().to_string();
        assert!(err.contains("already"), "{err}");
        put(&p, "t", 0, 9);
        let c = p.clone_snapshot("t", "s1", "c").unwrap();
        assert_eq!(c.size, 64 << 20);
        assert_eq!((get(&p, "c", 0), get(&p, "c", 3 << 20)), (1, 3));
        assert_eq!((get(&p, "t", 0), get(&p, "t", 3 << 20)), (9, 3));
        put(&p, "c", 3 << 20, 5);
        assert_eq!((get(&p, "c", 3 << 20), get(&p, "t", 3 << 20)), (5, 3));
        // Maps: t, s1, c (1 MiB each); chunks: 1 and 3 (shared), t's copy of 0, c's of 3.
        assert_eq!(p.info().free, free0 - (7 << 20));
        super::check_tests::assert_clean(&p);
    }
    let mut p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(
        p.info().free,
        free0 - (7 << 20),
        "nothing leaked or taken twice"
    );
    assert_eq!((get(&p, "c", 0), get(&p, "c", 3 << 20)), (1, 5));
    assert_eq!((get(&p, "t", 0), get(&p, "t", 3 << 20)), (9, 3));
    let snaps = p.snapshots("t").unwrap();
    assert_eq!(snaps.len(), 1);
    assert_eq!((snaps[0].name.as_str(), snaps[0].mapped), ("s1", 2 << 20));
    assert_eq!(
        snaps[0].exclusive, 0,
        "chunk 0 is the clone's too, chunk 3 t's"
    );
    // After the reopen the sharing is known again: writes still copy.
    put(&p, "t", (3 << 20) + 4096, 6);
    assert_eq!(get(&p, "c", (3 << 20) + 4096), 0);
    assert_eq!(get(&p, "t", 3 << 20), 3);
    let err = p.snapshots("nope").unwrap_err().to_string();
    assert!(err.contains("no volume"), "{err}");
    // Deleting the origin keeps what the clone still names.
    p.delete_volume("t").unwrap();
    assert_eq!((get(&p, "c", 0), get(&p, "c", 3 << 20)), (1, 5));
    p.delete_volume("c").unwrap();
    assert_eq!(p.info().free, free0);
    super::check_tests::assert_clean(&p);
    drop(p);
    let p = Pool::open(&specs, opts()).unwrap();
    assert_eq!(p.info().free, free0);
}

#[test]
fn deleting_a_snapshot_gives_back_its_own_chunks_and_bad_names_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 9)];
    let mut p = Pool::open(&specs, opts()).unwrap();
    let free0 = p.info().free;
    p.create_volume("thick", 4 << 20, false, 1).unwrap();
    let err = p.snapshot_volume("thick", "s").unwrap_err().to_string();
    assert!(err.contains("not thin"), "{err}");
    p.create_thin_volume("t", 16 << 20, false, 1, false)
        .unwrap();
    let err = p.snapshot_volume("t", "a/b").unwrap_err().to_string();
    assert!(err.contains("must be"), "{err}");
    put(&p, "t", 0, 1);
    p.snapshot_volume("t", "s").unwrap();
    put(&p, "t", 0, 2);
    // The chunk copied from is let go by the volume after its grace period (milliseconds).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while p.snapshots("t").unwrap()[0].exclusive == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let used = free0 - p.info().free;
    let s = p.delete_snapshot("t", "s").unwrap();
    assert_eq!(s.exclusive, 1 << 20);
    assert_eq!(
        used - (free0 - p.info().free),
        2 << 20,
        "its chunk and its map"
    );
    assert_eq!(get(&p, "t", 0), 2);
    // Revert: the volume holds the snapshot's data again; inflate: it shares nothing.
    p.delete_volume("thick").unwrap();
    p.snapshot_volume("t", "s2").unwrap();
    put(&p, "t", 0, 3);
    put(&p, "t", 5 << 20, 4);
    assert_eq!(p.revert_volume("t", "s2").unwrap(), 2);
    assert_eq!((get(&p, "t", 0), get(&p, "t", 5 << 20)), (2, 0));
    let c = p.clone_snapshot("t", "s2", "c").unwrap();
    assert!(c.thin.is_some());
    assert_eq!(p.inflate_volume("c").unwrap(), 1);
    assert_eq!(get(&p, "c", 0), 2);
    put(&p, "t", 0, 5);
    assert_eq!(get(&p, "c", 0), 2);
    p.delete_snapshot("t", "s2").unwrap();
    p.delete_volume("c").unwrap();
    let err = p.delete_snapshot("t", "s").unwrap_err().to_string();
    assert!(err.contains("no snapshot"), "{err}");
    assert!(p.clone_snapshot("t", "s", "c").is_err());
}

/// The states a crash leaves between the durable steps of a snapshot, a clone and a delete
/// (the process dies: nothing after the step is done, memory is lost). At the next open the
/// table and the maps agree: no snapshot or clone half there, no chunk leaked or taken
/// twice, and every acknowledged write where it was.
#[test]
fn a_crash_between_the_steps_of_a_snapshot_a_clone_or_a_delete_leaks_nothing() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 17)];
    let (free0, free_with_s);
    {
        let mut p = Pool::open(&specs, opts()).unwrap();
        free0 = p.info().free;
        p.create_thin_volume("t", 8 << 20, false, 1, false).unwrap();
        put(&p, "t", 0, 1);
        put(&p, "t", 2 << 20, 2);
        p.snapshot_volume("t", "s").unwrap();
        put(&p, "t", 0, 3);
        free_with_s = p.info().free;
        // Snapshot "x": its map written (the chunks marked and drained), the table not.
        let v = p.table.volumes[p.find("t").unwrap()].clone();
        let map = p.new_map(8 << 20).unwrap();
        let spec = spool_thin::SnapshotSpec {
            uuid: uuid::Uuid::new_v4(),
            size: 8 << 20,
            store: p.map_store(&v, &map).unwrap(),
        };
        let dev = p.thin_device(&v).unwrap();
        spool_thin::ThinBackend::of(&dev)
            .unwrap()
            .snapshot(&spec)
            .unwrap();
        // Clone "c" of "s": its map written under its UUID, the table not.
        let map = p.new_map(8 << 20).unwrap();
        let entries = spool_thin::ThinBackend::of(&dev)
            .unwrap()
            .snapshot_entries(v.thin.as_ref().unwrap().snapshots[0].uuid)
            .unwrap();
        let store = p.map_store(&v, &map).unwrap();
        spool_thin::map::write_image(&store, uuid::Uuid::new_v4(), &entries).unwrap();
    }
    {
        let mut p = Pool::open(&specs, opts()).unwrap();
        super::check_tests::assert_clean(&p);
        assert_eq!(
            p.info().free,
            free_with_s,
            "what the crash left is free again"
        );
        assert_eq!(p.snapshots("t").unwrap().len(), 1);
        assert!(p.volume("c").is_err());
        assert_eq!((get(&p, "t", 0), get(&p, "t", 2 << 20)), (3, 2));
        // Delete of "s": the table without it committed, nothing given back yet.
        let mut table = p.table.clone();
        let i = p.find("t").unwrap();
        table.volumes[i].thin.as_mut().unwrap().snapshots.clear();
        p.commit(table).unwrap();
    }
    let p = Pool::open(&specs, opts()).unwrap();
    super::check_tests::assert_clean(&p);
    assert!(p.snapshots("t").unwrap().is_empty());
    // t's map and its two chunks; the snapshot's map and its own chunk went back.
    assert_eq!(p.info().free, free0 - (3 << 20));
    assert_eq!((get(&p, "t", 0), get(&p, "t", 2 << 20)), (3, 2));
}

/// A snapshot whose map rotted on the device costs only that snapshot: the volume, and its
/// other snapshots, are served; the damaged one is listed with why, refused for clones,
/// reverts and diffs, and can be deleted (after which the pool checks clean).
#[test]
fn a_corrupt_snapshot_map_costs_only_that_snapshot() {
    use std::os::unix::fs::FileExt;
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 17)];
    {
        let mut p = Pool::open(&specs, opts()).unwrap();
        p.create_thin_volume("t", 8 << 20, false, 1, false).unwrap();
        put(&p, "t", 0, 1);
        put(&p, "t", 1 << 20, 2);
        p.snapshot_volume("t", "s").unwrap();
        put(&p, "t", 0, 3);
        p.snapshot_volume("t", "s2").unwrap();
        // Entry 1 of s's map (the chunk t and s2 share with it): one bit flipped.
        let v = &p.table.volumes[p.find("t").unwrap()];
        let e = &v.thin.as_ref().unwrap().snapshots[0].map[0];
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(d.path().join("a"))
            .unwrap();
        let mut entry = [0u8; 32];
        f.read_exact_at(&mut entry, e.offset + 32).unwrap();
        entry[29] ^= 1;
        f.write_all_at(&entry, e.offset + 32).unwrap();
    }
    let mut p = Pool::open(&specs, opts()).unwrap();
    assert_eq!((get(&p, "t", 0), get(&p, "t", 1 << 20)), (3, 2));
    put(&p, "t", 2 << 20, 4);
    let snaps = p.snapshots("t").unwrap();
    let why = snaps[0].error.clone().expect("s is damaged");
    assert_eq!(snaps[0].mapped, 1 << 20, "what still decodes");
    assert!(why.contains("entry 1: checksum mismatch"), "{why}");
    assert_eq!(snaps[1].error, None);
    for err in [
        p.clone_snapshot("t", "s", "c").unwrap_err(),
        p.revert_volume("t", "s").unwrap_err(),
        p.diff("t", "s", None).unwrap_err(),
    ] {
        let err = err.to_string();
        assert!(
            err.contains("'t@s' cannot be used") && err.contains("only be deleted"),
            "{err}"
        );
    }
    let r = p.check();
    assert_eq!(r.problems.len(), 1, "{:#?}", r.problems);
    assert!(r.problems[0].contains("snapshot 't@s'"), "{:?}", r.problems);
    p.delete_snapshot("t", "s").unwrap();
    super::check_tests::assert_clean(&p);
    // s2 still holds its moment; a clone of it reads it.
    p.clone_snapshot("t", "s2", "c").unwrap();
    assert_eq!((get(&p, "c", 0), get(&p, "c", 1 << 20)), (3, 2));
    assert_eq!(get(&p, "c", 2 << 20), 0);
    drop(p);
    let p = Pool::open(&specs, opts()).unwrap();
    super::check_tests::assert_clean(&p);
    assert_eq!(p.snapshots("t").unwrap().len(), 1);
}

/// A snapshot of an encrypted volume is exported as the guest reads it: decrypted with the
/// volume's key and its sector as the tweak, at any offset and length (whole sectors are
/// read around them); holes read as zeroes.
#[test]
fn a_snapshot_of_an_encrypted_volume_reads_decrypted() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 17)];
    let opts = PoolOptions {
        kek: Some(std::sync::Arc::new(spool_crypt::Kek::generate().unwrap())),
        ..opts()
    };
    let mut p = Pool::open(&specs, opts).unwrap();
    p.create_thin_volume("t", 8 << 20, false, 1, true).unwrap();
    let v = p.table.volumes[p.find("t").unwrap()].clone();
    let cipher = p.volume_cipher(&v).unwrap().unwrap();
    let plain: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
    let at = (1u64 << 20) + 4096;
    // What the frontend's encrypting queue writes below the thin map.
    let mut sealed = plain.clone();
    cipher.encrypt(&mut sealed, at / 512);
    let l = p.layout("t").unwrap();
    assert_eq!(io(&l.devices[0], true, at, &mut sealed), 0);
    p.snapshot_volume("t", "s").unwrap();
    let img = p.snapshot_image("t", "s", None).unwrap();
    let mut whole = vec![0u8; plain.len()];
    img.read_at(&mut whole, at).unwrap();
    assert!(whole == plain, "the whole range decrypts");
    let mut part = vec![0u8; 1000];
    img.read_at(&mut part, at + 777).unwrap();
    assert!(part == plain[777..1777], "a range in the middle of sectors");
    let mut hole = vec![1u8; 600];
    img.read_at(&mut hole, (5 << 20) + 100).unwrap();
    assert!(hole.iter().all(|&b| b == 0), "a hole reads zeroes");
    assert!(sealed != plain, "the device holds ciphertext");
}

/// Devices a, b and c of 17 MiB, and thin volume t of `mib` MiB whose first 12 chunks
/// hold 1, 2, ... 12.
pub(crate) fn thin_pool_of_three(dir: &std::path::Path, mib: u64) -> Pool {
    let specs: Vec<DeviceSpec> = ["a", "b", "c"].map(|n| spec(dir, n, 17)).to_vec();
    let mut p = Pool::open(&specs, opts()).unwrap();
    p.create_thin_volume("t", mib << 20, false, 1, false)
        .unwrap();
    for i in 0..12u64 {
        put(&p, "t", i << 20, i as u8 + 1);
    }
    p
}

/// The pool of a, b, c and the replacement n, opened without the replaced device's file
/// `gone`.
fn reopen_without(dir: &std::path::Path, gone: &str) -> Pool {
    let kept: Vec<DeviceSpec> = (["a", "b", "c", "n"].iter())
        .filter(|n| **n != gone)
        .map(|n| spec(dir, n, 17))
        .collect();
    Pool::open(&kept, opts()).unwrap()
}

/// A device replaced under a thin volume: the chunks on it are lost, as a thick volume's
/// extents are (their entries read zeroes, in the volume and in its snapshot and clone), the
/// rest is kept, and the pool checks clean before and after a reopen.
#[test]
fn replacing_a_device_under_a_thin_volume_loses_only_its_chunks() {
    let d = tempfile::tempdir().unwrap();
    let mut p = thin_pool_of_three(d.path(), 12);
    p.snapshot_volume("t", "s").unwrap();
    let v = p.table.volumes[p.find("t").unwrap()].clone();
    let dev = p.thin_device(&v).unwrap();
    let live = spool_thin::ThinBackend::of(&dev).unwrap().live_entries();
    let with_map: Vec<uuid::Uuid> = v.all_extents().map(|e| e.device).collect();
    // Two maps on three devices: one device holds chunks and no map.
    let victim = p
        .members
        .iter()
        .map(|m| m.uuid)
        .find(|u| !with_map.contains(u) && live.iter().any(|e| e.1.device == *u))
        .expect("a device with chunks and no map");
    let lost: Vec<u64> = live
        .iter()
        .filter(|e| e.1.device == victim)
        .map(|e| e.0)
        .collect();
    assert!(!lost.is_empty() && lost.len() < 12, "{lost:?}");
    let gone_file = (p.members.iter().find(|m| m.uuid == victim))
        .and_then(|m| m.dev.path().file_name())
        .and_then(|f| f.to_str())
        .unwrap()
        .to_string();
    let gone_file = gone_file.as_str();
    let r = p
        .replace_device(&victim.to_string(), &spec(d.path(), "n", 17), true)
        .unwrap();
    assert_eq!(r.volumes, vec!["t".to_string()]);
    p.clone_snapshot("t", "s", "c").unwrap();
    let expect = |i: u64| if lost.contains(&i) { 0 } else { i as u8 + 1 };
    for i in 0..12u64 {
        assert_eq!(get(&p, "t", i << 20), expect(i), "t, chunk {i}");
        assert_eq!(get(&p, "c", i << 20), expect(i), "c, chunk {i}");
    }
    super::check_tests::assert_clean(&p);
    // A lost chunk takes a new one on its next write.
    put(&p, "t", lost[0] << 20, 0x77);
    assert_eq!(get(&p, "t", lost[0] << 20), 0x77);
    assert_eq!(get(&p, "c", lost[0] << 20), 0);
    drop((dev, p));
    let p = reopen_without(d.path(), gone_file);
    super::check_tests::assert_clean(&p);
    for i in (0..12u64).filter(|i| *i != lost[0]) {
        assert_eq!(
            get(&p, "t", i << 20),
            expect(i),
            "t after a reopen, chunk {i}"
        );
        assert_eq!(
            get(&p, "c", i << 20),
            expect(i),
            "c after a reopen, chunk {i}"
        );
    }
}

/// A device holding a running thin volume's own map is replaced: the map is written
/// elsewhere from memory (the old one is not read: it is damaged here first), the chunks on
/// the device are lost and the rest kept, and the pool reopens without the device and
/// checks clean.
#[test]
fn replacing_the_device_holding_a_thin_volumes_map_moves_the_map() {
    let d = tempfile::tempdir().unwrap();
    // One chunk more than is written before the move: a hole written after it.
    let mut p = thin_pool_of_three(d.path(), 13);
    let v = p.table.volumes[p.find("t").unwrap()].clone();
    let map = v.thin.as_ref().unwrap().map.clone();
    let old = map[0].device;
    let dev = p.thin_device(&v).unwrap();
    let live = spool_thin::ThinBackend::of(&dev).unwrap().live_entries();
    let lost: Vec<u64> = (live.iter().filter(|e| e.1.device == old))
        .map(|e| e.0)
        .collect();
    assert!(lost.len() < 12, "{lost:?}");
    // The old map is garbage from now on: only memory holds it.
    let member = p.members.iter().find(|m| m.uuid == old).unwrap();
    let old_file = member.dev.path().to_path_buf();
    junk(&p, &old_file, &map);
    let r = p
        .replace_device(&old.to_string(), &spec(d.path(), "n", 17), true)
        .unwrap();
    assert!(r.volumes.contains(&"t".to_string()), "{:?}", r.volumes);
    assert!(
        !p.space
            .members
            .read()
            .unwrap()
            .iter()
            .any(|m| m.uuid == old),
        "thin allocators may use the replaced device again"
    );
    let moved = &p.table.volumes[p.find("t").unwrap()]
        .thin
        .as_ref()
        .unwrap()
        .map;
    assert!(moved.iter().all(|e| e.device != old), "{moved:?}");
    let expect = |i: u64| if lost.contains(&i) { 0 } else { i as u8 + 1 };
    for i in 0..12u64 {
        assert_eq!(get(&p, "t", i << 20), expect(i), "chunk {i}");
    }
    super::check_tests::assert_clean(&p);
    // Writes after the move land in the new map: a lost chunk written again, and the
    // hole, survive a reopen.
    if let Some(&c) = lost.first() {
        put(&p, "t", c << 20, 0x77);
    }
    put(&p, "t", 12 << 20, 0x99);
    drop((dev, p));
    let p = reopen_without(d.path(), old_file.file_name().unwrap().to_str().unwrap());
    super::check_tests::assert_clean(&p);
    for i in 0..12u64 {
        let want = match lost.first() {
            Some(&c) if c == i => 0x77,
            _ => expect(i),
        };
        assert_eq!(get(&p, "t", i << 20), want, "chunk {i} after a reopen");
    }
    assert_eq!(
        get(&p, "t", 12 << 20),
        0x99,
        "the chunk allocated after the move"
    );
}

/// Junk over `extents` of the device file `file` (a map only memory holds from now on).
fn junk(p: &Pool, file: &std::path::Path, extents: &[crate::metadata::ExtentEntry]) {
    let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    for e in extents {
        let junk = vec![0x5au8; (p.table.min_extent << e.order) as usize];
        std::os::unix::fs::FileExt::write_all_at(&f, &junk, e.offset).unwrap();
    }
}

/// The device holding a snapshot's map is replaced: the snapshot's map is written elsewhere
/// from memory (the old one junk), and a clone of the snapshot made after, and after a
/// reopen without the device, reads the snapshot's data less the chunks that were on it.
#[test]
fn replacing_the_device_holding_a_snapshots_map_moves_the_map() {
    let d = tempfile::tempdir().unwrap();
    let mut p = thin_pool_of_three(d.path(), 12);
    p.snapshot_volume("t", "s").unwrap();
    for i in 0..12u64 {
        put(&p, "t", i << 20, 0xee);
    }
    let v = p.table.volumes[p.find("t").unwrap()].clone();
    let thin = v.thin.as_ref().unwrap();
    let old = thin.snapshots[0].map[0].device;
    let dev = p.thin_device(&v).unwrap();
    let snap = spool_thin::ThinBackend::of(&dev)
        .unwrap()
        .snapshot_entries(thin.snapshots[0].uuid);
    let lost: Vec<u64> = (snap.unwrap().iter().filter(|e| e.1.device == old))
        .map(|e| e.0)
        .collect();
    let file = p
        .members
        .iter()
        .find(|m| m.uuid == old)
        .unwrap()
        .dev
        .path()
        .to_path_buf();
    junk(&p, &file, &thin.snapshots[0].map);
    p.replace_device(&old.to_string(), &spec(d.path(), "n", 17), true)
        .unwrap();
    let moved = &p.table.volumes[p.find("t").unwrap()]
        .thin
        .as_ref()
        .unwrap()
        .snapshots[0]
        .map;
    assert!(moved.iter().all(|e| e.device != old), "{moved:?}");
    p.clone_snapshot("t", "s", "c").unwrap();
    let expect = |i: u64| if lost.contains(&i) { 0 } else { i as u8 + 1 };
    for i in 0..12u64 {
        assert_eq!(get(&p, "c", i << 20), expect(i), "clone, chunk {i}");
    }
    super::check_tests::assert_clean(&p);
    drop((dev, p));
    let mut p = reopen_without(d.path(), file.file_name().unwrap().to_str().unwrap());
    super::check_tests::assert_clean(&p);
    // The moved map itself, read at open: a clone made from it now reads the same.
    p.clone_snapshot("t", "s", "c2").unwrap();
    for i in 0..12u64 {
        assert_eq!(
            get(&p, "c", i << 20),
            expect(i),
            "clone after a reopen, chunk {i}"
        );
        assert_eq!(
            get(&p, "c2", i << 20),
            expect(i),
            "a clone of the moved map, chunk {i}"
        );
    }
}

/// A thin map's move commits the table, and a commit refreshes the space thin allocators
/// take chunks from: the device being replaced must stay out of it until the replace ends.
#[test]
fn a_device_being_replaced_stays_out_of_the_thin_space_through_a_map_move() {
    let d = tempfile::tempdir().unwrap();
    let specs = [spec(d.path(), "a", 17), spec(d.path(), "b", 17)];
    let mut p = Pool::open(&specs, opts()).unwrap();
    p.create_thin_volume("t", 4 << 20, false, 1, false).unwrap();
    let v = p.table.volumes[p.find("t").unwrap()].clone();
    let old = v.thin.as_ref().unwrap().map[0].device;
    let in_space = |p: &Pool| {
        p.space
            .members
            .read()
            .unwrap()
            .iter()
            .any(|m| m.uuid == old)
    };
    assert!(p.space.exclude(old));
    assert_eq!(p.move_thin_maps_off(old).unwrap(), vec!["t".to_string()]);
    assert!(
        !in_space(&p),
        "the map's commit gave the device back to the allocators"
    );
    p.space.end_exclusion();
    p.refresh_space();
    assert!(in_space(&p));
}
