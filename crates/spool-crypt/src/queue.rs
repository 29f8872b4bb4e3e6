//! [`CryptQueue`]: a device queue over another that stores only ciphertext. A write is copied
//! from the caller's buffers into a bounce buffer of the queue's own and encrypted there; a
//! read lands in a bounce buffer, is decrypted there and copied out when it completes. The
//! caller's buffers (guest memory) never hold ciphertext and the device never sees plaintext.
//!
//! The XTS tweak is the volume's sector, not the device's: a [`TweakMap`] says which volume
//! range each device range holds, so data moved between devices (a mirror rebuild, a replace)
//! stays valid ciphertext. Discards pass through; write-zeroes cannot (zeroes on the device
//! decrypt to noise) and fail with `EOPNOTSUPP` (encrypted volumes do not offer it).
//!
//! A caller may submit several operations under one tag (a worker sends every piece of a
//! request with the request's tag, two of them to one device when the layout's segments are
//! not contiguous), as every queue allows: in-flight records are kept under ids of this
//! queue's own, handed to the device as its tags, never under the caller's tag.
//!
//! Must not know: volumes' metadata, virtio, where keys come from.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use spool_devices::{DeviceIo, DeviceQueue, IoVec, Slots};

use crate::locked::Locked;
use crate::xts::{XtsCipher, SECTOR};

/// Bounce buffers alignment: enough for O_DIRECT on any device here.
const ALIGN: usize = 4096;
/// Bounce buffers kept for reuse, and the largest kept: at most 8 MiB held per queue (a
/// queue deep in 128K requests keeps them all; larger ones are allocated per request).
const KEEP: usize = 32;
const KEEP_MAX: usize = 256 << 10;

/// Which volume bytes each device range of one device holds: (device offset, length,
/// volume offset), ascending by device offset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TweakMap {
    pieces: Vec<(u64, u64, u64)>,
}

impl TweakMap {
    /// A map from (device offset, length, volume offset) pieces.
    pub fn new(mut pieces: Vec<(u64, u64, u64)>) -> TweakMap {
        pieces.sort_unstable();
        TweakMap { pieces }
    }

    /// The volume sector of device byte `offset` when `[offset, offset + len)` lies in one
    /// piece and on sector boundaries.
    pub fn sector(&self, offset: u64, len: u64) -> Option<u64> {
        let i = self
            .pieces
            .partition_point(|p| p.0 <= offset)
            .checked_sub(1)?;
        let (dev, plen, vol) = self.pieces[i];
        let within = offset - dev;
        if within.checked_add(len).is_none_or(|end| end > plen) {
            return None;
        }
        let at = vol.checked_add(within)?;
        (at.is_multiple_of(SECTOR as u64) && len.is_multiple_of(SECTOR as u64))
            .then_some(at / SECTOR as u64)
    }
}

/// A buffer aligned to [`ALIGN`], and the one iovec that describes it to the device (boxed:
/// its address must not move while the device holds it).
struct Bounce {
    mem: Vec<u8>,
    iov: Box<IoVec>,
}

impl Bounce {
    fn with_len(len: usize) -> Bounce {
        let mut b = Bounce {
            mem: vec![0u8; len + ALIGN],
            iov: Box::new(IoVec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }),
        };
        b.set_len(len);
        b
    }

    fn fits(&self, len: usize) -> bool {
        self.mem.len() >= len + ALIGN
    }

    fn set_len(&mut self, len: usize) {
        let skip = self.mem.as_ptr().align_offset(ALIGN);
        self.iov.iov_base = self.mem[skip..].as_mut_ptr().cast();
        self.iov.iov_len = len;
    }

    fn data(&mut self) -> &mut [u8] {
        let skip = self.mem.as_ptr().align_offset(ALIGN);
        let len = self.iov.iov_len;
        &mut self.mem[skip..skip + len]
    }
}

/// An operation in flight: the caller's tag, its bounce buffer (none for an operation
/// passed through: a flush, a discard), and for a read the caller's iovecs to fill.
struct Pending {
    tag: u64,
    bounce: Option<Bounce>,
    read: Option<(*const IoVec, u32, u64)>,
}

