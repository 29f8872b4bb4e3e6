//! What the queues and the allocator thread of one thin volume share: the spec, the chunk
//! map, the device table, the work queue and the mailboxes that carry results back, the grace
//! counters, and the thin device's health cell.
//!
//! Owns: [`Shared`] and its small operations (asking for a chunk or an unmap, looking up a
//! device, following the pool devices' health). Must not know: virtio, the pool, how the
//! allocator or the queues do their work.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::time::Duration;

use spool_devices::{Device, DeviceHealth, HealthState};
use uuid::Uuid;

use crate::grace::Grace;
use crate::map::{ChunkMap, MapStore, Placement};
use crate::ChunkSource;

/// What a thin volume is made of.
#[derive(Debug, Clone)]
pub struct ThinSpec {
    pub volume: Uuid,
    /// The device's name (`thin:VOLUME`).
    pub path: PathBuf,
    /// The volume's size in bytes.
    pub size: u64,
    /// Bytes per chunk (a power of two, a multiple of 4 KiB).
    pub chunk: u64,
    /// Where chunks start on every pool device: a chunk's offset is this plus a multiple of
    /// `chunk` (the pool's data area begins after its metadata).
    pub chunk_base: u64,
    pub store: MapStore,
    /// How long a write that needs a chunk waits for free space before it fails.
    pub full_wait: Duration,
    /// The pool devices do their I/O inline in the worker (files on tmpfs): so does the
    /// thin device (the worker takes fewer requests a round from the ring then).
    pub inline_io: bool,
    /// The volume's snapshots, oldest first (their maps are read at open).
    pub snapshots: Vec<SnapshotSpec>,
    /// A mirrored thin volume's copy: the pool devices it may use. When one of them is
    /// isolated the thin device fails as a whole (the copy is incomplete: the mirror reads
    /// the other copies, and the copy is made anew when the device is replaced). Empty: the
    /// thin device follows only the devices its map names, and stays healthy when one of
    /// them fails (its chunks there fail their I/O).
    pub copy_devices: Vec<Arc<Device>>,
}

/// A snapshot of a thin volume: its own map, written once when it was taken.
#[derive(Debug, Clone)]
pub struct SnapshotSpec {
    pub uuid: Uuid,
    /// The volume's size when it was taken.
    pub size: u64,
    pub store: MapStore,
}

/// A snapshot's chunks in memory: (chunk index, where).
#[derive(Debug, Clone)]
pub(crate) struct SnapImage {
    pub(crate) uuid: Uuid,
    pub(crate) entries: Vec<(u64, Placement)>,
    /// Why its map was found corrupt at open (`entries` holds what decoded).
    pub(crate) damage: Option<String>,
    /// Where its map lives (rewritten when a device leaves under it).
    pub(crate) store: Option<crate::map::MapStore>,
}

/// What the queues and the allocator thread of one thin volume share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) spec: ThinSpec,
    /// The volume's size now (`spec.size` at open; a grow raises it).
    pub(crate) size: AtomicU64,
    pub(crate) map: ChunkMap,
    /// Pool devices by the index the map's table uses (only ever appended to); `None` for a
    /// device the map names that is not in the pool now.
    pub(crate) devices: RwLock<Vec<(Uuid, Option<Arc<Device>>)>>,
    pub(crate) source: Arc<dyn ChunkSource>,
    pub(crate) work: Mutex<Work>,
    pub(crate) wake: Condvar,
    pub(crate) grace: Grace,
    /// The health cell of the `Device` wrapping this backend.
    pub(crate) health: OnceLock<Arc<DeviceHealth>>,
    /// The pool devices' epochs the thin cell last followed.
    pub(crate) followed: Mutex<Vec<u64>>,
    pub(crate) stop: AtomicBool,
    /// Writes waiting for free space now (shown by `volume show`).
    pub(crate) waiting_for_space: AtomicU64,
    /// Chunks unmapped and not given back yet (the allocator's; read when the volume goes).
    pub(crate) retire: Mutex<Retire>,
    /// The volume's snapshots (their chunks are named by their maps too).
    pub(crate) snapshots: Mutex<Vec<SnapImage>>,
    /// Where every change of the map is written: `spec.store` until the map moves
    /// (`relocate.rs`); two places while a move was not recorded for sure.
    pub(crate) map_places: Mutex<Vec<crate::map::MapStore>>,
    /// Chunks the allocator took and has not published or given back yet (what `pool
    /// check` must not call leaked): set by `take_filled`, emptied when the batch is done.
    pub(crate) in_hand: Mutex<Vec<Placement>>,
    /// Map blocks whose last write failed: on the device they may hold the old entries or
    /// the new ones, whatever memory says. A change that finds its entries already as it
    /// wants them in memory must still write such a block before it is acknowledged. With
    /// each, the chunks held back because the device may name them there (a failed
    /// allocation's new chunk, a failed unmap's old one): the block's next successful write
    /// gives back those it does not name.
    pub(crate) unsure_blocks: Mutex<std::collections::BTreeMap<u64, Vec<Placement>>>,
    /// Where the allocator dies (crash-point tests; read only in test builds).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) crash_at: Mutex<Option<CrashPoint>>,
}

