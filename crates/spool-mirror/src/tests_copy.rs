//! A copy whose source was chosen before a write missed it: the write, acknowledged from the
//! target alone, must survive the copy (seed 7017 of the torture tester lost it so).

use super::bitmap::stale;
use super::legio::{AlignedBuf, LegIo};
use super::tests::{errno_rule, run, setup, MIB};
use super::*;
use spool_devices::{DeviceIo, FaultOps, IoVec};

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
        copied.unwrap().is_none(),
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

/// A region the guest writes all the time is still copied: writes first, each piece under a
/// hold of its own, never found it quiet (or a write came between two pieces), so the copy
/// never counted and the leg stayed stale there for as long as the writes went on; now the
/// copy keeps writes out of it for one whole region once that fails.
#[test]
fn a_region_written_all_the_time_is_still_copied() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let d = tempfile::tempdir().unwrap();
    let (devs, mirror) = setup(d.path());
    devs[1]
        .faults()
        .add(errno_rule(FaultOps::Write, libc::EIO, Some(1)));
    let mut q = mirror.device().open_queue(64).unwrap();
    let mut data = vec![0x33_u8; 4096];
    assert_eq!(run(&mut *q, true, 2 * MIB, &mut data), 0, "leg 0 took it");
    // Eight writes always in flight in region 2 while leg 1 comes back.
    let (stop, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let dev = mirror.device().clone();
    let (stop2, done2) = (stop.clone(), done.clone());
    let writer = std::thread::spawn(move || {
        let mut q = dev.open_queue(64).unwrap();
        let mut bufs = vec![vec![0u8; 4096]; 8];
        let iovs: Vec<IoVec> = (bufs.iter_mut())
            .map(|b| IoVec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: 4096,
            })
            .collect();
        let submit = |q: &mut Box<dyn DeviceQueue>, slot: u64, n: u64| {
            let off = 2 * MIB + (n * 8 + slot) * 4096 % MIB;
            // SAFETY: the buffers and `iovs` outlive every write, all reaped below.
            unsafe {
                q.submit(
                    DeviceIo::data(true, off, 4096, &iovs[slot as usize], 1),
                    slot,
                )
            };
        };
        (0..8).for_each(|slot| submit(&mut q, slot, 0));
        let (mut n, mut in_flight) = (1, 8);
        while in_flight > 0 {
            q.kick().unwrap();
            let mut finished = Vec::new();
            q.reap(&mut |slot, r| finished.push((slot, r)));
            for (slot, r) in finished {
                assert_eq!(r, 0, "a write failed");
                done2.fetch_add(1, Ordering::Relaxed);
                in_flight -= 1;
                if !stop2.load(Ordering::Acquire) {
                    submit(&mut q, slot, n);
                    (n, in_flight) = (n + 1, in_flight + 1);
                }
            }
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    });
    super::tests::wait_until("writes going", || done.load(Ordering::Relaxed) > 200);
    devs[1].faults().clear();
    devs[1].health().set(spool_devices::HealthState::Healthy);
    super::tests::wait_until("leg 1 caught up under the writes", || {
        mirror.progress().legs[1].state == "current"
    });
    let before = done.load(Ordering::Relaxed);
    super::tests::wait_until("writes still going", || {
        done.load(Ordering::Relaxed) > before + 200
    });
    stop.store(true, Ordering::Release);
    writer.join().unwrap();
    let (a, b) = super::tests::legs_of(&devs);
    assert!(a == b, "the legs differ");
}
