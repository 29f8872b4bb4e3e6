//! Physical Region Page lists (NVMe Base Specification §4.3) and Scatter Gather Lists (§4.4):
//! how one command describes a scattered buffer.
//!
//! The first entry may start anywhere dword-aligned; every later entry is a whole page
//! start, and every segment but the last must end on a page boundary. A buffer list that
//! breaks these rules cannot be described by PRPs and goes through a bounce buffer.

use crate::PAGE;

/// Whether `segs` (device addresses, byte lengths) can be described by one PRP list.
pub fn describable(segs: &[(u64, u64)]) -> bool {
    let n = segs.len();
    if n == 0 || !segs[0].0.is_multiple_of(4) {
        return false;
    }
    segs.iter().enumerate().all(|(i, &(addr, len))| {
        len > 0 && (i == 0 || addr % PAGE == 0) && (i + 1 == n || (addr + len) % PAGE == 0)
    })
}

/// Appends the PRP entries of `segs` (assumed [`describable`]) to `out`.
pub fn entries(segs: &[(u64, u64)], out: &mut Vec<u64>) {
    for &(addr, len) in segs {
        let end = addr + len;
        out.push(addr);
        let mut page = (addr & !(PAGE - 1)) + PAGE;
        while page < end {
            out.push(page);
            page += PAGE;
        }
    }
}

/// The sub-range `[start, start+len)` (in bytes of the whole transfer) of `segs`.
pub fn slice(segs: &[(u64, u64)], start: u64, len: u64, out: &mut Vec<(u64, u64)>) {
    let mut pos = 0u64;
    let end = start + len;
    for &(addr, l) in segs {
        let (s, e) = (pos, pos + l);
        pos = e;
        if e <= start {
            continue;
        }
        if s >= end {
            break;
        }
        let from = start.max(s);
        let to = end.min(e);
        out.push((addr + (from - s), to - from));
    }
}

/// PRP1/PRP2 for a command whose entries are `e`; when more than two entries are needed the
/// entries after the first are written to `list` (one page, device address `list_iova`) and
/// PRP2 points at it. Returns `None` if they do not fit one list page.
pub fn fill(e: &[u64], list: &mut [u64], list_iova: u64) -> Option<(u64, u64)> {
    match e.len() {
        0 => Some((0, 0)),
        1 => Some((e[0], 0)),
        2 => Some((e[0], e[1])),
        n if n - 1 <= list.len() => {
            list[..n - 1].copy_from_slice(&e[1..]);
            Some((e[0], list_iova))
        }
        _ => None,
    }
}

/// Whether the controller's SGL support (`sgl`: 0 none, 1 any alignment, 2 dword aligned)
/// can describe `segs` with at most `max` data block descriptors in one list.
pub fn sgl_describable(segs: &[(u64, u64)], sgl: u8, max: usize) -> bool {
    match sgl {
        1 => !segs.is_empty() && segs.len() <= max,
        2 => {
            !segs.is_empty()
                && segs.len() <= max
                && segs
                    .iter()
                    .all(|&(a, l)| a.is_multiple_of(4) && l.is_multiple_of(4))
        }
        _ => false,
    }
}

fn descriptor(addr: u64, len: u64, id: u8) -> [u8; 16] {
    let mut d = [0u8; 16];
    d[..8].copy_from_slice(&addr.to_le_bytes());
    d[8..12].copy_from_slice(&(len as u32).to_le_bytes());
    d[15] = id;
    d
}

