//! Pool layer: devices assembled into a storage pool, carved into logical volumes.
//!
//! Owns: the on-device metadata (superblock + volume table, two alternating checksummed
//! copies on every member device), the per-device buddy allocators, volume create / delete /
//! grow, and the logical→physical map ([`VolumeLayout`]) the data path uses.
//!
//! Must not know: virtio, vhost-user, guest memory, or how I/O is submitted (that is the
//! devices layer's job); it never sits on the data path.

pub mod buddy;
pub mod metadata;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use uuid::Uuid;

use buddy::Buddy;
use metadata::{
    DeviceEntry, DeviceState, ExtentEntry, PoolTable, Record, VolumeEntry, MAX_QUEUES,
    METADATA_AREA, MIN_EXTENT_MAX, MIN_EXTENT_MIN,
};
use spool_devices::{Device, OpenOptions};

/// Errors of the pool layer. Each says what was wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Device(#[from] spool_devices::Error),
    #[error("{path}: device belongs to another pool ({found}), not to this one ({expected}); pass --force to reformat it (its data is lost)")]
    ForeignPool {
        path: String,
        found: Uuid,
        expected: Uuid,
    },
    #[error("{path}: metadata is unreadable: {why}; refusing to touch it. Pass --force to reformat it (its data is lost)")]
    Corrupt { path: String, why: String },
    #[error("{path}: metadata format version {version} is newer than this spoold understands ({supported}); upgrade spoold")]
    Unsupported {
        path: String,
        version: u32,
        supported: u32,
    },
    #[error("{path}: device is {size} bytes; a pool device needs at least {need} (metadata area plus one extent)")]
    TooSmall { path: String, size: u64, need: u64 },
    #[error("{path}: same device (UUID {uuid}) given twice")]
    Duplicate { path: String, uuid: Uuid },
    #[error("no volume named or with UUID '{0}'; `spoolctl volume list` shows them")]
    NoSuchVolume(String),
    #[error("a volume named '{0}' already exists")]
    VolumeExists(String),
    #[error("not enough free space: {requested} bytes requested, largest allocation possible is {available} bytes; add a device or delete volumes")]
    NoSpace { requested: u64, available: u64 },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("writing pool metadata failed: {0}")]
    Metadata(String),
    #[error("pool has no devices; add at least one device")]
    NoDevices,
}

/// Result type of the pool layer.
pub type Result<T> = std::result::Result<T, Error>;

/// A device to assemble into the pool.
#[derive(Debug, Clone)]
pub struct DeviceSpec {
    pub path: PathBuf,
    /// Create a file of this size when the path does not exist (the size of a null device).
    pub create_size: Option<u64>,
    /// A null device (benchmarks only): `path` is its name, nothing is stored.
    pub null: Option<spool_devices::NullReads>,
}

fn open_spec(s: &DeviceSpec, opts: &PoolOptions) -> Result<Device> {
    let open = OpenOptions {
        create_size: s.create_size,
        no_direct: opts.no_direct,
        no_nvme_sgl: !opts.nvme_sgl,
        faults: opts.startup_faults.clone(),
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
fn new_buddy(dev: &Device, min_extent: u64) -> Result<Buddy> {
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
    Buddy::new(METADATA_AREA, len, min_extent).map_err(|why| Error::Corrupt { path, why })
}

/// How to assemble a pool.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Name given to a new pool.
    pub name: String,
    /// Minimum extent (buddy block) size for a new pool; a power of two from 64 KiB to 1 TiB.
    pub min_extent: u64,
    /// Reformat devices with foreign, corrupt or unknown metadata.
    pub force: bool,
    /// Never use O_DIRECT.
    pub no_direct: bool,
    /// NVMe queues may use SGLs (config `[io] nvme_sgl`, default on).
    pub nvme_sgl: bool,
    /// Fault rules armed on every device from the moment it opens (crash tests).
    pub startup_faults: Vec<spool_devices::FaultRule>,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            name: "pool0".into(),
            min_extent: 4 << 20,
            force: false,
            no_direct: false,
            nvme_sgl: true,
            startup_faults: Vec::new(),
        }
    }
}

struct Member {
    uuid: Uuid,
    dev: Arc<Device>,
    buddy: Buddy,
}

impl Member {
    /// Failed or removed (the health layer says so): no new extents, no metadata writes.
    fn isolated(&self) -> bool {
        self.dev.health().state().isolated()
    }
}

