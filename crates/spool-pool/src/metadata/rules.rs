//! The rules a pool table must obey to be read or written (docs/metadata-format.md,
//! "Validation"): every field that sizes, offsets or names anything, mirrored volumes' legs,
//! volumes on RBD images, encrypted volumes' key records, thin volumes' maps. A table with valid checksums but
//! impossible contents (a bug, a bit flip before the checksum was taken, a hand-edited or
//! hostile device) is refused instead of panicking, overflowing or silently dropping data.
//!
//! Must not know: devices, the pool's state, how volumes are made.

use std::collections::{HashMap, HashSet};

use uuid::Uuid;

use super::{
    block_size, check_volume_name, printable, ExtentEntry, Invalid, PoolTable, RbdImage, ThinMap,
    VolumeEntry, VolumeKey, MAX_COPIES, MAX_QUEUES, METADATA_AREA, MIN_EXTENT_MAX, MIN_EXTENT_MIN,
};

impl PoolTable {
    /// Checks every field that sizes, offsets or names anything, so that a table with valid
    /// checksums but impossible contents (a bug, a bit flip before the checksum was taken,
    /// a hand-edited or hostile device) is refused instead of panicking, overflowing or
    /// silently dropping data. Says which device, volume and field is wrong, and why.
    ///
    /// Checked: `min_extent` is a power of two in `MIN_EXTENT_MIN..=MIN_EXTENT_MAX`; device
    /// UUIDs are unique and every device holds the metadata area plus one extent; volume
    /// names are valid and unique, volume UUIDs unique, sizes positive multiples of 512,
    /// `num_queues` in `1..=MAX_QUEUES`; every extent is on a listed device, its block size
    /// fits in 64 bits, it lies in the data area, aligned to its block size relative to the
    /// data area, within the device's recorded size, and overlaps no other extent; and the
    /// extents of each volume add up to exactly its size rounded up to `min_extent`.
    pub fn validate(&self) -> Result<(), Invalid> {
        let min = self.min_extent;
        if !min.is_power_of_two() || !(MIN_EXTENT_MIN..=MIN_EXTENT_MAX).contains(&min) {
            return Err(Invalid(format!(
                "min_extent {min} is not a power of two between {MIN_EXTENT_MIN} and {MIN_EXTENT_MAX}"
            )));
        }
        let devices = self.device_sizes()?;
        let mut names = HashSet::with_capacity(self.volumes.len());
        let mut uuids = HashSet::with_capacity(self.volumes.len());
        // (device, start, end, volume index) of every extent, for the overlap check.
        let mut used: Vec<(Uuid, u64, u64, usize)> = Vec::new();
        for (vi, v) in self.volumes.iter().enumerate() {
            check_volume_name(&v.name).map_err(|e| Invalid(format!("volume {}: {e}", v.uuid)))?;
            if !names.insert(v.name.as_str()) {
                return Err(Invalid(format!("duplicate volume name '{}'", v.name)));
            }
            if !uuids.insert(v.uuid) {
                return Err(Invalid(format!(
                    "volume '{}': duplicate volume UUID {}",
                    v.name, v.uuid
                )));
            }
            // A copy's map is opened under its UUID, as a volume's is.
            for (l, m) in v.leg_maps() {
                if !uuids.insert(m.uuid) {
                    return Err(Invalid(format!(
                        "volume '{}': leg {} map UUID {} is used twice in the table",
                        v.name, l.slot, m.uuid
                    )));
                }
            }
            // A remote leg's id names its connection: two volumes must never share one.
            if let Some(r) = v.remote_leg().and_then(|l| l.remote.as_ref()) {
                if !uuids.insert(r.id) {
                    return Err(Invalid(format!(
                        "volume '{}': remote leg id {} is used twice in the table",
                        v.name, r.id
                    )));
                }
            }
            self.validate_volume(v, &devices, |dev, start, end| {
                used.push((dev, start, end, vi))
            })?;
        }
        used.sort_unstable();
        for w in used.windows(2) {
            let (a, b) = (w[0], w[1]);
            if a.0 == b.0 && b.1 < a.2 {
                return Err(Invalid(format!(
                    "extents of volume '{}' and volume '{}' overlap on device {} at {}",
                    self.volumes[a.3].name, self.volumes[b.3].name, a.0, b.1
                )));
            }
        }
        Ok(())
    }

