//! Volumes whose data is a Ceph RBD image (docs/ceph.md): created as image POOL/NAME, or an
//! existing image attached, so any spoold on the cluster can serve the volume. The pool table
//! names the image; the data path sees one segment on the image's device, opened on first use
//! and cached while the volume exists (workers compare device handles).
//!
//! Owns: creating / attaching, resizing and removing the image, the device cache. Must not
//! know: the data path, how the cluster is reached (spool-devices' `RbdBackend`).

use std::sync::Arc;

use uuid::Uuid;

use crate::metadata::{RbdImage, VolumeEntry, MAX_QUEUES};
use crate::{Error, Pool, Result, VolumeInfo};
use spool_devices::{Device, OpenOptions, RbdBackend};

/// The RBD device of each RBD volume in use.
pub(crate) type RbdCache = std::collections::HashMap<Uuid, Arc<Device>>;

/// What `volume create --rbd` names: a pool (create image POOL/NAME) or an image to attach.
pub struct RbdTarget<'a> {
    pub pool: &'a str,
    /// `None`: create the image, named as the volume.
    pub attach: Option<&'a str>,
    /// An attached image removed with the volume, as one this pool created is (a clone's).
    pub owned: bool,
}

impl<'a> RbdTarget<'a> {
    /// `POOL` or `POOL/IMAGE`.
    pub fn parse(s: &'a str) -> Result<RbdTarget<'a>> {
        let t = match s.split_once('/') {
            Some((pool, image)) => RbdTarget {
                pool,
                attach: Some(image),
                owned: false,
            },
            None => RbdTarget {
                pool: s,
                attach: None,
                owned: false,
            },
        };
        rbd_name(t.pool).map_err(|why| Error::InvalidArgument(format!("rbd pool: {why}")))?;
        if let Some(i) = t.attach {
            rbd_name(i).map_err(|why| Error::InvalidArgument(format!("rbd image: {why}")))?;
        }
        Ok(t)
    }
}

impl Pool {
    fn rbd_open(&self, r: &RbdImage, create: Option<u64>) -> Result<Device> {
        let opts = OpenOptions {
            create_size: create,
            ceph: self.opts.ceph.clone(),
            faults: self.opts.startup_faults.clone(),
            ..Default::default()
        };
        Ok(Device::open(
            std::path::Path::new(&format!("rbd:{}", r.spec())),
            &opts,
        )?)
    }

    /// The device of RBD volume `v`: the cached one, else opened now.
    pub(crate) fn rbd_device(&self, v: &VolumeEntry, r: &RbdImage) -> Result<Arc<Device>> {
        let mut cache = self.rbd_devices.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = cache.get(&v.uuid) {
            return Ok(d.clone());
        }
        let d = Arc::new(self.rbd_open(r, None)?);
        cache.insert(v.uuid, d.clone());
        Ok(d)
    }

    /// Creates a volume on an RBD image: with `target.attach` an existing image (its size,
    /// or `size` when given, which must match), else a new image POOL/NAME of `size`.
    pub fn create_rbd_volume(
        &mut self,
        name: &str,
        size: Option<u64>,
        read_only: bool,
        num_queues: u16,
        target: &RbdTarget,
    ) -> Result<VolumeInfo> {
        crate::metadata::check_volume_name(name).map_err(Error::invalid)?;
        if !(1..=MAX_QUEUES).contains(&num_queues) {
            return Err(Error::InvalidArgument(format!(
                "num_queues {num_queues} must be between 1 and {MAX_QUEUES}"
            )));
        }
        if self.table.volumes.iter().any(|v| v.name == name) {
            return Err(Error::VolumeExists(name.into()));
        }
        let image = RbdImage {
            pool: target.pool.into(),
            image: target.attach.unwrap_or(name).into(),
            created: target.attach.is_none(),
        };
        if let Some(o) = self
            .table
            .volumes
            .iter()
            .find(|v| v.rbd.as_ref().is_some_and(|r| r.spec() == image.spec()))
        {
            return Err(Error::InvalidArgument(format!(
                "RBD image {} is already volume '{}'",
                image.spec(),
                o.name
            )));
        }
        let dev = self.open_for_create(&image, size)?;
        let mut v = VolumeEntry::new(name, dev.size(), read_only, num_queues);
        v.rbd = Some(image.clone());
        if let Some(s) = size.filter(|_| !image.created) {
            if s != v.size {
                return Err(Error::InvalidArgument(format!(
                    "RBD image {} is {} bytes, not {s}: leave the size out to attach it as it is, or resize it first",
                    image.spec(),
                    v.size
                )));
            }
        }
        v.size = size.unwrap_or(v.size);
        if let Some(r) = v.rbd.as_mut() {
            r.created |= target.owned;
        }
        let mut table = self.table.clone();
        table.volumes.push(v.clone());
        if let Err(e) = self.commit(table) {
            drop(dev);
            if image.created {
                let _ = RbdBackend::remove(&image.spec(), &self.opts.ceph);
            }
            return Err(e);
        }
        self.rbd_devices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(v.uuid, Arc::new(dev));
        tracing::info!(volume = %v.name, uuid = %v.uuid, image = %image.spec(), created = image.created, size = v.size, "RBD volume created");
        Ok(self.volume_info(&v))
    }

