//! The mirror on real files through real queues (io_uring or inline): writes reach every
//! leg, a failing leg costs no request, missed regions are copied back, a crash's intent
//! regions are resynced, reads move to another leg after a media error.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use spool_devices::{DeviceIo, FaultEffect, FaultOps, FaultRule, IoVec, OpenOptions};

pub(super) const MIB: u64 = 1 << 20;
pub(super) const SIZE: u64 = 8 * MIB;

pub(super) fn file_device(dir: &Path, name: &str) -> Arc<Device> {
    let opts = OpenOptions {
        create_size: Some(16 * MIB),
        no_direct: true,
        ..Default::default()
    };
    Arc::new(Device::open(&dir.join(name), &opts).unwrap())
}

/// Three file devices in `dir` (a, b, c).
pub(super) fn three_devices(dir: &Path) -> Vec<Arc<Device>> {
    ["a", "b", "c"].map(|n| file_device(dir, n)).to_vec()
}

/// Leg 0 on device 0 at 1 MiB; leg 1 on device 1 in two pieces (at 1 MiB and 9 MiB), so
/// requests can straddle a piece boundary.
pub(super) fn spec(dir: &Path, devices: Vec<Arc<Device>>, synced1: bool) -> MirrorSpec {
    if !dir.join("bitmap").exists() && synced1 {
        // A new volume: both legs zeroed files, identical.
        create_clean_bitmap(&dir.join("bitmap"), SIZE).unwrap();
    }
    let half = SIZE / 2;
    MirrorSpec {
        name: "t".into(),
        size: SIZE,
        devices,
        legs: vec![
            LegSpec {
                slot: 0,
                id: 10,
                synced: true,
                far: false,
                pieces: vec![LegPiece {
                    logical: 0,
                    len: SIZE,
                    device: 0,
                    offset: MIB,
                }],
            },
            LegSpec {
                slot: 1,
                id: 11,
                synced: synced1,
                far: false,
                pieces: vec![
                    LegPiece {
                        logical: 0,
                        len: half,
                        device: 1,
                        offset: MIB,
                    },
                    LegPiece {
                        logical: half,
                        len: half,
                        device: 1,
                        offset: 9 * MIB,
                    },
                ],
            },
        ],
        bitmap: Some(dir.join("bitmap")),
        resync_rate: 0,
    }
}

/// A rule failing `ops` on the whole device with `errno`, `count` times (None: until cleared).
pub(super) fn errno_rule(ops: FaultOps, errno: i32, count: Option<u64>) -> FaultRule {
    FaultRule {
        effect: FaultEffect::Errno(errno),
        ops,
        offset: 0,
        len: 0,
        count,
        duration: None,
        fails_probe: false,
    }
}

/// Two file devices and a new mirror over them (identical, zeroed legs).
pub(super) fn setup(d: &Path) -> (Vec<Arc<Device>>, Mirror) {
    let devs = vec![file_device(d, "a"), file_device(d, "b")];
    (devs.clone(), Mirror::open(spec(d, devs, true)).unwrap())
}

pub(super) fn leg_bytes(dev: &Device, offsets: &[(u64, u64)]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(off, len) in offsets {
        let mut b = vec![0u8; len as usize];
        dev.read_at(&mut b, off).unwrap();
        out.extend(b);
    }
    out
}

pub(super) fn legs_of(devs: &[Arc<Device>]) -> (Vec<u8>, Vec<u8>) {
    let a = leg_bytes(&devs[0], &[(MIB, SIZE)]);
    let b = leg_bytes(&devs[1], &[(MIB, SIZE / 2), (9 * MIB, SIZE / 2)]);
    (a, b)
}

