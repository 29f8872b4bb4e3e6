//! Snapshots and copy on write, the allocator's side.
//!
//! Taking a snapshot: the allocator lets the previous grace period end, marks every mapped
//! chunk shared (counting the snapshot's map as one more name of it in [`SharedChunks`]),
//! starts a grace period and waits until every request that read the map before the marks
//! has completed. From then on the chunks hold exactly what every request completed before
//! the snapshot wrote, and no later write reaches them: a write to a shared chunk waits
//! (parked, as one to a hole does) until the allocator has copied the chunk to a new one,
//! written the new entry durably and published it. The snapshot's map is then written and
//! recorded by the caller, while the volume goes on ([`ThinBackend::snapshot`]).
//!
//! The stall a snapshot costs writes is the marking (one pass over the table in memory) and
//! the drain of the requests in flight; the first write to each chunk after it pays a copy
//! of the chunk.
//!
//! Owns: marking, the drain, copying a shared chunk. Must not know: the pool, virtio.
//!
//! [`SharedChunks`]: crate::SharedChunks
//! [`ThinBackend::snapshot`]: crate::ThinBackend::snapshot

use std::time::{Duration, Instant};

use spool_devices::Device;

use crate::alloc::Allocator;
use crate::map::Placement;
use crate::shared::CrashPoint;
use crate::Error;

/// How long a snapshot waits for the requests in flight before it (a device holding its
/// requests through a reset): past it the snapshot fails and nothing is recorded.
pub(crate) const DRAIN_WAIT: Duration = Duration::from_secs(5);

impl Allocator<'_> {
    /// Marks every mapped chunk shared and waits until no request that could write to it
    /// without a copy is left; returns the chunks the snapshot names.
    pub(crate) fn take_snapshot(&mut self) -> Result<Vec<(u64, Placement)>, Error> {
        let s = self.s;
        let deadline = Instant::now() + DRAIN_WAIT;
        let late = || {
            Error::Snapshot(format!(
                "requests on the volume did not complete within {} s (is a device resetting?)",
                DRAIN_WAIT.as_secs()
            ))
        };
        // One grace period at a time: the one of chunks let go before ends first.
        while s.retiring() {
            self.retire_drained();
            if Instant::now() >= deadline {
                return Err(late());
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        let refs = s.source.shared_chunks();
        let mut entries = Vec::new();
        for (c, d, off) in s.map.entries() {
            if let Some(p) = s.placement(d, off) {
                refs.add(p);
                s.map.mark_shared(c);
                entries.push((c, p));
            }
        }
        crate::alloc::crash_point(s, CrashPoint::Marked);
        let phase = s.grace.flip();
        while !s.grace.drained(phase) {
            if Instant::now() >= deadline {
                // The marks stay (a write then finds the chunk named once and only clears
                // its mark). The phase still has requests on devices: the next grace period
                // starts only once it drained (one at a time, grace.rs).
                for &(_, p) in &entries {
                    refs.release(p);
                }
                let mut r = s.retire.lock().unwrap_or_else(|p| p.into_inner());
                r.waiting = Some((phase, Vec::new()));
                return Err(late());
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        Ok(entries)
    }

    /// Makes the volume's map name exactly `entries` (a snapshot's: chunk index, where),
    /// each marked shared; the chunks it named before are let go after the grace period.
    /// Written durably block by block: a crash in between leaves the volume partly reverted
    /// (the operator runs it again). A block whose write failed is taken as reverted in
    /// memory all the same (what the device holds may be either): its old chunks are held
    /// until its next successful write (alloc.rs), which the first write to one of its
    /// chunks makes (they are marked shared) and so does running the revert again. Memory
    /// keeping the old entries instead would let writes land in place in chunks a restart
    /// could find unnamed. Returns how many entries changed.
    pub(crate) fn revert(&mut self, entries: &[(u64, Placement)]) -> Result<u64, Error> {
        let s = self.s;
        let want: std::collections::HashMap<u64, Placement> = entries.iter().copied().collect();
        let refs = s.source.shared_chunks();
        let unsure = crate::alloc::unsure_blocks(s);
        let mut changes = Vec::new();
        for c in 0..s.chunks() {
            let now = s.map.get(c).and_then(|(d, off)| s.placement(d, off));
            let to = want.get(&c).copied();
            // A block whose last write failed is written again even where memory agrees.
            if now == to && !unsure.contains(&crate::map::block_of(c)) {
                continue;
            }
            let to = match to {
                Some(p) => {
                    let d = s.device_of(p.device).ok_or_else(|| {
                        Error::Revert(format!(
                            "the snapshot's chunk {c} is on device {}, not in the pool",
                            p.device
                        ))
                    })?;
                    Some((d, p.offset))
                }
                None => None,
            };
            changes.push((c, to, now));
        }
        let change: Vec<(u64, Option<(usize, u64)>)> = changes.iter().map(|x| (x.0, x.1)).collect();
        let failed = crate::alloc::persist(s, &change);
        let mut r = s.retire.lock().unwrap_or_else(|p| p.into_inner());
        let mut done = 0;
        for (c, to, now) in changes {
            let to_p = to.map(|(d, off)| s.placement(d, off).expect("indexed above"));
            if to_p == now {
                continue; // An unsure block's entry written again.
            }
            if let Some(p) = to_p {
                refs.add(p);
            }
            // One store: no write may find the snapshot's chunk unmarked.
            s.map.set_shared(c, to);
            match failed.contains(&crate::map::block_of(c)) {
                // The device may still name it: held until the block's next good write.
                true => crate::alloc::hold(s, c, now),
                false => r.next.extend(now),
            }
            done += 1;
        }
        match failed.is_empty() {
            true => Ok(done),
            false => Err(Error::Revert(format!(
                "{} map blocks could not be written; run it again",
                failed.len()
            ))),
        }
    }

    /// Chunk `c`, marked shared at `old` (device index, offset): when another map still
    /// names it, a new chunk holding a durable copy of it (`Ok(Some)`: its entry is then
    /// written and published like a new chunk's, and `old` let go after a grace period);
    /// when none does any more, its mark is cleared (`Ok(None)`).
    pub(crate) fn unshare(
        &mut self,
        c: u64,
        old: (usize, u64),
        deadline: Instant,
        left: u64,
    ) -> Result<Option<(usize, u64)>, i32> {
        let s = self.s;
        let Some(p) = s.placement(old.0, old.1) else {
            return Err(-libc::EIO);
        };
        if !s.source.shared_chunks().is_shared(p) {
            // Its block's last write failed: the device may name another chunk there (a
            // revert failed part way), so the block is written before writes land in place.
            let b = crate::map::block_of(c);
            if crate::alloc::unsure_blocks(s).contains(&b)
                && !crate::alloc::persist(s, &[(c, Some(old))]).is_empty()
            {
                return Err(-libc::EIO);
            }
            s.map.set(c, Some(old));
            return Ok(None);
        }
        let src = s.device(old.0).ok_or(-libc::ENOMEDIUM)?;
        let mut buf = std::mem::take(&mut self.buf);
        buf.resize(s.spec.chunk as usize, 0);
        let got = self.take_filled(deadline, left, &mut |dev: &Device, off, len| {
            src.read_at(&mut buf[..len as usize], old.1)?;
            dev.write_at_durable(&buf[..len as usize], off)
        });
        self.buf = buf;
        let new = got?;
        crate::alloc::crash_point(s, CrashPoint::Copied);
        Ok(Some(new))
    }
}
