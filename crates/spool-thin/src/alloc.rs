//! The allocator thread of one thin volume: chunks for writes to holes, holes for discards
//! of whole chunks, each change durable in the map before anyone sees it.
//!
//! Allocating a chunk: take it from the pool, zero it on its device (durably), write the map
//! block holding its entry (durably), then publish the entry to the queues and wake the
//! requests waiting for it. A crash before the map write leaves the chunk free (the pool
//! rebuilds its free space from the maps at start); after it, the chunk is the volume's and
//! reads zeroes where nothing was written. Unmapping: clear the entries in memory, write the
//! map blocks, answer the request, and give the chunks back once the grace period that
//! started after the clearing has drained (checked every few milliseconds, never waited
//! for: a queue of this volume whose I/O never completes keeps every chunk the volume unmaps
//! from then on from going back, until a restart, but allocation goes on).
//!
//! A map block whose write failed may or may not be on the device: memory keeps the new
//! state (an allocation stays unpublished, an unmap stays a hole), the requests fail with
//! `EIO`, and the block is marked unsure with the chunks the device may name in it (held,
//! not given back). The next successful write of that block, with whatever changes it then
//! carries (an unmap over it writes it even when memory has nothing to clear, and so does a
//! write-zeroes over part of a hole in it), makes device and memory agree again and gives
//! back the held chunks it does not name.
//!
//! When the pool is full, a write waits up to `full_wait` from when it asked (discards are
//! still served meanwhile: they are what frees space) and then fails with `ENOSPC`.
//!
//! Owns: the thread and what it does. Must not know: virtio, the pool table.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spool_devices::{Device, ErrorReport, Signal};

use crate::map::{self, Placement, BLOCK_BYTES, ENTRY_BYTES};
use crate::shared::{CrashPoint, Mailbox, Note, Shared, Unmap};
use crate::Error;

/// Dies here when a test armed this point (nothing in other builds).
#[inline]
pub(crate) fn crash_point(s: &Shared, at: CrashPoint) {
    #[cfg(test)]
    if *s.crash_at.lock().unwrap_or_else(|p| p.into_inner()) == Some(at) {
        panic!("thin allocator: test crash point {at:?}");
    }
    #[cfg(not(test))]
    let _ = (s, at);
}

/// How often chunks waiting for their grace period are checked.
const RETIRE_POLL: Duration = Duration::from_millis(2);

/// Starts the thread of `shared`; it ends when the backend shuts down.
pub(crate) fn start(shared: &Arc<Shared>) -> std::io::Result<std::thread::JoinHandle<()>> {
    let s = shared.clone();
    std::thread::Builder::new()
        .name("spool-thin".into())
        .spawn(move || {
            Allocator {
                s: &s,
                buf: Vec::new(),
            }
            .run()
        })
}

pub(crate) struct Allocator<'a> {
    pub(crate) s: &'a Shared,
    /// Where a shared chunk is copied through.
    pub(crate) buf: Vec<u8>,
}

