//! The per-region state every queue and the background thread of one mirror share: the
//! write-intent bitmap's bytes, writes in flight and started per region, and the counts the
//! control plane shows (stale regions per leg, regions out of sync).
//!
//! Which leg may serve a read is decided here ([`Shared::readable`]): a leg usable over the
//! range and not stale in any region of it; in a region out of sync after an unclean stop,
//! only the leg recorded as that region's read source (md's rule: one leg answers until the
//! resync makes them agree, so a block whose last write no one saw complete reads the same
//! every time). When that leg cannot serve, the source moves to another leg holding every
//! acknowledged write there, and the leg it leaves is marked stale in the region (copied
//! before it is read there again).
//!
//! Owns: the region byte transitions and their counts. Must not know: queues, devices' I/O.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::bitmap::{out_of_sync, stale, sync_source, Bitmap, INTENT, SYNC_SOURCE};
use super::writes::WriteCounts;
use super::{Shared, CLEARING, COPYING, MAX_LEGS, WAITER};

/// What a write entering its regions found ([`Regions::enter_write`]).
pub(crate) enum Entry {
    /// The copy holds one of them: try again once it lets go.
    Held,
    /// In; `sync`: the bitmap bytes changed and are synced before the write goes out.
    Entered { sync: bool },
    /// No leg it can reach is current in one of them (nothing counted).
    NoCurrent,
}

/// The per-region state shared by every queue of one mirror.
pub(crate) struct Regions {
    pub(crate) shift: u32,
    pub(crate) bitmap: Bitmap,
    /// Writes in flight per region (| CLEARING, | COPYING), where a killed worker's successor
    /// reads them.
    pub(crate) writes: WriteCounts,
    /// Writes ever started per region (the copy's race check).
    pub(crate) gens: Box<[AtomicU32]>,
    /// Per region, the number of the first flush submitted after its last write completed
    /// (see [`Regions::wrote`]): which regions a failed flush leaves undurable.
    pub(crate) unflushed: Box<[AtomicU32]>,
    /// Flushes submitted since the mirror opened.
    pub(crate) flushes: AtomicU32,
    /// Per slot, the first flush number whose regions' writes a power cut may take from the
    /// leg: every write to it that a flush before had to cover, one the leg took did (or
    /// its region was marked stale). A leg that missed several flushes in a row is behind
    /// since the first of them (torture seed 9748: a retried flush, which the leg missed
    /// again, looked only at the regions written since the one before, found none, and
    /// reported success; the write it should have covered was lost at the next power cut).
    pub(crate) durable_before: [AtomicU32; MAX_LEGS],
    /// Regions marked stale, per slot.
    pub(crate) stale: [AtomicU64; MAX_LEGS],
    /// Regions out of sync (a read source recorded).
    pub(crate) out_of_sync: AtomicU64,
    /// Per slot, the id of the far leg there that has held a complete copy (0: none): kept
    /// across the reopens a link's coming and going makes (see `LegSpec::far`).
    pub(crate) required_ids: [AtomicU64; MAX_LEGS],
    /// The volume was promoted elsewhere ([`crate::Mirror::fence`]): writes fail here.
    pub(crate) fenced: std::sync::atomic::AtomicBool,
    /// The completion events of queues with writes waiting for the copy to let a region
    /// go ([`Regions::wait_for_copy`]), signalled by [`Regions::release_copy`].
    wakers: std::sync::Mutex<Vec<std::sync::Weak<std::fs::File>>>,
}

impl Regions {
    pub(crate) fn new(bitmap: Bitmap, shift: u32, writes: WriteCounts) -> Regions {
        let n = bitmap.regions();
        Regions {
            shift,
            bitmap,
            writes,
            gens: (0..n).map(|_| AtomicU32::new(0)).collect(),
            unflushed: (0..n).map(|_| AtomicU32::new(0)).collect(),
            flushes: AtomicU32::new(0),
            durable_before: Default::default(),
            stale: Default::default(),
            out_of_sync: AtomicU64::new(0),
            required_ids: Default::default(),
            fenced: Default::default(),
            wakers: Default::default(),
        }
    }

