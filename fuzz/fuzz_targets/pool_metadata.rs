//! Fuzzes pool metadata decoding and validation (`spool_pool::metadata::decode`), past the
//! checksums: a slot image is built around the input with valid header and payload CRCs (and
//! the payload's own pool UUID in the header), so whatever the pool table says reaches field
//! validation. It must never panic, and whatever it accepts must be safe to use: every
//! device's allocator rebuilds from the table (no extent overlaps, lies outside its device or
//! is misaligned), every volume's extents cover exactly its size rounded up to the minimum
//! extent, and the record survives an encode/decode round trip unchanged.
//!
//! The first input byte selects the mode: even = the rest is a raw slot image (header checks
//! included), odd with bit 1 clear = the rest is the payload (JSON), odd with bit 1 set = the
//! rest drives a generator of structurally plausible tables (reaching deep validation without
//! a corpus). Every input also goes through a thin volume's map-entry decoder
//! (`spool_thin::map::decode`), which must refuse what it cannot read and round-trip what it
//! accepts.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spool_pool::buddy::Buddy;
use spool_pool::metadata::{
    decode, encode, DeviceEntry, ExtentEntry, LegEntry, PoolTable, Record, SlotState, VolumeEntry,
    FORMAT_VERSION, HEADER_SIZE, MAGIC, METADATA_AREA, SLOT_SIZE,
};
use uuid::Uuid;

/// A slot image with valid checksums around `payload`.
fn slot(generation: u64, payload: &[u8]) -> Vec<u8> {
    let payload = &payload[..payload.len().min(SLOT_SIZE as usize - HEADER_SIZE)];
    let pool = serde_json::from_slice::<PoolTable>(payload)
        .map(|t| t.pool_uuid)
        .unwrap_or_default();
    let mut b = vec![0u8; HEADER_SIZE + payload.len()];
    b[0..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&(HEADER_SIZE as u32).to_le_bytes());
    b[16..24].copy_from_slice(&generation.to_le_bytes());
    b[24..28].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    b[28..32].copy_from_slice(&crc32c(payload).to_le_bytes());
    b[32..48].copy_from_slice(pool.as_bytes());
    b[48..64].copy_from_slice(Uuid::from_u128(1).as_bytes());
    let h = crc32c(&b[0..64]);
    b[64..68].copy_from_slice(&h.to_le_bytes());
    b[HEADER_SIZE..].copy_from_slice(payload);
    b
}

/// CRC32C (Castagnoli), bitwise: the fuzz crate does not depend on the crc32c crate.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Reads the input as a stream of choices (zeroes once it runs out).
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(std::array::from_fn(|_| self.u8()))
    }
    /// Mostly plausible sizes and offsets (multiples of 512 KiB past the metadata area),
    /// sometimes anything.
    fn offset(&mut self) -> u64 {
        match self.u8() % 4 {
            0 => self.u64(),
            1 => (self.u8() as u64) << 9,
            _ => METADATA_AREA + ((self.u8() as u64) << 19),
        }
    }
    /// Fewer than `n` extents on devices 1 to 5, of orders 0 to 4.
    fn extents(&mut self, n: u8) -> Vec<ExtentEntry> {
        (0..self.u8() % n)
            .map(|_| ExtentEntry {
                device: Uuid::from_u128(1 + (self.u8() % 5) as u128),
                offset: self.offset(),
                order: (self.u8() % 5) as u32,
            })
            .collect()
    }
}