impl Allocator<'_> {
    fn run(&mut self) {
        loop {
            let work = {
                let mut w = self.s.work.lock().unwrap_or_else(|p| p.into_inner());
                while w.is_empty() && !self.s.stopping() {
                    let idle = match self.s.retiring() {
                        true => RETIRE_POLL,
                        false => Duration::from_secs(1),
                    };
                    let (g, timeout) = self
                        .s
                        .wake
                        .wait_timeout(w, idle)
                        .unwrap_or_else(|p| p.into_inner());
                    w = g;
                    if timeout.timed_out() {
                        break;
                    }
                }
                std::mem::take(&mut *w)
            };
            if self.s.stopping() {
                // Chunks still in their grace period stay taken (`Shared::retire`: the pool
                // gives them back with the rest when the volume is deleted; a restart
                // rebuilds free space from the map).
                fail_all(work);
                return;
            }
            self.unmap(work.unmaps);
            for reply in work.snapshots {
                if let Err(unsent) = reply.answer(self.take_snapshot()) {
                    // The caller gave up waiting and recorded nothing: the snapshot's names
                    // go again (exactly once: `Handoff`).
                    for (_, p) in unsent.unwrap_or_default() {
                        if self.s.source.shared_chunks().release(p) {
                            self.s.source.give_back(p.device, p.offset);
                        }
                    }
                }
            }
            for (entries, reply) in work.reverts {
                let _ = reply.send(self.revert(&entries));
            }
            for (device, reply) in work.evictions {
                let _ = reply.send(self.evict(device));
            }
            for r in work.relocations {
                self.relocate(r);
            }
            self.allocate(work.allocs);
            self.retire_drained();
        }
    }

    /// Lets go of what drained (a chunk no other map names goes back to the pool), and
    /// starts the next grace period.
    pub(crate) fn retire_drained(&mut self) {
        let mut r = self.s.retire.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((phase, _)) = &r.waiting {
            if !self.s.grace.drained(*phase) {
                return;
            }
            let (_, chunks) = r.waiting.take().expect("checked above");
            for p in chunks {
                if self.s.source.shared_chunks().release(p) {
                    self.s.source.give_back(p.device, p.offset);
                }
            }
        }
        if !r.next.is_empty() {
            let chunks = std::mem::take(&mut r.next);
            r.waiting = Some((self.s.grace.flip(), chunks));
        }
    }

    /// Allocates every chunk asked for that is still a hole.
    fn allocate(&mut self, allocs: Vec<(u64, Arc<Mailbox>, Instant)>) {
        let mut want: BTreeMap<u64, (Vec<Arc<Mailbox>>, Instant)> = BTreeMap::new();
        for (c, m, at) in allocs {
            let e = want.entry(c).or_insert_with(|| (Vec::new(), at));
            e.0.push(m);
            e.1 = e.1.min(at);
        }
        let mut fresh = Vec::new();
        let mut copied = Vec::new();
        // Chunks whose requesters were told already (failed, or nothing to copy).
        let mut answered = std::collections::HashSet::new();
        for (n, (&c, (boxes, asked))) in want.iter().enumerate() {
            // While the pool is full, the chunks asked for and not served yet wait.
            let left = (want.len() - n) as u64;
            let deadline = *asked + self.s.spec.full_wait;
            let stamp = self.s.map.stamp(c);
            let got = match self.s.map.get(c) {
                _ if self.s.map.get_for_write(c).is_some() => continue,
                None if boxes.iter().all(|m| m.copy_only) => {
                    // Unmapped since an inflate asked: nothing to copy, and no space taken.
                    for m in boxes {
                        m.post(Some(Note::Mapped { chunk: c }));
                    }
                    answered.insert(c);
                    continue;
                }
                None => self.take_zeroed(deadline, left),
                Some(old) => match self.unshare(c, old, deadline, left) {
                    Ok(Some(new)) => {
                        copied.push((c, old));
                        Ok(new)
                    }
                    Ok(None) => continue,
                    Err(e) => Err(e),
                },
            };
            match got {
                Ok(p) => fresh.push((c, Some(p), stamp)),
                Err(errno) => {
                    post_failed(boxes, c, errno);
                    answered.insert(c);
                }
            }
        }
        // Waiting for space serves unmaps: an entry unmapped (or changed) since it was
        // looked at keeps what it is now, and its new chunk goes back (its writers ask again).
        let (fresh, dropped) = self.drop_changed(fresh);
        copied.retain(|(c, _)| !dropped.contains(c));
        if !fresh.is_empty() {
            crash_point(self.s, CrashPoint::Zeroed);
        }
        let failed = persist(self.s, &fresh);
        if !fresh.is_empty() {
            crash_point(self.s, CrashPoint::MapWritten);
        }
        for &(c, p) in &fresh {
            if failed.contains(&map::block_of(c)) {
                // Maybe on the device: the chunk stays taken (see the module doc) until the
                // block's next successful write.
                post_failed(&want[&c].0, c, -libc::EIO);
                answered.insert(c);
                hold(self.s, c, p.and_then(|(d, off)| self.s.placement(d, off)));
            } else {
                self.s.map.set(c, p);
            }
        }
        self.s.source.settled(fresh.len());
        self.s.waiting_for_space.store(0, Ordering::Relaxed);
        // The chunks copied from are let go once no request that read the old entry is left.
        let mut r = self.s.retire.lock().unwrap_or_else(|p| p.into_inner());
        for (c, (d, off)) in copied {
            if !failed.contains(&map::block_of(c)) {
                r.next.extend(self.s.placement(d, off));
            }
        }
        drop(r);
        self.batch_done();
        answer_the_rest(&want, &answered);
    }

    /// Ends a batch: every chunk taken in it is published, given back, or (a failed map
    /// write) left taken until a restart decides.
    fn batch_done(&self) {
        (self.s.in_hand.lock())
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Splits new chunks into those whose entry is still what it was when they were taken
    /// for it (`stamp`) and those whose entry changed meanwhile: the latter go back to the
    /// pool, and their chunk indexes are returned.
    fn drop_changed(&mut self, fresh: Vec<Stamped>) -> (Vec<Change>, Vec<u64>) {
        let (mut keep, mut dropped) = (Vec::new(), Vec::new());
        for (c, p, stamp) in fresh {
            if self.s.map.stamp(c) == stamp {
                keep.push((c, p));
                continue;
            }
            if let Some(pl) = p.and_then(|(d, off)| self.s.placement(d, off)) {
                self.s.source.give_back(pl.device, pl.offset);
            }
            self.s.source.settled(1);
            dropped.push(c);
        }
        (keep, dropped)
    }

    /// A chunk from the pool, zeroed durably; waits for free space until `deadline`,
    /// serving unmaps and giving chunks back meanwhile.
    fn take_zeroed(&mut self, deadline: Instant, left: u64) -> Result<(usize, u64), i32> {
        self.take_filled(deadline, left, &mut |dev, off, len| {
            dev.zero_range(off, len)
        })
    }

    /// A chunk from the pool, written durably by `fill` (zeroes, or a copy); see
    /// [`Allocator::take_zeroed`].
    pub(crate) fn take_filled(
        &mut self,
        deadline: Instant,
        left: u64,
        fill: &mut dyn FnMut(&Device, u64, u64) -> spool_devices::Result<()>,
    ) -> Result<(usize, u64), i32> {
        let s = self.s;
        let mut waited = false;
        let got = loop {
            if let Some(got) = s.source.take() {
                break Ok(got);
            }
            if s.stopping() {
                break Err(-libc::ENOMEDIUM);
            }
            if Instant::now() >= deadline {
                tracing::error!(volume = %s.spec.path.display(), waited_ms = s.spec.full_wait.as_millis() as u64, "the pool is full: failing a write to an unallocated chunk of a thin volume (add a device, or free space)");
                break Err(-libc::ENOSPC);
            }
            if !waited {
                waited = true;
                s.waiting_for_space.store(left, Ordering::Relaxed);
                tracing::warn!(volume = %s.spec.path.display(), wait_ms = s.spec.full_wait.as_millis() as u64, "the pool is full: a write to an unallocated chunk of a thin volume waits for free space");
            }
            let unmaps =
                std::mem::take(&mut s.work.lock().unwrap_or_else(|p| p.into_inner()).unmaps);
            if unmaps.is_empty() {
                std::thread::sleep(RETIRE_POLL);
            }
            self.unmap(unmaps);
            self.retire_drained();
        };
        if waited {
            s.waiting_for_space
                .store(left.saturating_sub(1), Ordering::Relaxed);
        }
        let (uuid, dev, off) = got?;
        let placement = Placement {
            device: uuid,
            offset: off,
        };
        s.in_hand
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(placement);
        crash_point(s, CrashPoint::Taken);
        if let Err(e) = fill(&dev, off, s.spec.chunk) {
            tracing::error!(volume = %s.spec.path.display(), error = %e, "writing a new chunk (zeroes, or a copy) failed");
            report(&dev, off, s.spec.chunk);
            s.in_hand
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|p| *p != placement);
            s.source.give_back(uuid, off);
            s.source.settled(1);
            return Err(-libc::EIO);
        }
        Ok((s.device_index(uuid, &dev), off))
    }

    /// Unmaps every chunk asked for; their chunks go back after the grace period.
    fn unmap(&mut self, unmaps: Vec<Unmap>) {
        if unmaps.is_empty() {
            return;
        }
        let s = self.s;
        let mut old = Vec::new();
        let mut holes: Vec<Change> = Vec::new();
        let unsure = s
            .unsure_blocks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for u in &unmaps {
            let end = u.end.min(s.chunks());
            for c in u.first..end {
                if let Some(p) = s.map.get(c) {
                    s.map.set(c, None);
                    old.push((c, p));
                    holes.push((c, None));
                }
            }
            // A block of the range whose last write failed may still name what memory has
            // cleared (an earlier try of this very unmap, answered EIO), or a hole a
            // write-zeroes covers in part: written again, so that this answer means the
            // holes are on the device.
            let (first, end) = (u.confirm.start, u.confirm.end.min(s.chunks()));
            if first < end {
                for &b in unsure
                    .range(map::block_of(first)..=map::block_of(end - 1))
                    .map(|(b, _)| b)
                {
                    let c = map::block_entries(b, s.map.capacity())
                        .find(|&c| (first..end).contains(&c) && s.map.get(c).is_none());
                    if let Some(c) = c {
                        holes.push((c, None));
                    }
                }
            }
        }
        crash_point(s, CrashPoint::Cleared);
        let failed = persist(s, &holes);
        crash_point(s, CrashPoint::HolesWritten);
        let mut r = s.retire.lock().unwrap_or_else(|p| p.into_inner());
        for &(c, (d, off)) in &old {
            // A block whose write failed keeps its chunks taken (see the module doc) until
            // its next successful write.
            match failed.contains(&map::block_of(c)) {
                false => r.next.extend(s.placement(d, off)),
                true => hold(s, c, s.placement(d, off)),
            }
        }
        drop(r);
        for u in unmaps {
            let bad = (u.confirm.clone()).any(|c| failed.contains(&map::block_of(c)));
            u.mailbox.post(Some(Note::Unmapped {
                token: u.token,
                errno: if bad { -libc::EIO } else { 0 },
            }));
        }
    }
}

