//! The data path's view of a volume: its logical→physical map onto device handles.
//!
//! Owns: [`VolumeLayout`] and [`Segment`], and building them from the pool table (a mirrored
//! volume is one segment on its mirror device, a spool-mirror `Mirror` over its legs,
//! kept in [`MirrorCache`] while the legs stay the same). Must not know: how I/O is submitted
//! (the frontend does that), metadata on disk.

use std::sync::Arc;

use uuid::Uuid;

use crate::{Error, Pool, QosLimits, Result};
use spool_devices::Device;
use spool_mirror::{LegPiece, LegSpec, Mirror, MirrorSpec, MISSING};

use crate::metadata::{ExtentEntry, LegEntry, VolumeEntry};

/// Mirror devices by volume, each with what it was built from.
pub(crate) type MirrorCache = std::collections::HashMap<Uuid, (MirrorKey, Mirror)>;

/// What a mirror device was built from: its legs and the member handles they use.
#[derive(PartialEq, Eq)]
pub(crate) struct MirrorKey {
    size: u64,
    /// Slot and placement of each leg (its extents, and a remote leg's id or a thin copy's
    /// map UUID; not its synced flag: marking a rebuilt leg synced
    /// changes nothing on the data path).
    legs: Vec<(u8, Vec<ExtentEntry>, Option<Uuid>)>,
    handles: Vec<usize>,
}

/// Identity of a leg's placement (FNV-1a over its extents), never 0.
pub(crate) fn leg_id(extents: &[ExtentEntry]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for e in extents {
        for b in e
            .device
            .as_bytes()
            .iter()
            .copied()
            .chain(e.offset.to_le_bytes())
            .chain(e.order.to_le_bytes())
        {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h.max(1)
}

/// Identity of a remote leg's placement (from the id the send gave it), or of a mirrored
/// thin volume's copy (from its map's UUID), never 0.
fn uuid_leg_id(id: Uuid) -> u64 {
    let (hi, lo) = id.as_u64_pair();
    (hi ^ lo).max(1)
}

/// The identity the mirror knows leg `l` by (its bits in the write-intent bitmap).
pub(crate) fn table_leg_id(l: &LegEntry) -> u64 {
    match (&l.remote, &l.thin) {
        (Some(r), _) => uuid_leg_id(r.id),
        // A copy made anew (a device replaced under it) has a new map, so a new identity:
        // the mirror rebuilds it whole.
        (None, Some(m)) => uuid_leg_id(m.uuid),
        (None, None) => leg_id(&l.extents),
    }
}

/// The discard alignment of a volume that is not thin.
pub const DEFAULT_DISCARD_ALIGNMENT: u64 = 4096;

/// One piece of a volume's address space mapped onto a device (its `device` indexes
/// [`VolumeLayout::devices`]): the fan-out engine's span, as a mirror's leg pieces are.
pub type Segment = spool_devices::fanout::Span;

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
    /// I/O limits the workers enforce (None: unlimited, and no cost).
    pub qos: Option<QosLimits>,
    pub devices: Vec<Arc<Device>>,
    /// An encrypted volume's cipher (docs/encryption.md): the frontend wraps each device
    /// queue in a `spool_crypt::CryptQueue` with the segments' volume offsets as tweaks.
    pub cipher: Option<crate::encryption::VolumeCipher>,
    /// The unit in which discards give space back, advertised to the guest as the discard
    /// alignment: a thin volume's chunk (docs/thin.md), else 4 KiB.
    pub discard_alignment: u64,
    /// The pool table's generation it was made from: a volume's running queues keep the
    /// newest they were given (one made earlier and published late is dropped), and what
    /// a commit took out of the table is out of their reach once none holds a layout older
    /// than that commit.
    pub generation: u64,
}

impl VolumeLayout {
    /// The device and device offset of `[offset, offset + len)` when it lies within one
    /// segment (the common case); `None` when it spans segments or lies outside them.
    #[inline]
    pub fn map_one(&self, offset: u64, len: u64) -> Option<(usize, u64)> {
        spool_devices::fanout::within_one(&self.segments, offset, len)
    }

    /// Splits the volume range `[offset, offset + len)` into device pieces:
    /// `f(device index, device offset, piece length, offset within the range)`.
    /// The caller has checked the range against `size`.
    #[inline]
    pub fn map(&self, offset: u64, len: u64, f: impl FnMut(usize, u64, u64, u64)) {
        spool_devices::fanout::split(&self.segments, offset, len, f)
    }

    /// A queue on device `d` of the layout for one worker, through [`Self::wrap_queue`].
    pub fn open_queue(
        &self,
        d: usize,
        depth: u32,
    ) -> std::io::Result<Box<dyn spool_devices::DeviceQueue>> {
        let dev = self.devices.get(d).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such device in the layout")
        })?;
        Ok(self.wrap_queue(d, dev.open_queue(depth)?))
    }

    /// `q`, a queue on device `d`, as the volume's I/O goes through it: an encrypted
    /// volume's is wrapped in a [`spool_crypt::CryptQueue`] whose tweaks are the volume
    /// offsets of the layout's segments on that device.
    pub fn wrap_queue(
        &self,
        d: usize,
        q: Box<dyn spool_devices::DeviceQueue>,
    ) -> Box<dyn spool_devices::DeviceQueue> {
        match &self.cipher {
            None => q,
            Some(c) => {
                let pieces = self.segments.iter().filter(|s| s.device == d);
                let map = spool_crypt::TweakMap::new(
                    pieces.map(|s| (s.offset, s.len, s.logical)).collect(),
                );
                Box::new(spool_crypt::CryptQueue::new(q, c.clone(), map))
            }
        }
    }
}

