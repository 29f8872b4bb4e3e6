//! Snapshots over a real file device: the data of their moment kept through copies on
//! write, their maps across a reopen, their chunks going back when they are dropped, and a
//! crash at each step of a copy or a snapshot.

use super::*;
use crate::map::Placement;
use crate::SnapshotSpec;

/// A snapshot's map store: a zeroed file of its own.
pub(super) fn snap_spec(f: &Fixture, name: &str) -> SnapshotSpec {
    let dev = device(&f._dir.path().join(name), CHUNKS_AT);
    SnapshotSpec {
        uuid: Uuid::new_v4(),
        size: 4 * CHUNK,
        store: MapStore::new(vec![MapExtent {
            device: dev,
            offset: 0,
            len: CHUNKS_AT,
        }])
        .unwrap(),
    }
}

/// What chunk `p` holds on the device, at `within` (4 KiB).
fn on_device(f: &Fixture, p: Placement, within: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    f.dev.read_at(&mut b, p.offset + within).unwrap();
    b
}

fn fill(q: &mut dyn DeviceQueue, offset: u64, byte: u8) {
    let mut b = vec![byte; 4096];
    assert_eq!(rw(q, true, offset, &mut b), 0);
}

fn read(q: &mut dyn DeviceQueue, offset: u64) -> Vec<u8> {
    let mut b = vec![0xeeu8; 4096];
    assert_eq!(rw(q, false, offset, &mut b), 0);
    b
}

#[test]
fn a_snapshot_keeps_its_moment_and_writes_after_it_copy_first() {
    let f = fixture(8);
    let (thin, _) = f.open(4 * CHUNK);
    let t = ThinBackend::of(&thin).unwrap();
    let mut q = thin.open_queue(8).unwrap();
    fill(&mut *q, 0, 1);
    fill(&mut *q, 4096, 2);
    fill(&mut *q, CHUNK, 3);
    let s = snap_spec(&f, "s1.map");
    assert_eq!(t.snapshot(&s).unwrap(), 2);
    assert_eq!(t.shared_chunks(), 2);
    let named = t.snapshot_entries(s.uuid).unwrap();
    assert_eq!(named.len(), 2);
    // A write after it goes to a copy: the volume reads the new data and the rest of the
    // chunk as it was; the snapshot's chunk is untouched.
    fill(&mut *q, 0, 9);
    assert_eq!(read(&mut *q, 0), vec![9; 4096]);
    assert_eq!(read(&mut *q, 4096), vec![2; 4096]);
    assert_eq!((t.allocated(), f.free()), (2 * CHUNK, 5));
    assert_eq!(t.shared_chunks(), 1);
    let first = named.iter().find(|e| e.0 == 0).unwrap().1;
    assert_eq!(on_device(&f, first, 0), vec![1; 4096]);
    // Zeroes over part of a shared chunk copy it too; a discard of part of one is dropped.
    let zero = DeviceIo::WriteZeroes {
        offset: CHUNK,
        len: 4096,
    };
    assert_eq!(run(&mut *q, zero), 0);
    assert_eq!(read(&mut *q, CHUNK), vec![0; 4096]);
    let second = named.iter().find(|e| e.0 == 1).unwrap().1;
    assert_eq!(on_device(&f, second, 0), vec![3; 4096]);
    assert_eq!((t.shared_chunks(), f.free()), (0, 4));
    // A discard of a whole chunk the snapshot names leaves it to the snapshot.
    let discard = DeviceIo::Discard {
        offset: 0,
        len: CHUNK,
    };
    assert_eq!(run(&mut *q, discard), 0);
    f.wait_free(5);
    // The snapshot's map says what it held, across a reopen too.
    drop(q);
    drop(thin);
    let mut sp = spec(f.volume, &f.dev, 4 * CHUNK);
    sp.snapshots.push(s.clone());
    *f.source.free.lock().unwrap() = Vec::new();
    let (thin, loaded) = f.open_spec(sp);
    assert_eq!(
        loaded.len(),
        3,
        "the volume's one chunk and the snapshot's two"
    );
    let t = ThinBackend::of(&thin).unwrap();
    let mut again = t.snapshot_entries(s.uuid).unwrap();
    again.sort_by_key(|e| e.0);
    assert_eq!(again, named);
    // Dropping it gives back what nothing else names: both of its chunks.
    assert!(t.drop_snapshot(s.uuid));
    assert!(!t.drop_snapshot(s.uuid));
    assert_eq!(f.free(), 2);
}