    /// The device table as UUID → size, each device big enough for the metadata area plus
    /// one extent and listed once.
    fn device_sizes(&self) -> Result<HashMap<Uuid, u64>, Invalid> {
        // Cannot overflow: the caller checked min_extent <= MIN_EXTENT_MAX.
        let need = METADATA_AREA + self.min_extent;
        let mut devices: HashMap<Uuid, u64> = HashMap::with_capacity(self.devices.len());
        for d in &self.devices {
            if d.size < need {
                return Err(Invalid(format!(
                    "device {}: size {} is smaller than the metadata area plus one extent ({need})",
                    d.uuid, d.size
                )));
            }
            if devices.insert(d.uuid, d.size).is_some() {
                return Err(Invalid(format!(
                    "duplicate device {} in the device table",
                    d.uuid
                )));
            }
        }
        Ok(devices)
    }

    /// One volume's own fields and extents; `extent(device, start, end)` is told where each
    /// extent lies, for the overlap check across volumes.
    fn validate_volume(
        &self,
        v: &VolumeEntry,
        devices: &HashMap<Uuid, u64>,
        mut extent: impl FnMut(Uuid, u64, u64),
    ) -> Result<(), Invalid> {
        let min = self.min_extent;
        let what = format!("volume '{}'", v.name);
        if v.size == 0 || !v.size.is_multiple_of(512) {
            return Err(Invalid(format!(
                "{what}: size {} is not a positive multiple of 512",
                v.size
            )));
        }
        if !(1..=MAX_QUEUES).contains(&v.num_queues) {
            return Err(Invalid(format!(
                "{what}: num_queues {} is not between 1 and {MAX_QUEUES}",
                v.num_queues
            )));
        }
        if let Some(q) = &v.qos {
            q.validate()
                .map_err(|why| Invalid(format!("{what}: qos: {why}")))?;
        }
        if let Some(k) = &v.encryption {
            k.validate()
                .map_err(|why| Invalid(format!("{what}: {why}")))?;
        }
        if let Some(r) = &v.replica {
            r.validate()
                .map_err(|why| Invalid(format!("{what}: {why}")))?;
        }
        if v.epoch == u64::MAX {
            return Err(Invalid(format!("{what}: its epoch cannot be raised")));
        }
        if let Some(t) = &v.thin {
            return self.validate_thin(v, t, devices, extent);
        }
        if let Some(r) = &v.rbd {
            return validate_rbd(v, r).map_err(|why| Invalid(format!("{what}: {why}")));
        }
        if let Some(l) = v.legs.iter().find(|l| l.thin.is_some()) {
            return Err(Invalid(format!(
                "{what}: leg {} has a chunk map but the volume is not thin",
                l.slot
            )));
        }
        validate_legs(v).map_err(|why| Invalid(format!("{what}: {why}")))?;
        for (leg, extents) in v.copies_extents().into_iter().enumerate() {
            let what = match v.is_mirrored() {
                true => format!("{what} leg {leg}"),
                false => what.clone(),
            };
            let mut allocated = 0u64;
            for (i, e) in extents.iter().enumerate() {
                let (block, end) = validate_extent(min, e, devices)
                    .map_err(|why| Invalid(format!("{what}: extent {i} {why}")))?;
                allocated = allocated.checked_add(block).ok_or_else(|| {
                    Invalid(format!("{what}: extents add up to more than 2^64 bytes"))
                })?;
                extent(e.device, e.offset, end);
            }
            if v.size.checked_next_multiple_of(min) != Some(allocated) {
                return Err(Invalid(format!(
                    "{what}: size {} does not match its extents ({allocated} bytes; they must hold exactly the size rounded up to min_extent {min})",
                    v.size
                )));
            }
        }
        validate_distinct(v, min).map_err(|why| Invalid(format!("{what}: {why}")))
    }
}