/// Runs one request through `q` and returns its result.
pub(super) fn run(q: &mut dyn DeviceQueue, write: bool, offset: u64, buf: &mut [u8]) -> i32 {
    let iov = [IoVec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    }];
    // SAFETY: `iov` and `buf` live until the completion is reaped below.
    unsafe {
        q.submit(
            DeviceIo::data(write, offset, buf.len() as u64, iov.as_ptr(), 1),
            7,
        )
    };
    q.kick().unwrap();
    let t0 = Instant::now();
    loop {
        let mut res = None;
        q.reap(&mut |tag, r| {
            assert_eq!(tag, 7);
            res = Some(r)
        });
        if let Some(r) = res {
            return r;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "request never completed"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

pub(super) fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn writes_reach_every_leg_including_across_a_piece_boundary() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m_mirror) = setup(d.path());
    let m = m_mirror.device().clone();
    let mut q = m.open_queue(64).unwrap();
    let mut data: Vec<u8> = (0..2 * MIB).map(|i| (i * 7 % 251) as u8).collect();
    // 2 MiB straddling leg 1's piece boundary at 4 MiB.
    assert_eq!(run(&mut *q, true, 3 * MIB, &mut data), 0);
    let (a, b) = legs_of(&devs);
    assert_eq!(&a[3 * MIB as usize..5 * MIB as usize], &data[..]);
    assert_eq!(a, b, "legs differ");
    let mut back = vec![0u8; 2 * MIB as usize];
    for _ in 0..3 {
        assert_eq!(run(&mut *q, false, 3 * MIB, &mut back), 0);
        assert_eq!(back, data);
    }
    let v = m_mirror.verify().unwrap();
    assert_eq!((v.regions_differing, v.regions_skipped), (0, 0), "{v:?}");
}

/// A leg's failed piece is reported to its device's health with the device range it
/// covered, as a plain volume's pieces are (it was reported at offset 0, length 0).
#[test]
fn a_legs_failed_piece_is_reported_with_its_device_range() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m) = setup(d.path());
    let mut q = m.device().open_queue(64).unwrap();
    devs[1]
        .faults()
        .add(errno_rule(FaultOps::Write, libc::EIO, None));
    let _ = devs[1].health().take_reports();
    let mut data = vec![0x5a_u8; 64 * 1024];
    assert_eq!(run(&mut *q, true, 6 * MIB, &mut data), 0);
    let (reports, _) = devs[1].health().take_reports();
    // Volume byte 6 MiB is 2 MiB into leg 1's second piece, at 9 MiB of device 1.
    let r = reports.first().expect("the failed piece was reported");
    assert_eq!((r.offset, r.len, r.write), (11 * MIB, 64 * 1024, true));
}

#[test]
fn a_failing_leg_costs_no_request_and_is_caught_up_when_healthy_again() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m_mirror) = setup(d.path());
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    let mut q = m.open_queue(64).unwrap();
    devs[1]
        .faults()
        .add(errno_rule(FaultOps::Write, libc::EIO, None));
    let mut data = vec![0x5a_u8; 64 * 1024];
    assert_eq!(
        run(&mut *q, true, MIB, &mut data),
        0,
        "the write succeeds on leg 0"
    );
    // The EIO put leg 1's device into resetting: further writes skip it.
    assert_eq!(devs[1].health().state(), HealthState::Resetting);
    assert_eq!(run(&mut *q, true, 6 * MIB, &mut data), 0);
    let p = mirror.progress();
    assert_eq!(p.legs[1].state, "unusable");
    assert_eq!(
        p.legs[1].stale_bytes,
        2 * MIB,
        "regions 1 and 6 missed on leg 1"
    );
    // Reads come from leg 0 only.
    let mut back = vec![0u8; data.len()];
    assert_eq!(run(&mut *q, false, 6 * MIB, &mut back), 0);
    assert_eq!(back, data);
    // The monitor's job, here by hand: the device is reset and healthy again.
    devs[1].faults().clear();
    devs[1].health().set(HealthState::Healthy);
    wait_until("leg 1 caught up", || {
        mirror.progress().legs[1].state == "current"
    });
    let (a, b) = legs_of(&devs);
    assert_eq!(a, b, "legs differ after catching up");
    assert_eq!(
        mirror.progress().regions_copied,
        2,
        "only the missed regions were copied"
    );
}

