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

use std::sync::atomic::Ordering::SeqCst;
use std::sync::mpsc::{RecvTimeoutError, Sender};
use std::sync::Arc;

use uuid::Uuid;

use crate::alloc::Allocator;
use crate::backend::ThinBackend;
use crate::map::{self, MapStore, Placement};
use crate::shared::{Decision, Relocation, MOVE_COPYING, MOVE_QUEUED};
use crate::Error;

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

/// How long the map's copy may take before the move is given up.
const MAP_COPY_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

impl ThinBackend {
    /// Writes the volume's map (or `snapshot`'s) whole to `store` (new, zeroed, as large)
    /// and holds every map change until the returned move is decided. Fails if the copy
    /// fails, if an earlier move was left unsure, or if the snapshot's map is damaged.
    pub fn move_map(
        &self,
        snapshot: Option<Uuid>,
        store: crate::map::MapStore,
    ) -> Result<crate::MapMove, Error> {
        let (copied, done) = std::sync::mpsc::channel();
        let (decision, decided) = std::sync::mpsc::channel();
        let state = Arc::new(std::sync::atomic::AtomicU8::new(crate::shared::MOVE_QUEUED));
        let mut w = self.shared.work.lock().unwrap_or_else(|p| p.into_inner());
        w.relocations.push(crate::shared::Relocation {
            snapshot,
            store,
            state: state.clone(),
            copied,
            decision: decided,
        });
        drop(w);
        self.shared.wake.notify_one();
        match done.recv_timeout(MAP_COPY_WAIT) {
            Ok(Ok(())) => Ok(crate::MapMove { decision }),
            Ok(Err(e)) => Err(e),
            Err(e) => {
                use crate::shared::{MOVE_CANCELLED, MOVE_QUEUED};
                let why = match e {
                    RecvTimeoutError::Timeout => {
                        "the volume's allocator did not copy the map within 60 s"
                    }
                    RecvTimeoutError::Disconnected => "the volume's allocator stopped",
                };
                match state.compare_exchange(MOVE_QUEUED, MOVE_CANCELLED, SeqCst, SeqCst) {
                    Ok(_) => Err(Error::Relocate(why.into())),
                    Err(_) => match done.try_recv() {
                        // Copied just now: the move goes on.
                        Ok(Ok(())) => Ok(crate::MapMove { decision }),
                        // Copying: it may still write there, so the place must stay taken.
                        _ => Err(Error::RelocateAbandoned(why.into())),
                    },
                }
            }
        }
    }
}

impl Allocator<'_> {
    /// Copies the map to `r.store`, then waits for the decision (nothing else changes the
    /// map meanwhile) and writes where it says.
    pub(crate) fn relocate(&mut self, r: Relocation) {
        let start = r
            .state
            .compare_exchange(MOVE_QUEUED, MOVE_COPYING, SeqCst, SeqCst);
        if start.is_err() {
            // Given up before it started: its extents may be someone else's by now.
            return;
        }
        let copy = match r.snapshot {
            None => self.copy_map(&r.store),
            Some(uuid) => self.copy_snapshot_map(uuid, &r.store),
        };
        let copied = copy.is_ok();
        if r.copied.send(copy).is_err() || !copied {
            return;
        }
        // The pool commits its table now; no map change may land in between.
        let decision = r.decision.recv();
        let s = self.s;
        let volume = s.spec.path.display();
        if let Some(uuid) = r.snapshot {
            // A snapshot's map changes only when a device leaves (`evict.rs`): unsure,
            // where it lives is unknown until a restart, so nothing writes either copy.
            let mut snaps = s.snapshots.lock().unwrap_or_else(|p| p.into_inner());
            let Some(img) = snaps.iter_mut().find(|i| i.uuid == uuid) else {
                return;
            };
            match decision {
                Ok(Decision::Recorded) => {
                    tracing::info!(%volume, snapshot = %uuid, "the snapshot's map moved");
                    img.store = Some(r.store);
                }
                Ok(Decision::Unsure) => img.store = None,
                Err(_) => {}
            }
            return;
        }
        let mut places = s.map_places.lock().unwrap_or_else(|p| p.into_inner());
        match decision {
            Ok(Decision::Recorded) => {
                tracing::info!(%volume, "the thin volume's map moved");
                *places = vec![r.store];
            }
            Ok(Decision::Unsure) => {
                tracing::warn!(%volume, "the thin volume's map is written to its old and its new place until spoold restarts (the table's commit failed part way)");
                places.push(r.store);
            }
            Err(_) => {}
        }
    }

    /// The volume's map, from memory, to `store`.
    fn copy_map(&self, store: &MapStore) -> Result<(), Error> {
        let s = self.s;
        let places = s.map_places.lock().unwrap_or_else(|p| p.into_inner());
        if places.len() > 1 {
            return Err(Error::Relocate("an earlier move of the map was not recorded for sure; restart spoold before moving it again".into()));
        }
        if store.capacity() < s.map.capacity() {
            return Err(Error::Relocate(format!(
                "the new place holds {} entries, the map {}",
                store.capacity(),
                s.map.capacity()
            )));
        }
        let live: Vec<(u64, Placement)> = (s.map.entries())
            .filter_map(|(c, d, off)| s.placement(d, off).map(|p| (c, p)))
            .collect();
        map::write_image(store, s.spec.volume, &live).map_err(|e| Error::Relocate(e.to_string()))
    }

    /// Snapshot `uuid`'s map, from memory (what it named at open, less what evictions
    /// cleared since), to `store`. A damaged map is not moved: what did not decode would
    /// be lost, and the snapshot would then read as whole.
    fn copy_snapshot_map(&self, uuid: uuid::Uuid, store: &MapStore) -> Result<(), Error> {
        let snaps = self.s.snapshots.lock().unwrap_or_else(|p| p.into_inner());
        let img = (snaps.iter().find(|i| i.uuid == uuid))
            .ok_or_else(|| Error::Relocate(format!("no snapshot {uuid}")))?;
        if let Some(why) = &img.damage {
            return Err(Error::Relocate(format!(
                "the snapshot's map is damaged ({why}): delete the snapshot"
            )));
        }
        if img.store.is_none() {
            return Err(Error::Relocate("an earlier move of the snapshot's map was not recorded for sure; restart spoold before moving it again".into()));
        }
        map::write_image(store, uuid, &img.entries).map_err(|e| Error::Relocate(e.to_string()))
    }
}