/// What a device replacement did.
#[derive(Debug, Clone, Serialize)]
pub struct Replacement {
    pub old: Uuid,
    pub new: DeviceInfo,
    /// Volumes whose extents moved to the new device (their data there reads as zeroes).
    pub volumes: Vec<String>,
    pub extents: usize,
}

/// An assembled storage pool.
pub struct Pool {
    table: PoolTable,
    generation: u64,
    members: Vec<Member>,
    opts: PoolOptions,
    /// Configured devices that could not be opened or were left out at start, and why.
    left_out: Vec<LeftOut>,
}

/// A configured device the pool is running without.
#[derive(Debug, Clone, Serialize)]
pub struct LeftOut {
    pub path: String,
    pub reason: String,
}

/// One piece of a volume's address space mapped onto a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Volume byte offset where the segment starts.
    pub logical: u64,
    pub len: u64,
    /// Index into [`VolumeLayout::devices`].
    pub device: usize,
    /// Device byte offset.
    pub offset: u64,
}

/// Everything the data path needs to serve one volume.
#[derive(Debug, Clone)]
pub struct VolumeLayout {
    pub uuid: Uuid,
    pub name: String,
    /// Capacity in bytes.
    pub size: u64,
    pub read_only: bool,
    pub num_queues: u16,
    /// Ascending by `logical`, contiguous, covering at least `size`.
    pub segments: Vec<Segment>,
    pub devices: Vec<Arc<Device>>,
}

impl VolumeLayout {
    /// Index of the segment holding volume byte `offset` (`segments.len()` past the end).
    #[inline]
    fn segment_at(&self, offset: u64) -> usize {
        self.segments
            .partition_point(|s| s.logical + s.len <= offset)
    }

    /// The device and device offset of `[offset, offset + len)` when it lies within one
    /// segment (the common case); `None` when it spans segments or lies outside them.
    #[inline]
    pub fn map_one(&self, offset: u64, len: u64) -> Option<(usize, u64)> {
        let s = self.segments.get(self.segment_at(offset))?;
        let within = offset.checked_sub(s.logical)?;
        (s.len - within >= len).then_some((s.device, s.offset + within))
    }

    /// Splits the volume range `[offset, offset + len)` into device pieces:
    /// `f(device index, device offset, piece length, offset within the range)`.
    /// The caller has checked the range against `size`.
    pub fn map(&self, offset: u64, len: u64, mut f: impl FnMut(usize, u64, u64, u64)) {
        let mut i = self.segment_at(offset);
        let mut done = 0;
        while done < len && i < self.segments.len() {
            let s = &self.segments[i];
            let pos = offset + done;
            let within = pos - s.logical;
            let n = (s.len - within).min(len - done);
            f(s.device, s.offset + within, n, done);
            done += n;
            i += 1;
        }
    }
}

/// Public description of a device, for the control plane.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceInfo {
    pub uuid: Uuid,
    pub path: String,
    pub size: u64,
    pub free: u64,
    pub present: bool,
    pub direct_io: bool,
}

/// Public description of a volume, for the control plane.
#[derive(Debug, Clone, Serialize)]
pub struct VolumeInfo {
    pub uuid: Uuid,
    pub name: String,
    pub size: u64,
    pub allocated: u64,
    pub read_only: bool,
    pub num_queues: u16,
    pub extents: usize,
    pub devices: Vec<Uuid>,
    /// False when one of its devices is missing.
    pub online: bool,
}

/// Public description of the pool, for the control plane.
#[derive(Debug, Clone, Serialize)]
pub struct PoolInfo {
    pub name: String,
    pub uuid: Uuid,
    pub generation: u64,
    pub min_extent: u64,
    pub size: u64,
    pub free: u64,
    pub devices: Vec<DeviceInfo>,
    pub volumes: usize,
    /// Configured devices the pool runs without (cannot be opened, unreadable, foreign,
    /// replaced), untouched.
    pub left_out: Vec<LeftOut>,
}

fn valid_name(name: &str) -> Result<()> {
    metadata::check_volume_name(name).map_err(Error::InvalidArgument)
}

