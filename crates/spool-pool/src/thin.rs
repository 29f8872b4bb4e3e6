//! Thin volumes in the pool (docs/thin.md): their maps in the table, their chunks taken
//! from and given back to the members' buddy allocators, their devices.
//!
//! Owns: opening each thin map once per process (a volume's own, or each copy's of a
//! mirrored one) and marking its chunks taken, with its chunk source (`thin_space.rs`: the
//! pool's free space, or a copy's share of it); growing and deleting thin volumes
//! (`thin_create.rs` creates them). Must not know: the data path (spool-thin's queues),
//! virtio.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use spool_devices::Device;
use spool_thin::map::Placement;
use spool_thin::map::{MapExtent, MapStore};
use spool_thin::{ChunkSource, MapScan, ScanProblem, SnapshotSpec, ThinBackend, ThinSpec};
use uuid::Uuid;

use crate::metadata::{ExtentEntry, VolumeEntry};
use crate::thin_maps::{map_refs, MapRef};
use crate::thin_space::{CopySpace, SpaceMember};
use crate::{Error, Pool, Result, VolumeInfo};

/// How long a write needing a chunk waits for free space on a full pool by default.
pub const DEFAULT_FULL_WAIT: Duration = Duration::from_secs(20);

/// Thin volumes' devices by volume: opened once per process (one allocator per map), or why
/// the volume cannot be served.
pub(crate) type ThinCache = HashMap<Uuid, std::result::Result<Arc<Device>, Arc<Error>>>;

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

    /// The spec of one of thin volume `v`'s maps.
    pub(crate) fn thin_spec(&self, v: &VolumeEntry, m: &MapRef) -> Result<ThinSpec> {
        let mut snapshots = Vec::new();
        for s in m.snapshots {
            snapshots.push(SnapshotSpec {
                uuid: s.uuid,
                size: s.size,
                store: self.map_store(v, &s.map)?,
            });
        }
        let path = match m.slot {
            None => format!("thin:{}", v.name),
            Some(slot) => format!("thin:{}/leg{slot}", v.name),
        };
        Ok(ThinSpec {
            volume: m.key,
            path: path.into(),
            size: v.size,
            chunk: m.chunk,
            chunk_base: crate::metadata::METADATA_AREA,
            store: self.map_store(v, m.map)?,
            full_wait: self.opts.thin_full_wait,
            inline_io: !self.members.is_empty() && self.members.iter().all(|m| m.dev.inline_io()),
            snapshots,
            // (A copy with a device not in the pool now is not served: `start_scanned`.)
            copy_devices: (m.devices.iter())
                .filter_map(|u| self.members.iter().find(|x| x.uuid == *u))
                .map(|x| x.dev.clone())
                .collect(),
        })
    }

    /// Reads one of thin volume `v`'s maps (with its snapshots'); an error when they cannot
    /// be read at all (which chunks they name is unknown: allocation stops).
    fn scan_thin(&self, v: &VolumeEntry, m: &MapRef) -> Result<(ThinSpec, MapScan)> {
        let spec = match self.thin_spec(v, m) {
            Ok(spec) => spec,
            // A copy's chunks lie on its own devices only: they alone are kept out.
            Err(e) if !m.devices.is_empty() => {
                self.space.block(m.key, m.devices, &e.to_string());
                return Err(e);
            }
            Err(e) => {
                self.space
                    .freeze(format!("thin volume '{}'{}: {e}", v.name, m.of()));
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

    /// Serves a scanned map of thin volume `v` (refused when its scan found a problem): its
    /// chunks come from the whole pool, or a mirrored copy's from its own devices only.
    fn start_scanned(
        &self,
        v: &VolumeEntry,
        m: &MapRef,
        spec: ThinSpec,
        scan: MapScan,
    ) -> Result<Arc<Device>> {
        let thin_err = |why: String| Error::Thin {
            volume: v.name.clone(),
            why: format!("{}{why}", m.prefix()),
        };
        match &scan.problem {
            Some(ScanProblem::Unreadable(why)) if !m.devices.is_empty() => {
                self.space.block(m.key, m.devices, why)
            }
            Some(ScanProblem::Unreadable(why)) => {
                self.space
                    .freeze(format!("thin volume '{}'{}: its map {why}", v.name, m.of()))
            }
            _ => {}
        }
        // A copy that lost a device has lost chunks: it fails whole, until made anew.
        let member = |u: &Uuid| self.members.iter().any(|x| x.uuid == *u);
        if let Some(gone) = m.devices.iter().find(|u| !member(u)) {
            let why = format!("its device {gone} is missing: the copy is failed until it is made anew (device replace)");
            self.space.block(m.key, m.devices, &why);
            return Err(thin_err(why));
        }
        let source: Arc<dyn ChunkSource> = match m.devices.is_empty() {
            true => self.space.clone(),
            false => CopySpace::new(&self.space, m.devices),
        };
        ThinBackend::start(spec, source, scan).map_err(|e| thin_err(e.to_string()))
    }

    /// Opens thin volume `v`'s maps whose chunks are accounted for already (a new volume, a
    /// clone), each into the cache.
    pub(crate) fn open_thin(&self, v: &VolumeEntry) {
        self.open_maps(v, |_| true)
    }

    /// [`Self::open_thin`] for the maps whose key `which` accepts only.
    pub(crate) fn open_maps(&self, v: &VolumeEntry, which: impl Fn(Uuid) -> bool) {
        for m in map_refs(v).into_iter().filter(|m| which(m.key)) {
            let opened = self
                .scan_thin(v, &m)
                .and_then(|(spec, scan)| self.start_scanned(v, &m, spec, scan))
                .map_err(Arc::new);
            self.thins
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(m.key, opened);
        }
    }

    /// At start, after the allocators are rebuilt from the table: every thin volume's maps
    /// are read, the chunks they name marked taken (each once, however many maps name it)
    /// and counted ([`SharedChunks`]). A map that is unreadable or corrupt is not served (and
    /// says why); the others are.
    pub(crate) fn open_thins(&mut self) {
        self.refresh_space();
        let mut scans = Vec::new();
        for v in &self.table.volumes {
            for m in map_refs(v) {
                let scan = self.scan_thin(v, &m);
                scans.push((v, m, scan));
            }
        }
        let mut named: HashMap<Placement, (u64, u32)> = HashMap::new();
        for (v, m, scan) in &mut scans {
            let Ok((_, scan)) = scan else { continue };
            for (uuid, why) in &scan.damaged {
                tracing::error!(volume = %v.name, snapshot = %uuid, why = %why, "a snapshot's map is corrupt: the volume is served, the snapshot can only be deleted");
            }
            for &(i, p) in &scan.placements {
                let outside = !m.devices.is_empty() && !m.devices.contains(&p.device);
                let why = match outside {
                    true => Some(format!(
                        "chunk {i} is on device {}, not one of this copy's",
                        p.device
                    )),
                    false => self.mark_named(&mut named, i, p),
                };
                if let Some(why) = why {
                    let why = format!("volume '{}'{}: {why}", v.name, m.of());
                    scan.problem.get_or_insert(ScanProblem::Corrupt(why));
                }
            }
        }
        let counts = named.iter().map(|(&p, &(_, n))| (p, n)).collect();
        self.space.refs.rebuild(&counts);
        let mut cache = ThinCache::new();
        for (v, m, scan) in scans {
            // Only a clean scan's chunks are all this map's to give back (a refused one may
            // name another's).
            let clean = scan.as_ref().ok().filter(|s| s.1.problem.is_none());
            let named = clean.map(|s| s.1.placements.clone());
            let opened = scan
                .and_then(|(spec, scan)| self.start_scanned(v, &m, spec, scan))
                .map_err(|e| {
                    tracing::error!(volume = %v.name, copy = ?m.slot, error = %e, "thin volume not served");
                    Arc::new(e)
                });
            if let (Err(_), Some(named), false) = (&opened, named, m.devices.is_empty()) {
                let mut unserved = self
                    .space
                    .unserved
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                unserved.insert(m.key, named.into_iter().map(|(_, p)| p).collect());
            }
            cache.insert(m.key, opened);
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

    /// The device of thin volume `v`: its own map's, or a mirrored thin volume's first
    /// copy's once it has no map of its own.
    pub(crate) fn thin_device(&self, v: &VolumeEntry) -> Result<Arc<Device>> {
        let own = v.thin.as_ref().is_some_and(|t| !t.map.is_empty());
        match v.leg_maps().next() {
            Some((_, m)) if !own => self.map_device(v, m.uuid),
            _ => self.map_device(v, v.uuid),
        }
    }

    /// The device of thin volume `v`'s map `key` (the volume's UUID: its own map's; a
    /// mirrored copy's map UUID: that copy's).
    pub(crate) fn map_device(&self, v: &VolumeEntry, key: Uuid) -> Result<Arc<Device>> {
        let cache = self.thins.lock().unwrap_or_else(|p| p.into_inner());
        match cache.get(&key) {
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

    /// Grows thin volume `i` to `new_size` bytes: recorded in the table, then the thin
    /// device serves it (its new chunks are holes; no space is taken). Up to what its map's
    /// extents hold.
    /// A mirrored thin volume grows every copy (each its own map), served or not: a copy
    /// that is not served is made anew at the new size by the replace that brings it back.
    pub(crate) fn resize_thin_volume(&mut self, i: usize, new_size: u64) -> Result<VolumeInfo> {
        let v = self.table.volumes[i].clone();
        let devs: Vec<Arc<Device>> = (map_refs(&v).iter())
            .filter_map(|m| self.map_device(&v, m.key).ok())
            .collect();
        if devs.is_empty() {
            self.thin_device(&v)?;
        }
        let mut backends = Vec::new();
        for dev in &devs {
            backends.push(crate::snapshots::thin_backend(&v, dev)?);
        }
        let max = backends.iter().map(|t| t.max_size()).min().unwrap_or(0);
        if new_size > max {
            return Err(Error::InvalidArgument(format!(
                "thin volume '{}' can grow up to {max} bytes (what its map holds); growing it further is not supported yet",
                v.name
            )));
        }
        // Every copy first (it only changes the size they serve): the table then never says
        // more than one of them holds. A failed commit leaves them larger than the volume,
        // which the layout (the table's size) never reads past.
        for t in backends {
            t.grow(new_size).map_err(|e| Error::Thin {
                volume: v.name.clone(),
                why: e.to_string(),
            })?;
        }
        let mut table = self.table.clone();
        table.volumes[i].size = new_size;
        self.commit(table)?;
        tracing::info!(volume = %v.name, from = v.size, to = new_size, "thin volume grown");
        Ok(self.volume_info(&self.table.volumes[i]))
    }

    /// Stops the allocator of thin map `uuid` (a volume's own, or a mirrored copy's) and
    /// gives back every chunk the map names (after the table without it is committed).
    pub(crate) fn release_thin(&self, uuid: Uuid) {
        let dev = self
            .thins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&uuid);
        let unserved = (self
            .space
            .unserved
            .lock()
            .unwrap_or_else(|p| p.into_inner()))
        .remove(&uuid);
        let placements = match (dev, unserved) {
            (Some(Ok(dev)), _) => {
                let Some(t) = ThinBackend::of(&dev) else {
                    return;
                };
                t.shut_down();
                t.placements()
            }
            (_, Some(named)) => named,
            _ => return,
        };
        for p in placements {
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

    /// Whether thin volume `v` keeps any chunk (data, not its map) on device `uuid`, in any
    /// of its copies.
    pub(crate) fn thin_chunks_on(&self, v: &VolumeEntry, uuid: Uuid) -> bool {
        map_refs(v).iter().any(|m| self.map_chunks_on(m.key, uuid))
    }

    /// Whether thin map `key` names any chunk on device `uuid`.
    pub(crate) fn map_chunks_on(&self, key: Uuid, uuid: Uuid) -> bool {
        let cache = self.thins.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .get(&key)
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
#[derive(Debug, Default, Clone)]
pub(crate) struct ThinState {
    pub(crate) mapped: u64,
    pub(crate) waiting_for_space: u64,
    pub(crate) max_size: u64,
    pub(crate) error: Option<String>,
}
