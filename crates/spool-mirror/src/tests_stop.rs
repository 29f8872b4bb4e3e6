//! A dropped mirror's copy lands nowhere: once the mirror is stopped (its volume deleted,
//! its space about to be given back), a piece whose read was still waiting is not written.

use std::os::fd::RawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;

use super::tests::{file_device, leg_bytes, spec, three_devices, wait_until, MIB};
use super::*;
use spool_devices::DeviceIo;

/// A device whose queues hold every read until `open` is set (a source leg whose link
/// hangs), counting the reads held in `held`.
#[derive(Debug)]
struct Gated {
    dev: Arc<Device>,
    open: Arc<AtomicBool>,
    held: Arc<AtomicUsize>,
}

impl PoolDevice for Gated {
    fn path(&self) -> &Path {
        self.dev.path()
    }
    fn size(&self) -> u64 {
        self.dev.size()
    }
    fn info(&self) -> BackendInfo {
        self.dev.info()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.dev.read_at(buf, offset)
    }
    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.dev.write_at_durable(buf, offset)
    }
    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        self.dev.zero_range(offset, len)
    }
    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        Ok(Box::new(GatedQueue {
            inner: self.dev.open_queue(depth)?,
            open: self.open.clone(),
            held: self.held.clone(),
            waiting: Vec::new(),
        }))
    }
    fn probe(&self) -> Probe {
        Probe::Ok
    }
}

struct GatedQueue {
    inner: Box<dyn DeviceQueue>,
    open: Arc<AtomicBool>,
    held: Arc<AtomicUsize>,
    waiting: Vec<Held>,
}

/// A read held back, with its tag.
struct Held(DeviceIo, u64);

// SAFETY: the iovec a held read points at is the submitter's, valid until its completion is
// reaped (the submit contract) whichever thread the queue is on; nothing here touches it.
unsafe impl Send for Held {}

impl GatedQueue {
    fn pass_on(&mut self) {
        if self.open.load(Ordering::Acquire) {
            for Held(io, tag) in self.waiting.drain(..) {
                // SAFETY: the submitter's contract (buffers live until the completion is
                // reaped) still holds: nothing was completed for these tags yet.
                unsafe { self.inner.submit(io, tag) };
            }
        }
    }
}

impl DeviceQueue for GatedQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        match io {
            DeviceIo::Read { .. } if !self.open.load(Ordering::Acquire) => {
                self.held.fetch_add(1, Ordering::AcqRel);
                self.waiting.push(Held(io, tag));
            }
            // SAFETY: the caller's contract, passed on.
            io => unsafe { self.inner.submit(io, tag) },
        }
    }
    fn kick(&mut self) -> std::io::Result<()> {
        self.pass_on();
        self.inner.kick()
    }
    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        self.inner.reap(done)
    }
    fn completion_fd(&self) -> RawFd {
        self.inner.completion_fd()
    }
    fn ack_completion_event(&self) {
        self.inner.ack_completion_event()
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.waiting.len()
    }
}

/// The copy reads a piece from leg 0, whose reads hang; the mirror is stopped meanwhile (as
/// a volume delete does, which then frees the space) and gives up waiting after 5 s. The
/// read completing later must not be written to leg 1: that space may belong to another
/// volume by then.
#[test]
fn a_piece_read_before_the_mirror_stopped_is_not_written_after() {
    let d = tempfile::tempdir().unwrap();
    let a = file_device(d.path(), "a");
    a.write_at_durable(&[0x5a; 4096], MIB).unwrap();
    let (open, held) = (Arc::new(AtomicBool::new(false)), Arc::default());
    let gated = Gated {
        dev: a,
        open: open.clone(),
        held: Arc::clone(&held),
    };
    let devs = vec![
        Arc::new(Device::new(gated, &[])),
        file_device(d.path(), "b"),
    ];
    let m = Mirror::open(spec(d.path(), devs.clone(), false)).unwrap();
    wait_until("the copy's first read to hang", || {
        held.load(Ordering::Acquire) > 0
    });
    assert!(!m.stop_copying(), "the copy still waits for its read");
    open.store(true, Ordering::Release);
    wait_until("the copy thread to end", || {
        m.shared.stopped.load(Ordering::Acquire)
    });
    let b = leg_bytes(&devs[1], &[(MIB, 256 << 10)]);
    assert!(
        b.iter().all(|&x| x == 0),
        "a piece of the copy landed after the mirror stopped"
    );
}

/// A copy removed while the size stays (3 copies to 2): the new mirror shares the regions,
/// and the previous one's thread, which still knows the removed leg, ends: it would go on
/// copying to and from that leg after its space is given back. A change that keeps every
/// leg leaves it running.
#[test]
fn a_mirror_reopened_without_a_leg_ends_the_previous_ones_thread() {
    let d = tempfile::tempdir().unwrap();
    let devs = three_devices(d.path());
    let two = spec(d.path(), devs.clone(), true);
    let mut three = spec(d.path(), devs.clone(), true);
    let mut leg = three.legs[0].clone();
    (leg.slot, leg.id, leg.pieces[0].device) = (2, 12, 2);
    three.legs.push(leg);
    let m3 = Mirror::open(three.clone()).unwrap();
    let same = Mirror::open_after(three, Some(&m3)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(!m3.shared.stopped.load(Ordering::Acquire), "every leg kept");
    let m2 = Mirror::open_after(two, Some(&same)).unwrap();
    wait_until("the previous mirror's thread to end", || {
        same.shared.stopped.load(Ordering::Acquire)
    });
    assert!(Arc::ptr_eq(&same.shared.regions, &m2.shared.regions));
    assert!(!m2.shared.stopped.load(Ordering::Acquire));
}

/// Dropping a mirror returns only once its thread has let go of the legs: the caller may
/// then take the devices (a pool closing; the torture tester putting the devices back to
/// what a power cut leaves). The copy's read hangs while the mirror is dropped and comes
/// back 300 ms later; the drop has waited for it, and the piece was not written. Before,
/// the drop returned at once, and a copy finishing behind it once wrote a leg and marked it
/// current after the tester had rewritten the devices (torture seed 4).
#[test]
fn dropping_a_mirror_returns_once_its_thread_let_go_of_the_legs() {
    let d = tempfile::tempdir().unwrap();
    let a = file_device(d.path(), "a");
    a.write_at_durable(&[0x5a; 4096], MIB).unwrap();
    let (open, held) = (Arc::new(AtomicBool::new(false)), Arc::default());
    let gated = Gated {
        dev: a,
        open: open.clone(),
        held: Arc::clone(&held),
    };
    let devs = vec![
        Arc::new(Device::new(gated, &[])),
        file_device(d.path(), "b"),
    ];
    let m = Mirror::open(spec(d.path(), devs.clone(), false)).unwrap();
    wait_until("the copy's first read to hang", || {
        held.load(Ordering::Acquire) > 0
    });
    let stopped = m.shared.stopped.clone();
    let opener = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        open.store(true, Ordering::Release);
    });
    drop(m);
    assert!(
        stopped.load(Ordering::Acquire),
        "the drop returned while the copy thread still held the legs"
    );
    opener.join().unwrap();
    let b = leg_bytes(&devs[1], &[(MIB, 256 << 10)]);
    assert!(b.iter().all(|&x| x == 0), "a piece landed after the drop");
}