/// A volume that is one segment of `len` bytes at the start of `dev` (a mirror device, an
/// RBD image).
fn one_segment(
    v: &VolumeEntry,
    len: u64,
    dev: Arc<Device>,
    cipher: Option<crate::encryption::VolumeCipher>,
) -> VolumeLayout {
    VolumeLayout {
        uuid: v.uuid,
        name: v.name.clone(),
        size: v.size,
        read_only: v.read_only,
        num_queues: v.num_queues,
        segments: vec![Segment {
            logical: 0,
            len,
            device: 0,
            offset: 0,
        }],
        devices: vec![dev],
        qos: v.qos,
        cipher,
        discard_alignment: v
            .thin
            .as_ref()
            .map_or(DEFAULT_DISCARD_ALIGNMENT, |t| t.chunk),
        generation: 0,
    }
}

impl Pool {
    /// The data-path view of a volume. Fails when one of its devices is missing (for a
    /// mirrored volume: when no synced leg is present).
    pub fn layout(&self, id: &str) -> Result<VolumeLayout> {
        let mut l = self.layout_now(id)?;
        l.generation = self.generation;
        Ok(l)
    }

    fn layout_now(&self, id: &str) -> Result<VolumeLayout> {
        let v = &self.table.volumes[self.find(id)?];
        let cipher = self.volume_cipher(v)?;
        if let Some(r) = &v.rbd {
            let dev = self.rbd_device(v, r)?;
            return Ok(one_segment(v, dev.size(), dev, cipher));
        }
        // Before thin: a thin volume being sent is a mirror whose local leg is its thin device.
        if v.is_mirrored() {
            let dev = self.open_mirror(v)?.device().clone();
            return Ok(one_segment(v, self.mirror_size(v), dev, cipher));
        }
        if v.thin.is_some() {
            let dev = self.thin_device(v)?;
            return Ok(one_segment(v, v.size, dev, cipher));
        }
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
            qos: v.qos,
            cipher,
            discard_alignment: DEFAULT_DISCARD_ALIGNMENT,
            generation: 0,
        })
    }
}

impl Pool {
    /// Where volume `uuid`'s write-intent bitmap lives.
    pub(crate) fn bitmap_path(&self, uuid: Uuid) -> Option<std::path::PathBuf> {
        self.opts
            .mirror_dir
            .as_ref()
            .map(|d| d.join(format!("{uuid}.bitmap")))
    }