#[test]
fn a_crash_leaves_intent_regions_that_are_resynced_at_open() {
    let d = tempfile::tempdir().unwrap();
    let devs = vec![file_device(d.path(), "a"), file_device(d.path(), "b")];
    {
        let m_mirror = Mirror::open(spec(d.path(), devs.clone(), true)).unwrap();
        let m = m_mirror.device().clone();
        let mut q = m.open_queue(64).unwrap();
        let mut data = vec![1u8; 4096];
        assert_eq!(run(&mut *q, true, 2 * MIB, &mut data), 0);
        // What a host crash mid-write leaves: leg 0 got a later write, leg 1 did not.
        devs[0]
            .write_at_durable(&[9u8; 4096], MIB + 2 * MIB)
            .unwrap();
        // Gone without its intent bits cleared (they clear after a quiet second).
        drop(q);
        drop(m);
        drop(m_mirror);
    }
    // After a reboot the write counters say nothing (here: gone); the intent bits decide.
    std::fs::remove_file(d.path().join("bitmap.writes")).unwrap();
    let m_mirror = Mirror::open(spec(d.path(), devs.clone(), true)).unwrap();
    let mirror = &m_mirror;
    assert_eq!(
        mirror.resync_at_open(),
        1,
        "only the region written is in doubt"
    );
    wait_until("resync", || {
        mirror.progress().legs.iter().all(|l| l.state == "current")
    });
    let (a, b) = legs_of(&devs);
    assert_eq!(a, b, "legs differ after the resync");
    assert_eq!(mirror.verify().unwrap().regions_differing, 0);
}

#[test]
fn a_new_leg_is_rebuilt_and_a_lost_bitmap_resyncs_everything() {
    let d = tempfile::tempdir().unwrap();
    let devs = vec![file_device(d.path(), "a"), file_device(d.path(), "b")];
    devs[0]
        .write_at_durable(&vec![3u8; SIZE as usize], MIB)
        .unwrap();
    let m_mirror = Mirror::open(spec(d.path(), devs.clone(), false)).unwrap();
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    assert_eq!(mirror.progress().legs[1].state, "catching-up");
    // Reads never see the leg being rebuilt.
    let mut q = m.open_queue(64).unwrap();
    let mut back = vec![0u8; 4096];
    for i in 0..8 {
        assert_eq!(run(&mut *q, false, i * MIB, &mut back), 0);
        assert!(back.iter().all(|&b| b == 3));
    }
    wait_until("rebuild", || mirror.leg_current(1));
    assert_eq!(legs_of(&devs).0, legs_of(&devs).1);
    drop(q);
    drop(m);
    drop(m_mirror);
    // The bitmap lost: every region is in doubt and copied from the synced leg.
    std::fs::remove_file(d.path().join("bitmap")).unwrap();
    devs[1].write_at_durable(&[8u8; 4096], MIB).unwrap();
    let s = spec(d.path(), devs.clone(), true);
    std::fs::remove_file(d.path().join("bitmap")).unwrap();
    let m_mirror = Mirror::open(s).unwrap();
    let mirror = &m_mirror;
    assert_eq!(mirror.resync_at_open(), 8);
    wait_until("full resync", || mirror.leg_current(1));
    assert_eq!(legs_of(&devs).0, legs_of(&devs).1);
}

#[test]
fn a_media_error_on_read_moves_to_the_other_leg_and_repairs_the_range() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m_mirror) = setup(d.path());
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    let mut q = m.open_queue(64).unwrap();
    let mut data = vec![0x42_u8; 8192];
    assert_eq!(run(&mut *q, true, 5 * MIB, &mut data), 0);
    // Leg 0 is read first; it fails once with a media error and leg 1 answers.
    devs[0]
        .faults()
        .add(errno_rule(FaultOps::Read, libc::ENODATA, Some(1)));
    let mut back = vec![0u8; data.len()];
    assert_eq!(run(&mut *q, false, 5 * MIB, &mut back), 0);
    assert_eq!(back, data);
    assert_eq!(devs[0].faults().injected(), 1, "leg 0 was tried first");
    // The failed range's region is rewritten on leg 0 from leg 1.
    wait_until("repair", || {
        mirror.progress().regions_copied == 1 && mirror.leg_current(0)
    });
    assert_eq!(legs_of(&devs).0, legs_of(&devs).1);
}

