//! A mirror after an unclean stop: the regions that had writes in flight are out of sync,
//! not stale, so a leg failing before the resync is done costs no request (md's rule); reads
//! there come from one leg until the resync; a media error on the only current copy is not
//! made worse; regions with no current leg are shown and an operator can accept a leg.

use std::sync::atomic::Ordering;

use super::tests::*;
use super::*;
use bitmap::INTENT;
use spool_devices::{DeviceIo, FaultOps, FaultRule, IoVec};
use std::time::{Duration, Instant};

/// What a kill mid-write leaves: a write (of 9s) in flight in region 2, which reached leg 0
/// and not leg 1 and which no one saw complete. Returns the devices (the mirror is gone).
fn crash_with_region_2_differing(d: &Path) -> Vec<Arc<Device>> {
    let devs = vec![file_device(d, "a"), file_device(d, "b")];
    let m_mirror = Mirror::open(spec(d, devs.clone(), true)).unwrap();
    let m = m_mirror.device().clone();
    let mut q = m.open_queue(64).unwrap();
    assert_eq!(run(&mut *q, true, 2 * MIB, &mut [1u8; 4096]), 0);
    // Entered (its intent durable) and never left: the process died with it in flight.
    let regions = &m_mirror.shared.regions;
    regions.enter(2, 2, INTENT);
    regions.bitmap.sync(2, 2);
    devs[0]
        .write_at_durable(&[9u8; 4096], MIB + 2 * MIB)
        .unwrap();
    drop(q);
    drop(m);
    drop(m_mirror);
    devs
}

#[test]
fn after_a_kill_only_the_regions_with_writes_in_flight_are_in_doubt() {
    let d = tempfile::tempdir().unwrap();
    let devs = vec![file_device(d.path(), "a"), file_device(d.path(), "b")];
    {
        let m_mirror = Mirror::open(spec(d.path(), devs.clone(), true)).unwrap();
        let m = m_mirror.device().clone();
        let mut q = m.open_queue(64).unwrap();
        for r in 0..6 {
            assert_eq!(run(&mut *q, true, r * MIB, &mut [2u8; 4096]), 0);
        }
        // Region 3's next write is in flight when the worker dies; the other five regions
        // have intent (written less than a second ago) and nothing in flight.
        m_mirror.shared.regions.enter(3, 3, INTENT);
    }
    let m_mirror = Mirror::open(spec(d.path(), devs.clone(), true)).unwrap();
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    assert_eq!(mirror.resync_at_open(), 1, "region 3 only");
    // After a reboot (the counters say nothing) all six are in doubt.
    drop(m);
    drop(m_mirror);
    std::fs::remove_file(d.path().join("bitmap.writes")).unwrap();
    let m_mirror = Mirror::open(spec(d.path(), devs.clone(), true)).unwrap();
    assert_eq!(m_mirror.resync_at_open(), 6);
}

#[test]
fn after_a_crash_either_leg_serves_the_regions_in_doubt_when_the_other_fails() {
    let d = tempfile::tempdir().unwrap();
    let devs = crash_with_region_2_differing(d.path());
    // Leg 0's device fails before the resync could copy region 2 anywhere.
    devs[0].health().set(HealthState::Failed);
    let m_mirror = Mirror::open(spec(d.path(), devs.clone(), true)).unwrap();
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    assert_eq!(mirror.resync_at_open(), 1);
    let mut q = m.open_queue(64).unwrap();
    // Leg 1 holds every acknowledged write of region 2: reads and writes go on there.
    let mut back = vec![0u8; 4096];
    assert_eq!(
        run(&mut *q, false, 2 * MIB, &mut back),
        0,
        "read held or failed"
    );
    assert_eq!(back, vec![1u8; 4096], "the acknowledged write");
    assert_eq!(run(&mut *q, true, 2 * MIB + 8192, &mut [4u8; 4096]), 0);
    let p = mirror.progress();
    assert_eq!(p.legs[1].state, "current", "{p:?}");
    assert_eq!(p.regions_without_current, 0, "{p:?}");
    // Leg 0 back: it is copied to in region 2 (it left the region while out of sync).
    devs[0].health().set(HealthState::Healthy);
    wait_until("leg 0 caught up", || mirror.leg_current(0));
    let (a, b) = legs_of(&devs);
    assert_eq!(a, b, "legs differ after catching up");
}