    /// The bytes each copy of mirrored `v` holds (a local leg's extents; a thin volume being
    /// sent: its thin device's, the volume's size).
    pub(crate) fn mirror_size(&self, v: &VolumeEntry) -> u64 {
        if v.thin.is_some() {
            return v.size;
        }
        v.copies_extents()
            .first()
            .map(|x| x.iter().map(|e| self.table.min_extent << e.order).sum())
            .unwrap_or(0)
    }

    /// What the mirror is told of leg `l` (a copy of `size` bytes, of a volume of
    /// `volume_size`), its devices added to `devices`. A remote leg is one piece over the
    /// volume's size (a thick volume's legs here go on to the end of its last extent, which
    /// is not the volume's: the other host's copy has no such tail), missing while its link
    /// is down (the leg then misses writes, and the bitmap says which); a local leg of a
    /// thin volume (being sent, or mirrored) is one piece over its map's thin device, which
    /// holds its data (`thin`: `Some(None)` when that map is not served: the leg is missing).
    fn leg_spec(
        &self,
        l: &LegEntry,
        (size, volume_size): (u64, u64),
        thin: Option<Option<&Arc<Device>>>,
        devices: &mut Vec<Arc<Device>>,
    ) -> LegSpec {
        let mut index = |dev: Arc<Device>| match devices.iter().position(|d| Arc::ptr_eq(d, &dev)) {
            Some(d) => d,
            None => {
                devices.push(dev);
                devices.len() - 1
            }
        };
        let whole = match (&l.remote, thin) {
            (Some(r), _) => Some((self.remote_device(r).map_or(MISSING, &mut index), true)),
            (None, Some(t)) => Some((t.map_or(MISSING, |t| index(t.clone())), false)),
            (None, None) => None,
        };
        if let Some((device, far)) = whole {
            let len = if far { size.min(volume_size) } else { size };
            return LegSpec {
                slot: l.slot,
                id: table_leg_id(l),
                synced: l.synced,
                far,
                pieces: vec![LegPiece {
                    logical: 0,
                    len,
                    device,
                    offset: 0,
                }],
            };
        }
        let mut pieces = Vec::new();
        let mut logical = 0;
        for e in &l.extents {
            let len = self.table.min_extent << e.order;
            let device = match self.members.iter().find(|m| m.uuid == e.device) {
                Some(m) => index(m.dev.clone()),
                None => MISSING,
            };
            pieces.push(LegPiece {
                logical,
                len,
                device,
                offset: e.offset,
            });
            logical += len;
        }
        LegSpec {
            slot: l.slot,
            id: table_leg_id(l),
            synced: l.synced,
            far: false,
            pieces,
        }
    }

