//! virtio-blk request parsing: a descriptor chain becomes an owned, bounds-checked [`Request`]
//! once, before anything is executed; execution never looks at the ring again.
//!
//! Every check a hostile guest could make us skip is here: descriptor direction, every buffer
//! inside the guest's memory regions, chain length and loops (bounded by the ring and detected
//! when the last descriptor still says NEXT), request size, sector range inside the volume
//! with overflow-checked arithmetic, discard/write-zeroes segment counts, sizes and flags.
//! A rejected chain still carries its status address when one could be found, so the guest
//! gets `VIRTIO_BLK_S_IOERR`/`S_UNSUPP` instead of a hang.

use smallvec::SmallVec;
use spool_devices::IoVec;
use virtio_bindings::virtio_blk::*;
use virtio_queue::desc::split::Descriptor;
use vm_memory::GuestAddress;

use crate::hostmem::HostMap;

/// Guest memory as the frontend maps it.
pub use crate::memory::GuestMemory;

/// A request's data buffers: up to four without a heap allocation (libblkio and Linux use
/// one per page or per contiguous run).
pub type IoVecs = SmallVec<[IoVec; 4]>;

/// Bytes in a virtio-blk sector (fixed by the spec, independent of the block size).
pub const SECTOR: u64 = 512;
/// Length of the virtio-blk request header.
pub const HEADER_LEN: u64 = 16;
/// Serial length of GET_ID.
pub const ID_LEN: usize = VIRTIO_BLK_ID_BYTES as usize;

/// What a queue accepts.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Volume capacity in sectors.
    pub capacity_sectors: u64,
    pub read_only: bool,
    /// Largest data payload of one read or write, in bytes.
    pub max_data: u64,
    /// Largest number of segments in one discard/write-zeroes request.
    pub max_discard_segs: u32,
    /// Largest sector count of one discard/write-zeroes segment.
    pub max_discard_sectors: u32,
}

/// One discard or write-zeroes range, already checked against the capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub sector: u64,
    pub sectors: u32,
}

/// The operation a request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    GetId,
    Discard(Vec<Range>),
    WriteZeroes { ranges: Vec<Range>, unmap: bool },
}

/// A parsed, validated request.
#[derive(Debug)]
pub struct Request {
    /// Head descriptor index (what goes back into the used ring).
    pub head: u16,
    pub op: Op,
    /// First sector (reads and writes).
    pub sector: u64,
    /// Data buffers as host addresses inside the guest mapping the parser was given. Valid
    /// while that mapping is alive: the worker keeps it alive until the request completes.
    pub iov: IoVecs,
    /// Data length in bytes.
    pub len: u64,
    /// Where the status byte goes.
    pub status: GuestAddress,
    /// Host address of the status byte in the mapping the parser was given (valid as long as
    /// `iov`).
    pub status_host: usize,
}

/// A chain the device refuses, answered with `status` when a status byte could be located.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub head: u16,
    pub status_addr: Option<GuestAddress>,
    pub status: u8,
    pub reason: &'static str,
}

#[derive(Debug, Clone, Copy)]
struct Seg {
    addr: GuestAddress,
    len: u64,
    write: bool,
    /// Host address of `addr` when the whole segment lies in one memory region (the common
    /// case: translated once here instead of by every later access).
    host: Option<usize>,
}

/// Host iovecs covering the data segments (None if one is not in guest memory).
fn host_iovecs(data: &[Seg], mem: &HostMap) -> Option<IoVecs> {
    let mut iov = IoVecs::new();
    for s in data {
        if let Some(h) = s.host {
            iov.push(IoVec {
                iov_base: h as *mut libc::c_void,
                iov_len: s.len as usize,
            });
            continue;
        }
        let whole = mem.pieces(s.addr.0, s.len, |h, n| {
            iov.push(IoVec {
                iov_base: h as *mut libc::c_void,
                iov_len: n,
            })
        });
        if !whole {
            return None;
        }
    }
    Some(iov)
}

/// Descriptors the common-case parser looks at (header, one or two data buffers, status).
const FAST_DESCS: usize = 4;

