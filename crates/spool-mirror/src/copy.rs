//! Copying one region of a mirror from a source leg to target legs, piece by piece, with
//! writes kept out of the region while each piece moves (md's resync barrier, writes first).
//! A copy counts only if no write reached the region meanwhile, and it never copies from a
//! source that a write missed after the source was chosen: it would land older bytes over
//! the only leg holding that write.
//!
//! Owns: one region's copy. Must not know: which regions need copying (the background
//! thread's pass, `resync.rs`), the data path's queues.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::bitmap::{stale, sync_source, SYNC_SOURCE};
use super::legio::{leg_read, leg_unwritten, leg_write, leg_zeroes, AlignedBuf, LegIo};
use super::{Shared, MAX_LEGS};
use spool_devices::Result;

/// Longest wait for a region's writes to drain before the copy moves on to other regions.
const DRAIN_WAIT: Duration = Duration::from_millis(20);
/// Longest the copy keeps writes out of a region never quiet while those in flight finish
/// ([`HeldForCopy::drain`]); then it lets them in again and tries on a later pass.
const DRAIN_WHOLE: Duration = Duration::from_millis(100);
/// The copy moves a region this much at a time, keeping writes out of the region meanwhile:
/// short enough that a write waiting for it waits about one device write.
const COPY_PIECE: u64 = 256 << 10;

