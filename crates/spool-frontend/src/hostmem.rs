//! Guest-physical to host address translation for the request path.
//!
//! A [`HostMap`] is a flat copy of one guest memory map's regions (guest address, length,
//! host address), built once per memory table and used for every ring access, descriptor,
//! request header and status byte. vm-memory's generic accessors (region lookup through the
//! backend trait, slice iterators, bounds-checked volatile slices) cost about half of the
//! request path's instructions (callgrind, `docs/benchmarks/request-path.md`); a guest has a
//! handful of regions, so a linear scan behind a two-entry cache of the regions last hit is
//! cheaper (a request's header and status usually lie in one region, its data in another).
//!
//! It owns nothing: the host addresses are valid while the [`GuestMemory`] it was built from
//! is alive, which its users guarantee by holding that `Arc`. It knows nothing of virtio.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use crate::memory::GuestMemory;

#[derive(Debug, Clone, Copy, Default)]
struct Region {
    gpa: u64,
    len: u64,
    host: usize,
}

/// The regions of one guest memory map, sorted by guest address.
#[derive(Debug, Default)]
pub struct HostMap {
    /// Unique per map built (0: the empty default), so that users may cache addresses
    /// translated through it and know when they are stale.
    id: u64,
    regions: Box<[Region]>,
    /// Copies of the two regions most recently found by a scan, tried before scanning (an
    /// empty default region matches nothing).
    hot: [Cell<Region>; 2],
}

impl HostMap {
    /// Flattens `mem` (regions whose host address cannot be had are left out: every access
    /// into them fails, as it would through vm-memory).
    pub fn new(mem: &GuestMemory) -> HostMap {
        let mut regions: Vec<Region> = mem
            .iter()
            .filter_map(|r| {
                let host = r.get_host_address(MemoryRegionAddress(0)).ok()? as usize;
                Some(Region {
                    gpa: r.start_addr().0,
                    len: r.len(),
                    host,
                })
            })
            .collect();
        regions.sort_by_key(|r| r.gpa);
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        HostMap {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            regions: regions.into_boxed_slice(),
            hot: Default::default(),
        }
    }

    /// This map's identity (see the field).
    #[inline]
    pub fn id(&self) -> u64 {
        self.id
    }

    #[inline]
    fn region_of(&self, gpa: u64) -> Option<Region> {
        for h in &self.hot {
            let r = h.get();
            if gpa.wrapping_sub(r.gpa) < r.len {
                return Some(r);
            }
        }
        self.scan(gpa)
    }

    /// The region holding `gpa`, found by a scan; it becomes the hotter cached one.
    #[inline(never)]
    fn scan(&self, gpa: u64) -> Option<Region> {
        let r = *self
            .regions
            .iter()
            .find(|r| gpa.wrapping_sub(r.gpa) < r.len)?;
        self.hot[1].set(self.hot[0].get());
        self.hot[0].set(r);
        Some(r)
    }

    /// Host address of `[gpa, gpa + len)` when all of it lies in one region (`len` may be 0).
    #[inline]
    pub fn host(&self, gpa: u64, len: u64) -> Option<usize> {
        let r = self.region_of(gpa)?;
        let off = gpa - r.gpa;
        if len > r.len - off {
            return None;
        }
        Some(r.host + off as usize)
    }

    /// Calls `f(host, len)` for each piece of `[gpa, gpa + len)`, split where it crosses from
    /// one region into the next; false (after any calls) if part of it is not guest memory.
    pub fn pieces(&self, gpa: u64, len: u64, mut f: impl FnMut(usize, usize)) -> bool {
        let (mut at, mut left) = (gpa, len);
        while left > 0 {
            let Some(r) = self.region_of(at) else {
                return false;
            };
            let off = at - r.gpa;
            let n = left.min(r.len - off);
            f(r.host + off as usize, n as usize);
            left -= n;
            let Some(next) = at.checked_add(n) else {
                return left == 0;
            };
            at = next;
        }
        true
    }

    /// Whether all of `[gpa, gpa + len)` is guest memory (possibly over several regions).
    pub fn contains(&self, gpa: u64, len: u64) -> bool {
        self.host(gpa, len).is_some() || self.pieces(gpa, len, |_, _| {})
    }

