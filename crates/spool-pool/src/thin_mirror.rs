//! Mirrored thin volumes in the pool (docs/thin.md, "Mirrored thin volumes"): each copy is
//! a thin map of its own whose chunks and map lie on devices no other copy uses, so one
//! device's loss costs at most one copy. The mirror composes the copies' thin devices as its
//! legs, as it composes a thin volume being sent.
//!
//! A thin volume made without copies gets two (`volume mirror NAME add`): two new, empty
//! copies on devices of their own are added as legs beside one standing for the volume's own
//! map, and the mirror rebuilds them from it, online; once both are current, the own map
//! (with what it shared with a clone's origin) is given up and the volume is a mirrored thin
//! volume like one made so. Each step is one commit of a valid table, so a crash between two
//! finds either.
//!
//! Owns: splitting the devices among the copies, adding copies to a thin volume, making a
//! copy anew on the device that replaces one of its own (a copy's chunk source,
//! `CopySpace`, is `thin_space.rs`'s). Must not know: the data path, how a copy is rebuilt (the
//! mirror does it: a copy made anew has a new identity).

use spool_devices::Device;
use uuid::Uuid;

use crate::buddy::Buddy;
use crate::metadata::{ExtentEntry, LegEntry, LegMap, PoolTable, VolumeEntry};
use crate::{Error, Pool, Result, VolumeInfo};

