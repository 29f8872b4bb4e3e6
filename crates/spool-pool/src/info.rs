//! What the control plane is told about the pool, its devices and volumes.
//!
//! Owns: the serialisable descriptions ([`PoolInfo`], [`DeviceInfo`], [`VolumeInfo`],
//! [`LeftOut`], [`Replacement`], [`LegInfo`]). Must not know: RPC, formatting for people.

use serde::Serialize;
use uuid::Uuid;

use crate::metadata::VolumeEntry;
use crate::{Pool, QosLimits, Result};

/// What a device replacement did.
#[derive(Debug, Clone, Serialize)]
pub struct Replacement {
    pub old: Uuid,
    pub new: DeviceInfo,
    /// Volumes whose extents moved to the new device (their data there reads as zeroes).
    pub volumes: Vec<String>,
    pub extents: usize,
}

/// A configured device the pool is running without.
#[derive(Debug, Clone, Serialize)]
pub struct LeftOut {
    pub path: String,
    pub reason: String,
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
    /// I/O limits, if any.
    pub qos: Option<QosLimits>,
    /// Copies the volume keeps (1: plain).
    pub copies: u8,
    /// A mirrored volume's legs (fewer than `copies`: degraded).
    pub legs: Vec<LegInfo>,
    /// `POOL/IMAGE` of a volume on an RBD image (docs/ceph.md).
    pub rbd: Option<String>,
    /// Where its data lies, extent by extent, each copy in volume order.
    pub extent_map: Vec<ExtentInfo>,
    /// Its data is encrypted (docs/encryption.md).
    pub encrypted: bool,
    /// The id of the key-encryption key its data key is wrapped under (never the key).
    pub kek_id: Option<String>,
    /// A thin volume's chunks (docs/thin.md).
    pub thin: Option<ThinInfo>,
    /// Another host's copy, not to be run here until promoted (docs/replicas.md).
    pub replica: Option<crate::metadata::ReplicaOf>,
    /// The epoch the volume is served under here (0: never promoted).
    pub epoch: u64,
}

/// A thin volume's space.
#[derive(Debug, Clone, Serialize)]
pub struct ThinInfo {
    /// Bytes per chunk.
    pub chunk: u64,
    /// Bytes of the volume backed by chunks now.
    pub mapped: u64,
    /// Bytes its map takes.
    pub map_bytes: u64,
    /// Writes waiting for free space now (the pool is full).
    pub waiting_for_space: u64,
    /// How large the volume can grow (what its map holds); 0 when it is not served.
    pub max_size: u64,
    /// Why the volume is not served (a map that cannot be read or is corrupt).
    pub error: Option<String>,
}

/// One extent of a volume: `len` bytes at `offset` on `device`, holding the volume's bytes
/// from `volume_offset` (of the mirror leg in slot `copy`; 0 for a plain volume).
#[derive(Debug, Clone, Serialize)]
pub struct ExtentInfo {
    pub copy: u8,
    pub volume_offset: u64,
    pub device: Uuid,
    pub offset: u64,
    pub len: u64,
}

/// One copy of a mirrored volume.
#[derive(Debug, Clone, Serialize)]
pub struct LegInfo {
    pub slot: u8,
    /// Holds a complete copy (false while it is first being rebuilt).
    pub synced: bool,
    /// All of its devices are present and not isolated.
    pub present: bool,
    pub devices: Vec<Uuid>,
    /// A copy on another host (a volume being sent): its NBD address.
    pub remote: Option<String>,
    /// Why the remote copy is not connected now, if it is not.
    pub remote_trouble: Option<String>,
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
    /// What thin volumes promise (the sum of their sizes) and what their chunks take now:
    /// `provisioned` above `size` is over-commitment.
    pub thin_provisioned: u64,
    pub thin_mapped: u64,
    /// Bytes of chunks named by more than one map (a volume and its snapshots, clones).
    pub thin_shared: u64,
}

