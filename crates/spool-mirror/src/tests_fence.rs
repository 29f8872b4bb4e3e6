//! A mirror fenced off (its volume promoted on the host its far leg is on,
//! docs/replicas.md): writes waiting for that leg, and every later one, fail at once;
//! reads go on; a mirror reopened over the same regions stays fenced.

use super::tests::{file_device, run, spec, wait_until, MIB};
use super::*;

#[test]
fn a_fenced_mirror_fails_its_writes_and_serves_its_reads() {
    let d = tempfile::tempdir().unwrap();
    let devs = vec![file_device(d.path(), "a"), file_device(d.path(), "b")];
    let mut s = spec(d.path(), devs.clone(), false);
    s.legs[1].far = true;
    let mirror = Mirror::open(s.clone()).unwrap();
    let m = mirror.device().clone();
    let mut q = m.open_queue(8).unwrap();
    assert_eq!(run(&mut *q, true, MIB, &mut [7u8; 4096]), 0);
    wait_until("the far leg caught up and required", || {
        mirror.progress().legs[1].required
    });
    // The far leg's host is away: writes wait (a path error the worker holds).
    devs[1].health().set(HealthState::Resetting);
    assert_eq!(run(&mut *q, true, 0, &mut [1u8; 4096]), -libc::ENOLINK);
    wait_until("mirror resetting", || {
        m.health().state() == HealthState::Resetting
    });
    // It was promoted there: nothing waits any more, and no write completes here.
    assert!(!mirror.fenced());
    mirror.fence();
    wait_until("mirror healthy: nothing to wait for", || {
        m.health().state() == HealthState::Healthy
    });
    assert_eq!(run(&mut *q, true, 0, &mut [1u8; 4096]), -libc::EROFS);
    let mut back = vec![0u8; 4096];
    assert_eq!(run(&mut *q, false, MIB, &mut back), 0, "reads go on");
    assert_eq!(back, vec![7u8; 4096]);
    // SAFETY: a flush carries no buffers.
    unsafe { q.submit(spool_devices::DeviceIo::Flush, 3) };
    q.kick().unwrap();
    let mut res = None;
    wait_until("the flush answered", || {
        q.reap(&mut |_, r| res = Some(r));
        res.is_some()
    });
    assert_eq!(res, Some(-libc::EROFS));
    drop(q);
    let again = Mirror::open_after(s, Some(&mirror)).unwrap();
    assert!(again.fenced(), "a reopened mirror forgot the fence");
}
