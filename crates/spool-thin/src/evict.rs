//! A device leaving the pool under a thin volume (`device replace`): the chunks on it are
//! lost, as a thick volume's extents on a replaced device are. Every entry naming one, in
//! the volume's map and in its snapshots', becomes a hole (it reads zeroes; the next write
//! there takes a new chunk), written durably, and the names are released from the sharing
//! counts. Done by the allocator thread, so no allocation or copy races it.
//!
//! Owns: clearing the entries. Must not know: the pool table, which device replaces it.

use std::collections::BTreeSet;

use uuid::Uuid;

use crate::alloc::Allocator;
use crate::map::{self, Placement};

impl Allocator<'_> {
    /// Makes every entry naming a chunk on `device` a hole, durably; returns how many
    /// entries (over the volume's and its snapshots' maps) were cleared.
    pub(crate) fn evict(&mut self, device: Uuid) -> Result<u64, String> {
        let s = self.s;
        let mut lost: Vec<Placement> = Vec::new();
        if let Some(idx) = s.device_of(device) {
            let mut holes = Vec::new();
            for (c, d, offset) in s.map.entries() {
                if d == idx {
                    holes.push((c, None));
                    lost.push(Placement { device, offset });
                }
            }
            for &(c, _) in &holes {
                s.map.set(c, None);
            }
            let failed = crate::alloc::persist(s, &holes);
            if !failed.is_empty() {
                return Err(format!(
                    "{} blocks of the volume's map could not be written",
                    failed.len()
                ));
            }
        }
        let mut snaps = s.snapshots.lock().unwrap_or_else(|p| p.into_inner());
        for img in snaps.iter_mut() {
            let gone: Vec<(u64, Placement)> = (img.entries.iter())
                .filter(|e| e.1.device == device)
                .copied()
                .collect();
            if gone.is_empty() {
                continue;
            }
            let store = img
                .store
                .as_ref()
                .ok_or_else(|| format!("snapshot {}: where its map lives is unknown", img.uuid))?;
            img.entries.retain(|e| e.1.device != device);
            let blocks: BTreeSet<u64> = gone.iter().map(|e| map::block_of(e.0)).collect();
            map::write_blocks(store, img.uuid, &blocks, &img.entries)
                .map_err(|e| format!("snapshot {}: {e}", img.uuid))?;
            lost.extend(gone.iter().map(|e| e.1));
        }
        drop(snaps);
        // Nothing names it any more: let go of the device (its lock, its descriptor) as far as
        // this volume goes; a late request through the index finds no device and fails.
        let mut devices = s.devices.write().unwrap_or_else(|p| p.into_inner());
        for d in devices.iter_mut().filter(|d| d.0 == device) {
            d.1 = None;
        }
        drop(devices);
        let refs = s.source.shared_chunks();
        for p in &lost {
            if refs.release(*p) {
                // Gone with its device: the pool no longer lends from it.
                s.source.give_back(p.device, p.offset);
            }
        }
        tracing::warn!(volume = %s.spec.path.display(), %device, entries = lost.len(), "thin volume: the chunks on a replaced device are lost; their entries read zeroes now");
        Ok(lost.len() as u64)
    }
}