#[test]
fn after_a_crash_the_regions_in_doubt_read_from_one_leg_until_resynced() {
    let d = tempfile::tempdir().unwrap();
    let devs = crash_with_region_2_differing(d.path());
    let mut s = spec(d.path(), devs.clone(), true);
    // Leg 1's device is resetting: it leaves the region while out of sync (stale there,
    // copied to once back), so every read comes from the source, leg 0.
    devs[1].health().set(HealthState::Resetting);
    s.resync_rate = 0;
    let m_mirror = Mirror::open(s).unwrap();
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    let mut q = m.open_queue(64).unwrap();
    let mut back = vec![0u8; 4096];
    for _ in 0..4 {
        assert_eq!(run(&mut *q, false, 2 * MIB, &mut back), 0);
        assert_eq!(
            back,
            vec![9u8; 4096],
            "the source leg (0) answers every read"
        );
    }
    // Leg 1 back: the resync makes it agree with the source; the mirror is in sync.
    devs[1].health().set(HealthState::Healthy);
    wait_until("resynced", || {
        let p = mirror.progress();
        p.out_of_sync_bytes == 0 && p.remaining_bytes == 0 && mirror.leg_current(1)
    });
    let (a, b) = legs_of(&devs);
    assert_eq!(a, b, "legs differ after the resync");
    assert_eq!(mirror.verify().unwrap().regions_differing, 0);
}

#[test]
fn a_media_error_on_the_only_current_copy_fails_the_read_and_keeps_the_copy() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m_mirror) = setup(d.path());
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    let mut q = m.open_queue(64).unwrap();
    // Leg 1 misses a write of region 3 (its device resetting), so leg 0 alone is current.
    devs[1].health().set(HealthState::Resetting);
    assert_eq!(run(&mut *q, true, 3 * MIB, &mut [6u8; 4096]), 0);
    devs[0]
        .faults()
        .add(errno_rule(FaultOps::Read, libc::ENODATA, Some(1)));
    let mut back = vec![0u8; 4096];
    assert_eq!(run(&mut *q, false, 3 * MIB, &mut back), -libc::ENODATA);
    let p = mirror.progress();
    assert_eq!(
        p.legs[0].stale_bytes, 0,
        "the only copy marked stale: {p:?}"
    );
    // The next read (the sector readable again) returns the data.
    assert_eq!(run(&mut *q, false, 3 * MIB, &mut back), 0);
    assert_eq!(back, vec![6u8; 4096]);
}

#[test]
fn regions_with_no_current_leg_are_shown_and_an_operator_can_accept_a_leg() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m_mirror) = setup(d.path());
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    let mut q = m.open_queue(64).unwrap();
    assert_eq!(run(&mut *q, true, 4 * MIB, &mut [3u8; 4096]), 0);
    // What a second failure can leave: both legs stale in region 4.
    mirror.shared.regions.mark(4, 0b11);
    // No leg that may come back holds it: the request fails (not held for ever).
    let mut back = vec![0u8; 4096];
    assert_eq!(run(&mut *q, false, 4 * MIB, &mut back), -libc::ENOMEDIUM);
    let p = mirror.progress();
    assert_eq!(
        (p.regions_without_current, p.without_current_offsets.clone()),
        (1, vec![4 * MIB]),
        "{p:?}"
    );
    assert!(mirror.accept_leg(2).is_err(), "no leg in slot 2");
    devs[1].health().set(HealthState::Resetting);
    assert!(mirror.accept_leg(1).is_err(), "leg 1 is not usable");
    devs[1].health().set(HealthState::Healthy);
    assert_eq!(mirror.accept_leg(1).unwrap(), 1);
    assert_eq!(run(&mut *q, false, 4 * MIB, &mut back), 0);
    assert_eq!(back, vec![3u8; 4096]);
    wait_until("leg 0 copied from leg 1", || {
        mirror.leg_current(0) && mirror.progress().regions_without_current == 0
    });
    let (a, b) = legs_of(&devs);
    assert_eq!(a, b);
    assert_eq!(mirror.shared.regions.stale[1].load(Ordering::Relaxed), 0);
}

