//! Assembling a pool at start: [`Pool::open`] as a sequence of named steps.
//!
//! open the configured devices → choose the newest pool table among them → rediscover
//! devices that joined at run time → admit each device (member, blank, foreign, corrupt) →
//! rebuild the buddy allocators from the table → write the table back if anything changed.
//!
//! Owns: the decisions of start-up (which table wins, which device is left out and why,
//! when a rewrite is due). Must not know: volumes' data, the data path, health policy.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;

use uuid::Uuid;

use crate::members::{new_buddy, open_spec, Member};
use crate::metadata::{
    self, DeviceState, PoolTable, METADATA_AREA, MIN_EXTENT_MAX, MIN_EXTENT_MIN,
};
use crate::{DeviceSpec, Error, LeftOut, Pool, PoolOptions, Result};
use spool_devices::Device;

/// A device opened at start with what its metadata says.
type Opened = (Device, DeviceState);

impl Pool {
    /// Assembles a pool from devices: existing members are recognised by their metadata
    /// (wherever their paths are now), blank devices join, anything else is refused unless
    /// `opts.force`.
    pub fn open(specs: &[DeviceSpec], opts: PoolOptions) -> Result<Pool> {
        check_min_extent(opts.min_extent)?;
        let (mut opened, mut left_out) = open_configured(specs, &opts)?;
        let (table, generation) = choose_table(&opened, &opts);
        rediscover(&table, specs, &opts, &mut opened);
        let mut admission = Admission {
            table,
            pool_uuid: Uuid::nil(),
            generation,
            force: opts.force,
            needs_write: false,
            members: Vec::new(),
            seen: HashSet::new(),
        };
        admission.pool_uuid = admission.table.pool_uuid;
        for (dev, state) in opened {
            admission.admit(dev, state, &mut left_out)?;
        }
        let Admission {
            table,
            mut members,
            needs_write,
            ..
        } = admission;
        rebuild_allocators(&table, &mut members)?;
        warn_missing(&table, &members);
        let mut pool = Pool {
            table,
            generation,
            members,
            opts,
            left_out,
            mirrors: Default::default(),
            remotes: Default::default(),
            rbd_devices: Default::default(),
            ciphers: Default::default(),
            space: Default::default(),
            thins: Default::default(),
            retired: Default::default(),
            commit_unsure: false,
        };
        pool.settle_keys();
        // Thin volumes' chunks are named by their maps, not the table: taken now, before
        // anything can allocate.
        pool.open_thins();
        if needs_write {
            let t = pool.table.clone();
            pool.commit(t)?;
        }
        Ok(pool)
    }
}

fn check_min_extent(min_extent: u64) -> Result<()> {
    if !min_extent.is_power_of_two() || !(MIN_EXTENT_MIN..=MIN_EXTENT_MAX).contains(&min_extent) {
        return Err(Error::InvalidArgument(format!(
            "minimum extent {min_extent} must be a power of two from 64 KiB to 1 TiB"
        )));
    }
    Ok(())
}

