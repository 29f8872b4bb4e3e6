//! Changing a volume's copies while it serves: adding a leg (a plain volume becomes a
//! mirror), removing one (a mirror of one copy becomes plain again), and moving the pieces of
//! legs that sit on an isolated device to free space on other devices. A new or moved leg is
//! not synced: the mirror rebuilds it, and reads never go to it until it is current.
//!
//! Owns: the table side of those changes. Must not know: how the rebuild copies.

use crate::metadata::{ExtentEntry, LegEntry, VolumeEntry};
use crate::mirror::MAX_COPIES;
use crate::{Error, Pool, Result, VolumeInfo};

/// What `relocate_failed_legs` did to one volume.
#[derive(Debug, Clone)]
pub struct Relocated {
    pub volume: String,
    pub leg: u8,
    pub extents: usize,
}

impl Pool {
    /// Adds a copy to volume `id` (a plain volume becomes a 2-way mirror), allocated on
    /// devices none of its other copies uses at the same range; it is rebuilt online.
    pub fn add_leg(&mut self, id: &str) -> Result<VolumeInfo> {
        let i = self.find(id)?;
        let mut v = self.table.volumes[i].clone();
        if v.thin.is_some() {
            return self.add_thin_copies(i);
        }
        v.make_mirrored();
        if v.legs.len() >= MAX_COPIES as usize {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' already has {} copies (at most {MAX_COPIES})",
                v.name,
                v.legs.len()
            )));
        }
        self.check_copies(v.legs.len() as u8 + 1)?;
        let bytes = self.round_up(v.size)?;
        let others: Vec<&[ExtentEntry]> = v.legs.iter().map(|l| l.extents.as_slice()).collect();
        let extents = self.allocate_leg(0, bytes, &others)?;
        let slot = (0..MAX_COPIES)
            .find(|s| !v.legs.iter().any(|l| l.slot == *s))
            .expect("fewer legs than slots");
        v.legs.push(LegEntry::local(slot, false, extents.clone()));
        v.copies = v.copies.max(v.legs.len() as u8);
        if self.table.volumes[i].is_mirrored() {
            // Nothing to prepare: the bitmap marks the new placement stale when it opens.
        } else if let Some(path) = self.bitmap_path(v.uuid) {
            if let Err(e) = spool_mirror::create_clean_bitmap(&path, bytes) {
                self.release(&extents);
                return Err(Error::InvalidArgument(format!(
                    "cannot create the write-intent bitmap {}: {e}",
                    path.display()
                )));
            }
        }
        self.replace_volume(i, v, &extents, &[])
    }

    /// Removes copy `slot` (default: a copy that is not current, else the newest) from
    /// volume `id`; the last synced copy is never removed. With one copy left the volume is
    /// plain again.
    pub fn remove_leg(&mut self, id: &str, slot: Option<u8>) -> Result<VolumeInfo> {
        // A copy a rebuild has just made current counts as complete.
        self.settle_mirrors()?;
        let i = self.find(id)?;
        let mut v = self.table.volumes[i].clone();
        Self::refuse_mirrored_thin(&v, "removing a copy")?;
        if !v.is_mirrored() {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' is not mirrored: it has one copy",
                v.name
            )));
        }
        // The live mirror knows which legs missed writes since (a leg marked synced in the
        // table may be stale in some regions after a transient failure): removing the only
        // current copy of a region would lose what the guest was told is written.
        let holds_alone = |slot: u8| {
            let cache = self.mirrors.lock().unwrap_or_else(|p| p.into_inner());
            cache
                .get(&v.uuid)
                .is_some_and(|(_, m)| m.only_current_in(spool_mirror::bitmap::stale(slot)))
        };
        let at = match slot {
            Some(s) => v.legs.iter().position(|l| l.slot == s).ok_or_else(|| {
                Error::InvalidArgument(format!("volume '{}' has no leg {s}", v.name))
            })?,
            // An unsynced leg first, then the last, of those that hold nothing alone.
            None => (v.legs.iter().enumerate())
                .filter(|(_, l)| !holds_alone(l.slot))
                .min_by_key(|&(i, l)| (l.synced, if l.synced { usize::MAX - i } else { i }))
                .map_or(v.legs.len() - 1, |(i, _)| i),
        };
        // A far copy's own reason first (it says what to do about the far host).
        self.check_remote_leg_removable(&v, v.legs[at].slot)?;
        if holds_alone(v.legs[at].slot) {
            return Err(Error::InvalidArgument(format!(
                "leg {} of volume '{}' holds the only current copy of some regions (the other legs missed writes there and are being rebuilt); remove it once `volume show` has the others current",
                v.legs[at].slot, v.name
            )));
        }
        let leg = v.legs.remove(at);
        if !v.legs.iter().any(|l| l.synced && l.remote.is_none()) {
            return Err(Error::InvalidArgument(format!(
                "leg {} holds the only complete copy of volume '{}'; add another copy first",
                leg.slot, v.name
            )));
        }
        if v.legs.len() == 1 {
            let last = v.legs.pop().expect("one leg");
            v.extents = last.extents;
            v.copies = 0;
        } else {
            v.copies = v.copies.saturating_sub(1).max(v.legs.len() as u8).max(2);
        }
        let uuid = v.uuid;
        if let Some(r) = &leg.remote {
            self.abort_remote(r.id);
        }
        let info = self.replace_volume(i, v, &[], &[])?;
        // Free once no queue writes the removed leg (the daemon says when).
        self.retire(uuid, leg.extents);
        Ok(info)
    }

    /// Commits `v` as volume `i`: on failure frees `allocated`; on success frees `freed`.
    pub(crate) fn replace_volume(
        &mut self,
        i: usize,
        v: VolumeEntry,
        allocated: &[ExtentEntry],
        freed: &[ExtentEntry],
    ) -> Result<VolumeInfo> {
        let mut table = self.table.clone();
        table.volumes[i] = v.clone();
        if let Err(e) = table
            .validate()
            .map_err(Error::invalid)
            .and_then(|_| self.commit(table))
        {
            self.release(allocated);
            return Err(e);
        }
        self.release(freed);
        if !v.is_mirrored() {
            self.drop_mirror(v.uuid);
        }
        tracing::info!(volume = %v.name, copies = v.legs.len().max(1), "volume copies changed");
        Ok(self.volume_info(&v))
    }

    /// Moves every leg piece that lies on an isolated (failed or removed) device to free space
    /// on another device that no other copy uses at that range; the moved legs are rebuilt.
    /// Volumes without such space stay degraded until a device is replaced or added.
    pub fn relocate_failed_legs(&mut self) -> Result<Vec<Relocated>> {
        let failed: Vec<_> = self
            .members
            .iter()
            .filter(|m| m.isolated())
            .map(|m| m.uuid)
            .collect();
        if failed.is_empty() {
            return Ok(Vec::new());
        }
        let min = self.table.min_extent;
        let mut table = self.table.clone();
        let (mut done, mut taken, mut freed) = (Vec::new(), Vec::new(), Vec::new());
        for v in table.volumes.iter_mut().filter(|v| v.is_mirrored()) {
            for li in 0..v.legs.len() {
                // Only while another copy here is complete: that is what the rebuild copies
                // from (a remote copy never is, and the table needs a complete one here).
                let local_synced =
                    |(j, l): (usize, &LegEntry)| j != li && l.synced && l.remote.is_none();
                if !v.legs.iter().enumerate().any(local_synced) {
                    continue;
                }
                let mut moved = 0;
                let mut at = 0;
                for ei in 0..v.legs[li].extents.len() {
                    let e = v.legs[li].extents[ei];
                    let len = min << e.order;
                    if failed.contains(&e.device) {
                        let others: Vec<&[ExtentEntry]> = v
                            .legs
                            .iter()
                            .enumerate()
                            .filter(|(j, _)| *j != li)
                            .map(|(_, l)| l.extents.as_slice())
                            .collect();
                        // One block of the same order, at the same logical offset.
                        if let Ok(new) = self.allocate_leg_exact(at, e.order, &others) {
                            v.legs[li].extents[ei] = new;
                            taken.push(new);
                            freed.push(e);
                            moved += 1;
                        }
                    }
                    at += len;
                }
                if moved > 0 {
                    v.legs[li].synced = false;
                    done.push(Relocated {
                        volume: v.name.clone(),
                        leg: v.legs[li].slot,
                        extents: moved,
                    });
                }
            }
        }
        if done.is_empty() {
            return Ok(done);
        }
        if let Err(e) = self.commit(table) {
            self.release(&taken);
            return Err(e);
        }
        // The failed device's blocks are freed in its allocator (nothing allocates there).
        self.release(&freed);
        for r in &done {
            tracing::warn!(volume = %r.volume, leg = r.leg, extents = r.extents, "mirror leg moved off a failed device; rebuilding it online");
        }
        Ok(done)
    }
}
