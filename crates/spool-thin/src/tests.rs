//! A thin volume over a real file device: allocation on first write, holes, unmapping, the
//! map across a reopen, a full pool, corrupt entries.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use spool_devices::{Device, DeviceIo, DeviceQueue, IoVec, OpenOptions};
use uuid::Uuid;

use crate::map::{MapExtent, MapStore};
use crate::{ChunkSource, SharedChunks, ThinBackend, ThinSpec};

mod map_failures;
mod relocate;
mod snapshots;
mod sync_io;

const CHUNK: u64 = 64 << 10;
/// Device layout: the map at 0..64K, chunks from 64K on.
const CHUNKS_AT: u64 = 64 << 10;

#[derive(Debug)]
struct Free {
    uuid: Uuid,
    dev: Arc<Device>,
    free: Mutex<Vec<u64>>,
    refs: SharedChunks,
}

impl ChunkSource for Free {
    fn take(&self) -> Option<(Uuid, Arc<Device>, u64)> {
        let off = self.free.lock().unwrap().pop()?;
        Some((self.uuid, self.dev.clone(), off))
    }

    fn give_back(&self, device: Uuid, offset: u64) {
        assert_eq!(device, self.uuid);
        let mut f = self.free.lock().unwrap();
        assert!(!f.contains(&offset), "chunk {offset} given back twice");
        f.push(offset);
    }

    fn shared_chunks(&self) -> &SharedChunks {
        &self.refs
    }
}

fn device(path: &Path, size: u64) -> Arc<Device> {
    let opts = OpenOptions {
        create_size: Some(size),
        ..Default::default()
    };
    Arc::new(Device::open(path, &opts).unwrap())
}

fn spec(volume: Uuid, dev: &Arc<Device>, size: u64) -> ThinSpec {
    ThinSpec {
        volume,
        path: "thin:t".into(),
        size,
        chunk: CHUNK,
        chunk_base: 0,
        store: MapStore::new(vec![MapExtent {
            device: dev.clone(),
            offset: 0,
            len: CHUNKS_AT,
        }])
        .unwrap(),
        full_wait: Duration::from_millis(200),
        inline_io: false,
        snapshots: Vec::new(),
        copy_devices: Vec::new(),
    }
}

/// Submits `io` and waits for its result.
fn run(q: &mut dyn DeviceQueue, io: DeviceIo) -> i32 {
    // SAFETY: the test's buffers outlive the call, which waits for the completion.
    unsafe { q.submit(io, 9) };
    q.kick().unwrap();
    let mut got = None;
    while got.is_none() {
        q.reap(&mut |tag, res| {
            assert_eq!(tag, 9);
            got = Some(res)
        });
        std::thread::yield_now();
    }
    got.unwrap()
}

fn rw(q: &mut dyn DeviceQueue, write: bool, offset: u64, buf: &mut [u8]) -> i32 {
    let iov = [IoVec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    run(
        q,
        DeviceIo::data(write, offset, buf.len() as u64, iov.as_ptr(), 1),
    )
}

struct Fixture {
    _dir: tempfile::TempDir,
    dev: Arc<Device>,
    source: Arc<Free>,
    volume: Uuid,
}

fn fixture(chunks: u64) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    // The chunks hold an old tenant's bytes: a chunk handed out unzeroed would show them.
    let old = vec![0xa5u8; (chunks * CHUNK) as usize];
    let file = std::fs::File::create(dir.path().join("d.img")).unwrap();
    file.write_all_at(&old, CHUNKS_AT).unwrap();
    drop(file);
    let dev = device(&dir.path().join("d.img"), CHUNKS_AT + chunks * CHUNK);
    let source = Arc::new(Free {
        uuid: Uuid::new_v4(),
        dev: dev.clone(),
        free: Mutex::new((0..chunks).rev().map(|i| CHUNKS_AT + i * CHUNK).collect()),
        refs: SharedChunks::default(),
    });
    Fixture {
        _dir: dir,
        dev,
        source,
        volume: Uuid::new_v4(),
    }
}

