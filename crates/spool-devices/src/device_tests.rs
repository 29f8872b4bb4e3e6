//! The wrapper on a backend it has never seen: a tiny in-memory backend proves that health,
//! fault injection and probe/SMART stacking work on any `PoolDevice`, and that a `Device`
//! stacks on a `Device`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::*;
use crate::{
    DeviceIo, Error, FaultEffect, FaultOps, FaultRule, HealthState, IoVec, NullQueue, Result,
};

/// A backend kept in memory, counting the operations its queues receive.
#[derive(Debug)]
struct MemBackend {
    path: PathBuf,
    data: Mutex<Vec<u8>>,
    submitted: Arc<AtomicUsize>,
    smart: u8,
    presence: Option<Probe>,
}

impl MemBackend {
    fn new(size: usize) -> Self {
        MemBackend {
            path: PathBuf::from("mem:test"),
            data: Mutex::new(vec![0; size]),
            submitted: Arc::default(),
            smart: 0,
            presence: None,
        }
    }
}

/// A queue that counts submissions and completes them at once (through a null queue).
struct CountingQueue {
    inner: NullQueue,
    submitted: Arc<AtomicUsize>,
}

impl DeviceQueue for CountingQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        self.submitted.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's guarantee is passed on unchanged.
        unsafe { self.inner.submit(io, tag) }
    }
    fn kick(&mut self) -> std::io::Result<()> {
        self.inner.kick()
    }
    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        self.inner.reap(done)
    }
    fn completion_fd(&self) -> std::os::fd::RawFd {
        self.inner.completion_fd()
    }
    fn ack_completion_event(&self) {}
    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
}

