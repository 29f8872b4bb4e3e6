//! Pool layer: devices assembled into a storage pool, carved into logical volumes.
//!
//! Owns: the on-device metadata (superblock + volume table, two alternating checksummed
//! copies on every member device), the per-device buddy allocators, volume create / delete /
//! grow, and the logical→physical map ([`VolumeLayout`]) the data path uses.
//!
//! Must not know: virtio, vhost-user, guest memory, or how I/O is submitted (that is the
//! devices layer's job); it never sits on the data path.

mod assemble;
pub mod buddy;
mod check;
mod encryption;
mod export;
mod info;
mod layout;
mod legs;
mod members;
pub mod metadata;
mod mirror;
pub mod qos;
mod rbd;
mod rbd_snapshots;
mod remote;
mod replica;
mod retired;
mod snapshots;
mod thin;
mod thin_create;
mod thin_maps;
mod thin_mirror;
mod thin_move;
mod thin_space;
mod volume_image;
mod volumes;

use std::path::Path;

use uuid::Uuid;

pub use check::CheckReport;
pub use encryption::{export_key_offline, ExportedKey, VolumeCipher};
pub use export::SnapshotImage;
pub use info::{
    DeviceInfo, ExtentInfo, LeftOut, LegInfo, PoolInfo, Replacement, ThinInfo, VolumeInfo,
};
pub use layout::{Segment, VolumeLayout};
pub use legs::Relocated;
pub use members::DeviceSpec;
pub use mirror::MAX_COPIES;
pub use qos::{Priority, QosLimits};
pub use rbd::RbdTarget;
pub use remote::RemoteDue;
pub use snapshots::{inflate, SnapshotInfo};
pub use thin::DEFAULT_FULL_WAIT;
pub use thin_space::PoolSpace;

use members::Member;
use metadata::{PoolTable, Record};

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
    #[error("volume '{volume}': {why}")]
    Key { volume: String, why: String },
    #[error("thin volume '{volume}': {why}")]
    Thin { volume: String, why: String },
}

impl Error {
    /// An invalid argument, as `why` says it.
    pub(crate) fn invalid(why: impl std::fmt::Display) -> Error {
        Error::InvalidArgument(why.to_string())
    }
}

/// Result type of the pool layer.
pub type Result<T> = std::result::Result<T, Error>;

/// Default rate of a mirror's resync and rebuild copying: 64 MiB/s.
pub const DEFAULT_RESYNC_RATE: u64 = 64 << 20;

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
    /// Where mirrored volumes keep their write-intent bitmaps (`None`: in memory, which
    /// survives nothing: tests only).
    pub mirror_dir: Option<std::path::PathBuf>,
    /// Bytes per second a mirror's resync or rebuild may copy (0: unlimited).
    pub resync_rate: u64,
    /// The Ceph cluster of `rbd:POOL/IMAGE` devices (config `[ceph]`), and the daemon's
    /// connections to it.
    pub ceph: spool_devices::Ceph,
    /// Where devices keep what the next worker takes over, and what the previous one left
    /// (the daemon's; the default keeps nothing).
    pub handoff: std::sync::Arc<spool_devices::handoff::Handoff>,
    /// How long a device's lock may stay taken before it counts as in use (a worker taking
    /// over from a killed one: the dead process's descriptors close asynchronously).
    pub lock_wait: std::time::Duration,
    /// The key-encryption key that wraps encrypted volumes' data keys (config
    /// `[encryption]`); without one, encrypted volumes are refused.
    pub kek: Option<std::sync::Arc<spool_crypt::Kek>>,
    /// Key-encryption keys besides `kek` that may unwrap data keys: those a previous worker
    /// held (a rekey's two sides), the one it wrapped new keys under first. At open the pool
    /// settles which key wraps new keys and keeps the others only while its table names
    /// them ([`Pool::keks`]; docs/encryption.md).
    pub other_keks: Vec<std::sync::Arc<spool_crypt::Kek>>,
    /// How long a write to a thin volume that needs a chunk waits for free space when the
    /// pool is full before it fails (config `[thin] full_wait_ms`).
    pub thin_full_wait: std::time::Duration,
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
            mirror_dir: None,
            resync_rate: DEFAULT_RESYNC_RATE,
            ceph: Default::default(),
            handoff: Default::default(),
            lock_wait: std::time::Duration::ZERO,
            kek: None,
            other_keks: Vec::new(),
            thin_full_wait: thin::DEFAULT_FULL_WAIT,
        }
    }
}

