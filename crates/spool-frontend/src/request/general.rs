//! The general request parser: any chain framing, every check, every error.
//!
//! Owns: walking a chain whose header, data and status may share or split descriptors,
//! reading discard / write-zeroes range lists. Must not know: the ring, the journal, devices.

use smallvec::SmallVec;
use virtio_bindings::virtio_blk::*;
use virtio_queue::desc::split::Descriptor;
use vm_memory::GuestAddress;

use super::{
    check_range, host_iovecs, Failure, Header, IoVecs, Limits, Op, Range, Rejected, Request, Seg,
    HEADER_LEN, SECTOR,
};
use crate::hostmem::HostMap;

/// Parses any chain (see [`parse`]): every check, every error.
pub fn parse_general(
    head: u16,
    descs: impl Iterator<Item = Descriptor>,
    mem: &HostMap,
    limits: &Limits,
) -> Result<Request, Rejected> {
    let mut chain = Chain::collect(descs, mem);
    let (status_addr, status_host) = chain.status_byte(mem);
    let reject = |status_addr, failure| Rejected {
        head,
        status_addr,
        failure,
    };
    if chain.truncated {
        return Err(reject(status_addr, Failure::ChainTooLong));
    }
    let Some(status) = status_addr else {
        return Err(reject(None, Failure::NoStatusByte));
    };
    let fail = |f| reject(Some(status), f);
    chain.check_in_memory(mem).map_err(fail)?;
    chain.drop_status_byte();
    let header = chain.take_header(mem).map_err(fail)?;
    let data = chain.data();
    let len: u64 = data.iter().map(|s| s.len).sum();
    let (op, iov) = match header.ty {
        VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
            read_write(header, data, len, mem, limits).map_err(fail)?
        }
        VIRTIO_BLK_T_FLUSH => (Op::Flush, IoVecs::new()),
        VIRTIO_BLK_T_GET_ID => (Op::GetId, get_id(data, len, mem).map_err(fail)?),
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            let zeroes = header.ty == VIRTIO_BLK_T_WRITE_ZEROES;
            (
                ranges(zeroes, data, len, mem, limits).map_err(fail)?,
                IoVecs::new(),
            )
        }
        _ => return Err(fail(Failure::UnsupportedType)),
    };
    Ok(Request {
        head,
        op,
        sector: header.sector,
        iov,
        len,
        status,
        status_host,
    })
}

/// A chain's non-empty buffers in order, consumed from the front as the header is read.
struct Chain {
    // Most chains have 3 descriptors (libblkio) or a few more (Linux): no heap allocation.
    segs: SmallVec<[Seg; 8]>,
    /// Index of the first segment not consumed by the header.
    next: usize,
    /// The last descriptor still said NEXT: the chain loops or is longer than the ring.
    truncated: bool,
}

impl Chain {
    fn collect(descs: impl Iterator<Item = Descriptor>, mem: &HostMap) -> Chain {
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
        Chain {
            segs,
            next: 0,
            truncated,
        }
    }

    /// The status byte: the last byte of the last buffer, which must be device-writable and
    /// inside guest memory. Returns its guest and host address.
    fn status_byte(&self, mem: &HostMap) -> (Option<GuestAddress>, usize) {
        match self.segs.last() {
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
        }
    }

    fn check_in_memory(&self, mem: &HostMap) -> Result<(), Failure> {
        match self
            .segs
            .iter()
            .any(|s| s.host.is_none() && !mem.contains(s.addr.0, s.len))
        {
            true => Err(Failure::OutsideMemory),
            false => Ok(()),
        }
    }

    fn drop_status_byte(&mut self) {
        if let Some(last) = self.segs.last_mut() {
            last.len -= 1;
            if last.len == 0 {
                self.segs.pop();
            }
        }
    }

    /// Reads the header: the first 16 bytes, device-readable, possibly split across
    /// buffers, and steps past them.
    fn take_header(&mut self, mem: &HostMap) -> Result<Header, Failure> {
        let mut header = [0u8; HEADER_LEN as usize];
        let mut got = 0usize;
        while got < header.len() {
            let s = self
                .segs
                .get_mut(self.next)
                .ok_or(Failure::HeaderTooShort)?;
            if s.write {
                return Err(Failure::HeaderWritable);
            }
            let n = (header.len() - got).min(s.len as usize);
            if let Some(h) = s.host {
                // SAFETY: `s.host` was `HostMap::host(addr, len)` of the whole segment and
                // moves in step with `s.len`, so `h..h+n` (n <= s.len) lies in one region,
                // mapped while the caller holds the map; copied once as bytes (the guest
                // may rewrite them).
                unsafe {
                    std::ptr::copy_nonoverlapping(h as *const u8, header[got..].as_mut_ptr(), n)
                };
            } else if !mem.read(s.addr.0, &mut header[got..got + n]) {
                return Err(Failure::HeaderUnreadable);
            }
            got += n;
            s.addr = GuestAddress(s.addr.0 + n as u64);
            s.host = s.host.map(|h| h + n);
            s.len -= n as u64;
            if s.len == 0 {
                self.next += 1;
            }
        }
        Ok(Header::from_bytes(&header))
    }

