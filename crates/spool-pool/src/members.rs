//! Pool membership: opening a configured device, a device joining the pool, added at run
//! time or replacing another, and finding members by UUID or path.
//!
//! Owns: [`DeviceSpec`], the per-device [`Member`] (device handle + buddy allocator), and
//! the rules for who may join (blank, or forced). Must not know: the data path, health
//! policy (it only reads whether a device is isolated).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use uuid::Uuid;

use crate::buddy::{AllocError, Buddy};
use crate::metadata::{self, DeviceEntry, DeviceState, ExtentEntry, PoolTable, METADATA_AREA};
use crate::{DeviceInfo, Error, Pool, PoolOptions, Replacement, Result};
use spool_devices::{Device, OpenOptions};

/// A device to assemble into the pool.
#[derive(Debug, Clone)]
pub struct DeviceSpec {
    pub path: PathBuf,
    /// Create a file of this size when the path does not exist (the size of a null device).
    pub create_size: Option<u64>,
    /// A null device (benchmarks only): `path` is its name, nothing is stored.
    pub null: Option<spool_devices::NullReads>,
}

pub(crate) fn open_spec(s: &DeviceSpec, opts: &PoolOptions) -> Result<Device> {
    let open = OpenOptions {
        create_size: s.create_size,
        no_direct: opts.no_direct,
        no_nvme_sgl: !opts.nvme_sgl,
        faults: opts.startup_faults.clone(),
        ceph: opts.ceph.clone(),
        handoff: opts.handoff.clone(),
        lock_wait: opts.lock_wait,
    };
    Ok(match s.null {
        Some(reads) => Device::open_null(
            &s.path.display().to_string(),
            s.create_size.ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "null device {}: a size is required",
                    s.path.display()
                ))
            })?,
            reads,
            &open,
        )?,
        None => Device::open(&s.path, &open)?,
    })
}

/// The buddy allocator of a device's data area.
pub(crate) fn new_buddy(dev: &Device, min_extent: u64) -> Result<Buddy> {
    let path = dev.path().display().to_string();
    let need = METADATA_AREA.saturating_add(min_extent);
    let len = dev
        .size()
        .checked_sub(METADATA_AREA)
        .filter(|_| dev.size() >= need)
        .ok_or(Error::TooSmall {
            path: path.clone(),
            size: dev.size(),
            need,
        })?;
    Buddy::new(METADATA_AREA, len, min_extent).map_err(|why| Error::Corrupt {
        path,
        why: why.to_string(),
    })
}

pub(crate) struct Member {
    pub(crate) uuid: Uuid,
    pub(crate) dev: Arc<Device>,
    /// Shared with thin volumes' allocator threads, which take chunks from it
    /// (`space.rs`); every use locks it for one call.
    pub(crate) buddy: Arc<Mutex<Buddy>>,
}

impl Member {
    pub(crate) fn new(uuid: Uuid, dev: Arc<Device>, buddy: Buddy) -> Member {
        Member {
            uuid,
            dev,
            buddy: Arc::new(Mutex::new(buddy)),
        }
    }

    fn buddy(&self) -> std::sync::MutexGuard<'_, Buddy> {
        self.buddy.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn free_bytes(&self) -> u64 {
        self.buddy().free_bytes()
    }

    pub(crate) fn total(&self) -> u64 {
        self.buddy().total()
    }

    /// A free block of `order`, when the device has one (another thread may take the last
    /// one between a check and this call: callers handle `None`).
    pub(crate) fn alloc(&self, order: u32) -> Option<u64> {
        self.buddy().alloc(order)
    }

    pub(crate) fn alloc_at(&self, offset: u64, order: u32) -> std::result::Result<(), AllocError> {
        self.buddy().alloc_at(offset, order)
    }

    pub(crate) fn free(&self, offset: u64, order: u32) {
        self.buddy().free(offset, order)
    }

    pub(crate) fn has_order(&self, order: u32) -> bool {
        self.buddy()
            .largest_free_order()
            .is_some_and(|l| l >= order)
    }

    /// Failed or removed (the health layer says so): no new extents, no metadata writes.
    pub(crate) fn isolated(&self) -> bool {
        self.dev.health().state().isolated()
    }
}

