//! On-device pool metadata: a checksummed, versioned record written to two slots alternately.
//!
//! Every member device carries the whole pool table (devices and volumes), so the pool can be
//! reassembled from any subset of its devices, wherever their paths moved. A record is written
//! to slot `generation % 2`; a torn write therefore damages at most the newer copy and the
//! older one is still valid. The layout is documented in `docs/metadata-format.md`.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::qos::QosLimits;

mod rules;
mod volume;
pub(crate) use rules::{rbd_name, spans};
use spool_devices::Device;
pub use volume::ReplicaOf;

/// First bytes of every metadata record.
pub const MAGIC: [u8; 8] = *b"SPOOLPL\x01";
/// Newest record format version this spoold reads and writes. Readers refuse records with
/// a higher version. A table is written as version 1 unless it uses something version 1
/// cannot say (volume QoS limits: version 2; mirrored volumes: version 3; volumes on RBD
/// images: version 4; encrypted volumes: version 5; thin volumes: version 6; snapshots and
/// clones: version 7; a copy being sent to another host: version 8; a thin volume being sent:
/// version 9; a mirrored thin volume: version 10; a replica, or a volume promoted from one:
/// version 11), so an older spoold
/// refuses a table it would otherwise rewrite without them, and still reads every table that
/// needs nothing new.
pub const FORMAT_VERSION: u32 = 11;
/// Size of one metadata slot in bytes.
pub const SLOT_SIZE: u64 = 512 * 1024;
/// Bytes reserved at the start of every device for the two slots; data starts here.
pub const METADATA_AREA: u64 = 2 * SLOT_SIZE;
/// Fixed header size in bytes.
pub const HEADER_SIZE: usize = 72;
/// Smallest minimum extent (buddy block) size a pool may have.
pub const MIN_EXTENT_MIN: u64 = 64 * 1024;
/// Largest minimum extent size a pool may have (1 TiB: far beyond any sensible choice, and
/// small enough that `METADATA_AREA + min_extent` and friends cannot overflow).
pub const MIN_EXTENT_MAX: u64 = 1 << 40;
/// Most copies a mirrored volume keeps.
pub const MAX_COPIES: u8 = 3;
/// Most virtqueues a volume may have.
pub const MAX_QUEUES: u16 = 64;
/// Longest volume name in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// Checks a volume name: 1-64 characters of `A-Z a-z 0-9 . _ -`, not starting with `.`, not
/// parsing as a UUID (volumes are looked up by name or UUID). Names end up in socket paths,
/// so this is also what keeps a damaged table from naming a path outside the state directory.
pub fn check_volume_name(name: &str) -> Result<(), Invalid> {
    if name.is_empty()
        || name.len() > MAX_NAME_LEN
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        || name.starts_with('.')
        || Uuid::parse_str(name).is_ok()
    {
        return Err(Invalid(format!(
            "volume name '{}' must be 1-{MAX_NAME_LEN} characters of A-Z a-z 0-9 . _ -, not start with '.', and not look like a UUID",
            printable(name)
        )));
    }
    Ok(())
}

/// Why a pool table, a volume name or one of its fields is refused: the text names the
/// device, volume and field, and says why (users and tests match on it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(String);

/// Why a metadata record is not encoded or written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("refusing to write an invalid pool table: {0}")]
    Invalid(Invalid),
    #[error("generation {0} is out of range")]
    Generation(u64),
    #[error("{0}")]
    Encode(serde_json::Error),
    #[error("pool table is {len} bytes, more than a metadata slot holds ({max}); delete volumes or raise the minimum extent size")]
    TooLarge { len: usize, max: usize },
    #[error(transparent)]
    Device(#[from] spool_devices::Error),
}

/// `name` shortened and escaped for an error message.
pub(crate) fn printable(name: &str) -> String {
    let mut s: String = name.chars().take(MAX_NAME_LEN).collect();
    if s.len() < name.len() {
        s.push('…');
    }
    s.escape_debug().to_string()
}

/// Bytes of a block of `order` when its size `min << order` fits in 64 bits.
pub fn block_size(min: u64, order: u32) -> Option<u64> {
    (min != 0 && order < 64 && order <= min.leading_zeros()).then(|| min << order)
}

/// The pool table, identical on every member device of a given generation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PoolTable {
    pub name: String,
    pub pool_uuid: Uuid,
    pub min_extent: u64,
    pub devices: Vec<DeviceEntry>,
    pub volumes: Vec<VolumeEntry>,
}