/// During a rebuild the only current leg's device resets: requests to regions not yet
/// copied wait (the mirror is resetting, so the worker holds them without spending their
/// retries), and the mirror is healthy again once that device is back.
#[test]
fn the_only_current_leg_resetting_makes_the_mirror_wait_not_fail() {
    let d = tempfile::tempdir().unwrap();
    let devs = vec![file_device(d.path(), "a"), file_device(d.path(), "b")];
    let mut s = spec(d.path(), devs.clone(), false);
    s.resync_rate = 1; // leg 1 stays stale almost everywhere
    let m_mirror = Mirror::open(s).unwrap();
    let m = m_mirror.device().clone();
    let mut q = m.open_queue(64).unwrap();
    devs[0].health().set(HealthState::Resetting);
    assert_eq!(
        run(&mut *q, true, 5 * MIB, &mut [1u8; 4096]),
        -libc::ENOLINK
    );
    wait_until("mirror resetting", || {
        m.health().state() == HealthState::Resetting
    });
    devs[0].health().set(HealthState::Healthy);
    wait_until("mirror healthy", || {
        m.health().state() == HealthState::Healthy
    });
    assert_eq!(run(&mut *q, true, 5 * MIB, &mut [1u8; 4096]), 0);
    // Gone for good: what only it held fails at once instead of waiting.
    devs[0].health().set(HealthState::Failed);
    assert_eq!(
        run(&mut *q, true, 5 * MIB, &mut [1u8; 4096]),
        -libc::ENOMEDIUM
    );
}

/// Damaged state files lose nothing: a write-counters file that is short, of another magic
/// or another region count says nothing (the intent bits decide), and a region byte whose
/// read source names a slot with no leg, or the fourth slot value, still serves from a
/// current leg and resyncs.
#[test]
fn damaged_write_counters_and_read_sources_are_not_trusted() {
    let d = tempfile::tempdir().unwrap();
    let devs = crash_with_region_2_differing(d.path());
    let counts = d.path().join("bitmap.writes");
    for bad in [vec![], b"SPOOLWC1".to_vec(), vec![0xffu8; 4096]] {
        std::fs::write(&counts, &bad).unwrap();
        // Region 3: a read source in slot 2, where this mirror has no leg.
        let (bitmap, _) = Bitmap::open(Some(&d.path().join("bitmap")), 8, 20).unwrap();
        bitmap
            .byte(3)
            .fetch_or(INTENT | bitmap::out_of_sync(2), Ordering::AcqRel);
        bitmap.sync(3, 3);
        drop(bitmap);
        let m_mirror = Mirror::open(spec(d.path(), devs.clone(), true)).unwrap();
        let m = m_mirror.device().clone();
        let mirror = &m_mirror;
        assert!(mirror.resync_at_open() >= 2, "intent bits decide");
        let mut q = m.open_queue(64).unwrap();
        let mut back = vec![0u8; 4096];
        assert_eq!(run(&mut *q, false, 3 * MIB, &mut back), 0);
        assert_eq!(run(&mut *q, false, 2 * MIB, &mut back), 0);
        wait_until("resynced", || {
            let p = mirror.progress();
            p.out_of_sync_bytes == 0 && p.remaining_bytes == 0
        });
        let (a, b) = legs_of(&devs);
        assert_eq!(a, b);
    }
}