/// Chunks unmapped and not yet given back.
#[derive(Debug, Default)]
pub(crate) struct Retire {
    /// Waiting for the phase (the value `Grace::flip` returned) to drain.
    pub(crate) waiting: Option<(u64, Vec<Placement>)>,
    /// Unmapped since; their grace period starts when `waiting` is done.
    pub(crate) next: Vec<Placement>,
}

impl Shared {
    pub(crate) fn new(
        spec: ThinSpec,
        source: Arc<dyn ChunkSource>,
        map: ChunkMap,
        devices: Vec<(Uuid, Option<Arc<Device>>)>,
    ) -> Shared {
        Shared {
            map_places: Mutex::new(vec![spec.store.clone()]),
            size: AtomicU64::new(spec.size),
            spec,
            map,
            devices: RwLock::new(devices),
            source,
            work: Mutex::default(),
            wake: Condvar::new(),
            grace: Grace::default(),
            health: OnceLock::new(),
            followed: Mutex::default(),
            stop: AtomicBool::new(false),
            waiting_for_space: AtomicU64::new(0),
            retire: Mutex::default(),
            snapshots: Mutex::default(),
            in_hand: Mutex::default(),
            unsure_blocks: Mutex::default(),
            crash_at: Mutex::default(),
        }
    }

    /// The index of `uuid` in the device table, added when new.
    pub(crate) fn device_index(&self, uuid: Uuid, dev: &Arc<Device>) -> usize {
        let mut d = self.devices.write().unwrap_or_else(|p| p.into_inner());
        match d.iter().position(|(u, _)| *u == uuid) {
            Some(i) => {
                d[i].1.get_or_insert_with(|| dev.clone());
                i
            }
            None => {
                d.push((uuid, Some(dev.clone())));
                d.len() - 1
            }
        }
    }

    /// The index of pool device `uuid` in the device table, if the map has named it.
    pub(crate) fn device_of(&self, uuid: Uuid) -> Option<usize> {
        let d = self.devices.read().unwrap_or_else(|p| p.into_inner());
        d.iter().position(|(u, _)| *u == uuid)
    }

    pub(crate) fn device(&self, i: usize) -> Option<Arc<Device>> {
        let d = self.devices.read().unwrap_or_else(|p| p.into_inner());
        d.get(i).and_then(|(_, dev)| dev.clone())
    }

    pub(crate) fn placement(&self, i: usize, offset: u64) -> Option<Placement> {
        let d = self.devices.read().unwrap_or_else(|p| p.into_inner());
        d.get(i).map(|(device, _)| Placement {
            device: *device,
            offset,
        })
    }

    /// Whether this is a mirrored copy one of whose devices is isolated.
    pub(crate) fn copy_lost(&self) -> bool {
        (self.spec.copy_devices.iter()).any(|d| d.health().state().isolated())
    }

