//! Structure-aware fuzzer of a whole vhost-user session against the real thing: a
//! `VolumeServer` (serving thread, sessions, polling workers, per-queue journals in a private
//! directory) for a 2-queue volume laid out over a real file-backed pool device, driven over
//! its Unix socket by a hand-built hostile frontend (the logic of
//! crates/spool-control/tests/common/raw.rs): vhost-user messages with descriptors attached
//! (SCM_RIGHTS), guest memory in memfds of our own, split rings we lay out and fill.
//!
//! The input is a config byte and then up to 64 operations (see `Op` below): the usual
//! session setup of a queue, single vhost-user messages with plausible or hostile payloads
//! (SET_MEM_TABLE with memfds of chosen sizes and offsets and mismatched descriptor counts,
//! ADD/REM_MEM_REG, SET_VRING_*, GET_VRING_BASE, resets, garbage with lying sizes), virtio-blk
//! requests written into guest memory and offered on the avail ring, raw guest writes into
//! rings and headers, a "guest" thread flipping bytes of descriptors, rings and headers while
//! the worker parses them, ftruncate of a memfd under the worker (SIGBUS, covered by
//! spool-sigbus: the session is closed), reconnects (journals persist: recovery runs), a
//! live-restart through the keeper's state (`detach` and `Restore`, as an upgrade does),
//! device resets and volume resizes. Sleeps are at most 1 ms.
//!
//! Everything is torn down per input (server, connection, memfds, threads); journals are
//! deleted before each input. Beyond "never crash, never hang" the harness checks that no
//! descriptor outlives the input (the process's descriptor count is back where it started).
//! Client-side I/O errors are ignored: the server closing the connection is a valid answer.
#![no_main]

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use spool_devices::{Device, OpenOptions};
use spool_frontend::{
    listen_key, session_key, FrontendSettings, Restore, StateStore, VolumeContext, VolumeServer,
};
use spool_pool::{Segment, VolumeLayout};
use uuid::Uuid;

// ---- vhost-user ---------------------------------------------------------------------------

const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_OWNER: u32 = 3;
const RESET_OWNER: u32 = 4;
const SET_MEM_TABLE: u32 = 5;
const SET_LOG_BASE: u32 = 6;
const SET_VRING_NUM: u32 = 8;
const SET_VRING_ADDR: u32 = 9;
const SET_VRING_BASE: u32 = 10;
const GET_VRING_BASE: u32 = 11;
const SET_VRING_KICK: u32 = 12;
const SET_VRING_CALL: u32 = 13;
const SET_VRING_ERR: u32 = 14;
const GET_PROTOCOL_FEATURES: u32 = 15;
const SET_PROTOCOL_FEATURES: u32 = 16;
const GET_QUEUE_NUM: u32 = 17;
const SET_VRING_ENABLE: u32 = 18;
const GET_CONFIG: u32 = 24;
const RESET_DEVICE: u32 = 34;
const GET_MAX_MEM_SLOTS: u32 = 36;
const ADD_MEM_REG: u32 = 37;
const REM_MEM_REG: u32 = 38;

/// Messages the server answers (without REPLY_ACK).
fn has_reply(code: u32) -> bool {
    matches!(
        code,
        GET_FEATURES | GET_VRING_BASE | GET_PROTOCOL_FEATURES | GET_QUEUE_NUM | GET_CONFIG
            | GET_MAX_MEM_SLOTS
    )
}

const VERSION_1: u64 = 1 << 32;
const PROTOCOL_FEATURES: u64 = 1 << 30;
const EVENT_IDX: u64 = 1 << 29;
const INDIRECT_DESC: u64 = 1 << 28;

/// Frontend virtual address of the first region (any value: the server translates).
const VVA: u64 = 0x7f00_0000_0000;

// ---- the volume ---------------------------------------------------------------------------

const VOLUME: Uuid = Uuid::from_u128(0xf0220000_0000_4000_8000_000000000001);
const QUEUES: u16 = 2;
const SEG: u64 = 512 * 1024;

struct Env {
    _dir: tempfile::TempDir,
    sock: PathBuf,
    journals: PathBuf,
    device: Arc<Device>,
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        // Writes to a closed connection must fail with EPIPE, as in spoold (Rust's runtime
        // ignores SIGPIPE there; libFuzzer's main does not).
        // SAFETY: setting a signal disposition; no memory is involved.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            "/dev/shm"
        } else {
            "/tmp"
        };
        let dir = tempfile::Builder::new()
            .prefix("spool-fuzz-session")
            .tempdir_in(base)
            .expect("tempdir");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let device = Device::open(
            &dir.path().join("device"),
            &OpenOptions {
                create_size: Some(4 << 20),
                no_direct: true,
                ..Default::default()
            },
        )
        .expect("device");
        Env {
            sock: dir.path().join("vol.sock"),
            journals: dir.path().join("journals"),
            device: Arc::new(device),
            _dir: dir,
        }
    })
}

