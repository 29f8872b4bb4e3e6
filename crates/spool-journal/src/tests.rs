//! Journal unit tests: layout validation and Algorithm 2's repairs. The exhaustive crash-point
//! test over Algorithms 1 and 2 with a real virtqueue lives in the frontend crate.

use super::*;

fn dir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Steps 2–6 of one take at the journal's next avail index (step 7 is the caller's).
fn take(j: &Journal, head: u16) {
    let at = j.last_avail();
    j.take_begin(head, at);
    j.take_mark_inflight(head, at);
}

#[test]
fn create_then_reopen_keeps_state() {
    let d = dir();
    let v = Uuid::new_v4();
    {
        let (mut j, existed) = Journal::open_or_create(d.path(), v, 0, 8).unwrap();
        assert!(!existed);
        j.new_generation(
            8,
            RingAddrs {
                desc: 1,
                avail: 2,
                used: 3,
            },
            5,
            5,
        )
        .unwrap();
        take(&j, 3);
        j.take_finish();
    }
    let (j, existed) = Journal::open_or_create(d.path(), v, 0, 8).unwrap();
    assert!(existed);
    assert_eq!(
        j.header().rings,
        RingAddrs {
            desc: 1,
            avail: 2,
            used: 3
        }
    );
    assert_eq!(j.last_avail(), 6);
    assert_eq!(j.state(3), ReqState::Inflight);
    assert!(j.has_work());
}

#[test]
fn recovery_finishes_start_and_orders_by_avail() {
    let d = dir();
    let (mut j, _) = Journal::open_or_create(d.path(), Uuid::new_v4(), 0, 8).unwrap();
    j.new_generation(8, RingAddrs::default(), 65534, 65534)
        .unwrap();
    for h in [5u16, 2, 7] {
        take(&j, h);
        j.take_finish();
    }
    // Crash between steps 5 and 6 for head 4 (index wraps past 65535 on the way).
    j.take_begin(4, j.last_avail());
    let r = j.recover(65534, &mut |_| {});
    assert!(r.finished_start);
    assert_eq!(r.last_avail, 65534u16.wrapping_add(4));
    assert_eq!(r.inflight, vec![5, 2, 7, 4]);
}

#[test]
fn a_batch_of_takes_needs_one_finish() {
    // Step 7 once per batch: each take's START replaces the previous one, so a crash
    // anywhere in the batch leaves every taken head INFLIGHT exactly once, and nothing more.
    let d = dir();
    let (mut j, _) = Journal::open_or_create(d.path(), Uuid::new_v4(), 0, 8).unwrap();
    j.new_generation(8, RingAddrs::default(), 10, 10).unwrap();
    for h in [6u16, 0, 3] {
        take(&j, h);
    }
    // Crash before the batch's step 7: the last START is finished without effect.
    let r = j.recover(10, &mut |_| {});
    assert!(r.finished_start);
    assert_eq!((r.last_avail, r.inflight.clone()), (13, vec![6, 0, 3]));
    // Recovery left the journal finished: a second recovery sees the same requests.
    let r = j.recover(10, &mut |_| {});
    assert!(!r.finished_start);
    assert_eq!((r.last_avail, r.inflight), (13, vec![6, 0, 3]));
}

#[test]
fn done_rolls_back_or_forward_by_used_index() {
    let d = dir();
    let (mut j, _) = Journal::open_or_create(d.path(), Uuid::new_v4(), 0, 8).unwrap();
    j.new_generation(8, RingAddrs::default(), 0, 0).unwrap();
    take(&j, 1);
    j.take_finish();
    j.complete_begin();
    j.complete_mark_done(1);
    // The ring did not get the completion (ring used 0, journal 1): resubmit.
    let r = j.recover(0, &mut |_| {});
    assert_eq!((r.rolled_back, r.inflight.clone()), (1, vec![1]));
    assert_eq!(j.used_idx(), 0);
    // This time the ring did (both 1): the head is free.
    j.complete_begin();
    j.complete_mark_done(1);
    let r = j.recover(1, &mut |_| {});
    assert_eq!((r.rolled_forward, r.inflight.len()), (1, 0));
    assert!(!j.has_work());
}

#[test]
fn foreign_corrupt_and_newer_journals_are_refused_by_name() {
    let d = dir();
    let v = Uuid::new_v4();
    drop(Journal::open_or_create(d.path(), v, 1, 16).unwrap());
    let p = journal_path(d.path(), v, 1);
    let good = std::fs::read(&p).unwrap();
    let check = |bytes: &[u8], needle: &str| {
        std::fs::write(&p, bytes).unwrap();
        let e = Journal::open_or_create(d.path(), v, 1, 16)
            .err()
            .expect("must refuse");
        let m = e.to_string();
        assert!(
            m.contains(needle) && m.contains(&p.display().to_string()),
            "{m}"
        );
        // Refused journals are left in place for inspection.
        assert_eq!(std::fs::read(&p).unwrap(), bytes);
    };
    let mut b = good.clone();
    b[0] = b'X';
    check(&b, "bad magic");
    let mut b = good.clone();
    b[8] = 9;
    check(&b, "newer");
    let mut b = good.clone();
    b[40] ^= 1; // volume uuid byte: static part checksum fails
    check(&b, "checksum");
    let mut b = good.clone();
    b.truncate(b.len() - 4);
    check(&b, "queue size");
    check(&good[..10], "impossible");
    std::fs::write(&p, &good).unwrap();
    // A journal of another queue copied over this one.
    let e = Journal::open_or_create(d.path(), v, 2, 16);
    assert!(e.is_ok(), "queue 2 has its own file");
    std::fs::copy(&p, journal_path(d.path(), v, 2)).unwrap();
    let e = Journal::open_or_create(d.path(), v, 2, 16).err().unwrap();
    assert!(e.to_string().contains("belongs to"), "{e}");
}

#[test]
fn new_generation_with_a_new_queue_size_drops_old_state() {
    let d = dir();
    let v = Uuid::new_v4();
    let (mut j, _) = Journal::open_or_create(d.path(), v, 0, 8).unwrap();
    take(&j, 3);
    let g = j.header().generation;
    j.new_generation(256, RingAddrs::default(), 0, 0).unwrap();
    assert_eq!(j.queue_size(), 256);
    assert!(!j.has_work());
    assert_eq!(j.header().generation, g + 1);
    drop(j);
    let (j, _) = Journal::open_or_create(d.path(), v, 0, 256).unwrap();
    assert_eq!(j.queue_size(), 256);
    remove_volume_journals(d.path(), v);
    assert!(!journal_path(d.path(), v, 0).exists());
}
