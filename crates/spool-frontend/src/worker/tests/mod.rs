//! Unit tests of the worker: iovec slicing, and the recovery logic driven directly (not end
//! to end) with a scripted [`DeviceQueue`] whose completions, errors, hangs and the device's
//! health changes come in the order each test chooses. Each test checks what the guest sees
//! (status bytes, the used ring) and what the journal says is still in flight.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};
use spool_devices::{Device, DeviceHealth, DeviceIo, DeviceQueue, HealthState, IoVec, NullReads};
use spool_journal::{Journal, RingAddrs};
use spool_pool::{Segment, VolumeLayout};
use uuid::Uuid;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::dispatch::slice_iov;
use super::recovery::StopKind;
use super::{QueueWorker, WorkerSpec};
use crate::queue_start::{resume, ResumeFrom, RingView};
use crate::request::{GuestMemory, Limits, SECTOR};

mod group;
mod harness;
use harness::*;

#[test]
fn slice_iov_splits_across_buffers() {
    let v = [
        IoVec {
            iov_base: 0x1000 as *mut _,
            iov_len: 512,
        },
        IoVec {
            iov_base: 0x5000 as *mut _,
            iov_len: 1024,
        },
    ];
    let s = slice_iov(&v, 256, 512);
    assert_eq!(s.len(), 2);
    assert_eq!((s[0].iov_base as usize, s[0].iov_len), (0x1100, 256));
    assert_eq!((s[1].iov_base as usize, s[1].iov_len), (0x5000, 256));
    let s = slice_iov(&v, 512, 1024);
    assert_eq!(s.len(), 1);
    assert_eq!((s[0].iov_base as usize, s[0].iov_len), (0x5000, 1024));
}

/// A read that completed with `errno`: what becomes of it on the next round.
fn after_error(errno: i32) -> Harness {
    let mut h = Harness::new(2);
    let head = h.post_read(0);
    h.round();
    assert_eq!(h.submitted(), vec![head as u64]);
    assert_eq!(h.journaled(), vec![head]);
    h.device_completes(head, -errno);
    h.round();
    h
}

/// A frontend adds a memory region and, once spoold acknowledged it, posts a request whose
/// buffer lies there; the worker's round had loaded the map before the region was published.
/// The request is parsed again under the newest map and goes to the device, where it used to
/// be refused as "buffer outside guest memory" (a libblkio client's first writes failed so).
#[test]
fn a_request_in_a_region_added_during_the_round_is_not_refused() {
    let mut h = Harness::new(3);
    let mem = h.w.begin_round();
    let grown = h
        .mem
        .with_anon_region(vm_memory::GuestAddress(0x40_0000), 0x1_0000);
    h.mem_src.store(Arc::new(grown));
    let head = h.post_read_into(0, 0x40_0000);
    h.w.poll_round(&mem);
    assert_eq!(h.submitted(), vec![head as u64], "refused: {:?}", h.used());
    assert_eq!(h.status(head), UNWRITTEN);
    h.device_completes(head, LEN as i32);
    h.round();
    assert_eq!(h.used(), vec![(head, LEN + 1)]);
}

#[test]
fn media_and_request_errors_fail_the_request_alone() {
    for errno in [libc::ENODATA, libc::EINVAL] {
        let h = after_error(errno);
        assert_eq!(h.status(0), VIRTIO_BLK_S_IOERR as u8, "errno {errno}");
        assert_eq!(h.used(), vec![(0, LEN + 1)], "errno {errno}");
        assert!(h.journaled().is_empty(), "errno {errno}");
        assert!(!h.w.inflight.any_held() && !h.w.inflight.any_cancelled());
        // Not a path error: the device keeps serving; the monitor decides on isolation.
        assert_eq!(h.state(), HealthState::Healthy, "errno {errno}");
        let (reports, _) = h.health.take_reports();
        assert_eq!(reports.len(), 1, "errno {errno}");
    }
}

