//! Pool metadata that passes its checksums but holds impossible values must be refused at
//! start with a clear error, never panic, overflow or silently drop data, and must leave the
//! device untouched. Operator-supplied sizes must never overflow into zero extents.
//!
//! Every corrupt table here carries VALID checksums: the slot images are built by hand from
//! the documented layout (docs/metadata-format.md), so they get past the CRC checks and only
//! field validation can catch them.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use spool_pool::metadata::{self, SlotState, HEADER_SIZE, METADATA_AREA, SLOT_SIZE};
use spool_pool::{DeviceSpec, Error, Pool, PoolOptions};
use uuid::Uuid;

const MIB: u64 = 1 << 20;

fn spec(path: &Path, size: Option<u64>) -> DeviceSpec {
    DeviceSpec {
        path: path.to_path_buf(),
        create_size: size,
        null: None,
    }
}

fn opts() -> PoolOptions {
    PoolOptions {
        min_extent: MIB,
        ..Default::default()
    }
}

/// A slot image with valid header and payload checksums, whatever the payload says.
fn slot_image(generation: u64, pool: Uuid, device: Uuid, payload: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8; HEADER_SIZE + payload.len()];
    b[0..8].copy_from_slice(&metadata::MAGIC);
    b[8..12].copy_from_slice(&metadata::FORMAT_VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&(HEADER_SIZE as u32).to_le_bytes());
    b[16..24].copy_from_slice(&generation.to_le_bytes());
    b[24..28].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    b[28..32].copy_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    b[32..48].copy_from_slice(pool.as_bytes());
    b[48..64].copy_from_slice(device.as_bytes());
    let h = crc32c::crc32c(&b[0..64]);
    b[64..68].copy_from_slice(&h.to_le_bytes());
    b[HEADER_SIZE..].copy_from_slice(payload);
    b
}

/// The newest valid record on the device file, decoded with the crate's own decoder.
fn newest_record(path: &Path) -> metadata::Record {
    let bytes = std::fs::read(path).unwrap();
    (0..2u64)
        .filter_map(|slot| {
            let base = (slot * SLOT_SIZE) as usize;
            match metadata::decode(&bytes[base..base + HEADER_SIZE], |len| {
                Ok(bytes[base + HEADER_SIZE..base + HEADER_SIZE + len].to_vec())
            }) {
                SlotState::Valid(r) => Some(r),
                _ => None,
            }
        })
        .max_by_key(|r| r.generation)
        .expect("a valid record")
}

/// A healthy one-device pool (9 MiB, 1 MiB extents) with volumes "v" (3 MiB: an order-1 and
/// an order-0 extent) and "w" (1 MiB). Returns the directory, the device path and the
/// newest record, its table as JSON.
fn healthy_pool() -> (tempfile::TempDir, PathBuf, metadata::Record, Value) {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("a");
    {
        let mut p = Pool::open(&[spec(&path, Some(9 * MIB))], opts()).unwrap();
        p.create_volume("v", 3 * MIB, false, 1).unwrap();
        p.create_volume("w", MIB, false, 1).unwrap();
    }
    let rec = newest_record(&path);
    let table = serde_json::to_value(&rec.table).unwrap();
    (d, path, rec, table)
}

/// Writes `table` (any JSON) with valid checksums into BOTH slots of the device, as the two
/// newest generations, so no older valid copy is left to fall back to.
fn write_both_slots(path: &Path, rec: &metadata::Record, table: &Value) {
    let payload = serde_json::to_vec(table).unwrap();
    let pool = rec.table.pool_uuid;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    for g in [rec.generation + 1, rec.generation + 2] {
        f.write_all_at(
            &slot_image(g, pool, rec.device_uuid, &payload),
            (g % 2) * SLOT_SIZE,
        )
        .unwrap();
    }
    f.sync_all().unwrap();
}

/// Opens the pool over the corrupt device and expects a clear `Corrupt` error that mentions
/// every word of `expect`, and the device unchanged byte for byte.
fn assert_refused(path: &Path, expect: &[&str]) {
    let before = std::fs::read(path).unwrap();
    let r = Pool::open(&[spec(path, None)], opts());
    let after = std::fs::read(path).unwrap();
    assert!(before == after, "the refused device was modified");
    match r {
        Ok(p) => panic!(
            "corrupt metadata was accepted: {} volumes, left out {:?}",
            p.volumes().len(),
            p.info().left_out
        ),
        Err(Error::Corrupt { why, .. }) => {
            for w in expect {
                assert!(why.contains(w), "error does not mention '{w}': {why}");
            }
        }
        Err(e) => panic!("expected a Corrupt error, got: {e}"),
    }
}

/// Mutates a healthy pool's table and checks the result is refused cleanly.
fn refused_after(mutate: impl FnOnce(&mut Value), expect: &[&str]) {
    let (_d, path, rec, mut table) = healthy_pool();
    mutate(&mut table);
    write_both_slots(&path, &rec, &table);
    assert_refused(&path, expect);
}