impl Pool {
    /// Assembles a pool from devices: existing members are recognised by their metadata
    /// (wherever their paths are now), blank devices join, anything else is refused unless
    /// `opts.force`.
    pub fn open(specs: &[DeviceSpec], opts: PoolOptions) -> Result<Pool> {
        if !opts.min_extent.is_power_of_two()
            || !(MIN_EXTENT_MIN..=MIN_EXTENT_MAX).contains(&opts.min_extent)
        {
            return Err(Error::InvalidArgument(format!(
                "minimum extent {} must be a power of two from 64 KiB to 1 TiB",
                opts.min_extent
            )));
        }
        let mut opened = Vec::new();
        let mut first_error = None;
        let mut left_out = Vec::new();
        for s in specs {
            // A device that cannot be opened (pulled, hot-removed, failed) must not take the
            // volumes on the other devices down with it: it is left out, and the pool table
            // (read from the others) marks it missing, so only its volumes are offline.
            match open_spec(s, &opts) {
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
        if opened.is_empty() {
            if let Some(e) = first_error {
                return Err(e);
            }
        }
        let best = opened
            .iter()
            .filter_map(|(_, st)| match st {
                DeviceState::Member(r, _) => Some(r),
                _ => None,
            })
            .max_by_key(|r| r.generation)
            .cloned();
        let (mut table, generation) = match best {
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
        };
        let pool_uuid = table.pool_uuid;
        // Devices that joined at run time (`device add`, `device replace`, spares) are not in
        // the configuration: they are found again at the path the pool table last saw them.
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
            match open_spec(&spec, &opts) {
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
        let mut needs_write = false;
        let mut members = Vec::new();
        let mut seen = HashSet::new();
        // An existing pool is not held hostage by one bad device: a device whose metadata is
        // unreadable, foreign, of an unknown format or no longer in the pool (replaced) is
        // left out untouched, with the reason logged. Only while assembling a new pool are
        // such devices a hard error (the operator is pointing at the wrong disk).
        let existing = generation > 0;
        for (dev, state) in opened {
            let path = dev.path().display().to_string();
            let p = path.clone();
            let checked: Result<Uuid> = (|| {
                let path = p;
                Ok(match state {
                    DeviceState::Member(r, note) if r.table.pool_uuid == pool_uuid => {
                        let Some(i) = table.devices.iter().position(|d| d.uuid == r.device_uuid)
                        else {
                            if !opts.force {
                                return Err(Error::Corrupt {
                                    path,
                                    why: format!(
                                        "device {} is not in the pool's current device table",
                                        r.device_uuid
                                    ),
                                });
                            }
                            needs_write = true;
                            return Self::join(&mut table, &dev, opts.force);
                        };
                        // The table was validated when it was read; the device itself must
                        // still hold the metadata area, an extent, and everything the table
                        // placed on it. A device that shrank (or is a different, smaller one
                        // carrying a copy of the metadata) is left out; one that grew keeps
                        // its extents, and the table learns its size.
                        let need = METADATA_AREA + table.min_extent;
                        let entry = &mut table.devices[i];
                        if dev.size() < need {
                            return Err(Error::Corrupt {
                                path,
                                why: format!(
                                    "device {} is {} bytes, smaller than the metadata area plus one extent ({need}); its volumes stay offline",
                                    r.device_uuid,
                                    dev.size()
                                ),
                            });
                        }
                        if dev.size() < entry.size {
                            return Err(Error::Corrupt {
                                path,
                                why: format!(
                                    "device {} is {} bytes, smaller than the {} bytes the pool table records for it (it shrank, or is not the device it claims to be); its volumes stay offline",
                                    r.device_uuid,
                                    dev.size(),
                                    entry.size
                                ),
                            });
                        }
                        if dev.size() > entry.size {
                            tracing::info!(%path, old_size = entry.size, new_size = dev.size(), "device grew");
                            entry.size = dev.size();
                            needs_write = true;
                        }
                        if let Some(n) = note {
                            tracing::warn!(%path, "{n}");
                            needs_write = true;
                        }
                        if r.generation != generation {
                            tracing::info!(%path, device_generation = r.generation, generation, "device metadata is stale, rewriting");
                            needs_write = true;
                        }
                        r.device_uuid
                    }
                    DeviceState::Member(r, _) => {
                        if !opts.force {
                            return Err(Error::ForeignPool {
                                path,
                                found: r.table.pool_uuid,
                                expected: pool_uuid,
                            });
                        }
                        needs_write = true;
                        Self::join(&mut table, &dev, true)?
                    }
                    DeviceState::Corrupt(why) if !opts.force => {
                        return Err(Error::Corrupt { path, why })
                    }
                    DeviceState::Unsupported(version) if !opts.force => {
                        return Err(Error::Unsupported {
                            path,
                            version,
                            supported: metadata::FORMAT_VERSION,
                        })
                    }
                    DeviceState::Blank | DeviceState::Corrupt(_) | DeviceState::Unsupported(_) => {
                        needs_write = true;
                        Self::join(&mut table, &dev, opts.force)?
                    }
                })
            })();
            let uuid = match checked {
                Ok(u) => u,
                Err(
                    e @ (Error::Corrupt { .. }
                    | Error::ForeignPool { .. }
                    | Error::Unsupported { .. }),
                ) if existing => {
                    tracing::error!(%path, error = %e, "device left out of the pool (not touched)");
                    left_out.push(LeftOut {
                        path,
                        reason: e.to_string(),
                    });
                    continue;
                }
                Err(e) => return Err(e),
            };
            if !seen.insert(uuid) {
                return Err(Error::Duplicate { path, uuid });
            }
            if let Some(e) = table.devices.iter_mut().find(|d| d.uuid == uuid) {
                if e.last_path != path {
                    e.last_path = path;
                    needs_write = true;
                }
            }
            let buddy = new_buddy(&dev, table.min_extent)?;
            members.push(Member {
                uuid,
                dev: Arc::new(dev),
                buddy,
            });
        }
        for v in &table.volumes {
            for e in &v.extents {
                if let Some(m) = members.iter_mut().find(|m| m.uuid == e.device) {
                    m.buddy
                        .alloc_at(e.offset, e.order)
                        .map_err(|why| Error::Corrupt {
                            path: m.dev.path().display().to_string(),
                            why: format!("volume '{}': {why}", v.name),
                        })?;
                }
            }
        }
        for d in &table.devices {
            if !members.iter().any(|m| m.uuid == d.uuid) {
                tracing::warn!(device = %d.uuid, last_path = %d.last_path, "pool device is missing; volumes on it are offline");
            }
        }
        let mut pool = Pool {
            table,
            generation,
            members,
            opts,
            left_out,
        };
        if needs_write {
            let t = pool.table.clone();
            pool.commit(t)?;
        }
        Ok(pool)
    }

    fn join(table: &mut PoolTable, dev: &Device, force: bool) -> Result<Uuid> {
        let need = METADATA_AREA.saturating_add(table.min_extent);
        if dev.size() < need {
            return Err(Error::TooSmall {
                path: dev.path().display().to_string(),
                size: dev.size(),
                need,
            });
        }
        if force {
            metadata::wipe(dev).map_err(Error::Metadata)?;
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

    /// Writes `table` as the next generation to every present member that is not isolated
    /// (failed or removed: writing to it could hang or fail), then adopts it.
    fn commit(&mut self, table: PoolTable) -> Result<()> {
        if !self.members.iter().any(|m| !m.isolated()) {
            return Err(Error::NoDevices);
        }
        let generation = self
            .generation
            .checked_add(1)
            .filter(|&g| g < u64::MAX)
            .ok_or_else(|| Error::Metadata("the pool's generation counter is exhausted".into()))?;
        for m in self.members.iter().filter(|m| !m.isolated()) {
            metadata::write_record(
                &m.dev,
                &Record {
                    generation,
                    device_uuid: m.uuid,
                    table: table.clone(),
                },
            )
            .map_err(|e| Error::Metadata(format!("{}: {e}", m.dev.path().display())))?;
        }
        self.table = table;
        self.generation = generation;
        Ok(())
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
        self.members.push(Member {
            uuid,
            dev: Arc::new(dev),
            buddy,
        });
        if let Err(e) = self.commit(table) {
            self.members.pop();
            return Err(e);
        }
        Ok(self.device_info(uuid))
    }

    fn device_info(&self, uuid: Uuid) -> DeviceInfo {
        let entry = self.table.devices.iter().find(|d| d.uuid == uuid);
        match self.members.iter().find(|m| m.uuid == uuid) {
            Some(m) => DeviceInfo {
                uuid,
                path: m.dev.path().display().to_string(),
                size: m.dev.size(),
                free: m.buddy.free_bytes(),
                present: true,
                direct_io: m.dev.direct_align().is_some(),
            },
            None => DeviceInfo {
                uuid,
                path: entry.map(|e| e.last_path.clone()).unwrap_or_default(),
                size: entry.map(|e| e.size).unwrap_or(0),
                free: 0,
                present: false,
                direct_io: false,
            },
        }
    }

    /// Pool summary.
    pub fn info(&self) -> PoolInfo {
        let devices: Vec<_> = self
            .table
            .devices
            .iter()
            .map(|d| self.device_info(d.uuid))
            .collect();
        PoolInfo {
            name: self.table.name.clone(),
            uuid: self.table.pool_uuid,
            generation: self.generation,
            min_extent: self.table.min_extent,
            size: self.members.iter().map(|m| m.buddy.total()).sum(),
            free: self.members.iter().map(|m| m.buddy.free_bytes()).sum(),
            devices,
            volumes: self.table.volumes.len(),
            left_out: self.left_out.clone(),
        }
    }

    /// Devices of the pool.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.info().devices
    }

    fn find(&self, id: &str) -> Result<usize> {
        let by_uuid = Uuid::parse_str(id).ok();
        self.table
            .volumes
            .iter()
            .position(|v| v.name == id || Some(v.uuid) == by_uuid)
            .ok_or_else(|| Error::NoSuchVolume(id.to_string()))
    }

    fn volume_info(&self, v: &VolumeEntry) -> VolumeInfo {
        let mut devices: Vec<Uuid> = Vec::new();
        for e in &v.extents {
            if !devices.contains(&e.device) {
                devices.push(e.device);
            }
        }
        VolumeInfo {
            uuid: v.uuid,
            name: v.name.clone(),
            size: v.size,
            allocated: v
                .extents
                .iter()
                .map(|e| self.table.min_extent << e.order)
                .sum(),
            read_only: v.read_only,
            num_queues: v.num_queues,
            extents: v.extents.len(),
            online: devices
                .iter()
                .all(|d| self.members.iter().any(|m| m.uuid == *d)),
            devices,
        }
    }

    /// All volumes.
    pub fn volumes(&self) -> Vec<VolumeInfo> {
        self.table
            .volumes
            .iter()
            .map(|v| self.volume_info(v))
            .collect()
    }

    /// One volume, by name or UUID.
    pub fn volume(&self, id: &str) -> Result<VolumeInfo> {
        Ok(self.volume_info(&self.table.volumes[self.find(id)?]))
    }

    /// Allocates extents covering `bytes` (a multiple of the minimum extent), largest blocks
    /// first, each on the device with the most free space that has a block of that order.
    fn allocate(&mut self, bytes: u64) -> Result<Vec<ExtentEntry>> {
        let min = self.table.min_extent;
        let mut units = bytes / min;
        let mut out: Vec<ExtentEntry> = Vec::new();
        let mut pending: Vec<u32> = Vec::new();
        while units > 0 {
            let order = 63 - units.leading_zeros();
            pending.push(order);
            units -= 1 << order;
        }
        pending.reverse(); // pop() then takes the largest block first
        while let Some(order) = pending.pop() {
            let best = self
                .members
                .iter_mut()
                .filter(|m| {
                    !m.isolated() && m.buddy.largest_free_order().is_some_and(|l| l >= order)
                })
                .max_by_key(|m| m.buddy.free_bytes());
            match best {
                Some(m) => {
                    let off = m.buddy.alloc(order).expect("checked largest free order");
                    out.push(ExtentEntry {
                        device: m.uuid,
                        offset: off,
                        order,
                    });
                }
                None if order > 0 => {
                    pending.push(order - 1);
                    pending.push(order - 1);
                }
                None => {
                    let available = self
                        .members
                        .iter()
                        .map(|m| m.buddy.free_bytes())
                        .sum::<u64>()
                        + out.iter().map(|e| min << e.order).sum::<u64>();
                    self.release(&out);
                    return Err(Error::NoSpace {
                        requested: bytes,
                        available,
                    });
                }
            }
        }
        // Largest extents first in the volume's address space.
        out.sort_by_key(|e| std::cmp::Reverse(e.order));
        Ok(out)
    }

    fn release(&mut self, extents: &[ExtentEntry]) {
        for e in extents {
            if let Some(m) = self.members.iter_mut().find(|m| m.uuid == e.device) {
                m.buddy.free(e.offset, e.order);
            }
        }
    }

    /// Zeroes newly allocated extents so a volume never reads another tenant's old data.
    fn scrub(&self, extents: &[ExtentEntry]) -> Result<()> {
        for e in extents {
            if let Some(m) = self.members.iter().find(|m| m.uuid == e.device) {
                m.dev
                    .zero_range(e.offset, self.table.min_extent << e.order)?;
            }
        }
        Ok(())
    }

    fn check_size(size: u64) -> Result<()> {
        if size == 0 || !size.is_multiple_of(512) {
            return Err(Error::InvalidArgument(format!(
                "volume size {size} must be a positive multiple of 512 bytes"
            )));
        }
        Ok(())
    }

    /// `size` rounded up to whole minimum extents; sizes so large that this overflows (near
    /// 2^64) are refused rather than wrapping to zero extents.
    fn round_up(&self, size: u64) -> Result<u64> {
        size.checked_next_multiple_of(self.table.min_extent)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "volume size {size} is too large (it does not fit in 64 bits once rounded up to the minimum extent {})",
                    self.table.min_extent
                ))
            })
    }