/// Parses the chain whose descriptors are `descs` (in chain order).
///
/// The common chain (a 16-byte device-readable header, one or two data buffers of one
/// direction, a 1-byte device-writable status, a valid read or write, everything in single
/// memory regions) takes a short path; everything else, and everything that path does not
/// accept, goes through [`parse_general`], which alone produces errors. The short path returns
/// exactly what [`parse_general`] would (checked by a property test and the fuzz target).
#[inline]
pub fn parse(
    head: u16,
    mut descs: impl Iterator<Item = Descriptor>,
    mem: &HostMap,
    limits: &Limits,
) -> Result<Request, Rejected> {
    let mut first = [Descriptor::default(); FAST_DESCS + 1];
    let mut n = 0;
    while n < first.len() {
        match descs.next() {
            Some(d) => {
                first[n] = d;
                n += 1;
            }
            None => break,
        }
    }
    if n <= FAST_DESCS {
        if let Some(r) = parse_common(head, &first[..n], mem, limits) {
            return Ok(r);
        }
    }
    parse_general(head, first[..n].iter().copied().chain(descs), mem, limits)
}

/// The short path of [`parse`] for a whole chain `d`: `Some` only for a valid read or write
/// framed as header, data, status.
#[inline]
fn parse_common(head: u16, d: &[Descriptor], mem: &HostMap, limits: &Limits) -> Option<Request> {
    let (h, rest) = d.split_first()?;
    let (s, data) = rest.split_last()?;
    if data.is_empty()
        || h.is_write_only()
        || h.len() as u64 != HEADER_LEN
        || !s.is_write_only()
        || s.len() != 1
        || s.has_next()
    {
        return None;
    }
    let status_host = mem.host(s.addr().0, 1)?;
    let hh = mem.host(h.addr().0, HEADER_LEN)?;
    let mut header = [0u8; HEADER_LEN as usize];
    // SAFETY: `hh..hh+16` lies inside one region (`HostMap::host(h.addr(), HEADER_LEN)`),
    // mapped while the caller holds the map's `GuestMemory`; `h` is a copy `ChainWalker`
    // read once, and the bytes are copied once here (the guest may be rewriting them).
    unsafe { std::ptr::copy_nonoverlapping(hh as *const u8, header.as_mut_ptr(), header.len()) };
    let ty = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
    let sector = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    let (op, write) = match ty {
        VIRTIO_BLK_T_IN => (Op::Read, false),
        VIRTIO_BLK_T_OUT => (Op::Write, true),
        _ => return None,
    };
    if write && limits.read_only {
        return None;
    }
    // Filled in place, inline (a longer chain takes the general path).
    let mut bufs = [IoVec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; 4];
    if data.len() > bufs.len() {
        return None;
    }
    let mut len = 0u64;
    for (x, b) in data.iter().zip(bufs.iter_mut()) {
        if x.len() == 0 || x.is_write_only() == write {
            return None;
        }
        let host = mem.host(x.addr().0, x.len() as u64)?;
        *b = IoVec {
            iov_base: host as *mut libc::c_void,
            iov_len: x.len() as usize,
        };
        len += x.len() as u64;
    }
    let iov = IoVecs::from_buf_and_len(bufs, data.len());
    if !len.is_multiple_of(SECTOR) || len > limits.max_data {
        return None;
    }
    check_range(sector, len / SECTOR, limits.capacity_sectors).ok()?;
    Some(Request {
        head,
        op,
        sector,
        iov,
        len,
        status: s.addr(),
        status_host,
    })
}