impl PoolDevice for MemBackend {
    fn path(&self) -> &Path {
        &self.path
    }
    fn size(&self) -> u64 {
        self.data.lock().unwrap().len() as u64
    }
    fn info(&self) -> BackendInfo {
        BackendInfo {
            backend: "mem",
            direct_align: None,
            inline_io: true,
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let d = self.data.lock().unwrap();
        let at = offset as usize;
        let src = d.get(at..at + buf.len()).ok_or(Error::Invalid {
            path: "mem".into(),
            msg: "beyond the end".into(),
        })?;
        buf.copy_from_slice(src);
        Ok(())
    }
    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        let at = offset as usize;
        self.data.lock().unwrap()[at..at + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        self.write_at_durable(&vec![0; len as usize], offset)
    }
    fn open_queue(&self, _depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        Ok(Box::new(CountingQueue {
            inner: NullQueue::new(NullReads::Untouched)?,
            submitted: self.submitted.clone(),
        }))
    }
    fn probe(&self) -> Probe {
        Probe::Ok
    }
    fn presence(&self) -> Option<Probe> {
        self.presence.clone()
    }
    fn smart_warning(&self) -> u8 {
        self.smart
    }
}

fn rule(effect: FaultEffect, ops: FaultOps) -> FaultRule {
    FaultRule {
        effect,
        ops,
        offset: 0,
        len: 0,
        count: None,
        duration: None,
        fails_probe: false,
    }
}

/// Submits one write and one read of 512 bytes; returns their results by tag (1 = write).
fn write_then_read(q: &mut dyn DeviceQueue) -> Vec<(u64, i32)> {
    let mut buf = [0u8; 512];
    let iov = [IoVec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    let rw = |write: bool| DeviceIo::data(write, 0, 512, iov.as_ptr(), 1);
    // SAFETY: `buf` and `iov` outlive the reap below, which completes both.
    unsafe {
        q.submit(rw(true), 1);
        q.submit(rw(false), 2);
    }
    q.kick().unwrap();
    let mut got = Vec::new();
    q.reap(&mut |t, r| got.push((t, r)));
    got.sort();
    got
}

#[test]
fn faults_and_health_stack_on_any_backend() {
    let mem = MemBackend::new(1 << 16);
    let submitted = mem.submitted.clone();
    let dev = Device::new(mem, &[]);
    assert_eq!(dev.health().load(), (HealthState::Healthy, 0));
    assert_eq!(dev.info().backend, "mem");
    assert!(dev.inline_io() && dev.direct_align().is_none());
    dev.write_at_durable(b"meta", 100).unwrap();
    let mut b = [0u8; 4];
    dev.read_at(&mut b, 100).unwrap();
    assert_eq!(&b, b"meta");

    let mut q = dev.open_queue(8).unwrap();
    assert_eq!(write_then_read(&mut *q), vec![(1, 512), (2, 512)]);
    assert_eq!(submitted.load(Ordering::Relaxed), 2);

    // A write fault armed after the queue opened still applies to it, and the failed write
    // never reaches the backend.
    dev.faults()
        .add(rule(FaultEffect::Errno(libc::EIO), FaultOps::Write));
    assert_eq!(write_then_read(&mut *q), vec![(1, -libc::EIO), (2, 512)]);
    assert_eq!(
        submitted.load(Ordering::Relaxed),
        3,
        "only the read got through"
    );
    assert_eq!(dev.faults().injected(), 1);
}

#[test]
fn probes_and_smart_warnings_combine_injected_and_backend() {
    let dev = Device::new(
        MemBackend {
            smart: 0b100,
            ..MemBackend::new(4096)
        },
        &[],
    );
    assert_eq!(dev.probe(), Probe::Ok);
    assert_eq!(dev.smart_warning(), 0b100);
    dev.faults().set_smart_warning(0b1);
    assert_eq!(dev.smart_warning(), 0b101, "both, when both are set");

    dev.faults().add(FaultRule {
        fails_probe: true,
        ..rule(FaultEffect::Errno(libc::ENODEV), FaultOps::Read)
    });
    assert!(matches!(dev.probe(), Probe::Gone(why) if why.starts_with("injected")));
    // Without a presence check of its own, presence is the (injected) probe.
    assert!(matches!(dev.presence(), Probe::Gone(_)));
    dev.faults().clear();
    dev.faults().add(FaultRule {
        fails_probe: true,
        ..rule(FaultEffect::Errno(libc::EIO), FaultOps::Read)
    });
    assert_eq!(dev.probe(), Probe::Failed(libc::EIO));

    // A backend with its own presence check answers from it (as NVMe does from registers).
    let nvme_like = Device::new(
        MemBackend {
            presence: Some(Probe::Ok),
            ..MemBackend::new(4096)
        },
        &[FaultRule {
            fails_probe: true,
            ..rule(FaultEffect::Errno(libc::EIO), FaultOps::Read)
        }],
    );
    assert_eq!(nvme_like.presence(), Probe::Ok);
    assert_eq!(nvme_like.probe(), Probe::Failed(libc::EIO));
    assert!(nvme_like.reset_controller().is_none() && nvme_like.controller_status().is_none());
}

#[test]
fn devices_stack_on_devices() {
    let mem = MemBackend::new(1 << 16);
    let submitted = mem.submitted.clone();
    let inner = Device::new(
        mem,
        &[rule(FaultEffect::Errno(libc::ENOSPC), FaultOps::Read)],
    );
    let inner_faults = inner.faults().clone();
    let inner_health = inner.health().clone();
    // Object safe: the stacked device is held as any other backend.
    let boxed: Box<dyn PoolDevice> = Box::new(inner);
    let outer = Device::from_box(boxed, &[]);
    assert_eq!(outer.path(), Path::new("mem:test"));
    assert_eq!(outer.size(), 1 << 16);

    let mut q = outer.open_queue(8).unwrap();
    assert_eq!(
        write_then_read(&mut *q),
        vec![(1, 512), (2, -libc::ENOSPC)],
        "the inner device's rule applies under the outer one"
    );
    assert_eq!(submitted.load(Ordering::Relaxed), 1);
    assert_eq!(inner_faults.injected(), 1);
    assert_eq!(outer.faults().injected(), 0);

    // Each layer has its own health cell.
    inner_health.set(HealthState::Failed);
    assert_eq!(outer.health().state(), HealthState::Healthy);
    assert_eq!(
        outer.backend().presence(),
        Some(Probe::Ok),
        "a Device answers presence for what it wraps"
    );
}

/// Metadata rules reach the device's synchronous I/O, by kind and range, and leave queue
/// I/O alone; queue rules leave metadata alone.
#[test]
fn metadata_faults_reach_synchronous_io_by_kind() {
    let dev = Device::new(MemBackend::new(1 << 16), &[]);
    let meta = |ops, offset, len, count| FaultRule {
        effect: FaultEffect::Errno(libc::EIO),
        ops,
        offset,
        len,
        count,
        duration: None,
        fails_probe: false,
    };
    let errno = |r: Result<()>| match r {
        Err(Error::Io { source, .. }) => source.raw_os_error(),
        Ok(()) => None,
        Err(e) => panic!("{e}"),
    };
    dev.faults()
        .add(meta(FaultOps::MetaWrite, 4096, 4096, Some(1)));
    let mut b = [0u8; 512];
    // Outside the range, and reads and zeroing: untouched.
    assert_eq!(errno(dev.write_at_durable(&b, 0)), None);
    assert_eq!(errno(dev.read_at(&mut b, 4096)), None);
    assert_eq!(errno(dev.zero_range(4096, 512)), None);
    assert_eq!(errno(dev.write_at_durable(&b, 4096 + 512)), Some(libc::EIO));
    assert_eq!(
        errno(dev.write_at_durable(&b, 4096)),
        None,
        "count 1: disarmed"
    );
    dev.faults().add(meta(FaultOps::Meta, 0, 0, Some(3)));
    assert_eq!(errno(dev.read_at(&mut b, 0)), Some(libc::EIO));
    assert_eq!(errno(dev.zero_range(0, 512)), Some(libc::EIO));
    // A queue rule is not a metadata rule, nor the other way round.
    let mut q = dev.open_queue(4).unwrap();
    let iov = [IoVec {
        iov_base: b.as_mut_ptr().cast(),
        iov_len: 512,
    }];
    // SAFETY: `b` and `iov` outlive the submission, reaped below.
    unsafe { q.submit(DeviceIo::data(true, 0, 512, iov.as_ptr(), 1), 1) };
    let mut got = None;
    while got.is_none() {
        q.reap(&mut |_, r| got = Some(r));
    }
    assert_eq!(got, Some(512), "a metadata rule failed queue I/O");
    assert_eq!(errno(dev.write_at_durable(&b, 0)), Some(libc::EIO));
    dev.faults().add(meta(FaultOps::Any, 0, 0, None));
    assert_eq!(
        errno(dev.write_at_durable(&b, 0)),
        None,
        "a queue rule failed metadata"
    );
    // Holding effects fail synchronous I/O with a timeout; a crash rule never matches it.
    dev.faults().clear();
    dev.faults().add(FaultRule {
        effect: FaultEffect::Hang,
        ..meta(FaultOps::MetaRead, 0, 0, Some(1))
    });
    assert_eq!(errno(dev.read_at(&mut b, 0)), Some(libc::ETIMEDOUT));
    dev.faults().add(FaultRule {
        effect: FaultEffect::Crash,
        ..meta(FaultOps::Meta, 0, 0, None)
    });
    assert_eq!(errno(dev.write_at_durable(&b, 0)), None);
}
