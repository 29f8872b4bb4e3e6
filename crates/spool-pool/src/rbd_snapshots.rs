//! Snapshots and clones of RBD volumes (docs/ceph.md, "Snapshots and clones"): RBD's own,
//! through the image handle the volume is served by, so the same commands work on thin and
//! RBD volumes. The cluster keeps them, not the pool table: any spoold serving the image,
//! and the `rbd` tool, sees the same snapshots.
//!
//! Owns: mapping `volume snapshot`, `snapshots`, `snapshot delete`, `clone`, `revert` and
//! `inflate` to the image. Must not know: librbd (spool-devices' `RbdBackend` calls it).

use std::sync::Arc;

use spool_devices::{Device, RbdBackend, RbdSnapshot};
use uuid::Uuid;

use crate::metadata::{check_volume_name, VolumeEntry};
use crate::{Error, Pool, Result, SnapshotInfo, VolumeInfo};

/// The RBD backend of RBD volume `v`'s device.
fn backend<'a>(v: &VolumeEntry, dev: &'a Arc<Device>) -> Result<&'a RbdBackend> {
    RbdBackend::of(dev).ok_or_else(|| {
        Error::InvalidArgument(format!("volume '{}': its device is not RBD", v.name))
    })
}

fn info(v: &VolumeEntry, s: &RbdSnapshot) -> SnapshotInfo {
    SnapshotInfo {
        volume: v.name.clone(),
        name: s.name.clone(),
        // RBD names a snapshot by its id within the image.
        uuid: Uuid::from_u64_pair(0, s.id),
        size: s.size,
        created: s.created,
        // What a snapshot holds is RBD's to count (`rbd du`).
        mapped: 0,
        exclusive: 0,
        error: None,
        rbd: true,
    }
}

impl Pool {
    /// Refuses, before anything is stopped, to delete RBD volume `id` when its image would
    /// be removed and still has snapshots (librbd would refuse after the volume went
    /// offline). A volume not on RBD passes.
    pub fn check_delete(&self, id: &str, remove_image: bool) -> Result<()> {
        let Some((_, v, dev)) = self.rbd_volume(id)? else {
            return Ok(());
        };
        let removed = remove_image || v.rbd.as_ref().is_some_and(|r| r.created);
        let snaps = match removed {
            true => backend(&v, &dev)?.snapshots().map_err(|e| rbd_err(&v, e))?,
            false => Vec::new(),
        };
        if let Some(s) = snaps.first() {
            return Err(Error::InvalidArgument(format!(
                "volume '{}': RBD image {} has snapshots ({}, the first {}@{}): delete them first (`spoolctl volume snapshots {}` lists them); the volume is kept and served",
                v.name,
                v.rbd.as_ref().map(|r| r.spec()).unwrap_or_default(),
                snaps.len(),
                v.name,
                s.name,
                v.name
            )));
        }
        Ok(())
    }

    /// Volume `id` when it is on RBD: its index, entry and device.
    pub(crate) fn rbd_volume(&self, id: &str) -> Result<Option<(usize, VolumeEntry, Arc<Device>)>> {
        let i = self.find(id)?;
        let v = self.table.volumes[i].clone();
        let Some(r) = v.rbd.clone() else {
            return Ok(None);
        };
        let dev = self.rbd_device(&v, &r)?;
        Ok(Some((i, v, dev)))
    }

    pub(crate) fn rbd_snapshot(
        &self,
        v: &VolumeEntry,
        dev: &Arc<Device>,
        name: &str,
    ) -> Result<SnapshotInfo> {
        check_volume_name(name).map_err(Error::invalid)?;
        let b = backend(v, dev)?;
        let started = std::time::Instant::now();
        b.snapshot_create(name).map_err(|e| rbd_err(v, e))?;
        let snap = find(v, b, name)?;
        tracing::info!(volume = %v.name, snapshot = name, took_ms = started.elapsed().as_secs_f64() * 1e3, "RBD snapshot taken");
        Ok(info(v, &snap))
    }

