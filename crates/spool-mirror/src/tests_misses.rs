//! Writes in flight together in one region that each leg misses a different one of: no
//! region may be left with every leg stale (each holding an acknowledged write the other
//! lacks), which a later read could only fail (`ENOMEDIUM`, tier-2 torture seed 4 on a
//! mirrored thin volume, with transient write errors on both devices).

use super::tests::*;
use super::*;
use spool_devices::{DeviceIo, FaultOps, IoVec};
use std::time::{Duration, Instant};

/// A rule failing the next write at device byte `offset` (4 KiB) with EIO.
fn fail_once_at(offset: u64) -> spool_devices::FaultRule {
    spool_devices::FaultRule {
        offset,
        len: 4096,
        ..errno_rule(FaultOps::Write, libc::EIO, Some(1))
    }
}

/// Submits the writes `(offset, buffer)` together and returns their results in order.
fn run_together(q: &mut dyn DeviceQueue, writes: &mut [(u64, Vec<u8>)]) -> Vec<i32> {
    let iovs: Vec<[IoVec; 1]> = (writes.iter_mut())
        .map(|(_, b)| {
            [IoVec {
                iov_base: b.as_mut_ptr() as *mut libc::c_void,
                iov_len: b.len(),
            }]
        })
        .collect();
    for (tag, ((off, b), iov)) in writes.iter().zip(&iovs).enumerate() {
        let io = DeviceIo::data(true, *off, b.len() as u64, iov.as_ptr(), 1);
        // SAFETY: `iovs` and the buffers outlive every completion, reaped below.
        unsafe { q.submit(io, tag as u64) };
    }
    q.kick().unwrap();
    let mut res = vec![None; writes.len()];
    let t0 = Instant::now();
    while res.iter().any(Option::is_none) {
        q.reap(&mut |tag, r| res[tag as usize] = Some(r));
        assert!(t0.elapsed() < Duration::from_secs(10), "writes never done");
        std::thread::sleep(Duration::from_micros(100));
    }
    res.into_iter().map(Option::unwrap).collect()
}

#[test]
fn two_writes_of_a_region_each_missed_by_a_different_leg_leave_it_a_current_leg() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m_mirror) = setup(d.path());
    let m = m_mirror.device().clone();
    let mut q = m.open_queue(64).unwrap();
    // Region 2 (volume 2 MiB) is at device 3 MiB on both legs: device a fails the first
    // write's block, device b the second's.
    let (one, two) = (2 * MIB, 2 * MIB + 64 * 1024);
    devs[0].faults().add(fail_once_at(MIB + one));
    devs[1].faults().add(fail_once_at(MIB + two));
    let mut writes = vec![(one, vec![1u8; 4096]), (two, vec![2u8; 4096])];
    let res = run_together(&mut *q, &mut writes);
    assert_eq!(
        res.iter().filter(|&&r| r == 0).count(),
        1,
        "one write is done, on the leg that stays current; the other fails: {res:?}"
    );
    for dev in &devs {
        dev.faults().clear();
        dev.health().set(HealthState::Healthy);
    }
    let mut back = vec![0u8; 128 * 1024];
    assert_eq!(
        run(&mut *q, false, one, &mut back),
        0,
        "region 2 has a current leg"
    );
    let done = res.iter().position(|&r| r == 0).unwrap();
    let at = (writes[done].0 - one) as usize;
    assert_eq!(
        back[at..at + 4096],
        writes[done].1[..],
        "the acknowledged write"
    );
    wait_until("both legs current", || {
        m_mirror
            .progress()
            .legs
            .iter()
            .all(|l| l.state == "current")
    });
    let (a, b) = legs_of(&devs);
    assert!(a == b, "the legs differ once caught up");
}
