//! What a mirror marks for copying when it opens: legs placed anew or not yet synced, and the
//! regions a crash left in doubt (their intent bits).
//!
//! Owns: [`prepare_legs`], [`prepare_intents`]. Must not know: queues, the copy itself.

use std::sync::atomic::Ordering;

use crate::bitmap::{self, Found, INTENT, SYNC_SOURCE};
use crate::{MirrorSpec, Regions, MAX_LEGS, MISSING};

/// The identity a slot without a leg holds (a new bitmap's slots hold it too).
const NO_LEG: u64 = 0;

/// Marks what the legs need copied: legs not synced whose slot's bits belong to another
/// placement (or to no bitmap) become stale everywhere; a synced leg whose slot held another
/// placement's bits has them dropped.
pub(crate) fn prepare_legs(spec: &MirrorSpec, regions: &Regions, found: Found) {
    let n = regions.bitmap.regions();
    let mut cleanup = !spec.legs.iter().fold(0, |m, l| m | bitmap::stale(l.slot)) & 0b111;
    // A slot without a leg forgets its last leg's identity: a leg added there later is new
    // even on the very extents the removed one had (a thick leg's identity is its extents),
    // never taken for the removed leg, current wherever the removal cleared it, holding its
    // old data (tier 2, a fresh seed: a copy removed and one added at once).
    for slot in (0..MAX_LEGS as u8).filter(|&s| cleanup & bitmap::stale(s) != 0) {
        regions
            .bitmap
            .slot_id(slot)
            .store(NO_LEG, Ordering::Release);
    }
    let mut fill = 0u8;
    for l in &spec.legs {
        let id = regions.bitmap.slot_id(l.slot);
        if id.load(Ordering::Acquire) != l.id || found == Found::Fresh {
            match l.synced {
                false => fill |= bitmap::stale(l.slot),
                true if found == Found::Kept => cleanup |= bitmap::stale(l.slot),
                true => {}
            }
        }
        id.store(l.id, Ordering::Release);
    }
    if cleanup | fill != 0 {
        for r in 0..n {
            regions.unmark(r, cleanup);
            regions.mark(r, fill);
        }
        regions.bitmap.sync(0, n - 1);
    }
    regions.bitmap.sync_header();
}

/// Marks at a fresh open what a crash left in doubt; returns how many regions had intent.
///
/// With the bitmap kept, a region with intent is *out of sync*, not stale: a write is
/// acknowledged only once every usable leg took it (and a leg that missed one is marked stale
/// first), so every leg not stale there holds every acknowledged write, and the legs differ
/// at most in writes no one saw complete. The region's reads go to one such leg (a synced
/// one, present if any, lowest slot) until the resync copies it to the others. With the
/// bitmap lost nothing is known of what a leg missed: every leg but that one is stale.
///
/// `left` (from [`WriteCounts::left_behind`]: the predecessor was a process of this boot)
/// says exactly which regions had writes in flight: only those intent regions are in doubt.
pub(crate) fn prepare_intents(
    spec: &MirrorSpec,
    regions: &Regions,
    found: Found,
    left: Option<&[bool]>,
) -> u64 {
    let n = regions.bitmap.regions();
    let all: u8 = spec.legs.iter().fold(0, |m, l| m | bitmap::stale(l.slot));
    let mut intents = 0;
    for r in 0..n {
        let b = regions.bitmap.byte(r);
        if found == Found::Fresh {
            b.fetch_or(INTENT, Ordering::AcqRel);
        }
        let v = b.load(Ordering::Acquire);
        if v & INTENT == 0 || left.is_some_and(|l| !l[r]) {
            continue;
        }
        intents += 1;
        // A missing leg's region stays in doubt until it is back.
        let src = spec
            .legs
            .iter()
            .filter(|l| l.synced && v & bitmap::stale(l.slot) == 0)
            .min_by_key(|l| {
                (
                    l.pieces.iter().any(|p| p.device == MISSING),
                    Some(l.slot) != bitmap::sync_source(v),
                    l.slot,
                )
            });
        let Some(s) = src else { continue };
        let to = match found {
            Found::Fresh => v | (all & !bitmap::stale(s.slot)),
            Found::Kept => match bitmap::sync_source(v) {
                Some(old) if old == s.slot => v,
                // The recorded source cannot serve: it is copied to like any other.
                Some(old) => (v & !SYNC_SOURCE) | bitmap::out_of_sync(s.slot) | bitmap::stale(old),
                None => v | bitmap::out_of_sync(s.slot),
            },
        };
        b.store(to, Ordering::Release);
    }
    regions.recount();
    regions.bitmap.sync(0, n - 1);
    intents
}
