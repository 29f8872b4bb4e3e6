//! Fuzzes the keeper channel's receiving side with packets a broken or hostile peer could
//! send: any bytes (including oversized and empty packets) with any number of descriptors
//! attached, over a real SOCK_SEQPACKET pair. The decoder is only reachable by receiving, so
//! the input is sent with `sendmsg` on the peer's descriptor and read back with the public
//! API: `Channel::recv` directly, and the worker-side `KeeperLink` (`receive_store`,
//! `preview`, the command thread) adopted from `SPOOL_KEEPER_FD` as spoold does. It must
//! never panic, and:
//! - every descriptor sent arrives with its message (none is lost or leaked: the process's
//!   descriptor count is the same after every input);
//! - a message `recv` accepts re-encodes (`Channel::send`) to the same message;
//! - `receive_store` keeps exactly the entries whose checksum matches.
//!
//! Input: byte 0 selects the reader (0 = `recv`, 1 = `receive_store`, 2 = `preview`, 3 = the
//! command thread), then packets: a length byte pair (bit 15 of it = pad the packet past the
//! largest message), a descriptor-count byte (0..=5: memfds, eventfds and a socket), the
//! packet's bytes. Bytes 0x01 in a packet are replaced by a valid CRC32C of the packet's
//! `"value"` string (so `Put`/`Entry` checksums can match).
#![no_main]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use libfuzzer_sys::fuzz_target;
use spool_keeper::link::Command;
use spool_keeper::proto::{crc, Channel, Msg, CHANNEL_ENV, MAX_MSG, ROLE_ENV};
use spool_keeper::KeeperLink;

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
}

struct Packet {
    body: Vec<u8>,
    fds: Vec<OwnedFd>,
}

fn fresh_fd(kind: u8) -> OwnedFd {
    // SAFETY: plain descriptor-creating calls with constant arguments; results are checked.
    let fd = unsafe {
        match kind % 3 {
            0 => libc::memfd_create(c"spool-fuzz-kept".as_ptr(), libc::MFD_CLOEXEC),
            1 => libc::eventfd(0, libc::EFD_CLOEXEC),
            _ => libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0),
        }
    };
    assert!(fd >= 0, "cannot create a descriptor");
    // SAFETY: a fresh descriptor we own.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// Fills 0x01 bytes with the CRC of the packet's "value" string as JSON text (so valid
/// checksums are reachable); the JSON-decoded value differs when it has escapes, which is fine.
fn fix_crc(body: &mut Vec<u8>) {
    if !body.contains(&1) {
        return;
    }
    let text = String::from_utf8_lossy(body).to_string();
    let value = serde_json::from_slice::<serde_json::Value>(&body.iter().map(|&c| if c == 1 { b'0' } else { c }).collect::<Vec<_>>())
        .ok()
        .and_then(|v| v.get("value").and_then(|v| v.as_str()).map(str::to_string))
        .unwrap_or(text);
    let c = crc(&value).to_string();
    let mut out = Vec::with_capacity(body.len() + 10);
    for &b in body.iter() {
        if b == 1 {
            out.extend_from_slice(c.as_bytes());
        } else {
            out.push(b);
        }
    }
    *body = out;
}

fn packets(b: &mut Bytes) -> Vec<Packet> {
    let mut out = Vec::new();
    while !b.0.is_empty() && out.len() < 16 {
        let lenw = u16::from_le_bytes([b.u8(), b.u8()]);
        let nfds = b.u8();
        let mut body = b.take((lenw & 0x7fff) as usize).to_vec();
        fix_crc(&mut body);
        if lenw & 0x8000 != 0 {
            // Past the largest message: the reader must refuse it, not truncate and parse.
            let pad = MAX_MSG + 1 - body.len().min(MAX_MSG + 1) + (nfds as usize % 3);
            body.extend(std::iter::repeat_n(b' ', pad));
        }
        let fds = (0..nfds % 6).map(|i| fresh_fd(nfds / 8 + i)).collect();
        out.push(Packet { body, fds });
    }
    out
}

/// Sends one packet on `fd` with `fds` attached; false if it could not be sent.
fn send_raw(fd: RawFd, body: &[u8], fds: &[OwnedFd]) -> bool {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let mut iov = libc::iovec {
        iov_base: body.as_ptr() as *mut libc::c_void,
        iov_len: body.len(),
    };
    // SAFETY: a zeroed msghdr is valid; we point it at our iovec and control buffer.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let mut cbuf;
    if !raw.is_empty() {
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(&raw[..]) as u32) } as usize;
        cbuf = vec![0u64; space.div_ceil(8)];
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: the control buffer holds one cmsg of CMSG_SPACE(raw) bytes.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(&raw[..]) as u32) as usize;
            std::ptr::copy_nonoverlapping(raw.as_ptr(), libc::CMSG_DATA(c).cast(), raw.len());
        }
    }
    // SAFETY: msg points at live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    n >= 0 && n as usize == body.len()
}


/// The descriptors of kinds this target creates (sockets, memfds, eventfds, files under
/// /dev/shm), by number and target: the sanitizer's and libFuzzer's own (pipes to a
/// symbolizer, /dev/null) come and go between inputs and are not counted.
fn open_fds() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let t = std::fs::read_link(e.path()).ok()?.display().to_string();
                    let ours = t.starts_with("socket:")
                        || t.starts_with("/memfd:")
                        || t.starts_with("anon_inode:")
                        || t.starts_with("/dev/shm/");
                    ours.then(|| format!("{}={t}", e.file_name().to_string_lossy()))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// No input may leave a descriptor open that was not open before it.
