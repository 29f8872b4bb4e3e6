//! The RBD backend against a real single-node Ceph cluster (scripts/ceph-cluster.sh): images
//! created and opened by name, metadata I/O, the queue's reads and writes through scattered
//! buffers, flush, discard and write-zeroes, errors as negative errnos, the completion
//! eventfd, the probe; and the OSD stopped under I/O: requests wait (no error), the probe
//! times out, and everything completes once the OSD is back. Clear errors for bad names.
//! `#[ignore]`d by default (it needs Ceph): scripts/test.sh runs it.

#[path = "../../spool-control/tests/common/ceph.rs"]
mod ceph;

use std::sync::Arc;
use std::time::{Duration, Instant};

use spool_devices::{
    Ceph, CephClusters, CephConnections, CephOptions, Device, DeviceIo, DeviceQueue, OpenOptions,
    Probe, RbdBackend,
};

/// Opens `name` through the connections of `clusters`.
fn open_through(
    cluster: &ceph::CephCluster,
    clusters: &Arc<CephClusters>,
    name: &str,
    create: Option<u64>,
) -> Result<Device, String> {
    let opts = OpenOptions {
        create_size: create,
        ceph: Ceph::new(options(cluster), clusters.clone()),
        ..Default::default()
    };
    Device::open(std::path::Path::new(name), &opts).map_err(|e| e.to_string())
}

fn options(cluster: &ceph::CephCluster) -> CephOptions {
    CephOptions {
        conf: cluster.conf.clone(),
        id: "admin".into(),
    }
}

/// Submits `io` and waits for its completion (polling the queue), at most `limit`.
fn run(q: &mut dyn DeviceQueue, io: DeviceIo, tag: u64, limit: Duration) -> Option<i32> {
    // SAFETY: the buffers `io` points to live in the caller's frame until this returns, and
    // it returns only after the completion was reaped (or the test fails and exits).
    unsafe { q.submit(io, tag) };
    q.kick().unwrap();
    let deadline = Instant::now() + limit;
    let mut res = None;
    while res.is_none() && Instant::now() < deadline {
        q.reap(&mut |t, r| {
            assert_eq!(t, tag);
            res = Some(r);
        });
        std::thread::sleep(Duration::from_millis(1));
    }
    res
}

fn iov(buf: &mut [u8]) -> libc::iovec {
    libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }
}