fn vol<'a>(t: &'a mut Value, name: &str) -> &'a mut Value {
    t["volumes"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|v| v["name"] == name)
        .unwrap()
}

#[test]
fn healthy_table_written_by_hand_is_accepted() {
    // The hand-built slot images are right: an unmodified table opens and keeps its volumes.
    let (_d, path, rec, table) = healthy_pool();
    write_both_slots(&path, &rec, &table);
    let p = Pool::open(&[spec(&path, None)], opts()).unwrap();
    assert_eq!(p.volumes().len(), 2);
    assert_eq!(p.layout("v").unwrap().size, 3 * MIB);
}

#[test]
fn min_extent_zero_is_refused() {
    refused_after(|t| t["min_extent"] = json!(0), &["min_extent"]);
}

#[test]
fn min_extent_not_a_power_of_two_is_refused() {
    refused_after(|t| t["min_extent"] = json!(3 * MIB / 2), &["min_extent"]);
}

#[test]
fn min_extent_too_small_or_too_large_is_refused() {
    refused_after(|t| t["min_extent"] = json!(4096), &["min_extent"]);
    refused_after(|t| t["min_extent"] = json!(1u64 << 62), &["min_extent"]);
}

#[test]
fn extent_order_whose_block_size_wraps_is_refused() {
    // 1 MiB << 44 == 2^64: the shift wraps to 0 (the allocator divided by it).
    for order in [44u32, 63, 64, u32::MAX] {
        refused_after(
            |t| vol(t, "w")["extents"][0]["order"] = json!(order),
            &["volume 'w'", "order"],
        );
    }
}

#[test]
fn extent_past_the_end_of_its_device_is_refused() {
    refused_after(
        |t| vol(t, "w")["extents"][0]["offset"] = json!(METADATA_AREA + 64 * MIB),
        &["volume 'w'", "beyond"],
    );
    refused_after(
        |t| vol(t, "w")["extents"][0]["offset"] = json!(u64::MAX - MIB + 1),
        &["volume 'w'"],
    );
}

#[test]
fn extent_in_the_metadata_area_or_misaligned_is_refused() {
    refused_after(
        |t| vol(t, "w")["extents"][0]["offset"] = json!(0),
        &["volume 'w'", "metadata area"],
    );
    refused_after(
        |t| vol(t, "w")["extents"][0]["offset"] = json!(METADATA_AREA + 4096),
        &["volume 'w'", "aligned"],
    );
}

#[test]
fn overlapping_extents_are_refused() {
    refused_after(
        |t| {
            let e = vol(t, "v")["extents"][1].clone();
            vol(t, "w")["extents"][0] = e;
        },
        &["overlap"],
    );
}

#[test]
fn overlapping_extents_on_a_missing_device_are_refused() {
    // The allocator only sees present devices; the table check must catch the rest.
    refused_after(
        |t| {
            let gone = Uuid::new_v4();
            t["devices"]
                .as_array_mut()
                .unwrap()
                .push(json!({"uuid": gone, "size": 9 * MIB, "last_path": ""}));
            vol(t, "v")["extents"][1]["device"] = json!(gone);
            let e = vol(t, "v")["extents"][1].clone();
            vol(t, "w")["extents"][0] = e;
        },
        &["overlap"],
    );
}

#[test]
fn extent_on_an_unknown_device_is_refused() {
    refused_after(
        |t| vol(t, "w")["extents"][0]["device"] = json!(Uuid::new_v4()),
        &["volume 'w'", "unknown device"],
    );
}

#[test]
fn volume_larger_than_its_extents_is_refused() {
    // Before: the tail beyond the extents was silently dropped (writes lost).
    refused_after(
        |t| vol(t, "w")["size"] = json!(5 * MIB),
        &["volume 'w'", "size"],
    );
    // No extents at all.
    refused_after(
        |t| vol(t, "w")["extents"] = json!([]),
        &["volume 'w'", "size"],
    );
}

#[test]
fn volume_much_smaller_than_its_extents_is_refused() {
    refused_after(
        |t| vol(t, "v")["size"] = json!(512),
        &["volume 'v'", "size"],
    );
}

#[test]
fn volume_size_zero_or_unaligned_is_refused() {
    refused_after(|t| vol(t, "w")["size"] = json!(0), &["volume 'w'", "size"]);
    refused_after(
        |t| vol(t, "w")["size"] = json!(MIB - 100),
        &["volume 'w'", "size"],
    );
}

#[test]
fn bad_num_queues_are_refused() {
    for q in [0, 65] {
        refused_after(
            |t| vol(t, "w")["num_queues"] = json!(q),
            &["volume 'w'", "num_queues"],
        );
    }
}

#[test]
fn bad_and_duplicate_volume_names_and_uuids_are_refused() {
    refused_after(|t| vol(t, "w")["name"] = json!("../../etc/x"), &["name"]);
    refused_after(|t| vol(t, "w")["name"] = json!("v"), &["duplicate", "'v'"]);
    refused_after(
        |t| {
            let u = vol(t, "v")["uuid"].clone();
            vol(t, "w")["uuid"] = u;
        },
        &["duplicate"],
    );
}