impl PoolTable {
    /// A thin volume: no extents or copies of its own (but while it is sent: a local leg
    /// without extents, standing for its map, and the remote leg), chunks of the pool's
    /// minimum extent, a map holding an entry for every chunk.
    fn validate_thin(
        &self,
        v: &VolumeEntry,
        t: &ThinMap,
        devices: &HashMap<Uuid, u64>,
        mut extent: impl FnMut(Uuid, u64, u64),
    ) -> Result<(), Invalid> {
        let what = format!("volume '{}'", v.name);
        thin_shape(v, t).map_err(|why| Invalid(format!("{what}: {why}")))?;
        if t.chunk != self.min_extent {
            return Err(Invalid(format!(
                "{what}: thin chunk size {} is not the pool's min_extent {}",
                t.chunk, self.min_extent
            )));
        }
        if v.is_mirrored_thin() {
            self.validate_thin_copies(v, t, devices, &mut extent)?;
            if t.map.is_empty() {
                return Ok(());
            }
        }
        let mut bytes = 0u64;
        for (i, e) in t.map.iter().enumerate() {
            let (block, end) = validate_extent(self.min_extent, e, devices)
                .map_err(|why| Invalid(format!("{what}: map extent {i} {why}")))?;
            let sum = bytes.checked_add(block);
            bytes = sum.ok_or_else(|| Invalid(format!("{what}: map extents overflow 64 bits")))?;
            extent(e.device, e.offset, end);
        }
        let need = spool_thin::map::map_bytes(v.size.div_ceil(t.chunk));
        if bytes < need {
            return Err(Invalid(format!(
                "{what}: its map holds {bytes} bytes; {need} are needed for its chunks"
            )));
        }
        if let Some(o) = &t.origin {
            if o.len() > 2 * super::MAX_NAME_LEN + 1 || o.chars().any(|c| c.is_control()) {
                return Err(Invalid(format!(
                    "{what}: origin '{}' is not a snapshot's name",
                    printable(o)
                )));
            }
        }
        let mut names = std::collections::HashSet::new();
        for s in &t.snapshots {
            let what = format!("{what} snapshot '{}'", printable(&s.name));
            check_volume_name(&s.name).map_err(|why| Invalid(format!("{what}: {why}")))?;
            if !names.insert(&s.name) {
                return Err(Invalid(format!("{what}: two snapshots have this name")));
            }
            if s.uuid == v.uuid || t.snapshots.iter().filter(|o| o.uuid == s.uuid).count() > 1 {
                return Err(Invalid(format!(
                    "{what}: its UUID {} is not its own",
                    s.uuid
                )));
            }
            if s.size == 0 || !s.size.is_multiple_of(512) || s.size > v.size {
                return Err(Invalid(format!(
                    "{what}: size {} is not a positive multiple of 512 up to the volume's",
                    s.size
                )));
            }
            let mut bytes = 0u64;
            for (i, e) in s.map.iter().enumerate() {
                let (block, end) = validate_extent(self.min_extent, e, devices)
                    .map_err(|why| Invalid(format!("{what}: map extent {i} {why}")))?;
                bytes = bytes.saturating_add(block);
                extent(e.device, e.offset, end);
            }
            let need = spool_thin::map::map_bytes(s.size.div_ceil(t.chunk));
            if bytes < need {
                return Err(Invalid(format!(
                    "{what}: its map holds {bytes} bytes; {need} are needed for its chunks"
                )));
            }
        }
        Ok(())
    }
}

