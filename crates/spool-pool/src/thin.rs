//! Thin volumes in the pool (docs/thin.md): their maps in the table, their chunks taken
//! from and given back to the members' buddy allocators, their devices.
//!
//! Owns: [`PoolSpace`] (the pool's free space as a `spool_thin::ChunkSource`, shared with
//! every thin volume's allocator thread), opening each thin volume once per process and
//! marking its chunks taken, creating and deleting thin volumes. Must not know: the data
//! path (spool-thin's queues), virtio.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use spool_devices::Device;
use spool_thin::map::Placement;
use spool_thin::map::{MapExtent, MapStore};
use spool_thin::{
    ChunkSource, MapScan, ScanProblem, SharedChunks, SnapshotSpec, ThinBackend, ThinSpec,
};
use uuid::Uuid;

use crate::buddy::Buddy;
use crate::encryption::NewKey;
use crate::metadata::{ExtentEntry, ThinMap, VolumeEntry};
use crate::{Error, Pool, Result, VolumeInfo};

/// How long a write needing a chunk waits for free space on a full pool by default.
pub const DEFAULT_FULL_WAIT: Duration = Duration::from_secs(20);

/// Thin volumes' devices by volume: opened once per process (one allocator per map), or why
/// the volume cannot be served.
pub(crate) type ThinCache = HashMap<Uuid, std::result::Result<Arc<Device>, Arc<Error>>>;

/// One member as thin allocators see it.
#[derive(Debug)]
pub(crate) struct SpaceMember {
    pub(crate) uuid: Uuid,
    dev: Arc<Device>,
    buddy: Arc<Mutex<Buddy>>,
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
    excluded: RwLock<Option<Uuid>>,
    /// Chunks named by more than one map (snapshots, clones), rebuilt from every map at
    /// open.
    pub(crate) refs: SharedChunks,
}

