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

mod failure;
mod general;

pub use failure::{Failure, Rejected};
pub use general::parse_general;

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

/// The virtio-blk request header (virtio 1.2 §5.2.6), as the guest lays it out; read with
/// one unaligned copy (the guest may be rewriting it: it is read once, never again).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Header {
    ty: u32,
    reserved: u32,
    sector: u64,
}

const _: () = assert!(std::mem::size_of::<Header>() == HEADER_LEN as usize);

impl Header {
    /// Reads a header from `at`.
    ///
    /// # Safety
    /// `at..at + HEADER_LEN` must be readable memory for the duration of the call (guest
    /// memory that the caller's map keeps mapped).
    #[inline]
    unsafe fn read(at: usize) -> Header {
        // SAFETY: the caller guarantees the 16 bytes are mapped; `read_unaligned` has no
        // alignment requirement and every bit pattern is a valid `Header` (plain integers).
        let h = unsafe { std::ptr::read_unaligned(at as *const Header) };
        h.to_native()
    }

    fn from_bytes(b: &[u8; HEADER_LEN as usize]) -> Header {
        // SAFETY: `b` is 16 initialised bytes on our stack.
        unsafe { Header::read(b.as_ptr() as usize) }
    }

    fn to_native(self) -> Header {
        Header {
            ty: u32::from_le(self.ty),
            reserved: u32::from_le(self.reserved),
            sector: u64::from_le(self.sector),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Seg {
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
    // SAFETY: `hh..hh+16` lies inside one region (`HostMap::host(h.addr(), HEADER_LEN)`),
    // mapped while the caller holds the map's `GuestMemory`; `h` is a copy `ChainWalker`
    // read once, and the header is copied once here (the guest may be rewriting it).
    let Header { ty, sector, .. } = unsafe { Header::read(hh) };
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

fn check_range(sector: u64, sectors: u64, capacity: u64) -> Result<(), Failure> {
    match sector.checked_add(sectors) {
        Some(end) if end <= capacity => Ok(()),
        _ => Err(Failure::OutOfRange),
    }
}

#[cfg(test)]
mod tests;