fn generated(b: &mut Bytes) -> PoolTable {
    let min_extent = match b.u8() % 8 {
        0 => b.u64(),
        1 => 1 << (b.u8() % 64),
        2 | 3 => 1 << 19,
        _ => 1 << 20,
    };
    let devices = (0..b.u8() % 4)
        .map(|_| DeviceEntry {
            uuid: Uuid::from_u128(1 + (b.u8() % 4) as u128),
            size: b.offset(),
            last_path: String::new(),
        })
        .collect();
    let volumes = (0..b.u8() % 4)
        .map(|_| VolumeEntry {
            uuid: Uuid::from_u128(100 + (b.u8() % 4) as u128),
            name: ["a", "b", "c", "../x"][(b.u8() % 4) as usize].into(),
            size: b.offset().wrapping_sub(METADATA_AREA),
            read_only: false,
            num_queues: b.u8() as u16 % 70,
            extents: (0..b.u8() % 5)
                .map(|_| ExtentEntry {
                    device: Uuid::from_u128(1 + (b.u8() % 5) as u128),
                    offset: b.offset(),
                    order: match b.u8() {
                        x @ 0..=200 => (x % 5) as u32,
                        _ => b.u8() as u32,
                    },
                })
                .collect(),
            // Limits (format version 2) on some volumes, valid or not.
            qos: match b.u8() % 4 {
                0 => Some(spool_pool::QosLimits {
                    iops: b.u64() >> (b.u8() % 64),
                    write_bps: b.u64() >> (b.u8() % 64),
                    burst_ms: b.u64() as u32 % 70_000,
                    weight: b.u64() as u32 % 12_000,
                    ..Default::default()
                }),
                _ => None,
            },
            // Mirror legs (format version 3) on some volumes, valid or not.
            copies: match b.u8() % 4 {
                0 => b.u8() % 5,
                _ => 0,
            },
            legs: (0..b.u8() % 3)
                .map(|_| LegEntry {
                    slot: b.u8() % 4,
                    synced: b.u8() % 2 == 0,
                    extents: b.extents(3),
                    // A remote leg (format version 8) now and then, well formed or not.
                    remote: match b.u8() % 4 {
                        0 => Some(spool_pool::metadata::RemoteLeg {
                            uri: [
                                "nbd://h:10809/v",
                                "nbd+unix:///v?socket=/s",
                                "file:///x",
                                "nbd://h/\n",
                                "",
                            ][(b.u8() % 5) as usize]
                                .into(),
                            id: Uuid::from_u128(b.u8() as u128),
                        }),
                        _ => None,
                    },
                    // A mirrored thin volume's map of its own (format version 10), on
                    // devices of its own or not.
                    thin: match b.u8() % 4 {
                        0 => Some(spool_pool::metadata::LegMap {
                            uuid: Uuid::from_u128(200 + (b.u8() % 3) as u128),
                            map: b.extents(3),
                            devices: (0..b.u8() % 3)
                                .map(|_| Uuid::from_u128(1 + (b.u8() % 5) as u128))
                                .collect(),
                        }),
                        _ => None,
                    },
                })
                .collect(),
            // An RBD image (format version 4) on some volumes, valid names or not.
            rbd: match b.u8() % 4 {
                0 => Some(spool_pool::metadata::RbdImage {
                    pool: ["rbd", "", "a/b", "p"][(b.u8() % 4) as usize].into(),
                    image: ["img", "x@snap", " ", "i"][(b.u8() % 4) as usize].into(),
                    created: b.u8() % 2 == 0,
                }),
                _ => None,
            },
            // A key record (format version 5) on some volumes, well formed or not.
            encryption: match b.u8() % 4 {
                0 => Some(spool_pool::metadata::VolumeKey {
                    cipher: ["aes-xts-plain64", "aes-cbc-essiv", ""][(b.u8() % 3) as usize].into(),
                    kek_id: ["0011223344556677", "xyz", ""][(b.u8() % 3) as usize].into(),
                    wrapped: "ab".repeat([72usize, 71, 0, 200][(b.u8() % 4) as usize]),
                }),
                _ => None,
            },
            // A thin volume's map (format version 6) on some volumes, sized right or not.
            thin: match b.u8() % 4 {
                0 => Some(spool_pool::metadata::ThinMap {
                    chunk: [min_extent, 4096, 0][(b.u8() % 3) as usize],
                    map: b.extents(3),
                    // Snapshots and a clone's origin (format version 7), named and sized
                    // right or not.
                    snapshots: (0..b.u8() % 3)
                        .map(|i| spool_pool::metadata::ThinSnapshot {
                            name: ["s", "s", "", "a/b"][(b.u8() % 4) as usize].into(),
                            uuid: Uuid::from_u128(100 + (b.u8() % 3) as u128 + i as u128),
                            size: [min_extent, 0, 511, u64::MAX][(b.u8() % 4) as usize],
                            created: 0,
                            map: b.extents(2),
                        })
                        .collect(),
                    origin: (b.u8() % 4 == 0).then(|| "v@s".into()),
                }),
                _ => None,
            },
            // A standing replica or a promoted volume (format version 11), well formed or
            // not.
            replica: (b.u8() % 4 == 0).then(|| spool_pool::metadata::ReplicaOf {
                primary: ["10.0.0.1", "", "a b", "h\n"][(b.u8() % 4) as usize].into(),
                epoch: [0, 1, u64::MAX][(b.u8() % 3) as usize],
                complete: b.u8() % 2 == 0,
            }),
            epoch: [0, 0, 1, u64::MAX][(b.u8() % 4) as usize],
        })
        .collect();
    PoolTable {
        name: "p".into(),
        pool_uuid: Uuid::from_u128(9),
        min_extent,
        devices,
        volumes,
    }
}