/// A member device.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeviceEntry {
    pub uuid: Uuid,
    pub size: u64,
    /// Last path the device was seen at (informational: devices are found by UUID).
    pub last_path: String,
}

/// A logical volume.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeEntry {
    pub uuid: Uuid,
    pub name: String,
    /// Capacity in bytes, a multiple of 512.
    pub size: u64,
    pub read_only: bool,
    pub num_queues: u16,
    /// Extents in logical order.
    pub extents: Vec<ExtentEntry>,
    /// I/O limits (format version 2; absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qos: Option<QosLimits>,
    /// Copies a mirrored volume keeps (2 or 3; format version 3). 0: a plain volume.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub copies: u8,
    /// A mirrored volume's copies (format version 3), each with its own extents; `extents`
    /// is then empty. Fewer legs than `copies`: the volume runs degraded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub legs: Vec<LegEntry>,
    /// A volume whose data is a Ceph RBD image (format version 4; docs/ceph.md): no extents,
    /// no legs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rbd: Option<RbdImage>,
    /// An encrypted volume's data key, wrapped (format version 5; docs/encryption.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<VolumeKey>,
    /// A thin volume's chunk map (format version 6; docs/thin.md): `extents` is empty, its
    /// chunks are named by the map.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thin: Option<ThinMap>,
    /// Another host's copy, written by its primary (format version 11; docs/replicas.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<ReplicaOf>,
    /// The epoch this host serves the volume under (format version 11; 0: never promoted).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub epoch: u64,
}

/// Where a thin volume's chunk map lives.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ThinMap {
    /// Bytes per chunk (the pool's minimum extent).
    pub chunk: u64,
    /// The map's extents in order (32 bytes per chunk, docs/thin.md).
    pub map: Vec<ExtentEntry>,
    /// The volume's snapshots, oldest first (format version 7; docs/snapshots.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub snapshots: Vec<ThinSnapshot>,
    /// The snapshot a clone was made from, as `VOLUME@SNAPSHOT` (format version 7): its
    /// chunks may be named by that snapshot's map too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
}

/// One copy of a mirrored thin volume (format version 10; docs/thin.md): a chunk map of its
/// own, whose chunks and map lie only on its own devices, which no other copy of the volume
/// uses (so one device's loss costs at most one copy).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LegMap {
    /// The map's own UUID (each entry's checksum covers it), unique in the table.
    pub uuid: Uuid,
    /// The map's extents in order (32 bytes per chunk, docs/thin.md).
    pub map: Vec<ExtentEntry>,
    /// The devices its chunks and map may lie on.
    pub devices: Vec<Uuid>,
}

/// A snapshot of a thin volume: a map of its own, written once, naming chunks the volume's
/// map (or a clone's) may name too.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ThinSnapshot {
    /// Unique among the volume's snapshots (the rules of a volume name).
    pub name: String,
    /// Its own UUID (each map entry's checksum covers it).
    pub uuid: Uuid,
    /// The volume's size when it was taken.
    pub size: u64,
    /// When it was taken, in seconds since the Unix epoch.
    pub created: u64,
    /// Its map's extents in order.
    pub map: Vec<ExtentEntry>,
}

/// An encrypted volume's cipher and its data key, wrapped under the pool's key-encryption
/// key. Never the key in the clear.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeKey {
    /// Always `aes-xts-plain64`.
    pub cipher: String,
    /// The id of the key-encryption key that wrapped it (`Kek::id`: 16 hex digits).
    pub kek_id: String,
    /// The wrapped data key, in hex (RFC 3394: 72 bytes).
    pub wrapped: String,
}

/// The RBD image a volume's data lives in.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RbdImage {
    pub pool: String,
    pub image: String,
    /// Created by this pool (deleting the volume removes it); false: an existing image was
    /// attached, and is removed only when asked.
    pub created: bool,
}

impl RbdImage {
    /// `POOL/IMAGE`.
    pub fn spec(&self) -> String {
        format!("{}/{}", self.pool, self.image)
    }
}