/// An assembled storage pool.
pub struct Pool {
    table: PoolTable,
    generation: u64,
    members: Vec<Member>,
    opts: PoolOptions,
    /// Configured devices that could not be opened or were left out at start, and why.
    left_out: Vec<LeftOut>,
    /// The mirror device of each mirrored volume being served, kept while its legs stay
    /// the same (workers compare device handles: a new one resets their queues).
    mirrors: std::sync::Mutex<layout::MirrorCache>,
    /// The connection of each remote leg (a volume being sent to another host).
    remotes: std::sync::Arc<std::sync::Mutex<remote::RemoteCache>>,
    /// The device of each RBD volume in use.
    rbd_devices: std::sync::Mutex<rbd::RbdCache>,
    /// The cipher of each encrypted volume, unwrapped once.
    ciphers: std::sync::Mutex<encryption::CipherCache>,
    /// The free space thin volumes' allocators take chunks from.
    space: std::sync::Arc<PoolSpace>,
    /// The device of each thin volume (one per process: one allocator per map).
    thins: std::sync::Mutex<thin::ThinCache>,
    /// Extents of removed mirror legs the running queues may still write (`retired.rs`).
    retired: retired::Retired,
    /// A table commit failed and could not be undone: a restart may open the table before
    /// or the one that failed. Until a commit succeeds, extents released are held instead
    /// (`volumes.rs`, `Pool::release`).
    commit_unsure: bool,
}

impl Pool {
    /// Writes `table` as the next generation to every present member that is not isolated
    /// (failed or removed: writing to it could hang or fail), then adopts it.
    pub(crate) fn commit(&mut self, table: PoolTable) -> Result<()> {
        self.commit_with(table, false)
    }

    /// [`Self::commit`], twice, each time over the whole slot: afterwards neither slot of any
    /// member written holds anything of the tables before (a deleted volume's wrapped key,
    /// a key wrapped under a retired key-encryption key).
    pub(crate) fn commit_erasing(&mut self, table: PoolTable) -> Result<()> {
        self.commit_with(table.clone(), true)?;
        self.commit_with(table, true)
    }

    fn commit_with(&mut self, table: PoolTable, erase: bool) -> Result<()> {
        if !self.members.iter().any(|m| !m.isolated()) {
            return Err(Error::NoDevices);
        }
        let generation = self
            .generation
            .checked_add(1)
            .filter(|&g| g < u64::MAX)
            .ok_or_else(|| Error::Metadata("the pool's generation counter is exhausted".into()))?;
        let write = |m: &Member, generation: u64, table: &PoolTable| {
            let rec = Record {
                generation,
                device_uuid: m.uuid,
                table: table.clone(),
            };
            metadata::write_record(&m.dev, &rec, erase)
        };
        let mut took = Vec::new();
        let mut failed = None;
        for (i, m) in self
            .members
            .iter()
            .enumerate()
            .filter(|(_, m)| !m.isolated())
        {
            match write(m, generation, &table) {
                Ok(()) => took.push(i),
                Err(e) => {
                    // Only a failed device write may have left the record on the device; its
                    // error names the device already.
                    let device = matches!(e, metadata::WriteError::Device(_));
                    let why = match device {
                        true => e.to_string(),
                        false => format!("{}: {e}", m.dev.path().display()),
                    };
                    failed = Some((why, device));
                    break;
                }
            }
        }
        let Some((why, maybe_written)) = failed else {
            self.table = table;
            self.generation = generation;
            self.commit_unsure = false;
            self.refresh_space();
            return Ok(());
        };
        if took.is_empty() && !maybe_written {
            return Err(Error::Metadata(why));
        }
        // Some members hold the new table (and the one that failed may): a restart would open
        // it while this process goes on with the old one. Rolled back: the old table as the
        // generation after, on every member that took the new one (its slot for that
        // generation held the one before, which the new table now supersedes there). A
        // member whose write failed is not written again: the slot of the table before is
        // what it falls back to.
        let back = took
            .iter()
            .filter(|&&i| write(&self.members[i], generation + 1, &self.table).is_ok())
            .count();
        // The next commit goes to the slot the failed generation went to, never over the
        // last one known whole.
        self.generation = generation + 1;
        if back > 0 {
            tracing::error!(error = %why, "writing the pool table failed on a member; the table before was written back, nothing changed");
            return Err(Error::Metadata(format!(
                "{why} (nothing changed: the table before was written back)"
            )));
        }
        // Neither is known to be on the devices: the next start may open either table.
        // Until a commit succeeds, what this process frees stays taken (`Pool::release`),
        // so nothing either table names is handed out twice.
        self.commit_unsure = true;
        tracing::error!(error = %why, "writing the pool table failed and could not be undone: the next start may open the old or the new table; extents freed until a commit succeeds stay taken until a restart");
        Err(Error::Metadata(format!(
            "{why} (the new table may or may not be on the device: a restart opens one or the other; what it would have freed stays taken until then)"
        )))
    }

    pub(crate) fn find(&self, id: &str) -> Result<usize> {
        let by_uuid = Uuid::parse_str(id).ok();
        self.table
            .volumes
            .iter()
            .position(|v| v.name == id || Some(v.uuid) == by_uuid)
            .ok_or_else(|| Error::NoSuchVolume(id.to_string()))
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
mod check_tests;
#[cfg(test)]
mod mirror_tests;
#[cfg(test)]
mod rekey_tests;
#[cfg(test)]
mod remote_tests;
#[cfg(test)]
mod snapshot_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod thin_mirror_tests;
#[cfg(test)]
mod thin_rebuild_tests;
#[cfg(test)]
mod thin_takeover_tests;
#[cfg(test)]
mod thin_tests;