#[test]
fn duplicate_devices_are_refused() {
    refused_after(
        |t| {
            let d = t["devices"][0].clone();
            t["devices"].as_array_mut().unwrap().push(d);
        },
        &["duplicate", "device"],
    );
}

#[test]
fn device_smaller_than_the_metadata_area_or_its_extents_is_refused() {
    refused_after(
        |t| t["devices"][0]["size"] = json!(4096),
        &["device", "size"],
    );
    refused_after(
        |t| t["devices"][0]["size"] = json!(METADATA_AREA + 2 * MIB),
        &["volume", "beyond"],
    );
}

#[test]
fn exhausted_generation_is_refused() {
    let (_d, path, rec, table) = healthy_pool();
    // The newest copy claims the last generation; nothing could ever be committed after it.
    let payload = serde_json::to_vec(&table).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(
        &slot_image(u64::MAX, rec.table.pool_uuid, rec.device_uuid, &payload),
        SLOT_SIZE,
    )
    .unwrap();
    f.write_all_at(&[0u8; HEADER_SIZE], 0).unwrap();
    drop(f);
    assert_refused(&path, &["generation"]);
}

#[test]
fn truncated_member_device_is_left_out_not_a_panic() {
    // A member device whose file was truncated below the metadata area still has a valid
    // copy in slot 0; the pool must not subtract its way below zero.
    let (_d, path, rec, table) = healthy_pool();
    let payload = serde_json::to_vec(&table).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(
        &slot_image(
            rec.generation + 1 + (rec.generation + 1) % 2,
            rec.table.pool_uuid,
            rec.device_uuid,
            &payload,
        ),
        0,
    )
    .unwrap();
    f.set_len(METADATA_AREA - 4096).unwrap();
    drop(f);
    let before = std::fs::read(&path).unwrap();
    let r = Pool::open(&[spec(&path, None)], opts());
    assert!(
        before == std::fs::read(&path).unwrap(),
        "the truncated device was modified"
    );
    match r {
        Ok(p) => {
            let info = p.info();
            assert_eq!(info.left_out.len(), 1, "{:?}", info.left_out);
            assert!(
                info.left_out[0].reason.contains("smaller"),
                "{:?}",
                info.left_out
            );
            assert!(p.volumes().iter().all(|v| !v.online));
        }
        Err(e) => assert!(e.to_string().contains("smaller"), "{e}"),
    }
}

#[test]
fn device_that_shrank_below_its_extents_is_left_out() {
    let (_d, path, _rec, _table) = healthy_pool();
    // 9 MiB with 5 MiB of extents from 1 MiB on: cut it to 4 MiB.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(4 * MIB).unwrap();
    drop(f);
    let before = std::fs::read(&path).unwrap();
    let p = Pool::open(&[spec(&path, None)], opts()).unwrap();
    assert!(before == std::fs::read(&path).unwrap());
    let info = p.info();
    assert_eq!(info.left_out.len(), 1, "{:?}", info.left_out);
    assert!(
        info.left_out[0].reason.contains("smaller"),
        "{:?}",
        info.left_out
    );
}

#[test]
fn huge_sizes_from_operators_are_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("a");
    let mut p = Pool::open(&[spec(&path, Some(9 * MIB))], opts()).unwrap();
    p.create_volume("v", MIB, false, 1).unwrap();
    let free = p.info().free;
    let huge = [
        u64::MAX - 511,
        u64::MAX - MIB + 1,
        (u64::MAX / MIB) * MIB,
        1u64 << 63,
        (1u64 << 63) + 512,
    ];
    for size in huge {
        match p.create_volume("big", size, false, 1) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("size"), "{m}"),
            Err(Error::NoSpace { requested, .. }) => assert!(requested >= size, "{requested}"),
            Err(e) => panic!("create {size}: unexpected error {e}"),
            Ok(v) => panic!("create {size}: created {v:?}"),
        }
        match p.resize_volume("v", size) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("size"), "{m}"),
            Err(Error::NoSpace { requested, .. }) => {
                assert!(requested >= size - MIB, "{requested}")
            }
            Err(e) => panic!("resize {size}: unexpected error {e}"),
            Ok(v) => panic!("resize {size}: resized to {v:?}"),
        }
    }
    // Nothing leaked, nothing changed, and the pool still reopens as it was.
    assert_eq!(p.info().free, free);
    assert_eq!(p.volumes().len(), 1);
    assert_eq!(p.volume("v").unwrap().size, MIB);
    drop(p);
    let p = Pool::open(&[spec(&path, None)], opts()).unwrap();
    assert_eq!(p.volume("v").unwrap().size, MIB);
    assert_eq!(p.info().free, free);
}

#[test]
fn pool_options_with_huge_min_extent_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let e = Pool::open(
        &[spec(&d.path().join("a"), Some(9 * MIB))],
        PoolOptions {
            min_extent: 1 << 63,
            ..Default::default()
        },
    )
    .err()
    .expect("refused");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}
