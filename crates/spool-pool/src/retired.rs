//! Extents the table does not name but that must not be handed out:
//! - the extents of a mirror leg just removed, which the workers' layout (and the mirror
//!   device in it) keeps writing until every queue of the volume has moved to the new
//!   layout. Freed at once, they could go to a new volume or a thin volume's next chunk
//!   while an old write was still on its way there. They go back to the allocators when the
//!   caller says the old layout is out of use (the daemon, once no queue holds it);
//! - the new extents of a thin map move whose commit failed part way or whose copy timed
//!   out (`thin_move.rs`): the allocator may write there, and the next start may read a
//!   table naming them. They are held until that start;
//! - the map of a mirrored thin volume's copy made anew on a replacing device
//!   (`thin_mirror.rs`): the old map's allocator keeps running, and its chunks taken, until
//!   no queue holds a layout that names it, as a removed leg's extents.
//!
//! A start's allocators are built from the table alone, so neither kind outlives the
//! process. `pool check` names both as held, not leaked.
//!
//! Owns: the held extents, their tickets and why each is held. Must not know: layouts,
//! workers, virtio.

use uuid::Uuid;

use crate::metadata::ExtentEntry;
use crate::Pool;

/// The held extents, each batch under a ticket: the generation of the table that no longer
/// names them (0: held until the next start).
#[derive(Debug, Default)]
pub(crate) struct Retired {
    held: Vec<(Uuid, u64, Vec<ExtentEntry>)>,
    /// Thin maps (by key) held the same way: (volume, ticket, map key).
    maps: Vec<(Uuid, u64, Uuid)>,
}

/// The ticket of extents held until the next start.
const UNTIL_RESTART: u64 = 0;

impl Pool {
    /// Keeps `extents`, which volume `volume`'s committed table entry no longer names, out
    /// of the allocators until [`Pool::release_retired`], under the committed table's
    /// generation: they are out of the queues' reach once none holds a layout older than
    /// that (`VolumeLayout::generation`).
    pub(crate) fn retire(&mut self, volume: Uuid, extents: Vec<ExtentEntry>) {
        if extents.is_empty() {
            return;
        }
        let ticket = self.generation;
        self.retired.held.push((volume, ticket, extents));
    }

    /// Keeps thin map `key` of volume `volume` (a mirrored copy's old map) served, and its
    /// `extents` taken, until [`Pool::release_retired`], as [`Pool::retire`] does.
    pub(crate) fn retire_map(&mut self, volume: Uuid, key: Uuid, extents: Vec<ExtentEntry>) {
        let ticket = self.generation;
        self.retired.maps.push((volume, ticket, key));
        self.retired.held.push((volume, ticket, extents));
    }

    /// Keeps `extents` (volume `volume`'s new thin map extents, which the allocator may
    /// write and the next start's table may name) out of the allocators until that start.
    pub(crate) fn hold_until_restart(&mut self, volume: Uuid, extents: Vec<ExtentEntry>) {
        if !extents.is_empty() {
            self.retired.held.push((volume, UNTIL_RESTART, extents));
        }
    }

    /// The keys of the thin maps retired and not released yet (their backends still serve
    /// the queues that hold an older layout).
    pub(crate) fn retired_map_keys(&self) -> Vec<Uuid> {
        self.retired.maps.iter().map(|&(_, _, key)| key).collect()
    }

    /// The newest ticket of volume `volume`'s retired extents (None: it has none): the
    /// generation from which on no layout names them.
    pub fn retired_ticket(&self, volume: Uuid) -> Option<u64> {
        let maps = self.retired.maps.iter().map(|&(v, t, _)| (v, t));
        (self.retired.held.iter().map(|&(v, t, _)| (v, t)))
            .chain(maps)
            .filter(|&(v, t)| v == volume && t != UNTIL_RESTART)
            .map(|(_, t)| t)
            .max()
    }

    /// Gives volume `volume`'s retired extents up to ticket `upto` back to the allocators:
    /// no queue uses a layout that names them any more. Returns the bytes given back.
    pub fn release_retired(&mut self, volume: Uuid, upto: u64) -> u64 {
        // A map's allocator stops, and its chunks go back, before its extents do.
        let (maps, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retired.maps)
            .into_iter()
            .partition(|&(v, t, _)| v == volume && t <= upto);
        self.retired.maps = keep;
        for (_, _, key) in maps {
            self.release_thin(key);
            tracing::info!(%volume, map = %key, "a thin map given up (a replaced copy's, or the own map of a volume its copies took over from): no queue uses it any more");
        }
        let (now, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retired.held)
            .into_iter()
            .partition(|&(v, t, _)| v == volume && t != UNTIL_RESTART && t <= upto);
        self.retired.held = keep;
        let mut bytes = 0;
        for (_, _, extents) in now {
            bytes += extents
                .iter()
                .map(|e| self.table.min_extent << e.order)
                .sum::<u64>();
            self.release(&extents);
        }
        if bytes > 0 {
            tracing::info!(%volume, bytes, "a removed copy's extents given back: no queue writes them any more");
        }
        bytes
    }

    /// Every held extent, with the volume it was held for and why.
    pub(crate) fn retired_extents(
        &self,
    ) -> impl Iterator<Item = (Uuid, &ExtentEntry, &'static str)> {
        self.retired.held.iter().flat_map(|(v, t, x)| {
            let why = match *t {
                UNTIL_RESTART => "a thin map move's new extents, held until spoold restarts",
                _ => "a removed copy (or a renewed copy's old map), given back once its queues moved off it",
            };
            x.iter().map(move |e| (*v, e, why))
        })
    }
}
