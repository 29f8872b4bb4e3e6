//! A mirror built again over grown legs: which legs of the new spec are the old ones grown
//! (so their bitmap slots, and what they are stale in, carry over), as opposed to new legs
//! put in a slot.
//!
//! Owns: telling a grown leg from a new one. Must not know: the pool's allocation.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::regions::Regions;
use crate::{LegPiece, MirrorSpec};

/// A leg that only grew is the same leg: its stale bits stay its own, under its new
/// identity (`prepare_legs` would wipe them as a new leg's in its slot).
pub(crate) fn keep_grown(regions: &Regions, grown: &[(u8, u64, u64)]) {
    for &(slot, old, new) in grown {
        let id = regions.bitmap.slot_id(slot);
        let _ = id.compare_exchange(old, new, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// The legs of `new` that are legs of `old` grown (the same slot, its pieces those of the old
/// one with more after them, the old last one perhaps longer): (slot, old id, new id).
///
/// Pieces name devices by index into their spec's devices, and a grow may put a leg's new
/// piece on a device the mirror did not use before, which can move the others' indices:
/// devices are compared as the devices themselves. (Compared by index, such a grown leg was
/// taken for a new leg in its slot, its stale bits wiped, and it served data it had missed:
/// torture seed 10589.)
pub(crate) fn grown_legs(old: &MirrorSpec, new: &MirrorSpec) -> Vec<(u8, u64, u64)> {
    let dev = |spec: &MirrorSpec, i: usize| spec.devices.get(i).map(Arc::as_ptr);
    let same = |a: &LegPiece, b: &LegPiece| {
        (a.logical, a.offset) == (b.logical, b.offset)
            && dev(old, a.device).is_some()
            && dev(old, a.device) == dev(new, b.device)
    };
    let mut out = Vec::new();
    for l in &new.legs {
        let Some(p) = old.legs.iter().find(|p| p.slot == l.slot) else {
            continue;
        };
        let Some((last, head)) = p.pieces.split_last() else {
            continue;
        };
        let prefix = l.pieces.len() >= p.pieces.len()
            && head
                .iter()
                .zip(&l.pieces)
                .all(|(a, b)| same(a, b) && a.len == b.len)
            && l.pieces
                .get(head.len())
                .is_some_and(|b| same(last, b) && b.len >= last.len);
        if p.id != l.id && prefix && p.far == l.far {
            out.push((l.slot, p.id, l.id));
        }
    }
    out
}