impl Fixture {
    fn open(&self, size: u64) -> (Arc<Device>, crate::LoadedMap) {
        self.open_spec(spec(self.volume, &self.dev, size))
    }

    pub(crate) fn open_spec(&self, spec: ThinSpec) -> (Arc<Device>, crate::LoadedMap) {
        let d = self.dev.clone();
        let u = self.source.uuid;
        ThinBackend::open(spec, self.source.clone(), &move |x| {
            (x == u).then(|| d.clone())
        })
        .unwrap()
    }

    fn free(&self) -> usize {
        self.source.free.lock().unwrap().len()
    }

    /// Chunks given back after a discard come back once their grace period is over (a few
    /// milliseconds): waits up to 10 s for `n` free chunks.
    fn wait_free(&self, n: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.free() != n && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(self.free(), n);
    }
}

#[test]
fn chunks_come_on_first_write_and_go_back_on_discard() {
    let f = fixture(8);
    let (thin, loaded) = f.open(4 * CHUNK);
    assert!(loaded.is_empty());
    let t = ThinBackend::of(&thin).unwrap();
    let mut q = thin.open_queue(8).unwrap();
    // A hole reads zeroes and takes nothing.
    let mut buf = vec![0xaau8; 8192];
    assert_eq!(rw(&mut *q, false, CHUNK, &mut buf), 0);
    assert!(buf.iter().all(|&b| b == 0));
    assert_eq!((t.allocated(), f.free()), (0, 8));
    // A write across a chunk boundary takes two chunks; the rest of them reads zeroes.
    let mut data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8 + 1).collect();
    assert_eq!(rw(&mut *q, true, CHUNK - 4096, &mut data), 0);
    assert_eq!((t.allocated(), f.free()), (2 * CHUNK, 6));
    let mut back = vec![0u8; 8192];
    assert_eq!(rw(&mut *q, false, CHUNK - 4096, &mut back), 0);
    assert!(back == data);
    let mut rest = vec![0xffu8; 4096];
    assert_eq!(rw(&mut *q, false, CHUNK, &mut rest), 0);
    assert_eq!(&rest[..], &data[4096..]);
    assert_eq!(rw(&mut *q, false, 2 * CHUNK - 4096, &mut rest), 0);
    assert!(rest.iter().all(|&b| b == 0));
    // The data is where the map says, on the device.
    let p = t.placements();
    assert_eq!(p.len(), 2);
    // A discard of a partial chunk keeps it; of a whole chunk gives it back.
    assert_eq!(
        run(
            &mut *q,
            DeviceIo::Discard {
                offset: CHUNK,
                len: 4096
            }
        ),
        0
    );
    assert_eq!(f.free(), 6);
    assert_eq!(
        run(
            &mut *q,
            DeviceIo::WriteZeroes {
                offset: 0,
                len: 2 * CHUNK
            }
        ),
        0
    );
    assert_eq!(t.allocated(), 0);
    f.wait_free(8);
    assert_eq!(rw(&mut *q, false, CHUNK - 4096, &mut back), 0);
    assert!(back.iter().all(|&b| b == 0));
    assert_eq!(run(&mut *q, DeviceIo::Flush), 0);
}

#[test]
fn the_map_outlives_the_process_and_corruption_is_refused() {
    let f = fixture(8);
    let mut data = vec![0x5au8; 4096];
    {
        let (thin, _) = f.open(4 * CHUNK);
        let mut q = thin.open_queue(8).unwrap();
        assert_eq!(rw(&mut *q, true, 3 * CHUNK, &mut data), 0);
        assert_eq!(rw(&mut *q, true, 100 << 10, &mut data), 0);
    }
    let (thin, loaded) = f.open(4 * CHUNK);
    assert_eq!(loaded.len(), 2);
    let mut q = thin.open_queue(8).unwrap();
    let mut back = vec![0u8; 4096];
    assert_eq!(rw(&mut *q, false, 3 * CHUNK, &mut back), 0);
    assert!(back == data);
    drop((q, thin));
    // Entry 3 lies at map byte 96; flip one of its bits.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(f._dir.path().join("d.img"))
        .unwrap();
    let mut b = [0u8; 1];
    file.read_exact_at(&mut b, 96 + 30).unwrap();
    file.write_all_at(&[b[0] ^ 4], 96 + 30).unwrap();
    let d = f.dev.clone();
    let err = ThinBackend::open(
        spec(f.volume, &f.dev, 4 * CHUNK),
        f.source.clone(),
        &move |_| Some(d.clone()),
    )
    .unwrap_err();
    assert!(err.to_string().contains("entry 3: checksum"), "{err}");
}