/// Whether chunk `c`'s map block's last write failed.
pub(crate) fn unsure(s: &Shared, c: u64) -> bool {
    let unsure = s.unsure_blocks.lock().unwrap_or_else(|p| p.into_inner());
    !unsure.is_empty() && unsure.contains_key(&map::block_of(c))
}

/// The map blocks whose last write failed.
pub(crate) fn unsure_blocks(s: &Shared) -> std::collections::BTreeSet<u64> {
    let unsure = s.unsure_blocks.lock().unwrap_or_else(|p| p.into_inner());
    unsure.keys().copied().collect()
}

/// Holds `chunk`'s placement `p` (one the device may name in the block of `chunk`, whose
/// write failed) until that block's next successful write (`persist`).
pub(crate) fn hold(s: &Shared, chunk: u64, p: Option<Placement>) {
    let mut unsure = s.unsure_blocks.lock().unwrap_or_else(|p| p.into_inner());
    unsure.entry(map::block_of(chunk)).or_default().extend(p);
}

/// Tells every requester of `want` not `answered` yet to look again: its chunk is mapped
/// now, or its new chunk went back (`drop_changed`), or it was skipped as mapped and has been
/// unmapped since (a whole-chunk discard served while the batch waited for space). Whoever
/// still finds a hole asks again; one left unanswered would never ask again (a queue asks
/// once until answered) and its parked write would wait for ever.
fn answer_the_rest<T>(
    want: &BTreeMap<u64, (Vec<Arc<Mailbox>>, T)>,
    answered: &std::collections::HashSet<u64>,
) {
    for (&chunk, (boxes, _)) in want {
        if !answered.contains(&chunk) {
            for m in boxes {
                m.post(Some(Note::Mapped { chunk }));
            }
        }
    }
}