#[test]
fn path_and_gone_errors_hold_the_request_until_the_epoch_changes() {
    for errno in [libc::EIO, libc::ENODEV] {
        let mut h = after_error(errno);
        // Held: neither completed nor failed, still INFLIGHT in the journal.
        assert_eq!(h.status(0), UNWRITTEN, "errno {errno}");
        assert!(h.used().is_empty());
        assert_eq!(h.journaled(), vec![0]);
        assert_eq!(h.w.inflight.held(), [0]);
        if errno == libc::EIO {
            // A path error on a healthy device holds its I/O at once.
            assert_eq!(h.state(), HealthState::Resetting);
        } else {
            h.health.set(HealthState::Resetting);
        }
        // The worker sees the device resetting: nothing held is submitted meanwhile.
        h.round();
        h.round();
        assert_eq!(h.submitted().len(), 1, "errno {errno}");
        // The monitor's probe succeeded: the held request goes to the device again.
        h.health.set(HealthState::Healthy);
        h.round();
        assert_eq!(h.submitted(), vec![0, 0], "errno {errno}");
        assert!(!h.w.inflight.any_held());
        h.device_completes(0, LEN as i32);
        h.round();
        assert_eq!(h.status(0), VIRTIO_BLK_S_OK as u8);
        assert_eq!(h.used(), vec![(0, LEN + 1)]);
        assert!(h.journaled().is_empty());
    }
}

#[test]
fn our_own_cancellation_resubmits_at_once_without_a_report_or_a_retry() {
    let mut h = after_error(libc::ECANCELED);
    // The round that reaped it submitted it again (its cancelled list), uncounted.
    assert_eq!(h.submitted(), vec![0, 0]);
    assert_eq!(h.w.inflight.retries(0), 0);
    assert_eq!(h.state(), HealthState::Healthy);
    assert!(h.health.take_reports().0.is_empty());
    assert_eq!(h.status(0), UNWRITTEN);
    assert!(h.used().is_empty());
    h.device_completes(0, LEN as i32);
    h.round();
    assert_eq!(h.status(0), VIRTIO_BLK_S_OK as u8);
    assert_eq!(h.used(), vec![(0, LEN + 1)]);
    assert!(h.journaled().is_empty());
}

/// Runs timeout sweeps until one reports the hung request (the device then resets).
fn sweep_until_timed_out(h: &mut Harness) {
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(2));
        h.w.sweep_timeouts();
        if h.state() == HealthState::Resetting {
            return;
        }
    }
    panic!("the hung request was never reported as timed out");
}

