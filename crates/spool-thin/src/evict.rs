//! A device leaving the pool under a thin volume (`device replace`): the chunks on it are
//! lost, as a thick volume's extents on a replaced device are. Every entry naming one, in
//! the volume's map and in its snapshots', becomes a hole (it reads as a hole; the next
//! write there takes a new chunk), written durably, and the names are released from the
//! sharing counts. Done by the allocator thread, so no allocation or copy races it.
//!
//! Only what reached the device is forgotten: an entry whose block could not be written is
//! kept (in memory, and named in the counts), so running the replace again finds it and
//! writes it again. Snapshot maps are changed by reading each block and clearing only the
//! evicted entries' slots, so entries a damaged map could not decode stay as they were.
//!
//! Owns: clearing the entries. Must not know: the pool table, which device replaces it.

use uuid::Uuid;

use crate::alloc::Allocator;
use crate::map::{self, Placement};
use crate::Error;

impl Allocator<'_> {
    /// Makes every entry naming a chunk on `device` a hole, durably; returns how many
    /// entries (over the volume's and its snapshots' maps) were cleared, or what could not
    /// be written (what was written stays done).
    pub(crate) fn evict(&mut self, device: Uuid) -> Result<u64, Error> {
        let s = self.s;
        let refs = s.source.shared_chunks();
        let mut lost: Vec<Placement> = Vec::new();
        let mut errors: Vec<String> = Vec::new();
        if let Some(idx) = s.device_of(device) {
            let named: Vec<(u64, u64)> = (s.map.entries())
                .filter(|e| e.1 == idx)
                .map(|e| (e.0, e.2))
                .collect();
            for &(c, _) in &named {
                s.map.set(c, None);
            }
            let holes: Vec<_> = named.iter().map(|&(c, _)| (c, None)).collect();
            let failed = crate::alloc::persist(s, &holes);
            for &(c, offset) in &named {
                let p = Placement { device, offset };
                if !failed.contains(&map::block_of(c)) {
                    lost.push(p);
                } else if refs.is_shared(p) {
                    s.map.set_shared(c, Some((idx, offset)));
                } else {
                    s.map.set(c, Some((idx, offset)));
                }
            }
            if !failed.is_empty() {
                errors.push(format!(
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
            let Some(store) = &img.store else {
                errors.push(format!(
                    "snapshot {}: where its map lives is unknown",
                    img.uuid
                ));
                continue;
            };
            let slots: Vec<u64> = gone.iter().map(|e| e.0).collect();
            match map::clear_entries(store, &slots) {
                Ok(()) => {
                    img.entries.retain(|e| e.1.device != device);
                    lost.extend(gone.iter().map(|e| e.1));
                }
                Err(e) => errors.push(format!("snapshot {}: {e}", img.uuid)),
            }
        }
        drop(snaps);
        for p in &lost {
            if refs.release(*p) {
                // Gone with its device: the pool no longer lends from it.
                s.source.give_back(p.device, p.offset);
            }
        }
        tracing::warn!(volume = %s.spec.path.display(), %device, entries = lost.len(), "thin volume: the chunks on a replaced device are lost; their entries are holes now");
        match errors.is_empty() {
            true => {
                // Nothing names it any more: the device table lets go of it (queues opened
                // on it keep their handles until they are reopened).
                let mut devices = s.devices.write().unwrap_or_else(|p| p.into_inner());
                for d in devices.iter_mut().filter(|d| d.0 == device) {
                    d.1 = None;
                }
                Ok(lost.len() as u64)
            }
            false => Err(Error::Evict(errors.join("; "))),
        }
    }
}
