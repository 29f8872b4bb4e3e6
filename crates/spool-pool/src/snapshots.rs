//! Snapshots and clones of thin volumes (docs/snapshots.md): recorded in the table, their
//! maps allocated like a volume's, their chunks shared through the pool's
//! [`SharedChunks`](spool_thin::SharedChunks).
//!
//! Order of each operation, so that a crash at any point leaves the table and the maps
//! agreeing (free space and the sharing counts are rebuilt from the maps at open):
//! - snapshot: new zeroed map → the thin device marks, drains and writes the map → commit
//!   the table naming it. Before the commit, the map is named by nothing: its extents and
//!   the chunks only it names are free after a restart.
//! - clone: new zeroed map → the snapshot's entries written into it under the clone's UUID
//!   → commit the table naming the clone.
//! - delete: commit the table without the snapshot → its chunks that no map names any
//!   more, and its map, go back.
//!
//! Owns: the pool's side of snapshots and clones. Must not know: the data path.

use std::sync::Arc;

use serde::Serialize;
use spool_devices::{Device, RbdBackend};
use spool_thin::{SnapshotSpec, ThinBackend};
use uuid::Uuid;

use crate::metadata::{check_volume_name, ThinMap, ThinSnapshot, VolumeEntry};
use crate::{Error, Pool, Result, VolumeInfo};

/// A snapshot as `volume snapshots` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotInfo {
    pub volume: String,
    pub name: String,
    pub uuid: Uuid,
    /// The volume's size when it was taken.
    pub size: u64,
    /// Seconds since the Unix epoch.
    pub created: u64,
    /// Bytes of chunks its map names.
    pub mapped: u64,
    /// Of those, the bytes no other map names: what deleting it gives back.
    pub exclusive: u64,
    /// Why it cannot be used (its map was found corrupt): it can only be deleted.
    pub error: Option<String>,
    /// RBD's own snapshot: `mapped` and `exclusive` are not known here (`rbd du`).
    pub rbd: bool,
}