/// A queue that encrypts what it writes and decrypts what it reads (module doc).
pub struct CryptQueue {
    inner: Box<dyn DeviceQueue>,
    cipher: Arc<Locked<XtsCipher>>,
    map: TweakMap,
    /// In flight, under ids of the queue's own (the device's tags).
    pending: Slots<Pending>,
    free: Vec<Bounce>,
    refused: VecDeque<(u64, i32)>,
}

// SAFETY: the raw iovec pointers kept for reads point into caller buffers the caller keeps
// valid until the operation is reaped (`DeviceQueue::submit`'s contract); they are only
// dereferenced by the thread that owns the queue, which moves with it as a whole.
unsafe impl Send for CryptQueue {}

impl CryptQueue {
    /// Wraps `inner`, a queue of one device whose ranges hold the volume ranges in `map`.
    pub fn new(inner: Box<dyn DeviceQueue>, cipher: Arc<Locked<XtsCipher>>, map: TweakMap) -> Self {
        CryptQueue {
            inner,
            cipher,
            map,
            pending: Slots::default(),
            free: Vec::new(),
            refused: VecDeque::new(),
        }
    }

    fn bounce(&mut self, len: usize) -> Bounce {
        match self.free.iter().position(|b| b.fits(len)) {
            Some(i) => {
                let mut b = self.free.swap_remove(i);
                b.set_len(len);
                b
            }
            None => Bounce::with_len(len),
        }
    }

    fn recycle(free: &mut Vec<Bounce>, b: Bounce) {
        if free.len() < KEEP && b.mem.len() <= KEEP_MAX + ALIGN {
            free.push(b);
        }
    }
}

/// The iovecs at `iov` as a slice.
///
/// # Safety
/// `iov` points to `n` valid iovecs (the submit contract).
unsafe fn iovecs<'a>(iov: *const IoVec, n: u32) -> &'a [IoVec] {
    if n == 0 {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(iov, n as usize) }
}

/// Encrypts the caller's buffers (exactly `dst.len()` bytes in all, whole sectors, the first
/// being number `sector`) into `dst` in one pass: sectors that lie whole in one buffer are
/// read straight from it, a sector split between buffers is gathered first. -EFAULT when one
/// of them lies in guest memory a fault covered (its bytes are the cover's, not the guest's).
///
/// # Safety
/// Every iovec describes a readable buffer valid for the call.
unsafe fn encrypt_gather(
    c: &XtsCipher,
    iov: &[IoVec],
    dst: &mut [u8],
    sector: u64,
) -> Result<(), i32> {
    let (mut at, mut carry, mut carried) = (0usize, [0u8; SECTOR], 0usize);
    for v in iov {
        let (mut p, mut left) = (v.iov_base as *const u8, v.iov_len);
        if carried > 0 {
            let k = (SECTOR - carried).min(left);
            // SAFETY: `k` bytes of the caller's buffer into our stack buffer.
            unsafe { std::ptr::copy_nonoverlapping(p, carry[carried..].as_mut_ptr(), k) };
            // SAFETY: within the caller's buffer (`k <= left`).
            p = unsafe { p.add(k) };
            (left, carried) = (left - k, carried + k);
            if carried == SECTOR {
                c.encrypt_sector_into(
                    &carry,
                    &mut dst[at..at + SECTOR],
                    sector + (at / SECTOR) as u64,
                );
                (at, carried) = (at + SECTOR, 0);
            }
        }
        let whole = left / SECTOR;
        if whole > 0 {
            let out = &mut dst[at..at + whole * SECTOR];
            // SAFETY: `whole` sectors of the caller's readable buffer into `out`, ours.
            unsafe { c.encrypt_from(p, out.as_mut_ptr(), whole, sector + (at / SECTOR) as u64) };
            // SAFETY: within the caller's buffer.
            p = unsafe { p.add(whole * SECTOR) };
            (at, left) = (at + whole * SECTOR, left - whole * SECTOR);
        }
        if left > 0 {
            // SAFETY: the rest of the caller's buffer (less than a sector) into `carry`.
            unsafe { std::ptr::copy_nonoverlapping(p, carry.as_mut_ptr(), left) };
            carried = left;
        }
    }
    zeroize::Zeroize::zeroize(&mut carry);
    faulted(iov)
}