impl PoolSpace {
    fn freeze(&self, why: String) {
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
}

impl ChunkSource for PoolSpace {
    fn take(&self) -> Option<(Uuid, Arc<Device>, u64)> {
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
            .filter(|m| !m.dev.health().state().isolated())
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

impl Pool {
    /// Publishes the current members to thin volumes' allocators.
    pub(crate) fn refresh_space(&self) {
        let excluded = *self
            .space
            .excluded
            .read()
            .unwrap_or_else(|p| p.into_inner());
        let fresh = self
            .members
            .iter()
            .filter(|m| Some(m.uuid) != excluded)
            .map(|m| SpaceMember {
                uuid: m.uuid,
                dev: m.dev.clone(),
                buddy: m.buddy.clone(),
            })
            .collect();
        *self
            .space
            .members
            .write()
            .unwrap_or_else(|p| p.into_inner()) = fresh;
    }

    /// The store of a map on `extents` (of volume `v`, for errors).
    pub(crate) fn map_store(&self, v: &VolumeEntry, extents: &[ExtentEntry]) -> Result<MapStore> {
        let thin_err = |why: String| Error::Thin {
            volume: v.name.clone(),
            why,
        };
        let mut out = Vec::new();
        for e in extents {
            let m = (self.members.iter().find(|m| m.uuid == e.device)).ok_or_else(|| {
                thin_err(format!("a map is on device {}, which is missing", e.device))
            })?;
            out.push(MapExtent {
                device: m.dev.clone(),
                offset: e.offset,
                len: self.table.min_extent << e.order,
            });
        }
        MapStore::new(out).map_err(|e| thin_err(e.to_string()))
    }

    pub(crate) fn thin_spec(&self, v: &VolumeEntry, t: &ThinMap) -> Result<ThinSpec> {
        let mut snapshots = Vec::new();
        for s in &t.snapshots {
            snapshots.push(SnapshotSpec {
                uuid: s.uuid,
                size: s.size,
                store: self.map_store(v, &s.map)?,
            });
        }
        Ok(ThinSpec {
            volume: v.uuid,
            path: format!("thin:{}", v.name).into(),
            size: v.size,
            chunk: t.chunk,
            chunk_base: crate::metadata::METADATA_AREA,
            store: self.map_store(v, &t.map)?,
            full_wait: self.opts.thin_full_wait,
            inline_io: !self.members.is_empty() && self.members.iter().all(|m| m.dev.inline_io()),
            snapshots,
        })
    }

    /// Reads thin volume `v`'s maps (its own and its snapshots'); `None` when they cannot
    /// be read at all (which chunks they name is unknown: allocation stops).
    fn scan_thin(&self, v: &VolumeEntry, t: &ThinMap) -> Result<(ThinSpec, MapScan)> {
        let spec = match self.thin_spec(v, t) {
            Ok(spec) => spec,
            Err(e) => {
                self.space.freeze(format!("thin volume '{}': {e}", v.name));
                return Err(e);
            }
        };
        let members: Vec<(Uuid, Arc<Device>)> = self
            .members
            .iter()
            .map(|m| (m.uuid, m.dev.clone()))
            .collect();
        let resolve = move |u: Uuid| members.iter().find(|m| m.0 == u).map(|m| m.1.clone());
        let scan = ThinBackend::scan(&spec, &resolve);
        Ok((spec, scan))
    }

    /// Serves a scanned thin volume (refused when its scan found a problem).
    fn start_scanned(&self, v: &VolumeEntry, spec: ThinSpec, scan: MapScan) -> Result<Arc<Device>> {
        if let Some(ScanProblem::Unreadable(why)) = &scan.problem {
            self.space
                .freeze(format!("thin volume '{}': its map {why}", v.name));
        }
        ThinBackend::start(spec, self.space.clone(), scan).map_err(|e| Error::Thin {
            volume: v.name.clone(),
            why: e.to_string(),
        })
    }

    /// Opens a thin volume whose chunks are accounted for already (a new one, a clone).
    pub(crate) fn open_thin(&self, v: &VolumeEntry, t: &ThinMap) -> Result<Arc<Device>> {
        let (spec, scan) = self.scan_thin(v, t)?;
        self.start_scanned(v, spec, scan)
    }

    /// At start, after the allocators are rebuilt from the table: every thin volume's maps
    /// are read, the chunks they name marked taken (each once, however many maps name it)
    /// and counted ([`SharedChunks`]). A volume whose map is unreadable or corrupt is not
    /// served (and says why); the others are.
    pub(crate) fn open_thins(&mut self) {
        self.refresh_space();
        let mut scans = Vec::new();
        for v in &self.table.volumes {
            let Some(t) = &v.thin else { continue };
            scans.push((v.clone(), self.scan_thin(v, t)));
        }
        let mut named: HashMap<Placement, (u64, u32)> = HashMap::new();
        for (v, scan) in &mut scans {
            let Ok((_, scan)) = scan else { continue };
            for (uuid, why) in &scan.damaged {
                tracing::error!(volume = %v.name, snapshot = %uuid, why = %why, "a snapshot's map is corrupt: the volume is served, the snapshot can only be deleted");
            }
            for &(i, p) in &scan.placements {
                if let Some(why) = self.mark_named(&mut named, i, p) {
                    let why = format!("volume '{}': {why}", v.name);
                    scan.problem.get_or_insert(ScanProblem::Corrupt(why));
                }
            }
        }
        let counts = named.iter().map(|(&p, &(_, n))| (p, n)).collect();
        self.space.refs.rebuild(&counts);
        let mut cache = ThinCache::new();
        for (v, scan) in scans {
            let opened = scan
                .and_then(|(spec, scan)| self.start_scanned(&v, spec, scan))
                .map_err(|e| {
                    tracing::error!(volume = %v.name, error = %e, "thin volume not served");
                    Arc::new(e)
                });
            cache.insert(v.uuid, opened);
        }
        *self.thins.lock().unwrap_or_else(|p| p.into_inner()) = cache;
    }

    /// Counts one more map naming chunk `p` at entry `i`, marking it taken the first time;
    /// why the map naming it is refused, if it is: the chunk is named at another entry too
    /// (maps share a chunk at the same entry only), or something else holds it.
    fn mark_named(
        &self,
        named: &mut HashMap<Placement, (u64, u32)>,
        i: u64,
        p: Placement,
    ) -> Option<String> {
        if let Some((at, n)) = named.get_mut(&p) {
            if *at != i {
                return Some(format!(
                    "a chunk at {} on device {} is named at entries {at} and {i}",
                    p.offset, p.device
                ));
            }
            *n += 1;
            return None;
        }
        named.insert(p, (i, 1));
        let m = self.members.iter().find(|m| m.uuid == p.device)?; // Not here: its I/O fails.
                                                                   // Kept by its first owner; this map is refused.
        m.alloc_at(p.offset, 0).err().map(|why| {
            format!(
                "a chunk at {} on device {} is used twice: {why}",
                p.offset, p.device
            )
        })
    }

    /// The device of thin volume `v`.
    pub(crate) fn thin_device(&self, v: &VolumeEntry) -> Result<Arc<Device>> {
        let cache = self.thins.lock().unwrap_or_else(|p| p.into_inner());
        match cache.get(&v.uuid) {
            Some(Ok(d)) => Ok(d.clone()),
            Some(Err(why)) => Err(Error::Thin {
                volume: v.name.clone(),
                why: why.to_string(),
            }),
            None => Err(Error::Thin {
                volume: v.name.clone(),
                why: "its map was never opened".into(),
            }),
        }
    }

    /// Creates a thin volume: only its map is allocated (zeroed: every chunk a hole).
    pub fn create_thin_volume(
        &mut self,
        name: &str,
        size: u64,
        read_only: bool,
        num_queues: u16,
        encrypt: bool,
    ) -> Result<VolumeInfo> {
        let key = match encrypt {
            true => NewKey::Fresh,
            false => NewKey::Plain,
        };
        self.create_thin_with(name, size, read_only, num_queues, key)
    }

    /// Creates thin volume `name` for a transfer from another host (docs/transfer.md): as
    /// the sender has it, under the sender's data key if it is encrypted.
    pub fn create_received_thin_volume(
        &mut self,
        name: &str,
        size: u64,
        num_queues: u16,
        key: Option<crate::metadata::VolumeKey>,
    ) -> Result<VolumeInfo> {
        let key = key.map_or(NewKey::Plain, NewKey::Given);
        self.create_thin_with(name, size, false, num_queues, key)
    }

    fn create_thin_with(
        &mut self,
        name: &str,
        size: u64,
        read_only: bool,
        num_queues: u16,
        key: NewKey,
    ) -> Result<VolumeInfo> {
        self.check_new_volume(name, size, num_queues)?;
        let chunk = self.table.min_extent;
        let map_bytes = spool_thin::map::map_bytes(size.div_ceil(chunk));
        let bytes = self.round_up(map_bytes)?;
        self.check_space(bytes)?;
        let mut v = VolumeEntry::new(name, size, read_only, num_queues);
        v.encryption = match key {
            NewKey::Plain => None,
            NewKey::Fresh => Some(self.new_volume_key(&v)?),
            NewKey::Given(k) => Some(self.check_received_key(&v, k)?),
        };
        let encrypt = v.encryption.is_some();
        let map = self.allocate(bytes)?;
        if let Err(e) = self.scrub(&map) {
            self.release(&map);
            return Err(e);
        }
        v.thin = Some(ThinMap {
            chunk,
            map: map.clone(),
            snapshots: Vec::new(),
            origin: None,
        });
        let mut table = self.table.clone();
        table.volumes.push(v.clone());
        if let Err(e) = self.commit(table) {
            self.release(&map);
            return Err(e);
        }
        let t = v.thin.as_ref().expect("set above");
        let opened = self.open_thin(&v, t).map_err(Arc::new);
        self.thins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(v.uuid, opened);
        tracing::info!(volume = %v.name, uuid = %v.uuid, size, chunk, map_bytes = bytes, encrypted = encrypt, "thin volume created");
        Ok(self.volume_info(&v))
    }

    /// Grows thin volume `i` to `new_size` bytes: recorded in the table, then the thin
    /// device serves it (its new chunks are holes; no space is taken). Up to what its map's
    /// extents hold.
    pub(crate) fn resize_thin_volume(&mut self, i: usize, new_size: u64) -> Result<VolumeInfo> {
        let v = self.table.volumes[i].clone();
        let dev = self.thin_device(&v)?;
        let t = crate::snapshots::thin_backend(&v, &dev)?;
        if new_size > t.max_size() {
            return Err(Error::InvalidArgument(format!(
                "thin volume '{}' can grow up to {} bytes (what its map holds); growing it further is not supported yet",
                v.name,
                t.max_size()
            )));
        }
        let mut table = self.table.clone();
        table.volumes[i].size = new_size;
        self.commit(table)?;
        t.grow(new_size).map_err(|e| Error::Thin {
            volume: v.name.clone(),
            why: e.to_string(),
        })?;
        tracing::info!(volume = %v.name, from = v.size, to = new_size, "thin volume grown");
        Ok(self.volume_info(&self.table.volumes[i]))
    }

    /// Stops thin volume `uuid`'s allocator and gives back every chunk its map names (after
    /// the table without it is committed).
    pub(crate) fn release_thin(&self, uuid: Uuid) {
        let dev = self
            .thins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&uuid);
        let Some(Ok(dev)) = dev else { return };
        let Some(t) = ThinBackend::of(&dev) else {
            return;
        };
        t.shut_down();
        for p in t.placements() {
            if !self.space.refs.release(p) {
                continue; // Another map (a clone's) still names it.
            }
            if let Some(m) = self.members.iter().find(|m| m.uuid == p.device) {
                m.free(p.offset, 0);
            }
        }
    }

    /// Whether thin volume `v` keeps its map or any chunk on device `uuid`.
    pub(crate) fn thin_uses(&self, v: &VolumeEntry, uuid: Uuid) -> bool {
        (v.thin.is_some() && v.all_extents().any(|e| e.device == uuid))
            || self.thin_chunks_on(v, uuid)
    }

    /// Whether thin volume `v` keeps any chunk (data, not its map) on device `uuid`.
    pub(crate) fn thin_chunks_on(&self, v: &VolumeEntry, uuid: Uuid) -> bool {
        let cache = self.thins.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .get(&v.uuid)
            .and_then(|d| d.as_ref().ok())
            .and_then(|d| ThinBackend::of(d))
            .is_some_and(|t| t.placements().iter().any(|p| p.device == uuid))
    }

    /// Thin volume `uuid` now, as `volume show` tells it.
    pub(crate) fn thin_state(&self, uuid: Uuid) -> ThinState {
        let cache = self.thins.lock().unwrap_or_else(|p| p.into_inner());
        match cache.get(&uuid) {
            Some(Ok(d)) => ThinBackend::of(d).map_or_else(ThinState::default, |t| ThinState {
                mapped: t.allocated(),
                waiting_for_space: t.waiting_for_space(),
                max_size: t.max_size(),
                error: None,
            }),
            Some(Err(why)) => ThinState {
                error: Some(why.to_string()),
                ..Default::default()
            },
            None => ThinState::default(),
        }
    }
}

/// A thin volume now (see [`Pool::thin_state`]).
#[derive(Debug, Default)]
pub(crate) struct ThinState {
    pub(crate) mapped: u64,
    pub(crate) waiting_for_space: u64,
    pub(crate) max_size: u64,
    pub(crate) error: Option<String>,
}
