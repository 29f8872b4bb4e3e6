//! Thin maps moved off a device leaving the pool (`device replace`, docs/thin.md): a thin
//! volume's own map, or a snapshot's, is written whole to new extents on the other devices
//! from the running volume's memory (so a failed device's map is not read), and the table
//! is committed naming them while the volume's allocator holds every map change (spool-thin's
//! `relocate.rs`). A crash before the commit finds the old table and the old map, after it
//! the new ones; a commit that failed part way leaves the allocator writing both copies of a
//! volume's map (a snapshot's is then written by nothing until a restart), so either table
//! read at the next start finds its map whole.
//!
//! Owns: choosing the new extents and the commit. Must not know: the map's format.

use uuid::Uuid;

use crate::metadata::ExtentEntry;
use crate::{Error, Pool, Result};

/// A map of a thin volume: its own (None) or its snapshot's at that index.
type Which = Option<usize>;

impl Pool {
    /// Moves every thin map (a volume's own or a snapshot's) lying (in part) on `old` to new
    /// extents elsewhere, each in a commit of its own; returns the volumes moved.
    pub(crate) fn move_thin_maps_off(&mut self, old: Uuid) -> Result<Vec<String>> {
        let on = |m: &[ExtentEntry]| m.iter().any(|e| e.device == old);
        let mut maps: Vec<(usize, Which)> = Vec::new();
        for (i, v) in self.table.volumes.iter().enumerate() {
            let Some(t) = &v.thin else { continue };
            if on(&t.map) {
                maps.push((i, None));
            }
            let snaps = t.snapshots.iter().enumerate();
            maps.extend(snaps.filter(|(_, s)| on(&s.map)).map(|(k, _)| (i, Some(k))));
        }
        let mut moved = Vec::new();
        for (i, which) in maps {
            self.move_thin_map(i, which, old)?;
            let name = &self.table.volumes[i].name;
            if !moved.contains(name) {
                moved.push(name.clone());
            }
        }
        Ok(moved)
    }

    fn move_thin_map(&mut self, i: usize, which: Which, old: Uuid) -> Result<()> {
        let v = self.table.volumes[i].clone();
        let t = v.thin.as_ref().expect("a thin volume");
        let (map, snapshot) = match which {
            None => (&t.map, None),
            Some(k) => (&t.snapshots[k].map, Some(&t.snapshots[k])),
        };
        let what = match snapshot {
            None => v.name.clone(),
            Some(s) => format!("{}@{}", v.name, s.name),
        };
        let dev = self.thin_device(&v)?;
        let backend = crate::snapshots::thin_backend(&v, &dev)?;
        let bytes: u64 = (map.iter()).map(|e| self.table.min_extent << e.order).sum();
        let new = self.allocate_off(bytes, Some(old))?;
        let store = self.scrub(&new).and_then(|()| self.map_store(&v, &new));
        let moving = store.map(|s| backend.move_map(snapshot.map(|s| s.uuid), s));
        let thin_err = |e: spool_thin::Error| Error::Thin {
            volume: what.clone(),
            why: e.to_string(),
        };
        let moving = match moving {
            Ok(Ok(m)) => m,
            Ok(Err(e @ spool_thin::Error::RelocateAbandoned(_))) => {
                // The allocator may still write there: the extents stay taken until a
                // restart.
                tracing::error!(map = %what, "moving a thin map timed out while it was being copied; its new extents stay taken until spoold restarts");
                self.hold_until_restart(v.uuid, new);
                return Err(thin_err(e));
            }
            Ok(Err(e)) => {
                self.release(&new);
                return Err(thin_err(e));
            }
            Err(e) => {
                self.release(&new);
                return Err(e);
            }
        };
        let mut table = self.table.clone();
        if let Some(t) = table.volumes[i].thin.as_mut() {
            match which {
                None => t.map = new.clone(),
                Some(k) => t.snapshots[k].map = new.clone(),
            }
        }
        match self.commit(table) {
            Ok(()) => {
                moving.recorded();
                self.release(map);
                tracing::info!(map = %what, from = %old, "thin map moved off the device");
                Ok(())
            }
            Err(e) => {
                // Either table may be read at the next start: both copies are kept whole,
                // and the new extents stay taken until then.
                moving.unsure();
                tracing::error!(map = %what, error = %e, "moving a thin map: the table's commit failed; both copies are kept until spoold restarts");
                self.hold_until_restart(v.uuid, new);
                Err(e)
            }
        }
    }
}
