//! A hand-built vhost-user frontend for hostile tests: raw messages over the real socket
//! (descriptors passed with SCM_RIGHTS), guest memory in a memfd of our own, and a split
//! virtqueue we lay out and fill ourselves. It does only what a test tells it, so it can send
//! what QEMU or libblkio never would (no SET_VRING_NUM, regions past the end of their file,
//! a head re-posted while in flight, ...). Simulates nothing: spoold sees a real frontend.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

pub const GET_FEATURES: u32 = 1;
pub const SET_FEATURES: u32 = 2;
pub const SET_OWNER: u32 = 3;
pub const SET_MEM_TABLE: u32 = 5;
pub const SET_VRING_NUM: u32 = 8;
pub const SET_VRING_ADDR: u32 = 9;
pub const SET_VRING_BASE: u32 = 10;
pub const GET_VRING_BASE: u32 = 11;
pub const SET_VRING_KICK: u32 = 12;
pub const SET_VRING_CALL: u32 = 13;
pub const SET_VRING_ERR: u32 = 14;
pub const SET_VRING_ENABLE: u32 = 18;
pub const GET_MAX_MEM_SLOTS: u32 = 36;
pub const ADD_MEM_REG: u32 = 37;
pub const REM_MEM_REG: u32 = 38;
pub const GET_PROTOCOL_FEATURES: u32 = 15;
pub const SET_PROTOCOL_FEATURES: u32 = 16;

/// virtio-blk request types.
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;

/// Frontend virtual address our guest memory is said to live at (any value works: spoold
/// translates ring addresses through the table we send).
pub const VVA: u64 = 0x7f00_0000_0000;

/// Guest memory: a memfd mapped here, shared with spoold.
pub struct GuestMem {
    pub fd: OwnedFd,
    pub ptr: *mut u8,
    pub size: usize,
}

impl GuestMem {
    pub fn new(size: usize) -> GuestMem {
        // SAFETY: memfd_create with a static name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"spool-test-guest".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) }, 0);
        // SAFETY: maps `size` bytes of a file that long, shared (spoold maps the same pages).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        GuestMem {
            fd,
            ptr: ptr.cast(),
            size,
        }
    }

    fn at<T>(&self, gpa: u64) -> *mut T {
        assert!(gpa as usize + std::mem::size_of::<T>() <= self.size);
        // SAFETY: inside the mapping (checked above).
        unsafe { self.ptr.add(gpa as usize).cast() }
    }

    pub fn write<T: Copy>(&self, gpa: u64, v: T) {
        // SAFETY: inside our mapping; the other side reads it concurrently, as a guest's.
        unsafe { std::ptr::write_volatile(self.at::<T>(gpa), v) }
    }

    pub fn read<T: Copy>(&self, gpa: u64) -> T {
        // SAFETY: inside our mapping.
        unsafe { std::ptr::read_volatile(self.at::<T>(gpa)) }
    }

    pub fn fill(&self, gpa: u64, bytes: &[u8]) {
        for (i, b) in bytes.iter().enumerate() {
            self.write(gpa + i as u64, *b);
        }
    }

    pub fn bytes(&self, gpa: u64, len: usize) -> Vec<u8> {
        (0..len).map(|i| self.read::<u8>(gpa + i as u64)).collect()
    }
}

impl Drop for GuestMem {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.size) };
    }
}

/// A raw vhost-user connection.
pub struct RawFrontend {
    pub sock: UnixStream,
}

impl RawFrontend {
    pub fn connect(path: &Path) -> RawFrontend {
        let sock = UnixStream::connect(path).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        RawFrontend { sock }
    }

    /// Sends one message (version 1, no flags) with `fds` attached. Errors when the
    /// connection is closed.
    pub fn send(&mut self, code: u32, payload: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        self.send_flags(code, 1, payload, fds)
    }