/// Decrypts `src` (whole sectors, the first being number `sector`) into the caller's buffers
/// in one pass: sectors that fall whole in one buffer are written straight into it, a sector
/// split between buffers is decrypted on the stack and scattered. -EFAULT as
/// [`encrypt_gather`].
///
/// # Safety
/// Every iovec describes a writable buffer valid for the call, `src.len()` bytes in all.
unsafe fn decrypt_scatter(
    c: &XtsCipher,
    src: &[u8],
    iov: &[IoVec],
    sector: u64,
) -> Result<(), i32> {
    let (mut at, mut split, mut used) = (0usize, [0u8; SECTOR], SECTOR);
    for v in iov {
        let (mut p, mut left) = (v.iov_base as *mut u8, v.iov_len);
        if used < SECTOR {
            let k = (SECTOR - used).min(left);
            // SAFETY: `k` decrypted bytes of our stack buffer into the caller's buffer.
            unsafe { std::ptr::copy_nonoverlapping(split[used..].as_ptr(), p, k) };
            // SAFETY: within the caller's buffer.
            p = unsafe { p.add(k) };
            (left, used) = (left - k, used + k);
        }
        let whole = left / SECTOR;
        if whole > 0 {
            let input = &src[at..at + whole * SECTOR];
            // SAFETY: `whole` sectors of ours into the caller's writable buffer.
            unsafe { c.decrypt_to(input.as_ptr(), p, whole, sector + (at / SECTOR) as u64) };
            // SAFETY: within the caller's buffer.
            p = unsafe { p.add(whole * SECTOR) };
            (at, left) = (at + whole * SECTOR, left - whole * SECTOR);
        }
        if left > 0 {
            // A sector split between this buffer and the next: decrypted on the stack.
            let n = sector + (at / SECTOR) as u64;
            // SAFETY: one sector of ours into our stack buffer.
            unsafe { c.decrypt_to(src[at..].as_ptr(), split.as_mut_ptr(), 1, n) };
            // SAFETY: its first `left` bytes into the rest of the caller's buffer.
            unsafe { std::ptr::copy_nonoverlapping(split.as_ptr(), p, left) };
            (at, used) = (at + SECTOR, left);
        }
    }
    zeroize::Zeroize::zeroize(&mut split);
    faulted(iov)
}

/// Whether a fault (a frontend truncating guest memory) hit one of `iov`'s buffers.
fn faulted(iov: &[IoVec]) -> Result<(), i32> {
    fence(Ordering::SeqCst);
    let hit = spool_sigbus::hits() != 0
        && iov
            .iter()
            .any(|v| spool_sigbus::hit_in(v.iov_base as usize, v.iov_len));
    if hit {
        Err(-libc::EFAULT)
    } else {
        Ok(())
    }
}

