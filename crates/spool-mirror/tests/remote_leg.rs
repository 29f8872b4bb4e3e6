//! A mirror leg on another host's export (what `volume send` builds): a real qemu-nbd serves
//! the remote copy, which is rebuilt from the local leg while it is written.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use spool_devices::testing::{MemExport, QemuNbd};
use spool_devices::{Device, DeviceIo, DeviceQueue, IoVec, OpenOptions};
use spool_mirror::{create_clean_bitmap, LegPiece, LegSpec, Mirror, MirrorSpec};

const MIB: u64 = 1 << 20;

/// Submits `io` (tag 1), kicks and waits for its result.
fn run(q: &mut dyn DeviceQueue, io: DeviceIo) -> i32 {
    // SAFETY: the caller keeps the iovecs and buffers alive until this returns (reaped).
    unsafe { q.submit(io, 1) };
    q.kick().unwrap();
    let t0 = Instant::now();
    loop {
        let mut res = None;
        q.reap(&mut |_, r| res = Some(r));
        if let Some(r) = res {
            return r;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "never completed");
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn pattern(len: u64, seed: u64) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + seed) % 251) as u8).collect()
}

fn leg(slot: u8, synced: bool, device: usize, offset: u64, len: u64) -> LegSpec {
    LegSpec {
        slot,
        id: slot as u64 + 1,
        synced,
        far: false,
        pieces: vec![LegPiece {
            logical: 0,
            len,
            device,
            offset,
        }],
    }
}

/// A file device of 16 MiB, the local leg's.
fn local_device(dir: &std::path::Path) -> Arc<Device> {
    let opts = OpenOptions {
        create_size: Some(16 * MIB),
        no_direct: true,
        ..Default::default()
    };
    Arc::new(Device::open(&dir.join("local.img"), &opts).unwrap())
}

/// A new mirror of `size` bytes: leg 0 synced on `local` at 1 MiB, leg 1 on `remote` (to
/// be rebuilt), its bitmap in `dir`.
fn local_and_remote(
    dir: &std::path::Path,
    local: Arc<Device>,
    remote: Arc<Device>,
    size: u64,
) -> Mirror {
    create_clean_bitmap(&dir.join("bitmap"), size).unwrap();
    Mirror::open(MirrorSpec {
        name: "moving".into(),
        size,
        devices: vec![local, remote],
        legs: vec![leg(0, true, 0, MIB, size), leg(1, false, 1, 0, size)],
        bitmap: Some(dir.join("bitmap")),
        resync_rate: 0,
    })
    .unwrap()
}

/// Waits (up to 30 s) until the remote leg holds a complete copy.
fn wait_current(mirror: &Mirror) {
    let t0 = Instant::now();
    while !mirror.leg_current(1) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the remote leg never caught up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
#[ignore = "needs qemu-nbd (run by scripts/test.sh)"]
fn a_mirror_leg_on_a_remote_export_is_rebuilt_and_written() {
    let d = tempfile::tempdir().unwrap();
    let size = 8 * MIB;
    let local = local_device(d.path());
    let data = pattern(size, 6);
    local.write_at_durable(&data, MIB).unwrap();
    let srv = QemuNbd::start(d.path(), size);
    let mirror = local_and_remote(d.path(), local, srv.device(), size);
    // Written while the remote copy is made (or just after): both copies get it.
    let mut q = mirror.device().open_queue(64).unwrap();
    let mut w = pattern(64 << 10, 7);
    let v = [IoVec {
        iov_base: w.as_mut_ptr().cast(),
        iov_len: w.len(),
    }];
    assert!(
        run(
            &mut *q,
            DeviceIo::data(true, 3 * MIB, 64 << 10, v.as_ptr(), 1)
        ) >= 0
    );
    wait_current(&mirror);
    let mut want = data.clone();
    want[(3 * MIB) as usize..(3 * MIB + (64 << 10)) as usize].copy_from_slice(&w);
    assert!(srv.contents(0, size) == want, "the remote copy differs");
    assert_eq!(mirror.verify().unwrap().regions_differing, 0);
}

/// An export in memory that counts the bytes written to it as data.
struct Counting(MemExport, AtomicU64);

impl spool_nbd::Export for Counting {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.0.read_at(buf, offset)
    }
    fn extent(&self) -> u64 {
        self.0.extent()
    }
    fn allocated(&self, i: u64) -> bool {
        self.0.allocated(i)
    }
    fn base(&self) -> Option<&str> {
        None
    }
    fn changed(&self, _: u64) -> bool {
        false
    }
    fn writable(&self) -> bool {
        true
    }
    fn offers_write_zeroes(&self) -> bool {
        true
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.1.fetch_add(buf.len() as u64, Ordering::Relaxed);
        self.0.write_at(buf, offset)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        let mut d = self.0 .0.lock().unwrap();
        d[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}

/// A copy to another host sends only what is not zeroes as data: a fresh volume with one
/// MiB written crosses as one MiB of data and write-zeroes for the rest (before, all of
/// it went as data).
#[test]
fn a_rebuild_sends_pieces_of_zeroes_as_write_zeroes() {
    let d = tempfile::tempdir().unwrap();
    let size = 8 * MIB;
    let local = local_device(d.path());
    let data = pattern(MIB, 9);
    local.write_at_durable(&data, MIB + 3 * MIB).unwrap();
    // The remote copy starts as junk: the zeroes must really be written there.
    let export = Arc::new(Counting(
        MemExport(
            std::sync::Mutex::new(vec![0xee; size as usize]),
            true,
            Default::default(),
        ),
        AtomicU64::new(0),
    ));
    let listen = spool_nbd::Listen::parse("127.0.0.1:0").unwrap();
    let srv = spool_nbd::Server::start(listen, export.clone()).unwrap();
    let uri = format!("nbd://{}/m", srv.listen);
    let remote =
        Arc::new(Device::open(std::path::Path::new(&uri), &OpenOptions::default()).unwrap());
    let mirror = local_and_remote(d.path(), local, remote, size);
    wait_current(&mirror);
    let mut want = vec![0u8; size as usize];
    want[(3 * MIB) as usize..(4 * MIB) as usize].copy_from_slice(&data);
    assert!(
        *export.0 .0.lock().unwrap() == want,
        "the remote copy differs"
    );
    assert_eq!(
        export.1.load(Ordering::Relaxed),
        MIB,
        "only the MiB of data crossed as data"
    );
    assert_eq!(mirror.progress().zeroed_bytes, size - MIB);
}