impl Pool {
    pub(crate) fn join(table: &mut PoolTable, dev: &Device, force: bool) -> Result<Uuid> {
        let need = METADATA_AREA.saturating_add(table.min_extent);
        if dev.size() < need {
            return Err(Error::TooSmall {
                path: dev.path().display().to_string(),
                size: dev.size(),
                need,
            });
        }
        if force {
            metadata::wipe(dev).map_err(|e| Error::Metadata(e.to_string()))?;
            tracing::warn!(path = %dev.path().display(), "reformatting device (--force)");
        }
        let uuid = Uuid::new_v4();
        table.devices.push(DeviceEntry {
            uuid,
            size: dev.size(),
            last_path: dev.path().display().to_string(),
        });
        tracing::info!(path = %dev.path().display(), device = %uuid, "device joins the pool");
        Ok(uuid)
    }

    /// Adds a device to a running pool.
    pub fn add_device(&mut self, spec: &DeviceSpec, force: bool) -> Result<DeviceInfo> {
        let dev = open_spec(spec, &self.opts)?;
        let path = dev.path().display().to_string();
        match metadata::read_device(&dev) {
            DeviceState::Blank => {}
            DeviceState::Member(r, _) if !force => {
                return Err(if r.table.pool_uuid == self.table.pool_uuid {
                    Error::Duplicate {
                        path,
                        uuid: r.device_uuid,
                    }
                } else {
                    Error::ForeignPool {
                        path,
                        found: r.table.pool_uuid,
                        expected: self.table.pool_uuid,
                    }
                })
            }
            DeviceState::Corrupt(why) if !force => return Err(Error::Corrupt { path, why }),
            DeviceState::Unsupported(version) if !force => {
                return Err(Error::Unsupported {
                    path,
                    version,
                    supported: metadata::FORMAT_VERSION,
                })
            }
            _ => {}
        }
        let mut table = self.table.clone();
        let uuid = Self::join(&mut table, &dev, force)?;
        let buddy = new_buddy(&dev, table.min_extent)?;
        self.members.push(Member::new(uuid, Arc::new(dev), buddy));
        if let Err(e) = self.commit(table) {
            self.members.pop();
            return Err(e);
        }
        Ok(self.device_info(uuid))
    }

    /// Present devices with their handles (for the health monitor).
    pub fn device_handles(&self) -> Vec<(Uuid, Arc<Device>)> {
        self.members
            .iter()
            .map(|m| (m.uuid, m.dev.clone()))
            .collect()
    }

