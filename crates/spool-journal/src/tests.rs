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

#[test]
fn a_queue_size_that_is_not_a_power_of_two_is_refused() {
    // Size 0 used to create a 144-byte journal whose mask `0 - 1` let heads index ~128 KiB
    // past the mapping (issue 15, finding 1).
    let d = dir();
    let v = Uuid::new_v4();
    for qs in [0u16, 3, 100] {
        match Journal::open_or_create(d.path(), v, 0, qs) {
            Err(Error::QueueSize { queue_size, .. }) => assert_eq!(queue_size, qs),
            Err(e) => panic!("size {qs}: wrong error {e}"),
            Ok(_) => panic!("size {qs} accepted"),
        }
    }
    // Nothing was left behind to block the queue for the next client.
    assert!(!journal_path(d.path(), v, 0).exists());
    let (mut j, _) = Journal::open_or_create(d.path(), v, 0, 8).unwrap();
    assert!(matches!(
        j.new_generation(0, RingAddrs::default(), 0, 0),
        Err(Error::QueueSize { .. })
    ));
    assert_eq!(j.queue_size(), 8);
}

#[test]
fn a_symlink_in_place_of_a_journal_is_not_followed() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir();
    let v = Uuid::new_v4();
    let elsewhere = tempfile::tempdir().unwrap();
    let target = elsewhere.path().join("victim");
    std::fs::write(&target, b"precious").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink(&target, journal_path(d.path(), v, 0)).unwrap();
    let e = Journal::open_or_create(d.path(), v, 0, 8)
        .err()
        .expect("refused");
    assert!(matches!(e, Error::NotPrivate { .. }), "{e}");
    assert!(e.to_string().contains("symbolic link"), "{e}");
    assert_eq!(std::fs::read(&target).unwrap(), b"precious");
    // A dangling symlink (O_CREAT would have created the target) is refused as well.
    let v2 = Uuid::new_v4();
    let planted = elsewhere.path().join("planted");
    std::os::unix::fs::symlink(&planted, journal_path(d.path(), v2, 0)).unwrap();
    assert!(Journal::open_or_create(d.path(), v2, 0, 8).is_err());
    assert!(!planted.exists());
}

#[test]
fn a_hard_linked_or_shared_journal_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir();
    let v = Uuid::new_v4();
    drop(Journal::open_or_create(d.path(), v, 0, 8).unwrap());
    let p = journal_path(d.path(), v, 0);
    let link = d.path().join("second-name");
    std::fs::hard_link(&p, &link).unwrap();
    let e = Journal::open_or_create(d.path(), v, 0, 8)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("hard links"), "{e}");
    std::fs::remove_file(&link).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
    let e = Journal::open_or_create(d.path(), v, 0, 8)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("group or others"), "{e}");
}

#[test]
fn a_journal_directory_others_can_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir();
    let jd = d.path().join("journals");
    // Created by us when missing, private.
    ensure_private_dir(&jd).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(&jd).unwrap().mode() & 0o777, 0o700);
    std::fs::set_permissions(&jd, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let e = Journal::open_or_create(&jd, Uuid::new_v4(), 0, 8)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("writable by group or others"), "{e}");
    // A symlink to a private directory is refused too.
    std::fs::set_permissions(&jd, std::fs::Permissions::from_mode(0o700)).unwrap();
    let link = d.path().join("link");
    std::os::unix::fs::symlink(&jd, &link).unwrap();
    assert!(ensure_private_dir(&link)
        .unwrap_err()
        .to_string()
        .contains("symbolic link"));
}

#[test]
fn a_journal_directory_of_another_user_is_refused() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to give a directory to another user");
        return;
    }
    let d = dir();
    let jd = d.path().join("taken");
    std::fs::create_dir(&jd).unwrap();
    // What user nobody could do in /dev/shm before spoold first ran.
    std::os::unix::fs::chown(&jd, Some(65534), Some(65534)).unwrap();
    let e = Journal::open_or_create(&jd, Uuid::new_v4(), 0, 8)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("owned by uid 65534"), "{e}");
    assert_eq!(
        std::fs::read_dir(&jd).unwrap().count(),
        0,
        "nothing created"
    );
}

#[test]
fn a_new_generation_after_the_last_one_wraps_instead_of_panicking() {
    // Found by the journal fuzzer: a (checksummed) header at generation u64::MAX made the
    // next new_generation overflow.
    let d = dir();
    let v = Uuid::new_v4();
    let (mut j, _) = Journal::open_or_create(d.path(), v, 0, 8).unwrap();
    let mut h = j.header();
    h.generation = u64::MAX;
    j.write_header(&h);
    j.new_generation(8, RingAddrs::default(), 0, 0).unwrap();
    assert_eq!(j.header().generation, 0);
}

#[test]
fn a_replay_that_crashed_marks_its_heads_poison_for_the_next_process() {
    let d = dir();
    let (j, _) = Journal::open_or_create(d.path(), Uuid::new_v4(), 0, 8).unwrap();
    // A replay that finished (the record dropped): nothing is poison.
    let (rec, poison) = j.begin_replay(&[3, 1]).unwrap();
    assert!(!poison);
    drop(rec);
    let (rec, poison) = j.begin_replay(&[1, 3]).unwrap();
    assert!(!poison);
    // The process is killed from outside (mark not set; the record stays behind).
    std::mem::forget(rec);
    let (rec, poison) = j.begin_replay(&[1, 3]).unwrap();
    assert!(!poison, "being killed is no fault of the requests");
    // It dies of a fault while replaying: the fatal-signal hook sets the mark.
    // SAFETY: the record's mapping is alive (forgotten, never unmapped).
    unsafe { *rec.crash_mark() = 1 };
    std::mem::forget(rec);
    let (rec, poison) = j.begin_replay(&[3, 1]).unwrap();
    assert!(poison, "the same heads after a crash are poison");
    // SAFETY: as above.
    unsafe { *rec.crash_mark() = 1 };
    std::mem::forget(rec);
    // Other heads are not.
    let (_rec, poison) = j.begin_replay(&[1, 3, 5]).unwrap();
    assert!(!poison);
}