/// Waits (briefly) until no write is in flight in region `r`; returns the generation seen
/// before, or `None` when writes kept coming.
pub(super) fn quiet_gen(shared: &Shared, r: usize) -> Option<u32> {
    let t0 = Instant::now();
    loop {
        let g = shared.regions.gens[r].load(Ordering::SeqCst);
        if shared.regions.writes[r].load(Ordering::SeqCst) & !super::FLAGS == 0 {
            return Some(g);
        }
        if t0.elapsed() > DRAIN_WAIT {
            return None;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Copies region `r` from leg `source` to the legs in `targets`; `Some` when the copy counts
/// (no write reached the region meanwhile), with the bytes of it that neither source nor
/// targets ever wrote (neither read nor written: [`leg_unwritten`]). An out-of-sync region is in sync afterwards: the
/// legs copied to agree with the source, and the legs that were not (not usable now) are
/// marked stale there, so they are copied to before they are read.
///
/// Writes first: each piece moves under a hold of its own and writes go in between (a write
/// waits at most one piece). A region the guest writes all the time is never quiet that
/// way, and its copy never counted: the leg stayed stale there for as long as the guest
/// wrote (found in release builds, where a test's load outran the copy). Such a region is
/// then, when writes came in meanwhile, copied once more with writes kept out of it from the
/// start to the end, as md's resync barrier does: new writes wait, those in flight finish,
/// the whole region moves.
pub(crate) fn copy_region(
    shared: &Shared,
    io: &mut LegIo,
    buf: &mut AlignedBuf,
    job: (usize, u8, u8),
) -> Result<Option<u64>> {
    let g0 = shared.regions.gens[job.0].load(Ordering::SeqCst);
    if let Some(n) = copy_once(shared, io, buf, job, None)? {
        return Ok(Some(n));
    }
    // Only writes coming in keep a region from being copied that way: a write that does not
    // finish (a hung leg) is no reason to keep the others out of it.
    let churned = shared.regions.gens[job.0].load(Ordering::SeqCst) != g0;
    if !churned || shared.stop.load(Ordering::Acquire) || !still_source(shared, job.0, job.1) {
        return Ok(None);
    }
    let Some(held) = HeldForCopy::drain(shared, job.0) else {
        return Ok(None);
    };
    copy_once(shared, io, buf, job, Some(&held))
}

/// One try at [`copy_region`]: piece by piece with writes in between, or, under `whole` (a
/// hold of the region taken for the whole copy), with none.
fn copy_once(
    shared: &Shared,
    io: &mut LegIo,
    buf: &mut AlignedBuf,
    (r, source, targets): (usize, u8, u8),
    whole: Option<&HeldForCopy>,
) -> Result<Option<u64>> {
    let g = match whole {
        Some(_) => shared.regions.gens[r].load(Ordering::SeqCst),
        None => match quiet_gen(shared, r) {
            Some(g) => g,
            None => return Ok(None),
        },
    };
    // The source was chosen from the region's byte before its writes drained: one in flight
    // then may have failed on the source since (marking it stale there) and reached the
    // targets, which the copy would overwrite with the older bytes. Chosen again next pass.
    if !still_source(shared, r, source) {
        return Ok(None);
    }
    let mut unwritten = 0;
    if targets != 0 {
        match copy_pieces(shared, io, buf, (r, source, targets), (g, whole.is_some()))? {
            Some(n) => unwritten = n,
            None => return Ok(None),
        }
    }
    // The targets become current under a hold of the region, so no write can enter between
    // the last check and the change: one that failed on a target then would mark it stale
    // in vain (it is still), and the change would clear that.
    let _held = match whole {
        Some(_) => None,
        None => match HeldForCopy::wait(shared, r) {
            Some(h) => Some(h),
            None => return Ok(None),
        },
    };
    if shared.regions.gens[r].load(Ordering::SeqCst) != g {
        return Ok(None);
    }
    let others = shared.all_slots() & !targets & !stale(source);
    let (_, after) = shared.regions.update(r, |b| match sync_source(b) {
        // A flush the source missed marks it without a hold: checked in the change itself.
        _ if b & stale(source) != 0 => b,
        Some(s) if s == source => (b & !targets & !SYNC_SOURCE) | others,
        Some(_) => b,
        None => b & !targets,
    });
    if sync_source(after).is_some() || after & stale(source) != 0 {
        // The source moved meanwhile (its leg failed), or it missed a flush: copied again
        // from the leg that serves then.
        return Ok(None);
    }
    if others != 0 {
        shared.regions.bitmap.sync(r, r);
    }
    Ok(Some(unwritten))
}

/// Copies region `r` piece by piece from `source` to `targets` and flushes them; `None` when
/// a write reached the region (its generation moved from `g`) or the source stopped being
/// one, so the copy counts for nothing; else the bytes neither read nor written. `whole`: the
/// caller holds the region throughout (no hold per piece).
fn copy_pieces(
    shared: &Shared,
    io: &mut LegIo,
    buf: &mut AlignedBuf,
    (r, source, targets): (usize, u8, u8),
    (g, whole): (u32, bool),
) -> Result<Option<u64>> {
    let (off, len) = shared.region_range(r);
    let mut written = Vec::new();
    let (mut at, mut unwritten) = (0, 0);
    while at < len {
        let n = COPY_PIECE.min(len - at);
        let _held = match whole {
            true => None,
            false => match HeldForCopy::wait(shared, r) {
                Some(h) => Some(h),
                None => return Ok(None),
            },
        };
        // A write between two pieces may have missed the source (the same overwrite),
        // and a flush the source's device failed makes it stale without any write: the
        // copy counts for nothing then, so it stops before the next piece.
        if shared.regions.gens[r].load(Ordering::SeqCst) != g || !still_source(shared, r, source) {
            return Ok(None);
        }
        let buf = buf.get(n as usize);
        // A piece the source never wrote (a thin copy's holes) is zeroes without reading it
        // (the region is held: no write changes that meanwhile), and a target that never
        // wrote it either needs nothing: an empty thin copy is copied at once.
        let hole = leg_unwritten(shared, source, off + at, n);
        if !hole {
            leg_read(shared, io, source, off + at, buf)?;
        }
        // A piece of zeroes goes out as write-zeroes: no data crosses a far leg's link
        // (a fresh volume sent to another host is mostly zeroes).
        let (zeroes, mut filled, mut wrote) = (hole || all_zero(buf), !hole, false);
        for t in (0..MAX_LEGS as u8).filter(|&t| targets & stale(t) != 0) {
            if shared.stop.load(Ordering::Acquire) {
                return Ok(None); // dropped meanwhile: its space may be given back
            }
            let piece = (t, off + at, n);
            if hole && leg_unwritten(shared, t, off + at, n) {
                continue;
            }
            if !filled {
                // Zeroes as data for a device without write-zeroes (only when one is
                // needed: a pass over a big empty thin copy skips every piece).
                buf.fill(0);
                filled = true;
            }
            wrote = true;
            if zeroes && leg_zeroes(shared, io, piece, buf, &mut written)? {
                shared.progress.zeroes.fetch_add(n, Ordering::Relaxed);
            } else if !zeroes {
                leg_write(shared, io, t, off + at, Some(&mut *buf), n, &mut written)?;
            }
        }
        if hole && !wrote {
            unwritten += n; // neither read nor written: not counted against the rate
        }
        at += n;
    }
    for d in written {
        io.flush(shared, d)?;
    }
    Ok(Some(unwritten))
}

/// Whether leg `source` may still be copied from in region `r`: not stale there, and the
/// region's read source if it is out of sync.
fn still_source(shared: &Shared, r: usize, source: u8) -> bool {
    let byte = shared.regions.bitmap.byte(r).load(Ordering::Acquire);
    byte & stale(source) == 0 && sync_source(byte).is_none_or(|s| s == source)
}

/// Whether `buf` holds only zero bytes (page by page, so a piece of data stops at its first
/// page; each page's test is a branch-free OR the compiler vectorises).
pub(crate) fn all_zero(buf: &[u8]) -> bool {
    buf.chunks(4096)
        .all(|page| page.iter().fold(0u8, |acc, &b| acc | b) == 0)
}

/// Region `r` held for one piece of a copy (no write in flight or entering), until dropped.
struct HeldForCopy<'a> {
    shared: &'a Shared,
    r: usize,
}

impl<'a> HeldForCopy<'a> {
    /// Waits (briefly: [`DRAIN_WAIT`]) for the writes in flight or waiting in region `r`
    /// to be done and holds it; `None` when writes kept coming (the region is copied on a
    /// later pass).
    fn wait(shared: &'a Shared, r: usize) -> Option<HeldForCopy<'a>> {
        let t0 = Instant::now();
        while !shared.regions.hold_for_copy(r) {
            if t0.elapsed() > DRAIN_WAIT {
                shared.regions.forget_waiter(r);
                return None;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Some(HeldForCopy { shared, r })
    }
}

impl<'a> HeldForCopy<'a> {
    /// Keeps writes out of region `r` from now on (they wait, as for any hold) and waits
    /// (briefly: [`DRAIN_WHOLE`]) for those in flight there to finish: the copy's barrier for
    /// a region never quiet. `None` when they did not finish in time (let go again).
    fn drain(shared: &'a Shared, r: usize) -> Option<HeldForCopy<'a>> {
        shared.regions.bar_for_copy(r);
        let held = HeldForCopy { shared, r };
        let t0 = Instant::now();
        while shared.regions.writes[r].load(Ordering::SeqCst) & !super::FLAGS != 0 {
            if t0.elapsed() > DRAIN_WHOLE {
                return None;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Some(held)
    }
}

impl Drop for HeldForCopy<'_> {
    fn drop(&mut self) {
        self.shared.regions.release_copy(self.r);
    }
}
