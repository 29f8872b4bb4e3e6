//! The copy's pieces of zeroes: written as write-zeroes where the leg device does it, as
//! data where it does not (an NVMe controller without the command, a file system without
//! fallocate), never failing the copy or counting against the device's health.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::Arc;

use super::tests::{file_device, legs_of, spec, wait_until, MIB};
use super::*;
use spool_devices::DeviceIo;

/// A device whose queues refuse write-zeroes with `EOPNOTSUPP`, as an NVMe controller
/// without the command does; everything else goes to the device under it.
#[derive(Debug)]
struct NoZeroes(Arc<Device>);

impl PoolDevice for NoZeroes {
    fn path(&self) -> &Path {
        self.0.path()
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn info(&self) -> BackendInfo {
        self.0.info()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.0.read_at(buf, offset)
    }
    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.0.write_at_durable(buf, offset)
    }
    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        self.0.zero_range(offset, len)
    }
    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        Ok(Box::new(NoZeroesQueue(
            self.0.open_queue(depth)?,
            VecDeque::new(),
        )))
    }
    fn probe(&self) -> Probe {
        Probe::Ok
    }
}

struct NoZeroesQueue(Box<dyn DeviceQueue>, VecDeque<u64>);

impl DeviceQueue for NoZeroesQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        match io {
            DeviceIo::WriteZeroes { .. } => self.1.push_back(tag),
            // SAFETY: the caller's contract, passed on.
            io => unsafe { self.0.submit(io, tag) },
        }
    }
    fn kick(&mut self) -> std::io::Result<()> {
        self.0.kick()
    }
    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        let refused = self.1.len();
        for tag in self.1.drain(..) {
            done(tag, -libc::EOPNOTSUPP);
        }
        refused + self.0.reap(done)
    }
    fn completion_fd(&self) -> RawFd {
        self.0.completion_fd()
    }
    fn ack_completion_event(&self) {
        self.0.ack_completion_event()
    }
    fn in_flight(&self) -> usize {
        self.0.in_flight() + self.1.len()
    }
}

/// Rebuilds leg 1 on `b` (junk first, where the copy must write zeroes) from leg 0, which
/// holds 4 KiB of data in a fresh volume; returns the mirror once the legs agree.
fn rebuild_onto(dir: &Path, b: Arc<Device>) -> Mirror {
    b.write_at_durable(&vec![0xee; 12 * MIB as usize], MIB)
        .unwrap();
    let devs = vec![file_device(dir, "a"), b];
    devs[0]
        .write_at_durable(&[7u8; 4096], MIB + 2 * MIB)
        .unwrap();
    let m = Mirror::open(spec(dir, devs.clone(), false)).unwrap();
    wait_until("leg 1 rebuilt", || m.leg_current(1));
    let (a, b_bytes) = legs_of(&devs);
    assert!(a == b_bytes, "legs differ");
    m
}

#[test]
fn a_leg_device_without_write_zeroes_gets_the_zeroes_as_data() {
    let d = tempfile::tempdir().unwrap();
    let b = Arc::new(Device::new(NoZeroes(file_device(d.path(), "b")), &[]));
    let m = rebuild_onto(d.path(), b.clone());
    assert_eq!(m.progress().zeroed_bytes, 0, "nothing went as write-zeroes");
    let (reports, _) = b.health().take_reports();
    assert!(
        reports.is_empty(),
        "refused write-zeroes reported: {reports:?}"
    );
    assert_eq!(b.health().state(), HealthState::Healthy);
}

#[test]
fn a_leg_device_with_write_zeroes_gets_the_zeroes_that_way() {
    let d = tempfile::tempdir().unwrap();
    let m = rebuild_onto(d.path(), file_device(d.path(), "b"));
    // Every 256 KiB piece but the one with data.
    assert_eq!(m.progress().zeroed_bytes, 8 * MIB - (256 << 10));
}