#[test]
fn with_no_usable_leg_requests_fail_as_path_errors_and_the_mirror_follows() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m_mirror) = setup(d.path());
    let m = m_mirror.device().clone();
    let mut q = m.open_queue(64).unwrap();
    for dev in &devs {
        dev.health().set(HealthState::Resetting);
    }
    let mut data = vec![1u8; 4096];
    assert_eq!(run(&mut *q, true, 0, &mut data), -libc::ENOLINK);
    wait_until("mirror resetting", || {
        m.health().state() == HealthState::Resetting
    });
    devs[0].health().set(HealthState::Healthy);
    wait_until("mirror healthy", || {
        m.health().state() == HealthState::Healthy
    });
    assert_eq!(run(&mut *q, true, 0, &mut data), 0);
    devs[0].health().set(HealthState::Failed);
    devs[1].health().set(HealthState::Removed);
    wait_until("mirror failed", || {
        m.health().state() == HealthState::Failed
    });
}

#[test]
fn a_hung_leg_is_aborted_when_the_worker_asks_and_costs_no_request() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m_mirror) = setup(d.path());
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    let mut q = m.open_queue(64).unwrap();
    devs[1].faults().add(FaultRule {
        effect: FaultEffect::Hang,
        ops: FaultOps::Write,
        offset: 0,
        len: 0,
        count: Some(1),
        duration: None,
        fails_probe: false,
    });
    let mut data = vec![7u8; 4096];
    let iov = [IoVec {
        iov_base: data.as_mut_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    }];
    let submitted = Instant::now();
    // SAFETY: `iov` and `data` outlive the completion reaped below.
    unsafe { q.submit(DeviceIo::data(true, 0, 4096, iov.as_ptr(), 1), 9) };
    q.kick().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let mut res = None;
    q.reap(&mut |_, r| res = Some(r));
    assert_eq!(res, None, "leg 1 hangs: the write waits for it");
    // Too early: the hang is not yet old enough to be told from a slow device (checked only
    // when this thread was not itself held up past the threshold on a loaded machine).
    if submitted.elapsed() < Duration::from_millis(80) {
        assert_eq!(q.abort(), 0);
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(q.abort(), 1, "the hung leg device's command is aborted");
    assert_eq!(devs[1].health().state(), HealthState::Resetting);
    q.reap(&mut |_, r| res = Some(r));
    assert_eq!(res, Some(0), "the write succeeds on leg 0");
    assert_eq!(mirror.progress().legs[1].stale_bytes, MIB);
}

#[test]
fn a_write_that_reaches_only_a_leg_being_rebuilt_fails_and_marks_nothing() {
    let d = tempfile::tempdir().unwrap();
    let devs = vec![file_device(d.path(), "a"), file_device(d.path(), "b")];
    let mut s = spec(d.path(), devs.clone(), false);
    s.resync_rate = 1; // one region copied, then the copy waits: leg 1 stays stale elsewhere
    let m_mirror = Mirror::open(s).unwrap();
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    let mut q = m.open_queue(64).unwrap();
    devs[0]
        .faults()
        .add(errno_rule(FaultOps::Write, libc::EIO, Some(1)));
    let stale_before = mirror.progress().legs[0].stale_bytes;
    let mut data = vec![5u8; 4096];
    // Leg 0 (the only current copy of region 5) fails; leg 1, still being rebuilt, took it:
    // acknowledging it would leave no readable copy holding the data.
    assert_eq!(run(&mut *q, true, 5 * MIB, &mut data), -libc::EIO);
    assert_eq!(
        mirror.progress().legs[0].stale_bytes,
        stale_before,
        "leg 0 stays the source"
    );
    // With leg 0 resetting, a write there has no current leg to go to: a path error to hold.
    assert_eq!(run(&mut *q, true, 5 * MIB, &mut data), -libc::ENOLINK);
    devs[0].health().set(HealthState::Healthy);
    assert_eq!(run(&mut *q, true, 5 * MIB, &mut data), 0);
}

