//! On-device pool metadata: a checksummed, versioned record written to two slots alternately.
//!
//! Every member device carries the whole pool table (devices and volumes), so the pool can be
//! reassembled from any subset of its devices, wherever their paths moved. A record is written
//! to slot `generation % 2`; a torn write therefore damages at most the newer copy and the
//! older one is still valid. The layout is documented in `docs/metadata-format.md`.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use spool_devices::FileDevice;

/// First bytes of every metadata record.
pub const MAGIC: [u8; 8] = *b"SPOOLPL\x01";
/// Current record format version. Readers refuse records with a higher version.
pub const FORMAT_VERSION: u32 = 1;
/// Size of one metadata slot in bytes.
pub const SLOT_SIZE: u64 = 512 * 1024;
/// Bytes reserved at the start of every device for the two slots; data starts here.
pub const METADATA_AREA: u64 = 2 * SLOT_SIZE;
/// Fixed header size in bytes.
pub const HEADER_SIZE: usize = 72;

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
pub fn encode(rec: &Record) -> Result<Vec<u8>, String> {
    let payload = serde_json::to_vec(&rec.table).map_err(|e| e.to_string())?;
    if payload.len() > SLOT_SIZE as usize - HEADER_SIZE {
        return Err(format!(
            "pool table is {} bytes, more than a metadata slot holds ({}); delete volumes or raise the minimum extent size",
            payload.len(),
            SLOT_SIZE as usize - HEADER_SIZE
        ));
    }
    let mut buf = vec![0u8; HEADER_SIZE + payload.len()];
    buf[0..8].copy_from_slice(&MAGIC);
    buf[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
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

/// Decodes a slot image (at least the header; the payload is read through `payload`).
pub fn decode(
    header: &[u8],
    read_payload: impl FnOnce(usize) -> Result<Vec<u8>, String>,
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
    if u32_at(12) as usize != HEADER_SIZE {
        return SlotState::Corrupt(format!("header size {} unexpected", u32_at(12)));
    }
    let generation = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
    let len = u32_at(24) as usize;
    if len > SLOT_SIZE as usize - HEADER_SIZE {
        return SlotState::Corrupt(format!("payload length {len} exceeds the slot"));
    }
    let payload = match read_payload(len) {
        Ok(p) => p,
        Err(e) => return SlotState::Corrupt(e),
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
    SlotState::Valid(Record {
        generation,
        device_uuid: Uuid::from_slice(&header[48..64]).expect("16 bytes"),
        table,
    })
}

/// Reads one slot of a device.
pub fn read_slot(dev: &FileDevice, slot: u64) -> SlotState {
    let base = slot * SLOT_SIZE;
    let mut header = [0u8; HEADER_SIZE];
    if let Err(e) = dev.read_at(&mut header, base) {
        return SlotState::Corrupt(format!("cannot read: {e}"));
    }
    decode(&header, |len| {
        let mut p = vec![0u8; len];
        dev.read_at(&mut p, base + HEADER_SIZE as u64)
            .map(|_| p)
            .map_err(|e| format!("cannot read payload: {e}"))
    })
}

/// Reads both slots and decides what the device holds.
pub fn read_device(dev: &FileDevice) -> DeviceState {
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

/// Writes `rec` durably into slot `rec.generation % 2`.
pub fn write_record(dev: &FileDevice, rec: &Record) -> Result<(), String> {
    let img = encode(rec)?;
    dev.write_at_durable(&img, (rec.generation % 2) * SLOT_SIZE)
        .map_err(|e| e.to_string())
}

/// Erases both slots (used by `--force` before reformatting a device).
pub fn wipe(dev: &FileDevice) -> Result<(), String> {
    let zero = vec![0u8; HEADER_SIZE];
    for slot in 0..2 {
        dev.write_at_durable(&zero, slot * SLOT_SIZE)
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use spool_devices::OpenOptions;

    fn table() -> PoolTable {
        PoolTable {
            name: "p".into(),
            pool_uuid: Uuid::new_v4(),
            min_extent: 1 << 20,
            devices: vec![],
            volumes: vec![VolumeEntry {
                uuid: Uuid::new_v4(),
                name: "v".into(),
                size: 4096,
                read_only: false,
                num_queues: 1,
                extents: vec![ExtentEntry {
                    device: Uuid::new_v4(),
                    offset: METADATA_AREA,
                    order: 0,
                }],
            }],
        }
    }

    fn dev() -> (tempfile::TempDir, FileDevice) {
        let d = tempfile::tempdir().unwrap();
        let f = FileDevice::open(
            &d.path().join("dev"),
            &OpenOptions {
                create_size: Some(4 << 20),
                no_direct: true,
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

    #[test]
    fn decode_never_panics_on_garbage() {
        use proptest::prelude::*;
        proptest!(|(bytes in prop::collection::vec(any::<u8>(), 0..200), len in 0usize..100)| {
            let _ = decode(&bytes, |_| Ok(vec![0u8; len]));
        });
    }
}