    pub(crate) fn rbd_snapshots(
        &self,
        v: &VolumeEntry,
        dev: &Arc<Device>,
    ) -> Result<Vec<SnapshotInfo>> {
        let snaps = backend(v, dev)?.snapshots().map_err(|e| rbd_err(v, e))?;
        Ok(snaps.iter().map(|s| info(v, s)).collect())
    }

    pub(crate) fn rbd_delete_snapshot(
        &self,
        v: &VolumeEntry,
        dev: &Arc<Device>,
        name: &str,
    ) -> Result<SnapshotInfo> {
        let b = backend(v, dev)?;
        let snap = find(v, b, name)?;
        b.snapshot_remove(name).map_err(|e| rbd_err(v, e))?;
        tracing::info!(volume = %v.name, snapshot = name, "RBD snapshot deleted");
        Ok(info(v, &snap))
    }

    pub(crate) fn rbd_revert(&self, v: &VolumeEntry, dev: &Arc<Device>, name: &str) -> Result<u64> {
        let b = backend(v, dev)?;
        let snap = find(v, b, name)?;
        // A rollback also gives the image the snapshot's size, behind the table's back.
        if snap.size != v.size {
            return Err(Error::InvalidArgument(format!(
                "snapshot '{}@{name}' is {} bytes and the volume {} now: a rollback would resize the image; clone the snapshot instead",
                v.name, snap.size, v.size
            )));
        }
        b.rollback(name).map_err(|e| rbd_err(v, e))?;
        tracing::info!(volume = %v.name, snapshot = name, "RBD volume rolled back to a snapshot");
        Ok(0)
    }

    /// A new RBD volume `new` on an image cloned from snapshot `snap` of RBD volume `v`, in
    /// the same Ceph pool and named as the volume; removed with it.
    pub(crate) fn rbd_clone(
        &mut self,
        v: &VolumeEntry,
        dev: &Arc<Device>,
        snap: &str,
        new: &str,
    ) -> Result<VolumeInfo> {
        let b = backend(v, dev)?;
        find(v, b, snap)?;
        self.check_new_volume(new, v.size, v.num_queues)
            .or_else(|e| match e {
                Error::NoDevices => Ok(()), // An RBD volume needs no pool device.
                e => Err(e),
            })?;
        let pool = v.rbd.as_ref().map(|r| r.pool.clone()).unwrap_or_default();
        let spec = b.clone_snapshot(snap, new).map_err(|e| rbd_err(v, e))?;
        // Owned: deleting the clone removes its image (recorded in the one commit).
        let target = crate::RbdTarget {
            pool: &pool,
            attach: Some(new),
            owned: true,
        };
        match self.create_rbd_volume(new, None, false, v.num_queues, &target) {
            Ok(info) => {
                tracing::info!(volume = %new, image = %spec, origin = %format!("{}@{snap}", v.name), "RBD clone created");
                Ok(info)
            }
            Err(e) => {
                let _ = RbdBackend::remove(&spec, &self.opts.ceph);
                Err(e)
            }
        }
    }
}

/// Snapshot `name` of `v`'s image, or an error saying how to list them.
fn find(v: &VolumeEntry, b: &RbdBackend, name: &str) -> Result<RbdSnapshot> {
    let snaps = b.snapshots().map_err(|e| rbd_err(v, e))?;
    snaps.into_iter().find(|s| s.name == name).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "volume '{}' has no snapshot named '{name}'; `spoolctl volume snapshots {}` lists them",
            v.name, v.name
        ))
    })
}

/// A refusal (`Invalid`: a name that exists, a snapshot with clones) names the volume;
/// anything else is the cluster's error.
fn rbd_err(v: &VolumeEntry, e: spool_devices::Error) -> Error {
    match e {
        spool_devices::Error::Invalid { msg, .. } => {
            Error::InvalidArgument(format!("volume '{}': {msg}", v.name))
        }
        e => Error::Device(e),
    }
}