fn is_zero(n: &u8) -> bool {
    *n == 0
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

/// One copy of a mirrored volume's data.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LegEntry {
    /// Stable number of the leg (0..MAX_COPIES): its bit in the write-intent bitmap.
    pub slot: u8,
    /// False from the moment the leg is allocated until a rebuild has copied all of the
    /// volume onto it: such a leg is never read from, and is rebuilt whole when its bitmap is
    /// lost.
    pub synced: bool,
    /// Extents in logical order (none for a remote leg).
    pub extents: Vec<ExtentEntry>,
    /// A copy on another host, reached over NBD (format version 8; docs/transfer.md): the
    /// leg has no extents here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemoteLeg>,
    /// A mirrored thin volume's copy: its chunk map (format version 10). No extents then;
    /// the volume's own map (`ThinMap::map`) is empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thin: Option<LegMap>,
}

/// Where a remote leg lives: an NBD export (normally another spoold's `volume receive`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RemoteLeg {
    /// `nbd://HOST[:PORT]/EXPORT` or `nbd+unix:///EXPORT?socket=PATH`.
    pub uri: String,
    /// The leg's identity: fixed when the send starts, so the write-intent bitmap's record
    /// of what the leg missed outlives reconnections and restarts.
    pub id: Uuid,
}

impl PoolTable {
    /// The oldest record format that can hold this table (see [`FORMAT_VERSION`]).
    pub fn format_version(&self) -> u32 {
        let shares = |t: &ThinMap| !t.snapshots.is_empty() || t.origin.is_some();
        let sent = |v: &VolumeEntry| v.legs.iter().any(|l| l.remote.is_some());
        if (self.volumes.iter()).any(|v| v.replica.is_some() || v.epoch != 0) {
            11
        } else if self
            .volumes
            .iter()
            .any(|v| v.legs.iter().any(|l| l.thin.is_some()))
        {
            10
        } else if self.volumes.iter().any(|v| v.thin.is_some() && sent(v)) {
            9
        } else if self.volumes.iter().any(sent) {
            8
        } else if self
            .volumes
            .iter()
            .any(|v| v.thin.as_ref().is_some_and(shares))
        {
            7
        } else if self.volumes.iter().any(|v| v.thin.is_some()) {
            6
        } else if self.volumes.iter().any(|v| v.encryption.is_some()) {
            5
        } else if self.volumes.iter().any(|v| v.rbd.is_some()) {
            4
        } else if self
            .volumes
            .iter()
            .any(|v| v.is_mirrored() || !v.legs.is_empty())
        {
            3
        } else if self.volumes.iter().any(|v| v.qos.is_some()) {
            2
        } else {
            1
        }
    }
}

/// One buddy block of a volume.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExtentEntry {
    pub device: Uuid,
    pub offset: u64,
    pub order: u32,
}

/// What one slot holds.
#[derive(Debug, Clone, PartialEq)]
pub enum SlotState {
    /// Never written (no magic).
    Blank,
    /// A valid record.
    Valid(Record),
    /// Magic present but the record is damaged.
    Corrupt(String),
    /// A record of a newer format than this spoold understands.
    Unsupported(u32),
}

/// A decoded metadata record.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub generation: u64,
    pub device_uuid: Uuid,
    pub table: PoolTable,
}

/// What a whole device holds, both slots considered.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceState {
    Blank,
    /// The newest valid record, and a note when the other slot was damaged.
    Member(Record, Option<String>),
    Corrupt(String),
    Unsupported(u32),
}

/// Encodes a record into a slot image.
pub fn encode(rec: &Record) -> Result<Vec<u8>, WriteError> {
    let payload = serde_json::to_vec(&rec.table).map_err(WriteError::Encode)?;
    if payload.len() > SLOT_SIZE as usize - HEADER_SIZE {
        return Err(WriteError::TooLarge {
            len: payload.len(),
            max: SLOT_SIZE as usize - HEADER_SIZE,
        });
    }
    let mut buf = vec![0u8; HEADER_SIZE + payload.len()];
    buf[0..8].copy_from_slice(&MAGIC);
    buf[8..12].copy_from_slice(&rec.table.format_version().to_le_bytes());
    buf[12..16].copy_from_slice(&(HEADER_SIZE as u32).to_le_bytes());
    buf[16..24].copy_from_slice(&rec.generation.to_le_bytes());
    buf[24..28].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    buf[28..32].copy_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    buf[32..48].copy_from_slice(rec.table.pool_uuid.as_bytes());
    buf[48..64].copy_from_slice(rec.device_uuid.as_bytes());
    let hcrc = crc32c::crc32c(&buf[0..64]);
    buf[64..68].copy_from_slice(&hcrc.to_le_bytes());
    buf[HEADER_SIZE..].copy_from_slice(&payload);
    Ok(buf)
}

