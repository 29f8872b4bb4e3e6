//! `RbdQueue`: one worker's queue on an RBD image. Each request is a librbd aio call with a
//! completion whose callback (on a librbd thread) appends `(tag, result)` to the queue's
//! shared list and, when the worker sleeps, signals its eventfd; the worker reaps the list.
//! librbd dispatches on submit, so `kick` has nothing to do.
//!
//! Owns: submission, the completion callback, reaping, the timed probe read.
//! Must not know: health, pools, what the requests are for.

use std::ffi::{c_int, c_void};
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use super::{ffi, Image};
use crate::queue::{DeviceIo, DeviceQueue};

/// What completions and the worker share.
struct Shared {
    done: Mutex<Vec<(u64, i32)>>,
    /// The worker wants the eventfd signalled (it is about to sleep).
    notify: AtomicBool,
    event: File,
}

/// One request's context, owned by its completion until the callback runs.
struct Op {
    shared: Arc<Shared>,
    tag: u64,
    /// Reads report the bytes read, as the file backends do; everything else 0.
    read: bool,
}

/// The completion callback (a librbd thread).
extern "C" fn on_complete(c: ffi::rbd_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the `Box<Op>` leaked by `submit` for this completion, handed back
    // exactly once; `c` is that completion, released here and never used again.
    let op = unsafe { Box::from_raw(arg.cast::<Op>()) };
    // SAFETY: as above.
    let r = unsafe {
        let r = (ffi::loaded().rbd_aio_get_return_value)(c);
        (ffi::loaded().rbd_aio_release)(c);
        r
    };
    let res = match r {
        r if r < 0 => r.max(-(i32::MAX as isize)) as i32,
        r if op.read => r.min(i32::MAX as isize) as i32,
        _ => 0,
    };
    op.shared
        .done
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((op.tag, res));
    if op.shared.notify.load(Ordering::SeqCst) {
        let _ = (&op.shared.event).write(&1u64.to_ne_bytes());
    }
}

/// A queue on an RBD image for one worker.
pub struct RbdQueue {
    image: Arc<Image>,
    shared: Arc<Shared>,
    /// Completions reaped from `shared` and not yet handed out, and submissions librbd
    /// refused (they complete with its error).
    local: Vec<(u64, i32)>,
    in_flight: usize,
}

impl RbdQueue {
    pub(crate) fn new(image: Arc<Image>) -> std::io::Result<Self> {
        Ok(RbdQueue {
            image,
            shared: Arc::new(Shared {
                done: Mutex::new(Vec::with_capacity(256)),
                notify: AtomicBool::new(false),
                event: crate::queue::completion_eventfd()?,
            }),
            local: Vec::with_capacity(256),
            in_flight: 0,
        })
    }
}