/// The volume: `segs` segments of 512 KiB, not contiguous on the device (so requests split),
/// capacity a little short of their end.
fn layout(read_only: bool, encrypted: bool, segs: u64) -> VolumeLayout {
    VolumeLayout {
        uuid: VOLUME,
        name: "fz".into(),
        size: segs * SEG - 4096,
        read_only,
        num_queues: QUEUES,
        segments: (0..segs)
            .map(|i| Segment {
                logical: i * SEG,
                len: SEG,
                device: 0,
                offset: (1 << 20) + i * (SEG + 4096 * (i + 1)),
            })
            .collect(),
        devices: vec![env().device.clone()],
        qos: None,
        // An encrypted volume's requests go through spool-crypt's CryptQueue.
        cipher: encrypted.then(cipher),
        discard_alignment: 4096,
        generation: 0,
    }
}

/// One data cipher for every encrypted session (a fresh key each run of the target).
fn cipher() -> spool_pool::VolumeCipher {
    static CIPHER: OnceLock<spool_pool::VolumeCipher> = OnceLock::new();
    CIPHER
        .get_or_init(|| {
            let key = spool_crypt::DataKey::generate().expect("random source");
            Arc::new(key.cipher().expect("a generated key's halves differ"))
        })
        .clone()
}

/// The keeper's store, in memory: values with their own copies of the descriptors.
#[derive(Default)]
struct MemStore(Mutex<HashMap<String, (String, Vec<File>)>>);

fn dup(fd: RawFd) -> Option<File> {
    // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor number; no memory is involved.
    let n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    // SAFETY: a fresh descriptor we own.
    (n >= 0).then(|| unsafe { File::from_raw_fd(n) })
}

impl StateStore for MemStore {
    fn put(&self, key: &str, value: String, fds: &[RawFd]) -> std::io::Result<()> {
        if fds.len() > 250 {
            return Err(std::io::Error::other("too many descriptors"));
        }
        let files = fds
            .iter()
            .map(|&fd| dup(fd).ok_or_else(|| std::io::Error::other("bad descriptor")))
            .collect::<std::io::Result<Vec<_>>>()?;
        self.0
            .lock()
            .unwrap()
            .insert(key.to_string(), (value, files));
        Ok(())
    }
    fn remove(&self, prefix: &str) -> std::io::Result<()> {
        self.0.lock().unwrap().retain(|k, _| !k.starts_with(prefix));
        Ok(())
    }
}

// ---- guest memory -------------------------------------------------------------------------

const MAP_LEN: usize = 512 * 1024;
const PAGE: usize = 4096;

/// A memfd of guest memory, mapped here too. Writes stay inside the file's current length
/// (the client must not SIGBUS itself); `lock` orders them against ftruncate.
struct Memfd {
    fd: OwnedFd,
    ptr: usize,
    len: AtomicUsize,
    lock: RwLock<()>,
}

impl Memfd {
    fn new(size: usize) -> Option<Arc<Memfd>> {
        // SAFETY: memfd_create with a static name; checked.
        let fd = unsafe { libc::memfd_create(c"spool-fuzz-guest".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) } != 0 {
            return None;
        }
        // SAFETY: a shared mapping of our memfd; accesses past its end are never made.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MAP_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        Some(Arc::new(Memfd {
            fd,
            ptr: ptr as usize,
            len: AtomicUsize::new(size),
            lock: RwLock::new(()),
        }))
    }

    fn size(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    /// Writes `bytes` at file offset `off` if the file holds them now.
    fn write(&self, off: u64, bytes: &[u8]) {
        let _g = self.lock.read().unwrap_or_else(|p| p.into_inner());
        let safe = (self.size() & !(PAGE - 1)).min(MAP_LEN) as u64;
        if off.checked_add(bytes.len() as u64).is_none_or(|e| e > safe) {
            return;
        }
        for (i, b) in bytes.iter().enumerate() {
            // SAFETY: inside our mapping and inside the file (checked above, under the lock
            // that ftruncate takes); the server reads it concurrently, as a guest's memory.
            unsafe { std::ptr::write_volatile((self.ptr + off as usize + i) as *mut u8, *b) };
        }
    }

    fn read_u16(&self, off: u64) -> Option<u16> {
        let _g = self.lock.read().unwrap_or_else(|p| p.into_inner());
        let safe = (self.size() & !(PAGE - 1)).min(MAP_LEN) as u64;
        if off.checked_add(2).is_none_or(|e| e > safe) {
            return None;
        }
        // Byte by byte: `off` comes from the fuzzer's input and need not be even (a u16
        // read there was unaligned: UB, which the fuzzer found).
        let byte = |i: usize| {
            // SAFETY: inside our mapping and the file (checked above); a byte needs no
            // alignment.
            unsafe { std::ptr::read_volatile((self.ptr + off as usize + i) as *const u8) }
        };
        Some(u16::from_le_bytes([byte(0), byte(1)]))
    }

    fn truncate(&self, size: usize) {
        let _g = self.lock.write().unwrap_or_else(|p| p.into_inner());
        // SAFETY: ftruncate on our memfd; our own writers are held off by the lock.
        if unsafe { libc::ftruncate(self.fd.as_raw_fd(), size as i64) } == 0 {
            self.len.store(size, Ordering::Release);
        }
    }
}

impl Drop for Memfd {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, MAP_LEN) };
    }
}

/// A region as this client last described it to the server.
#[derive(Clone, Copy)]
struct Region {
    gpa: u64,
    size: u64,
    vva: u64,
    mem: usize,
    offset: u64,
}