    /// Opens the image a new volume will use: creating it (it must not exist yet), or an
    /// existing one to attach.
    fn open_for_create(&self, image: &RbdImage, size: Option<u64>) -> Result<Device> {
        let spec = image.spec();
        let exists = RbdBackend::exists(&spec, &self.opts.ceph)?;
        if image.created {
            let size = size.ok_or_else(|| {
                Error::InvalidArgument("a size is needed to create an RBD image".into())
            })?;
            Self::check_size(size)?;
            if exists {
                return Err(Error::InvalidArgument(format!(
                    "RBD image {spec} already exists: attach it with --rbd {spec}"
                )));
            }
            return self.rbd_open(image, Some(size));
        }
        if !exists {
            return Err(Error::InvalidArgument(format!(
                "RBD image {spec} does not exist (to create one, name only its pool: --rbd {})",
                image.pool
            )));
        }
        self.rbd_open(image, None)
    }

    /// Deletes RBD volume `i` from the table; removes its image when this pool created it or
    /// `remove_image` asks. The caller stops serving it first.
    pub(crate) fn delete_rbd_volume(&mut self, i: usize, remove_image: bool) -> Result<VolumeInfo> {
        let v = self.table.volumes[i].clone();
        let Some(image) = v.rbd.clone() else {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' is not on RBD",
                v.name
            )));
        };
        let info = self.volume_info(&v);
        self.rbd_devices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&v.uuid);
        if image.created || remove_image {
            match RbdBackend::remove(&image.spec(), &self.opts.ceph) {
                Err(spool_devices::Error::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    tracing::warn!(volume = %v.name, image = %image.spec(), "the RBD image was already gone");
                }
                Err(spool_devices::Error::Io { source, .. })
                    if source.raw_os_error() == Some(39) /* ENOTEMPTY */ =>
                {
                    return Err(Error::InvalidArgument(format!(
                        "RBD image {} has snapshots: delete them first (`spoolctl volume snapshots {}` lists them); the volume is kept",
                        image.spec(),
                        v.name
                    )));
                }
                Err(spool_devices::Error::Io { source, .. })
                    if source.raw_os_error() == Some(16) /* EBUSY */ =>
                {
                    return Err(Error::InvalidArgument(format!(
                        "RBD image {} is still open elsewhere: another spoold serving it (delete it there first), or a killed worker whose session the cluster has not timed out yet (up to 30 s); the volume is kept, retry",
                        image.spec()
                    )));
                }
                r => r?,
            }
        }
        let mut table = self.table.clone();
        table.volumes.remove(i);
        self.commit(table)?;
        tracing::info!(volume = %v.name, uuid = %v.uuid, image = %image.spec(), removed = image.created || remove_image, "RBD volume deleted");
        Ok(info)
    }

    /// Grows RBD volume `i` (and its image) to `new_size`.
    pub(crate) fn resize_rbd_volume(&mut self, i: usize, new_size: u64) -> Result<VolumeInfo> {
        let mut v = self.table.volumes[i].clone();
        let Some(image) = v.rbd.clone() else {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' is not on RBD",
                v.name
            )));
        };
        let dev = self.rbd_device(&v, &image)?;
        if new_size > dev.size() {
            let rbd = RbdBackend::of(&dev).ok_or_else(|| {
                Error::InvalidArgument(format!("volume '{}': not an RBD device", v.name))
            })?;
            rbd.resize(new_size)?;
        }
        v.size = new_size;
        let mut table = self.table.clone();
        table.volumes[i] = v.clone();
        self.commit(table)?;
        tracing::info!(volume = %v.name, size = new_size, "RBD volume resized");
        Ok(self.volume_info(&v))
    }
}

use crate::metadata::rbd_name;
