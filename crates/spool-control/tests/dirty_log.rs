//! Dirty-page logging for live migration, through the real socket with a hand-built
//! vhost-user frontend (`common::raw`), page by page: with VHOST_F_LOG_ALL on and a log given
//! by SET_LOG_BASE, spoold marks exactly the guest pages it wrote (a read's buffer, status
//! bytes, the used ring) and not those it only read (a write's buffer, the descriptor table,
//! the avail ring); it keeps marking after its worker is SIGKILLed (the log is part of the
//! kept session); it stops when logging is turned off; and a log its file cannot hold is
//! refused without harming anyone.

mod common;

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use common::raw::{GuestMem, RawFrontend, Ring, SET_FEATURES, T_IN, T_OUT};
use common::Spoold;

const SET_LOG_BASE: u32 = 6;
const VERSION_1: u64 = 1 << 32;
const PROTOCOL_FEATURES: u64 = 1 << 30;
const LOG_ALL: u64 = 1 << 26;
const LOG_SHMFD: u64 = 1 << 1;

const CFG: &str = r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[volumes]]
name = "vm"
size = "8M"
num_queues = 1
"#;

fn memfd(len: u64) -> File {
    // SAFETY: a NUL-terminated name; the descriptor is checked and owned by the File.
    let fd = unsafe { libc::memfd_create(c"log".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a fresh descriptor we own.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).unwrap();
    f
}

/// The pages marked in `log` (one bit per 4 KiB page).
fn marked(log: &File) -> Vec<u64> {
    let mut b = [0u8; 64];
    log.read_at(&mut b, 0).unwrap();
    (0..b.len() as u64 * 8)
        .filter(|p| b[(p / 8) as usize] & (1 << (p % 8)) != 0)
        .collect()
}

/// The marked pages once they include every page of `want` (the worker marks the used
/// ring's page just after publishing the used index, so a look right after the completion
/// may come before it); at most 5 s.
fn marked_with(log: &File, want: &[u64]) -> Vec<u64> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let m = marked(log);
        if want.iter().all(|p| m.contains(p)) || std::time::Instant::now() > deadline {
            return m;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn clear(log: &File) {
    log.write_at(&[0u8; 64], 0).unwrap();
}

/// A session with protocol features, LOG_SHMFD and (with `log_all`) logging on; ring 0 of
/// 16 entries running.
fn session(d: &Spoold, mem: &GuestMem, ring: &Ring, log_all: bool) -> RawFrontend {
    let mut fe = RawFrontend::connect(&d.socket("vm"));
    let offered = fe.sync().unwrap();
    assert_ne!(
        offered & LOG_ALL,
        0,
        "spoold does not offer VHOST_F_LOG_ALL"
    );
    let proto = ring.start_enabled(
        &mut fe,
        mem,
        if log_all { LOG_ALL } else { 0 },
        LOG_SHMFD,
        0,
    );
    assert_ne!(proto & LOG_SHMFD, 0, "spoold does not offer LOG_SHMFD");
    fe
}

fn set_log(fe: &mut RawFrontend, log: &File, size: u64) -> std::io::Result<Vec<u8>> {
    let mut p = size.to_le_bytes().to_vec();
    p.extend_from_slice(&0u64.to_le_bytes());
    fe.send(SET_LOG_BASE, &p, &[log.as_raw_fd()])?;
    fe.reply()
}

/// Runs one request of `ty` in `slot` (descriptors 3*slot..) and waits for it.
fn request(ring: &mut Ring, mem: &GuestMem, slot: u16, ty: u32) {
    ring.prepare(mem, slot * 3, slot as u64, ty, 0, 4096);
    ring.post(mem, slot * 3);
    let done = ring.wait_used(mem, 1, Duration::from_secs(10));
    assert_eq!(done.len(), 1, "request not completed");
    assert_eq!(ring.status(mem, slot as u64), 0, "request failed");
}

#[test]
fn spoold_marks_every_guest_page_it_writes_while_the_frontend_logs() {
    let d = Spoold::start(CFG);
    let mem = GuestMem::new(1 << 20);
    let mut ring = Ring::new(16);
    let mut fe = session(&d, &mem, &ring, true);
    // 1 MiB of guest memory: 256 pages, 32 bytes of log.
    let log = memfd(4096);
    set_log(&mut fe, &log, 32).unwrap();
    fe.sync().unwrap();

    // Layout (common::raw): descriptors page 0, avail ring page 4, used ring page 6, headers
    // and status bytes page 8, slot n's data page 16 + n.
    request(&mut ring, &mem, 0, T_IN);
    assert_eq!(
        marked_with(&log, &[6, 8, 16]),
        vec![6, 8, 16],
        "a read marks its buffer, its status byte and the used ring, nothing else"
    );
    clear(&log);
    request(&mut ring, &mem, 1, T_OUT);
    assert_eq!(
        marked_with(&log, &[6, 8]),
        vec![6, 8],
        "a write's buffer is only read by spoold: not marked"
    );

    // A worker SIGKILLed mid-migration: the next one goes on marking the same log.
    clear(&log);
    d.kill_worker();
    request(&mut ring, &mem, 2, T_IN);
    let m = marked_with(&log, &[6, 8, 18]);
    assert!(
        m.contains(&18) && m.contains(&8) && m.contains(&6),
        "after a worker restart the log is no longer marked: {m:?}"
    );

    // Logging off: nothing is marked any more.
    let _ = fe.send(
        SET_FEATURES,
        &(VERSION_1 | PROTOCOL_FEATURES).to_le_bytes(),
        &[],
    );
    fe.sync().unwrap();
    clear(&log);
    request(&mut ring, &mem, 3, T_IN);
    assert_eq!(marked(&log), Vec::<u64>::new(), "marked with logging off");
}

#[test]
fn a_log_its_file_cannot_hold_is_refused_and_spoold_serves_on() {
    let mut d = Spoold::start(CFG);
    let mem = GuestMem::new(1 << 20);
    let mut ring = Ring::new(16);
    let mut fe = session(&d, &mem, &ring, true);
    let log = memfd(16);
    let _ = set_log(&mut fe, &log, 4096);
    assert!(fe.closed(), "a log past the end of its file was accepted");
    assert!(d.running(), "spoold died\n{}", d.log());
    assert!(d.log().contains("dirty log"), "{}", d.log());
    // The next frontend is served.
    let mut fe = session(&d, &mem, &ring, false);
    request(&mut ring, &mem, 0, T_IN);
    fe.sync().unwrap();
}