/// The command's data pointer (two quadwords) for `segs` described by an SGL, and the list of
/// data block descriptors to place at `list_iova` when there is more than one segment (the data
/// pointer is then a Last Segment descriptor naming that list). `list_iova` may be a
/// placeholder (`u64::MAX`) the caller replaces with the list page's address.
pub fn sgl(segs: &[(u64, u64)], list_iova: u64) -> ((u64, u64), Vec<[u8; 16]>) {
    const DATA_BLOCK: u8 = 0x00;
    const LAST_SEGMENT: u8 = 0x30;
    let quads = |d: [u8; 16]| {
        (
            u64::from_le_bytes(d[..8].try_into().expect("8 bytes")),
            u64::from_le_bytes(d[8..].try_into().expect("8 bytes")),
        )
    };
    if segs.len() == 1 {
        return (
            quads(descriptor(segs[0].0, segs[0].1, DATA_BLOCK)),
            Vec::new(),
        );
    }
    let list: Vec<[u8; 16]> = segs
        .iter()
        .map(|&(a, l)| descriptor(a, l, DATA_BLOCK))
        .collect();
    let last = descriptor(list_iova, list.len() as u64 * 16, LAST_SEGMENT);
    (quads(last), list)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgl_descriptors() {
        let segs = [(0x1001, 0x3ff), (0x5000, 0x201)];
        assert!(!describable(&segs));
        assert!(sgl_describable(&segs, 1, 256));
        assert!(!sgl_describable(&segs, 2, 256), "dword alignment required");
        assert!(!sgl_describable(&segs, 0, 256));
        assert!(!sgl_describable(&segs, 1, 1), "too many for one list");
        let ((d0, d1), list) = sgl(&segs, 0xabc000);
        // Last Segment descriptor: the list's address, its length (2 × 16), type 3.
        assert_eq!(d0, 0xabc000);
        assert_eq!(d1 & 0xffff_ffff, 32);
        assert_eq!(d1 >> 56, 0x30);
        assert_eq!(list.len(), 2);
        assert_eq!(u64::from_le_bytes(list[1][..8].try_into().unwrap()), 0x5000);
        assert_eq!(
            u32::from_le_bytes(list[1][8..12].try_into().unwrap()),
            0x201
        );
        assert_eq!(list[1][15], 0);
        // One segment: a Data Block descriptor in the command itself.
        let ((d0, d1), list) = sgl(&segs[..1], 0);
        assert_eq!((d0, d1 & 0xffff_ffff, d1 >> 56), (0x1001, 0x3ff, 0));
        assert!(list.is_empty());
    }

    #[test]
    fn rules() {
        assert!(describable(&[(0x1000, 4096)]));
        assert!(describable(&[(0x1200, 512)]));
        assert!(describable(&[
            (0x1200, 0xe00),
            (0x5000, 0x2000),
            (0x9000, 0x200)
        ]));
        assert!(
            !describable(&[(0x1200, 0x200), (0x5000, 0x1000)]),
            "first ends mid-page"
        );
        assert!(
            !describable(&[(0x1000, 0x1000), (0x5200, 0x200)]),
            "later starts mid-page"
        );
        assert!(!describable(&[(0x1002, 0x200)]), "not dword aligned");
        assert!(!describable(&[]));
    }

    #[test]
    fn entries_and_fill() {
        let mut e = Vec::new();
        entries(
            &[(0x1200, 0xe00), (0x5000, 0x2000), (0x9000, 0x200)],
            &mut e,
        );
        assert_eq!(e, vec![0x1200, 0x5000, 0x6000, 0x9000]);
        let mut list = [0u64; 512];
        assert_eq!(fill(&e, &mut list, 0xabc000), Some((0x1200, 0xabc000)));
        assert_eq!(&list[..3], &[0x5000, 0x6000, 0x9000]);
        assert_eq!(fill(&e[..2], &mut list, 0xabc000), Some((0x1200, 0x5000)));
        let mut e = Vec::new();
        entries(&[(0x1200, 0x1000)], &mut e);
        assert_eq!(
            e,
            vec![0x1200, 0x2000],
            "a page-crossing buffer takes two entries"
        );
        let big: Vec<u64> = (0..600).map(|i| i * PAGE).collect();
        assert_eq!(fill(&big, &mut list, 0), None);
    }

    #[test]
    fn slicing_keeps_boundaries_valid() {
        let segs = [(0x1200, 0xe00), (0x5000, 0x2000), (0x9000, 0x1000)];
        let mut out = Vec::new();
        slice(&segs, 0x800, 0x1000, &mut out);
        assert_eq!(out, vec![(0x1a00, 0x600), (0x5000, 0xa00)]);
        assert!(describable(&out));
        out.clear();
        slice(&segs, 0xe00, 0x3000, &mut out);
        assert_eq!(out, vec![(0x5000, 0x2000), (0x9000, 0x1000)]);
        // Every split of a describable list at sector boundaries stays describable.
        for start in (0..0x3e00u64).step_by(512) {
            for len in (512..=0x3e00 - start).step_by(512) {
                out.clear();
                slice(&segs, start, len, &mut out);
                assert!(describable(&out), "{start:#x}+{len:#x}: {out:x?}");
                assert_eq!(out.iter().map(|s| s.1).sum::<u64>(), len);
            }
        }
    }
}