impl Pool {
    /// Thin volume `id`: its index, entry, map and device.
    fn thin_volume(&self, id: &str) -> Result<(usize, VolumeEntry, Arc<Device>)> {
        let i = self.find(id)?;
        let v = self.table.volumes[i].clone();
        if v.rbd.is_some() {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' is on RBD: its snapshots are RBD's, and changed blocks and NBD exports of them are not built yet (`rbd export-diff --from-snap` reads the changes)",
                v.name
            )));
        }
        if v.thin.is_none() {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' is not thin: only thin and RBD volumes have snapshots (create one with --thin)",
                v.name
            )));
        }
        let dev = self.thin_device(&v)?;
        Ok((i, v, dev))
    }

    /// A new zeroed map for a volume of `size` bytes.
    pub(crate) fn new_map(&mut self, size: u64) -> Result<Vec<crate::metadata::ExtentEntry>> {
        let bytes = self.round_up(spool_thin::map::map_bytes(
            size.div_ceil(self.table.min_extent),
        ))?;
        self.check_space(bytes)?;
        let map = self.allocate(bytes)?;
        if let Err(e) = self.scrub(&map) {
            self.release(&map);
            return Err(e);
        }
        Ok(map)
    }

    /// What a snapshot of thin volume `id` could cost later, before it is taken: the bytes
    /// its copies could need (every chunk the volume maps shared with it, each copied on its
    /// first write after), and the pool's free bytes now. `None` for an RBD volume (the
    /// cluster keeps its snapshots). Other thin volumes' shared chunks draw on the same free
    /// space and are not counted here.
    pub fn snapshot_space(&self, id: &str) -> Result<Option<(u64, u64)>> {
        if self.rbd_volume(id)?.is_some() {
            return Ok(None);
        }
        let (_, v, dev) = self.thin_volume(id)?;
        // What the snapshot itself would refuse is said first, not the space.
        Self::refuse_mirrored_thin(&v, "a snapshot")?;
        let need = thin_backend(&v, &dev)?.allocated();
        let free = self.members.iter().map(|m| m.free_bytes()).sum();
        Ok(Some((need, free)))
    }

    /// Takes snapshot `name` of running thin volume `id` (crash-consistent: every write
    /// completed before it is in it, none started after it).
    pub fn snapshot_volume(&mut self, id: &str, name: &str) -> Result<SnapshotInfo> {
        if let Some((_, v, dev)) = self.rbd_volume(id)? {
            return self.rbd_snapshot(&v, &dev, name);
        }
        let (i, v, dev) = self.thin_volume(id)?;
        Self::refuse_mirrored_thin(&v, "a snapshot")?;
        check_volume_name(name).map_err(Error::invalid)?;
        if v.remote_leg().is_some() {
            // A snapshot of a copy missing writes only the other host holds would not hold
            // every write completed before it.
            self.check_copy_here_complete(&v, "a snapshot")?;
        }
        let t = v.thin.as_ref().expect("thin_volume checked");
        if t.snapshots.iter().any(|s| s.name == name) {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' has a snapshot named '{name}' already",
                v.name
            )));
        }
        let backend = thin_backend(&v, &dev)?;
        let map = self.new_map(v.size)?;
        let snap = ThinSnapshot {
            name: name.into(),
            uuid: Uuid::new_v4(),
            size: v.size,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            map: map.clone(),
        };
        let started = std::time::Instant::now();
        let taken = self.map_store(&v, &map).and_then(|store| {
            let spec = SnapshotSpec {
                uuid: snap.uuid,
                size: v.size,
                store,
            };
            backend.snapshot(&spec).map_err(|e| thin_err(&v, e))
        });
        let chunks = match taken {
            Ok(n) => n,
            Err(e) => {
                self.release(&map);
                return Err(e);
            }
        };
        let mut table = self.table.clone();
        let tm = table.volumes[i].thin.as_mut().expect("thin_volume checked");
        tm.snapshots.push(snap.clone());
        if let Err(e) = self.commit(table) {
            backend.drop_snapshot(snap.uuid);
            self.release(&map);
            return Err(e);
        }
        tracing::info!(volume = %v.name, snapshot = name, chunks, took_ms = started.elapsed().as_secs_f64() * 1e3, "snapshot taken");
        self.snapshot_info(&v, &snap)
    }

    fn snapshot_info(&self, v: &VolumeEntry, s: &ThinSnapshot) -> Result<SnapshotInfo> {
        let chunk = self.table.min_extent;
        let dev = self.thin_device(v)?;
        let backend = thin_backend(v, &dev)?;
        let entries = backend.snapshot_chunks(s.uuid).unwrap_or_default();
        let alone = (entries.iter())
            .filter(|e| !self.space.refs.is_shared(e.1))
            .count() as u64;
        Ok(SnapshotInfo {
            volume: v.name.clone(),
            name: s.name.clone(),
            uuid: s.uuid,
            size: s.size,
            created: s.created,
            mapped: entries.len() as u64 * chunk,
            exclusive: alone * chunk,
            error: backend.snapshot_damage(s.uuid),
            rbd: false,
        })
    }

    /// The snapshots of thin volume `id`, oldest first.
    pub fn snapshots(&self, id: &str) -> Result<Vec<SnapshotInfo>> {
        if let Some((_, v, dev)) = self.rbd_volume(id)? {
            return self.rbd_snapshots(&v, &dev);
        }
        let (_, v, _) = self.thin_volume(id)?;
        let t = v.thin.as_ref().expect("thin_volume checked");
        t.snapshots
            .iter()
            .map(|s| self.snapshot_info(&v, s))
            .collect()
    }

    /// Deletes snapshot `name` of volume `id`: the chunks no other map names go back.
    pub fn delete_snapshot(&mut self, id: &str, name: &str) -> Result<SnapshotInfo> {
        if let Some((_, v, dev)) = self.rbd_volume(id)? {
            return self.rbd_delete_snapshot(&v, &dev, name);
        }
        let (i, v, dev) = self.thin_volume(id)?;
        let t = v.thin.as_ref().expect("thin_volume checked");
        let at = no_such_snapshot(&v, t, name)?;
        let snap = t.snapshots[at].clone();
        let info = self.snapshot_info(&v, &snap)?;
        let mut table = self.table.clone();
        table.volumes[i]
            .thin
            .as_mut()
            .expect("thin")
            .snapshots
            .remove(at);
        self.commit(table)?;
        thin_backend(&v, &dev)?.drop_snapshot(snap.uuid);
        self.release(&snap.map);
        tracing::info!(volume = %v.name, snapshot = name, freed = info.exclusive, "snapshot deleted");
        Ok(info)
    }

    /// Creates thin volume `new` from snapshot `snap` of volume `id`: writable, sharing every
    /// chunk with the snapshot until it writes there (copy on write). Same size, queues and
    /// encryption (the data key too: the chunks hold the snapshot's ciphertext).
    pub fn clone_snapshot(&mut self, id: &str, snap: &str, new: &str) -> Result<VolumeInfo> {
        if let Some((_, v, dev)) = self.rbd_volume(id)? {
            return self.rbd_clone(&v, &dev, snap, new);
        }
        let (_, v, dev) = self.thin_volume(id)?;
        let t = v.thin.as_ref().expect("thin_volume checked");
        let s = t.snapshots[no_such_snapshot(&v, t, snap)?].clone();
        self.check_new_volume(new, s.size, v.num_queues)?;
        let entries = usable_entries(&v, thin_backend(&v, &dev)?, &s)?;
        let mut c = VolumeEntry::new(new, s.size, false, v.num_queues);
        c.encryption = v.encryption.clone();
        let map = self.new_map(s.size)?;
        let written = self.map_store(&c, &map).and_then(|store| {
            spool_thin::map::write_image(&store, c.uuid, &entries).map_err(|e| thin_err(&c, e))
        });
        if let Err(e) = written {
            self.release(&map);
            return Err(e);
        }
        c.thin = Some(ThinMap {
            chunk: t.chunk,
            map: map.clone(),
            snapshots: Vec::new(),
            origin: Some(format!("{}@{}", v.name, s.name)),
        });
        for e in &entries {
            self.space.refs.add(e.1);
        }
        let mut table = self.table.clone();
        table.volumes.push(c.clone());
        if let Err(e) = self.commit(table) {
            for e in &entries {
                self.space.refs.release(e.1);
            }
            self.release(&map);
            return Err(e);
        }
        self.open_thin(&c);
        tracing::info!(volume = %c.name, origin = %format!("{}@{}", v.name, s.name), chunks = entries.len(), "clone created");
        Ok(self.volume_info(&c))
    }
}