#[test]
fn a_chunk_of_a_snapshot_taken_again_after_a_reopen_is_still_copied() {
    let f = fixture(8);
    let s = snap_spec(&f, "s.map");
    {
        let (thin, _) = f.open(4 * CHUNK);
        let mut q = thin.open_queue(8).unwrap();
        fill(&mut *q, 0, 1);
        ThinBackend::of(&thin).unwrap().snapshot(&s).unwrap();
    }
    // As the pool does at open: every map counted, the chunks they name marked taken.
    let resolve = {
        let (d, u) = (f.dev.clone(), f.source.uuid);
        move |x: Uuid| (x == u).then(|| d.clone())
    };
    let mut sp = spec(f.volume, &f.dev, 4 * CHUNK);
    sp.snapshots.push(s.clone());
    let scan = ThinBackend::scan(&sp, &resolve);
    let mut named = std::collections::HashMap::new();
    for (_, p) in &scan.placements {
        *named.entry(*p).or_insert(0) += 1;
    }
    assert_eq!(named.len(), 1);
    f.source.refs.rebuild(&named);
    f.source
        .free
        .lock()
        .unwrap()
        .retain(|o| !named.keys().any(|p| p.offset == *o));
    let (thin, _) = f.open_spec(sp);
    let t = ThinBackend::of(&thin).unwrap();
    assert_eq!(t.shared_chunks(), 1);
    let mut q = thin.open_queue(8).unwrap();
    fill(&mut *q, 4096, 7);
    assert_eq!(read(&mut *q, 0), vec![1; 4096]);
    let old = *named.keys().next().unwrap();
    assert_eq!(
        on_device(&f, old, 4096),
        vec![0; 4096],
        "the snapshot's chunk"
    );
    assert_eq!(t.shared_chunks(), 0);
}

/// The allocator dies after marking a snapshot, or after copying a shared chunk: after the
/// restart (the maps as on disk) the volume reads every acknowledged write, and the chunks
/// the maps name are exactly the ones taken.
#[test]
fn a_crash_in_a_snapshot_or_a_copy_loses_nothing_acknowledged() {
    use crate::shared::CrashPoint::{Copied, Marked};
    for point in [Marked, Copied] {
        let f = fixture(4);
        let s = snap_spec(&f, "s.map");
        {
            let (thin, _) = f.open(4 * CHUNK);
            let t = ThinBackend::of(&thin).unwrap();
            let mut q = thin.open_queue(8).unwrap();
            fill(&mut *q, 0, 0x42);
            if point == Copied {
                t.snapshot(&s).unwrap();
            }
            t.arm_crash(point);
            if point == Marked {
                assert!(t.snapshot(&s).is_err(), "the allocator died in it");
                drop(q);
                drop(thin);
                let (thin, placements) = after_crash(&f, 4);
                let mut q = thin.open_queue(8).unwrap();
                assert_eq!(read(&mut *q, 0), vec![0x42; 4096]);
                assert_eq!(placements.len(), 1);
                continue;
            }
            let mut data = vec![9u8; 4096];
            let iov = [IoVec {
                iov_base: data.as_mut_ptr().cast(),
                iov_len: data.len(),
            }];
            // SAFETY: `data` and `iov` outlive the queue, dropped below.
            unsafe { q.submit(DeviceIo::data(true, 0, 4096, iov.as_ptr(), 1), 5) };
            q.kick().unwrap();
            std::thread::sleep(Duration::from_millis(100));
            let mut got = Vec::new();
            q.reap(&mut |tag, res| got.push((tag, res)));
            assert_eq!(got, vec![], "the write cut short was acknowledged");
        }
        // The snapshot was never recorded (Marked) or was (Copied): open as the pool would.
        let (thin, placements) = after_crash(&f, 4);
        let mut q = thin.open_queue(8).unwrap();
        assert_eq!(read(&mut *q, 0), vec![0x42; 4096], "{point:?}");
        assert_eq!(
            placements.len(),
            1,
            "{point:?}: the copy never made it into the map"
        );
    }
}