/// Decodes a slot image (at least the header; the payload's `len` bytes are read through
/// `read_payload`, whose error becomes the slot's corruption).
pub fn decode(
    header: &[u8],
    read_payload: impl FnOnce(usize) -> std::io::Result<Vec<u8>>,
) -> SlotState {
    if header.len() < HEADER_SIZE {
        return SlotState::Corrupt("short header".into());
    }
    if header[0..8] != MAGIC {
        if header[0..8].iter().all(|&b| b == 0) {
            return SlotState::Blank;
        }
        if &header[0..7] == b"SPOOLPL" {
            return SlotState::Unsupported(header[7] as u32);
        }
        return SlotState::Corrupt("unknown magic (not a Spool device, or overwritten)".into());
    }
    let u32_at = |o: usize| u32::from_le_bytes(header[o..o + 4].try_into().expect("4 bytes"));
    let version = u32_at(8);
    if crc32c::crc32c(&header[0..64]) != u32_at(64) {
        return SlotState::Corrupt("header checksum mismatch".into());
    }
    if version > FORMAT_VERSION {
        return SlotState::Unsupported(version);
    }
    if version == 0 {
        return SlotState::Corrupt("format version 0 does not exist".into());
    }
    if u32_at(12) as usize != HEADER_SIZE {
        return SlotState::Corrupt(format!("header size {} unexpected", u32_at(12)));
    }
    let generation = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
    // Generation 0 is never written (the first commit is 1), and after u64::MAX nothing could
    // ever be committed again.
    if generation == 0 || generation == u64::MAX {
        return SlotState::Corrupt(format!("generation {generation} is out of range"));
    }
    let len = u32_at(24) as usize;
    if len > SLOT_SIZE as usize - HEADER_SIZE {
        return SlotState::Corrupt(format!("payload length {len} exceeds the slot"));
    }
    let payload = match read_payload(len) {
        Ok(p) => p,
        Err(e) => return SlotState::Corrupt(e.to_string()),
    };
    if crc32c::crc32c(&payload) != u32_at(28) {
        return SlotState::Corrupt("payload checksum mismatch".into());
    }
    let table: PoolTable = match serde_json::from_slice(&payload) {
        Ok(t) => t,
        Err(e) => return SlotState::Corrupt(format!("pool table does not parse: {e}")),
    };
    let pool_uuid = Uuid::from_slice(&header[32..48]).expect("16 bytes");
    if table.pool_uuid != pool_uuid {
        return SlotState::Corrupt("pool UUID in header and table differ".into());
    }
    if let Err(why) = table.validate() {
        return SlotState::Corrupt(format!("pool table is invalid: {why}"));
    }
    SlotState::Valid(Record {
        generation,
        device_uuid: Uuid::from_slice(&header[48..64]).expect("16 bytes"),
        table,
    })
}

/// Reads one slot of a device.
pub fn read_slot(dev: &Device, slot: u64) -> SlotState {
    let base = slot * SLOT_SIZE;
    let mut header = [0u8; HEADER_SIZE];
    if let Err(e) = dev.read_at(&mut header, base) {
        return SlotState::Corrupt(format!("cannot read: {e}"));
    }
    decode(&header, |len| {
        let mut p = vec![0u8; len];
        dev.read_at(&mut p, base + HEADER_SIZE as u64)
            .map(|_| p)
            .map_err(|e| std::io::Error::other(format!("cannot read payload: {e}")))
    })
}

/// Reads both slots and decides what the device holds.
pub fn read_device(dev: &Device) -> DeviceState {
    let slots = [read_slot(dev, 0), read_slot(dev, 1)];
    let mut best: Option<&Record> = None;
    for s in &slots {
        if let SlotState::Valid(r) = s {
            if best.is_none_or(|b| r.generation > b.generation) {
                best = Some(r);
            }
        }
    }
    if let Some(r) = best {
        let note = slots.iter().find_map(|s| match s {
            SlotState::Corrupt(why) => Some(format!(
                "other metadata copy is damaged ({why}); it will be rewritten"
            )),
            _ => None,
        });
        return DeviceState::Member(r.clone(), note);
    }
    if let Some(v) = slots.iter().find_map(|s| match s {
        SlotState::Unsupported(v) => Some(*v),
        _ => None,
    }) {
        return DeviceState::Unsupported(v);
    }
    if let Some(why) = slots.iter().find_map(|s| match s {
        SlotState::Corrupt(w) => Some(w.clone()),
        _ => None,
    }) {
        return DeviceState::Corrupt(why);
    }
    DeviceState::Blank
}

