//! The NBD backend against a real server: qemu-nbd (Debian's qemu-utils) serving a file.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::testing::{MemExport, QemuNbd};
use crate::{Device, DeviceIo, DeviceQueue, ErrorClass, IoVec, OpenOptions, Probe};

const MIB: u64 = 1 << 20;

/// Submits `io` (tag 1), kicks and waits for its result.
fn run(q: &mut dyn DeviceQueue, io: DeviceIo) -> i32 {
    // SAFETY: the callers keep the iovecs and buffers alive until this returns (reaped).
    unsafe { q.submit(io, 1) };
    q.kick().unwrap();
    wait(q)
}

fn wait(q: &mut dyn DeviceQueue) -> i32 {
    let t0 = Instant::now();
    loop {
        let mut res = None;
        q.reap(&mut |tag, r| {
            assert_eq!(tag, 1);
            res = Some(r)
        });
        if let Some(r) = res {
            return r;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "request never completed"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn iov(b: &mut [u8]) -> IoVec {
    IoVec {
        iov_base: b.as_mut_ptr().cast(),
        iov_len: b.len(),
    }
}

fn pattern(len: u64, seed: u64) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + seed) % 251) as u8).collect()
}

#[test]
#[ignore = "needs qemu-nbd (run by scripts/test.sh)"]
fn queues_read_and_write_an_export_of_qemu_nbd() {
    let d = tempfile::tempdir().unwrap();
    let srv = QemuNbd::start(d.path(), 64 * MIB);
    let dev = srv.device();
    assert_eq!(dev.size(), 64 * MIB);
    assert_eq!(dev.info().backend, "nbd");
    let mut q = dev.open_queue(64).unwrap();
    // A write from three buffers, then read back into two.
    let (mut a, mut b, mut c) = (pattern(4096, 1), pattern(8192, 2), pattern(512, 3));
    let w = [iov(&mut a), iov(&mut b), iov(&mut c)];
    let io = DeviceIo::data(true, 12288, 12800, w.as_ptr(), 3);
    assert_eq!(run(&mut *q, io), 12800);
    assert_eq!(run(&mut *q, DeviceIo::Flush), 0);
    let written: Vec<u8> = [a.clone(), b.clone(), c.clone()].concat();
    assert_eq!(srv.contents(12288, 12800), written);
    let (mut x, mut y) = (vec![0u8; 10000], vec![0u8; 2800]);
    let r = [iov(&mut x), iov(&mut y)];
    let io = DeviceIo::data(false, 12288, 12800, r.as_ptr(), 2);
    assert_eq!(run(&mut *q, io), 12800);
    assert_eq!([x, y].concat(), written);
    // Write-zeroes and discard of part of it.
    let io = DeviceIo::WriteZeroes {
        offset: 12288,
        len: 4096,
    };
    assert_eq!(run(&mut *q, io), 0);
    assert!(srv.contents(12288, 4096).iter().all(|&v| v == 0));
    assert_eq!(srv.contents(16384, 8704), written[4096..]);
    let io = DeviceIo::Discard {
        offset: 32 * MIB,
        len: MIB,
    };
    assert_eq!(run(&mut *q, io), 0);
    // Larger than one NBD request (32 MiB): split, and whole.
    let mut big = pattern(40 * MIB, 9);
    let v = [iov(&mut big)];
    let io = DeviceIo::data(true, 8 * MIB, 40 * MIB, v.as_ptr(), 1);
    assert_eq!(run(&mut *q, io), (40 * MIB) as i32);
    let mut back = vec![0u8; (40 * MIB) as usize];
    let v = [iov(&mut back)];
    let io = DeviceIo::data(false, 8 * MIB, 40 * MIB, v.as_ptr(), 1);
    assert_eq!(run(&mut *q, io), (40 * MIB) as i32);
    assert!(back == big, "a split read or write lost its place");
    // No bytes at all (a guest may ask): done at once, nothing sent.
    let io = DeviceIo::data(true, 4096, 0, w.as_ptr(), 0);
    assert_eq!(run(&mut *q, io), 0);
    assert_eq!(q.in_flight(), 0);
    // Beyond the end: refused alone, the queue goes on.
    let mut one = vec![0u8; 4096];
    let v = [iov(&mut one)];
    let io = DeviceIo::data(false, 64 * MIB - 512, 4096, v.as_ptr(), 1);
    assert_eq!(run(&mut *q, io), -libc::EINVAL);
    // Synchronous metadata I/O shares nothing with the queues.
    dev.write_at_durable(&[5u8; 1024], 0).unwrap();
    let mut m = [0u8; 1024];
    dev.read_at(&mut m, 0).unwrap();
    assert!(m.iter().all(|&v| v == 5));
    dev.zero_range(0, 512).unwrap();
    assert_eq!(
        srv.contents(0, 1024),
        [vec![0u8; 512], vec![5u8; 512]].concat()
    );
    assert_eq!(dev.backend().probe(), Probe::Ok);
}

