//! The chunk maps a thin volume has: its own, and each copy's of a mirrored one (whose own
//! map is empty once its copies are added), each named by the key the pool opens it under.
//!
//! Must not know: how maps are read or served (`thin.rs`), devices.

use uuid::Uuid;

use crate::metadata::{ExtentEntry, VolumeEntry};

/// One chunk map of a thin volume (see [`map_refs`]).
#[derive(Debug)]
pub(crate) struct MapRef<'a> {
    /// What the pool opens it under: the volume's UUID for its own map, the map's for a
    /// mirrored copy's.
    pub(crate) key: Uuid,
    /// The copy's leg slot (a mirrored copy's map); `None`: the volume's own map.
    pub(crate) slot: Option<u8>,
    pub(crate) chunk: u64,
    pub(crate) map: &'a [ExtentEntry],
    pub(crate) snapshots: &'a [crate::metadata::ThinSnapshot],
    /// The devices its chunks may lie on (empty: any).
    pub(crate) devices: &'a [Uuid],
}

impl MapRef<'_> {
    /// " leg N" for a copy's map, nothing for the volume's own (after a volume's name).
    pub(crate) fn of(&self) -> String {
        self.slot.map_or(String::new(), |s| format!(" leg {s}"))
    }

    /// "leg N: " for a copy's map, nothing for the volume's own (before an error).
    pub(crate) fn prefix(&self) -> String {
        self.slot.map_or(String::new(), |s| format!("leg {s}: "))
    }
}

/// Every chunk map of volume `v`: none for a thick volume; a thin volume's own, then each
/// copy's of a mirrored thin volume (whose own map is empty once they are added).
pub(crate) fn map_refs(v: &VolumeEntry) -> Vec<MapRef<'_>> {
    let Some(t) = &v.thin else {
        return Vec::new();
    };
    // A mirrored thin volume's own map is empty once its copies are added.
    let own = (!t.map.is_empty()).then_some(MapRef {
        key: v.uuid,
        slot: None,
        chunk: t.chunk,
        map: &t.map,
        snapshots: &t.snapshots,
        devices: &[],
    });
    let copies = v.leg_maps().map(|(l, m)| MapRef {
        key: m.uuid,
        slot: Some(l.slot),
        chunk: t.chunk,
        map: &m.map,
        snapshots: &[],
        devices: &m.devices,
    });
    own.into_iter().chain(copies).collect()
}