/// A mirror reopened with other regions (a resize) maps the same bitmap: the previous
/// mirror's background thread must have ended before the new one runs, or it would copy and
/// clear by its own counts (seen: a grown mirror stuck "catching-up" on a region already
/// copied, its stale count never brought down).
#[test]
fn a_mirror_reopened_with_other_regions_ends_the_previous_ones_thread_first() {
    let d = tempfile::tempdir().unwrap();
    let (devs, m_mirror) = setup(d.path());
    let old = &m_mirror;
    let mut small = spec(d.path(), devs.clone(), true);
    small.size = SIZE / 2;
    small.legs[0].pieces[0].len = SIZE / 2;
    small.legs[1].pieces.truncate(1);
    let m2_mirror = Mirror::open_after(small, Some(&m_mirror)).unwrap();
    // The old mirror still exists (as while workers move over): its thread ends anyway.
    wait_until("the previous mirror's resync thread to end", || {
        old.shared.stopped.load(Ordering::Acquire)
    });
    let new = &m2_mirror;
    assert!(!Arc::ptr_eq(&old.shared.regions, &new.shared.regions));
    assert!(!new.shared.stopped.load(Ordering::Acquire));
}

/// A far leg (a copy on another host) is written like any other but read only when no other
/// leg can serve: reads of a region where the legs differ always return the near leg's bytes
/// (without the preference, reads alternate between the legs).
#[test]
fn reads_avoid_a_far_leg_while_a_near_one_serves() {
    let d = tempfile::tempdir().unwrap();
    let devs = vec![file_device(d.path(), "a"), file_device(d.path(), "b")];
    let mut s = spec(d.path(), devs.clone(), true);
    s.legs[1].far = true;
    let m_mirror = Mirror::open(s).unwrap();
    let m = m_mirror.device().clone();
    let mut q = m.open_queue(8).unwrap();
    let mut data = vec![0x5au8; 64 << 10];
    assert_eq!(run(&mut *q, true, 0, &mut data), 0);
    let (a, b) = legs_of(&devs);
    assert!(
        a[..data.len()] == data[..] && b[..data.len()] == data[..],
        "written to both"
    );
    // Only the far copy changes behind the mirror's back.
    devs[1].write_at_durable(&[0xa5u8; 4096], MIB).unwrap();
    for _ in 0..8 {
        let mut got = vec![0u8; 4096];
        assert_eq!(run(&mut *q, false, 0, &mut got), 0);
        assert!(got.iter().all(|&x| x == 0x5a), "a read went to the far leg");
    }
}