#[test]
#[ignore = "needs Ceph: scripts/test.sh runs it (cargo test -- --include-ignored)"]
fn rbd_images_serve_io_and_hold_it_while_the_osd_is_down() {
    let cluster = ceph::CephCluster::start("devices");
    let clusters = Arc::new(CephClusters::default());
    let open = |name: &str, create| open_through(&cluster, &clusters, name, create);
    let t = Instant::now();
    let dev = open("rbd:rbd/dev0", Some(64 << 20)).unwrap();
    eprintln!("connect + create + open: {:?}", t.elapsed());
    assert_eq!(dev.size(), 64 << 20);
    assert_eq!(dev.backend().info().backend, "rbd");
    assert!(cluster.rbd(&["ls", "rbd"]).unwrap().contains("dev0"));
    // Opening again (another handle on the same connection) finds the same image.
    assert_eq!(open("rbd:rbd/dev0", None).unwrap().size(), 64 << 20);

    // Metadata I/O.
    let meta: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
    dev.write_at_durable(&meta, 4096).unwrap();
    let mut back = vec![0u8; 8192];
    dev.read_at(&mut back, 4096).unwrap();
    assert_eq!(back, meta);
    dev.zero_range(4096, 4096).unwrap();
    dev.read_at(&mut back, 4096).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 0) && back[4096..] == meta[4096..]);
    assert!(
        dev.read_at(&mut back, (64 << 20) - 4096).is_err(),
        "beyond the end"
    );

    // The data path: a write from two buffers, read back into three.
    let mut q = dev.open_queue(64).unwrap();
    let (mut a, mut b) = (vec![0xa5u8; 4096], vec![0x5au8; 8192]);
    let w = [iov(&mut a), iov(&mut b)];
    let io = DeviceIo::data(true, 1 << 20, 12288, w.as_ptr(), 2);
    assert_eq!(run(&mut q, io, 1, Duration::from_secs(30)), Some(0));
    assert_eq!(
        run(&mut q, DeviceIo::Flush, 2, Duration::from_secs(30)),
        Some(0)
    );
    let (mut x, mut y, mut z) = (vec![0u8; 2048], vec![0u8; 2048], vec![0u8; 8192]);
    let r = [iov(&mut x), iov(&mut y), iov(&mut z)];
    let io = DeviceIo::data(false, 1 << 20, 12288, r.as_ptr(), 3);
    assert_eq!(run(&mut q, io, 3, Duration::from_secs(30)), Some(12288));
    assert!(x.iter().chain(&y).all(|&v| v == 0xa5) && z.iter().all(|&v| v == 0x5a));
    // Write-zeroes reads back as zeroes.
    let io = DeviceIo::WriteZeroes {
        offset: 1 << 20,
        len: 4096,
    };
    assert_eq!(run(&mut q, io, 4, Duration::from_secs(30)), Some(0));
    let io = DeviceIo::data(false, 1 << 20, 4096, r.as_ptr(), 2);
    assert_eq!(run(&mut q, io, 5, Duration::from_secs(30)), Some(4096));
    assert!(x.iter().chain(&y).all(|&v| v == 0));
    let io = DeviceIo::Discard {
        offset: 8 << 20,
        len: 4 << 20,
    };
    assert_eq!(run(&mut q, io, 6, Duration::from_secs(30)), Some(0));
    // An error is a negative errno, not a hang or a panic.
    let io = DeviceIo::data(false, 64 << 20, 4096, r.as_ptr(), 1);
    let res = run(&mut q, io, 7, Duration::from_secs(30)).unwrap();
    assert!(res < 0, "{res}");
    assert_eq!(q.in_flight(), 0);

    // The completion eventfd fires when events are on.
    q.set_completion_events(true);
    let io = DeviceIo::data(false, 0, 4096, r.as_ptr(), 1);
    // SAFETY: `x` outlives the completion, which is reaped below.
    unsafe { q.submit(io, 8) };
    let mut pfd = libc::pollfd {
        fd: q.completion_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 30_000) }, 1);
    q.ack_completion_event();
    assert_eq!(q.reap(&mut |t, _| assert_eq!(t, 8)), 1);
    q.set_completion_events(false);
    assert_eq!(dev.backend().probe(), Probe::Ok);

    // The OSD goes away: a write waits (no error), the probe times out, and the write
    // completes once the OSD is back.
    cluster.stop_osd();
    let w = [iov(&mut a)];
    let io = DeviceIo::data(true, 2 << 20, 4096, w.as_ptr(), 1);
    // SAFETY: `a` outlives the completion: it is reaped below before the test ends.
    unsafe { q.submit(io, 9) };
    std::thread::sleep(Duration::from_secs(2));
    let mut early = Vec::new();
    q.reap(&mut |t, r| early.push((t, r)));
    let t = Instant::now();
    let probe = dev.backend().probe();
    let probe_took = t.elapsed();
    // Asserted once the OSD is back (a failure here must not leave the write pending).
    cluster.start_osd();
    assert!(
        early.is_empty(),
        "completed while the OSD was down: {early:?}"
    );
    assert_eq!(probe, Probe::Failed(libc::ETIMEDOUT));
    assert!(probe_took < Duration::from_secs(10), "{probe_took:?}");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut res = None;
    while res.is_none() && Instant::now() < deadline {
        q.reap(&mut |_, r| res = Some(r));
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        res,
        Some(0),
        "the held write completes once the OSD is back"
    );
    assert_eq!(dev.backend().probe(), Probe::Ok);
    drop(q);

    // Grow, never shrink; exists; remove.
    let ceph = Ceph::new(options(&cluster), clusters.clone());
    let rbd = RbdBackend::of(&dev).expect("an RBD backend");
    rbd.resize(128 << 20).unwrap();
    assert_eq!(dev.size(), 128 << 20);
    assert!(rbd
        .resize(64 << 20)
        .unwrap_err()
        .to_string()
        .contains("shrinking"));
    assert!(cluster
        .rbd(&["info", "rbd/dev0"])
        .unwrap()
        .contains("128 MiB"));
    assert!(RbdBackend::exists("rbd/dev0", &ceph).unwrap());
    assert!(!RbdBackend::exists("rbd/nothere", &ceph).unwrap());
    drop(dev);
    RbdBackend::remove("rbd/dev0", &ceph).unwrap();
    assert!(!RbdBackend::exists("rbd/dev0", &ceph).unwrap());
    let err = RbdBackend::remove("rbd/dev0", &ceph)
        .unwrap_err()
        .to_string();
    assert!(err.contains("remove the RBD image"), "{err}");

    // Clear errors.
    let err = open("rbd:nopool", None).unwrap_err();
    assert!(err.contains("named POOL/IMAGE"), "{err}");
    let err = open("rbd:nosuchpool/x", Some(1 << 20)).unwrap_err();
    assert!(err.contains("pool nosuchpool"), "{err}");
    let err = open("rbd:rbd/missing", None).unwrap_err();
    assert!(err.contains("open RBD image"), "{err}");
    let opts = OpenOptions {
        ceph: Ceph::new(
            CephOptions {
                conf: "/nonexistent/ceph.conf".into(),
                id: "admin".into(),
            },
            Default::default(),
        ),
        ..Default::default()
    };
    let err = Device::open(std::path::Path::new("rbd:rbd/x"), &opts).unwrap_err();
    assert!(err.to_string().contains("cannot read ceph config"), "{err}");

    // A daemon's connections: still in use while one of its images is open, and closed for
    // good (the process is exiting) whatever the answer; another registry is not.
    let dev = open("rbd:rbd/dev1", Some(1 << 20)).unwrap();
    assert_eq!(clusters.close(), CephConnections::InUse);
    drop(dev);
    assert_eq!(clusters.close(), CephConnections::Closed { any: true });
    let err = open("rbd:rbd/dev1", None).unwrap_err();
    assert!(err.contains("its ceph connections are closed"), "{err}");
    let other = Arc::new(CephClusters::default());
    open_through(&cluster, &other, "rbd:rbd/dev1", None).unwrap();
}
