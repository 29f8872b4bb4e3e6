//! Moving a thin volume's map to other extents while the volume serves (`device replace` of
//! the device holding it). The allocator thread, the map's only writer, writes the whole map
//! from memory to the new place, then waits, changing nothing, for the pool to record the
//! new place in its table: on the old table the old map is current, on the new one the new
//! map is, so a crash at any point finds a whole map where its table says. Then:
//!
//! - recorded: the allocator writes the new place only;
//! - not recorded for sure (a table commit failed part way, so either table may be read at
//!   the next start): it writes every change to both places from then on, and both stay
//!   whole;
//! - given up (the caller dropped its [`MapMove`] before deciding): the old place only, as
//!   before; nothing was recorded.
//!
//! Owns: the handshake and which places a change is written to. Must not know: the pool
//! table, why the map moves.

use std::sync::mpsc::Sender;

use crate::alloc::Allocator;
use crate::map::{self, Placement};
use crate::shared::{Decision, Relocation};

/// A map written whole to its new place; the allocator changes nothing until the caller
/// says whether the table records the place ([`MapMove::recorded`], [`MapMove::unsure`]).
/// Dropped without either, the move is given up.
#[derive(Debug)]
pub struct MapMove {
    pub(crate) decision: Sender<Decision>,
}

impl MapMove {
    /// The pool's table now names the new place: only it is written from now on.
    pub fn recorded(self) {
        let _ = self.decision.send(Decision::Recorded);
    }

    /// The table may or may not name the new place (its commit failed part way): both
    /// places are written from now on.
    pub fn unsure(self) {
        let _ = self.decision.send(Decision::Unsure);
    }
}

impl Allocator<'_> {
    /// Copies the map to `r.store`, then waits for the decision (nothing else changes the
    /// map meanwhile) and writes where it says.
    pub(crate) fn relocate(&mut self, r: Relocation) {
        let s = self.s;
        let copy = {
            let places = s.map_places.lock().unwrap_or_else(|p| p.into_inner());
            if places.len() > 1 {
                Err("an earlier move of the map was not recorded for sure; restart spoold before moving it again".to_string())
            } else if r.store.capacity() < s.map.capacity() {
                Err(format!(
                    "the new place holds {} entries, the map {}",
                    r.store.capacity(),
                    s.map.capacity()
                ))
            } else {
                let live: Vec<(u64, Placement)> = (s.map.entries())
                    .filter_map(|(c, d, off)| s.placement(d, off).map(|p| (c, p)))
                    .collect();
                map::write_image(&r.store, s.spec.volume, &live).map_err(|e| e.to_string())
            }
        };
        let copied = copy.is_ok();
        if r.copied.send(copy).is_err() || !copied {
            return;
        }
        // The pool commits its table now; no map change may land in between.
        let decision = r.decision.recv();
        let mut places = s.map_places.lock().unwrap_or_else(|p| p.into_inner());
        match decision {
            Ok(Decision::Recorded) => {
                tracing::info!(volume = %s.spec.path.display(), "the thin volume's map moved");
                *places = vec![r.store];
            }
            Ok(Decision::Unsure) => {
                tracing::warn!(volume = %s.spec.path.display(), "the thin volume's map is written to its old and its new place until spoold restarts (the table's commit failed part way)");
                places.push(r.store);
            }
            Err(_) => {}
        }
    }
}
