//! The server against the standard clients a backup uses: `qemu-img` (info, map with
//! `x-dirty-bitmap`, compare), libnbd's `nbdinfo` (the export, its meta contexts, their maps)
//! and `nbdcopy`, over a Unix socket and TCP, with a raw client for hostile requests.

use std::io::{Read, Write};
use std::process::Command;
use std::sync::Arc;

use spool_nbd::{Export, Listen, Server};

const EXTENT: u64 = 64 << 10;

/// 16 extents: even ones hold data (extent `i` filled with byte `i + 1`), odd ones are
/// holes; extents 2 and 5 changed since the base.
struct Mem {
    data: Vec<u8>,
}

impl Mem {
    fn new() -> Mem {
        let mut data = vec![0u8; (16 * EXTENT) as usize];
        for i in (0..16).step_by(2) {
            let at = (i * EXTENT) as usize;
            data[at..at + EXTENT as usize].fill(i as u8 + 1);
        }
        Mem { data }
    }
}

impl Export for Mem {
    fn name(&self) -> &str {
        "vol@snap"
    }
    fn size(&self) -> u64 {
        self.data.len() as u64
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        buf.copy_from_slice(&self.data[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn extent(&self) -> u64 {
        EXTENT
    }
    fn allocated(&self, i: u64) -> bool {
        i.is_multiple_of(2)
    }
    fn base(&self) -> Option<&str> {
        Some("base")
    }
    fn changed(&self, i: u64) -> bool {
        i == 2 || i == 5
    }
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
#[ignore = "needs nbdinfo and nbdcopy (libnbd-bin; scripts/install-deps.sh installs it)"]
fn standard_clients_read_the_export_its_holes_and_what_changed() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let mem = Arc::new(Mem::new());
    let _s = Server::start(Listen::Unix(sock.clone()), mem.clone()).unwrap();
    let uri = format!("nbd+unix:///vol@snap?socket={}", sock.display());
    let info = run(Command::new("nbdinfo").arg(&uri));
    assert!(
        info.contains("export-size: 1048576") && info.contains("is_read_only: true"),
        "{info}"
    );
    let list = run(Command::new("nbdinfo")
        .args(["--list", "--content"])
        .arg(&uri));
    assert!(
        list.contains("base:allocation") && list.contains("qemu:dirty-bitmap:base"),
        "{list}"
    );
    // The allocation map: data and holes alternate, one extent each.
    let map = run(Command::new("nbdinfo").arg("--map").arg(&uri));
    let lines: Vec<&str> = map.lines().collect();
    assert_eq!(lines.len(), 16, "{map}");
    assert!(
        lines[0].split_whitespace().collect::<Vec<_>>()[..3] == ["0", "65536", "0"],
        "{map}"
    );
    assert!(lines[1].contains("hole,zero"), "{map}");
    let dirty = run(Command::new("nbdinfo")
        .arg("--map=qemu:dirty-bitmap:base")
        .arg(&uri));
    let dirty: Vec<Vec<&str>> = dirty
        .lines()
        .map(|l| l.split_whitespace().take(3).collect())
        .collect();
    assert_eq!(
        dirty,
        vec![
            vec!["0", "131072", "0"],
            vec!["131072", "65536", "1"],
            vec!["196608", "131072", "0"],
            vec!["327680", "65536", "1"],
            vec!["393216", "655360", "0"]
        ]
    );
    // A whole copy, by nbdcopy and by qemu-img.
    let copy = dir.path().join("copy.img");
    run(Command::new("nbdcopy").arg(&uri).arg(&copy));
    assert!(std::fs::read(&copy).unwrap() == mem.data);
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&copy)
        .arg(&uri));
    // qemu-img reads the dirty bitmap as backup tools do (x-dirty-bitmap: dirty reads as
    // unallocated, "data": false).
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={},export=vol@snap,x-dirty-bitmap=qemu:dirty-bitmap:base",
        sock.display()
    );
    let map = run(Command::new("qemu-img").args(["map", "--output=json", "--image-opts", &opts]));
    let dirty: Vec<(String, String)> = map
        .lines()
        .filter(|l| l.contains(r#""data": false"#))
        .map(|l| {
            let f = |k: &str| {
                l.split(k)
                    .nth(1)
                    .unwrap()
                    .split(',')
                    .next()
                    .unwrap()
                    .trim()
                    .to_string()
            };
            (f(r#""start":"#), f(r#""length":"#))
        })
        .collect();
    assert_eq!(
        dirty,
        vec![
            ("131072".into(), "65536".into()),
            ("327680".into(), "65536".into())
        ],
        "{map}"
    );
}

#[test]
fn tcp_works_and_hostile_requests_get_errors_not_crashes() {
    // Port 0: a free port, which the server's `listen` names (no window in which another
    // process could take a port picked beforehand).
    let l = Listen::parse("127.0.0.1:0").unwrap();
    assert!(Listen::parse("nowhere").is_err() && Listen::parse("unix:").is_err());
    let s = Server::start(l, Arc::new(Mem::new())).unwrap();
    let Listen::Tcp(at) = &s.listen else {
        panic!("{:?}", s.listen)
    };
    let port: u16 = at.rsplit_once(':').unwrap().1.parse().unwrap();
    assert_ne!(port, 0);
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut hello = [0u8; 18];
    c.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..8], b"NBDMAGIC");
    c.write_all(&3u32.to_be_bytes()).unwrap();
    // An unknown option is refused; NBD_OPT_EXPORT_NAME for the default export starts
    // transmission.
    let opt = |c: &mut std::net::TcpStream, o: u32, data: &[u8]| {
        let mut b = 0x4948_4156_454f_5054u64.to_be_bytes().to_vec();
        b.extend_from_slice(&o.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        c.write_all(&b).unwrap();
    };
    opt(&mut c, 99, b"");
    let mut rep = [0u8; 20];
    c.read_exact(&mut rep).unwrap();
    assert_eq!(
        u32::from_be_bytes(rep[12..16].try_into().unwrap()),
        (1 << 31) + 1
    );
    let mut msg = vec![0u8; u32::from_be_bytes(rep[16..20].try_into().unwrap()) as usize];
    c.read_exact(&mut msg).unwrap();
    opt(&mut c, 1, b"");
    let mut ex = [0u8; 10];
    c.read_exact(&mut ex).unwrap();
    assert_eq!(u64::from_be_bytes(ex[..8].try_into().unwrap()), 16 * EXTENT);
    let req = |c: &mut std::net::TcpStream, kind: u16, off: u64, len: u32| {
        let mut b = 0x2560_9513u32.to_be_bytes().to_vec();
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&7u64.to_be_bytes());
        b.extend_from_slice(&off.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        c.write_all(&b).unwrap();
        let mut r = [0u8; 16];
        c.read_exact(&mut r).unwrap();
        u32::from_be_bytes(r[4..8].try_into().unwrap())
    };
    assert_eq!(req(&mut c, 0, u64::MAX - 10, 4096), 22, "past the end");
    assert_eq!(req(&mut c, 0, 0, u32::MAX), 22, "past the end");
    assert_eq!(
        req(&mut c, 7, 0, 4096),
        22,
        "block status without a context"
    );
    assert_eq!(req(&mut c, 4, 0, 4096), 1, "trim of a read-only export");
    assert_eq!(req(&mut c, 0, 65536, 4096), 0);
    let mut data = [0u8; 4096];
    c.read_exact(&mut data).unwrap();
    assert!(data.iter().all(|&b| b == 0), "a hole");
}

/// A writable export of 1 MiB in memory, counting flushes.
struct Disk {
    data: std::sync::Mutex<Vec<u8>>,
    flushes: std::sync::atomic::AtomicU64,
}

impl Export for Disk {
    fn name(&self) -> &str {
        "incoming"
    }
    fn size(&self) -> u64 {
        1 << 20
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let d = self.data.lock().unwrap();
        buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn extent(&self) -> u64 {
        EXTENT
    }
    fn allocated(&self, _i: u64) -> bool {
        true
    }
    fn base(&self) -> Option<&str> {
        None
    }
    fn changed(&self, _i: u64) -> bool {
        false
    }
    fn writable(&self) -> bool {
        true
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let mut d = self.data.lock().unwrap();
        d[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        self.flushes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

#[test]
#[ignore = "needs qemu-io, qemu-img and nbdcopy (scripts/install-deps.sh installs them)"]
fn a_writable_export_takes_what_qemu_io_and_nbdcopy_write() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("in.sock");
    let disk = Arc::new(Disk {
        data: std::sync::Mutex::new(vec![0xeeu8; 1 << 20]),
        flushes: Default::default(),
    });
    let _s = Server::start(Listen::Unix(sock.clone()), disk.clone()).unwrap();
    let uri = format!("nbd+unix:///incoming?socket={}", sock.display());
    let info = run(Command::new("nbdinfo").arg(&uri));
    assert!(info.contains("is_read_only: false"), "{info}");
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x5a 4096 8192",
        "-c",
        "write -z 65536 4096",
        "-c",
        "flush",
        &uri,
    ]));
    {
        let d = disk.data.lock().unwrap();
        assert!(d[4096..12288].iter().all(|&b| b == 0x5a));
        assert!(d[65536..69632].iter().all(|&b| b == 0));
        assert!(d[..4096].iter().all(|&b| b == 0xee) && d[69632] == 0xee);
    }
    assert!(disk.flushes.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    // A whole image copied in, as a transfer's first pass would, and compared.
    let src = dir.path().join("src.img");
    let bytes: Vec<u8> = (0..1u32 << 20).map(|i| (i % 253) as u8).collect();
    std::fs::write(&src, &bytes).unwrap();
    run(Command::new("nbdcopy").arg(&src).arg(&uri));
    assert!(*disk.data.lock().unwrap() == bytes);
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&src)
        .arg(&uri));
}

/// A server for given peers turns every other address away before the greeting.
#[test]
fn a_server_for_some_peers_turns_the_others_away() {
    let only = |ip: &str| -> Arc<[std::net::IpAddr]> { vec![ip.parse().unwrap()].into() };
    let greeted = |peers| {
        let l = Listen::parse("127.0.0.1:0").unwrap();
        let s = Server::start_for(l, None, Arc::new(Mem::new()), Some(peers)).unwrap();
        let mut c = std::net::TcpStream::connect(s.listen.to_string()).unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut hello = [0u8; 8];
        c.read_exact(&mut hello).is_ok() && &hello == b"NBDMAGIC"
    };
    assert!(greeted(only("127.0.0.1")));
    assert!(!greeted(only("10.9.9.9")), "a peer not allowed was served");
}

/// A writable export whose writes wait (up to 5 s) until another write is in progress with
/// them: what tells a server that serves a connection's requests together from one that
/// serves them one after the other (each write would then wait the 5 s alone).
struct Overlapping {
    active: std::sync::Mutex<(u32, u32)>,
    more: std::sync::Condvar,
}

impl Export for Overlapping {
    fn name(&self) -> &str {
        "in"
    }
    fn size(&self) -> u64 {
        1 << 20
    }
    fn read_at(&self, _: &mut [u8], _: u64) -> std::io::Result<()> {
        Ok(())
    }
    fn extent(&self) -> u64 {
        1 << 20
    }
    fn allocated(&self, _: u64) -> bool {
        true
    }
    fn base(&self) -> Option<&str> {
        None
    }
    fn changed(&self, _: u64) -> bool {
        false
    }
    fn writable(&self) -> bool {
        true
    }
    fn write_at(&self, _: &[u8], _: u64) -> std::io::Result<()> {
        let mut a = self.active.lock().unwrap();
        a.0 += 1;
        a.1 = a.1.max(a.0);
        self.more.notify_all();
        let (mut a, _) = self
            .more
            .wait_timeout_while(a, std::time::Duration::from_secs(5), |a| a.1 < 2)
            .unwrap();
        a.0 -= 1;
        Ok(())
    }
}

/// One connection's requests are served together: two writes sent back to back are in the
/// export at the same time, and each reply carries its own request's cookie.
#[test]
fn a_connections_requests_are_served_together() {
    use spool_nbd::client;
    let e = Arc::new(Overlapping {
        active: std::sync::Mutex::new((0, 0)),
        more: std::sync::Condvar::new(),
    });
    let s = Server::start(Listen::parse("127.0.0.1:0").unwrap(), e.clone()).unwrap();
    let t = client::Target::parse(&format!("nbd://{}/in", s.listen)).unwrap();
    let mut c = client::connect(&t, std::time::Duration::from_secs(10)).unwrap();
    for cookie in [7u64, 8] {
        c.stream
            .write_all(&client::request(1, cookie, cookie * 4096, 4096))
            .unwrap();
        c.stream.write_all(&[0u8; 4096]).unwrap();
    }
    let mut cookies = vec![
        client::read_reply(&mut c.stream).unwrap(),
        client::read_reply(&mut c.stream).unwrap(),
    ];
    cookies.sort();
    assert_eq!(cookies, vec![(7, 0), (8, 0)]);
    assert_eq!(
        e.active.lock().unwrap().1,
        2,
        "the writes were served one at a time"
    );
}

/// Clients that connect and say nothing take every place for the handshake's limit at most:
/// then they are disconnected, and a client that speaks gets its greeting again.
#[test]
fn silent_clients_lose_their_place_after_the_handshake_limit() {
    use std::os::unix::net::UnixStream;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let _s = Server::start(Listen::Unix(sock.clone()), Arc::new(Mem::new())).unwrap();
    let greeting = |c: &mut UnixStream| -> usize {
        c.set_read_timeout(Some(std::time::Duration::from_secs(60)))
            .unwrap();
        let mut g = [0u8; 18];
        let mut got = 0;
        while got < g.len() {
            match c.read(&mut g[got..]).unwrap() {
                0 => break,
                n => got += n,
            }
        }
        got
    };
    let mut silent: Vec<UnixStream> = (0..spool_nbd::MAX_CONNECTIONS)
        .map(|_| {
            let mut c = UnixStream::connect(&sock).unwrap();
            assert_eq!(greeting(&mut c), 18, "greeted");
            c
        })
        .collect();
    // Every place is taken: one more is turned away (closed before any greeting).
    let mut away = UnixStream::connect(&sock).unwrap();
    assert_eq!(greeting(&mut away), 0, "turned away");
    // Each is disconnected (a read waits 60 s at most: without the limit it fails).
    for c in &mut silent {
        let mut b = [0u8; 1];
        assert_eq!(c.read(&mut b).unwrap(), 0, "disconnected");
    }
    let mut c = UnixStream::connect(&sock).unwrap();
    assert_eq!(greeting(&mut c), 18, "a place again");
}

/// The handshake's limit is on the whole of it: a client that sends a byte of its options
/// every few seconds (each read answered within the limit) is disconnected all the same.
#[test]
fn a_client_trickling_its_handshake_is_disconnected_at_the_limit() {
    use std::os::unix::net::UnixStream;
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let _s = Server::start(Listen::Unix(sock.clone()), Arc::new(Mem::new())).unwrap();
    let mut c = UnixStream::connect(&sock).unwrap();
    let t0 = Instant::now();
    let mut g = [0u8; 18];
    c.read_exact(&mut g).unwrap();
    // The client's flags, then NBD_OPT_LIST's header and more, one byte every 3 s.
    let mut bytes = vec![0, 0, 0, 3];
    bytes.extend_from_slice(&0x4948_4156_454f_5054u64.to_be_bytes());
    bytes.extend_from_slice(&3u32.to_be_bytes());
    bytes.extend_from_slice(&0u32.to_be_bytes());
    c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut sent = 0;
    let closed = loop {
        if sent < bytes.len() && c.write_all(&bytes[sent..=sent]).is_err() {
            break t0.elapsed();
        }
        sent += 1;
        let mut b = [0u8; 64];
        match c.read(&mut b) {
            Ok(0) => break t0.elapsed(),
            Ok(_) => panic!("an answer before the option was complete"),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => assert!(
                t0.elapsed() < spool_nbd::HANDSHAKE_LIMIT * 3,
                "still connected after {:?}",
                t0.elapsed()
            ),
            Err(_) => break t0.elapsed(),
        }
    };
    assert!(
        closed < spool_nbd::HANDSHAKE_LIMIT + Duration::from_secs(4),
        "disconnected after {closed:?}, {sent} bytes"
    );
}