    /// Stale bits of the far legs of `legs` that must take every write: synced in the table,
    /// or caught up while an earlier mirror over these regions was open.
    pub(crate) fn required_legs(&self, legs: &[super::LegSpec]) -> u8 {
        let mut mask = 0;
        for l in legs.iter().filter(|l| l.far) {
            let id = &self.required_ids[l.slot as usize % MAX_LEGS];
            if l.synced {
                id.store(l.id, Ordering::Relaxed);
            }
            if id.load(Ordering::Relaxed) == l.id {
                mask |= stale(l.slot);
            }
        }
        mask
    }

    /// The regions `[offset, offset + len)` touches (`len` > 0).
    #[inline]
    pub(crate) fn span(&self, offset: u64, len: u64) -> (usize, usize) {
        let first = (offset >> self.shift) as usize;
        let last = ((offset + len.max(1) - 1) >> self.shift) as usize;
        (first, last.min(self.writes.len() - 1))
    }

    /// A write enters regions `first..=last`: counts it, and returns whether the bitmap bytes
    /// needed `want` set (then the caller syncs them before the write goes out). `None`, with
    /// nothing counted, while the copy holds one of the regions ([`Regions::hold_for_copy`]):
    /// the write must not reach a leg until that piece of the copy has landed, or the copy's
    /// older bytes could land on a target after it and the target, once the only current
    /// leg, would serve them (md's resync barrier). The caller tries again later.
    pub(crate) fn enter(&self, first: usize, last: usize, want: u8) -> Option<bool> {
        for r in first..=last {
            let was = self.writes[r].fetch_add(1, Ordering::SeqCst);
            if was & COPYING != 0 {
                for q in first..=r {
                    self.writes[q].fetch_sub(1, Ordering::SeqCst);
                }
                self.writes[r].fetch_or(WAITER, Ordering::SeqCst);
                return None;
            }
            if was & WAITER != 0 {
                self.writes[r].fetch_and(!WAITER, Ordering::SeqCst);
            }
            if was & CLEARING != 0 {
                while self.writes[r].load(Ordering::SeqCst) & CLEARING != 0 {
                    std::hint::spin_loop();
                }
            }
        }
        let mut changed = false;
        for r in first..=last {
            self.gens[r].fetch_add(1, Ordering::SeqCst);
            changed |= self.mark(r, want);
        }
        Some(changed)
    }

