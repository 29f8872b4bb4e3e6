//! Mirrored thin volumes in the pool (docs/thin.md, "Mirrored thin volumes"): each copy is
//! a thin map of its own whose chunks and map lie on devices no other copy uses, so one
//! device's loss costs at most one copy. The mirror composes the copies' thin devices as its
//! legs, as it composes a thin volume being sent.
//!
//! Owns: splitting the devices among the copies, making a copy anew on the device that
//! replaces one of its own (a copy's chunk source, `CopySpace`, is `thin.rs`'s). Must not know: the data path, how a copy is
//! rebuilt (the mirror does it: a copy made anew has a new identity).

use spool_devices::Device;
use uuid::Uuid;

use crate::buddy::Buddy;
use crate::metadata::{ExtentEntry, LegMap, PoolTable};
use crate::{Error, Pool, Result};

/// A copy made anew by a device replace: its old map is given up once no queue uses it.
#[derive(Debug)]
pub(crate) struct Renewed {
    pub(crate) volume: Uuid,
    pub(crate) name: String,
    pub(crate) slot: u8,
    pub(crate) old_map: Uuid,
    pub(crate) old_extents: Vec<ExtentEntry>,
    pub(crate) new_map: Uuid,
}

impl Pool {
    /// The usable members split into `copies` groups, each of at least one device, of about
    /// equal free space (each device joins the group with the least so far, largest first).
    pub(crate) fn copy_groups(&self, copies: u8) -> Result<Vec<Vec<Uuid>>> {
        let mut usable: Vec<(Uuid, u64)> = (self.members.iter())
            .filter(|m| !m.isolated())
            .map(|m| (m.uuid, m.free_bytes()))
            .collect();
        if usable.len() < copies as usize {
            return Err(Error::InvalidArgument(format!(
                "a thin volume of {copies} copies needs {copies} usable devices (no two copies share one); the pool has {}",
                usable.len()
            )));
        }
        usable.sort_by_key(|&(u, free)| (std::cmp::Reverse(free), u));
        let mut groups: Vec<(u64, Vec<Uuid>)> = vec![(0, Vec::new()); copies as usize];
        for (u, free) in usable {
            let g = (groups.iter_mut())
                .min_by_key(|g| (!g.1.is_empty(), g.0))
                .expect("at least one copy");
            g.0 += free;
            g.1.push(u);
        }
        Ok(groups.into_iter().map(|g| g.1).collect())
    }

    /// In `table`, the one a replace of `old` by `new` commits: every mirrored thin copy
    /// that may use `old` gets a new, zeroed map on `new` (from its allocator `buddy`,
    /// zeroed through `dev`), `new` in place of `old` among its devices, and is no longer
    /// synced: the mirror rebuilds it whole from another copy. Where it was the only synced
    /// copy, the volume's data is lost (as a plain volume's on a replaced device): the empty
    /// copy becomes the synced one and the others are rebuilt from it.
    pub(crate) fn renew_copies(
        &self,
        table: &mut PoolTable,
        (old, new): (Uuid, Uuid),
        buddy: &mut Buddy,
        dev: &Device,
    ) -> Result<Vec<Renewed>> {
        let min = table.min_extent;
        let mut renewed = Vec::new();
        for v in table.volumes.iter_mut().filter(|v| v.is_mirrored_thin()) {
            let Some(at) = (v.legs.iter())
                .position(|l| l.thin.as_ref().is_some_and(|m| m.devices.contains(&old)))
            else {
                continue;
            };
            let was = v.legs[at].thin.clone().expect("a copy's map");
            let mut map = Vec::new();
            for e in &was.map {
                let Some(offset) = buddy.alloc(e.order) else {
                    map.iter()
                        .for_each(|e: &ExtentEntry| buddy.free(e.offset, e.order));
                    return Err(Error::NoSpace {
                        requested: min << e.order,
                        available: buddy.free_bytes(),
                    });
                };
                dev.zero_range(offset, min << e.order)?;
                map.push(ExtentEntry {
                    device: new,
                    offset,
                    order: e.order,
                });
            }
            let devices = (was.devices.iter())
                .map(|&d| if d == old { new } else { d })
                .collect();
            let copy = LegMap {
                uuid: Uuid::new_v4(),
                map,
                devices,
            };
            let others_synced = (v.legs.iter().enumerate()).any(|(j, l)| j != at && l.synced);
            if others_synced {
                v.legs[at].synced = false;
            } else {
                // The new copy reads as all holes (zeroes): the others are rebuilt from it.
                tracing::error!(volume = %v.name, leg = v.legs[at].slot, "the only synced copy of a mirrored thin volume was on the replaced device; the volume's data is lost");
                v.legs.iter_mut().for_each(|l| l.synced = false);
                v.legs[at].synced = true;
            }
            renewed.push(Renewed {
                volume: v.uuid,
                name: v.name.clone(),
                slot: v.legs[at].slot,
                old_map: was.uuid,
                old_extents: was.map,
                new_map: copy.uuid,
            });
            v.legs[at].thin = Some(copy);
        }
        Ok(renewed)
    }

    /// After the replace's commit: each renewed copy's new map is served, and its old one
    /// is held (its allocator running, its chunks and extents taken) until no queue holds a
    /// layout that names it ([`Pool::release_retired`]).
    pub(crate) fn copies_renewed(&mut self, renewed: Vec<Renewed>) {
        for r in renewed {
            if let Some(v) = self.table.volumes.iter().find(|v| v.uuid == r.volume) {
                let v = v.clone();
                self.open_maps(&v, |k| k == r.new_map);
            }
            tracing::warn!(volume = %r.name, leg = r.slot, "mirrored thin copy made anew on the replacing device; rebuilding it online");
            self.retire_map(r.volume, r.old_map, r.old_extents);
        }
    }
}