    /// Refuses at once an allocation of `bytes` larger than all free space together (the
    /// allocator would find out too, one block split at a time).
    fn check_space(&self, bytes: u64) -> Result<()> {
        let free = self
            .members
            .iter()
            .filter(|m| !m.isolated())
            .fold(0u64, |a, m| a.saturating_add(m.buddy.free_bytes()));
        if bytes > free {
            return Err(Error::NoSpace {
                requested: bytes,
                available: free,
            });
        }
        Ok(())
    }

    /// Creates a volume.
    pub fn create_volume(
        &mut self,
        name: &str,
        size: u64,
        read_only: bool,
        num_queues: u16,
    ) -> Result<VolumeInfo> {
        valid_name(name)?;
        Self::check_size(size)?;
        if !(1..=MAX_QUEUES).contains(&num_queues) {
            return Err(Error::InvalidArgument(format!(
                "num_queues {num_queues} must be between 1 and {MAX_QUEUES}"
            )));
        }
        if self.table.volumes.iter().any(|v| v.name == name) {
            return Err(Error::VolumeExists(name.into()));
        }
        if self.members.is_empty() {
            return Err(Error::NoDevices);
        }
        let bytes = self.round_up(size)?;
        self.check_space(bytes)?;
        let extents = self.allocate(bytes)?;
        if let Err(e) = self.scrub(&extents) {
            self.release(&extents);
            return Err(e);
        }
        let v = VolumeEntry {
            uuid: Uuid::new_v4(),
            name: name.into(),
            size,
            read_only,
            num_queues,
            extents: extents.clone(),
        };
        let mut table = self.table.clone();
        table.volumes.push(v.clone());
        if let Err(e) = self.commit(table) {
            self.release(&extents);
            return Err(e);
        }
        tracing::info!(volume = %v.name, uuid = %v.uuid, size, extents = v.extents.len(), "volume created");
        Ok(self.volume_info(&v))
    }