/// A split virtqueue as this client laid it out (guest addresses).
#[derive(Clone, Copy, Default)]
struct Ring {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    avail_idx: u16,
}

// ---- input --------------------------------------------------------------------------------

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(std::array::from_fn(|_| self.u8()))
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(std::array::from_fn(|_| self.u8()))
    }
    fn take(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a.to_vec()
    }
}

fn eventfd() -> Option<OwnedFd> {
    // SAFETY: eventfd with no memory involved; checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    // SAFETY: a fresh descriptor we own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

// ---- the frontend -------------------------------------------------------------------------

struct Client {
    sock: Option<UnixStream>,
    mems: Vec<Arc<Memfd>>,
    table: Vec<Region>,
    rings: [Ring; QUEUES as usize],
    /// Eventfds the server was given (kept open like a frontend does).
    efds: Vec<OwnedFd>,
    reply_ack: bool,
    flipper: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
}

impl Client {
    fn connect(&mut self) {
        self.sock = UnixStream::connect(&env().sock).ok();
        if let Some(s) = &self.sock {
            let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
            let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
        }
        self.reply_ack = false;
    }

    fn send_raw(&mut self, code: u32, flags: u32, size: u32, payload: &[u8], fds: &[RawFd]) {
        let Some(sock) = &self.sock else { return };
        let mut m = Vec::with_capacity(12 + payload.len());
        m.extend_from_slice(&code.to_le_bytes());
        m.extend_from_slice(&flags.to_le_bytes());
        m.extend_from_slice(&size.to_le_bytes());
        m.extend_from_slice(payload);
        let mut iov = libc::iovec {
            iov_base: m.as_mut_ptr().cast(),
            iov_len: m.len(),
        };
        // SAFETY: a zeroed msghdr is valid; we point it at our iovec and control buffer.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        let mut cbuf;
        if !fds.is_empty() {
            // SAFETY: CMSG_SPACE is a pure size computation.
            let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
            cbuf = vec![0u64; space.div_ceil(8)];
            msg.msg_control = cbuf.as_mut_ptr().cast();
            msg.msg_controllen = space;
            // SAFETY: the control buffer holds one cmsg of CMSG_SPACE(fds) bytes.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as usize;
                std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
            }
        }
        // SAFETY: msg points at live buffers for the duration of the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 && (n as usize) < m.len() {
            let _ = (&*sock).write_all(&m[n as usize..]);
        }
    }

    /// Sends a well-framed message (NEED_REPLY when `ack` and REPLY_ACK was negotiated) and
    /// reads its reply if it has one.
    fn send(&mut self, code: u32, payload: &[u8], fds: &[RawFd], ack: bool) {
        let need = ack && self.reply_ack;
        self.send_raw(code, if need { 1 | 8 } else { 1 }, payload.len() as u32, payload, fds);
        if need || has_reply(code) {
            self.reply();
        }
    }

    /// Reads one reply; None on error, timeout or a closed connection.
    fn reply(&mut self) -> Option<Vec<u8>> {
        let sock = self.sock.as_ref()?;
        let mut hdr = [0u8; 12];
        if (&*sock).read_exact(&mut hdr).is_err() {
            // Closed or stuck: stop talking on this connection.
            self.sock = None;
            return None;
        }
        let len = (u32::from_le_bytes(hdr[8..12].try_into().unwrap()) as usize).min(4096);
        let mut body = vec![0u8; len];
        if (&*sock).read_exact(&mut body).is_err() {
            self.sock = None;
            return None;
        }
        Some(body)
    }

    fn ask_u64(&mut self, code: u32) -> Option<u64> {
        self.send_raw(code, 1, 0, &[], &[]);
        let b = self.reply()?;
        Some(u64::from_le_bytes(b.get(..8)?.try_into().ok()?))
    }

    fn vring_state(&mut self, code: u32, index: u32, v: u32, ack: bool) {
        let mut p = index.to_le_bytes().to_vec();
        p.extend_from_slice(&v.to_le_bytes());
        self.send(code, &p, &[], ack);
    }

    fn vring_addr(&mut self, index: u32, flags: u32, desc: u64, used: u64, avail: u64, ack: bool) {
        let mut p = index.to_le_bytes().to_vec();
        p.extend_from_slice(&flags.to_le_bytes());
        for v in [desc, used, avail, 0u64] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        self.send(SET_VRING_ADDR, &p, &[], ack);
    }

    fn vring_fd(&mut self, code: u32, index: u64, fd: Option<RawFd>, ack: bool) {
        let body = match fd {
            Some(_) => index,
            None => index | 0x100,
        };
        let fds: Vec<RawFd> = fd.into_iter().collect();
        self.send(code, &body.to_le_bytes(), &fds, ack);
    }

    fn mem(&mut self, i: usize) -> Option<Arc<Memfd>> {
        while self.mems.len() <= i {
            let size = [128 * 1024, 64 * 1024, 256 * 1024][self.mems.len() % 3];
            self.mems.push(Memfd::new(size)?);
        }
        Some(self.mems[i].clone())
    }

    /// Where guest address `gpa` lives in our memfds (per the table we last sent).
    fn locate(&self, gpa: u64, len: u64) -> Option<(Arc<Memfd>, u64)> {
        let r = self.table.iter().find(|r| {
            gpa >= r.gpa && (gpa - r.gpa).checked_add(len).is_some_and(|e| e <= r.size)
        })?;
        Some((self.mems.get(r.mem)?.clone(), r.offset.checked_add(gpa - r.gpa)?))
    }

    fn write(&self, gpa: u64, bytes: &[u8]) {
        if let Some((m, off)) = self.locate(gpa, bytes.len() as u64) {
            m.write(off, bytes);
        }
    }

    fn stop_flipper(&mut self) {
        if let Some((stop, t)) = self.flipper.take() {
            stop.store(true, Ordering::Release);
            let _ = t.join();
        }
    }
}