/// A thin volume's own fields: no extents or RBD image; legs only while it is sent (a synced
/// local one without extents, standing for its map, and the remote one) or while it is
/// mirrored (each leg with a map of its own; while copies are being added to it, one more
/// leg standing for its own map, which they are rebuilt from).
fn thin_shape(v: &VolumeEntry, t: &ThinMap) -> Result<(), Invalid> {
    let no_extents = v.legs.iter().all(|l| l.extents.is_empty());
    let own_maps = v.legs.iter().filter(|l| l.thin.is_some()).count();
    let sent = v.copies == 2
        && v.legs.len() == 2
        && v.remote_leg().is_some()
        && no_extents
        && own_maps == 0;
    let standing = match t.map.is_empty() {
        true => 0,
        false => 1,
    };
    let mirrored = v.is_mirrored()
        && v.legs.len() >= 2
        && v.remote_leg().is_none()
        && no_extents
        && own_maps >= 2
        && own_maps + standing == v.legs.len();
    let own = !sent && !mirrored && (!v.legs.is_empty() || v.copies != 0);
    if !v.extents.is_empty() || own || v.rbd.is_some() {
        return Err(Invalid("a thin volume has extents, copies or an RBD image of its own (legs only while it is sent: one standing for its map, and the remote one; or while it is mirrored: two or more each with a map of its own, and one standing for its own map while they are added)".into()));
    }
    match sent || mirrored {
        true => validate_legs(v),
        false => Ok(()),
    }
}

impl PoolTable {
    /// A mirrored thin volume's copies: each has devices of its own, no device is any two
    /// copies', each copy's map lies on its own devices and holds an entry for every chunk.
    /// No snapshots (not supported on a mirrored thin volume yet); an own map (and an origin,
    /// a clone's) only while the copies are being added, rebuilt from it.
    fn validate_thin_copies(
        &self,
        v: &VolumeEntry,
        t: &ThinMap,
        devices: &HashMap<Uuid, u64>,
        extent: &mut impl FnMut(Uuid, u64, u64),
    ) -> Result<(), Invalid> {
        let what = format!("volume '{}'", v.name);
        if !t.snapshots.is_empty() || (t.map.is_empty() && t.origin.is_some()) {
            return Err(Invalid(format!(
                "{what}: a mirrored thin volume has no snapshots, and no origin once its copies are added"
            )));
        }
        let need = spool_thin::map::map_bytes(v.size.div_ceil(t.chunk));
        let mut seen = HashSet::new();
        for (l, m) in v.leg_maps() {
            let (copy, own) = (format!("leg {}", l.slot), &m.devices);
            let what = format!("{what} {copy}");
            if own.is_empty() || own.len() > devices.len() {
                return Err(Invalid(format!(
                    "{what}: names {} devices (1 to the pool's {})",
                    own.len(),
                    devices.len()
                )));
            }
            for d in own {
                if !devices.contains_key(d) {
                    return Err(Invalid(format!("{what}: names unknown device {d}")));
                }
                if !seen.insert(*d) {
                    return Err(Invalid(format!(
                        "{what}: device {d} is named twice (copies must be on distinct devices)"
                    )));
                }
            }
            if m.uuid.is_nil() || m.uuid == v.uuid {
                return Err(Invalid(format!(
                    "{what}: its map's UUID {} is not its own",
                    m.uuid
                )));
            }
            let mut bytes = 0u64;
            for (i, e) in m.map.iter().enumerate() {
                let (block, end) = validate_extent(self.min_extent, e, devices)
                    .map_err(|why| Invalid(format!("{what}: map extent {i} {why}")))?;
                if !own.contains(&e.device) {
                    return Err(Invalid(format!(
                        "{what}: map extent {i} is on device {}, not one of its own",
                        e.device
                    )));
                }
                bytes = bytes.saturating_add(block);
                extent(e.device, e.offset, end);
            }
            if bytes < need {
                return Err(Invalid(format!(
                    "{what}: its map holds {bytes} bytes; {need} are needed for its chunks"
                )));
            }
        }
        Ok(())
    }
}

