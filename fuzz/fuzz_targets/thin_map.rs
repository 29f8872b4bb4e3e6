//! Fuzzes reading a thin volume's maps at open (`spool_thin::ThinBackend::scan`): the input
//! builds a volume's map and one snapshot's, entry by entry, each a hole, a valid entry
//! (right checksum) naming a chunk at an aligned or a hostile offset on one of three devices,
//! or raw bytes. Valid checksums let the input reach what lies past them. It must never
//! panic, and what it accepts must be safe to serve: every chunk named is inside the volume
//! (index below its chunk count), at the chunk base plus a multiple of the chunk; a map of
//! holes and good entries is never refused, whatever its snapshot's map holds (a damaged
//! snapshot map costs only the snapshot).
#![no_main]

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use spool_devices::{Device, OpenOptions};
use spool_thin::map::{encode, MapExtent, MapStore, Placement, ENTRY_BYTES};
use spool_thin::{SnapshotSpec, ThinBackend, ThinSpec};
use uuid::Uuid;

const CHUNK: u64 = 1 << 20;
const BASE: u64 = 1 << 20;
/// Bytes of each map's store: two blocks (256 entries).
const MAP: u64 = 8192;

struct Fixture {
    _dir: tempfile::TempDir,
    file: std::fs::File,
    dev: Arc<Device>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir_in(Path::new("/dev/shm")).unwrap_or_else(|_| {
            tempfile::tempdir().expect("a temporary directory")
        });
        let path = dir.path().join("maps");
        let opts = OpenOptions {
            create_size: Some(2 * MAP),
            no_direct: true,
            ..Default::default()
        };
        let dev = Arc::new(Device::open(&path, &opts).expect("the map device"));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("the map file");
        Fixture {
            _dir: dir,
            file,
            dev,
        }
    })
}

/// Builds a map image of `volume` from `input` (3 bytes per entry, cycled); returns it and
/// whether each of its first `chunks` entries (those read) is a hole or a good one.
fn image(
    volume: Uuid,
    devices: &[Uuid; 3],
    input: &[u8],
    salt: u8,
    chunks: u64,
) -> (Vec<u8>, bool) {
    let mut img = vec![0u8; MAP as usize];
    let mut clean = true;
    if input.is_empty() {
        return (img, clean);
    }
    for i in 0..MAP / ENTRY_BYTES {
        let at = (i as usize * 3) % input.len();
        let b = |k: usize| input[(at + k) % input.len()].wrapping_add(salt);
        let e = &mut img[(i * ENTRY_BYTES) as usize..((i + 1) * ENTRY_BYTES) as usize];
        let read = i < chunks;
        match b(0) % 4 {
            0 => {}
            1 => {
                let p = Placement {
                    device: devices[b(1) as usize % 3],
                    offset: BASE + b(2) as u64 * CHUNK,
                };
                e.copy_from_slice(&encode(volume, i, Some(p)));
            }
            2 => {
                // A good checksum over a hostile offset.
                let offset = u64::from_le_bytes([b(1), b(2), b(1), 0, 0, 0, b(2) & 0x0f, b(1)]);
                let p = Placement {
                    device: devices[b(2) as usize % 3],
                    offset,
                };
                e.copy_from_slice(&encode(volume, i, Some(p)));
                clean &= !read || (offset >= BASE && (offset - BASE) % CHUNK == 0 && offset < 1 << 59);
            }
            _ => {
                for (k, x) in e.iter_mut().enumerate() {
                    *x = b(k + 1);
                }
                clean &= !read || e.iter().all(|&x| x == 0);
            }
        }
    }
    (img, clean)
}

fuzz_target!(|data: &[u8]| {
    let Some((&head, rest)) = data.split_first() else {
        return;
    };
    let f = fixture();
    let devices = [Uuid::from_u128(1), Uuid::from_u128(2), Uuid::from_u128(3)];
    let (volume, snap) = (Uuid::from_u128(10), Uuid::from_u128(11));
    // Up to 2 blocks of entries: 1..=256 chunks.
    let chunks = 1 + head as u64;
    let size = chunks * CHUNK - (head as u64 % 3) * 512;
    let half = rest.len() / 2;
    let (own, own_clean) = image(volume, &devices, &rest[..half], 0, chunks);
    let (theirs, snap_clean) = image(snap, &devices, &rest[half..], 0x5a, chunks);
    f.file.write_all_at(&own, 0).expect("write the volume's map");
    f.file.write_all_at(&theirs, MAP).expect("write the snapshot's map");
    let store = |offset| {
        MapStore::new(vec![MapExtent {
            device: f.dev.clone(),
            offset,
            len: MAP,
        }])
        .expect("a whole number of blocks")
    };
    let spec = ThinSpec {
        volume,
        path: "thin:fuzz".into(),
        size,
        chunk: CHUNK,
        chunk_base: BASE,
        store: store(0),
        full_wait: Duration::from_millis(1),
        inline_io: true,
        snapshots: vec![SnapshotSpec {
            uuid: snap,
            size,
            store: store(MAP),
        }],
        copy_devices: Vec::new(),
    };
    // Only the first two devices are in the pool: the third's chunks fail I/O when served.
    let resolve = |u: Uuid| (u != devices[2]).then(|| f.dev.clone());
    let scan = ThinBackend::scan(&spec, &resolve);
    for &(i, p) in &scan.placements {
        assert!(i < chunks, "entry {i} past the volume's {chunks} chunks");
        assert!(
            p.offset >= BASE && (p.offset - BASE) % CHUNK == 0,
            "a chunk at {} accepted",
            p.offset
        );
    }
    // What decides the volume is its own map alone.
    if own_clean {
        assert!(scan.problem.is_none(), "{:?}", scan.problem);
    }
    if snap_clean {
        assert!(scan.damaged.is_empty(), "{:?}", scan.damaged);
    }
});