/// Parses any chain (see [`parse`]): every check, every error.
pub fn parse_general(
    head: u16,
    descs: impl Iterator<Item = Descriptor>,
    mem: &HostMap,
    limits: &Limits,
) -> Result<Request, Rejected> {
    // Most chains have 3 descriptors (libblkio) or a few more (Linux): no heap allocation.
    let mut segs: SmallVec<[Seg; 8]> = SmallVec::new();
    let mut truncated = false;
    for d in descs {
        truncated = d.has_next();
        if d.len() == 0 {
            continue;
        }
        segs.push(Seg {
            addr: d.addr(),
            len: d.len() as u64,
            write: d.is_write_only(),
            host: mem.host(d.addr().0, d.len() as u64),
        });
    }
    let reject = |status_addr: Option<GuestAddress>, status: u32, reason: &'static str| Rejected {
        head,
        status_addr,
        status: status as u8,
        reason,
    };
    // Status byte: the last byte of the last descriptor, which must be device-writable and
    // inside guest memory.
    let (status_addr, status_host) = match segs.last() {
        Some(s) if s.write => {
            let a = s.addr.0.checked_add(s.len - 1);
            let h = match (a, s.host) {
                (Some(_), Some(h)) => Some(h + (s.len - 1) as usize),
                (Some(a), None) => mem.host(a, 1),
                (None, _) => None,
            };
            (h.and(a).map(GuestAddress), h.unwrap_or(0))
        }
        _ => (None, 0),
    };
    if truncated {
        return Err(reject(
            status_addr,
            VIRTIO_BLK_S_IOERR,
            "descriptor chain loops or is too long",
        ));
    }
    let Some(status) = status_addr else {
        return Err(reject(
            None,
            VIRTIO_BLK_S_IOERR,
            "no writable status byte at the end of the chain",
        ));
    };
    let ioerr = |reason: &'static str| reject(Some(status), VIRTIO_BLK_S_IOERR, reason);
    for s in &segs {
        if s.host.is_none() && !mem.contains(s.addr.0, s.len) {
            return Err(ioerr("buffer outside guest memory"));
        }
    }
    if let Some(last) = segs.last_mut() {
        last.len -= 1;
        if last.len == 0 {
            segs.pop();
        }
    }
    // Header: the first 16 bytes, device-readable, possibly split across descriptors.
    let mut header = [0u8; HEADER_LEN as usize];
    let mut got = 0usize;
    let mut i = 0;
    while got < header.len() {
        let Some(s) = segs.get_mut(i) else {
            return Err(ioerr("request header too short"));
        };
        if s.write {
            return Err(ioerr("request header is device-writable"));
        }
        let n = (header.len() - got).min(s.len as usize);
        if let Some(h) = s.host {
            // SAFETY: `s.host` was `HostMap::host(addr, len)` of the whole segment and moves
            // in step with `s.len`, so `h..h+n` (n <= s.len) lies in one region, mapped while
            // the caller holds the map; copied once as bytes (the guest may rewrite them).
            unsafe { std::ptr::copy_nonoverlapping(h as *const u8, header[got..].as_mut_ptr(), n) };
        } else if !mem.read(s.addr.0, &mut header[got..got + n]) {
            return Err(ioerr("request header unreadable"));
        }
        got += n;
        s.addr = GuestAddress(s.addr.0 + n as u64);
        s.host = s.host.map(|h| h + n);
        s.len -= n as u64;
        if s.len == 0 {
            i += 1;
        }
    }
    // No empty segment remains: empty descriptors were skipped, an emptied status descriptor
    // popped and an emptied header descriptor stepped over.
    let data = &segs[i..];
    let ty = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
    let sector = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    let len: u64 = data.iter().map(|s| s.len).sum();
    let all = |write: bool| data.iter().all(|s| s.write == write);

    let op = match ty {
        VIRTIO_BLK_T_IN => Op::Read,
        VIRTIO_BLK_T_OUT => Op::Write,
        VIRTIO_BLK_T_FLUSH => Op::Flush,
        VIRTIO_BLK_T_GET_ID => Op::GetId,
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => Op::Discard(vec![]),
        _ => {
            return Err(reject(
                Some(status),
                VIRTIO_BLK_S_UNSUPP,
                "unsupported request type",
            ))
        }
    };
    let mut iov = IoVecs::new();
    let op = match op {
        Op::Read | Op::Write => {
            let write = op == Op::Write;
            if !all(!write) {
                return Err(ioerr("data buffer has the wrong direction"));
            }
            if write && limits.read_only {
                return Err(ioerr("write to a read-only volume"));
            }
            if !len.is_multiple_of(SECTOR) {
                return Err(ioerr("data length is not a multiple of 512"));
            }
            if len > limits.max_data {
                return Err(ioerr("request larger than the device accepts"));
            }
            check_range(sector, len / SECTOR, limits.capacity_sectors).map_err(ioerr)?;
            iov = host_iovecs(data, mem).ok_or_else(|| ioerr("buffer outside guest memory"))?;
            op
        }
        Op::Flush => Op::Flush,
        Op::GetId => {
            if !all(true) || len == 0 {
                return Err(ioerr("GET_ID needs a writable buffer"));
            }
            iov = host_iovecs(data, mem).ok_or_else(|| ioerr("buffer outside guest memory"))?;
            Op::GetId
        }
        _ => {
            let zeroes = ty == VIRTIO_BLK_T_WRITE_ZEROES;
            if !all(false) {
                return Err(ioerr("range buffer has the wrong direction"));
            }
            if limits.read_only {
                return Err(ioerr("discard/write-zeroes on a read-only volume"));
            }
            if len == 0 || !len.is_multiple_of(16) {
                return Err(ioerr("range list is not a multiple of 16 bytes"));
            }
            if len / 16 > limits.max_discard_segs as u64 {
                return Err(ioerr("too many discard/write-zeroes segments"));
            }
            let mut raw = Vec::with_capacity(len as usize);
            for s in data {
                let at = raw.len();
                raw.resize(at + s.len as usize, 0);
                if !mem.read(s.addr.0, &mut raw[at..]) {
                    return Err(ioerr("range list unreadable"));
                }
            }
            let mut ranges = Vec::new();
            let mut unmap = false;
            for c in raw.chunks_exact(16) {
                let sector = u64::from_le_bytes(c[0..8].try_into().expect("8 bytes"));
                let sectors = u32::from_le_bytes(c[8..12].try_into().expect("4 bytes"));
                let flags = u32::from_le_bytes(c[12..16].try_into().expect("4 bytes"));
                let allowed = if zeroes {
                    VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
                } else {
                    0
                };
                if flags & !allowed != 0 {
                    return Err(reject(
                        Some(status),
                        VIRTIO_BLK_S_UNSUPP,
                        "unsupported discard/write-zeroes flags",
                    ));
                }
                unmap |= flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
                if sectors > limits.max_discard_sectors {
                    return Err(ioerr("discard/write-zeroes segment too large"));
                }
                check_range(sector, sectors as u64, limits.capacity_sectors).map_err(ioerr)?;
                ranges.push(Range { sector, sectors });
            }
            if zeroes {
                Op::WriteZeroes { ranges, unmap }
            } else {
                Op::Discard(ranges)
            }
        }
    };
    Ok(Request {
        head,
        op,
        sector,
        iov,
        len,
        status,
        status_host,
    })
}