    /// The UUID of a device given by UUID or path.
    pub fn device_uuid(&self, id: &str) -> Result<Uuid> {
        let by_uuid = Uuid::parse_str(id).ok();
        self.table
            .devices
            .iter()
            .find(|d| Some(d.uuid) == by_uuid || d.last_path == id)
            .map(|d| d.uuid)
            .or_else(|| {
                self.members
                    .iter()
                    .find(|m| m.dev.path() == Path::new(id))
                    .map(|m| m.uuid)
            })
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "no device '{id}' in the pool; `spoolctl device list` shows them"
                ))
            })
    }

    /// Replaces device `old` (failed, removed or missing) with a blank device: every extent
    /// on `old` gets an extent of the same size on the new device, zeroed, and `old` leaves
    /// the pool. The data that was on `old` is gone (no mirror yet): the volumes come back
    /// online reading zeroes there. Refused while `old` is healthy and present, unless
    /// `force` (an operator retiring a working device would want its data copied first).
    pub fn replace_device(
        &mut self,
        old: &str,
        spec: &DeviceSpec,
        force: bool,
    ) -> Result<Replacement> {
        let old = self.device_uuid(old)?;
        let replaced = self.replace_checked(old, spec, force);
        self.space.end_exclusion();
        if replaced.is_err() {
            // The device stays: thin allocators may use it again.
            self.refresh_space();
        }
        replaced
    }

    fn replace_checked(
        &mut self,
        old: Uuid,
        spec: &DeviceSpec,
        force: bool,
    ) -> Result<Replacement> {
        self.check_replaceable(old, force)?;
        let dev = open_spec(spec, &self.opts)?;
        let path = dev.path().display().to_string();
        check_replacement_blank(&dev, old, force)?;
        // Thin maps on it are written elsewhere first (each in a commit of its own): the
        // moves below then find none there.
        let maps_moved = self.move_thin_maps_off(old)?;
        let mut table = self.table.clone();
        let new = Self::join(&mut table, &dev, force)?;
        let mut buddy = new_buddy(&dev, table.min_extent)?;
        let (mut volumes, moved) = move_extents(&mut table, old, new, &mut buddy)?;
        // A mirrored thin volume's copy on it is made anew there (and rebuilt); copies being
        // added are given up.
        let mut renewed = self.give_up_adding(&mut table, old);
        renewed.extend(self.renew_copies(&mut table, (old, new), &mut buddy, &dev)?);
        for r in &renewed {
            if !volumes.contains(&r.name) {
                volumes.push(r.name.clone());
            }
        }
        table.devices.retain(|d| d.uuid != old);
        self.zero_lost_copies(&mut table, &volumes, (new, &dev))?;
        // Thin volumes' chunks on it are lost, as thick extents are: their entries become
        // holes now, durably, after every other step that can fail and before the table
        // forgets the device.
        for v in self.evict_thin(old)?.into_iter().chain(maps_moved) {
            if !volumes.contains(&v) {
                volumes.push(v);
            }
        }
        let removed = self
            .members
            .iter()
            .position(|m| m.uuid == old)
            .map(|i| self.members.remove(i));
        self.members.push(Member::new(new, Arc::new(dev), buddy));
        if let Err(e) = self.commit(table) {
            self.members.pop();
            if let Some(m) = removed {
                self.members.push(m);
            }
            return Err(e);
        }
        self.copies_renewed(renewed);
        tracing::warn!(old = %old, new = %new, %path, extents = moved, volumes = ?volumes, "device replaced; the volumes' data on the old device is lost");
        Ok(Replacement {
            old,
            new: self.device_info(new),
            volumes,
            extents: moved,
        })
    }

    /// In `table` (a replace's, the new device `new` opened as `dev`): the new extents of
    /// `volumes` are zeroed; a mirrored volume whose every synced copy was on the replaced
    /// device has its first local leg zeroed and made the synced one.
    fn zero_lost_copies(
        &self,
        table: &mut PoolTable,
        volumes: &[String],
        (new, dev): (Uuid, &Device),
    ) -> Result<()> {
        let min = table.min_extent;
        for v in table
            .volumes
            .iter_mut()
            .filter(|v| volumes.contains(&v.name))
        {
            let local = |l: &crate::metadata::LegEntry| l.remote.is_none();
            if v.is_mirrored() && !v.legs.iter().any(|l| l.synced && local(l)) {
                // Every complete copy here was on the old device: the data is gone, as on a
                // plain volume; the first local leg is zeroed and the others rebuilt from it.
                tracing::error!(volume = %v.name, "every synced copy was on the replaced device; the volume's data is lost");
                let first = v.legs.iter().position(local).unwrap_or(0);
                for l in &mut v.legs {
                    l.synced = false;
                    // A copy on another host gets a new identity: every region of it is
                    // copied again from the zeroed leg, so both hosts hold the same bytes.
                    if let Some(r) = &mut l.remote {
                        r.id = Uuid::new_v4();
                    }
                }
                v.legs[first].synced = true;
                for e in &v.legs[first].extents {
                    if let Some(m) = self.members.iter().find(|m| m.uuid == e.device) {
                        m.dev.zero_range(e.offset, min << e.order)?;
                    } else if e.device == new {
                        dev.zero_range(e.offset, min << e.order)?;
                    }
                }
            }
            for e in v.extents.iter().filter(|e| e.device == new) {
                dev.zero_range(e.offset, min << e.order)?;
            }
        }
        Ok(())
    }

    /// Makes every thin volume's entries naming a chunk on `old` holes (see
    /// `ThinBackend::evict`); returns the names of the volumes that had some. A mirrored
    /// thin volume's copy on it is made anew instead (`thin_mirror.rs`).
    fn evict_thin(&self, old: Uuid) -> Result<Vec<String>> {
        let mut touched = Vec::new();
        // Its own map: a thin volume's, or a mirrored one's while copies are added to it.
        let evicted =
            |v: &&metadata::VolumeEntry| v.thin.as_ref().is_some_and(|t| !t.map.is_empty());
        for v in self.table.volumes.iter().filter(evicted) {
            if !self.thin_uses(v, old) {
                continue;
            }
            let dev = self.thin_device(v)?;
            let t = crate::snapshots::thin_backend(v, &dev)?;
            let n = t.evict(old).map_err(|e| Error::Thin {
                volume: v.name.clone(),
                why: e.to_string(),
            })?;
            if n > 0 {
                touched.push(v.name.clone());
            }
        }
        Ok(touched)
    }

    /// A healthy, present device is replaced only when forced.
    fn check_replaceable(&self, old: Uuid, force: bool) -> Result<()> {
        // No thin allocator takes a chunk on it from now on, and the chunks taken before are
        // in their maps (the next commit, or a refusal, publishes the members again).
        if !self.space.exclude(old) {
            self.refresh_space();
            return Err(Error::InvalidArgument(
                "thin volumes are allocating chunks on this device; try again".into(),
            ));
        }
        for v in self.table.volumes.iter().filter(|v| v.thin.is_some()) {
            // A mirrored thin volume's copy on `old` is made anew: only the others' maps
            // must be served.
            let kept = crate::thin_maps::map_refs(v).into_iter();
            let mut kept = kept.filter(|m| !m.devices.contains(&old));
            if let Some(e) = kept.find_map(|m| self.map_device(v, m.key).err()) {
                self.refresh_space();
                return Err(Error::InvalidArgument(format!(
                    "thin volume '{}' is not served ({e}): which of its chunks lie on device {old} is unknown, so they cannot be forgotten; delete it first",
                    v.name
                )));
            }
            if v.remote_leg().is_some() && self.thin_chunks_on(v, old) {
                // Its chunks there would become holes here while the copy there still holds
                // them (and may hold writes that failed here): finishing the send keeps them.
                self.refresh_space();
                return Err(Error::InvalidArgument(format!(
                    "thin volume '{}' is being sent and has chunks on device {old}, which the copy there holds: finish the send (volume send {} --finish) once it is current, or cancel it, then replace the device",
                    v.name, v.name
                )));
            }
        }
        if let Some(m) = self.members.iter().find(|m| m.uuid == old) {
            if !m.isolated() && !force {
                self.refresh_space();
                return Err(Error::InvalidArgument(format!(
                    "device {old} ({}) is healthy; replacing it would discard the data of every volume on it. Pass force to do it anyway",
                    m.dev.path().display()
                )));
            }
        }
        Ok(())
    }
}