fn check_fds(before: &[String], after: &[String]) {
    let new: Vec<&String> = after.iter().filter(|f| !before.contains(f)).collect();
    assert!(new.is_empty(), "descriptors leaked by this input: {new:?}");
}

fn expected_entries(p: &[&Packet]) -> Option<(Vec<String>, Vec<String>)> {
    // What receive_store must keep and refuse, if the packets are a well-formed store.
    let mut kept = Vec::new();
    let mut refused = Vec::new();
    for pk in p {
        if pk.body.is_empty() || pk.body.len() > MAX_MSG {
            return None;
        }
        match serde_json::from_slice::<Msg>(&pk.body).ok()? {
            Msg::Entry { key, value, crc: c } => {
                if crc(&value) == c {
                    kept.retain(|k| *k != key);
                    kept.push(key);
                } else {
                    refused.push(key);
                }
            }
            Msg::End { .. } => {
                kept.sort();
                return Some((kept, refused));
            }
            _ => return None,
        }
    }
    None
}

fuzz_target!(|data: &[u8]| {
    static INIT: std::sync::Once = std::sync::Once::new();
    // A send to a closed peer must fail with EPIPE, as in spoold (Rust's runtime ignores
    // SIGPIPE there; libFuzzer's main does not).
    // SAFETY: setting a signal disposition; no memory is involved.
    INIT.call_once(|| unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    });
    let before = open_fds();
    let mut b = Bytes(data);
    let reader = b.u8() % 4;
    let pkts = packets(&mut b);
    let (ours, theirs) = match Channel::pair() {
        Ok(p) => p,
        Err(_) => return,
    };
    match reader {
        0 => {
            for p in &pkts {
                if !send_raw(theirs.raw_fd(), &p.body, &p.fds) {
                    continue;
                }
                match ours.recv() {
                    Ok(Some((msg, files))) => {
                        assert_eq!(files.len(), p.fds.len(), "descriptors lost");
                        // Accepted messages survive a round trip through the encoder.
                        let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
                        if theirs.send(&msg, &raw).is_ok() {
                            let (again, f2) = ours
                                .recv()
                                .expect("re-encoded message is received")
                                .expect("not EOF");
                            assert_eq!(again, msg, "round trip changed the message");
                            assert_eq!(f2.len(), files.len());
                        }
                    }
                    Ok(None) => assert!(p.body.is_empty(), "EOF for a non-empty packet"),
                    Err(_) => {}
                }
            }
            drop(ours);
            drop(theirs);
        }
        _ => {
            // SAFETY: setting environment variables while no other thread of this process
            // reads them (the fuzzer runs inputs on one thread; command threads of earlier
            // inputs have ended).
            std::env::set_var(CHANNEL_ENV, ours.raw_fd().to_string());
            std::env::set_var(ROLE_ENV, if reader == 2 { "candidate" } else { "worker" });
            // from_env adopts the descriptor: give up ours without closing it.
            std::mem::forget(ours);
            let link = match KeeperLink::from_env() {
                Some(Ok(l)) => l,
                _ => panic!("cannot adopt the keeper channel"),
            };
            assert_eq!(link.is_candidate(), reader == 2);
            match theirs.recv() {
                Ok(Some((Msg::Hello { .. }, f))) => assert!(f.is_empty()),
                other => panic!("expected Hello, got {other:?}"),
            }
            // Packets that do not fit the socket buffer now are left out (never block).
            let sent: Vec<&Packet> = pkts
                .iter()
                .filter(|p| send_raw(theirs.raw_fd(), &p.body, &p.fds))
                .collect();
            match reader {
                1 => {
                    // The keeper's end stays open until the store was read; close it after
                    // the packets so a store without End ends in an error, not a hang.
                    let want = expected_entries(&sent);
                    drop(theirs);
                    match link.receive_store() {
                        Ok(mut r) => {
                            let (kept, refused) =
                                want.expect("receive_store accepted a malformed store");
                            assert_eq!(r.keys(), kept);
                            assert_eq!(r.refused, refused);
                            for k in kept {
                                assert!(r.take(&k).is_some());
                            }
                            assert!(r.is_empty());
                        }
                        Err(_) => {}
                    }
                }
                2 => {
                    drop(theirs);
                    let _ = link.preview(|entries| {
                        if entries.len() % 2 == 0 {
                            Ok(())
                        } else {
                            Err("odd".into())
                        }
                    });
                }
                _ => {
                    let rx = link.commands().expect("command thread");
                    drop(theirs);
                    let mut n = 0;
                    loop {
                        match rx.recv_timeout(std::time::Duration::from_secs(5)) {
                            Ok(Command::KeeperGone) => break,
                            Ok(_) => n += 1,
                            Err(e) => panic!("command thread did not report the closed channel: {e}"),
                        }
                        assert!(n <= sent.len());
                    }
                    // The thread returns right after KeeperGone; wait for it to drop its end.
                    let _ = link.last_report();
                }
            }
            drop(link);
        }
    }
    drop(pkts);
    // The command thread closes its clone of the channel just after sending KeeperGone.
    let mut after = open_fds();
    for _ in 0..1000 {
        if after.iter().all(|f| before.contains(f)) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
        after = open_fds();
    }
    check_fds(&before, &after);
});
