//! The pool's free space as thin volumes' allocators see it: [`PoolSpace`] (the members'
//! buddy allocators as a `spool_thin::ChunkSource`, shared with every thin allocator thread)
//! and `CopySpace` (the same, restricted to a mirrored thin volume's copy's own devices);
//! what stops allocation (a whole pool frozen, a copy's devices blocked, a device being
//! replaced).
//!
//! Must not know: maps, volumes, the table.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use spool_devices::Device;
use spool_thin::map::Placement;
use spool_thin::{ChunkSource, SharedChunks};
use uuid::Uuid;

use crate::buddy::Buddy;

/// One member as thin allocators see it.
#[derive(Debug)]
pub(crate) struct SpaceMember {
    pub(crate) uuid: Uuid,
    pub(crate) dev: Arc<Device>,
    pub(crate) buddy: Arc<Mutex<Buddy>>,
}

/// The pool's free space for thin volumes' chunks: the members' buddy allocators (order 0,
/// one minimum extent per chunk), refreshed whenever the table is committed.
#[derive(Debug, Default)]
pub struct PoolSpace {
    pub(crate) members: RwLock<Vec<SpaceMember>>,
    /// Why nothing may be allocated: a thin volume's map could not be read, so which chunks
    /// it names is unknown (until a start reads it).
    frozen: RwLock<Option<String>>,
    /// Chunks taken and not settled yet (zeroing, their map entry being written).
    in_flight: AtomicUsize,
    /// A device being replaced: kept out of `members` by every refresh until the replace
    /// ends (its commits, a thin map's move among them, refresh the members).
    pub(crate) excluded: RwLock<Option<Uuid>>,
    /// Chunks named by more than one map (snapshots, clones), rebuilt from every map at
    /// open.
    pub(crate) refs: SharedChunks,
    /// Devices nothing is allocated on, by the map that keeps them so: a mirrored thin
    /// volume's copy whose map could not be read (which of their blocks it names is unknown)
    /// until the copy is made anew. The rest of the pool allocates as before.
    blocked: RwLock<Vec<(Uuid, Vec<Uuid>)>>,
    /// The chunks of a mirrored thin volume's copy that is not served (a device of its group
    /// missing) though its map read clean: marked taken at open, given back with the map.
    pub(crate) unserved: Mutex<HashMap<Uuid, Vec<Placement>>>,
}

/// The pool's free space as one copy of a mirrored thin volume sees it: its own devices
/// only.
#[derive(Debug)]
pub(crate) struct CopySpace {
    space: Arc<PoolSpace>,
    devices: Vec<Uuid>,
}

impl CopySpace {
    pub(crate) fn new(space: &Arc<PoolSpace>, devices: &[Uuid]) -> Arc<CopySpace> {
        Arc::new(CopySpace {
            space: space.clone(),
            devices: devices.to_vec(),
        })
    }
}

impl ChunkSource for CopySpace {
    fn take(&self) -> Option<(Uuid, Arc<Device>, u64)> {
        self.space.take_on(&|u| self.devices.contains(&u))
    }

    fn give_back(&self, device: Uuid, offset: u64) {
        self.space.give_back(device, offset)
    }

    fn shared_chunks(&self) -> &SharedChunks {
        self.space.shared_chunks()
    }

    fn settled(&self, n: usize) {
        self.space.settled(n)
    }
}

impl PoolSpace {
    pub(crate) fn freeze(&self, why: String) {
        tracing::error!(why = %why, "no space is allocated in this pool until the map can be read (restart spoold once its device is back)");
        *self.frozen.write().unwrap_or_else(|p| p.into_inner()) = Some(why);
    }

    /// Why allocation is stopped, if it is.
    pub(crate) fn frozen(&self) -> Option<String> {
        self.frozen
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Keeps `devices` (a mirrored thin volume's copy's, whose map `key` cannot be read) out
    /// of every allocation until [`PoolSpace::unblock`].
    pub(crate) fn block(&self, key: Uuid, devices: &[Uuid], why: &str) {
        tracing::error!(map = %key, ?devices, why = %why, "a mirrored thin volume's copy is not served: nothing is allocated on its devices until it is made anew (device replace)");
        let mut blocked = self.blocked.write().unwrap_or_else(|p| p.into_inner());
        blocked.retain(|b| b.0 != key);
        blocked.push((key, devices.to_vec()));
    }

    /// The copy whose map was `key` was made anew: its devices take allocations again.
    pub(crate) fn unblock(&self, key: Uuid) {
        let mut blocked = self.blocked.write().unwrap_or_else(|p| p.into_inner());
        blocked.retain(|b| b.0 != key);
    }

    /// Whether nothing may be allocated on device `uuid` (see [`PoolSpace::block`]).
    pub(crate) fn blocked(&self, uuid: Uuid) -> bool {
        let blocked = self.blocked.read().unwrap_or_else(|p| p.into_inner());
        blocked.iter().any(|b| b.1.contains(&uuid))
    }

    /// Takes `uuid` out of what thin allocators may use (a device being replaced), and waits
    /// (up to 5 s) until no chunk taken before is still being allocated, so that the maps
    /// name every chunk on it. False when allocations did not settle in time.
    pub(crate) fn exclude(&self, uuid: Uuid) -> bool {
        *self.excluded.write().unwrap_or_else(|p| p.into_inner()) = Some(uuid);
        self.members
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|m| m.uuid != uuid);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while self.in_flight.load(Ordering::Acquire) > 0 {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// The replace ended: the next refresh lets thin allocators use every member again.
    pub(crate) fn end_exclusion(&self) {
        *self.excluded.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Takes a free chunk from the member with the most free space among those `ok` accepts.
    pub(crate) fn take_on(&self, ok: &dyn Fn(Uuid) -> bool) -> Option<(Uuid, Arc<Device>, u64)> {
        if self
            .frozen
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
        {
            return None;
        }
        let members = self.members.read().unwrap_or_else(|p| p.into_inner());
        let mut by_free: Vec<&SpaceMember> = members
            .iter()
            .filter(|m| ok(m.uuid) && !m.dev.health().state().isolated() && !self.blocked(m.uuid))
            .collect();
        by_free.sort_by_key(|m| {
            std::cmp::Reverse(
                m.buddy
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .free_bytes(),
            )
        });
        let got = by_free.into_iter().find_map(|m| {
            let off = m.buddy.lock().unwrap_or_else(|p| p.into_inner()).alloc(0)?;
            Some((m.uuid, m.dev.clone(), off))
        });
        if got.is_some() {
            // Counted under the members' lock: an `exclude` waits for it.
            self.in_flight.fetch_add(1, Ordering::AcqRel);
        }
        got
    }
}

impl ChunkSource for PoolSpace {
    fn take(&self) -> Option<(Uuid, Arc<Device>, u64)> {
        self.take_on(&|_| true)
    }

    fn settled(&self, n: usize) {
        self.in_flight.fetch_sub(n, Ordering::AcqRel);
    }

    fn shared_chunks(&self) -> &SharedChunks {
        &self.refs
    }

    fn give_back(&self, device: Uuid, offset: u64) {
        let members = self.members.read().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = members.iter().find(|m| m.uuid == device) {
            m.buddy
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .free(offset, 0);
        }
    }
}