#[test]
fn a_full_pool_holds_the_write_then_fails_it() {
    let f = fixture(1);
    let (thin, _) = f.open(4 * CHUNK);
    let mut q = thin.open_queue(8).unwrap();
    let mut data = vec![1u8; 4096];
    assert_eq!(rw(&mut *q, true, 0, &mut data), 0);
    // No chunk left: the write waits `full_wait`, then fails with ENOSPC.
    let start = std::time::Instant::now();
    assert_eq!(rw(&mut *q, true, CHUNK, &mut data), -libc::ENOSPC);
    assert!(start.elapsed() >= Duration::from_millis(150));
    // Space freed while a write waits lets it through.
    let thin2 = thin.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        let mut q2 = thin2.open_queue(8).unwrap();
        assert_eq!(
            run(
                &mut *q2,
                DeviceIo::Discard {
                    offset: 0,
                    len: CHUNK
                }
            ),
            0
        );
    });
    assert_eq!(rw(&mut *q, true, 2 * CHUNK, &mut data), 0);
    t.join().unwrap();
    let mut back = vec![0u8; 4096];
    assert_eq!(rw(&mut *q, false, 0, &mut back), 0);
    assert!(back.iter().all(|&b| b == 0));
}

#[test]
fn a_flush_reaches_devices_another_queue_wrote_to() {
    let f = fixture(4);
    let (thin, _) = f.open(4 * CHUNK);
    let mut a = thin.open_queue(8).unwrap();
    let mut b = thin.open_queue(8).unwrap();
    let mut data = vec![3u8; 4096];
    assert_eq!(rw(&mut *a, true, 0, &mut data), 0);
    // Queue b never wrote: its flush must still go to the device a wrote to (failing here,
    // with an injected error, shows it did).
    f.dev.faults().add(spool_devices::FaultRule {
        effect: spool_devices::FaultEffect::Errno(libc::EIO),
        ops: spool_devices::FaultOps::Write,
        offset: 0,
        len: 0,
        count: Some(1),
        duration: None,
        fails_probe: false,
    });
    assert_eq!(run(&mut *b, DeviceIo::Flush), -libc::EIO);
    assert_eq!(run(&mut *b, DeviceIo::Flush), 0);
}

#[test]
fn a_stop_cancels_writes_waiting_for_space_at_once() {
    let f = fixture(1);
    let (thin, _) = f.open(4 * CHUNK);
    let mut q = thin.open_queue(8).unwrap();
    let mut data = vec![1u8; 4096];
    assert_eq!(rw(&mut *q, true, 0, &mut data), 0);
    let iov = [IoVec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    }];
    // SAFETY: `data` and `iov` outlive the request, which completes below.
    unsafe { q.submit(DeviceIo::data(true, CHUNK, 4096, iov.as_ptr(), 1), 5) };
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(q.in_flight(), 1, "parked for a chunk");
    assert_eq!(q.abort(), 1);
    let mut got = Vec::new();
    q.reap(&mut |tag, res| got.push((tag, res)));
    assert_eq!(got, vec![(5, -libc::ECANCELED)]);
    assert_eq!(q.in_flight(), 0);
}