/// A copy made anew by a device replace (or given up: a nil `new_map`): its old map is
/// given up once no queue uses it.
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
            .filter(|m| !m.isolated() && !self.space.blocked(m.uuid))
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

    /// In `table`, the one a replace of `old` commits: copies being added to a thin volume
    /// that may use `old` are given up, and the volume is a thin volume without copies
    /// again, which loses only its chunks on `old` (its own map, which they were being
    /// rebuilt from, is evicted as any thin volume's is). Rebuilding a copy from a source
    /// that has just lost chunks would spread the holes, while the other copy may hold the
    /// data: giving both up is the one outcome that mixes nothing. The copies' maps, to
    /// retire after the commit, are returned.
    pub(crate) fn give_up_adding(&self, table: &mut PoolTable, old: Uuid) -> Vec<Renewed> {
        let mut given_up = Vec::new();
        for v in table.volumes.iter_mut().filter(|v| adding_copies(v)) {
            let on_old = v.leg_maps().any(|(_, m)| m.devices.contains(&old));
            if !on_old && !self.thin_uses(v, old) {
                continue;
            }
            tracing::error!(volume = %v.name, "a device under a thin volume's copies being added was replaced: the copies are given up; add them again");
            for l in std::mem::take(&mut v.legs) {
                if let Some(m) = l.thin {
                    given_up.push(Renewed {
                        volume: v.uuid,
                        name: v.name.clone(),
                        slot: l.slot,
                        old_map: m.uuid,
                        old_extents: m.map,
                        new_map: Uuid::nil(),
                    });
                }
            }
            v.copies = 0;
        }
        given_up
    }

    /// After the replace's commit: each renewed copy's new map is served, and its old one
    /// is held (its allocator running, its chunks and extents taken) until no queue holds a
    /// layout that names it ([`Pool::release_retired`]).
    pub(crate) fn copies_renewed(&mut self, renewed: Vec<Renewed>) {
        for r in renewed.iter().filter(|r| r.new_map.is_nil()) {
            self.drop_mirror(r.volume);
        }
        for r in renewed {
            if r.new_map.is_nil() {
                // Given up (`give_up_adding`): nothing new to serve.
                self.retire_map(r.volume, r.old_map, r.old_extents);
                continue;
            }
            if let Some(v) = self.table.volumes.iter().find(|v| v.uuid == r.volume) {
                let v = v.clone();
                self.open_maps(&v, |k| k == r.new_map);
            }
            tracing::warn!(volume = %r.name, leg = r.slot, "mirrored thin copy made anew on the replacing device; rebuilding it online");
            self.space.unblock(r.old_map);
            self.retire_map(r.volume, r.old_map, r.old_extents);
        }
    }

    /// Starts the hand-over to the copies added to `v` in its mirror
    /// (`Mirror::begin_hand_over`), then checks that each is synced in the table and current
    /// in the mirror: the slots it started when so (the takeover may go ahead: from the
    /// check on, a write a copy misses fails as a whole, so none acknowledged lives only on
    /// the own map that goes), `None` when not (and the hand-over is cancelled). The table's flag is never taken back:
    /// a copy that missed a write since, on a full device, is stale in the mirror only.
    fn hold_copies_current(&self, v: &VolumeEntry) -> Option<u8> {
        let cache = self.mirrors.lock().unwrap_or_else(|p| p.into_inner());
        let (_, m) = cache.get(&v.uuid)?;
        let slots = v.leg_maps().fold(0u8, |s, (l, _)| s | 1 << l.slot);
        let made = m.begin_hand_over(slots);
        let current = v.leg_maps().all(|(l, _)| {
            l.synced
                && m.leg_id(l.slot) == Some(crate::layout::table_leg_id(l))
                && m.leg_current(l.slot)
        });
        if !current {
            m.cancel_hand_over(made);
            return None;
        }
        Some(made)
    }

    /// Cancels the hand-over [`Pool::hold_copies_current`] started (a takeover whose commit
    /// failed: the own map goes on serving beside the copies).
    fn release_copies(&self, v: Uuid, made: u8) {
        let cache = self.mirrors.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, m)) = cache.get(&v) {
            m.cancel_hand_over(made);
        }
    }

    /// Adds two copies to thin volume `i` (see the module doc): refused for a volume with
    /// copies already, snapshots, a send in progress, or a map that is not served.
    pub(crate) fn add_thin_copies(&mut self, i: usize) -> Result<VolumeInfo> {
        let mut v = self.table.volumes[i].clone();
        let t = v.thin.clone().expect("a thin volume");
        let refuse = |why: &str| {
            Err(Error::InvalidArgument(format!(
                "volume '{}': {why}",
                v.name
            )))
        };
        if v.is_mirrored_thin() {
            return refuse("it has its copies already; a third copy of a mirrored thin volume is not supported yet");
        }
        if v.remote_leg().is_some() {
            return refuse("it is being sent to another host; finish or cancel the send first");
        }
        if !t.snapshots.is_empty() {
            return refuse(
                "it has snapshots, which a mirrored thin volume cannot keep yet; delete them first",
            );
        }
        self.thin_device(&v)?;
        self.check_not_frozen()?;
        let groups = self.copy_groups(2)?;
        let bytes = (t.map.iter())
            .map(|e| self.table.min_extent << e.order)
            .sum();
        let maps = self.zeroed_maps(&groups, bytes)?;
        let all: Vec<ExtentEntry> = maps.iter().flatten().copied().collect();
        v.copies = 2;
        v.legs.push(LegEntry::local(0, true, Vec::new()));
        for (slot, (map, devices)) in (1..).zip(maps.into_iter().zip(groups)) {
            v.legs.push(LegEntry::thin_copy(slot, false, map, devices));
        }
        if let Err(e) = self.new_clean_bitmap(&v) {
            self.release(&all);
            return Err(e);
        }
        let info = self.replace_volume(i, v.clone(), &all, &[])?;
        self.open_maps(&v, |k| k != v.uuid);
        tracing::info!(volume = %v.name, "copies added to a thin volume; rebuilding them from its map");
        Ok(info)
    }

    /// Every thin volume whose added copies are all current is made a mirrored thin volume
    /// like one made so: the leg standing for its own map goes, and the own map (with its
    /// origin) is held until no queue uses it ([`Pool::release_retired`]). Returns the
    /// volumes changed (their layout must be published again).
    pub fn finish_thin_copies(&mut self) -> Result<Vec<String>> {
        let adding: Vec<usize> = (self.table.volumes.iter().enumerate())
            .filter(|(_, v)| adding_copies(v))
            .map(|(i, _)| i)
            .collect();
        let mut changed = Vec::new();
        for i in adding {
            let Some(made) = self.hold_copies_current(&self.table.volumes[i]) else {
                continue;
            };
            let mut table = self.table.clone();
            let v = &mut table.volumes[i];
            v.legs.retain(|l| l.thin.is_some());
            let t = v.thin.as_mut().expect("a thin volume");
            let own = std::mem::take(&mut t.map);
            t.origin = None;
            let (uuid, name) = (v.uuid, v.name.clone());
            if let Err(e) = self.commit(table) {
                self.release_copies(uuid, made);
                // The volumes finished so far are returned, to be published.
                tracing::error!(volume = %name, error = %e, "cannot record that the thin volume's copies took over; trying again later");
                break;
            }
            tracing::info!(volume = %name, "copies of the thin volume current: its own map is given up");
            self.retire_map(uuid, uuid, own);
            changed.push(name);
        }
        Ok(changed)
    }
}

/// Whether copies are being added to thin volume `v`: it has copies and still its own map.
pub(crate) fn adding_copies(v: &VolumeEntry) -> bool {
    v.thin.as_ref().is_some_and(|t| !t.map.is_empty()) && v.is_mirrored_thin()
}
