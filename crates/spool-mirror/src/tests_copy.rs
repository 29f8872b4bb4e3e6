//! A copy whose source was chosen before a write missed it: the write, acknowledged from the
//! target alone, must survive the copy (seed 7017 of the torture tester lost it so).

use super::bitmap::stale;
use super::legio::{AlignedBuf, LegIo};
use super::tests::{errno_rule, run, setup, MIB};
use super::*;
use spool_devices::FaultOps;

#[test]
fn a_copy_chosen_before_a_write_missed_its_source_leaves_the_write_in_place() {
    let d = tempfile::tempdir().unwrap();
    let (devs, mirror) = setup(d.path());
    let mut q = mirror.device().open_queue(64).unwrap();
    let mut old = vec![0x11_u8; 64 * 1024];
    assert_eq!(run(&mut *q, true, 2 * MIB, &mut old), 0);
    // The background thread is held still, so the copy below runs exactly when the test
    // says: as if it had chosen leg 0 as the source of region 2 (current then) and leg 1 as
    // the target just before the write below went out.
    assert!(mirror.stop_copying());
    mirror
        .shared
        .stop
        .store(false, std::sync::atomic::Ordering::Release);
    devs[0]
        .faults()
        .add(errno_rule(FaultOps::Write, libc::EIO, Some(1)));
    let mut new = vec![0x22_u8; 64 * 1024];
    assert_eq!(run(&mut *q, true, 2 * MIB, &mut new), 0, "leg 1 took it");
    assert_eq!(
        mirror.progress().legs[0].stale_bytes,
        MIB,
        "leg 0 missed it"
    );
    devs[0].faults().clear();
    devs[0].health().set(HealthState::Healthy);

    let (mut io, mut buf) = (LegIo::default(), AlignedBuf::default());
    let copied = copy::copy_region(&mirror.shared, &mut io, &mut buf, (2, 0, stale(1)));
    assert!(
        !copied.unwrap(),
        "a copy from a leg stale there counts for nothing"
    );
    let mut back = vec![0u8; new.len()];
    assert_eq!(run(&mut *q, false, 2 * MIB, &mut back), 0);
    assert!(
        back == new,
        "the acknowledged write was overwritten by the copy"
    );
    assert_eq!(
        mirror.progress().legs[0].stale_bytes,
        MIB,
        "leg 0 still to copy to"
    );
}