/// The replacement must be blank (or forced), and not the device it replaces.
fn check_replacement_blank(dev: &Device, old: Uuid, force: bool) -> Result<()> {
    let path = dev.path().display().to_string();
    match metadata::read_device(dev) {
        DeviceState::Blank => Ok(()),
        DeviceState::Member(r, _) if r.device_uuid == old => Err(Error::InvalidArgument(format!(
            "{path} is the device being replaced"
        ))),
        _ if !force => Err(Error::InvalidArgument(format!(
            "{path} is not blank (it has pool metadata or other data); pass force to reformat it"
        ))),
        _ => Ok(()),
    }
}

/// Gives every extent on `old` an extent of the same order on `new` (allocated from
/// `buddy`); returns the volumes touched and the number of extents moved.
fn move_extents(
    table: &mut PoolTable,
    old: Uuid,
    new: Uuid,
    buddy: &mut Buddy,
) -> Result<(Vec<String>, usize)> {
    let min = table.min_extent;
    let mut moved = 0;
    let mut volumes = Vec::new();
    for v in &mut table.volumes {
        let mut touched = move_on(&mut v.extents, old, new, min, buddy)?;
        for leg in &mut v.legs {
            let n = move_on(&mut leg.extents, old, new, min, buddy)?;
            if n > 0 {
                // The new extents hold nothing yet: the leg is rebuilt from another.
                leg.synced = false;
            }
            touched += n;
        }
        if touched > 0 {
            volumes.push(v.name.clone());
            moved += touched;
        }
    }
    Ok((volumes, moved))
}

/// Moves the extents of `extents` that lie on `old` to new blocks on `new`; returns how many.
fn move_on(
    extents: &mut [ExtentEntry],
    old: Uuid,
    new: Uuid,
    min: u64,
    buddy: &mut Buddy,
) -> Result<usize> {
    let mut moved = 0;
    for e in extents.iter_mut().filter(|e| e.device == old) {
        let off = buddy.alloc(e.order).ok_or_else(|| Error::NoSpace {
            requested: min << e.order,
            available: buddy.free_bytes(),
        })?;
        *e = ExtentEntry {
            device: new,
            offset: off,
            order: e.order,
        };
        moved += 1;
    }
    Ok(moved)
}