/// One extent against the device table: returns its block size and end offset.
fn validate_extent(
    min: u64,
    e: &ExtentEntry,
    devices: &HashMap<Uuid, u64>,
) -> Result<(u64, u64), Invalid> {
    let dev_size = *devices
        .get(&e.device)
        .ok_or_else(|| Invalid(format!("is on unknown device {}", e.device)))?;
    let block = block_size(min, e.order).ok_or_else(|| {
        Invalid(format!(
            "has order {}: a block of {min} << {} bytes does not fit in 64 bits",
            e.order, e.order
        ))
    })?;
    let rel = e.offset.checked_sub(METADATA_AREA).ok_or_else(|| {
        Invalid(format!(
            "at {} lies in the metadata area (data starts at {METADATA_AREA})",
            e.offset
        ))
    })?;
    if !rel.is_multiple_of(block) {
        return Err(Invalid(format!(
            "at {} is not aligned to its block size {block}",
            e.offset
        )));
    }
    let end = e
        .offset
        .checked_add(block)
        .filter(|&end| end <= dev_size)
        .ok_or_else(|| {
            Invalid(format!(
                "at {} ({block} bytes) reaches beyond the end of device {} ({dev_size} bytes)",
                e.offset, e.device
            ))
        })?;
    Ok((block, end))
}

impl VolumeKey {
    /// Checks the fields' shapes (not whether any key unwraps it).
    pub fn validate(&self) -> Result<(), Invalid> {
        if self.cipher != spool_crypt::CIPHER {
            return Err(Invalid(format!(
                "encryption: unknown cipher '{}' (only {} exists)",
                printable(&self.cipher),
                spool_crypt::CIPHER
            )));
        }
        if self.kek_id.len() != 16 || spool_crypt::from_hex(&self.kek_id).is_none() {
            return Err(Invalid(
                "encryption: kek_id is not 16 hexadecimal digits".into(),
            ));
        }
        match spool_crypt::from_hex(&self.wrapped) {
            Some(w) if w.len() == spool_crypt::WRAPPED_LEN => Ok(()),
            _ => Err(Invalid(format!(
                "encryption: the wrapped key is not {} bytes of hex",
                spool_crypt::WRAPPED_LEN
            ))),
        }
    }
}

/// The leg fields of a volume: a plain volume has none; a mirrored one wants 2 or 3 copies,
/// keeps its extents in 1 to 3 legs with distinct slots, and at least one leg is synced.
fn validate_legs(v: &VolumeEntry) -> Result<(), Invalid> {
    if !v.is_mirrored() {
        return match v.legs.is_empty() {
            true => Ok(()),
            false => Err(Invalid(
                "has mirror legs but is not mirrored (copies 0)".into(),
            )),
        };
    }
    if !(2..=MAX_COPIES).contains(&v.copies) {
        return Err(Invalid(format!(
            "copies {} is not between 2 and {MAX_COPIES}",
            v.copies
        )));
    }
    if !v.extents.is_empty() {
        return Err(Invalid(
            "is mirrored but has extents outside its legs".into(),
        ));
    }
    if v.legs.is_empty() || v.legs.len() > MAX_COPIES as usize {
        return Err(Invalid(format!(
            "has {} legs (a mirrored volume has 1 to {MAX_COPIES})",
            v.legs.len()
        )));
    }
    let mut slots = HashSet::new();
    for l in &v.legs {
        if l.slot >= MAX_COPIES || !slots.insert(l.slot) {
            return Err(Invalid(format!(
                "leg slot {} is out of range or repeated",
                l.slot
            )));
        }
    }
    if !v.legs.iter().any(|l| l.synced && l.remote.is_none()) {
        return Err(Invalid(
            "has no synced leg on this pool (no complete copy of its data here)".into(),
        ));
    }
    validate_remote(v)
}

/// Most bytes of a remote leg's NBD URI.
const MAX_URI: usize = 1024;