fn check_range(sector: u64, sectors: u64, capacity: u64) -> Result<(), &'static str> {
    match sector.checked_add(sectors) {
        Some(end) if end <= capacity => Ok(()),
        _ => Err("sector range beyond the end of the volume"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::{Queue, QueueOwnedT};
    use vm_memory::Bytes;

    const W: u16 = VRING_DESC_F_WRITE as u16;

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    fn limits() -> Limits {
        Limits {
            capacity_sectors: 2048,
            read_only: false,
            max_data: 1 << 20,
            max_discard_segs: 4,
            max_discard_sectors: 1024,
        }
    }

    fn header(mem: &GuestMemory, at: u64, ty: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&ty.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, GuestAddress(at)).unwrap();
    }

    fn run(
        mem: &GuestMemory,
        descs: &[RawDescriptor],
        limits: &Limits,
    ) -> Result<Request, Rejected> {
        let q = MockSplitQueue::new(mem.map(), 16);
        let n = descs.len();
        let chained: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let x = Descriptor::from(*r);
                let (flags, next) = if i + 1 < n {
                    (x.flags() | VRING_DESC_F_NEXT as u16, i as u16 + 1)
                } else {
                    (x.flags(), 0)
                };
                RawDescriptor::from(Descriptor::new(x.addr().0, x.len(), flags, next))
            })
            .collect();
        q.add_desc_chains(&chained, 0).unwrap();
        let mut queue: Queue = q.create_queue().unwrap();
        let chain = queue.iter(mem.map()).unwrap().next().unwrap();
        let head = chain.head_index();
        parse(head, chain, &HostMap::new(mem), limits)
    }

    /// `descs` linked in order, as a walker yields them.
    fn chain_of(descs: &[RawDescriptor]) -> Vec<Descriptor> {
        let n = descs.len();
        descs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let x = Descriptor::from(*r);
                let flags = if i + 1 < n {
                    x.flags() | VRING_DESC_F_NEXT as u16
                } else {
                    x.flags()
                };
                Descriptor::new(x.addr().0, x.len(), flags, i as u16 + 1)
            })
            .collect()
    }

    fn d(addr: u64, len: u32, flags: u16) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, len, flags, 0))
    }

    #[test]
    fn read_with_libblkio_framing() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 8);
        let r = run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 4096, W), d(0x3000, 1, W)],
            &limits(),
        )
        .unwrap();
        assert_eq!(r.op, Op::Read);
        assert_eq!((r.sector, r.len, r.status), (8, 4096, GuestAddress(0x3000)));
        assert_eq!(r.iov.len(), 1);
    }

    #[test]
    fn header_and_status_may_share_descriptors_with_data() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_OUT, 0);
        // header + data in one readable descriptor, status at the end of a writable one
        let r = run(&m, &[d(0x1000, 16 + 512, 0), d(0x3000, 1, W)], &limits()).unwrap();
        assert_eq!((r.op, r.len), (Op::Write, 512));
        let r = run(
            &m,
            &[d(0x1000, 8, 0), d(0x1008, 8, 0), d(0x4000, 512 + 1, W)],
            &limits(),
        );
        assert_eq!(r.unwrap_err().reason, "data buffer has the wrong direction");
    }

    #[test]
    fn hostile_chains_are_rejected_with_a_status() {
        let m = mem();
        let l = limits();
        let cases: Vec<(Vec<RawDescriptor>, u32, &str)> = vec![
            (
                vec![d(0x1000, 16, 0), d(0x2000, 512, 0), d(0x3000, 1, W)],
                VIRTIO_BLK_T_IN,
                "wrong direction",
            ),
            (
                vec![d(0x1000, 16, 0), d(0x2000, 100, W), d(0x3000, 1, W)],
                VIRTIO_BLK_T_IN,
                "multiple of 512",
            ),
            (
                vec![d(0x1000, 16, 0), d(0xff000, 0x2000, W), d(0x3000, 1, W)],
                VIRTIO_BLK_T_IN,
                "outside guest memory",
            ),
            (
                vec![d(0x1000, 16, 0), d(u64::MAX - 10, 512, W), d(0x3000, 1, W)],
                VIRTIO_BLK_T_IN,
                "outside guest memory",
            ),
            (
                vec![d(0x1000, 8, 0), d(0x3000, 1, W)],
                VIRTIO_BLK_T_IN,
                "header too short",
            ),
            (
                vec![d(0x1000, 16, W), d(0x3000, 1, W)],
                VIRTIO_BLK_T_IN,
                "header is device-writable",
            ),
            (
                vec![d(0x1000, 16, 0), d(0x3000, 1, W)],
                99,
                "unsupported request type",
            ),
        ];
        for (descs, ty, why) in cases {
            header(&m, 0x1000, ty, 0);
            let e = run(&m, &descs, &l).unwrap_err();
            assert!(e.reason.contains(why), "{why}: got {e:?}");
            assert_eq!(e.status_addr, Some(GuestAddress(0x3000)), "{why}");
        }
        // No writable status byte at all: nothing can be written, but no panic either.
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let e = run(&m, &[d(0x1000, 16, 0), d(0x2000, 512, 0)], &l).unwrap_err();
        assert_eq!(e.status_addr, None);
        // Status outside memory.
        let e = run(&m, &[d(0x1000, 16, 0), d(0x20_0000, 1, W)], &l).unwrap_err();
        assert_eq!(e.status_addr, None);
    }

    #[test]
    fn sector_ranges_are_overflow_checked() {
        let m = mem();
        for (sector, ok) in [
            (2040u64, true),
            (2041, false),
            (u64::MAX - 2, false),
            (u64::MAX / 512 + 1, false),
        ] {
            header(&m, 0x1000, VIRTIO_BLK_T_IN, sector);
            let r = run(
                &m,
                &[d(0x1000, 16, 0), d(0x2000, 4096, W), d(0x3000, 1, W)],
                &limits(),
            );
            assert_eq!(r.is_ok(), ok, "sector {sector}: {r:?}");
        }
        let mut l = limits();
        l.max_data = 2048;
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let e = run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 4096, W), d(0x3000, 1, W)],
            &l,
        )
        .unwrap_err();
        assert!(e.reason.contains("larger"));
    }

    #[test]
    fn read_only_refuses_writes_discards_and_zeroes() {
        let m = mem();
        let mut l = limits();
        l.read_only = true;
        for ty in [
            VIRTIO_BLK_T_OUT,
            VIRTIO_BLK_T_DISCARD,
            VIRTIO_BLK_T_WRITE_ZEROES,
        ] {
            header(&m, 0x1000, ty, 0);
            let e = run(
                &m,
                &[d(0x1000, 16, 0), d(0x2000, 512, 0), d(0x3000, 1, W)],
                &l,
            )
            .unwrap_err();
            assert_eq!(e.status, VIRTIO_BLK_S_IOERR as u8);
        }
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        assert!(run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 512, W), d(0x3000, 1, W)],
            &l
        )
        .is_ok());
    }

    #[test]
    fn discard_and_write_zeroes_segments() {
        let m = mem();
        let seg = |sector: u64, n: u32, flags: u32| {
            let mut b = [0u8; 16];
            b[0..8].copy_from_slice(&sector.to_le_bytes());
            b[8..12].copy_from_slice(&n.to_le_bytes());
            b[12..16].copy_from_slice(&flags.to_le_bytes());
            b
        };
        m.write_slice(&seg(8, 16, 0), GuestAddress(0x2000)).unwrap();
        m.write_slice(&seg(100, 8, 0), GuestAddress(0x2010))
            .unwrap();
        header(&m, 0x1000, VIRTIO_BLK_T_DISCARD, 0);
        let r = run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 32, 0), d(0x3000, 1, W)],
            &limits(),
        )
        .unwrap();
        assert_eq!(
            r.op,
            Op::Discard(vec![
                Range {
                    sector: 8,
                    sectors: 16
                },
                Range {
                    sector: 100,
                    sectors: 8
                }
            ])
        );
        m.write_slice(
            &seg(0, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP),
            GuestAddress(0x2000),
        )
        .unwrap();
        let r = run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 32, 0), d(0x3000, 1, W)],
            &limits(),
        )
        .unwrap_err();
        assert_eq!(
            r.status, VIRTIO_BLK_S_UNSUPP as u8,
            "unmap flag is not valid on discard"
        );
        header(&m, 0x1000, VIRTIO_BLK_T_WRITE_ZEROES, 0);
        let r = run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 16, 0), d(0x3000, 1, W)],
            &limits(),
        )
        .unwrap();
        assert!(matches!(r.op, Op::WriteZeroes { unmap: true, .. }));
        m.write_slice(&seg(2047, 2, 0), GuestAddress(0x2000))
            .unwrap();
        assert!(run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 16, 0), d(0x3000, 1, W)],
            &limits()
        )
        .is_err());
        m.write_slice(&seg(0, 2000, 0), GuestAddress(0x2000))
            .unwrap();
        assert!(run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 16, 0), d(0x3000, 1, W)],
            &limits()
        )
        .is_err());
        assert!(run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 80, 0), d(0x3000, 1, W)],
            &limits()
        )
        .is_err());
        assert!(run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 15, 0), d(0x3000, 1, W)],
            &limits()
        )
        .is_err());
    }

    #[test]
    fn looping_chain_is_bounded_and_rejected() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let q = MockSplitQueue::new(m.map(), 4);
        // 0 -> 1 -> 0 -> ... never ends.
        let descs = [
            RawDescriptor::from(Descriptor::new(0x1000, 16, VRING_DESC_F_NEXT as u16, 1)),
            RawDescriptor::from(Descriptor::new(
                0x3000,
                1,
                (VRING_DESC_F_NEXT | VRING_DESC_F_WRITE) as u16,
                0,
            )),
        ];
        for (i, desc) in descs.iter().enumerate() {
            q.desc_table().store(i as u16, *desc).unwrap();
        }
        q.avail().ring().ref_at(0).unwrap().store(0u16.to_le());
        q.avail().idx().store(1u16.to_le());
        let mut queue: Queue = q.create_queue().unwrap();
        let chain = queue.iter(m.map()).unwrap().next().unwrap();
        let e = parse(chain.head_index(), chain, &HostMap::new(&m), &limits()).unwrap_err();
        assert!(e.reason.contains("loops"), "{e:?}");
    }

    /// Chains shaped like the common case, with every field varied around the limits: the
    /// short path must agree with the general one on every input (and does accept some).
    #[test]
    fn short_path_agrees_with_the_general_parser() {
        use proptest::prelude::*;
        let m = mem();
        let accepted = std::cell::Cell::new(0u32);
        // Valid values repeated so that valid chains are common; the odd ones probe each check.
        let lens = prop::sample::select(vec![
            0u32, 1, 511, 512, 512, 4096, 4096, 4096, 8192, 8192, 0x10_0000, 0x10_0200,
        ]);
        let addrs = prop::sample::select(vec![
            0x2000u64, 0x2000, 0x3000, 0x8000, 0x8000, 0xf_f000, 0xf_ff00, 0xf_ffff, 0x10_0000,
        ]);
        proptest!(ProptestConfig::with_cases(4000), |(hdr_len in prop::sample::select(vec![15u32, 16, 16, 16, 17]),
                    hdr_w in prop::sample::select(vec![false, false, false, true]),
                    data in prop::collection::vec((addrs.clone(), lens.clone(), any::<bool>()), 0..4),
                    st_len in prop::sample::select(vec![1u32, 1, 1, 2]), st_w in prop::sample::select(vec![true, true, true, false]),
                    st_addr in addrs.clone(),
                    ty in prop::sample::select(vec![VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_FLUSH, 99]),
                    sector in prop::sample::select(vec![0u64, 0, 8, 8, 2040, 2047, 2048, u64::MAX - 3]),
                    read_only in any::<bool>())| {
            header(&m, 0x1000, ty, sector);
            let mut raw = vec![d(0x1000, hdr_len, if hdr_w { W } else { 0 })];
            raw.extend(data.iter().map(|&(a, l, w)| d(a, l, if w { W } else { 0 })));
            raw.push(d(st_addr, st_len, if st_w { W } else { 0 }));
            let chained = chain_of(&raw);
            let host = HostMap::new(&m);
            let mut l = limits();
            l.read_only = read_only;
            let fast = parse(0, chained.iter().copied(), &host, &l);
            let general = parse_general(0, chained.iter().copied(), &host, &l);
            prop_assert_eq!(format!("{fast:?}"), format!("{general:?}"));
            if fast.is_ok() {
                accepted.set(accepted.get() + 1);
            }
        });
        assert!(
            accepted.get() > 0,
            "no generated chain was valid: the test checks nothing"
        );
    }

    #[test]
    fn parser_never_panics_on_random_chains() {
        use proptest::prelude::*;
        let m = mem();
        proptest!(|(descs in prop::collection::vec((0u64..0x12_0000, 0u32..0x3000, any::<bool>()), 1..8),
                    ty in 0u32..16, sector in any::<u64>())| {
            header(&m, 0x1000, ty, sector);
            let raw: Vec<_> = descs.iter().map(|&(a, l, w)| d(a, l, if w { W } else { 0 })).collect();
            let chained = chain_of(&raw);
            let host = HostMap::new(&m);
            let fast = parse(0, chained.iter().copied(), &host, &limits());
            let general = parse_general(0, chained.iter().copied(), &host, &limits());
            prop_assert_eq!(format!("{fast:?}"), format!("{general:?}"), "short and general paths differ");
            if let Ok(r) = run(&m, &raw, &limits()) {
                // Anything accepted stays inside memory and the volume.
                prop_assert!(r.len <= limits().max_data);
                if matches!(r.op, Op::Read | Op::Write) {
                    prop_assert!(r.sector + r.len / 512 <= 2048);
                }
            }
        });
    }
}
