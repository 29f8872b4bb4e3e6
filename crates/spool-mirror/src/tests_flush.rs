//! A flush one leg fails and another takes: the leg is marked stale only in the regions
//! written since the flush before (what it may lose at a power cut), not everywhere.

use super::tests::{errno_rule, legs_of, run, setup, three_devices, wait_until, MIB};
use super::*;
use spool_devices::{DeviceIo, FaultOps};

/// Runs one flush through `q` and returns its result.
fn flush(q: &mut dyn DeviceQueue) -> i32 {
    // SAFETY: a flush carries no buffers.
    unsafe { q.submit(DeviceIo::Flush, 9) };
    q.kick().unwrap();
    let t0 = std::time::Instant::now();
    loop {
        let mut res = None;
        q.reap(&mut |tag, r| {
            assert_eq!(tag, 9);
            res = Some(r)
        });
        if let Some(r) = res {
            return r;
        }
        assert!(t0.elapsed().as_secs() < 10, "flush never completed");
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

/// A mirror on two file devices in `d`, a queue on it, and 64 KiB of 0x5a written at 1 MiB.
fn written_at_one_mib(d: &std::path::Path) -> (Vec<Arc<Device>>, Mirror, Box<dyn DeviceQueue>) {
    let (devs, mirror) = setup(d);
    let mut q = mirror.device().open_queue(64).unwrap();
    assert_eq!(run(&mut *q, true, MIB, &mut vec![0x5a_u8; 64 * 1024]), 0);
    (devs, mirror, q)
}

#[test]
fn a_missed_flush_marks_only_what_was_written_since_the_flush_before() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m_mirror, mut q) = written_at_one_mib(d.path());
    let mirror = &m_mirror;
    let mut data = vec![0x5a_u8; 64 * 1024];
    assert_eq!(run(&mut *q, true, 6 * MIB, &mut data), 0);
    assert_eq!(flush(&mut *q), 0, "both legs took the first flush");
    // Region 3 is written after it (and region 6 again, across into region 7).
    data.fill(0xa5);
    assert_eq!(run(&mut *q, true, 3 * MIB, &mut data), 0);
    assert_eq!(run(&mut *q, true, 7 * MIB - 4096, &mut data), 0);
    devs[1]
        .faults()
        .add(errno_rule(FaultOps::Write, libc::EIO, Some(1)));
    assert_eq!(flush(&mut *q), 0, "leg 0 took the second flush");
    assert_eq!(
        mirror.progress().legs[1].stale_bytes,
        3 * MIB,
        "leg 1 is stale in regions 3, 6 and 7 only: 1 was covered by the first flush"
    );
    // Reads of what leg 1 may have lost come from leg 0.
    let mut back = vec![0u8; data.len()];
    assert_eq!(run(&mut *q, false, 3 * MIB, &mut back), 0);
    assert_eq!(back, data);
    // The monitor's job, here by hand: the device is healthy again and leg 1 catches up.
    devs[1].faults().clear();
    devs[1].health().set(HealthState::Healthy);
    wait_until("leg 1 caught up", || {
        mirror.progress().legs[1].state == "current"
    });
    assert_eq!(
        mirror.progress().regions_copied,
        3,
        "only those were copied"
    );
    let (a, b) = legs_of(&devs);
    assert_eq!(a, b, "legs differ after catching up");
}

/// A flush while a leg's device is not healthy (the monitor is resetting it) cannot reach
/// it: the leg missed that flush as surely as one it failed, so it is stale in the regions
/// written since the flush before, which a power cut may take from it. Found by the torture
/// tester (seed 9045): the flush skipped the device and reported success with nothing
/// marked, and after a power cut the leg, current by the bitmap, read zeroes for a write
/// the model had seen flushed.
#[test]
fn a_flush_that_skips_an_unhealthy_leg_marks_what_it_may_lose() {
    let d = tempfile::tempdir().unwrap();
    let (devs, mirror, mut q) = written_at_one_mib(d.path());
    assert_eq!(flush(&mut *q), 0, "both legs took the first flush");
    assert_eq!(run(&mut *q, true, 3 * MIB, &mut vec![0xa5; 4096]), 0);
    // Leg 1's device fails after taking the write to region 3, before any flush covered it.
    devs[1].health().set(HealthState::Resetting);
    assert_eq!(flush(&mut *q), 0, "leg 0 took the flush");
    assert_eq!(
        mirror.progress().legs[1].stale_bytes,
        MIB,
        "leg 1 is stale in region 3, written since the first flush"
    );
    devs[1].health().set(HealthState::Healthy);
    wait_until("leg 1 caught up", || {
        mirror.progress().legs[1].state == "current"
    });
    let (a, b) = legs_of(&devs);
    assert_eq!(a, b, "legs differ after catching up");
}