/// One region description from the input: plausible mostly, hostile sometimes.
fn region(c: &mut Client, b: &mut Bytes, slot: u64) -> Option<(Region, RawFd)> {
    let sel = b.u8();
    let mi = (sel % 3) as usize;
    let m = c.mem(mi)?;
    let flen = m.size() as u64;
    let gpa = match (sel >> 2) % 4 {
        0 | 1 => slot * 0x10_0000,
        2 => (b.u8() as u64) << 12,
        _ => b.u64(),
    };
    let size = match (sel >> 4) % 4 {
        0 | 1 => flen,
        2 => [PAGE as u64, flen.saturating_sub(PAGE as u64), flen + PAGE as u64, 0][b.u8() as usize % 4],
        _ => b.u64(),
    };
    let offset = match sel >> 6 {
        0 | 1 => 0,
        2 => [PAGE as u64, 123, flen, flen / 2][b.u8() as usize % 4],
        _ => b.u64(),
    };
    let vva = if b.u8() & 0xf0 == 0xf0 {
        b.u64()
    } else {
        VVA + slot * 0x1000_0000
    };
    let fd = if b.0.first().is_some_and(|x| *x == 0xee) {
        b.u8();
        // Not a memfd: an eventfd (must be refused).
        let e = eventfd()?;
        let raw = e.as_raw_fd();
        c.efds.push(e);
        raw
    } else {
        m.fd.as_raw_fd()
    };
    Some((
        Region {
            gpa,
            size,
            vva,
            mem: mi,
            offset,
        },
        fd,
    ))
}

fn region_bytes(r: &Region) -> Vec<u8> {
    let mut p = Vec::with_capacity(32);
    for v in [r.gpa, r.size, r.vva, r.offset] {
        p.extend_from_slice(&v.to_le_bytes());
    }
    p
}

/// Rings of queue `q` live at `q * 0x4000` of the first region: descriptors, then avail at
/// +0x1000, used at +0x2000 (room for 256 entries). Request headers from 0x8000, data from
/// 0x10000.
const HDRS: u64 = 0x8000;
const DATA: u64 = 0x10000;

fn setup(c: &mut Client, b: &mut Bytes, q: usize) {
    let sel = b.u8();
    let offered = c.ask_u64(GET_FEATURES).unwrap_or(0);
    c.send(SET_OWNER, &[], &[], false);
    let mut want = VERSION_1;
    if sel & 1 != 0 {
        want |= PROTOCOL_FEATURES;
    }
    if sel & 2 != 0 {
        want |= EVENT_IDX;
    }
    if sel & 4 != 0 {
        want |= INDIRECT_DESC;
    }
    if sel & 8 != 0 {
        want |= offered; // everything offered (discard, write zeroes, ...)
    }
    c.send(SET_FEATURES, &(offered & want).to_le_bytes(), &[], false);
    if offered & want & PROTOCOL_FEATURES != 0 {
        let p = c.ask_u64(GET_PROTOCOL_FEATURES).unwrap_or(0);
        let mask = if sel & 16 != 0 { !8u64 } else { !0 }; // without REPLY_ACK
        c.send(SET_PROTOCOL_FEATURES, &(p & mask).to_le_bytes(), &[], false);
        c.reply_ack = p & mask & 8 != 0;
    }
    if let Some(m) = c.mem(0) {
        let r = Region {
            gpa: 0,
            size: m.size() as u64,
            vva: VVA,
            mem: 0,
            offset: 0,
        };
        let mut p = 1u32.to_le_bytes().to_vec();
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend_from_slice(&region_bytes(&r));
        c.send(SET_MEM_TABLE, &p, &[m.fd.as_raw_fd()], true);
        c.table = vec![r];
    }
    let size = [8u16, 16, 256, 1, 4, 2, 128, 64][(sel >> 5) as usize];
    let base = q as u64 * 0x4000;
    c.rings[q] = Ring {
        size,
        desc: base,
        avail: base + 0x1000,
        used: base + 0x2000,
        avail_idx: 0,
    };
    // A fresh ring: indices zero.
    c.write(base + 0x1000, &[0; 4]);
    c.write(base + 0x2000, &[0; 4]);
    c.vring_state(SET_VRING_NUM, q as u32, size as u32, true);
    c.vring_addr(
        q as u32,
        0,
        VVA + base,
        VVA + base + 0x2000,
        VVA + base + 0x1000,
        true,
    );
    c.vring_state(SET_VRING_BASE, q as u32, 0, true);
    if let (Some(call), Some(kick)) = (eventfd(), eventfd()) {
        c.vring_fd(SET_VRING_CALL, q as u64, Some(call.as_raw_fd()), true);
        c.vring_fd(SET_VRING_KICK, q as u64, Some(kick.as_raw_fd()), true);
        c.efds.push(call);
        c.efds.push(kick);
    }
    if offered & want & PROTOCOL_FEATURES != 0 {
        c.vring_state(SET_VRING_ENABLE, q as u32, 1, true);
    }
}