/// After a crash at `point`: the map read back alone (as the pool does at start), with the
/// free list rebuilt from it. Returns the reopened device, the chunks its map names, and
/// checks that every chunk is either free or named by the map, exactly once.
fn after_crash(f: &Fixture, chunks: u64) -> (Arc<Device>, crate::LoadedMap) {
    let d = f.dev.clone();
    let u = f.source.uuid;
    let resolve = move |x: Uuid| (x == u).then(|| d.clone());
    let scan = ThinBackend::scan(&spec(f.volume, &f.dev, 4 * CHUNK), &resolve);
    assert_eq!(
        scan.problem, None,
        "a crash never leaves a map that cannot be served"
    );
    let named: Vec<u64> = scan.placements.iter().map(|(_, p)| p.offset).collect();
    let free: Vec<u64> = (0..chunks)
        .map(|i| CHUNKS_AT + i * CHUNK)
        .filter(|o| !named.contains(o))
        .collect();
    for o in &named {
        assert_eq!(
            named.iter().filter(|x| *x == o).count(),
            1,
            "chunk {o} named twice"
        );
    }
    *f.source.free.lock().unwrap() = free;
    let (thin, placements) = f.open(4 * CHUNK);
    (thin, placements)
}

/// Every step of a first write and of an unmap, with the allocator dying there: no
/// acknowledged write is lost, no chunk is owned twice or leaked (the pool's rebuild from the
/// map frees exactly the chunks the map does not name), and the request that was cut short
/// was never acknowledged.
#[test]
fn a_crash_at_any_step_of_an_allocation_or_unmap_loses_nothing_acknowledged() {
    use crate::shared::CrashPoint::*;
    for point in [Taken, Zeroed, MapWritten, Cleared, HolesWritten] {
        let f = fixture(4);
        let acked = vec![0x42u8; 4096];
        {
            let (thin, _) = f.open(4 * CHUNK);
            let mut q = thin.open_queue(8).unwrap();
            let mut a = acked.clone();
            assert_eq!(rw(&mut *q, true, 0, &mut a), 0);
            assert_eq!(rw(&mut *q, true, CHUNK, &mut a), 0);
            ThinBackend::of(&thin).unwrap().arm_crash(point);
            let mut data = vec![9u8; 4096];
            let iov = [IoVec {
                iov_base: data.as_mut_ptr().cast(),
                iov_len: data.len(),
            }];
            let io = match point {
                Taken | Zeroed | MapWritten => {
                    DeviceIo::data(true, 2 * CHUNK, 4096, iov.as_ptr(), 1)
                }
                _ => DeviceIo::Discard {
                    offset: CHUNK,
                    len: CHUNK,
                },
            };
            // SAFETY: `data` and `iov` outlive the queue, dropped below.
            unsafe { q.submit(io, 5) };
            q.kick().unwrap();
            std::thread::sleep(Duration::from_millis(100));
            let mut got = Vec::new();
            q.reap(&mut |tag, res| got.push((tag, res)));
            assert_eq!(
                got,
                vec![],
                "{point:?}: the request cut short was acknowledged"
            );
        }
        let (thin, placements) = after_crash(&f, 4);
        let mut q = thin.open_queue(8).unwrap();
        let mut back = vec![0u8; 4096];
        assert_eq!(rw(&mut *q, false, 0, &mut back), 0);
        assert!(back == acked, "{point:?}: an acknowledged write was lost");
        let mapped: Vec<u64> = {
            let t = ThinBackend::of(&thin).unwrap();
            assert_eq!(t.allocated(), placements.len() as u64 * CHUNK);
            (0..4)
                .filter(|&c| {
                    let mut b = vec![0xeeu8; 4096];
                    rw(&mut *q, false, c * CHUNK, &mut b);
                    b.iter().any(|&x| x != 0)
                })
                .collect()
        };
        match point {
            // The new chunk never made it into the map, or made it zeroed: no data either way.
            Taken | Zeroed => assert_eq!(placements.len(), 2, "{point:?}"),
            MapWritten => assert_eq!(placements.len(), 3, "{point:?}"),
            // The discard did not happen, or happened whole.
            Cleared => assert_eq!((placements.len(), &mapped[..]), (2, &[0, 1][..])),
            HolesWritten => assert_eq!((placements.len(), &mapped[..]), (1, &[0][..])),
            Copied | Marked => unreachable!("tests/snapshots.rs"),
        }
        assert!(
            mapped.iter().all(|&c| c < 2),
            "{point:?}: data in a chunk never written"
        );
        assert_eq!(
            f.free() as u64 + placements.len() as u64,
            4,
            "{point:?}: a chunk leaked"
        );
    }
}