    /// Reads one reply and returns its body.
    pub fn reply(&mut self) -> std::io::Result<Vec<u8>> {
        let mut hdr = [0u8; 12];
        self.sock.read_exact(&mut hdr)?;
        let len = u32::from_le_bytes(hdr[8..12].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        self.sock.read_exact(&mut body)?;
        Ok(body)
    }

    /// A message that has a reply (GET_*): the reply's u64.
    pub fn ask(&mut self, code: u32, payload: &[u8]) -> std::io::Result<u64> {
        self.send(code, payload, &[])?;
        let b = self.reply()?;
        Ok(u64::from_le_bytes(b[..8].try_into().unwrap()))
    }

    /// A message sent with NEED_REPLY (REPLY_ACK negotiated): the ack (0 = success).
    pub fn ask_ack(&mut self, code: u32, payload: &[u8], fds: &[RawFd]) -> std::io::Result<u64> {
        self.send_flags(code, 1 | 0x8, payload, fds)?;
        let b = self.reply()?;
        Ok(u64::from_le_bytes(b[..8].try_into().unwrap()))
    }

    fn send_flags(
        &mut self,
        code: u32,
        flags: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> std::io::Result<()> {
        let mut m = Vec::with_capacity(12 + payload.len());
        m.extend_from_slice(&code.to_le_bytes());
        m.extend_from_slice(&flags.to_le_bytes());
        m.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        m.extend_from_slice(payload);
        if fds.is_empty() {
            return self.sock.write_all(&m);
        }
        let cmsg_space =
            // SAFETY: CMSG_SPACE is a pure size computation.
            unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
        let mut cbuf = vec![0u64; cmsg_space.div_ceil(8)];
        let mut iov = libc::iovec {
            iov_base: m.as_mut_ptr().cast(),
            iov_len: m.len(),
        };
        // SAFETY: a zeroed msghdr is valid; we point it at our iovec and control buffer.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = cmsg_space;
        // SAFETY: the control buffer holds one cmsg of CMSG_SPACE(fds) bytes (sized above);
        // CMSG_FIRSTHDR/CMSG_DATA point inside it.
        let n = unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(c).cast::<RawFd>(),
                fds.len(),
            );
            libc::sendmsg(self.sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        assert_eq!(n as usize, m.len());
        Ok(())
    }

    /// Sends a GET_FEATURES and waits for its reply: a sync point (every earlier message has
    /// been handled). Err when spoold closed the connection instead.
    pub fn sync(&mut self) -> std::io::Result<u64> {
        self.ask(GET_FEATURES, &[])
    }

    /// Whether spoold closes the connection within 5 s (asked with GET_FEATURES every 50 ms:
    /// a close may follow a worker's finding, after the messages sent so far were answered).
    pub fn closed(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.sync().is_err() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    pub fn set_mem_table(&mut self, regions: &[(u64, u64, u64, u64)], fds: &[RawFd]) {
        let mut p = Vec::new();
        p.extend_from_slice(&(regions.len() as u32).to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        for &(gpa, size, vva, off) in regions {
            for v in [gpa, size, vva, off] {
                p.extend_from_slice(&v.to_le_bytes());
            }
        }
        let _ = self.send(SET_MEM_TABLE, &p, fds);
    }

    pub fn vring_u32(&mut self, code: u32, index: u32, v: u32) {
        let mut p = index.to_le_bytes().to_vec();
        p.extend_from_slice(&v.to_le_bytes());
        let _ = self.send(code, &p, &[]);
    }

    pub fn set_vring_addr(&mut self, index: u32, desc: u64, used: u64, avail: u64) {
        let mut p = index.to_le_bytes().to_vec();
        p.extend_from_slice(&0u32.to_le_bytes());
        for v in [desc, used, avail, 0u64] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        let _ = self.send(SET_VRING_ADDR, &p, &[]);
    }

    pub fn set_vring_fd(&mut self, code: u32, index: u8, fd: RawFd) {
        let _ = self.send(code, &(index as u64).to_le_bytes(), &[fd]);
    }
}

/// A split virtqueue in [`GuestMem`], driven like a guest driver does.
pub struct Ring {
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub kick: OwnedFd,
    pub call: OwnedFd,
    avail_idx: u16,
    used_seen: u16,
}

/// Guest addresses of a request's header, data and status byte.
pub const HDR: u64 = 0x8000;
pub const DATA: u64 = 0x10000;

impl Ring {
    /// Rings at fixed guest addresses (desc 0, avail 0x4000, used 0x6000).
    pub fn new(size: u16) -> Ring {
        let efd = || {
            // SAFETY: eventfd with no memory involved; checked.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
            assert!(fd >= 0);
            // SAFETY: a fresh descriptor we own.
            unsafe { OwnedFd::from_raw_fd(fd) }
        };
        Ring {
            size,
            desc: 0,
            avail: 0x4000,
            used: 0x6000,
            kick: efd(),
            call: efd(),
            avail_idx: 0,
            used_seen: 0,
        }
    }

    /// The usual session: features (no protocol features: rings start enabled), one memory
    /// region covering `mem` at gpa 0, then ring 0's size, addresses, base, call and kick.
    pub fn setup(&self, fe: &mut RawFrontend, mem: &GuestMem, send_num: bool) {
        let offered = fe.sync().unwrap();
        let version_1 = 1u64 << 32;
        let _ = fe.send(SET_OWNER, &[], &[]);
        let _ = fe.send(SET_FEATURES, &(offered & version_1).to_le_bytes(), &[]);
        fe.set_mem_table(&[(0, mem.size as u64, VVA, 0)], &[mem.fd.as_raw_fd()]);
        if send_num {
            fe.vring_u32(SET_VRING_NUM, 0, self.size as u32);
        }
        fe.set_vring_addr(0, VVA + self.desc, VVA + self.used, VVA + self.avail);
        fe.vring_u32(SET_VRING_BASE, 0, 0);
        fe.set_vring_fd(SET_VRING_CALL, 0, self.call.as_raw_fd());
        fe.set_vring_fd(SET_VRING_KICK, 0, self.kick.as_raw_fd());
    }

    /// The session QEMU runs: VERSION_1, protocol features (`proto` of those offered:
    /// rings then start disabled), plus `extra` features; one memory region covering `mem`
    /// at gpa 0; ring 0's size, addresses, base `base`, call and kick, then
    /// SET_VRING_ENABLE 1. Returns the protocol features offered.
    pub fn start_enabled(
        &self,
        fe: &mut RawFrontend,
        mem: &GuestMem,
        extra: u64,
        proto: u64,
        base: u16,
    ) -> u64 {
        const VERSION_1: u64 = 1 << 32;
        const PROTOCOL_FEATURES: u64 = 1 << 30;
        let _ = fe.send(SET_OWNER, &[], &[]);
        let features = VERSION_1 | PROTOCOL_FEATURES | extra;
        let _ = fe.send(SET_FEATURES, &features.to_le_bytes(), &[]);
        let offered = fe.ask(GET_PROTOCOL_FEATURES, &[]).unwrap();
        let _ = fe.send(SET_PROTOCOL_FEATURES, &(offered & proto).to_le_bytes(), &[]);
        fe.set_mem_table(&[(0, mem.size as u64, VVA, 0)], &[mem.fd.as_raw_fd()]);
        fe.vring_u32(SET_VRING_NUM, 0, self.size as u32);
        fe.set_vring_addr(0, VVA + self.desc, VVA + self.used, VVA + self.avail);
        fe.vring_u32(SET_VRING_BASE, 0, base as u32);
        fe.set_vring_fd(SET_VRING_CALL, 0, self.call.as_raw_fd());
        fe.set_vring_fd(SET_VRING_KICK, 0, self.kick.as_raw_fd());
        fe.vring_u32(SET_VRING_ENABLE, 0, 1);
        fe.sync().unwrap();
        offered
    }

    pub fn set_desc(&self, mem: &GuestMem, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = self.desc + 16 * i as u64;
        mem.write(d, addr);
        mem.write(d + 8, len);
        mem.write(d + 12, flags);
        mem.write(d + 14, next);
    }

    /// Writes a 3-descriptor request (header, data, status) starting at descriptor `head`
    /// (uses heads head..head+3), with its buffers at `slot`'s area.
    pub fn prepare(&self, mem: &GuestMem, head: u16, slot: u64, ty: u32, sector: u64, len: u32) {
        const NEXT: u16 = 1;
        const WRITE: u16 = 2;
        let hdr = HDR + slot * 32;
        let data = DATA + slot * len as u64;
        let status = HDR + slot * 32 + 16;
        mem.write(hdr, ty);
        mem.write(hdr + 4, 0u32);
        mem.write(hdr + 8, sector);
        mem.write(status, 0xffu8);
        let dflags = if ty == T_IN { WRITE } else { 0 };
        self.set_desc(mem, head, hdr, 16, NEXT, head + 1);
        self.set_desc(mem, head + 1, data, len, NEXT | dflags, head + 2);
        self.set_desc(mem, head + 2, status, 1, WRITE, 0);
    }

    /// Offers `head` in the avail ring and kicks.
    pub fn post(&mut self, mem: &GuestMem, head: u16) {
        let at = self.avail + 4 + 2 * (self.avail_idx % self.size) as u64;
        mem.write(at, head);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        mem.write(self.avail + 2, self.avail_idx);
        self.kick();
    }

    pub fn kick(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from our buffer to our eventfd.
        unsafe { libc::write(self.kick.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// The used ring's index as the guest sees it.
    pub fn used_idx(&self, mem: &GuestMem) -> u16 {
        mem.read(self.used + 2)
    }

    /// Waits up to `timeout` for new used entries; returns their (id, len).
    pub fn wait_used(&mut self, mem: &GuestMem, n: usize, timeout: Duration) -> Vec<(u32, u32)> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        while out.len() < n && Instant::now() < deadline {
            let idx = self.used_idx(mem);
            while self.used_seen != idx {
                let e = self.used + 4 + 8 * (self.used_seen % self.size) as u64;
                out.push((mem.read::<u32>(e), mem.read::<u32>(e + 4)));
                self.used_seen = self.used_seen.wrapping_add(1);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        out
    }

    /// The status byte of `slot`'s request.
    pub fn status(&self, mem: &GuestMem, slot: u64) -> u8 {
        mem.read(HDR + slot * 32 + 16)
    }
}