fn kick(c: &Client, q: usize) {
    // The most recent kick eventfd handed over for any queue: kicks are hints only, and the
    // worker also polls; writing every eventfd we hold reaches the right one.
    let one = 1u64.to_ne_bytes();
    for e in c.efds.iter().rev().take(2 * (q + 1)) {
        // SAFETY: writes 8 bytes from our buffer to our own eventfd.
        unsafe { libc::write(e.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const T_DISCARD: u32 = 11;
const T_WRITE_ZEROES: u32 = 13;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;

/// Writes a virtio-blk request into guest memory and offers it on queue `q`'s avail ring.
fn post(c: &mut Client, b: &mut Bytes, q: usize) {
    let ring = c.rings[q];
    if ring.size == 0 {
        return;
    }
    let shape = b.u8();
    let ty = match shape % 8 {
        0 | 1 => T_IN,
        2 | 3 => T_OUT,
        4 => T_FLUSH,
        5 => T_GET_ID,
        6 => [T_DISCARD, T_WRITE_ZEROES][(shape >> 3) as usize % 2],
        _ => b.u32(),
    };
    let slot = (b.u8() % 16) as u64;
    let cap_sectors = 2 * SEG / 512 - 8;
    let sector = match b.u8() % 8 {
        0 | 1 => 0,
        2 => b.u8() as u64,
        3 => cap_sectors - 1,
        4 => cap_sectors - 8,
        5 => cap_sectors,
        6 => SEG / 512 - 1, // crosses the segment boundary
        _ => b.u64(),
    };
    let len: u32 = match b.u8() % 8 {
        0 | 1 => 512,
        2 => 4096,
        3 => 0,
        4 => 1,
        5 => 513,
        6 => 8192, // runs into the next slot's data
        _ => 16,   // one discard segment
    };
    let hdr = HDRS + slot * 32;
    let status = hdr + 16;
    let data = DATA + slot * 0x1000;
    let mut h = Vec::with_capacity(16);
    h.extend_from_slice(&ty.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&sector.to_le_bytes());
    c.write(hdr, &h);
    c.write(status, &[0xff]);
    if matches!(ty, T_DISCARD | T_WRITE_ZEROES) {
        let mut seg = Vec::new();
        seg.extend_from_slice(&sector.to_le_bytes());
        seg.extend_from_slice(&((b.u8() as u32) + 1).to_le_bytes());
        seg.extend_from_slice(&((b.u8() & 1) as u32).to_le_bytes());
        c.write(data, &seg);
    }
    let dflags = if matches!(ty, T_IN | T_GET_ID) {
        F_WRITE
    } else {
        0
    };
    // Descriptor list (addr, len, flags) before chaining.
    let mut chain: Vec<(u64, u32, u16)> = match (shape >> 4) % 8 {
        0..=2 => vec![(hdr, 16, 0), (data, len, dflags), (status, 1, F_WRITE)],
        3 => vec![(hdr, 16, 0), (status, 1, F_WRITE)],
        4 => vec![
            (hdr, 16, 0),
            (data, len / 2, dflags),
            (data + len as u64 / 2, len - len / 2, dflags),
            (status, 1, F_WRITE),
        ],
        5 => vec![(hdr, 16 + len, 0), (status, 1, F_WRITE)],
        6 => {
            // Indirect: the table lives in the slot's data page, past the data.
            let table = data + 0x800;
            let entries = [(hdr, 16u32, F_NEXT), (data, len.min(0x800), dflags | F_NEXT), (status, 1, F_WRITE)];
            for (i, (a, l, f)) in entries.iter().enumerate() {
                let mut d = Vec::with_capacity(16);
                d.extend_from_slice(&a.to_le_bytes());
                d.extend_from_slice(&l.to_le_bytes());
                d.extend_from_slice(&f.to_le_bytes());
                d.extend_from_slice(&((i as u16 + 1) % 3).to_le_bytes());
                c.write(table + 16 * i as u64, &d);
            }
            vec![(table, 48, F_INDIRECT)]
        }
        _ => vec![(hdr, 16, 0), (data, len, dflags), (data, len, dflags), (status, 1, F_WRITE)],
    };
    if shape & 0x80 != 0 {
        // Hostile: one descriptor's fields changed.
        let i = b.u8() as usize % chain.len();
        match b.u8() % 4 {
            0 => chain[i].0 = b.u64(),
            1 => chain[i].1 = b.u32(),
            2 => chain[i].2 ^= b.u16(),
            _ => chain[i].2 ^= F_WRITE,
        }
    }
    let head = b.u16() % ring.size;
    let n = chain.len() as u16;
    let loop_back = shape & 0x40 != 0 && b.u8() & 1 != 0;
    for (i, (addr, l, f)) in chain.iter().enumerate() {
        let idx = (head + i as u16) % ring.size;
        let last = i as u16 + 1 == n;
        let next = if last && loop_back {
            head
        } else {
            (idx + 1) % ring.size
        };
        let flags = if last && !loop_back { *f } else { *f | F_NEXT };
        let mut d = Vec::with_capacity(16);
        d.extend_from_slice(&addr.to_le_bytes());
        d.extend_from_slice(&l.to_le_bytes());
        d.extend_from_slice(&flags.to_le_bytes());
        d.extend_from_slice(&next.to_le_bytes());
        c.write(ring.desc + 16 * idx as u64, &d);
    }
    c.write(
        ring.avail + 4 + 2 * (ring.avail_idx % ring.size) as u64,
        &head.to_le_bytes(),
    );
    let r = &mut c.rings[q];
    r.avail_idx = r.avail_idx.wrapping_add(1);
    let idx = r.avail_idx;
    std::sync::atomic::fence(Ordering::SeqCst);
    c.write(ring.avail + 2, &idx.to_le_bytes());
    if b.u8() & 3 != 0 {
        kick(c, q);
    }
}

/// A "guest" thread that flips bytes of queue `q`'s descriptors, avail ring and request
/// headers while the worker reads them.
fn start_flipper(c: &mut Client, b: &mut Bytes, q: usize) {
    c.stop_flipper();
    let ring = c.rings[q];
    let first = c.locate(ring.desc, 1).map(|(m, _)| m);
    let areas: Vec<(u64, u64)> = [
        (ring.desc, 16 * ring.size.max(1) as u64),
        (ring.avail, 4 + 2 * ring.size.max(1) as u64),
        (HDRS, 16 * 32),
        (ring.used, 4),
    ]
    .into_iter()
    .filter_map(|(gpa, len)| {
        let (m, off) = c.locate(gpa, len)?;
        Some((m, off, len))
    })
    .collect::<Vec<_>>()
    .into_iter()
    .filter(|(m, _, _)| first.as_ref().is_some_and(|f| Arc::ptr_eq(f, m)))
    .map(|(_, off, len)| (off, len))
    .collect();
    let Some(m) = first else {
        return;
    };
    if areas.is_empty() {
        return;
    }
    let mut seed = b.u32() as u64 | 1;
    let count = 64 * (1 + b.u8() as usize);
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let t = std::thread::Builder::new()
        .name("fuzz-guest".into())
        .spawn(move || {
            for _ in 0..count {
                if s2.load(Ordering::Acquire) {
                    break;
                }
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let (off, len) = areas[(seed % areas.len() as u64) as usize];
                let at = off + (seed >> 8) % len;
                m.write(at, &[(seed >> 40) as u8]);
                if seed & 0x3f == 0 {
                    std::thread::yield_now();
                }
            }
        });
    if let Ok(t) = t {
        c.flipper = Some((stop, t));
    }
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

fn start_server(ctx: &Arc<VolumeContext>, store: &Option<Arc<MemStore>>, restore: Restore) -> Option<VolumeServer> {
    let s = store.clone().map(|s| s as Arc<dyn StateStore>);
    VolumeServer::start(&env().sock, ctx.clone(), s, restore).ok()
}

/// The upgrade handoff: the server stops without closing anything, and a new one continues
/// from what it left in the store.
fn restart(server: VolumeServer, ctx: &Arc<VolumeContext>, store: &Option<Arc<MemStore>>) -> Option<VolumeServer> {
    let Some(st) = store else {
        drop(server);
        return start_server(ctx, store, Restore::default());
    };
    server.detach();
    let mut map = st.0.lock().unwrap();
    let listener = map
        .get(&listen_key(VOLUME))
        .and_then(|(_, f)| f.first())
        .and_then(|f| dup(f.as_raw_fd()))
        // SAFETY: the store's copy of the listening socket, duplicated: ours to own.
        .map(|f| unsafe { UnixListener::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(f)) });
    let session = map.remove(&session_key(VOLUME));
    drop(map);
    start_server(ctx, store, Restore { listener, session })
}

fuzz_target!(|data: &[u8]| {
    let env = env();
    let before = open_fds();
    let mut b = Bytes(data);
    let cfg = b.u8();
    let read_only = cfg & 1 != 0;
    let use_store = cfg & 2 != 0;
    let encrypted = cfg & 128 != 0;
    let settings = FrontendSettings {
        poll_idle: if cfg & 4 != 0 {
            Duration::ZERO
        } else {
            Duration::from_micros(50)
        },
        journal_dir: Some(env.journals.clone()),
        io_timeout: Duration::from_secs(5),
        request_retries: 1,
        state_fd_limit: [250, 12, 8, 4][(cfg >> 3) as usize % 4],
        clock: Default::default(),
        share_group: Default::default(),
        fair_share: cfg & 32 != 0,
        // Queues served by one thread (a poll group) or a thread each.
        volume_threads: usize::from(cfg & 64 != 0),
        ..Default::default()
    };
    spool_journal::remove_volume_journals(&env.journals, VOLUME);
    let ctx = VolumeContext::new(layout(read_only, encrypted, 2), settings);
    let store = use_store.then(|| Arc::new(MemStore::default()));
    let Some(mut server) = start_server(&ctx, &store, Restore::default()) else {
        return;
    };
    let mut c = Client {
        sock: None,
        mems: Vec::new(),
        table: Vec::new(),
        rings: Default::default(),
        efds: Vec::new(),
        reply_ack: false,
        flipper: None,
    };
    c.connect();

    for _ in 0..64 {
        if b.0.is_empty() {
            break;
        }
        let op = b.u8();
        let q = (op >> 7) as usize; // queue 0 or 1
        let ack = op & 0x40 != 0;
        match op % 32 {
            0..=3 => setup(&mut c, &mut b, q),
            4..=8 => post(&mut c, &mut b, q),
            9 => kick(&c, q),
            10 => {
                // SET_MEM_TABLE: 0..=3 regions, descriptor count right or off by one.
                let sel = b.u8();
                let n = (sel % 4) as usize;
                let mut regions = Vec::new();
                let mut fds = Vec::new();
                for i in 0..n {
                    if let Some((r, fd)) = region(&mut c, &mut b, i as u64) {
                        regions.push(r);
                        fds.push(fd);
                    }
                }
                match sel >> 6 {
                    1 => {
                        fds.pop();
                    }
                    2 => {
                        if let Some(m) = c.mem(0) {
                            fds.push(m.fd.as_raw_fd());
                        }
                    }
                    _ => {}
                }
                let mut p = (regions.len() as u32).to_le_bytes().to_vec();
                p.extend_from_slice(&0u32.to_le_bytes());
                for r in &regions {
                    p.extend_from_slice(&region_bytes(r));
                }
                c.send(SET_MEM_TABLE, &p, &fds, ack);
                c.table = regions;
            }
            11 => {
                let slot = 1 + (b.u8() % 4) as u64;
                if let Some((r, fd)) = region(&mut c, &mut b, slot) {
                    let mut p = 0u64.to_le_bytes().to_vec();
                    p.extend_from_slice(&region_bytes(&r));
                    c.send(ADD_MEM_REG, &p, &[fd], ack);
                    c.table.push(r);
                }
            }
            12 => {
                let r = if c.table.is_empty() || b.u8() & 3 == 0 {
                    Region {
                        gpa: b.u64(),
                        size: b.u64(),
                        vva: 0,
                        mem: 0,
                        offset: 0,
                    }
                } else {
                    let i = b.u8() as usize % c.table.len();
                    c.table.remove(i)
                };
                let mut p = 0u64.to_le_bytes().to_vec();
                p.extend_from_slice(&region_bytes(&r));
                c.send(REM_MEM_REG, &p, &[], ack);
            }
            13 => {
                let num = match b.u8() % 4 {
                    0 => 1u32 << (b.u8() % 17),
                    1 => b.u16() as u32,
                    2 => b.u32(),
                    _ => 0,
                };
                c.vring_state(SET_VRING_NUM, q as u32, num, ack);
            }
            14 => {
                // Ring addresses: mostly inside the first region, sometimes anywhere.
                let a = |b: &mut Bytes| match b.u8() % 4 {
                    0 => b.u64(),
                    _ => VVA + (b.u16() as u64) * 2,
                };
                let (d, u, av) = (a(&mut b), a(&mut b), a(&mut b));
                let flags = if b.u8() == 0xff { 1 } else { 0 };
                let index = if b.u8() == 0xff { b.u32() } else { q as u32 };
                c.vring_addr(index, flags, d, u, av, ack);
            }
            15 => {
                let v = if b.u8() & 1 == 0 { b.u16() as u32 } else { b.u32() };
                c.vring_state(SET_VRING_BASE, q as u32, v, ack);
            }
            16 => {
                c.stop_flipper();
                c.vring_state(GET_VRING_BASE, q as u32, 0, false);
            }
            17 => {
                // SET_VRING_KICK / CALL / ERR with an eventfd, no descriptor, or a memfd.
                let code = [SET_VRING_KICK, SET_VRING_CALL, SET_VRING_ERR][b.u8() as usize % 3];
                let index = if b.u8() == 0xff { b.u8() as u64 } else { q as u64 };
                match b.u8() % 4 {
                    0 => c.vring_fd(code, index, None, ack),
                    1 => {
                        if let Some(m) = c.mem(0) {
                            c.vring_fd(code, index, Some(m.fd.as_raw_fd()), ack);
                        }
                    }
                    _ => {
                        if let Some(e) = eventfd() {
                            c.vring_fd(code, index, Some(e.as_raw_fd()), ack);
                            c.efds.push(e);
                        }
                    }
                }
            }
            18 => {
                let v = (b.u8() & 1) as u32;
                let index = if b.u8() == 0xff { b.u32() } else { q as u32 };
                c.vring_state(SET_VRING_ENABLE, index, v, ack);
            }
            19 => {
                let code = [
                    GET_FEATURES,
                    GET_PROTOCOL_FEATURES,
                    GET_QUEUE_NUM,
                    GET_MAX_MEM_SLOTS,
                    RESET_OWNER,
                    RESET_DEVICE,
                    SET_OWNER,
                    GET_CONFIG,
                ][b.u8() as usize % 8];
                if code == GET_CONFIG {
                    let off = b.u8() as u32;
                    let size = (b.u8() % 80) as u32;
                    let mut p = off.to_le_bytes().to_vec();
                    p.extend_from_slice(&size.to_le_bytes());
                    p.extend_from_slice(&0u32.to_le_bytes());
                    p.extend(std::iter::repeat_n(0u8, size as usize));
                    c.send(GET_CONFIG, &p, &[], false);
                } else {
                    if matches!(code, RESET_OWNER | RESET_DEVICE) {
                        c.stop_flipper();
                    }
                    c.send(code, &[], &[], ack);
                }
            }
            20 => {
                // SET_FEATURES / SET_PROTOCOL_FEATURES with any bits (VHOST_F_LOG_ALL and
                // LOG_SHMFD among them), or SET_LOG_BASE: a guest memfd as the dirty log, of
                // any size and offset (it may not hold them, and may be truncated later).
                match b.u8() % 3 {
                    0 | 1 => {
                        let code = if b.u8() & 1 == 0 {
                            SET_FEATURES
                        } else {
                            SET_PROTOCOL_FEATURES
                        };
                        let v = b.u64();
                        c.send(code, &v.to_le_bytes(), &[], ack);
                    }
                    _ => {
                        let size = match b.u8() % 4 {
                            0 => 0,
                            1 => 64,
                            2 => b.u32() as u64,
                            _ => 1 << 20,
                        };
                        let offset = match b.u8() % 3 {
                            0 => 0,
                            1 => b.u16() as u64,
                            _ => b.u64(),
                        };
                        if let Some(m) = c.mem(b.u8() as usize % 3) {
                            let mut p = size.to_le_bytes().to_vec();
                            p.extend_from_slice(&offset.to_le_bytes());
                            c.send_raw(SET_LOG_BASE, 1, 16, &p, &[m.fd.as_raw_fd()]);
                            c.reply();
                        }
                    }
                }
            }
            21 => {
                // Garbage: any code and flags, a size that may lie, any payload, descriptors.
                let code = if b.u8() & 1 == 0 {
                    (b.u8() % 48) as u32
                } else {
                    b.u32()
                };
                let flags = match b.u8() % 4 {
                    0 => 1,
                    1 => 1 | 8,
                    2 => 0,
                    _ => b.u32(),
                };
                let plen = (b.u8() % 64) as usize;
                let payload = b.take(plen);
                let size = match b.u8() % 4 {
                    0 => b.u32(),
                    1 => payload.len() as u32 + 1,
                    _ => payload.len() as u32,
                };
                let mut fds = Vec::new();
                for _ in 0..b.u8() % 3 {
                    if let Some(e) = eventfd() {
                        fds.push(e.as_raw_fd());
                        c.efds.push(e);
                    }
                }
                c.send_raw(code, flags, size, &payload, &fds);
                if has_reply(code) {
                    c.reply();
                }
            }
            22 => {
                // A guest write into the rings, headers or anywhere.
                let ring = c.rings[q];
                let gpa = match b.u8() % 6 {
                    0 => ring.desc + b.u16() as u64 % (16 * ring.size.max(1) as u64),
                    1 => ring.avail + b.u8() as u64,
                    2 => ring.used + b.u8() as u64,
                    3 => HDRS + b.u16() as u64 % 512,
                    4 => DATA + b.u16() as u64,
                    _ => b.u32() as u64,
                };
                let n = (b.u8() % 16) as usize + 1;
                let bytes = b.take(n);
                c.write(gpa, &bytes);
                if let Some((m, o)) = c.locate(ring.avail + 2, 2) {
                    let _ = m.read_u16(o);
                }
            }
            23 => start_flipper(&mut c, &mut b, q),
            24 => c.stop_flipper(),
            25 => {
                // ftruncate a memfd under the worker (shrink: SIGBUS on its next access).
                let i = b.u8() as usize % 3;
                if let Some(m) = c.mem(i) {
                    let size = match b.u8() % 5 {
                        0 => 0,
                        1 => PAGE,
                        2 => m.size() / 2,
                        3 => 2 * m.size(),
                        _ => (b.u16() as usize) << 4,
                    };
                    m.truncate(size);
                }
            }
            26 => std::thread::sleep(Duration::from_micros(4 * (b.u8() as u64))),
            27 => {
                // Sync: GET_FEATURES answered means every earlier message was handled.
                let _ = c.ask_u64(GET_FEATURES);
            }
            28 => {
                // The frontend reconnects (the journals stay: the new session recovers).
                c.stop_flipper();
                c.sock = None;
                c.connect();
                c.rings = Default::default();
            }
            29 => {
                // Live restart through the keeper's state (an upgrade or crash-restart).
                match restart(server, &ctx, &store) {
                    Some(s) => server = s,
                    None => {
                        c.stop_flipper();
                        drop(c);
                        spool_journal::remove_volume_journals(&env.journals, VOLUME);
                        return;
                    }
                }
            }
            30 => server.device_reset(),
            _ => {
                // Resize the volume (grow or shrink); running workers pick it up.
                let segs = 1 + (b.u8() % 3) as u64;
                server.context().update_layout(layout(read_only, encrypted, segs));
            }
        }
    }

    // Let the worker catch up a little, then tear everything down.
    let _ = c.ask_u64(GET_FEATURES);
    std::thread::sleep(Duration::from_micros(200));
    c.stop_flipper();
    c.sock = None;
    drop(server);
    drop(c);
    drop(store);
    drop(ctx);
    spool_journal::remove_volume_journals(&env.journals, VOLUME);
    check_fds(&before, &open_fds());
});