    /// Keeps writes out of region `r` while the copy moves a piece of it: true when no write
    /// was in flight or waiting there and none will enter until [`Regions::release_copy`].
    pub(crate) fn hold_for_copy(&self, r: usize) -> bool {
        self.writes[r]
            .compare_exchange(0, COPYING, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Keeps writes out of region `r` from now on, with writes still in flight there (the
    /// copy waits for them to finish): new writes wait as for [`Regions::hold_for_copy`],
    /// until [`Regions::release_copy`]. For a region never quiet.
    pub(crate) fn bar_for_copy(&self, r: usize) {
        self.writes[r].fetch_or(COPYING, Ordering::SeqCst);
    }

    /// Lets writes into region `r` again (see [`Regions::hold_for_copy`]), and wakes the
    /// queues whose writes wait for the copy.
    pub(crate) fn release_copy(&self, r: usize) {
        self.writes[r].fetch_and(!COPYING, Ordering::SeqCst);
        let wakers = std::mem::take(&mut *self.wakers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in wakers.iter().filter_map(std::sync::Weak::upgrade) {
            let _ = std::io::Write::write(&mut &*w, &1u64.to_ne_bytes());
        }
    }

    /// A write [`Regions::enter`] turned away waits in the queue whose completion event is
    /// `waker`: signalled when the copy lets a region go. False when the copy let go of
    /// regions `first..=last` already (the write is to be tried again at once): the waker is
    /// registered before that is checked, so no release is missed.
    pub(crate) fn wait_for_copy(
        &self,
        first: usize,
        last: usize,
        waker: &std::sync::Arc<std::fs::File>,
    ) -> bool {
        let mut wakers = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
        if !wakers.iter().any(|w| std::ptr::eq(w.as_ptr(), &**waker)) {
            wakers.retain(|w| w.strong_count() > 0);
            wakers.push(std::sync::Arc::downgrade(waker));
        }
        drop(wakers);
        (first..=last).any(|r| self.writes[r].load(Ordering::SeqCst) & COPYING != 0)
    }

    /// Forgets that a write waits in region `r` (the copy gave up on the region meanwhile:
    /// a write that never came back must not keep it from being copied).
    pub(crate) fn forget_waiter(&self, r: usize) {
        self.writes[r].fetch_and(!WAITER, Ordering::SeqCst);
    }

    /// A write leaves regions `first..=last`.
    pub(crate) fn leave(&self, first: usize, last: usize) {
        for r in first..=last {
            self.writes[r].fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Sets `bits` in region `r`'s byte; returns whether any was new (stale counts follow).
    pub(crate) fn mark(&self, r: usize, bits: u8) -> bool {
        let b = self.bitmap.byte(r);
        if b.load(Ordering::Acquire) & bits == bits {
            return false;
        }
        let old = b.fetch_or(bits, Ordering::AcqRel);
        self.count(old, old | bits);
        bits & !old != 0
    }

    /// Sets `bits` in region `r` unless that leaves no leg of `keep` current there, checked
    /// and set in one step: two misses racing on different legs (a write each leg missed a
    /// different one of, a flush each failed) cannot each leave the other the region's only
    /// copy and then stale it, leaving none. Whether `keep` still has a current leg there.
    /// And whether the byte changed (then the caller syncs it before going on).
    pub(crate) fn mark_keeping(&self, r: usize, bits: u8, keep: u8) -> (bool, bool) {
        let (old, new) = self.update(r, |old| match keep & !(old | bits) & 0b111 {
            0 => old,
            _ => old | bits,
        });
        (keep & !(new | bits) & 0b111 != 0, old != new)
    }

    /// A write to the legs `writable` (of the mirror's legs `all`) enters regions
    /// `first..=last`: as [`Regions::enter`] with the intent bit, and the legs it cannot
    /// reach marked stale there unless that leaves none of `writable` current (another
    /// queue, with another view of the devices' health, staled those meanwhile: the write
    /// leaves again and finds no leg).
    pub(crate) fn enter_write(&self, first: usize, last: usize, all: u8, writable: u8) -> Entry {
        let Some(mut sync) = self.enter(first, last, INTENT) else {
            return Entry::Held;
        };
        let missed = all & !writable;
        if missed != 0 {
            for r in first..=last {
                let (kept, changed) = self.mark_keeping(r, missed, writable);
                if !kept {
                    self.leave(first, last);
                    return Entry::NoCurrent;
                }
                sync |= changed;
            }
        }
        Entry::Entered { sync }
    }

    /// Clears the stale bits of `slots_mask` in region `r`.
    pub(crate) fn unmark(&self, r: usize, slots_mask: u8) {
        let old = self
            .bitmap
            .byte(r)
            .fetch_and(!(slots_mask & 0b111), Ordering::AcqRel);
        self.count(old, old & !(slots_mask & 0b111));
    }

    /// Changes region `r`'s byte to `f(byte)` atomically (counts follow); returns the byte
    /// before and after.
    pub(crate) fn update(&self, r: usize, f: impl Fn(u8) -> u8) -> (u8, u8) {
        let b = self.bitmap.byte(r);
        let mut old = b.load(Ordering::Acquire);
        loop {
            let new = f(old);
            if new == old {
                return (old, old);
            }
            match b.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.count(old, new);
                    return (old, new);
                }
                Err(v) => old = v,
            }
        }
    }

    /// Keeps the stale and out-of-sync counts right for a byte changed from `old` to `new`.
    fn count(&self, old: u8, new: u8) {
        for s in 0..MAX_LEGS as u8 {
            match (old & stale(s) != 0, new & stale(s) != 0) {
                (false, true) => self.stale[s as usize].fetch_add(1, Ordering::Relaxed),
                (true, false) => self.stale[s as usize].fetch_sub(1, Ordering::Relaxed),
                _ => 0,
            };
        }
        match (sync_source(old).is_some(), sync_source(new).is_some()) {
            (false, true) => self.out_of_sync.fetch_add(1, Ordering::Relaxed),
            (true, false) => self.out_of_sync.fetch_sub(1, Ordering::Relaxed),
            _ => 0,
        };
    }

    /// Recounts stale and out-of-sync regions from the bytes (after they were set in bulk).
    pub(crate) fn recount(&self) {
        for s in &self.stale {
            s.store(0, Ordering::Relaxed);
        }
        self.out_of_sync.store(0, Ordering::Relaxed);
        for r in 0..self.bitmap.regions() {
            self.count(0, self.bitmap.byte(r).load(Ordering::Acquire));
        }
    }

    /// A write to regions `first..=last` completed on the legs it went to: the next flush
    /// submitted is the first that covers it there.
    pub(crate) fn wrote(&self, first: usize, last: usize) {
        let next = self.flushes.load(Ordering::SeqCst);
        for r in first..=last {
            self.unflushed[r].fetch_max(next, Ordering::SeqCst);
        }
    }

    /// A flush is submitted: its number (it covers every write [`Regions::wrote`] recorded
    /// before, with that number or less; a write completing meanwhile is given the next).
    pub(crate) fn flush_submitted(&self) -> u32 {
        self.flushes.fetch_add(1, Ordering::SeqCst)
    }

    /// Legs `missed` (their stale bits; `all`: every leg's) failed flush `flush` that others
    /// took, in each region `r` those of `missed_in(r)` (the legs whose part of `r` is on a
    /// device that missed it): each is marked stale there (durably), where another leg is
    /// current, if `r` was written since the last flush the leg took (`durable_before`; an
    /// earlier flush that covered a region answers for it itself), so what it may lose at a
    /// power cut is read from, and copied back from, those. False when in such a region no
    /// other leg is current: there the flush made nothing durable. Either way the legs that
    /// took it everywhere are durable up to it, and, when true, so are the others (what they
    /// may lose is stale).
    pub(crate) fn missed_flush(
        &self,
        all: u8,
        missed: u8,
        flush: u32,
        missed_in: &dyn Fn(usize) -> u8,
    ) -> bool {
        let since = (0..MAX_LEGS as u8)
            .filter(|&s| missed & stale(s) != 0)
            .map(|s| self.durable_before[s as usize].load(Ordering::SeqCst))
            .fold(flush, u32::min);
        let covered = self.mark_unflushed(all, since, missed_in);
        self.flushed(all & !missed, flush);
        if covered {
            self.flushed(missed, flush);
        }
        covered
    }

    /// Legs `slots` took flush `flush`: what was written before it was submitted is durable
    /// on them.
    pub(crate) fn flushed(&self, slots: u8, flush: u32) {
        for s in (0..MAX_LEGS as u8).filter(|&s| slots & stale(s) != 0) {
            self.durable_before[s as usize].fetch_max(flush + 1, Ordering::SeqCst);
        }
    }

    fn mark_unflushed(&self, all: u8, flush: u32, missed_in: &dyn Fn(usize) -> u8) -> bool {
        let n = self.bitmap.regions();
        let mut covered = true;
        let (mut first, mut last) = (usize::MAX, 0);
        for r in 0..n {
            if self.unflushed[r].load(Ordering::SeqCst) < flush {
                continue;
            }
            let missed = missed_in(r);
            if missed == 0 {
                continue;
            }
            if self.mark_keeping(r, all & missed, all & !missed).0 {
                (first, last) = (first.min(r), r);
            } else if all & missed & !self.bitmap.byte(r).load(Ordering::Acquire) != 0 {
                covered = false;
            }
        }
        if first <= last {
            self.bitmap.sync(first, last);
        }
        covered
    }

    /// Clears region `r`'s intent bit if no write is in flight there and none started since
    /// `gen` was seen; never races a write entering (see [`Regions::enter`]).
    pub(crate) fn try_clear_intent(&self, r: usize, gen: u32) -> bool {
        if self.writes[r]
            .compare_exchange(0, CLEARING, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return false;
        }
        let cleared = self.gens[r].load(Ordering::SeqCst) == gen;
        if cleared {
            self.bitmap.byte(r).fetch_and(!INTENT, Ordering::AcqRel);
        }
        self.writes[r].fetch_and(!CLEARING, Ordering::SeqCst);
        cleared
    }

    /// The leg serving reads of out-of-sync region `r` when the legs in `current` (usable,
    /// not stale there) can: its recorded source if that is one of them, else the lowest
    /// slot of them, which becomes the source (durably) while the leg it replaces is marked
    /// stale. `None` when the region is in sync or none of `current` can serve it.
    pub(crate) fn read_source(&self, r: usize, current: u8) -> Option<u8> {
        let byte = self.bitmap.byte(r).load(Ordering::Acquire);
        let src = sync_source(byte)?;
        if current & stale(src) != 0 {
            return Some(src);
        }
        let (_, new) = self.update(r, |b| match sync_source(b) {
            Some(s) if current & stale(s) == 0 && current != 0 => {
                let to = current.trailing_zeros() as u8;
                (b & !SYNC_SOURCE) | out_of_sync(to) | stale(s)
            }
            _ => b,
        });
        self.bitmap.sync(r, r);
        sync_source(new).filter(|s| current & stale(*s) != 0)
    }

    /// Makes leg `slot` the only current leg of region `r` (the operator's decision where no
    /// usable leg is current; see `Mirror::accept_leg`): every other leg of `all` (the
    /// mirror's slots) is stale there and will be copied from it.
    pub(crate) fn accept(&self, r: usize, all: u8, slot: u8) {
        self.update(r, |b| ((b | all) & !stale(slot)) & !SYNC_SOURCE);
    }
}

impl Shared {
    /// Legs usable (when the devices in `healthy` are) over `[offset, offset + len)` and
    /// not stale in any of its regions `regions`: those holding every acknowledged write.
    #[inline]
    pub(crate) fn current(
        &self,
        healthy: u64,
        offset: u64,
        len: u64,
        regions: (usize, usize),
    ) -> u8 {
        self.current_and_sync(healthy, offset, len, regions).0
    }

    /// The legs current in each region of `[offset, offset + len)` (regions `regions`), as a
    /// set of masks: bit `m` is set when some region's current legs are mask `m` (bit 0:
    /// some region has none). A range whose regions are current on different legs (each
    /// missed a write the other took, before the copy caught up) has no leg current in all
    /// of it, and is still served: each region from, or by, a leg current there.
    pub(crate) fn current_sets(
        &self,
        healthy: u64,
        offset: u64,
        len: u64,
        regions: (usize, usize),
    ) -> u8 {
        let usable = self.usable(healthy, offset, len);
        (regions.0..=regions.1).fold(0u8, |sets, r| {
            let b = self.regions.bitmap.byte(r).load(Ordering::Acquire);
            sets | 1 << (usable & !b & 0b111)
        })
    }

    /// [`Shared::current`], and whether some region of the range is out of sync (one pass
    /// over the region bytes: the read path's).
    #[inline]
    fn current_and_sync(
        &self,
        healthy: u64,
        offset: u64,
        len: u64,
        regions: (usize, usize),
    ) -> (u8, bool) {
        let mut mask = self.usable(healthy, offset, len);
        let mut out_of_sync = false;
        for r in regions.0..=regions.1 {
            let b = self.regions.bitmap.byte(r).load(Ordering::Acquire);
            mask &= !b;
            out_of_sync |= b & SYNC_SOURCE != 0;
        }
        (mask & 0b111, out_of_sync)
    }

    /// The legs a read of `[offset, offset + len)` (regions `regions`) may go to: the
    /// [`Shared::current`] ones, narrowed to the read source of every out-of-sync region it
    /// touches. (A read over two out-of-sync regions whose sources differ, possible only
    /// after a source moved, goes to the first one's.)
    #[inline]
    pub(crate) fn readable(
        &self,
        healthy: u64,
        offset: u64,
        len: u64,
        regions: (usize, usize),
    ) -> u8 {
        let (current, out_of_sync) = self.current_and_sync(healthy, offset, len, regions);
        if !out_of_sync {
            return current;
        }
        let mut mask = current;
        for r in regions.0..=regions.1 {
            if let Some(s) = self.regions.read_source(r, current) {
                if mask & stale(s) != 0 {
                    mask = stale(s);
                }
            }
        }
        mask
    }

    /// Regions where no usable leg is current now (every leg stale there, or the legs that
    /// are not on devices that failed or are resetting): nothing can be read there until a
    /// device comes back or an operator accepts a leg. How many, and the first few offsets.
    pub(crate) fn without_current(&self) -> (u64, Vec<u64>) {
        let (mut n, mut first) = (0, Vec::new());
        for r in self.regions_without_current() {
            n += 1;
            if first.len() < 16 {
                first.push(self.region_range(r).0);
            }
        }
        (n, first)
    }

    /// The regions of [`Shared::without_current`], in order.
    pub(crate) fn regions_without_current(&self) -> impl Iterator<Item = usize> + '_ {
        let healthy = self.healthy();
        (0..self.regions.bitmap.regions()).filter(move |&r| {
            let (off, len) = self.region_range(r);
            self.current(healthy, off, len, (r, r)) == 0
        })
    }

    /// Volume byte range of region `r`.
    pub(crate) fn region_range(&self, r: usize) -> (u64, u64) {
        let off = (r as u64) << self.regions.shift;
        let len = (1u64 << self.regions.shift).min(self.spec.size.saturating_sub(off));
        (off, len)
    }
}