/// A remote leg (a copy being sent to another host): at most one, no extents here, and an
/// NBD URI of printable ASCII.
fn validate_remote(v: &VolumeEntry) -> Result<(), Invalid> {
    let remote: Vec<_> = v
        .legs
        .iter()
        .filter_map(|l| Some((l, l.remote.as_ref()?)))
        .collect();
    if remote.len() > 1 {
        return Err(Invalid(format!(
            "has {} remote legs (at most one)",
            remote.len()
        )));
    }
    for (l, r) in remote {
        if !l.extents.is_empty() {
            return Err(Invalid(format!(
                "remote leg {} has extents on this pool",
                l.slot
            )));
        }
        let printable = r.uri.bytes().all(|b| b.is_ascii_graphic());
        let scheme = spool_devices::is_nbd_uri(&r.uri);
        if r.uri.len() > MAX_URI || !printable || !scheme {
            return Err(Invalid(format!(
                "remote leg {}: its address is not an nbd://, nbd+unix:// (or nbds://) URI of at most {MAX_URI} printable characters",
                l.slot
            )));
        }
        if r.id.is_nil() {
            return Err(Invalid(format!("remote leg {} has a nil id", l.slot)));
        }
    }
    Ok(())
}

/// No two legs of a mirrored volume use the same device at the same logical range.
fn validate_distinct(v: &VolumeEntry, min: u64) -> Result<(), Invalid> {
    let legs: Vec<_> = v.legs.iter().map(|l| spans(&l.extents, min)).collect();
    for (i, a) in legs.iter().enumerate() {
        for b in &legs[i + 1..] {
            if let Some((start, dev)) = shared_device(a, b) {
                return Err(Invalid(format!(
                    "two legs use device {dev} at volume offset {start} (copies must be on distinct devices)"
                )));
            }
        }
    }
    Ok(())
}

/// The first logical offset where both legs use the same device, and that device.
fn shared_device(a: &[(u64, u64, Uuid)], b: &[(u64, u64, Uuid)]) -> Option<(u64, Uuid)> {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        if x.0 < y.1 && y.0 < x.1 && x.2 == y.2 {
            return Some((x.0.max(y.0), x.2));
        }
        if x.1 <= y.1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    None
}

/// A volume on an RBD image: names Ceph accepts, nothing of a local volume.
fn validate_rbd(v: &VolumeEntry, r: &RbdImage) -> Result<(), Invalid> {
    if !v.extents.is_empty() || !v.legs.is_empty() || v.copies != 0 {
        return Err(Invalid("an RBD volume has extents or copies".into()));
    }
    for (what, name) in [("pool", &r.pool), ("image", &r.image)] {
        rbd_name(name).map_err(|why| Invalid(format!("rbd {what}: {why}")))?;
    }
    Ok(())
}

/// A Ceph pool or image name as spoold accepts it: 1..=128 bytes, no '/', '@', NUL or
/// whitespace.
pub fn rbd_name(name: &str) -> Result<(), Invalid> {
    if name.is_empty() || name.len() > 128 {
        return Err(Invalid(format!(
            "{:?} must be 1 to 128 bytes",
            printable(name)
        )));
    }
    if name
        .chars()
        .any(|c| c == '/' || c == '@' || c == '\0' || c.is_whitespace() || c.is_control())
    {
        return Err(Invalid(format!(
            "{:?} contains '/', '@', whitespace or a control character",
            printable(name)
        )));
    }
    Ok(())
}

/// `(logical start, logical end, device)` of each extent of one leg.
pub(crate) fn spans(extents: &[ExtentEntry], min: u64) -> Vec<(u64, u64, Uuid)> {
    let mut at = 0u64;
    extents
        .iter()
        .map(|e| {
            let len = min.checked_shl(e.order).unwrap_or(u64::MAX);
            let s = (at, at.saturating_add(len), e.device);
            at = s.1;
            s
        })
        .collect()
}