/// A far leg that has held a complete copy is required: while it cannot take writes (its
/// link down: here its device resetting) a write is held as a path error and the mirror
/// waits (resetting) instead of completing writes the far copy would lack; a write it fails
/// is held too (and its range marked stale there); once it is back they complete on both.
/// A far leg being rebuilt is not required until it has caught up.
#[test]
fn a_far_leg_that_was_current_takes_every_write_or_the_mirror_waits() {
    let d = tempfile::tempdir().unwrap();
    let devs = vec![file_device(d.path(), "a"), file_device(d.path(), "b")];
    let mut s = spec(d.path(), devs.clone(), false);
    s.legs[1].far = true;
    let m_mirror = Mirror::open(s.clone()).unwrap();
    let m = m_mirror.device().clone();
    let mirror = &m_mirror;
    let mut q = m.open_queue(8).unwrap();
    // Being rebuilt: writes complete without it.
    assert!(!mirror.progress().legs[1].required);
    devs[1].health().set(HealthState::Resetting);
    assert_eq!(run(&mut *q, true, 0, &mut [1u8; 4096]), 0);
    devs[1].health().set(HealthState::Healthy);
    wait_until("the far leg caught up and required", || {
        mirror.progress().legs[1].required
    });
    // Its link goes down: writes wait, and so does the mirror.
    devs[1].health().set(HealthState::Resetting);
    assert_eq!(
        run(&mut *q, true, 2 * MIB, &mut [2u8; 4096]),
        -libc::ENOLINK
    );
    wait_until("mirror resetting", || {
        m.health().state() == HealthState::Resetting
    });
    assert_eq!(leg_bytes(&devs[0], &[(3 * MIB, 4096)]), vec![0u8; 4096]);
    devs[1].health().set(HealthState::Healthy);
    wait_until("mirror healthy", || {
        m.health().state() == HealthState::Healthy
    });
    assert_eq!(run(&mut *q, true, 2 * MIB, &mut [2u8; 4096]), 0);
    // A write the far leg fails is held, and the far leg is stale there until copied (its
    // device, reported, resets; no monitor here to bring it back).
    devs[1]
        .faults()
        .add(errno_rule(FaultOps::Write, libc::EIO, Some(1)));
    assert_eq!(
        run(&mut *q, true, 4 * MIB, &mut [3u8; 4096]),
        -libc::ENOLINK
    );
    assert_eq!(mirror.progress().legs[1].stale_bytes, MIB);
    devs[1].health().set(HealthState::Healthy);
    assert_eq!(run(&mut *q, true, 4 * MIB, &mut [3u8; 4096]), 0);
    wait_until("copied", || mirror.leg_current(1));
    let (a, b) = legs_of(&devs);
    assert!(a == b, "legs differ");
    // Reopened (the link came back, or a worker restarted) it stays required.
    drop(q);
    let m2_mirror = Mirror::open_after(s, Some(&m_mirror)).unwrap();
    assert!(m2_mirror.progress().legs[1].required);
}

/// A worker reopening its queues while a remote leg's link is down (seen in the guest test
/// with the link cut): the mirror's queue opens all the same, the leg failing its commands
/// (a path error on that leg, its device reported), instead of the whole queue failing to
/// open, which failed the guest's requests with I/O errors.
#[test]
fn a_mirror_opens_its_queue_while_a_remote_legs_export_is_unreachable() {
    let d = tempfile::tempdir().unwrap();
    let mem = Arc::new(spool_devices::testing::MemExport(
        std::sync::Mutex::new(vec![0u8; SIZE as usize]),
        true,
        Default::default(),
    ));
    let listen = spool_nbd::Listen::parse("127.0.0.1:0").unwrap();
    let srv = spool_nbd::Server::start(listen, mem).unwrap();
    let uri = format!("nbd://{}/m", srv.listen);
    let remote = Arc::new(Device::open(Path::new(&uri), &OpenOptions::default()).unwrap());
    let devs = vec![file_device(d.path(), "a"), remote.clone()];
    let mut s = spec(d.path(), devs, false);
    s.legs[1].far = true;
    s.legs[1].pieces = vec![LegPiece {
        logical: 0,
        len: SIZE,
        device: 1,
        offset: 0,
    }];
    let m_mirror = Mirror::open(s).unwrap();
    let m = m_mirror.device().clone();
    drop(srv);
    let mut q = m
        .open_queue(8)
        .expect("the mirror's queue opens with a leg unreachable");
    assert_eq!(
        run(&mut *q, true, 0, &mut [4u8; 4096]),
        0,
        "written to the local leg"
    );
    assert_ne!(
        remote.health().state(),
        HealthState::Healthy,
        "the leg's device reported"
    );
    let mut back = vec![0u8; 4096];
    assert_eq!(run(&mut *q, false, 0, &mut back), 0);
    assert_eq!(back, vec![4u8; 4096]);
}