/// A write parked for a chunk that is mapped and then discarded again before its queue looks
/// asks for the chunk again instead of waiting for ever.
#[test]
fn a_write_whose_chunk_was_discarded_before_it_looked_asks_again() {
    let f = fixture(4);
    let (thin, _) = f.open(4 * CHUNK);
    let t = ThinBackend::of(&thin).unwrap();
    let mut a = thin.open_queue(8).unwrap();
    let mut b = thin.open_queue(8).unwrap();
    let mut data = vec![6u8; 4096];
    let iov = [IoVec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    }];
    // SAFETY: `data` and `iov` outlive the request, which is waited for below.
    unsafe { a.submit(DeviceIo::data(true, CHUNK, 4096, iov.as_ptr(), 1), 3) };
    // The allocator maps the chunk; queue a has not looked yet when b discards it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while t.allocated() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the chunk was never mapped"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        run(
            &mut *b,
            DeviceIo::Discard {
                offset: CHUNK,
                len: CHUNK
            }
        ),
        0
    );
    assert_eq!(t.allocated(), 0);
    let mut got = None;
    while got.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "the parked write was stranded"
        );
        a.reap(&mut |tag, res| got = Some((tag, res)));
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(got, Some((3, 0)));
    let mut back = vec![0u8; 4096];
    assert_eq!(rw(&mut *a, false, CHUNK, &mut back), 0);
    assert!(back == data);
}

/// A chunk the allocator has taken and not yet published is known as in its hands (what
/// `pool check` must not call leaked), and only until its batch is done.
#[test]
fn a_chunk_being_allocated_is_known_as_in_hand() {
    let f = fixture(4);
    let (thin, _) = f.open(4 * CHUNK);
    let t = ThinBackend::of(&thin).unwrap();
    let mut q = thin.open_queue(8).unwrap();
    let mut a = vec![1u8; 4096];
    assert_eq!(rw(&mut *q, true, 0, &mut a), 0);
    assert!(
        t.in_hand().is_empty(),
        "a done batch leaves nothing in hand"
    );
    // The allocator stops right after taking the next chunk.
    t.arm_crash(crate::shared::CrashPoint::Taken);
    let mut data = vec![9u8; 4096];
    let iov = [IoVec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    }];
    // SAFETY: `data` and `iov` outlive the queue, dropped at the end of the test.
    unsafe { q.submit(DeviceIo::data(true, CHUNK, 4096, iov.as_ptr(), 1), 5) };
    q.kick().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while t.in_hand().is_empty() {
        assert!(std::time::Instant::now() < deadline, "no chunk in hand");
        std::thread::sleep(Duration::from_millis(1));
    }
    let held = t.in_hand();
    assert_eq!(held.len(), 1);
    assert!(!t.placements().contains(&held[0]), "not named anywhere yet");
}

#[test]
fn a_failed_piece_is_reported_to_its_device_with_where_it_failed() {
    let f = fixture(4);
    let (thin, _) = f.open(4 * CHUNK);
    let mut q = thin.open_queue(8).unwrap();
    let mut data = vec![5u8; 4096];
    // The volume's second chunk takes the first free one, at CHUNKS_AT.
    assert_eq!(rw(&mut *q, true, CHUNK + 8192, &mut data), 0);
    let _ = f.dev.health().take_reports();
    f.dev.faults().add(spool_devices::FaultRule {
        effect: spool_devices::FaultEffect::Errno(libc::ENODATA),
        ops: spool_devices::FaultOps::Read,
        offset: 0,
        len: 0,
        count: Some(1),
        duration: None,
        fails_probe: false,
    });
    assert_eq!(rw(&mut *q, false, CHUNK + 8192, &mut data), -libc::ENODATA);
    let (reports, _) = f.dev.health().take_reports();
    assert_eq!(reports.len(), 1);
    let r = &reports[0];
    assert_eq!((r.offset, r.len, r.write), (CHUNKS_AT + 8192, 4096, false));
}