fn post_failed(boxes: &[Arc<Mailbox>], chunk: u64, errno: i32) {
    for m in boxes {
        m.post(Some(Note::Failed { chunk, errno }));
    }
}

/// The backend is shutting down: every request waiting fails (not held: the volume is going
/// away).
fn fail_all(work: crate::shared::Work) {
    for (chunk, m, _) in work.allocs {
        post_failed(&[m], chunk, -libc::ENOMEDIUM);
    }
    let down = || "the volume is shutting down".to_string();
    for reply in work.snapshots {
        let _ = reply.answer(Err(Error::Snapshot(down())));
    }
    for (_, reply) in work.reverts {
        let _ = reply.send(Err(Error::Snapshot(down())));
    }
    for (_, reply) in work.evictions {
        let _ = reply.send(Err(Error::Evict(down())));
    }
    for u in work.unmaps {
        u.mailbox.post(Some(Note::Unmapped {
            token: u.token,
            errno: -libc::ENOMEDIUM,
        }));
    }
}

/// Tells a pool device's health cell that metadata I/O on it failed.
fn report(dev: &Device, offset: u64, len: u64) {
    dev.health().report(ErrorReport {
        signal: Signal::Errno(libc::EIO),
        offset,
        len,
        write: true,
    });
}

/// A map change: chunk, and its new device index and offset (`None`: a hole).
type Change = (u64, Option<(usize, u64)>);