    /// The data buffers after the header. None is empty: empty descriptors were skipped, an
    /// emptied status descriptor popped and an emptied header descriptor stepped over.
    fn data(&self) -> &[Seg] {
        &self.segs[self.next..]
    }
}

fn all_write(data: &[Seg], write: bool) -> bool {
    data.iter().all(|s| s.write == write)
}

/// A read or a write: buffers of one direction, whole sectors, within the limits.
fn read_write(
    header: Header,
    data: &[Seg],
    len: u64,
    mem: &HostMap,
    limits: &Limits,
) -> Result<(Op, IoVecs), Failure> {
    let write = header.ty == VIRTIO_BLK_T_OUT;
    if !all_write(data, !write) {
        return Err(Failure::WrongDirection);
    }
    if write && limits.read_only {
        return Err(Failure::ReadOnly);
    }
    if !len.is_multiple_of(SECTOR) {
        return Err(Failure::Unaligned);
    }
    if len > limits.max_data {
        return Err(Failure::TooLarge);
    }
    check_range(header.sector, len / SECTOR, limits.capacity_sectors)?;
    let iov = host_iovecs(data, mem).ok_or(Failure::OutsideMemory)?;
    Ok((if write { Op::Write } else { Op::Read }, iov))
}

fn get_id(data: &[Seg], len: u64, mem: &HostMap) -> Result<IoVecs, Failure> {
    if !all_write(data, true) || len == 0 {
        return Err(Failure::GetIdNotWritable);
    }
    host_iovecs(data, mem).ok_or(Failure::OutsideMemory)
}

/// One discard / write-zeroes segment as the guest lays it out (virtio 1.2 §5.2.6).
#[repr(C)]
#[derive(Clone, Copy)]
struct RangeSegment {
    sector: u64,
    num_sectors: u32,
    flags: u32,
}

const RANGE_LEN: usize = std::mem::size_of::<RangeSegment>();
const _: () = assert!(RANGE_LEN == 16);

impl RangeSegment {
    fn from_bytes(c: &[u8]) -> RangeSegment {
        assert_eq!(c.len(), RANGE_LEN);
        // SAFETY: `c` is 16 initialised bytes (checked above); `read_unaligned` has no
        // alignment requirement and every bit pattern is a valid `RangeSegment`.
        let r = unsafe { std::ptr::read_unaligned(c.as_ptr() as *const RangeSegment) };
        RangeSegment {
            sector: u64::from_le(r.sector),
            num_sectors: u32::from_le(r.num_sectors),
            flags: u32::from_le(r.flags),
        }
    }
}

/// A discard or write-zeroes request: its range list, every segment checked.
fn ranges(
    zeroes: bool,
    data: &[Seg],
    len: u64,
    mem: &HostMap,
    limits: &Limits,
) -> Result<Op, Failure> {
    if !all_write(data, false) {
        return Err(Failure::RangeWrongDirection);
    }
    if limits.read_only {
        return Err(Failure::RangeReadOnly);
    }
    if len == 0 || !len.is_multiple_of(RANGE_LEN as u64) {
        return Err(Failure::RangeListLength);
    }
    if len / RANGE_LEN as u64 > limits.max_discard_segs as u64 {
        return Err(Failure::TooManySegments);
    }
    let mut raw = Vec::with_capacity(len as usize);
    for s in data {
        let at = raw.len();
        raw.resize(at + s.len as usize, 0);
        if !mem.read(s.addr.0, &mut raw[at..]) {
            return Err(Failure::RangeListUnreadable);
        }
    }
    let allowed = if zeroes {
        VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
    } else {
        0
    };
    let mut ranges = Vec::new();
    let mut unmap = false;
    for c in raw.chunks_exact(RANGE_LEN) {
        let seg = RangeSegment::from_bytes(c);
        if seg.flags & !allowed != 0 {
            return Err(Failure::UnsupportedFlags);
        }
        unmap |= seg.flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
        if seg.num_sectors > limits.max_discard_sectors {
            return Err(Failure::SegmentTooLarge);
        }
        check_range(seg.sector, seg.num_sectors as u64, limits.capacity_sectors)?;
        ranges.push(Range {
            sector: seg.sector,
            sectors: seg.num_sectors,
        });
    }
    Ok(if zeroes {
        Op::WriteZeroes { ranges, unmap }
    } else {
        Op::Discard(ranges)
    })
}
