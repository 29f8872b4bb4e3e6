//! A mirror after an unclean stop: the regions that had writes in flight are out of sync,
//! not stale, so a leg failing before the resync is done costs no request (md's rule); reads
//! there come from one leg until the resync; a media error on the only current copy is not
//! made worse; regions with no current leg are shown and an operator can accept a leg.

use std::sync::atomic::Ordering;

use super::tests::*;
use super::*;
use crate::FaultOps;

/// What a kill mid-write leaves: region 2 has intent and leg 0 holds a write (of 9s) that
/// leg 1 never got and no one saw complete. Returns the devices (the mirror is gone).
fn crash_with_region_2_differing(d: &Path) -> Vec<Arc<Device>> {
    let devs = vec![file_device(d, "a"), file_device(d, "b")];
    let m = MirrorBackend::open(spec(d, devs.clone(), true)).unwrap();
    let mut q = m.open_queue(64).unwrap();
    assert_eq!(run(&mut *q, true, 2 * MIB, &mut [1u8; 4096]), 0);
    devs[0]
        .write_at_durable(&[9u8; 4096], MIB + 2 * MIB)
        .unwrap();
    drop(q);
    drop(m);
    devs
}

#[test]
fn after_a_crash_either_leg_serves_the_regions_in_doubt_when_the_other_fails() {
    let d = tempfile::tempdir().unwrap();
    let devs = crash_with_region_2_differing(d.path());
    // Leg 0's device fails before the resync could copy region 2 anywhere.
    devs[0].health().set(HealthState::Failed);
    let m = MirrorBackend::open(spec(d.path(), devs.clone(), true)).unwrap();
    let mirror = MirrorBackend::of(&m).unwrap();
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
    let m = MirrorBackend::open(s).unwrap();
    let mirror = MirrorBackend::of(&m).unwrap();
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
    let (devs, m) = setup(d.path());
    let mirror = MirrorBackend::of(&m).unwrap();
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
    let (devs, m) = setup(d.path());
    let mirror = MirrorBackend::of(&m).unwrap();
    let mut q = m.open_queue(64).unwrap();
    assert_eq!(run(&mut *q, true, 4 * MIB, &mut [3u8; 4096]), 0);
    // What a second failure can leave: both legs stale in region 4.
    mirror.shared.regions.mark(4, 0b11);
    let mut back = vec![0u8; 4096];
    assert_eq!(run(&mut *q, false, 4 * MIB, &mut back), -libc::ENOLINK);
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
