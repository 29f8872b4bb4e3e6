//! Thin volumes' maps moved off a device leaving the pool (`device replace`, docs/thin.md):
//! the map is written whole to new extents on the other devices from the running volume's
//! memory (so a failed device's map is not read), and the table is committed naming them
//! while the volume's allocator holds every map change (spool-thin's `relocate.rs`). A crash
//! before the commit finds the old table and the old map, after it the new ones; a commit
//! that failed part way leaves the allocator writing both maps, so either table read at the
//! next start finds its map whole.
//!
//! Owns: choosing the new extents and the commit. Must not know: the map's format.

use uuid::Uuid;

use crate::{Error, Pool, Result};

impl Pool {
    /// Moves the map of every thin volume keeping its own map (in part) on `old` to new
    /// extents elsewhere, each in a commit of its own; returns the volumes moved.
    pub(crate) fn move_thin_maps_off(&mut self, old: Uuid) -> Result<Vec<String>> {
        let on_old: Vec<usize> = (self.table.volumes.iter().enumerate())
            .filter(|(_, v)| {
                (v.thin.as_ref()).is_some_and(|t| t.map.iter().any(|e| e.device == old))
            })
            .map(|(i, _)| i)
            .collect();
        let mut moved = Vec::new();
        for i in on_old {
            self.move_thin_map(i, old)?;
            moved.push(self.table.volumes[i].name.clone());
        }
        Ok(moved)
    }

    fn move_thin_map(&mut self, i: usize, old: Uuid) -> Result<()> {
        let v = self.table.volumes[i].clone();
        let t = v.thin.as_ref().expect("a thin volume");
        let dev = self.thin_device(&v)?;
        let backend = crate::snapshots::thin_backend(&v, &dev)?;
        let bytes: u64 = (t.map.iter())
            .map(|e| self.table.min_extent << e.order)
            .sum();
        let new = self.allocate_off(bytes, Some(old))?;
        let moving = self
            .scrub(&new)
            .and_then(|()| self.map_store(&v, &new))
            .and_then(|store| {
                backend.move_map(store).map_err(|e| Error::Thin {
                    volume: v.name.clone(),
                    why: e.to_string(),
                })
            });
        let moving = match moving {
            Ok(m) => m,
            Err(e) => {
                self.release(&new);
                return Err(e);
            }
        };
        let mut table = self.table.clone();
        if let Some(t) = table.volumes[i].thin.as_mut() {
            t.map = new;
        }
        match self.commit(table) {
            Ok(()) => {
                moving.recorded();
                self.release(&t.map);
                tracing::info!(volume = %v.name, from = %old, "thin volume's map moved off the device");
                Ok(())
            }
            Err(e) => {
                // Either table may be read at the next start: both maps are kept whole, and
                // the new extents stay taken until then.
                moving.unsure();
                tracing::error!(volume = %v.name, error = %e, "moving the thin volume's map: the table's commit failed; its map is written to both places until spoold restarts");
                Err(e)
            }
        }
    }
}
