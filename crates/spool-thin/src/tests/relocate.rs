//! Moving a running thin volume's map (`relocate.rs`): the copy is whole, nothing changes
//! the map until the move is decided, and each decision leaves a whole map wherever a table
//! may point.

use std::os::unix::fs::FileExt;
use std::sync::mpsc;
use std::time::Duration;

use super::{device, fixture, rw, spec, CHUNK, CHUNKS_AT};
use crate::map::{self, MapExtent, MapStore, Placement};
use crate::ThinBackend;

/// A new place for the map: a zeroed file of the map's size.
fn place(f: &super::Fixture, name: &str) -> MapStore {
    let dev = device(&f._dir.path().join(name), CHUNKS_AT);
    MapStore::new(vec![MapExtent {
        device: dev,
        offset: 0,
        len: CHUNKS_AT,
    }])
    .unwrap()
}

/// Entry `i` of the volume's map in file `name` (a map at offset 0), as decoded.
fn entry(f: &super::Fixture, name: &str, i: u64) -> Option<Placement> {
    entry_of(f, name, f.volume, i)
}

/// Entry `i` of `owner`'s map in file `name`.
fn entry_of(f: &super::Fixture, name: &str, owner: uuid::Uuid, i: u64) -> Option<Placement> {
    let file = std::fs::File::open(f._dir.path().join(name)).unwrap();
    let mut b = [0u8; 32];
    file.read_exact_at(&mut b, i * 32).unwrap();
    map::decode(owner, i, &b).unwrap()
}

fn fill(byte: u8) -> Vec<u8> {
    vec![byte; 4096]
}

#[test]
fn a_map_moves_whole_and_each_decision_leaves_it_whole_where_a_table_points() {
    let f = fixture(8);
    let (thin, _) = f.open(4 * CHUNK);
    let t = ThinBackend::of(&thin).unwrap();
    let mut q = thin.open_queue(8).unwrap();
    assert_eq!(rw(&mut *q, true, 0, &mut fill(1)), 0);

    // Recorded: the copy is whole, and a write needing a chunk waits for the decision.
    let moving = t.move_map(None, place(&f, "m1.img")).unwrap();
    assert!(entry(&f, "m1.img", 0).is_some() && entry(&f, "m1.img", 1).is_none());
    let (done, waited) = mpsc::channel();
    let writer = {
        let mut q = thin.open_queue(8).unwrap();
        std::thread::spawn(move || {
            let r = rw(&mut *q, true, CHUNK, &mut fill(2));
            done.send(r).unwrap();
        })
    };
    assert!(
        waited.recv_timeout(Duration::from_millis(300)).is_err(),
        "the map changed before the move was decided"
    );
    moving.recorded();
    assert_eq!(waited.recv_timeout(Duration::from_secs(10)).unwrap(), 0);
    writer.join().unwrap();
    assert!(
        entry(&f, "m1.img", 1).is_some(),
        "the new place takes changes"
    );
    assert!(entry(&f, "d.img", 1).is_none(), "the old place takes none");

    // Unsure: every change goes to both places; a third move is refused meanwhile.
    t.move_map(None, place(&f, "m2.img")).unwrap().unsure();
    assert_eq!(rw(&mut *q, true, 2 * CHUNK, &mut fill(3)), 0);
    assert!(entry(&f, "m1.img", 2).is_some() && entry(&f, "m2.img", 2).is_some());
    let e = t
        .move_map(None, place(&f, "m3.img"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("restart spoold"), "{e}");
    drop(q);
    t.shut_down();
    drop(thin);

    // Either place opens to the same volume.
    for name in ["m1.img", "m2.img"] {
        let mut s = spec(f.volume, &f.dev, 4 * CHUNK);
        s.store = place(&f, name);
        let (thin, loaded) = f.open_spec(s);
        assert_eq!(loaded.len(), 3, "{name}");
        let mut q = thin.open_queue(8).unwrap();
        for (i, byte) in [1u8, 2, 3].into_iter().enumerate() {
            let mut back = vec![0u8; 4096];
            assert_eq!(rw(&mut *q, false, i as u64 * CHUNK, &mut back), 0);
            assert!(back == fill(byte), "{name}: chunk {i}");
        }
        drop(q);
        ThinBackend::of(&thin).unwrap().shut_down();
    }
}

/// A move given up (dropped undecided) changes nothing: the old place goes on.
#[test]
fn a_move_given_up_leaves_the_map_where_it_was() {
    let f = fixture(8);
    let (thin, _) = f.open(4 * CHUNK);
    let t = ThinBackend::of(&thin).unwrap();
    let mut q = thin.open_queue(8).unwrap();
    drop(t.move_map(None, place(&f, "m1.img")).unwrap());
    assert_eq!(rw(&mut *q, true, 0, &mut fill(1)), 0);
    assert!(entry(&f, "d.img", 0).is_some());
    assert!(entry(&f, "m1.img", 0).is_none());
    // Too small a place is refused, and changes nothing either.
    let small = MapStore::new(vec![MapExtent {
        device: device(&f._dir.path().join("s.img"), 4096),
        offset: 0,
        len: 4096,
    }])
    .unwrap();
    let e = t.move_map(None, small).unwrap_err().to_string();
    assert!(e.contains("holds 128 entries"), "{e}");
    drop(q);
    t.shut_down();
}

/// A snapshot's map moves from memory too; unsure, nothing writes it until a restart (a
/// device's eviction is refused), and a second move is refused.
#[test]
fn a_snapshots_map_moves_and_an_unsure_move_freezes_it() {
    let f = fixture(8);
    let (thin, _) = f.open(4 * CHUNK);
    let t = ThinBackend::of(&thin).unwrap();
    let mut q = thin.open_queue(8).unwrap();
    assert_eq!(rw(&mut *q, true, 0, &mut fill(1)), 0);
    let s = super::snapshots::snap_spec(&f, "s.map");
    t.snapshot(&s).unwrap();
    t.move_map(Some(s.uuid), place(&f, "s1.img"))
        .unwrap()
        .recorded();
    assert!(entry_of(&f, "s1.img", s.uuid, 0).is_some());
    assert!(entry_of(&f, "s1.img", s.uuid, 1).is_none());
    t.move_map(Some(s.uuid), place(&f, "s2.img"))
        .unwrap()
        .unsure();
    assert!(entry_of(&f, "s2.img", s.uuid, 0).is_some());
    let e = t.move_map(Some(s.uuid), place(&f, "s3.img")).unwrap_err();
    assert!(e.to_string().contains("restart spoold"), "{e}");
    let e = t.evict(f.source.uuid).unwrap_err().to_string();
    assert!(e.contains("where its map lives is unknown"), "{e}");
    let e = t.move_map(Some(uuid::Uuid::new_v4()), place(&f, "s4.img"));
    assert!(e.unwrap_err().to_string().contains("no snapshot"));
    drop(q);
    t.shut_down();
}