impl DeviceQueue for RbdQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        let op = Box::new(Op {
            shared: self.shared.clone(),
            tag,
            read: matches!(io, DeviceIo::Read { .. }),
        });
        let arg = Box::into_raw(op).cast::<c_void>();
        let mut c: ffi::rbd_completion_t = std::ptr::null_mut();
        // SAFETY: `arg` is a leaked box the callback takes back; out-pointer to a local.
        let r = unsafe { (ffi::loaded().rbd_aio_create_completion)(arg, on_complete, &mut c) };
        let img = self.image.handle;
        let r = if r < 0 {
            r
        } else {
            // SAFETY: an open image and a fresh completion. Reads and writes: the iovec
            // array and buffers stay valid until the completion is reaped (the caller's
            // `submit` contract); librbd reads the array during the call and the buffers
            // until it completes.
            unsafe {
                match io {
                    DeviceIo::Read {
                        offset,
                        iov,
                        iovcnt,
                        ..
                    } => (ffi::loaded().rbd_aio_readv)(img, iov, iovcnt as c_int, offset, c),
                    DeviceIo::Write {
                        offset,
                        iov,
                        iovcnt,
                        ..
                    } => (ffi::loaded().rbd_aio_writev)(img, iov, iovcnt as c_int, offset, c),
                    DeviceIo::Flush => (ffi::loaded().rbd_aio_flush)(img, c),
                    DeviceIo::Discard { offset, len } => {
                        (ffi::loaded().rbd_aio_discard)(img, offset, len, c)
                    }
                    DeviceIo::WriteZeroes { offset, len } => {
                        (ffi::loaded().rbd_aio_write_zeroes)(img, offset, len as usize, c, 0, 0)
                    }
                }
            }
        };
        if r < 0 {
            if !c.is_null() {
                // SAFETY: the completion was never handed to librbd's I/O path.
                unsafe { (ffi::loaded().rbd_aio_release)(c) };
            }
            // SAFETY: the callback will not run for a refused request: the box is ours.
            drop(unsafe { Box::from_raw(arg.cast::<Op>()) });
            self.local.push((tag, r));
        }
        self.in_flight += 1;
    }

    fn kick(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        {
            let mut shared = self.shared.done.lock().unwrap_or_else(|e| e.into_inner());
            if shared.is_empty() && self.local.is_empty() {
                return 0;
            }
            self.local.append(&mut shared);
        }
        let n = self.local.len();
        for (tag, res) in self.local.drain(..) {
            done(tag, res);
        }
        self.in_flight -= n.min(self.in_flight);
        n
    }

    fn completion_fd(&self) -> RawFd {
        self.shared.event.as_raw_fd()
    }

    fn ack_completion_event(&self) {
        let mut b = [0u8; 8];
        // Non-blocking: an eventfd with nothing to read is WouldBlock, which is fine.
        let _ = std::io::Read::read(&mut &self.shared.event, &mut b);
    }

    /// The worker reaps after turning events on, so a completion that came in between is
    /// never left unsignalled.
    fn set_completion_events(&mut self, enabled: bool) {
        self.shared.notify.store(enabled, Ordering::SeqCst);
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

/// Reads `len` bytes at `offset` and waits at most `timeout`; Err(errno) on failure,
/// ETIMEDOUT when the cluster did not answer in time (the read stays with librbd, and its
/// buffer with the callback, until it completes).
pub(super) fn read_with_timeout(
    image: &Arc<Image>,
    offset: u64,
    len: usize,
    timeout: Duration,
) -> Result<(), i32> {
    struct Probe {
        buf: Vec<u8>,
        iov: libc::iovec,
        tx: mpsc::SyncSender<isize>,
    }
    extern "C" fn on_probe(c: ffi::rbd_completion_t, arg: *mut c_void) {
        // SAFETY: `arg` is the leaked `Box<Probe>` of this completion, handed back once.
        let p = unsafe { Box::from_raw(arg.cast::<Probe>()) };
        // SAFETY: this completion, released here and never used again.
        let r = unsafe {
            let r = (ffi::loaded().rbd_aio_get_return_value)(c);
            (ffi::loaded().rbd_aio_release)(c);
            r
        };
        let _ = p.tx.send(r);
    }
    let (tx, rx) = mpsc::sync_channel(1);
    let mut p = Box::new(Probe {
        buf: vec![0u8; len],
        iov: libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: len,
        },
        tx,
    });
    p.iov.iov_base = p.buf.as_mut_ptr().cast();
    let iov: *const libc::iovec = &p.iov;
    let arg = Box::into_raw(p).cast::<c_void>();
    let mut c: ffi::rbd_completion_t = std::ptr::null_mut();
    // SAFETY: the leaked box (its buffer and iovec live in the heap, not moved) stays alive
    // until the callback frees it; out-pointer to a local.
    let r = unsafe {
        let r = (ffi::loaded().rbd_aio_create_completion)(arg, on_probe, &mut c);
        if r < 0 {
            r
        } else {
            (ffi::loaded().rbd_aio_readv)(image.handle, iov, 1, offset, c)
        }
    };
    if r < 0 {
        if !c.is_null() {
            // SAFETY: never handed to librbd's I/O path.
            unsafe { (ffi::loaded().rbd_aio_release)(c) };
        }
        // SAFETY: the callback will not run: the box is ours again.
        drop(unsafe { Box::from_raw(arg.cast::<Probe>()) });
        return Err(-r);
    }
    match rx.recv_timeout(timeout) {
        Ok(r) if r >= 0 => Ok(()),
        Ok(r) => Err((-r) as i32),
        Err(_) => Err(libc::ETIMEDOUT),
    }
}