#[test]
#[ignore = "needs qemu-nbd (run by scripts/test.sh)"]
fn a_server_that_dies_fails_what_is_in_flight_as_a_path_error() {
    let d = tempfile::tempdir().unwrap();
    let mut srv = QemuNbd::start(d.path(), 16 * MIB);
    let dev = srv.device();
    let mut q = dev.open_queue(64).unwrap();
    let mut buf = pattern(MIB, 4);
    let v = [iov(&mut buf)];
    assert_eq!(
        run(&mut *q, DeviceIo::data(true, 0, MIB, v.as_ptr(), 1)),
        MIB as i32
    );
    srv.kill();
    let r = run(&mut *q, DeviceIo::data(false, 0, MIB, v.as_ptr(), 1));
    assert_eq!(
        r,
        -libc::ENOTCONN,
        "{}",
        std::io::Error::from_raw_os_error(-r)
    );
    assert_eq!(ErrorClass::of_errno(-r), ErrorClass::Path);
    // And every request after it, at once.
    assert_eq!(run(&mut *q, DeviceIo::Flush), -libc::ENOTCONN);
    assert!(matches!(dev.backend().probe(), Probe::Gone(_)));
    assert!(dev.open_queue(8).is_err());
}

#[test]
fn queues_work_against_spool_nbd_s_own_writable_server_over_tcp() {
    for offers_write_zeroes in [true, false] {
        against_our_server(offers_write_zeroes);
    }
}

fn against_our_server(offers_write_zeroes: bool) {
    let mem = Arc::new(MemExport(
        std::sync::Mutex::new(vec![1u8; (4 * MIB) as usize]),
        offers_write_zeroes,
        Default::default(),
    ));
    // Port 0: a free port the server names (no window for another process to take it).
    let listen = spool_nbd::Listen::parse("127.0.0.1:0").unwrap();
    let srv = spool_nbd::Server::start(listen, mem.clone()).unwrap();
    let uri = format!("nbd://{}/m", srv.listen);
    let dev = Device::open(Path::new(&uri), &OpenOptions::default()).unwrap();
    assert_eq!(dev.size(), 4 * MIB);
    let mut q = dev.open_queue(8).unwrap();
    // 3 MiB in one request (spool-nbd takes up to 8 MiB).
    let mut w = pattern(3 * MIB, 5);
    let v = [iov(&mut w)];
    let io = DeviceIo::data(true, 512, 3 * MIB, v.as_ptr(), 1);
    assert_eq!(run(&mut *q, io), (3 * MIB) as i32);
    assert_eq!(run(&mut *q, DeviceIo::Flush), 0);
    let io = DeviceIo::WriteZeroes {
        offset: 512,
        len: 4096,
    };
    assert_eq!(run(&mut *q, io), 0);
    // A longer run: one write-zeroes, or without it zeroes sent as data from one buffer.
    let io = DeviceIo::WriteZeroes {
        offset: 3 * MIB + 512,
        len: MIB - 1024,
    };
    assert_eq!(run(&mut *q, io), 0);
    assert!(
        mem.0.lock().unwrap()[(3 * MIB + 512) as usize..(4 * MIB - 512) as usize]
            .iter()
            .all(|&b| b == 0)
    );
    let mut r = vec![0u8; (3 * MIB) as usize];
    let v = [iov(&mut r)];
    assert_eq!(
        run(&mut *q, DeviceIo::data(false, 512, 3 * MIB, v.as_ptr(), 1)),
        (3 * MIB) as i32
    );
    assert!(r[..4096].iter().all(|&b| b == 0));
    assert!(r[4096..] == w[4096..]);
    let d = mem.0.lock().unwrap();
    assert_eq!(d[511], 1);
    assert!(d[512 + 4096..512 + (3 * MIB) as usize] == w[4096..]);
}

/// The synchronous requests' first connection (the one `open` made) is bounded like every
/// later one: a server that holds a read fails it after the timeout. It used to block for
/// ever (its connection had no timeout), and with it a copy thread or the pool's caller.
#[test]
fn a_held_synchronous_request_fails_after_the_timeout_on_the_first_connection() {
    let held = Arc::new(MemExport(
        std::sync::Mutex::new(vec![7u8; MIB as usize]),
        true,
        Default::default(),
    ));
    held.2.close();
    let listen = spool_nbd::Listen::parse("127.0.0.1:0").unwrap();
    let srv = spool_nbd::Server::start(listen, held.clone()).unwrap();
    let uri = format!("nbd://{}/m", srv.listen);
    let b = super::NbdBackend::open_with(&uri, Duration::from_millis(300)).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 4096];
        let _ = tx.send(crate::PoolDevice::read_at(&b, &mut buf, 0).map(|_| buf[0]));
    });
    let r = rx.recv_timeout(Duration::from_secs(20));
    held.2.open();
    match r {
        Ok(Err(e)) => assert!(e.to_string().contains("NBD request"), "{e}"),
        Ok(Ok(b)) => panic!("the held read was answered ({b})"),
        Err(_) => panic!("the held read never failed: the first connection has no timeout"),
    }
}