    /// The thin cell follows the pool devices it uses: failed when it is a mirrored copy
    /// and one of its devices is isolated, resetting while one of them is, healthy
    /// otherwise, with a new epoch whenever one of theirs moved (so the worker
    /// dispatches what it holds again). Also ends a reset the worker started on the thin
    /// cell itself (a timeout) once no pool device is resetting.
    pub(crate) fn follow_health(&self) {
        let Some(cell) = self.health.get() else {
            return;
        };
        let devices: Vec<Arc<Device>> = {
            let d = self.devices.read().unwrap_or_else(|p| p.into_inner());
            d.iter().filter_map(|(_, dev)| dev.clone()).collect()
        };
        let mut followed = self.followed.lock().unwrap_or_else(|p| p.into_inner());
        let states: Vec<(HealthState, u64)> = devices.iter().map(|d| d.health().load()).collect();
        let epochs: Vec<u64> = states.iter().map(|s| s.1).collect();
        let resetting = states.iter().any(|s| s.0 == HealthState::Resetting);
        let copy_lost = self.copy_lost();
        let want = if copy_lost {
            HealthState::Failed
        } else if resetting {
            HealthState::Resetting
        } else {
            HealthState::Healthy
        };
        if *followed != epochs || cell.state() != want {
            *followed = epochs;
            cell.set(want);
        }
    }
}

/// What one queue is told by the allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Note {
    /// Chunk `chunk`, asked for, is done with: mapped (or was already), or unmapped again
    /// since it was asked for. A requester that still finds a hole there asks again.
    Mapped { chunk: u64 },
    /// Chunk `chunk` could not be allocated (a negative errno).
    Failed { chunk: u64, errno: i32 },
    /// The unmap asked with `token` is done (0, or a negative errno).
    Unmapped { token: u64, errno: i32 },
}

/// A queue's inbox: notes, and an eventfd the queue's completion descriptor watches.
#[derive(Debug)]
pub(crate) struct Mailbox {
    notes: Mutex<Vec<Note>>,
    /// Set with every post, cleared by `take`: one relaxed load per reap when idle.
    mail: AtomicBool,
    pub(crate) event: File,
    /// Asks only for copies of shared chunks (an inflate): a chunk that is a hole by the
    /// time the allocator looks (unmapped meanwhile) is left a hole, not allocated.
    pub(crate) copy_only: bool,
}

impl Mailbox {
    pub(crate) fn new() -> std::io::Result<Mailbox> {
        Ok(Mailbox {
            notes: Mutex::default(),
            mail: AtomicBool::new(false),
            event: spool_devices::completion_eventfd()?,
            copy_only: false,
        })
    }

    /// A mailbox whose requests only copy shared chunks (see [`Mailbox::copy_only`]).
    pub(crate) fn for_copies() -> std::io::Result<Mailbox> {
        Ok(Mailbox {
            copy_only: true,
            ..Mailbox::new()?
        })
    }

    pub(crate) fn post(&self, note: Option<Note>) {
        let mut notes = self.notes.lock().unwrap_or_else(|p| p.into_inner());
        notes.extend(note);
        self.mail.store(true, Ordering::Release);
        drop(notes);
        self.ring();
    }

    /// Makes the queue's completion descriptor readable.
    pub(crate) fn ring(&self) {
        let _ = (&self.event).write(&1u64.to_ne_bytes());
    }

    /// Whether anything was posted since the last `take`.
    #[inline]
    pub(crate) fn has_mail(&self) -> bool {
        self.mail.load(Ordering::Acquire)
    }

    pub(crate) fn take(&self) -> Vec<Note> {
        let mut notes = self.notes.lock().unwrap_or_else(|p| p.into_inner());
        self.mail.store(false, Ordering::Relaxed);
        std::mem::take(&mut *notes)
    }
}

/// An unmap of chunks `[first, end)`.
#[derive(Debug)]
pub(crate) struct Unmap {
    /// The whole chunks cleared, `first..end` (may be empty).
    pub(crate) first: u64,
    pub(crate) end: u64,
    /// The chunks whose map blocks, where unsure, are written again though memory holds
    /// holes there: the cleared ones and those a write-zeroes covers in part as holes.
    pub(crate) confirm: std::ops::Range<u64>,
    pub(crate) token: u64,
    pub(crate) mailbox: Arc<Mailbox>,
}

/// The steps of allocating and unmapping, where the crash-point tests make the allocator die
/// as a crash would (the thread ends, everything it held in memory is lost).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CrashPoint {
    /// A chunk taken from the pool, not zeroed yet.
    Taken,
    /// Zeroed, its map entry not written.
    Zeroed,
    /// Its map entry durable, not published.
    MapWritten,
    /// Entries cleared in memory, the holes not written.
    Cleared,
    /// The holes durable, the chunks not given back.
    HolesWritten,
    /// A shared chunk copied to a new one, its map entry not written.
    Copied,
    /// A snapshot's chunks marked shared, the requests before it not drained yet.
    Marked,
}