/// Writes `rec` durably into slot `rec.generation % 2`. Refuses a table that [`decode`] would
/// refuse (a bug must not write a pool that no longer opens). With `erase`, the rest of the
/// slot is written with zeroes too, so nothing of an older, longer record survives in it.
pub fn write_record(dev: &Device, rec: &Record, erase: bool) -> Result<(), WriteError> {
    rec.table.validate().map_err(WriteError::Invalid)?;
    if rec.generation == 0 || rec.generation == u64::MAX {
        return Err(WriteError::Generation(rec.generation));
    }
    let mut img = encode(rec)?;
    if erase {
        img.resize(SLOT_SIZE as usize, 0);
    }
    Ok(dev.write_at_durable(&img, (rec.generation % 2) * SLOT_SIZE)?)
}

/// Erases both slots (used by `--force` before reformatting a device).
pub fn wipe(dev: &Device) -> Result<(), WriteError> {
    let zero = vec![0u8; HEADER_SIZE];
    for slot in 0..2 {
        dev.write_at_durable(&zero, slot * SLOT_SIZE)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use spool_devices::OpenOptions;

    /// A volume on an RBD image has no extents, names Ceph accepts, and needs format 4.
    #[test]
    fn rbd_volumes_validate_and_need_format_4() {
        let mut t = table();
        assert_eq!(t.format_version(), 1);
        let mut v = t.volumes[0].clone();
        v.name = "r".into();
        v.uuid = Uuid::new_v4();
        v.extents.clear();
        v.rbd = Some(RbdImage {
            pool: "rbd".into(),
            image: "r".into(),
            created: true,
        });
        t.volumes.push(v.clone());
        t.validate().unwrap();
        assert_eq!(t.format_version(), 4);
        for (pool, image) in [("", "r"), ("a/b", "r"), ("rbd", "x@snap"), ("rbd", "a b")] {
            let mut bad = t.clone();
            bad.volumes[1].rbd = Some(RbdImage {
                pool: pool.into(),
                image: image.into(),
                created: false,
            });
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains("volume 'r': rbd"), "{e}");
        }
        let mut bad = t.clone();
        bad.volumes[1].extents = t.volumes[0].extents.clone();
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("has extents"));
    }

    fn table() -> PoolTable {
        let device = Uuid::new_v4();
        PoolTable {
            name: "p".into(),
            pool_uuid: Uuid::new_v4(),
            min_extent: 1 << 20,
            devices: vec![DeviceEntry {
                uuid: device,
                size: 4 << 20,
                last_path: "/dev/null".into(),
            }],
            volumes: vec![VolumeEntry {
                uuid: Uuid::new_v4(),
                name: "v".into(),
                size: 4096,
                read_only: false,
                num_queues: 1,
                extents: vec![ExtentEntry {
                    device,
                    offset: METADATA_AREA,
                    order: 0,
                }],
                qos: None,
                copies: 0,
                legs: Vec::new(),
                rbd: None,
                encryption: None,
                thin: None,
                replica: None,
                epoch: 0,
            }],
        }
    }

    fn dev() -> (tempfile::TempDir, Device) {
        let d = tempfile::tempdir().unwrap();
        let f = Device::open(
            &d.path().join("dev"),
            &OpenOptions {
                create_size: Some(4 << 20),
                no_direct: true,
                ..Default::default()
            },
        )
        .unwrap();
        (d, f)
    }

    #[test]
    fn blank_then_alternating_generations() {
        let (_d, dev) = dev();
        assert_eq!(read_device(&dev), DeviceState::Blank);
        let t = table();
        let du = Uuid::new_v4();
        for g in 1..=3 {
            write_record(
                &dev,
                &Record {
                    generation: g,
                    device_uuid: du,
                    table: t.clone(),
                },
                false,
            )
            .unwrap();
            match read_device(&dev) {
                DeviceState::Member(r, None) => assert_eq!(r.generation, g),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn torn_newest_copy_falls_back_to_older() {
        let (_d, dev) = dev();
        let du = Uuid::new_v4();
        let mut t = table();
        write_record(
            &dev,
            &Record {
                generation: 1,
                device_uuid: du,
                table: t.clone(),
            },
            false,
        )
        .unwrap();
        t.name = "newer".into();
        write_record(
            &dev,
            &Record {
                generation: 2,
                device_uuid: du,
                table: t,
            },
            false,
        )
        .unwrap();
        // Tear generation 2 (slot 0) in the middle of its payload.
        dev.write_at_durable(&[0xff; 16], HEADER_SIZE as u64 + 10)
            .unwrap();
        match read_device(&dev) {
            DeviceState::Member(r, Some(note)) => {
                assert_eq!(r.generation, 1);
                assert_eq!(r.table.name, "p");
                assert!(note.contains("payload checksum"), "{note}");
            }
            other => panic!("{other:?}"),
        }
        // Tear the header of generation 1 too: nothing valid is left, and we say so.
        dev.write_at_durable(&[0x55; 4], SLOT_SIZE + 20).unwrap();
        assert!(matches!(read_device(&dev), DeviceState::Corrupt(_)));
    }

    #[test]
    fn foreign_and_newer_formats_are_recognised() {
        let (_d, dev) = dev();
        dev.write_at_durable(b"EXT4 superblock?", 0).unwrap();
        assert!(
            matches!(read_device(&dev), DeviceState::Corrupt(w) if w.contains("unknown magic"))
        );
        let mut img = encode(&Record {
            generation: 1,
            device_uuid: Uuid::new_v4(),
            table: table(),
        })
        .unwrap();
        img[7] = 2; // a format-2 magic from a newer spoold
        dev.write_at_durable(&img, 0).unwrap();
        assert_eq!(read_device(&dev), DeviceState::Unsupported(2));
    }

    /// Two devices (9 MiB each, 1 MiB extents); volume "a" holds 3 MiB on the first (an
    /// order-1 and an order-0 extent), volume "b" 2 MiB on the second.
    fn two_device_table() -> PoolTable {
        let d = [Uuid::from_u128(1), Uuid::from_u128(2)];
        let dev = |uuid| DeviceEntry {
            uuid,
            size: 9 << 20,
            last_path: String::new(),
        };
        let ext = |device, offset, order| ExtentEntry {
            device,
            offset,
            order,
        };
        PoolTable {
            name: "p".into(),
            pool_uuid: Uuid::from_u128(9),
            min_extent: 1 << 20,
            devices: vec![dev(d[0]), dev(d[1])],
            volumes: vec![
                VolumeEntry {
                    uuid: Uuid::from_u128(10),
                    name: "a".into(),
                    size: 3 << 20,
                    read_only: false,
                    num_queues: 1,
                    extents: vec![
                        ext(d[0], METADATA_AREA, 1),
                        ext(d[0], METADATA_AREA + (2 << 20), 0),
                    ],
                    qos: None,
                    copies: 0,
                    legs: Vec::new(),
                    rbd: None,
                    encryption: None,
                    thin: None,
                    replica: None,
                    epoch: 0,
                },
                VolumeEntry {
                    uuid: Uuid::from_u128(11),
                    name: "b".into(),
                    size: (1 << 20) + 512,
                    read_only: true,
                    num_queues: 4,
                    extents: vec![ext(d[1], METADATA_AREA, 1)],
                    qos: None,
                    copies: 0,
                    legs: Vec::new(),
                    rbd: None,
                    encryption: None,
                    thin: None,
                    replica: None,
                    epoch: 0,
                },
            ],
        }
    }

    #[test]
    fn validation_names_the_field() {
        assert_eq!(two_device_table().validate(), Ok(()));
        type Case = (fn(&mut PoolTable), &'static str);
        let cases: Vec<Case> = vec![
            (|t| t.min_extent = 0, "min_extent 0"),
            (|t| t.min_extent = 3 << 19, "min_extent"),
            (|t| t.min_extent = 1 << 41, "min_extent"),
            (
                |t| t.devices[1].size = SLOT_SIZE,
                "smaller than the metadata area",
            ),
            (
                |t| t.devices[1].uuid = t.devices[0].uuid,
                "duplicate device",
            ),
            (
                |t| t.volumes[0].extents[1].order = 44,
                "volume 'a': extent 1 has order 44",
            ),
            (|t| t.volumes[0].extents[1].offset = 4096, "metadata area"),
            (|t| t.volumes[0].extents[0].offset += 1 << 20, "not aligned"),
            (
                |t| t.volumes[1].extents[0].offset = 9 << 20,
                "beyond the end",
            ),
            (
                |t| t.volumes[1].extents[0].device = Uuid::nil(),
                "unknown device",
            ),
            (
                |t| t.volumes[1].extents[0].device = t.devices[0].uuid,
                "overlap",
            ),
            (
                |t| t.volumes[0].size = 5 << 20,
                "does not match its extents",
            ),
            (
                |t| t.volumes[0].size = 2 << 20,
                "does not match its extents",
            ),
            (
                |t| t.volumes[0].size = u64::MAX - 511,
                "does not match its extents",
            ),
            (|t| t.volumes[0].size = 100, "multiple of 512"),
            (|t| t.volumes[0].num_queues = 0, "num_queues"),
            (
                |t| t.volumes[1].name = "a".into(),
                "duplicate volume name 'a'",
            ),
            (
                |t| t.volumes[1].uuid = t.volumes[0].uuid,
                "duplicate volume UUID",
            ),
            (|t| t.volumes[1].name = "x/../y".into(), "volume name"),
        ];
        for (mutate, expect) in cases {
            let mut t = two_device_table();
            mutate(&mut t);
            let why = t.validate().expect_err(expect).to_string();
            assert!(why.contains(expect), "{why} (expected '{expect}')");
        }
    }

    #[test]
    fn invalid_tables_are_neither_written_nor_read() {
        let (_d, dev) = dev();
        let mut t = table();
        t.volumes[0].size = 8 << 20;
        let rec = Record {
            generation: 1,
            device_uuid: Uuid::new_v4(),
            table: t,
        };
        let e = write_record(&dev, &rec, false).unwrap_err().to_string();
        assert!(e.contains("does not match its extents"), "{e}");
        assert_eq!(read_device(&dev), DeviceState::Blank, "nothing was written");
        // Written anyway (valid checksums): read as corrupt, saying why.
        dev.write_at_durable(&encode(&rec).unwrap(), SLOT_SIZE)
            .unwrap();
        match read_device(&dev) {
            DeviceState::Corrupt(why) => assert!(why.contains("volume 'v'"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[derive(Debug, Clone)]
    enum Mutation {
        MinExtent(u64),
        DeviceSize(usize, u64),
        DeviceUuid(usize, u128),
        VolumeSize(usize, u64),
        Queues(usize, u16),
        Name(usize, &'static str),
        VolumeUuid(usize, u128),
        ExtentDevice(usize, usize, u128),
        ExtentOffset(usize, usize, u64),
        ExtentOrder(usize, usize, u32),
        DropExtent(usize, usize),
        CopyExtent(usize, usize, usize),
    }

    fn interesting_u64() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(0u64),
            Just(512),
            Just(1 << 16),
            Just(1 << 20),
            Just(3 << 19),
            Just(1 << 40),
            Just(1 << 63),
            Just(u64::MAX),
            Just(u64::MAX - 511),
            (0u64..20).prop_map(|k| METADATA_AREA + (k << 19)),
            (0u64..40).prop_map(|k| k << 19),
            any::<u64>(),
        ]
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        use Mutation::*;
        let i = || 0usize..3;
        let u = || 0u128..4;
        prop_oneof![
            interesting_u64().prop_map(MinExtent),
            (i(), interesting_u64()).prop_map(|(a, b)| DeviceSize(a, b)),
            (i(), u()).prop_map(|(a, b)| DeviceUuid(a, b)),
            (i(), interesting_u64()).prop_map(|(a, b)| VolumeSize(a, b)),
            (
                i(),
                prop_oneof![Just(0u16), Just(1), Just(64), Just(65), any::<u16>()]
            )
                .prop_map(|(a, b)| Queues(a, b)),
            (
                i(),
                prop_oneof![Just("a"), Just("b"), Just(""), Just("../x")]
            )
                .prop_map(|(a, b)| Name(a, b)),
            (i(), 9u128..12).prop_map(|(a, b)| VolumeUuid(a, b)),
            (i(), i(), u()).prop_map(|(a, b, c)| ExtentDevice(a, b, c)),
            (i(), i(), interesting_u64()).prop_map(|(a, b, c)| ExtentOffset(a, b, c)),
            (
                i(),
                i(),
                prop_oneof![
                    0u32..4,
                    Just(20),
                    Just(43),
                    Just(44),
                    Just(63),
                    Just(64),
                    any::<u32>()
                ]
            )
                .prop_map(|(a, b, c)| ExtentOrder(a, b, c)),
            (i(), i()).prop_map(|(a, b)| DropExtent(a, b)),
            (i(), i(), i()).prop_map(|(a, b, c)| CopyExtent(a, b, c)),
        ]
    }

    fn extent(t: &mut PoolTable, i: usize, j: usize) -> Option<&mut ExtentEntry> {
        let nv = t.volumes.len();
        let e = &mut t.volumes[i % nv].extents;
        let n = e.len().max(1);
        e.get_mut(j % n)
    }

    fn apply(t: &mut PoolTable, m: &Mutation) {
        use Mutation::*;
        let nv = t.volumes.len();
        let nd = t.devices.len();
        match *m {
            MinExtent(v) => t.min_extent = v,
            DeviceSize(d, v) => t.devices[d % nd].size = v,
            DeviceUuid(d, v) => t.devices[d % nd].uuid = Uuid::from_u128(v),
            VolumeSize(i, v) => t.volumes[i % nv].size = v,
            Queues(i, v) => t.volumes[i % nv].num_queues = v,
            Name(i, v) => t.volumes[i % nv].name = v.into(),
            VolumeUuid(i, v) => t.volumes[i % nv].uuid = Uuid::from_u128(v),
            ExtentDevice(i, j, v) => {
                if let Some(e) = extent(t, i, j) {
                    e.device = Uuid::from_u128(v);
                }
            }
            ExtentOffset(i, j, v) => {
                if let Some(e) = extent(t, i, j) {
                    e.offset = v;
                }
            }
            ExtentOrder(i, j, v) => {
                if let Some(e) = extent(t, i, j) {
                    e.order = v;
                }
            }
            DropExtent(i, j) => {
                let e = &mut t.volumes[i % nv].extents;
                if !e.is_empty() {
                    let n = e.len();
                    e.remove(j % n);
                }
            }
            CopyExtent(i, j, k) => {
                let Some(&x) = t.volumes[i % nv]
                    .extents
                    .get(j % t.volumes[i % nv].extents.len().max(1))
                else {
                    return;
                };
                t.volumes[k % nv].extents.push(x);
            }
        }
    }

    use proptest::prelude::*;

    proptest! {
        /// Whatever a valid-checksum table says, decoding never panics, and a table that
        /// passes validation is safe to use: every device's allocator can be rebuilt from it
        /// (no extent overlaps, lies outside its device or is misaligned) and every volume's
        /// extents cover exactly its size rounded up to the minimum extent.
        #[test]
        fn validated_tables_are_safe_to_use(
            muts in prop::collection::vec(mutation(), 0..4),
            generation in prop_oneof![Just(0u64), Just(1), Just(u64::MAX), any::<u64>()],
        ) {
            let mut t = two_device_table();
            for m in &muts {
                apply(&mut t, m);
            }
            let img = encode(&Record { generation, device_uuid: Uuid::from_u128(1), table: t.clone() })
                .unwrap();
            let st = decode(&img[..HEADER_SIZE], |len| Ok(img[HEADER_SIZE..HEADER_SIZE + len].to_vec()));
            let valid = t.validate().is_ok() && generation != 0 && generation != u64::MAX;
            prop_assert_eq!(matches!(st, SlotState::Valid(_)), valid, "{:?}", st);
            if let SlotState::Valid(r) = st {
                let t = r.table;
                for d in &t.devices {
                    let mut b = crate::buddy::Buddy::new(METADATA_AREA, d.size - METADATA_AREA, t.min_extent)
                        .unwrap();
                    for v in &t.volumes {
                        for e in v.extents.iter().filter(|e| e.device == d.uuid) {
                            prop_assert!(b.alloc_at(e.offset, e.order).is_ok(), "{:?} {:?}", e, t);
                        }
                    }
                }
                for v in &t.volumes {
                    let sum: u64 = v.extents.iter().map(|e| t.min_extent << e.order).sum();
                    prop_assert_eq!(sum, v.size.div_ceil(t.min_extent) * t.min_extent);
                }
            }
        }
    }

    #[test]
    fn decode_never_panics_on_garbage() {
        proptest!(|(bytes in prop::collection::vec(any::<u8>(), 0..200), len in 0usize..100)| {
            let _ = decode(&bytes, |_| Ok(vec![0u8; len]));
        });
    }
}