/// A thin map entry from the input: refused, a hole, or a placement that encodes back to
/// the same bytes.
fn thin_entry(data: &[u8]) {
    let vol = Uuid::from_u128(7);
    for (i, e) in data.chunks(32).enumerate() {
        if let Ok(Some(p)) = spool_thin::map::decode(vol, i as u64, e) {
            assert_eq!(&spool_thin::map::encode(vol, i as u64, Some(p))[..], e);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    thin_entry(data);
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let img = if mode & 1 == 0 {
        rest.to_vec()
    } else if mode & 2 == 0 {
        slot(1 + (mode >> 2) as u64, rest)
    } else {
        let t = generated(&mut Bytes(rest));
        slot(1, &serde_json::to_vec(&t).unwrap())
    };
    let st = decode(&img[..img.len().min(HEADER_SIZE)], |len| {
        img.get(HEADER_SIZE..HEADER_SIZE + len)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| std::io::Error::other("short payload"))
    });
    let SlotState::Valid(r) = st else {
        return;
    };
    let t = &r.table;
    for d in &t.devices {
        let mut buddy = Buddy::new(METADATA_AREA, d.size - METADATA_AREA, t.min_extent)
            .expect("a validated device has a valid allocator");
        for v in &t.volumes {
            for e in v.all_extents().filter(|e| e.device == d.uuid) {
                buddy
                    .alloc_at(e.offset, e.order)
                    .expect("a validated extent rebuilds into the allocator");
            }
        }
    }
    for v in &t.volumes {
        if let Some(thin) = &v.thin {
            // Its chunks are named by its map, which holds an entry for every chunk.
            assert!(v.extents.is_empty() && v.legs.is_empty() && v.copies == 0);
            assert_eq!(thin.chunk, t.min_extent);
            let bytes: u64 = thin.map.iter().map(|e| t.min_extent << e.order).sum();
            assert!(bytes >= spool_thin::map::map_bytes(v.size.div_ceil(thin.chunk)));
            continue;
        }
        if v.rbd.is_some() {
            // Its data is an RBD image: nothing of it is on the pool's devices.
            assert!(v.extents.is_empty() && v.legs.is_empty() && v.copies == 0);
            continue;
        }
        for extents in v.copies_extents() {
            let sum = extents.iter().try_fold(0u64, |a, e| {
                a.checked_add(t.min_extent.checked_shl(e.order)?)
            });
            assert_eq!(sum, v.size.checked_next_multiple_of(t.min_extent));
        }
    }
    let again = encode(&Record {
        generation: r.generation,
        device_uuid: r.device_uuid,
        table: r.table.clone(),
    })
    .expect("a decoded table encodes");
    match decode(&again[..HEADER_SIZE], |len| {
        Ok(again[HEADER_SIZE..HEADER_SIZE + len].to_vec())
    }) {
        SlotState::Valid(r2) => assert_eq!(r2, r),
        other => panic!("round trip: {other:?}"),
    }
});