impl Pool {
    /// Makes volume `id` hold snapshot `snap`'s data again (the caller makes sure no VM uses
    /// it): the chunks it wrote since are let go. Returns how many chunk entries changed.
    pub fn revert_volume(&mut self, id: &str, snap: &str) -> Result<u64> {
        if let Some((_, v, dev)) = self.rbd_volume(id)? {
            return self.rbd_revert(&v, &dev, snap);
        }
        let (_, v, dev) = self.thin_volume(id)?;
        if let Some(r) = v.remote_leg().and_then(|l| l.remote.as_ref()) {
            // The revert would change the copy here behind the mirror's back.
            return Err(Error::InvalidArgument(format!(
                "volume '{}' is being sent to {}: a revert here would not reach the copy there; finish or cancel the send first",
                v.name, r.uri
            )));
        }
        let t = v.thin.as_ref().expect("thin_volume checked");
        let s = &t.snapshots[no_such_snapshot(&v, t, snap)?];
        let backend = thin_backend(&v, &dev)?;
        usable_entries(&v, backend, s)?;
        let n = backend.revert(s.uuid).map_err(|e| thin_err(&v, e))?;
        tracing::info!(volume = %v.name, snapshot = snap, changed = n, "volume reverted to a snapshot");
        Ok(n)
    }