/// md's resync barrier: a write to a region whose copy is moving a piece waits in its queue
/// (the worker goes on) until the piece has landed, so the copy's older bytes never land over
/// it. What it prevents (seen in `tests/mirror.rs` as a read returning old data): after a
/// worker kill the copy reads a region from its source, a guest write completes on both
/// legs, the copy's older bytes land on the other leg, and the source fails before the next
/// pass: that leg, current, serves the older bytes.
#[test]
fn a_write_waits_while_the_copy_moves_its_region_and_is_never_overwritten_by_it() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m_mirror) = setup(d.path());
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    let mut q = m.open_queue(64).unwrap();
    // Straddles regions 2 and 3 (leg 1's piece boundary is elsewhere).
    let at = 3 * MIB - 2048;
    assert_eq!(run(&mut *q, true, at, &mut [1u8; 4096]), 0);
    let regions = &mirror.shared.regions;
    // The copy holds region 3 (the intent clearer may hold it for an instant first) and
    // reads the source's bytes.
    wait_until("region 3 held", || regions.hold_for_copy(3));
    let copied = leg_bytes(&devs[0], &[(MIB + at, 4096)]);
    assert_eq!(copied, vec![1u8; 4096]);
    let mut data = vec![7u8; 4096];
    let iov = [IoVec {
        iov_base: data.as_mut_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    }];
    // SAFETY: `iov` and `data` outlive the completion reaped below.
    unsafe { q.submit(DeviceIo::data(true, at, 4096, iov.as_ptr(), 1), 9) };
    q.kick().unwrap();
    let mut res = None;
    for _ in 0..20 {
        q.reap(&mut |_, r| res = Some(r));
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(
        res, None,
        "the write went out while the copy held its region"
    );
    assert_eq!(q.in_flight(), 1);
    assert_eq!(leg_bytes(&devs[0], &[(MIB + at, 4096)]), vec![1u8; 4096]);
    assert_eq!(
        regions.writes[2].load(Ordering::SeqCst) & !FLAGS,
        0,
        "a waiting write counts in none of its regions"
    );
    // Nothing signals the queue of the waiting write until the copy lets the region go.
    assert!(
        !signalled_after_reap(&mut *q),
        "the queue kept signalling itself"
    );
    // The copy's piece lands on leg 1 (whose range here is on device 1 at 1 MiB), then the
    // copy lets the region go.
    devs[1].write_at_durable(&copied, MIB + at).unwrap();
    regions.release_copy(3);
    assert!(
        readable(q.completion_fd()),
        "the copy's release woke nobody"
    );
    // Writes come first: the copy cannot take the region again before the waiting write
    // got in.
    assert!(
        !regions.hold_for_copy(3),
        "the copy's next piece went before the write"
    );
    let t0 = Instant::now();
    while res.is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the write never went out"
        );
        q.reap(&mut |_, r| res = Some(r));
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(res, Some(0));
    // Leg 0 fails: leg 1 serves the write, not the copy's older bytes.
    devs[0].health().set(HealthState::Failed);
    let mut back = vec![0u8; 4096];
    assert_eq!(run(&mut *q, false, at, &mut back), 0);
    assert_eq!(
        back,
        vec![7u8; 4096],
        "the copy landed over an acknowledged write"
    );
    // The region is the copy's again once the write is done (the clearer aside).
    assert_eq!(regions.writes[3].load(Ordering::SeqCst) & !CLEARING, 0);
}