/// The only current leg misses a flush (its device resetting), and then the retried flush
/// too: the retry must fail as well, for the write the first should have covered is still
/// not durable anywhere. Found by the torture tester (seed 9748): the retry looked only at
/// the regions written since the first was submitted, found none, and reported success;
/// the next power cut lost the write.
#[test]
fn a_flush_retried_after_the_only_current_leg_missed_one_fails_again() {
    let d = tempfile::tempdir().unwrap();
    let (devs, _mirror, mut q) = written_at_one_mib(d.path());
    assert_eq!(flush(&mut *q), 0, "both legs took the first flush");
    // Leg 1 misses a write to region 3 (stale there); then leg 0's device fails too.
    devs[1].health().set(HealthState::Resetting);
    assert_eq!(run(&mut *q, true, 3 * MIB, &mut vec![0xa5; 4096]), 0);
    devs[0].health().set(HealthState::Resetting);
    devs[1].health().set(HealthState::Healthy);
    assert_ne!(flush(&mut *q), 0, "no leg made region 3 durable");
    assert_ne!(flush(&mut *q), 0, "still none did");
    devs[0].health().set(HealthState::Healthy);
    assert_eq!(flush(&mut *q), 0, "leg 0 took it");
}

/// A leg over two devices, one of which fails a flush, missed it only where it lies on that
/// device: a region it alone holds on its other device, which took the flush, is durable.
/// Found by the tier-2 torture tester (seed 1796415333775496874): a grown leg's new device
/// failed a flush while the other leg was still being copied back, and every retry of the
/// guest's flush failed, for the regions only the grown leg held (on its first device) were
/// counted as missed.
#[test]
fn a_flush_missed_by_one_device_of_a_leg_holds_where_the_leg_is_on_another() {
    let d = tempfile::tempdir().unwrap();
    let devs = three_devices(d.path());
    let mut s = super::tests::spec(d.path(), devs.clone(), true);
    s.legs[1].pieces[1].device = 2;
    s.legs[1].pieces[1].offset = MIB;
    let mirror = Mirror::open(s).unwrap();
    let mut q = mirror.device().open_queue(64).unwrap();
    assert_eq!(flush(&mut *q), 0, "every device took the first flush");
    // Leg 0 misses a write to region 1 (leg 1 holds it, on device 1) and stays away.
    devs[0].health().set(HealthState::Resetting);
    assert_eq!(run(&mut *q, true, MIB, &mut vec![0xa5; 4096]), 0);
    // Device 2, where leg 1's second half lies, fails the flush; device 1 takes it.
    devs[2]
        .faults()
        .add(errno_rule(FaultOps::Write, libc::EIO, Some(1)));
    assert_eq!(flush(&mut *q), 0, "region 1 is durable on device 1");
    assert_eq!(mirror.progress().legs[1].stale_bytes, 0, "nothing lost");
    let mut back = vec![0u8; 4096];
    assert_eq!(run(&mut *q, false, MIB, &mut back), 0);
    assert_eq!(back, vec![0xa5; 4096]);
    // The monitor's job, here by hand: device 2 is reset and healthy again.
    devs[2].health().set(HealthState::Healthy);
    // A write to leg 1's second half since then, missed on device 2: that flush fails.
    assert_eq!(run(&mut *q, true, 5 * MIB, &mut vec![0x5a; 4096]), 0);
    devs[2]
        .faults()
        .add(errno_rule(FaultOps::Write, libc::EIO, Some(1)));
    assert_ne!(flush(&mut *q), 0, "region 5 is durable nowhere");
    devs[2].health().set(HealthState::Healthy);
    devs[0].health().set(HealthState::Healthy);
    wait_until("leg 0 caught up", || {
        mirror.progress().legs[0].state == "current"
    });
    assert_eq!(flush(&mut *q), 0, "both legs took it");
}