    /// The thin device of volume `id` to inflate ([`inflate`]), once the pool has room for
    /// a copy of every chunk it shares. The copying needs no lock on the pool.
    pub fn inflating(&self, id: &str) -> Result<Arc<Device>> {
        if let Some((_, _, dev)) = self.rbd_volume(id)? {
            return Ok(dev);
        }
        let (_, v, dev) = self.thin_volume(id)?;
        Self::refuse_mirrored_thin(&v, "inflating (its copies share nothing)")?;
        let need = thin_backend(&v, &dev)?.shared_chunks() * self.table.min_extent;
        let free: u64 = self.members.iter().map(|m| m.free_bytes()).sum();
        if need > free {
            return Err(Error::NoSpace {
                requested: need,
                available: free,
            });
        }
        Ok(dev)
    }

    /// After [`inflate`]: a clone's origin is forgotten.
    pub fn inflated(&mut self, id: &str, chunks: u64) -> Result<()> {
        if self.rbd_volume(id)?.is_some() {
            return Ok(());
        }
        let (i, v, _) = self.thin_volume(id)?;
        if v.thin.as_ref().is_some_and(|t| t.origin.is_some()) {
            let mut table = self.table.clone();
            table.volumes[i].thin.as_mut().expect("thin").origin = None;
            self.commit(table)?;
        }
        tracing::info!(volume = %v.name, chunks, "volume inflated: it shares no chunk now");
        Ok(())
    }

    /// [`Pool::inflating`], [`inflate`] and [`Pool::inflated`] in one (the pool held
    /// throughout: tests, tools).
    pub fn inflate_volume(&mut self, id: &str) -> Result<u64> {
        let dev = self.inflating(id)?;
        let n = inflate(&dev)?;
        self.inflated(id, n)?;
        Ok(n)
    }
}

/// Copies every chunk the thin device `dev` shares with another map (see
/// [`ThinBackend::inflate`]); returns how many were shared.
pub fn inflate(dev: &Arc<Device>) -> Result<u64> {
    let volume = dev.path().display().to_string();
    if let Some(rbd) = RbdBackend::of(dev) {
        rbd.flatten()?;
        tracing::info!(image = %volume, "RBD volume flattened: it depends on no snapshot now");
        return Ok(0);
    }
    let b = ThinBackend::of(dev).ok_or_else(|| Error::Thin {
        volume: volume.clone(),
        why: "not a thin device".into(),
    })?;
    b.inflate().map_err(|e| Error::Thin {
        volume,
        why: e.to_string(),
    })
}

/// The chunks snapshot `s` of `v` names, or why it cannot be used.
pub(crate) fn usable_entries(
    v: &VolumeEntry,
    backend: &ThinBackend,
    s: &ThinSnapshot,
) -> Result<Vec<(u64, spool_thin::map::Placement)>> {
    backend.snapshot_entries(s.uuid).ok_or_else(|| {
        thin_err(
            v,
            match backend.snapshot_damage(s.uuid) {
                Some(why) => format!(
                    "snapshot '{}@{}' cannot be used: its map is corrupt ({why}); it can only be deleted",
                    v.name, s.name
                ),
                None => format!("snapshot '{}' is not loaded", s.name),
            },
        )
    })
}

fn thin_err(v: &VolumeEntry, e: impl std::fmt::Display) -> Error {
    Error::Thin {
        volume: v.name.clone(),
        why: e.to_string(),
    }
}

/// The thin backend under volume `v`'s device `dev` (an error naming `v` if it is not one).
pub(crate) fn thin_backend<'a>(v: &VolumeEntry, dev: &'a Arc<Device>) -> Result<&'a ThinBackend> {
    ThinBackend::of(dev).ok_or_else(|| thin_err(v, "its device is not a thin device"))
}

fn no_such_snapshot(v: &VolumeEntry, t: &ThinMap, name: &str) -> Result<usize> {
    t.snapshots
        .iter()
        .position(|s| s.name == name)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
            "volume '{}' has no snapshot named '{name}'; `spoolctl volume snapshots {}` lists them",
            v.name, v.name
        ))
        })
}