    /// Deletes a volume and frees its extents. The caller stops serving it first.
    pub fn delete_volume(&mut self, id: &str) -> Result<VolumeInfo> {
        let i = self.find(id)?;
        let mut table = self.table.clone();
        let v = table.volumes.remove(i);
        let info = self.volume_info(&v);
        self.commit(table)?;
        self.release(&v.extents);
        tracing::info!(volume = %v.name, uuid = %v.uuid, "volume deleted");
        Ok(info)
    }

    /// Grows a volume to `new_size` bytes. Shrinking is refused (it would destroy data).
    pub fn resize_volume(&mut self, id: &str, new_size: u64) -> Result<VolumeInfo> {
        let i = self.find(id)?;
        Self::check_size(new_size)?;
        let old = self.table.volumes[i].clone();
        if new_size < old.size {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' is {} bytes; shrinking to {new_size} would destroy data and is not supported",
                old.name, old.size
            )));
        }
        let have = self.round_up(old.size)?;
        let need = self.round_up(new_size)?;
        let extents = if need > have {
            self.check_space(need - have)?;
            self.allocate(need - have)?
        } else {
            vec![]
        };
        if let Err(e) = self.scrub(&extents) {
            self.release(&extents);
            return Err(e);
        }
        let mut table = self.table.clone();
        let v = &mut table.volumes[i];
        v.size = new_size;
        v.extents.extend(extents.iter().copied());
        let v = v.clone();
        if let Err(e) = self.commit(table) {
            self.release(&extents);
            return Err(e);
        }
        tracing::info!(volume = %v.name, old_size = old.size, new_size, "volume resized");
        Ok(self.volume_info(&v))
    }

    /// The data-path view of a volume. Fails when one of its devices is missing.
    pub fn layout(&self, id: &str) -> Result<VolumeLayout> {
        let v = &self.table.volumes[self.find(id)?];
        let mut devices: Vec<Arc<Device>> = Vec::new();
        let mut dev_index: Vec<Uuid> = Vec::new();
        let mut segments: Vec<Segment> = Vec::new();
        let mut logical = 0;
        for e in &v.extents {
            let m = self
                .members
                .iter()
                .find(|m| m.uuid == e.device)
                .ok_or_else(|| Error::Corrupt {
                    path: format!("volume '{}'", v.name),
                    why: format!("device {} is missing; the volume is offline", e.device),
                })?;
            let d = match dev_index.iter().position(|u| *u == e.device) {
                Some(d) => d,
                None => {
                    dev_index.push(e.device);
                    devices.push(m.dev.clone());
                    dev_index.len() - 1
                }
            };
            let len = self.table.min_extent << e.order;
            match segments.last_mut() {
                Some(s) if s.device == d && s.offset + s.len == e.offset => s.len += len,
                _ => segments.push(Segment {
                    logical,
                    len,
                    device: d,
                    offset: e.offset,
                }),
            }
            logical += len;
        }
        Ok(VolumeLayout {
            uuid: v.uuid,
            name: v.name.clone(),
            size: v.size,
            read_only: v.read_only,
            num_queues: v.num_queues,
            segments,
            devices,
        })
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
        if let Some(m) = self.members.iter().find(|m| m.uuid == old) {
            if !m.isolated() && !force {
                return Err(Error::InvalidArgument(format!(
                    "device {old} ({}) is healthy; replacing it would discard the data of every volume on it. Pass force to do it anyway",
                    m.dev.path().display()
                )));
            }
        }
        let dev = open_spec(spec, &self.opts)?;
        let path = dev.path().display().to_string();
        match metadata::read_device(&dev) {
            DeviceState::Blank => {}
            DeviceState::Member(r, _) if r.device_uuid == old => {
                return Err(Error::InvalidArgument(format!(
                    "{path} is the device being replaced"
                )))
            }
            _ if !force => {
                return Err(Error::InvalidArgument(format!(
                    "{path} is not blank (it has pool metadata or other data); pass force to reformat it"
                )))
            }
            _ => {}
        }
        let mut table = self.table.clone();
        let new = Self::join(&mut table, &dev, force)?;
        let mut buddy = new_buddy(&dev, table.min_extent)?;
        let mut moved = 0;
        let mut volumes = Vec::new();
        for v in &mut table.volumes {
            let mut touched = false;
            for e in v.extents.iter_mut().filter(|e| e.device == old) {
                let off = buddy.alloc(e.order).ok_or_else(|| Error::NoSpace {
                    requested: self.table.min_extent << e.order,
                    available: buddy.free_bytes(),
                })?;
                *e = ExtentEntry {
                    device: new,
                    offset: off,
                    order: e.order,
                };
                moved += 1;
                touched = true;
            }
            if touched {
                volumes.push(v.name.clone());
            }
        }
        table.devices.retain(|d| d.uuid != old);
        for v in table.volumes.iter().filter(|v| volumes.contains(&v.name)) {
            for e in v.extents.iter().filter(|e| e.device == new) {
                dev.zero_range(e.offset, table.min_extent << e.order)?;
            }
        }
        let removed = self
            .members
            .iter()
            .position(|m| m.uuid == old)
            .map(|i| self.members.remove(i));
        self.members.push(Member {
            uuid: new,
            dev: Arc::new(dev),
            buddy,
        });
        if let Err(e) = self.commit(table) {
            self.members.pop();
            if let Some(m) = removed {
                self.members.push(m);
            }
            return Err(e);
        }
        tracing::warn!(old = %old, new = %new, %path, extents = moved, volumes = ?volumes, "device replaced; the volumes' data on the old device is lost");
        Ok(Replacement {
            old,
            new: self.device_info(new),
            volumes,
            extents: moved,
        })
    }

    /// Pool name.
    pub fn name(&self) -> &str {
        &self.table.name
    }

    /// Paths of present devices.
    pub fn device_paths(&self) -> Vec<&Path> {
        self.members.iter().map(|m| m.dev.path()).collect()
    }
}

#[cfg(test)]
mod tests;