impl DeviceQueue for CryptQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        let (write, offset, len, iov, iovcnt) = match io {
            DeviceIo::Read {
                offset,
                len,
                iov,
                iovcnt,
            } => (false, offset, len, iov, iovcnt),
            DeviceIo::Write {
                offset,
                len,
                iov,
                iovcnt,
            } => (true, offset, len, iov, iovcnt),
            DeviceIo::WriteZeroes { .. } => {
                return self.refused.push_back((tag, -libc::EOPNOTSUPP))
            }
            other => {
                let id = self.pending.insert(Pending {
                    tag,
                    bounce: None,
                    read: None,
                });
                // SAFETY: nothing of the caller's memory is involved.
                return unsafe { self.inner.submit(other, id) };
            }
        };
        // SAFETY: the submit contract.
        let bufs = unsafe { iovecs(iov, iovcnt) };
        let total: Option<u64> = bufs
            .iter()
            .try_fold(0u64, |t, v| t.checked_add(v.iov_len as u64));
        let (Some(sector), true) = (self.map.sector(offset, len), total == Some(len)) else {
            return self.refused.push_back((tag, -libc::EINVAL));
        };
        let Ok(n) = usize::try_from(len) else {
            return self.refused.push_back((tag, -libc::EINVAL));
        };
        let mut bounce = self.bounce(n);
        if write {
            // SAFETY: the submit contract: readable buffers, valid for this call, `len` bytes.
            if let Err(e) = unsafe { encrypt_gather(&self.cipher, bufs, bounce.data(), sector) } {
                Self::recycle(&mut self.free, bounce);
                return self.refused.push_back((tag, e));
            }
        }
        let one: *const IoVec = &*bounce.iov;
        let read = (!write).then_some((iov, iovcnt, sector));
        let id = self.pending.insert(Pending {
            tag,
            bounce: Some(bounce),
            read,
        });
        // SAFETY: the bounce buffer and its iovec stay in `pending` (heap allocations that do
        // not move with the table) until `id` is reaped; no other operation uses `id` before.
        unsafe {
            self.inner
                .submit(DeviceIo::data(write, offset, len, one, 1), id)
        };
    }

    fn kick(&mut self) -> std::io::Result<()> {
        self.inner.kick()
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        let mut n = 0;
        while let Some((tag, res)) = self.refused.pop_front() {
            done(tag, res);
            n += 1;
        }
        let CryptQueue {
            inner,
            cipher,
            pending,
            free,
            ..
        } = self;
        n + inner.reap(&mut |id, mut res| {
            let Some(p) = pending.remove(id) else {
                // Every operation handed to the device has a record: a device that reports
                // one it was never given (or twice) is not ours to complete.
                tracing::error!(id, "crypt queue: completion for an operation not in flight");
                return;
            };
            if let Some(mut b) = p.bounce {
                if let (Some((iov, iovcnt, sector)), true) = (p.read, res >= 0) {
                    // SAFETY: the caller's writable buffers, `len` bytes in all, valid until
                    // this reap returns (the submit contract).
                    let r =
                        unsafe { decrypt_scatter(cipher, b.data(), iovecs(iov, iovcnt), sector) };
                    if let Err(e) = r {
                        res = e;
                    }
                }
                CryptQueue::recycle(free, b);
            }
            done(p.tag, res)
        })
    }

    fn completion_fd(&self) -> RawFd {
        self.inner.completion_fd()
    }

    fn ack_completion_event(&self) {
        self.inner.ack_completion_event()
    }

    fn set_completion_events(&mut self, enabled: bool) {
        self.inner.set_completion_events(enabled)
    }

    fn polled(&self) -> bool {
        self.inner.polled()
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.refused.len()
    }

    fn abort(&mut self) -> usize {
        self.inner.abort()
    }

    fn abandon(&mut self) -> usize {
        self.inner.abandon()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DataKey;
    use spool_devices::{Device, OpenOptions};
    use std::os::unix::fs::FileExt;

    /// Submits `io` and waits for its result.
    fn run(q: &mut CryptQueue, io: DeviceIo) -> i32 {
        // SAFETY: the test's buffers outlive the call, which waits for the completion.
        unsafe { q.submit(io, 7) };
        q.kick().unwrap();
        let mut got = None;
        while got.is_none() {
            q.reap(&mut |tag, res| {
                assert_eq!(tag, 7);
                got = Some(res)
            });
        }
        got.unwrap()
    }

    /// A 1 MiB file device `d.img` in a new directory, and a new data key's cipher.
    fn fixture() -> (tempfile::TempDir, Device, Arc<Locked<XtsCipher>>) {
        let dir = tempfile::tempdir().unwrap();
        let opts = OpenOptions {
            create_size: Some(1 << 20),
            ..Default::default()
        };
        let dev = Device::open(&dir.path().join("d.img"), &opts).unwrap();
        let cipher = Arc::new(DataKey::generate().unwrap().cipher().unwrap());
        (dir, dev, cipher)
    }

    /// Writes land encrypted with the volume's sector as the tweak, reads come back plain, and
    /// what cannot be encrypted right is refused.
    #[test]
    fn writes_ciphertext_reads_plaintext() {
        let (dir, dev, cipher) = fixture();
        let path = dir.path().join("d.img");
        // Device bytes 64K.. hold volume bytes 1M.. (sector 2048).
        let map = TweakMap::new(vec![(65536, 65536, 1 << 20)]);
        let mut q = CryptQueue::new(dev.open_queue(8).unwrap(), cipher.clone(), map);
        let plain: Vec<u8> = (0..8192u32).map(|i| (i % 253) as u8).collect();
        // Two caller buffers, split off a sector boundary.
        let (a, b) = plain.split_at(700);
        let iov = [
            IoVec {
                iov_base: a.as_ptr() as *mut _,
                iov_len: a.len(),
            },
            IoVec {
                iov_base: b.as_ptr() as *mut _,
                iov_len: b.len(),
            },
        ];
        let w = DeviceIo::data(true, 65536 + 4096, 8192, iov.as_ptr(), 2);
        assert_eq!(run(&mut q, w), 8192);
        let mut raw = vec![0u8; 8192];
        std::fs::File::open(&path)
            .unwrap()
            .read_exact_at(&mut raw, 65536 + 4096)
            .unwrap();
        assert!(raw != plain, "plaintext reached the device");
        cipher.decrypt(&mut raw, (1 << 20) / 512 + 8);
        assert!(raw == plain, "not XTS under the volume's sector");
        let mut back = vec![0u8; 8192];
        let riov = [IoVec {
            iov_base: back.as_mut_ptr().cast(),
            iov_len: 8192,
        }];
        let r = DeviceIo::data(false, 65536 + 4096, 8192, riov.as_ptr(), 1);
        assert_eq!(run(&mut q, r), 8192);
        assert!(back == plain);
        // Buffers that split sectors every which way, both directions.
        let cuts = [1usize, 511, 512, 513, 100, 2000, 3000, 1555];
        let mut pieces: Vec<Vec<u8>> = Vec::new();
        let mut at = 0;
        for c in cuts {
            pieces.push(plain[at..at + c].iter().map(|b| b ^ 0x5a).collect());
            at += c;
        }
        assert_eq!(at, 8192);
        let wiov: Vec<IoVec> = pieces
            .iter()
            .map(|p| IoVec {
                iov_base: p.as_ptr() as *mut _,
                iov_len: p.len(),
            })
            .collect();
        let w = DeviceIo::data(true, 65536, 8192, wiov.as_ptr(), wiov.len() as u32);
        assert_eq!(run(&mut q, w), 8192);
        let want: Vec<u8> = plain.iter().map(|b| b ^ 0x5a).collect();
        let mut raw = vec![0u8; 8192];
        std::fs::File::open(&path)
            .unwrap()
            .read_exact_at(&mut raw, 65536)
            .unwrap();
        cipher.decrypt(&mut raw, (1 << 20) / 512);
        assert!(raw == want, "split buffers encrypted wrong");
        let mut outs: Vec<Vec<u8>> = cuts.iter().rev().map(|&c| vec![0u8; c]).collect();
        let riov: Vec<IoVec> = outs
            .iter_mut()
            .map(|o| IoVec {
                iov_base: o.as_mut_ptr().cast(),
                iov_len: o.len(),
            })
            .collect();
        let r = DeviceIo::data(false, 65536, 8192, riov.as_ptr(), riov.len() as u32);
        assert_eq!(run(&mut q, r), 8192);
        assert!(outs.concat() == want, "split buffers decrypted wrong");
        // Outside the map, unaligned, a length that is not the buffers', write-zeroes: refused.
        let outside = DeviceIo::data(true, 0, 4096, iov.as_ptr(), 1);
        assert_eq!(run(&mut q, outside), -libc::EINVAL);
        let unaligned = DeviceIo::data(true, 65536 + 100, 512, iov.as_ptr(), 1);
        assert_eq!(run(&mut q, unaligned), -libc::EINVAL);
        let short = DeviceIo::data(true, 65536, 4096, iov.as_ptr(), 2);
        assert_eq!(run(&mut q, short), -libc::EINVAL);
        let zeroes = DeviceIo::WriteZeroes {
            offset: 65536,
            len: 4096,
        };
        assert_eq!(run(&mut q, zeroes), -libc::EOPNOTSUPP);
        assert_eq!(q.in_flight(), 0);
    }

    /// Two pieces of one request on one device (a layout whose segments are not contiguous)
    /// come under one tag: each is encrypted and decrypted with its own buffer and sector,
    /// in both directions, with a flush under the same tag beside them.
    #[test]
    fn pieces_under_one_tag_keep_their_own_buffers() {
        let (dir, dev, cipher) = fixture();
        let path = dir.path().join("d.img");
        // Volume bytes 0..256K at device 512K, volume 256K..512K at device 0 (a split layout).
        let map = TweakMap::new(vec![(512 << 10, 256 << 10, 0), (0, 256 << 10, 256 << 10)]);
        let mut q = CryptQueue::new(dev.open_queue(8).unwrap(), cipher.clone(), map);
        let a: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
        let b: Vec<u8> = (0..65536u32).map(|i| (i % 241) as u8 ^ 0xa5).collect();
        let iov = |buf: &[u8]| IoVec {
            iov_base: buf.as_ptr() as *mut _,
            iov_len: buf.len(),
        };
        let (ia, ib) = ([iov(&a)], [iov(&b)]);
        // The tail of the first segment and the head of the second, one tag.
        let (da, db) = ((512 << 10) + (192 << 10), 0u64);
        let reap_all = |q: &mut CryptQueue, n: usize| {
            let mut got = Vec::new();
            while got.len() < n {
                q.reap(&mut |tag, res| got.push((tag, res)));
            }
            got
        };
        // SAFETY: the buffers outlive the calls, which wait for every completion.
        unsafe {
            q.submit(DeviceIo::data(true, da, 65536, ia.as_ptr(), 1), 7);
            q.submit(DeviceIo::data(true, db, 65536, ib.as_ptr(), 1), 7);
            q.submit(DeviceIo::Flush, 7);
        }
        q.kick().unwrap();
        let mut got = reap_all(&mut q, 3);
        got.sort();
        assert_eq!(got, vec![(7, 0), (7, 65536), (7, 65536)]);
        let raw = |at: u64, sector: u64| {
            let mut r = vec![0u8; 65536];
            std::fs::File::open(&path)
                .unwrap()
                .read_exact_at(&mut r, at)
                .unwrap();
            cipher.decrypt(&mut r, sector);
            r
        };
        assert!(raw(da, (192 << 10) / 512) == a, "first piece stored wrong");
        assert!(raw(db, (256 << 10) / 512) == b, "second piece stored wrong");
        let (mut ra, mut rb) = (vec![0u8; 65536], vec![0u8; 65536]);
        let oa = [IoVec {
            iov_base: ra.as_mut_ptr().cast(),
            iov_len: 65536,
        }];
        let ob = [IoVec {
            iov_base: rb.as_mut_ptr().cast(),
            iov_len: 65536,
        }];
        // SAFETY: as above.
        unsafe {
            q.submit(DeviceIo::data(false, da, 65536, oa.as_ptr(), 1), 9);
            q.submit(DeviceIo::data(false, db, 65536, ob.as_ptr(), 1), 9);
        }
        q.kick().unwrap();
        assert_eq!(reap_all(&mut q, 2), vec![(9, 65536), (9, 65536)]);
        assert!(ra == a, "first piece read back another buffer's data");
        assert!(rb == b, "second piece read back another buffer's data");
        assert_eq!(q.in_flight(), 0);
    }

    #[test]
    fn tweak_map_lookups() {
        let m = TweakMap::new(vec![(8192, 4096, 0), (0, 4096, 4096)]);
        assert_eq!(m.sector(0, 4096), Some(8));
        assert_eq!(m.sector(8192 + 512, 1024), Some(1));
        assert_eq!(m.sector(4096, 512), None, "a hole");
        assert_eq!(m.sector(2048, 4096), None, "spans a piece's end");
        assert_eq!(m.sector(0, 100), None, "not whole sectors");
        assert_eq!(m.sector(u64::MAX - 10, 4096), None);
    }
}