/// Opens every configured device and reads its metadata. A device that cannot be opened
/// (pulled, hot-removed, failed) must not take the volumes on the other devices down with
/// it: it is left out, and the pool table (read from the others) marks it missing, so only
/// its volumes are offline. Fails only when no device opens at all.
fn open_configured(
    specs: &[DeviceSpec],
    opts: &PoolOptions,
) -> Result<(Vec<Opened>, Vec<LeftOut>)> {
    let mut opened = Vec::new();
    let mut first_error = None;
    let mut left_out = Vec::new();
    for s in specs {
        match open_spec(s, opts) {
            Ok(dev) => {
                let state = metadata::read_device(&dev);
                opened.push((dev, state));
            }
            Err(e) => {
                tracing::error!(path = %s.path.display(), error = %e, "device cannot be opened; volumes on it stay offline until it is back (or replaced)");
                left_out.push(LeftOut {
                    path: s.path.display().to_string(),
                    reason: e.to_string(),
                });
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) if opened.is_empty() => Err(e),
        _ => Ok((opened, left_out)),
    }
}

/// The newest pool table any opened member holds, with its generation; a new, empty table
/// (generation 0) when no device is a member yet.
fn choose_table(opened: &[Opened], opts: &PoolOptions) -> (PoolTable, u64) {
    let best = opened
        .iter()
        .filter_map(|(_, st)| match st {
            DeviceState::Member(r, _) => Some(r),
            _ => None,
        })
        .max_by_key(|r| r.generation)
        .cloned();
    match best {
        Some(r) => {
            if r.table.min_extent != opts.min_extent {
                tracing::info!(
                    pool_min_extent = r.table.min_extent,
                    "existing pool keeps its own minimum extent size"
                );
            }
            (r.table, r.generation)
        }
        None => (
            PoolTable {
                name: opts.name.clone(),
                pool_uuid: Uuid::new_v4(),
                min_extent: opts.min_extent,
                devices: vec![],
                volumes: vec![],
            },
            0,
        ),
    }
}

/// Devices that joined at run time (`device add`, `device replace`, spares) are not in the
/// configuration: they are found again at the path the pool table last saw them.
fn rediscover(
    table: &PoolTable,
    specs: &[DeviceSpec],
    opts: &PoolOptions,
    opened: &mut Vec<Opened>,
) {
    let have: HashSet<Uuid> = opened
        .iter()
        .filter_map(|(_, st)| match st {
            DeviceState::Member(r, _) => Some(r.device_uuid),
            _ => None,
        })
        .collect();
    let configured: HashSet<PathBuf> = specs.iter().map(|s| s.path.clone()).collect();
    for d in &table.devices {
        let path = PathBuf::from(&d.last_path);
        if have.contains(&d.uuid) || configured.contains(&path) || d.last_path.is_empty() {
            continue;
        }
        let spec = DeviceSpec {
            path,
            create_size: None,
            null: None,
        };
        match open_spec(&spec, opts) {
            Ok(dev) => {
                let state = metadata::read_device(&dev);
                if matches!(&state, DeviceState::Member(r, _) if r.device_uuid == d.uuid) {
                    tracing::info!(path = %d.last_path, device = %d.uuid, "found a device added at run time where it was last seen");
                    opened.push((dev, state));
                }
            }
            Err(e) => {
                tracing::debug!(path = %d.last_path, error = %e, "device not at its last path")
            }
        }
    }
}

/// Deciding, device by device, who is in the pool.
struct Admission {
    table: PoolTable,
    pool_uuid: Uuid,
    /// Generation of `table` (0: a new pool).
    generation: u64,
    force: bool,
    /// The table changed (a device joined, grew, moved, or had stale metadata).
    needs_write: bool,
    members: Vec<Member>,
    seen: HashSet<Uuid>,
}

impl Admission {
    /// Admits one device, or leaves it out. An existing pool is not held hostage by one bad
    /// device: a device whose metadata is unreadable, foreign, of an unknown format or no
    /// longer in the pool (replaced) is left out untouched, with the reason logged. Only
    /// while assembling a new pool are such devices a hard error (the operator is pointing
    /// at the wrong disk).
    fn admit(
        &mut self,
        dev: Device,
        state: DeviceState,
        left_out: &mut Vec<LeftOut>,
    ) -> Result<()> {
        let path = dev.path().display().to_string();
        let uuid = match self.classify(&dev, state, &path) {
            Ok(u) => u,
            Err(
                e @ (Error::Corrupt { .. } | Error::ForeignPool { .. } | Error::Unsupported { .. }),
            ) if self.generation > 0 => {
                tracing::error!(%path, error = %e, "device left out of the pool (not touched)");
                left_out.push(LeftOut {
                    path,
                    reason: e.to_string(),
                });
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        if !self.seen.insert(uuid) {
            return Err(Error::Duplicate { path, uuid });
        }
        if let Some(e) = self.table.devices.iter_mut().find(|d| d.uuid == uuid) {
            if e.last_path != path {
                e.last_path = path;
                self.needs_write = true;
            }
        }
        let buddy = new_buddy(&dev, self.table.min_extent)?;
        self.members.push(Member::new(uuid, Arc::new(dev), buddy));
        Ok(())
    }

    /// What the device's metadata makes it: its UUID in the pool (joining it when blank, or
    /// when forced), or why it cannot be in it.
    fn classify(&mut self, dev: &Device, state: DeviceState, path: &str) -> Result<Uuid> {
        let path = path.to_string();
        match state {
            DeviceState::Member(r, note) if r.table.pool_uuid == self.pool_uuid => {
                let Some(i) = self
                    .table
                    .devices
                    .iter()
                    .position(|d| d.uuid == r.device_uuid)
                else {
                    if !self.force {
                        return Err(Error::Corrupt {
                            path,
                            why: format!(
                                "device {} is not in the pool's current device table",
                                r.device_uuid
                            ),
                        });
                    }
                    self.needs_write = true;
                    return Pool::join(&mut self.table, dev, self.force);
                };
                self.check_member(dev, i, &path)?;
                if let Some(n) = note {
                    tracing::warn!(%path, "{n}");
                    self.needs_write = true;
                }
                if r.generation != self.generation {
                    tracing::info!(%path, device_generation = r.generation, generation = self.generation, "device metadata is stale, rewriting");
                    self.needs_write = true;
                }
                Ok(r.device_uuid)
            }
            DeviceState::Member(r, _) => {
                if !self.force {
                    return Err(Error::ForeignPool {
                        path,
                        found: r.table.pool_uuid,
                        expected: self.pool_uuid,
                    });
                }
                self.needs_write = true;
                Pool::join(&mut self.table, dev, true)
            }
            DeviceState::Corrupt(why) if !self.force => Err(Error::Corrupt { path, why }),
            DeviceState::Unsupported(version) if !self.force => Err(Error::Unsupported {
                path,
                version,
                supported: metadata::FORMAT_VERSION,
            }),
            DeviceState::Blank | DeviceState::Corrupt(_) | DeviceState::Unsupported(_) => {
                self.needs_write = true;
                Pool::join(&mut self.table, dev, self.force)
            }
        }
    }

    /// A member of this pool (device table entry `i`): the table was validated when it was
    /// read; the device itself must still hold the metadata area, an extent, and everything
    /// the table placed on it. A device that shrank (or is a different, smaller one carrying
    /// a copy of the metadata) is left out; one that grew keeps its extents, and the table
    /// learns its size.
    fn check_member(&mut self, dev: &Device, i: usize, path: &str) -> Result<()> {
        let need = METADATA_AREA + self.table.min_extent;
        let entry = &mut self.table.devices[i];
        if dev.size() < need {
            return Err(Error::Corrupt {
                path: path.to_string(),
                why: format!(
                    "device {} is {} bytes, smaller than the metadata area plus one extent ({need}); its volumes stay offline",
                    entry.uuid,
                    dev.size()
                ),
            });
        }
        if dev.size() < entry.size {
            return Err(Error::Corrupt {
                path: path.to_string(),
                why: format!(
                    "device {} is {} bytes, smaller than the {} bytes the pool table records for it (it shrank, or is not the device it claims to be); its volumes stay offline",
                    entry.uuid,
                    dev.size(),
                    entry.size
                ),
            });
        }
        if dev.size() > entry.size {
            tracing::info!(%path, old_size = entry.size, new_size = dev.size(), "device grew");
            entry.size = dev.size();
            self.needs_write = true;
        }
        Ok(())
    }
}

/// The allocators are never persisted: every extent of every volume is marked used again.
fn rebuild_allocators(table: &PoolTable, members: &mut [Member]) -> Result<()> {
    for v in &table.volumes {
        for e in v.all_extents() {
            if let Some(m) = members.iter_mut().find(|m| m.uuid == e.device) {
                m.alloc_at(e.offset, e.order)
                    .map_err(|why| Error::Corrupt {
                        path: m.dev.path().display().to_string(),
                        why: format!("volume '{}': {why}", v.name),
                    })?;
            }
        }
    }
    Ok(())
}

fn warn_missing(table: &PoolTable, members: &[Member]) {
    for d in &table.devices {
        if !members.iter().any(|m| m.uuid == d.uuid) {
            tracing::warn!(device = %d.uuid, last_path = %d.last_path, "pool device is missing; volumes on it are offline");
        }
    }
}