/// A write to a shared chunk waits for space to copy it; meanwhile the chunk is zeroed
/// whole (unmapped). The copy, once space comes, must not come back over the zeroes, and
/// the snapshot's chunk must stay its own (given back neither early nor twice).
#[test]
fn a_chunk_unmapped_while_its_copy_waits_for_space_stays_unmapped() {
    let f = fixture(3);
    let (thin, _) = f.open(4 * CHUNK);
    let t = ThinBackend::of(&thin).unwrap();
    let mut q = thin.open_queue(8).unwrap();
    fill(&mut *q, 0, 1);
    fill(&mut *q, 4096, 1);
    fill(&mut *q, CHUNK, 1);
    let s = snap_spec(&f, "s.map");
    t.snapshot(&s).unwrap();
    fill(&mut *q, 2 * CHUNK, 2);
    assert_eq!(f.free(), 0, "the pool is full");
    let mut data = vec![9u8; 4096];
    let iov = [IoVec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    }];
    // SAFETY: `data` and `iov` outlive the request, waited for below.
    unsafe { q.submit(DeviceIo::data(true, 0, 4096, iov.as_ptr(), 1), 1) };
    q.kick().unwrap();
    std::thread::sleep(Duration::from_millis(30));
    let mut done = Vec::new();
    let wait_for = |q: &mut dyn DeviceQueue, tag: u64, done: &mut Vec<(u64, i32)>| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !done.iter().any(|d| d.0 == tag) {
            assert!(
                std::time::Instant::now() < deadline,
                "request {tag} never completed"
            );
            q.reap(&mut |t, r| done.push((t, r)));
            std::thread::yield_now();
        }
    };
    let zero = DeviceIo::WriteZeroes {
        offset: 0,
        len: CHUNK,
    };
    // SAFETY: no buffers.
    unsafe { q.submit(zero, 2) };
    q.kick().unwrap();
    wait_for(&mut *q, 2, &mut done);
    // Space comes back: chunk 2 is discarded whole.
    let discard = DeviceIo::Discard {
        offset: 2 * CHUNK,
        len: CHUNK,
    };
    // SAFETY: no buffers.
    unsafe { q.submit(discard, 3) };
    q.kick().unwrap();
    wait_for(&mut *q, 3, &mut done);
    wait_for(&mut *q, 1, &mut done);
    assert!(done.iter().all(|d| d.1 == 0), "{done:?}");
    // Whichever of the write and the zeroes came last, nothing of the snapshot's data is
    // in the volume's chunk 0 outside the written block.
    assert!(
        read(&mut *q, 4096) == vec![0; 4096],
        "the copy came back over the zeroes"
    );
    let named = t.snapshot_entries(s.uuid).unwrap();
    let first = named.iter().find(|e| e.0 == 0).unwrap().1;
    assert!(
        on_device(&f, first, 4096) == vec![1; 4096],
        "the snapshot's chunk changed"
    );
    assert!(
        !f.source.free.lock().unwrap().contains(&first.offset),
        "the snapshot's chunk went back to the pool"
    );
}

/// An inflate lists the shared chunks, then asks for copies: a chunk unmapped in between
/// (a discard from the guest) stays a hole and takes no space, where a write's request
/// would allocate it.
#[test]
fn an_inflate_leaves_a_chunk_unmapped_meanwhile_a_hole() {
    let f = fixture(8);
    let (thin, _) = f.open(4 * CHUNK);
    let t = ThinBackend::of(&thin).unwrap();
    let mut q = thin.open_queue(8).unwrap();
    fill(&mut *q, 0, 1);
    fill(&mut *q, CHUNK, 2);
    t.snapshot(&snap_spec(&f, "s.map")).unwrap();
    let free = f.free();
    // Chunk 0 still shared, chunk 3 a hole by the time the copies are asked for.
    t.copy_shared(&[0, 3]).unwrap();
    assert_eq!(f.free(), free - 1, "one copy, of chunk 0 only");
    assert_eq!(t.allocated(), 2 * CHUNK);
    assert_eq!(read(&mut *q, 3 * CHUNK), vec![0; 4096]);
    assert_eq!(read(&mut *q, 0), vec![1; 4096]);
    assert_eq!(t.shared_chunks(), 1, "chunk 1 is still the snapshot's too");
}

/// Clearing entries of a map (a replaced device's chunks) touches only their slots: the
/// others, even one that does not decode (a damaged snapshot map), stay as they were.
#[test]
fn clearing_entries_leaves_every_other_slot_alone() {
    let f = fixture(8);
    let s = snap_spec(&f, "s.map");
    let p = |o: u64| Placement {
        device: f.source.uuid,
        offset: CHUNKS_AT + o * CHUNK,
    };
    crate::map::write_image(&s.store, s.uuid, &[(0, p(0)), (1, p(1)), (2, p(2))]).unwrap();
    let mut block = vec![0u8; 4096];
    s.store.read_block(0, &mut block).unwrap();
    block[3 * 32..4 * 32].fill(0xab); // entry 3: not an entry
    s.store.write_block(0, &block).unwrap();
    crate::map::clear_entries(&s.store, &[1]).unwrap();
    let mut after = vec![0u8; 4096];
    s.store.read_block(0, &mut after).unwrap();
    assert!(after[32..64].iter().all(|&b| b == 0), "entry 1 is a hole");
    assert_eq!(after[..32], block[..32], "entry 0 kept");
    assert_eq!(
        after[64..4096],
        block[64..4096],
        "entries 2 and 3 kept as they were"
    );
}