impl Pool {
    pub(crate) fn device_info(&self, uuid: Uuid) -> DeviceInfo {
        let entry = self.table.devices.iter().find(|d| d.uuid == uuid);
        match self.members.iter().find(|m| m.uuid == uuid) {
            Some(m) => DeviceInfo {
                uuid,
                path: m.dev.path().display().to_string(),
                size: m.dev.size(),
                free: m.free_bytes(),
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
        let thin: Vec<&VolumeEntry> = self
            .table
            .volumes
            .iter()
            .filter(|v| v.thin.is_some())
            .collect();
        PoolInfo {
            name: self.table.name.clone(),
            uuid: self.table.pool_uuid,
            generation: self.generation,
            min_extent: self.table.min_extent,
            size: self.members.iter().map(|m| m.total()).sum(),
            free: self.members.iter().map(|m| m.free_bytes()).sum(),
            devices,
            volumes: self.table.volumes.len(),
            left_out: self.left_out.clone(),
            // A mirrored thin volume provisions and maps its size once per copy.
            thin_provisioned: thin
                .iter()
                .map(|v| {
                    v.size
                        .saturating_mul(crate::thin_maps::map_refs(v).len() as u64)
                })
                .sum(),
            thin_mapped: thin
                .iter()
                .flat_map(|v| crate::thin_maps::map_refs(v))
                .map(|m| self.thin_state(m.key).mapped)
                .sum(),
            thin_shared: self.space.refs.shared_chunks() * self.table.min_extent,
        }
    }

    /// Devices of the pool.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.info().devices
    }

    pub(crate) fn volume_info(&self, v: &VolumeEntry) -> VolumeInfo {
        let mut devices: Vec<Uuid> = Vec::new();
        // A mirrored thin volume's copies name the devices their chunks may lie on.
        let copy_devices = v.leg_maps().flat_map(|(_, m)| &m.devices);
        for d in v.all_extents().map(|e| &e.device).chain(copy_devices) {
            if !devices.contains(d) {
                devices.push(*d);
            }
        }
        let usable = |u: Uuid| self.members.iter().any(|m| m.uuid == u && !m.isolated());
        let legs = self.leg_infos(v, &devices);
        // A thin volume's maps: its own, or each copy's of a mirrored one (whose writes wait
        // for space, or whose maps fail, each on its own).
        let states: Vec<crate::thin::ThinState> = (crate::thin_maps::map_refs(v).iter())
            .map(|m| self.thin_state(m.key))
            .collect();
        let thin = self.thin_info(v, &states);
        // Chunks of every copy after the first (whose are the volume's `mapped`).
        let copies_mapped: u64 = states.iter().skip(1).map(|s| s.mapped).sum();
        VolumeInfo {
            uuid: v.uuid,
            name: v.name.clone(),
            size: v.size,
            allocated: v
                .all_extents()
                .map(|e| self.table.min_extent << e.order)
                .sum::<u64>()
                + thin.as_ref().map_or(0, |t| t.mapped)
                + copies_mapped,
            read_only: v.read_only,
            num_queues: v.num_queues,
            extents: v.all_extents().count(),
            // A thin volume being sent is online as a thin volume is (its map's devices).
            online: match (v.is_mirrored(), v.thin.is_some()) {
                (true, false) => crate::mirror::covered(v, self.table.min_extent, usable),
                // A mirrored thin volume: while one synced copy has all its devices.
                (true, true) if v.is_mirrored_thin() => legs.iter().any(|l| l.synced && l.present),
                _ => devices
                    .iter()
                    .all(|d| self.members.iter().any(|m| m.uuid == *d)),
            },
            devices,
            qos: v.qos,
            copies: v.copies.max(1),
            legs,
            rbd: v.rbd.as_ref().map(|r| r.spec()),
            extent_map: self.extent_map(v),
            encrypted: v.encryption.is_some(),
            kek_id: v.encryption.as_ref().map(|k| k.kek_id.clone()),
            thin,
            replica: v.replica.clone(),
            epoch: v.epoch,
        }
    }

    /// What `volume show` says of each of `v`'s legs (`devices`: the volume's).
    fn leg_infos(&self, v: &VolumeEntry, devices: &[Uuid]) -> Vec<LegInfo> {
        let usable = |u: Uuid| self.members.iter().any(|m| m.uuid == u && !m.isolated());
        let present =
            |extents: &[crate::metadata::ExtentEntry]| extents.iter().all(|e| usable(e.device));
        v.legs
            .iter()
            .map(|l| {
                let mut leg_devices: Vec<Uuid> = Vec::new();
                for e in &l.extents {
                    if !leg_devices.contains(&e.device) {
                        leg_devices.push(e.device);
                    }
                }
                // A thin volume's leg here is its map (its devices are the volume's, or a
                // mirrored thin volume's copy's own): the mirror's events name them.
                let mut present = present(&l.extents);
                if let (Some(_), None) = (&v.thin, &l.remote) {
                    leg_devices = match &l.thin {
                        Some(m) => m.devices.clone(),
                        None => devices.to_vec(),
                    };
                    present = leg_devices.iter().all(|&d| usable(d));
                }
                let devices = leg_devices;
                let trouble = l.remote.as_ref().and_then(|r| self.remote_trouble(r));
                LegInfo {
                    slot: l.slot,
                    synced: l.synced,
                    present: present && trouble.is_none(),
                    devices,
                    remote: l.remote.as_ref().map(|r| r.uri.clone()),
                    remote_trouble: trouble,
                }
            })
            .collect()
    }

    /// What `volume show` says of thin volume `v`'s maps (`states`: each map's, its own or
    /// each copy's).
    fn thin_info(&self, v: &VolumeEntry, states: &[crate::thin::ThinState]) -> Option<ThinInfo> {
        v.thin.as_ref().map(|t| {
            let mut copies = states.iter();
            let s = copies.next().cloned().unwrap_or_default();
            let map_bytes = |m: &[crate::metadata::ExtentEntry]| -> u64 {
                m.iter().map(|e| self.table.min_extent << e.order).sum()
            };
            let copy_maps = v.leg_maps().map(|(_, m)| map_bytes(&m.map));
            ThinInfo {
                chunk: t.chunk,
                mapped: s.mapped,
                map_bytes: map_bytes(&t.map) + copy_maps.sum::<u64>(),
                waiting_for_space: s.waiting_for_space
                    + copies.clone().map(|c| c.waiting_for_space).sum::<u64>(),
                max_size: s.max_size,
                error: s.error.or_else(|| copies.find_map(|c| c.error.clone())),
            }
        })
    }

    fn extent_map(&self, v: &VolumeEntry) -> Vec<ExtentInfo> {
        let mut map = Vec::new();
        let copies: Vec<(u8, &[crate::metadata::ExtentEntry])> = match v.is_mirrored() {
            true => v
                .legs
                .iter()
                .map(|l| (l.slot, l.extents.as_slice()))
                .collect(),
            false => vec![(0, v.extents.as_slice())],
        };
        for (copy, extents) in copies {
            let mut volume_offset = 0;
            for e in extents {
                let len = self.table.min_extent << e.order;
                map.push(ExtentInfo {
                    copy,
                    volume_offset,
                    device: e.device,
                    offset: e.offset,
                    len,
                });
                volume_offset += len;
            }
        }
        map
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
}