/// A change, and the entry as it was when the allocator looked ([`ChunkMap::stamp`]).
///
/// [`ChunkMap::stamp`]: crate::map::ChunkMap::stamp
type Stamped = (u64, Option<(usize, u64)>, u64);

/// Writes the map blocks holding `changes` (other entries as the table has them); returns
/// the blocks that could not be written.
pub(crate) fn persist(s: &Shared, changes: &[Change]) -> Vec<u64> {
    let mut blocks: BTreeMap<u64, Vec<Change>> = BTreeMap::new();
    for &(c, p) in changes {
        blocks.entry(map::block_of(c)).or_default().push((c, p));
    }
    let mut failed = Vec::new();
    let mut buf = vec![0u8; BLOCK_BYTES as usize];
    // Every place the map is written to (two while a move was not recorded for sure): a
    // block counts as written only when all of them took it (one that failed may still be
    // in some: as after any failed write, its chunks are never given back).
    let places = s.map_places.lock().unwrap_or_else(|p| p.into_inner());
    for (b, ch) in blocks {
        for i in map::block_entries(b, s.map.capacity()) {
            let p = ch
                .iter()
                .find(|x| x.0 == i)
                .map_or_else(|| s.map.get(i), |x| x.1);
            let at = ((i % (BLOCK_BYTES / ENTRY_BYTES)) * ENTRY_BYTES) as usize;
            let e = map::encode(s.spec.volume, i, p.and_then(|(d, o)| s.placement(d, o)));
            buf[at..at + ENTRY_BYTES as usize].copy_from_slice(&e);
        }
        let mut ok = true;
        for store in places.iter() {
            if let Err(e) = store.write_block(b, &buf) {
                ok = false;
                tracing::error!(volume = %s.spec.path.display(), block = b, error = %e, "writing the thin volume's map failed");
                if let Some((dev, off)) = store.locate(b * BLOCK_BYTES) {
                    report(dev, off, BLOCK_BYTES);
                }
                failed.push(b);
                break;
            }
        }
        let mut unsure = s.unsure_blocks.lock().unwrap_or_else(|p| p.into_inner());
        match ok {
            true => {
                // Written whole: the chunks held for it that it does not name go back (after
                // a grace period: a failed unmap's chunk was readable).
                let held = unsure.remove(&b).unwrap_or_default();
                drop(unsure);
                let named: Vec<Placement> = map::block_entries(b, s.map.capacity())
                    .filter_map(|i| {
                        let p = ch
                            .iter()
                            .find(|x| x.0 == i)
                            .map_or_else(|| s.map.get(i), |x| x.1);
                        p.and_then(|(d, o)| s.placement(d, o))
                    })
                    .collect();
                let back: Vec<Placement> =
                    held.into_iter().filter(|p| !named.contains(p)).collect();
                if !back.is_empty() {
                    (s.retire.lock().unwrap_or_else(|p| p.into_inner()))
                        .next
                        .extend(back);
                }
            }
            false => {
                unsure.entry(b).or_default();
            }
        }
        buf.fill(0);
    }
    failed
}
