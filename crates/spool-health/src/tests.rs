//! The classification table of docs/failures.md, row by row, against real file devices with
//! injected faults: each row feeds one signal and asserts the state the monitor moves to.

use super::*;
use spool_devices::{ErrorReport, FaultEffect, FaultOps, FaultRule, OpenOptions, Signal};

fn device(dir: &tempfile::TempDir, name: &str) -> Arc<Device> {
    Arc::new(
        Device::open(
            &dir.path().join(name),
            &OpenOptions {
                create_size: Some(8 << 20),
                no_direct: true,
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

fn policy() -> Policy {
    Policy {
        reset_timeout: Duration::from_millis(300),
        poll_interval: Duration::from_millis(20),
        ..Policy::default()
    }
}

fn errno(e: i32, write: bool) -> ErrorReport {
    ErrorReport {
        signal: Signal::Errno(e),
        offset: 4096,
        len: 4096,
        write,
    }
}

fn wait_state(m: &Monitor, uuid: Uuid, want: &str) -> DeviceReport {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = m.reports().into_iter().find(|r| r.device == uuid).unwrap();
        if r.state == want {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "device stayed {} ({}), wanted {want}",
            r.state,
            r.reason
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Feeds `report` to a fresh device and returns the state it settles in.
fn row(report: Option<ErrorReport>, setup: impl Fn(&Device), want: &str) -> DeviceReport {
    let dir = tempfile::tempdir().unwrap();
    let m = Monitor::start(policy());
    let dev = device(&dir, "d");
    let uuid = Uuid::new_v4();
    m.watch(uuid, dev.clone());
    setup(&dev);
    let reported = report.is_some();
    if let Some(r) = report {
        dev.health().report(r);
    }
    // Settle: the report counted (so that a device that starts in the state wanted is not
    // taken for one that came back to it), then the state wanted.
    let deadline = Instant::now() + Duration::from_secs(10);
    while reported && !counted(&m, uuid) {
        assert!(
            Instant::now() < deadline,
            "the monitor never took the report"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let r = wait_state(&m, uuid, want);
    m.stop();
    r
}

/// Whether the monitor has counted an error report of device `uuid`.
fn counted(m: &Monitor, uuid: Uuid) -> bool {
    let r = m.reports().into_iter().find(|r| r.device == uuid).unwrap();
    let c = &r.counters;
    c.media_errors + c.path_errors + c.timeouts + c.gone_errors + c.request_errors > 0
}

#[test]
fn media_errors_isolate_the_device() {
    let r = row(Some(errno(libc::ENODATA, false)), |_| {}, "failed");
    assert_eq!(r.counters.media_errors, 1);
    assert!(r.reason.contains("media error"), "{}", r.reason);
    let r = row(Some(errno(libc::EILSEQ, true)), |_| {}, "failed");
    assert!(r.reason.contains("replace"), "{}", r.reason);
}

#[test]
fn path_errors_and_timeouts_reset_and_come_back() {
    for e in [libc::EIO, libc::ENOLINK, libc::ETIMEDOUT] {
        let r = row(Some(errno(e, true)), |_| {}, "healthy");
        assert_eq!(r.counters.resets, 1, "errno {e}");
        assert_eq!(r.counters.path_errors, 1);
        assert!(r.reason.contains("reset done"), "{}", r.reason);
    }
    let r = row(
        Some(ErrorReport {
            signal: Signal::Timeout,
            offset: 0,
            len: 512,
            write: false,
        }),
        |_| {},
        "healthy",
    );
    assert_eq!((r.counters.timeouts, r.counters.resets), (1, 1));
}

/// A worker's path report that lands between the monitor taking the reports and looking at
/// the state (forced here: the test holds the monitor's lock and runs its round by hand)
/// resets the device once, not once for the state and again for the report.
#[test]
fn a_report_racing_the_monitor_resets_once() {
    let dir = tempfile::tempdir().unwrap();
    let m = Monitor::start(policy());
    let dev = device(&dir, "d");
    let uuid = Uuid::new_v4();
    m.watch(uuid, dev.clone());
    {
        let mut inner = m.lock();
        let w = &mut inner.devices[0];
        let taken = w.dev.health().take_reports_with_state();
        assert_eq!(taken.0, HealthState::Healthy);
        assert!(taken.1.is_empty());
        dev.health().report(errno(libc::EIO, true));
        assert_eq!(dev.health().state(), HealthState::Resetting);
        m.step_taken(w, taken, &mut |_| {});
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !counted(&m, uuid) {
        assert!(
            Instant::now() < deadline,
            "the monitor never took the report"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The round that counts the report is the one a second reset would begin and end in
    // (the probe answers at once), under the lock `reports` takes: seen together.
    let r = wait_state(&m, uuid, "healthy");
    m.stop();
    assert_eq!(
        (r.counters.path_errors, r.counters.resets),
        (1, 1),
        "{}",
        r.reason
    );
}

#[test]
fn a_link_that_stays_down_past_the_reset_timeout_fails_the_device() {
    let link_down = |ms: u64| {
        move |d: &Device| {
            d.faults().add(FaultRule {
                effect: FaultEffect::Errno(libc::EIO),
                ops: FaultOps::Any,
                offset: 0,
                len: 0,
                count: None,
                duration: Some(Duration::from_millis(ms)),
                fails_probe: true,
            });
        }
    };
    // Down for less than the reset timeout: the probes fail, then one succeeds.
    let r = row(Some(errno(libc::EIO, false)), link_down(100), "healthy");
    assert!(r.counters.failed_probes >= 1, "{:?}", r.counters);
    assert_eq!(r.counters.resets, 1);
    // Down for longer: escalated to failed.
    let r = row(Some(errno(libc::EIO, false)), link_down(5_000), "failed");
    assert!(r.reason.contains("did not come back"), "{}", r.reason);
}

#[test]
fn removal_is_seen_from_errors_and_from_a_deleted_file() {
    let r = row(Some(errno(libc::ENODEV, false)), |_| {}, "removed");
    assert_eq!(r.counters.gone_errors, 1);
    let r = row(None, |d| std::fs::remove_file(d.path()).unwrap(), "removed");
    assert!(r.reason.contains("deleted"), "{}", r.reason);
}

#[test]
fn smart_critical_warnings_isolate_only_for_wear() {
    for bit in [0u8, 2, 3] {
        let r = row(None, |d| d.faults().set_smart_warning(1 << bit), "failed");
        assert!(r.reason.contains("SMART"), "{}", r.reason);
    }
    let dir = tempfile::tempdir().unwrap();
    let m = Monitor::start(policy());
    let dev = device(&dir, "d");
    let uuid = Uuid::new_v4();
    m.watch(uuid, dev.clone());
    dev.faults().set_smart_warning(1 << 1);
    std::thread::sleep(Duration::from_millis(150));
    wait_state(&m, uuid, "healthy");
    let (events, _) = m.events(0);
    assert!(
        events
            .iter()
            .any(|e| e.kind == "warning" && e.reason.contains("temperature")),
        "{events:?}"
    );
}

#[test]
fn request_errors_fail_the_request_only() {
    let r = row(Some(errno(libc::EINVAL, true)), |_| {}, "healthy");
    assert_eq!((r.counters.request_errors, r.counters.resets), (1, 0));
}

#[test]
fn the_media_threshold_is_a_policy() {
    let dir = tempfile::tempdir().unwrap();
    let m = Monitor::start(Policy {
        media_errors_to_fail: 3,
        ..policy()
    });
    let dev = device(&dir, "d");
    let uuid = Uuid::new_v4();
    m.watch(uuid, dev.clone());
    dev.health().report(errno(libc::ENODATA, false));
    dev.health().report(errno(libc::ENODATA, false));
    std::thread::sleep(Duration::from_millis(120));
    assert_eq!(wait_state(&m, uuid, "healthy").counters.media_errors, 2);
    dev.health().report(errno(libc::ENODATA, false));
    wait_state(&m, uuid, "failed");
}

#[test]
fn events_are_numbered_and_the_hook_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("hook.out");
    let m = Monitor::start(Policy {
        hook: Some(format!(
            "echo \"$SPOOL_EVENT_KIND $SPOOL_EVENT_TO $SPOOL_EVENT_DEVICE\" >> {}",
            out.display()
        )),
        ..policy()
    });
    let dev = device(&dir, "d");
    let uuid = Uuid::new_v4();
    m.watch(uuid, dev.clone());
    dev.health().report(errno(libc::EIO, false));
    std::thread::sleep(Duration::from_millis(120));
    wait_state(&m, uuid, "healthy");
    let (events, last) = m.events(0);
    let kinds: Vec<_> = events.iter().map(|e| (e.seq, e.to)).collect();
    assert_eq!(kinds, vec![(1, Some("resetting")), (2, Some("healthy"))]);
    assert_eq!(last, 2);
    assert!(m.events(2).0.is_empty());
    let hook_lines = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            if text.lines().count() == n {
                return text;
            }
            assert!(Instant::now() < deadline, "hook output: {text:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let text = hook_lines(2);
    assert!(text.contains(&format!("state healthy {uuid}")), "{text}");
    // A replacement is an event too, and resets the counters.
    let new = device(&dir, "e");
    let new_uuid = Uuid::new_v4();
    m.replace(uuid, new_uuid, new);
    let (events, _) = m.events(2);
    assert_eq!(events[0].kind, "replaced");
    assert_eq!(m.reports().len(), 1);
    assert_eq!(m.reports()[0].device, new_uuid);
    // Its hook runs too: waited for, so that no hook outlives the directory it writes in.
    let text = hook_lines(3);
    assert!(
        text.lines().nth(2).unwrap().starts_with("replaced"),
        "{text}"
    );
    m.stop();
}

/// An isolation is handed to the recorder before the state is set: whoever sees the device
/// failed (a worker, `device_health`) can count on it being kept, even if the process dies
/// at once (the isolation used to be kept by an event listener after the state was
/// visible, and a worker killed in between came back with the device healthy).
#[test]
fn an_isolation_is_recorded_before_anyone_sees_it() {
    let dir = tempfile::tempdir().unwrap();
    let m = Monitor::start(policy());
    let dev = device(&dir, "d");
    let uuid = Uuid::new_v4();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (d, s) = (dev.clone(), seen.clone());
    m.record_isolations(move |u, state, why| {
        s.lock()
            .unwrap()
            .push((u, state, d.health().state(), why.to_string()));
    });
    m.watch(uuid, dev.clone());
    dev.health().report(errno(libc::ENODATA, false));
    wait_state(&m, uuid, "failed");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    let (u, state, before, why) = &seen[0];
    assert_eq!((*u, *state), (uuid, HealthState::Failed));
    assert_eq!(*before, HealthState::Healthy, "recorded after it was set");
    assert!(why.contains("media error"), "{why}");
    m.stop();
}