/// A worker's abort (its timeout sweep, a reset, a stop) gives a write waiting for the copy
/// back at once, to be submitted again: it holds nothing of a device.
#[test]
fn an_abort_gives_a_write_waiting_for_the_copy_back() {
    let d = tempfile::tempdir().unwrap();
    let (_devs, m_mirror) = setup(d.path());
    let m = m_mirror.device().clone();
    let regions = &m_mirror.shared.regions;
    let mut q = m.open_queue(64).unwrap();
    wait_until("region 3 held", || regions.hold_for_copy(3));
    let mut data = vec![7u8; 4096];
    let iov = [IoVec {
        iov_base: data.as_mut_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    }];
    // SAFETY: `iov` and `data` outlive the completion reaped below.
    unsafe { q.submit(DeviceIo::data(true, 3 * MIB, 4096, iov.as_ptr(), 1), 9) };
    let mut res = None;
    q.reap(&mut |_, r| res = Some(r));
    assert_eq!(res, None);
    assert_eq!(q.abort(), 1);
    q.reap(&mut |_, r| res = Some(r));
    assert_eq!(res, Some(-libc::ECANCELED));
    assert_eq!(q.in_flight(), 0);
    regions.release_copy(3);
}

/// Acks `q`'s event, reaps (nothing may complete), and tells whether the event is set again.
fn signalled_after_reap(q: &mut dyn DeviceQueue) -> bool {
    q.ack_completion_event();
    q.reap(&mut |_, r| panic!("a completion ({r}) while the write waits"));
    readable(q.completion_fd())
}

/// Whether `fd` is readable now.
fn readable(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd on the stack, valid for the call; no wait.
    unsafe { libc::poll(&mut p, 1, 0) == 1 }
}

/// Leg 1 misses a write of region 2 and then leg 0 one of region 3 (each device resetting
/// in turn, the copy held back): each region has one current leg, a different one. A read
/// across both takes each region's part from its current leg, and a write across both is
/// done, not failed for want of one leg current in all of it (`ENOMEDIUM`, tier-2 torture
/// seed 4, where a guest got EIO for data both legs held between them).
#[test]
fn a_request_across_regions_current_on_different_legs_is_served() {
    let d = tempfile::tempdir().unwrap();
    let devs = vec![file_device(d.path(), "a"), file_device(d.path(), "b")];
    let mut s = spec(d.path(), devs.clone(), true);
    s.resync_rate = 1; // the copy stays behind
    let m_mirror = Mirror::open(s).unwrap();
    let m = m_mirror.device().clone();
    let mut q = m.open_queue(64).unwrap();
    let at = 3 * MIB - 4096;
    devs[1].health().set(HealthState::Resetting);
    assert_eq!(run(&mut *q, true, at, &mut [1u8; 4096]), 0);
    devs[1].health().set(HealthState::Healthy);
    devs[0].health().set(HealthState::Resetting);
    assert_eq!(run(&mut *q, true, 3 * MIB, &mut [2u8; 4096]), 0);
    devs[0].health().set(HealthState::Healthy);
    wait_until("mirror healthy", || {
        m.health().state() == HealthState::Healthy
    });
    let mut back = vec![0u8; 8192];
    assert_eq!(run(&mut *q, false, at, &mut back), 0);
    assert_eq!((back[0], back[4095], back[4096], back[8191]), (1, 1, 2, 2));
    let mut both = vec![3u8; 8192];
    assert_eq!(run(&mut *q, true, at, &mut both), 0);
    assert_eq!(run(&mut *q, false, at, &mut back), 0);
    assert_eq!(back, vec![3u8; 8192]);
    // The only leg current in region 3 failing the write fails it.
    devs[1].health().set(HealthState::Resetting);
    assert_eq!(run(&mut *q, true, at, &mut both), -libc::ENOLINK);
}