#[test]
fn a_hung_request_times_out_is_retried_request_retries_times_then_fails_with_ioerr() {
    let retries = 2;
    let mut h = Harness::new(retries);
    // The kernel answers an aborted hung command with ETIMEDOUT (a path error).
    lock(&h.script).abort_with = Some(-libc::ETIMEDOUT);
    h.post_read(0);
    h.round();
    for attempt in 0..=retries {
        assert_eq!(h.submitted().len(), attempt as usize + 1);
        assert_eq!(h.journaled(), vec![0]);
        sweep_until_timed_out(&mut h);
        let (reports, _) = h.health.take_reports();
        assert!(
            reports
                .iter()
                .any(|r| r.signal == spool_devices::Signal::Timeout),
            "{reports:?}"
        );
        // The worker sees the reset, aborts the hung command, and holds the request (every
        // health change aborts: the reset and the recovery of each earlier attempt).
        h.round();
        assert_eq!(lock(&h.script).aborts, 2 * attempt as usize + 1);
        if attempt < retries {
            assert_eq!(h.w.inflight.held(), [0], "attempt {attempt}");
            assert_eq!(h.status(0), UNWRITTEN);
            assert!(h.used().is_empty());
            h.health.set(HealthState::Healthy);
            h.round();
        }
    }
    // Out of retries: failed, completed once, gone from the journal.
    assert!(!h.w.inflight.any_held());
    assert_eq!(h.submitted().len(), retries as usize + 1);
    assert_eq!(h.status(0), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(h.used(), vec![(0, LEN + 1)]);
    assert!(h.journaled().is_empty());
    assert_eq!(h.w.inflight.retries(0), 0);
}

#[test]
fn a_failed_device_fails_held_requests_at_once() {
    let mut h = Harness::new(2);
    h.health.set(HealthState::Resetting);
    let a = h.post_read(0);
    let b = h.post_read(1);
    h.round();
    // Held for the resetting device: taken and journaled, not submitted.
    assert!(h.submitted().is_empty());
    assert_eq!(h.w.inflight.held(), [a, b]);
    assert_eq!(h.journaled(), vec![a, b]);
    // The monitor gives up on the device: what is held fails now, not at some timeout.
    h.health.set(HealthState::Failed);
    h.round();
    assert!(h.submitted().is_empty());
    assert_eq!(h.status(a), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(h.status(b), VIRTIO_BLK_S_IOERR as u8);
    let mut used: Vec<u16> = h.used().iter().map(|u| u.0).collect();
    used.sort();
    assert_eq!(used, vec![a, b]);
    assert!(h.journaled().is_empty());
    // And a new request for it fails at once too.
    let c = h.post_read(2);
    h.round();
    assert!(h.submitted().is_empty());
    assert_eq!(h.status(c), VIRTIO_BLK_S_IOERR as u8);
    assert!(h.journaled().is_empty());
}

#[test]
fn a_device_reset_while_requests_are_held_resubmits_each_once_on_new_queues() {
    let mut h = Harness::new(2);
    let a = h.post_read(0);
    h.round();
    assert_eq!(h.submitted(), vec![a as u64]);
    // The device resets: `a`'s command is aborted and comes back cancelled, and `b`
    // arrives meanwhile; both are held.
    h.health.set(HealthState::Resetting);
    let b = h.post_read(1);
    h.round();
    assert_eq!(lock(&h.script).aborts, 1);
    assert_eq!(h.w.inflight.held(), [b, a]);
    assert_eq!(h.journaled(), vec![a, b]);
    assert!(h.used().is_empty());
    // The reset RPC: the device answers again and every queue is told to reset before it
    // has seen the health change.
    h.health.set(HealthState::Healthy);
    h.w.reset.store(true, Ordering::Release);
    h.round();
    let s = lock(&h.script);
    // Both went to the new queue, each once.
    assert_eq!(s.opened, 2);
    assert_eq!(s.submitted, vec![a as u64, a as u64, b as u64]);
    assert_eq!(s.outstanding, vec![a as u64, b as u64]);
    drop(s);
    assert!(!h.w.inflight.any_held());
    assert_eq!(h.status(a), UNWRITTEN);
    assert!(h.used().is_empty());
    h.device_completes(b, LEN as i32);
    h.device_completes(a, LEN as i32);
    h.round();
    assert_eq!(h.status(a), VIRTIO_BLK_S_OK as u8);
    assert_eq!(h.status(b), VIRTIO_BLK_S_OK as u8);
    assert_eq!(h.used(), vec![(b, LEN + 1), (a, LEN + 1)]);
    assert!(h.journaled().is_empty());
    assert_eq!(h.w.inflight.submitted(), 0);
}

#[test]
fn a_handoff_completes_what_the_devices_finish_and_leaves_the_rest_in_the_journal() {
    let mut h = Harness::new(2);
    let a = h.post_read(0);
    let b = h.post_read(1);
    h.round();
    h.device_completes(a, LEN as i32);
    // `b` hangs and its abort comes back cancelled: not completed, kept for the next process.
    h.w.drain(StopKind::Handoff);
    assert_eq!(h.used(), vec![(a, LEN + 1)]);
    assert_eq!(h.status(b), UNWRITTEN);
    assert_eq!(h.journaled(), vec![b]);
    assert_eq!(h.w.abandoned.load(Ordering::Acquire), 0);
}

#[test]
fn a_frontend_stop_waits_for_a_held_request_and_completes_it_once_its_device_is_back() {
    let mut h = after_error(libc::EIO);
    assert_eq!(h.w.inflight.held(), [0]);
    assert_eq!(h.state(), HealthState::Resetting);
    // The monitor brought the device back as the stop began; the device completes the
    // resubmitted read. The stop must wait for it, not answer with it outstanding.
    h.health.set(HealthState::Healthy);
    lock(&h.script).complete_at_once = Some(LEN as i32);
    h.w.drain(StopKind::Frontend);
    assert_eq!(h.submitted(), vec![0, 0]);
    assert_eq!(h.status(0), VIRTIO_BLK_S_OK as u8);
    assert_eq!(h.used(), vec![(0, LEN + 1)]);
    assert!(h.journaled().is_empty());
    assert!(!h.w.inflight.any_held());
}

#[test]
fn a_frontend_stop_fails_what_stays_held_past_the_window_and_leaves_no_inflight_head() {
    let mut h = after_error(libc::EIO);
    let b = h.post_read(1);
    h.round();
    // The device stays resetting: both are held, then both fail past the window.
    assert_eq!(h.w.inflight.held(), [0, b]);
    h.w.drain(StopKind::Frontend);
    assert_eq!(h.status(0), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(h.status(b), VIRTIO_BLK_S_IOERR as u8);
    let mut used = h.used();
    used.sort();
    assert_eq!(used, vec![(0, 1), (b, 1)]);
    assert!(h.journaled().is_empty());
    assert!(!h.w.inflight.any_held() && !h.w.inflight.any_cancelled());
    assert_eq!(h.w.inflight.submitted(), 0);
}

#[test]
fn a_frontend_stop_submits_a_cancelled_request_again_and_completes_it() {
    let mut h = Harness::new(2);
    let a = h.post_read(0);
    h.round();
    // A queue pair lost under the request (an NVMe abort): it comes back cancelled.
    h.device_completes(a, -libc::ECANCELED);
    lock(&h.script).complete_at_once = Some(LEN as i32);
    h.w.drain(StopKind::Frontend);
    assert_eq!(h.submitted(), vec![a as u64, a as u64]);
    assert_eq!(h.status(a), VIRTIO_BLK_S_OK as u8);
    assert_eq!(h.used(), vec![(a, LEN + 1)]);
    assert!(h.journaled().is_empty());
}

#[test]
fn a_reset_quarantines_a_command_that_never_completes_and_resubmits_its_request() {
    let mut h = Harness::new(2);
    lock(&h.script).abort_with = None;
    let a = h.post_read(0);
    h.round();
    h.w.reset.store(true, Ordering::Release);
    h.round();
    // The hung command's queue is kept (leaked) with the guest memory it may still write,
    // the volume is told, and the request goes to a new queue.
    assert_eq!(h.w.abandoned.load(Ordering::Acquire), 1);
    assert_eq!(lock(&h.script).opened, 2);
    assert_eq!(h.submitted(), vec![a as u64, a as u64]);
    assert_eq!(h.w.dev.queues.len(), 1);
    assert_eq!(h.status(a), UNWRITTEN);
    h.device_completes(a, LEN as i32);
    h.round();
    assert_eq!(h.status(a), VIRTIO_BLK_S_OK as u8);
    assert_eq!(h.used(), vec![(a, LEN + 1)]);
    assert!(h.journaled().is_empty());
}

/// The scripted device as RBD behaves: an abort cannot take a command back, abandoning it
/// can (its late callback then writes nothing into guest memory).
fn like_rbd(h: &Harness) {
    let mut s = lock(&h.script);
    s.abort_with = None;
    s.abandon_with = Some(-libc::ECANCELED);
}

#[test]
fn a_reset_gives_up_an_operation_it_can_abandon_instead_of_quarantining_it() {
    let mut h = Harness::new(2);
    like_rbd(&h);
    let a = h.post_read(0);
    h.round();
    h.w.reset.store(true, Ordering::Release);
    h.round();
    assert_eq!(lock(&h.script).abandons, 1);
    assert_eq!(
        h.w.abandoned.load(Ordering::Acquire),
        0,
        "nothing quarantined"
    );
    assert_eq!(h.submitted(), vec![a as u64, a as u64]);
    h.device_completes(a, LEN as i32);
    h.round();
    assert_eq!(h.status(a), VIRTIO_BLK_S_OK as u8);
    assert_eq!(h.used(), vec![(a, LEN + 1)]);
    assert!(h.journaled().is_empty());
}

#[test]
fn a_frontend_stop_fails_an_abandoned_operation_past_the_window() {
    let mut h = Harness::new(2);
    like_rbd(&h);
    let a = h.post_read(0);
    h.round();
    h.w.drain(StopKind::Frontend);
    assert_eq!(lock(&h.script).abandons, 1);
    assert_eq!(
        h.w.abandoned.load(Ordering::Acquire),
        0,
        "nothing quarantined"
    );
    assert_eq!(h.status(a), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(h.used(), vec![(a, 1)]);
    assert!(h.journaled().is_empty());
}

#[test]
fn a_handoff_quarantines_a_command_that_never_completes_and_keeps_it_in_the_journal() {
    let mut h = Harness::new(2);
    lock(&h.script).abort_with = None;
    let a = h.post_read(0);
    h.round();
    h.w.drain(StopKind::Handoff);
    assert_eq!(h.w.abandoned.load(Ordering::Acquire), 1);
    assert!(h.w.dev.queues.is_empty());
    assert_eq!(h.status(a), UNWRITTEN);
    assert!(h.used().is_empty());
    assert_eq!(h.journaled(), vec![a]);
}

#[test]
fn a_frontend_stop_quarantines_a_command_that_never_completes_and_fails_its_request() {
    let mut h = Harness::new(2);
    lock(&h.script).abort_with = None;
    let a = h.post_read(0);
    h.round();
    h.w.drain(StopKind::Frontend);
    assert_eq!(h.w.abandoned.load(Ordering::Acquire), 1);
    assert!(h.w.dev.queues.is_empty());
    assert_eq!(h.status(a), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(h.used(), vec![(a, 1)]);
    assert!(h.journaled().is_empty());
}

#[test]
fn a_throttled_worker_leaves_requests_in_the_avail_ring_until_time_passes() {
    use spool_pool::QosLimits;
    const SEC: u64 = 1_000_000_000;
    let mut h = Harness::new(2);
    let qos = h.w.pace.qos_shared.clone();
    qos.set_manual_now(1);
    // 1 IOPS with a 1 s burst: the bucket holds one op; the worker takes while it is not
    // in debt, so two requests go at once and the third waits a second.
    let mut l = (*h.w.dev.layout).clone();
    l.qos = Some(QosLimits {
        iops: 1,
        ..Default::default()
    });
    h.w.dev.src.store(Arc::new(l));
    let heads: Vec<u16> = (0..3).map(|k| h.post_read(k)).collect();
    h.round();
    assert_eq!(h.submitted(), vec![heads[0] as u64, heads[1] as u64]);
    let wait = h.w.pace.throttled.expect("throttled");
    assert!(wait > SEC / 2 && wait <= SEC + 1, "wait {wait}");
    // Completions are still reaped and given to the guest while throttled.
    h.device_completes(heads[0], LEN as i32);
    h.round();
    assert_eq!(h.used(), vec![(heads[0], LEN + 1)]);
    assert_eq!(
        h.submitted().len(),
        2,
        "the third request stays in the avail ring"
    );
    assert_eq!(h.journaled(), vec![heads[1]]);
    // A second later the debt is paid and the third is taken.
    qos.set_manual_now(1 + SEC + 1);
    h.round();
    assert_eq!(h.submitted().last(), Some(&(heads[2] as u64)));
    // Lifting the limits takes effect on the next round: nothing is checked any more.
    let mut l = (*h.w.dev.layout).clone();
    l.qos = None;
    h.w.dev.src.store(Arc::new(l));
    h.post_read(3);
    h.post_read(4);
    h.round();
    assert_eq!(h.submitted().len(), 5);
    assert!(h.w.pace.qos.is_none() && h.w.pace.throttled.is_none());
}

#[test]
fn a_volume_held_by_its_limits_does_not_hold_the_others_to_its_pace() {
    use spool_pool::QosLimits;
    let mut h = Harness::new(2);
    h.w.pace.qos_shared.set_manual_now(1);
    h.w.pace.share = h.w.pace.share_group.join(100);
    // Another volume, busy; their threads take turns at a core.
    let other = h.w.pace.share_group.join(100);
    h.w.pace.share_group.queue_busy(&other);
    h.w.pace.share.set_contended(true);
    other.set_contended(true);
    let mut l = (*h.w.dev.layout).clone();
    l.qos = Some(QosLimits {
        iops: 1,
        ..Default::default()
    });
    h.w.dev.src.store(Arc::new(l));
    for k in 0..3 {
        h.post_read(k);
    }
    h.round();
    assert!(
        h.w.pace.throttled.is_some(),
        "the third request waits for its budget"
    );
    // The other runs well ahead of this one in service.
    other.charge(10 * crate::share::WINDOW);
    assert!(
        h.w.pace.share_group.may_take(&other),
        "the capped volume, requests waiting in its ring, must not hold the other back"
    );
}

/// A queue that had more than one request in flight and drained leaves its volume busy
/// for `share::LINGER` (its client was most likely off its core), holding a volume far ahead
/// of it; a queue that ran at QD1 leaves it idle at once.
#[test]
fn a_queue_that_ran_deep_and_drained_keeps_its_volume_busy_for_a_while() {
    for depth in [2u16, 1] {
        let mut h = Harness::new(2);
        h.w.pace.share = h.w.pace.share_group.join(100);
        let other = h.w.pace.share_group.join(100);
        h.w.pace.share_group.queue_busy(&other);
        // Their threads take turns at a core (else nobody is held back).
        h.w.pace.share.set_contended(true);
        other.set_contended(true);
        let heads: Vec<u16> = (0..depth).map(|k| h.post_read(k)).collect();
        h.round();
        for head in heads {
            h.device_completes(head, LEN as i32);
        }
        h.round();
        assert_eq!(h.used().len(), depth as usize);
        h.w.note_idle();
        other.charge(10 * crate::share::WINDOW);
        assert_eq!(
            h.w.pace.share_group.may_take(&other),
            depth == 1,
            "depth {depth}: the drained volume {} the other back",
            if depth == 1 {
                "must not hold"
            } else {
                "lingers and holds"
            }
        );
    }
}

/// On a volume whose devices do their I/O inline (a file on tmpfs), a round takes at most
/// `INLINE_TAKE_BUDGET` requests, so the guest sees the first ones complete while the rest
/// wait; the next round takes the rest. On other devices, or with the thread's cores
/// contended, a round takes everything.
#[test]
fn a_round_on_inline_devices_takes_a_bounded_batch() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let opts = spool_devices::OpenOptions {
        create_size: Some(SIZE),
        ..Default::default()
    };
    let file = Arc::new(Device::open(&dir.path().join("d.img"), &opts).unwrap());
    assert!(file.inline_io(), "a file on tmpfs does its I/O inline");
    let budget = super::INLINE_TAKE_BUDGET as usize;
    for (mut h, first) in [
        (Harness::on(0, file), budget),
        (Harness::new(0), budget + 1),
    ] {
        for k in 0..=budget as u16 {
            h.post_read(k);
        }
        h.round();
        assert_eq!(h.submitted().len(), first);
        h.round();
        assert_eq!(h.submitted().len(), budget + 1);
    }
}
