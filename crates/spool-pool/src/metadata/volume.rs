//! What a volume's table entry says of itself: its copies, their extents and maps.
//!
//! Must not know: devices, the pool's state, the rules a table obeys (`rules.rs`).

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::{ExtentEntry, Invalid, LegEntry, LegMap, VolumeEntry};

/// A volume that is another host's copy (format version 11; docs/replicas.md): its primary
/// writes it through a transfer, and no frontend may run it until it is promoted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ReplicaOf {
    /// The primary's address, as its hello reached this host.
    pub primary: String,
    /// The primary's epoch when it said hello: a promotion here serves at a higher one.
    pub epoch: u64,
    /// The primary said its copy here became current (every write it completed since is
    /// here): until then a promotion would lose what its rebuild had not copied yet.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub complete: bool,
}

/// The longest primary address a table holds.
const MAX_PRIMARY: usize = 256;

impl ReplicaOf {
    pub(crate) fn validate(&self) -> Result<(), Invalid> {
        let ok = self.primary.bytes().all(|b| b.is_ascii_graphic());
        if self.primary.is_empty() || self.primary.len() > MAX_PRIMARY || !ok {
            return Err(Invalid(format!(
                "replica: its primary is not an address of 1 to {MAX_PRIMARY} printable characters"
            )));
        }
        if self.epoch == u64::MAX {
            return Err(Invalid("replica: its epoch cannot be raised".into()));
        }
        Ok(())
    }
}

impl LegEntry {
    /// A mirrored thin volume's copy: a new map (a fresh UUID) on `map`, whose chunks and
    /// map lie on `devices`.
    pub fn thin_copy(
        slot: u8,
        synced: bool,
        map: Vec<ExtentEntry>,
        devices: Vec<Uuid>,
    ) -> LegEntry {
        let mut leg = LegEntry::local(slot, synced, Vec::new());
        leg.thin = Some(LegMap {
            uuid: Uuid::new_v4(),
            map,
            devices,
        });
        leg
    }

    /// A leg on this pool's devices.
    pub fn local(slot: u8, synced: bool, extents: Vec<ExtentEntry>) -> LegEntry {
        LegEntry {
            slot,
            synced,
            extents,
            remote: None,
            thin: None,
        }
    }
}

impl VolumeEntry {
    /// A plain volume becomes a mirror of one copy, its extents that copy's (a leg is then
    /// added); a mirrored one stays as it is.
    pub(crate) fn make_mirrored(&mut self) {
        if !self.is_mirrored() {
            self.copies = 1;
            self.legs = vec![LegEntry::local(0, true, std::mem::take(&mut self.extents))];
        }
    }

    /// A mirrored thin volume's copies, each with its own map.
    pub fn leg_maps(&self) -> impl Iterator<Item = (&LegEntry, &LegMap)> {
        self.legs.iter().filter_map(|l| Some((l, l.thin.as_ref()?)))
    }

    /// Whether this is a thin volume with copies on this pool, each with its own map (not a
    /// thin volume being sent, whose local leg stands for the volume's own map).
    pub fn is_mirrored_thin(&self) -> bool {
        self.thin.is_some() && self.legs.iter().any(|l| l.thin.is_some())
    }

    /// The leg on another host this volume is being sent to, if any.
    pub fn remote_leg(&self) -> Option<&LegEntry> {
        self.legs.iter().find(|l| l.remote.is_some())
    }

    /// A new volume (fresh UUID) with no data placed yet: no extents, legs or image.
    pub fn new(name: &str, size: u64, read_only: bool, num_queues: u16) -> VolumeEntry {
        VolumeEntry {
            uuid: Uuid::new_v4(),
            name: name.into(),
            size,
            read_only,
            num_queues,
            extents: Vec::new(),
            qos: None,
            copies: 0,
            legs: Vec::new(),
            rbd: None,
            encryption: None,
            thin: None,
            replica: None,
            epoch: 0,
        }
    }

    /// Whether the volume keeps mirrored copies.
    pub fn is_mirrored(&self) -> bool {
        self.copies > 0
    }

    /// Every extent the volume owns, on every leg (a thin volume: its map's; its chunks are
    /// named by the map).
    pub fn all_extents(&self) -> impl Iterator<Item = &ExtentEntry> {
        self.extents
            .iter()
            .chain(self.legs.iter().flat_map(|l| l.extents.iter()))
            .chain(self.thin.iter().flat_map(|t| t.map.iter()))
            .chain(
                (self.thin.iter())
                    .flat_map(|t| &t.snapshots)
                    .flat_map(|s| s.map.iter()),
            )
            .chain(self.leg_maps().flat_map(|(_, m)| m.map.iter()))
    }

    /// Each local copy's extents in logical order (a plain volume has one; a remote leg has
    /// none here and is left out).
    pub fn copies_extents(&self) -> Vec<&[ExtentEntry]> {
        if self.is_mirrored() {
            self.legs
                .iter()
                .filter(|l| l.remote.is_none())
                .map(|l| l.extents.as_slice())
                .collect()
        } else {
            vec![self.extents.as_slice()]
        }
    }
}