    /// Copies guest memory at `gpa` into `buf`; false if part of it is not guest memory.
    #[inline]
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> bool {
        if let Some(h) = self.host(gpa, buf.len() as u64) {
            // SAFETY: `h..h+buf.len()` lies inside one region (`host` refuses a range that
            // crosses a region's end), mapped while the caller holds the `GuestMemory` (module
            // doc); copied as bytes, never through a reference (the guest may be writing).
            unsafe { std::ptr::copy_nonoverlapping(h as *const u8, buf.as_mut_ptr(), buf.len()) };
            return true;
        }
        let mut at = 0usize;
        self.pieces(gpa, buf.len() as u64, |h, n| {
            // SAFETY: `pieces` hands out `h..h+n` inside one region (`n <= r.len - off`) and
            // the pieces sum to at most `buf.len()`, so `at + n <= buf.len()`; mapped per the
            // module doc; copied as bytes (the guest may write them concurrently).
            unsafe { std::ptr::copy_nonoverlapping(h as *const u8, buf.as_mut_ptr().add(at), n) };
            at += n;
        })
    }

    /// A little-endian u16 at `gpa`, read with one access when aligned (ring indices are:
    /// virtio-queue's validity check requires aligned rings; the guest updates them
    /// concurrently).
    #[inline]
    pub fn read_u16(&self, gpa: u64) -> Option<u16> {
        let h = self.host(gpa, 2)?;
        // SAFETY: `h..h+2` lies inside one region (`host(gpa, 2)`), mapped per the module
        // doc; read once as a value, never through a reference (the guest may write it).
        let v = unsafe {
            if h.is_multiple_of(2) {
                std::ptr::read_volatile(h as *const u16)
            } else {
                std::ptr::read_unaligned(h as *const u16)
            }
        };
        Some(u16::from_le(v))
    }

    /// Writes a little-endian u16 at `gpa`, with one access when aligned; false if not guest
    /// memory.
    #[inline]
    pub fn write_u16(&self, gpa: u64, v: u16) -> bool {
        let Some(h) = self.host(gpa, 2) else {
            return false;
        };
        // SAFETY: `h..h+2` lies inside one region (`host(gpa, 2)`), mapped per the module
        // doc; written as a value (the guest reads this word concurrently).
        unsafe {
            if h.is_multiple_of(2) {
                std::ptr::write_volatile(h as *mut u16, v.to_le())
            } else {
                std::ptr::write_unaligned(h as *mut u16, v.to_le())
            }
        };
        true
    }

    /// Writes `bytes` at `gpa` (within one region); false if not guest memory.
    #[inline]
    pub fn write(&self, gpa: u64, bytes: &[u8]) -> bool {
        let Some(h) = self.host(gpa, bytes.len() as u64) else {
            let mut at = 0usize;
            return self.pieces(gpa, bytes.len() as u64, |h, n| {
                // SAFETY: `pieces` hands out `h..h+n` inside one region and the pieces sum to
                // at most `bytes.len()`, so `at + n <= bytes.len()`; written as bytes.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr().add(at), h as *mut u8, n) };
                at += n;
            });
        };
        // SAFETY: `h..h+bytes.len()` lies inside one region (`host` refuses a range crossing a
        // region's end), mapped per the module doc; no reference to guest memory is formed.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), h as *mut u8, bytes.len()) };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn translates_reads_and_writes_across_regions() {
        let mem = GuestMemory::from_ranges(&[
            (GuestAddress(0), 0x1000),
            (GuestAddress(0x1000), 0x1000),
            (GuestAddress(0x10_0000), 0x1000),
        ])
        .unwrap();
        let m = HostMap::new(&mem);
        assert!(m.host(0x0ff8, 8).is_some());
        assert!(m.host(0x0ffc, 8).is_none(), "crosses a region boundary");
        assert!(m.contains(0x0ffc, 8), "adjacent regions together hold it");
        assert!(!m.contains(0x1ffc, 8), "runs past the end of guest memory");
        assert!(!m.contains(0x5000, 1));
        assert!(m.host(u64::MAX, 1).is_none());
        assert!(!m.contains(u64::MAX - 1, 4));
        let data: Vec<u8> = (0..16).collect();
        assert!(m.write(0x0ff8, &data));
        let mut back = [0u8; 16];
        mem.read_slice(&mut back, GuestAddress(0x0ff8)).unwrap();
        assert_eq!(&back[..], &data[..]);
        let mut again = [0u8; 16];
        assert!(m.read(0x0ff8, &mut again));
        assert_eq!(again, back);
        assert!(m.write_u16(0x10_0002, 0xbeef));
        assert_eq!(m.read_u16(0x10_0002), Some(0xbeef));
        let v: u16 = mem.read_obj(GuestAddress(0x10_0002)).unwrap();
        assert_eq!(v, 0xbeef);
        assert_eq!(m.read_u16(0x10_0fff), None, "half outside");
        let mut out = [0u8; 4];
        assert!(!m.read(0x1ffe, &mut out));
    }
}