    /// The mirror of `v`: the cached one while its legs are unchanged, else a new one
    /// (sharing the old one's region state).
    pub(crate) fn open_mirror(&self, v: &VolumeEntry) -> Result<Mirror> {
        let mut devices: Vec<Arc<Device>> = Vec::new();
        let size = self.mirror_size(v);
        // Each local leg of a thin volume is one of its maps: the volume's own, or a mirrored
        // copy's. A map that is not served leaves its leg missing; the volume is served while
        // a synced leg's is.
        let mut maps: Vec<Option<Result<Arc<Device>>>> = (v.legs.iter())
            .map(|l| match (&v.thin, &l.remote, &l.thin) {
                (None, _, _) | (_, Some(_), _) => None,
                (Some(_), None, Some(m)) => Some(self.map_device(v, m.uuid)),
                (Some(_), None, None) => Some(self.thin_device(v)),
            })
            .collect();
        let served = |(l, m): (&LegEntry, &Option<Result<Arc<Device>>>)| {
            l.synced && matches!(m, Some(Ok(_)))
        };
        if v.thin.is_some() && !v.legs.iter().zip(&maps).any(served) {
            // No synced leg's map is served: the first one's error says why.
            let failed = (v.legs.iter().zip(&maps)).position(|(l, m)| l.synced && m.is_some());
            if let Some(Some(Err(e))) = failed.map(|i| maps.swap_remove(i)) {
                return Err(e);
            }
        }
        let legs = (v.legs.iter().zip(&maps))
            .map(|(l, m)| {
                let thin = m.as_ref().map(|m| m.as_ref().ok());
                self.leg_spec(l, (size, v.size), thin, &mut devices)
            })
            .collect();
        let present = |u: Uuid| self.members.iter().any(|m| m.uuid == u);
        if !crate::mirror::covered(v, self.table.min_extent, present) {
            return Err(Error::Corrupt {
                path: format!("volume '{}'", v.name),
                why: "part of the mirrored volume has no synced copy on a present device; the volume is offline".into(),
            });
        }
        let key = MirrorKey {
            size,
            legs: v
                .legs
                .iter()
                .map(|l| {
                    let id = (l.remote.as_ref().map(|r| r.id)).or(l.thin.as_ref().map(|m| m.uuid));
                    (l.slot, l.extents.clone(), id)
                })
                .collect(),
            handles: devices.iter().map(|d| Arc::as_ptr(d) as usize).collect(),
        };
        let mut cache = self.mirrors.lock().unwrap_or_else(|p| p.into_inner());
        let previous = match cache.get(&v.uuid) {
            Some((k, m)) if *k == key => return Ok(m.clone()),
            Some((_, m)) => Some(m.clone()),
            None => None,
        };
        let spec = MirrorSpec {
            name: v.name.clone(),
            size,
            devices,
            legs,
            bitmap: self.bitmap_path(v.uuid),
            resync_rate: self.opts.resync_rate,
        };
        let m = Mirror::open_after(spec, previous.as_ref())?;
        cache.insert(v.uuid, (key, m.clone()));
        Ok(m)
    }

    /// Records in the table every leg a rebuild has made current (so a lost bitmap never
    /// makes it a copy source before that); returns the volumes changed.
    pub fn settle_mirrors(&mut self) -> Result<Vec<String>> {
        let mut table = self.table.clone();
        let mut changed = Vec::new();
        {
            let cache = self.mirrors.lock().unwrap_or_else(|p| p.into_inner());
            for v in table.volumes.iter_mut().filter(|v| v.is_mirrored()) {
                let Some((_, m)) = cache.get(&v.uuid) else {
                    continue;
                };
                for l in v.legs.iter_mut().filter(|l| !l.synced) {
                    // The mirror built from this very leg (not one a later change put in
                    // the same slot, before the layout was published again).
                    if m.leg_id(l.slot) == Some(table_leg_id(l)) && m.leg_current(l.slot) {
                        l.synced = true;
                        tracing::info!(volume = %v.name, leg = l.slot, "mirror leg rebuilt: it holds a complete copy");
                        changed.push(v.name.clone());
                    }
                }
            }
        }
        if !changed.is_empty() {
            self.commit(table)?;
        }
        Ok(changed)
    }

    /// After the queues stopped: clears the intent bits of every quiet region of every
    /// mirror, so the next start resyncs only regions a write was really in flight in.
    pub fn quiesce_mirrors(&self) {
        let cache = self.mirrors.lock().unwrap_or_else(|p| p.into_inner());
        for (_, m) in cache.values() {
            m.clear_quiet_intents();
        }
    }

    /// Forgets a deleted volume's mirror (its copy stopped: a copy in flight must not land in
    /// space given back next) and bitmap.
    pub(crate) fn drop_mirror(&self, uuid: Uuid) {
        let gone = self
            .mirrors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&uuid);
        if let Some((_, m)) = gone {
            m.stop_copying();
        }
        if let Some(p) = self.bitmap_path(uuid) {
            let _ = std::fs::remove_file(p);
        }
    }

    /// The mirror of a mirrored volume being served (`None`: plain, or not served yet).
    pub fn mirror(&self, id: &str) -> Result<Option<Mirror>> {
        let v = &self.table.volumes[self.find(id)?];
        if !v.is_mirrored() {
            return Ok(None);
        }
        self.open_mirror(v).map(Some)
    }
}