/// Legs that swap devices between stripes (a grown mirror's new extents land where there is
/// space: leg 0 on a then b, leg 1 on c then a): while a resets, a write across the stripe
/// boundary has no leg on healthy devices in all of it. The mirror is resetting then (the
/// worker holds the write without spending its retries on other health changes), and the
/// write goes through once a is back (tier-2 torture: it failed after three retries during
/// a link-down of 104 ms, the mirror calling itself healthy throughout).
#[test]
fn legs_that_swap_devices_make_the_mirror_wait_while_one_resets() {
    let d = tempfile::tempdir().unwrap();
    let devs = three_devices(d.path());
    let mut s = spec(d.path(), devs.clone(), true);
    let half = SIZE / 2;
    let piece = |logical, device, offset| LegPiece {
        logical,
        len: half,
        device,
        offset,
    };
    s.legs[0].pieces = vec![piece(0, 0, MIB), piece(half, 1, MIB)];
    s.legs[1].pieces = vec![piece(0, 2, MIB), piece(half, 0, 9 * MIB)];
    let m_mirror = Mirror::open(s).unwrap();
    let m = m_mirror.device().clone();
    let mut q = m.open_queue(64).unwrap();
    let at = half - 4096;
    devs[0].health().set(HealthState::Resetting);
    assert_eq!(run(&mut *q, true, at, &mut [5u8; 8192]), -libc::ENOLINK);
    wait_until("mirror resetting", || {
        m.health().state() == HealthState::Resetting
    });
    devs[0].health().set(HealthState::Healthy);
    wait_until("mirror healthy", || {
        m.health().state() == HealthState::Healthy
    });
    assert_eq!(run(&mut *q, true, at, &mut [5u8; 8192]), 0);
    let mut back = vec![0u8; 8192];
    assert_eq!(run(&mut *q, false, at, &mut back), 0);
    assert_eq!(back, vec![5u8; 8192]);
}

/// Each region of a write has a usable current leg, but not one leg for all of them: leg 0
/// lies on a then b, leg 1 on c, stale in the last region on a (its copy there keeps
/// failing); while b resets, a write across from that region into the next has leg 0 current
/// in the first and usable only there, leg 1 usable everywhere and current only in the
/// second. The write path sends a write only to legs usable over all of it, so it cannot
/// go on: the mirror is resetting then, and the write goes through once b is back (tier-2
/// torture, seed 1796421754462691513: a write of 1280 KiB failed after three retries during a
/// link-down of 126 ms, the mirror calling itself healthy throughout).
#[test]
fn a_write_with_no_leg_usable_over_its_regions_waits_for_the_device() {
    let d = tempfile::tempdir().unwrap();
    let devs = three_devices(d.path());
    let mut s = spec(d.path(), devs.clone(), true);
    let half = SIZE / 2;
    let piece = |logical, len, device, offset| LegPiece {
        logical,
        len,
        device,
        offset,
    };
    s.legs[0].pieces = vec![piece(0, half, 0, MIB), piece(half, half, 1, MIB)];
    s.legs[1].pieces = vec![piece(0, SIZE, 2, MIB)];
    let m_mirror = Mirror::open(s).unwrap();
    let m = m_mirror.device().clone();
    let mut q = m.open_queue(64).unwrap();
    // Leg 1 misses a write to the last region of the first half and is not copied back
    // there: its device fails writes to that region with a media error (which leaves the
    // device healthy, so leg 1 stays usable everywhere).
    let last = half - MIB;
    devs[2].faults().add(FaultRule {
        offset: MIB + last,
        len: MIB,
        ..errno_rule(FaultOps::Write, libc::ENODATA, None)
    });
    assert_eq!(run(&mut *q, true, last, &mut [1u8; 4096]), 0);
    assert_eq!(devs[2].health().state(), HealthState::Healthy);
    assert!(m_mirror.progress().legs[1].stale_bytes >= MIB);
    devs[1].health().set(HealthState::Resetting);
    wait_until("mirror resetting", || {
        m.health().state() == HealthState::Resetting
    });
    let at = half - 4096;
    assert_eq!(run(&mut *q, true, at, &mut [5u8; 8192]), -libc::ENOLINK);
    devs[1].health().set(HealthState::Healthy);
    wait_until("mirror healthy", || {
        m.health().state() == HealthState::Healthy
    });
    assert_eq!(run(&mut *q, true, at, &mut [5u8; 8192]), 0);
    let mut back = vec![0u8; 8192];
    assert_eq!(run(&mut *q, false, at, &mut back), 0);
    assert_eq!(back, vec![5u8; 8192]);
    devs[2].faults().clear();
}