/// Work waiting for the thread.
#[derive(Debug, Default)]
pub(crate) struct Work {
    /// Chunks asked for, by whom, and when (the full-pool wait runs from then).
    pub(crate) allocs: Vec<(u64, Arc<Mailbox>, std::time::Instant)>,
    pub(crate) unmaps: Vec<Unmap>,
    /// Snapshots to take: each answered with the chunks it names, or why it failed.
    pub(crate) snapshots: Vec<SnapshotReply>,
    /// Reverts to a snapshot's chunks: each answered with how many entries changed.
    pub(crate) reverts: Vec<Revert>,
    /// Devices leaving the pool: each answered with how many entries became holes.
    pub(crate) evictions: Vec<(Uuid, std::sync::mpsc::Sender<Result<u64, crate::Error>>)>,
    /// Moves of the map to another place (`relocate.rs`).
    pub(crate) relocations: Vec<Relocation>,
}

/// A map move not started yet.
pub(crate) const MOVE_QUEUED: u8 = 0;
/// A map move the allocator is copying (it may write its extents).
pub(crate) const MOVE_COPYING: u8 = 1;
/// A map move given up before it started (its extents are never written).
pub(crate) const MOVE_CANCELLED: u8 = 2;

/// What the pool decided about a map written to its new place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// The table names the new place.
    Recorded,
    /// The table may or may not name it.
    Unsure,
}

/// A map move the allocator thread is to make.
#[derive(Debug)]
pub(crate) struct Relocation {
    /// The snapshot whose map moves (None: the volume's).
    pub(crate) snapshot: Option<Uuid>,
    pub(crate) store: crate::map::MapStore,
    /// [`MOVE_QUEUED`], then [`MOVE_COPYING`] (the allocator's) or [`MOVE_CANCELLED`] (a
    /// caller that gave up waiting: its extents may go back then, and only then).
    pub(crate) state: Arc<std::sync::atomic::AtomicU8>,
    pub(crate) copied: std::sync::mpsc::Sender<Result<(), crate::Error>>,
    pub(crate) decision: std::sync::mpsc::Receiver<Decision>,
}

/// A revert: the snapshot's chunks (chunk index, where), and where the number of entries
/// changed (or why it failed) is sent.
pub(crate) type Revert = (
    Vec<(u64, Placement)>,
    std::sync::mpsc::Sender<Result<u64, crate::Error>>,
);

/// Where a snapshot's chunks (chunk index, where), or why it failed, are handed to the
/// caller (or back, when it gave up waiting).
pub(crate) type SnapshotReply =
    Arc<crate::handoff::Handoff<Result<Vec<(u64, Placement)>, crate::Error>>>;

impl Work {
    pub(crate) fn is_empty(&self) -> bool {
        self.allocs.is_empty()
            && self.unmaps.is_empty()
            && self.snapshots.is_empty()
            && self.reverts.is_empty()
            && self.evictions.is_empty()
            && self.relocations.is_empty()
    }
}

impl Shared {
    /// Asks for chunk `chunk`; `mailbox` is woken when it is mapped or failed.
    pub(crate) fn request_chunk(&self, chunk: u64, mailbox: &Arc<Mailbox>) {
        let mut w = self.work.lock().unwrap_or_else(|p| p.into_inner());
        w.allocs
            .push((chunk, mailbox.clone(), std::time::Instant::now()));
        drop(w);
        self.wake.notify_one();
    }

    /// Asks for chunks `[first, end)` to be unmapped.
    pub(crate) fn request_unmap(&self, u: Unmap) {
        let mut w = self.work.lock().unwrap_or_else(|p| p.into_inner());
        w.unmaps.push(u);
        drop(w);
        self.wake.notify_one();
    }

    /// The volume's chunks now.
    #[inline]
    pub(crate) fn chunks(&self) -> u64 {
        self.size.load(Ordering::Acquire).div_ceil(self.spec.chunk)
    }

    /// Whether chunks wait for their grace period.
    pub(crate) fn retiring(&self) -> bool {
        let r = self.retire.lock().unwrap_or_else(|p| p.into_inner());
        r.waiting.is_some() || !r.next.is_empty()
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}
