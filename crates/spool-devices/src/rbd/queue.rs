//! `RbdQueue`: one worker's queue on an RBD image. Each request is a librbd aio call with a
//! completion whose callback (on a librbd thread) appends `(tag, result)` to the queue's
//! shared list and, when the worker sleeps, signals its eventfd; the worker reaps the list.
//! librbd dispatches on submit, so `kick` has nothing to do.
//!
//! librbd cannot take an operation back, and a cluster that is gone holds it for ever. So
//! that a device declared failed can still fail its requests to the guest cleanly
//! ([`DeviceQueue::abandon`]), no operation touches guest memory after it was given up: reads
//! land in a buffer of the operation's own and are copied into the guest's buffers by the
//! callback, under the operation's lock, only if it was not given up; writes are copied by
//! librbd when submitted (`rbd_disable_zero_copy_writes`, set at connect).
//!
//! Owns: submission, the completion callback, reaping, giving up, the timed probe read.
//! Must not know: health, pools, what the requests are for.

use std::ffi::{c_int, c_void};
use std::os::fd::RawFd;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use super::{ffi, Image};
use crate::completions::Completions;
use crate::queue::{DeviceIo, DeviceQueue};

/// Where an operation is: with librbd, completed, or given up by the queue.
#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    InFlight,
    Done,
    Abandoned,
}

/// What the queue and an operation's callback share: its state, and for a read the guest's
/// buffers to copy into (valid while the operation is in flight: the `submit` contract).
struct Ctl {
    tag: u64,
    state: Mutex<State>,
    guest: Vec<(usize, usize)>,
}

// SAFETY: `guest` holds addresses of guest memory, written only under `state`'s lock while
// the operation is in flight (when the submitter guarantees the memory is alive).
unsafe impl Send for Ctl {}
// SAFETY: as above.
unsafe impl Sync for Ctl {}

/// One request's context, owned by its completion until the callback runs.
struct Op {
    shared: Arc<Completions>,
    ctl: Arc<Ctl>,
    /// Reads report the bytes read, as the file backends do; everything else 0.
    read: bool,
    /// A read's own buffer (librbd reads into it), and the iovec that describes it.
    bounce: Vec<u8>,
    iov: libc::iovec,
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
    let mut state = op.ctl.state.lock().unwrap_or_else(|e| e.into_inner());
    if *state == State::Abandoned {
        // Given up: the request was completed without us, its guest memory may be gone.
        return;
    }
    if op.read && r > 0 {
        let mut from = 0usize;
        let n = (r as usize).min(op.bounce.len());
        for &(addr, len) in &op.ctl.guest {
            if from >= n {
                break;
            }
            let k = len.min(n - from);
            // SAFETY: the operation is in flight (not abandoned, checked under the lock the
            // queue takes to abandon it), so its guest buffers are alive and ours to fill
            // until the worker reaps it; `from + k <= bounce.len()`.
            unsafe {
                std::ptr::copy_nonoverlapping(op.bounce.as_ptr().add(from), addr as *mut u8, k)
            };
            from += k;
        }
    }
    *state = State::Done;
    drop(state);
    op.shared.push(op.ctl.tag, res);
}

/// A queue on an RBD image for one worker.
pub struct RbdQueue {
    image: Arc<Image>,
    shared: Arc<Completions>,
    /// Completions reaped from `shared` and not yet handed out, and submissions librbd
    /// refused (they complete with its error).
    local: Vec<(u64, i32)>,
    in_flight: usize,
    /// Operations submitted and not yet reaped (for `abandon`).
    live: Vec<Arc<Ctl>>,
}

impl RbdQueue {
    pub(crate) fn new(image: Arc<Image>) -> std::io::Result<Self> {
        Ok(RbdQueue {
            image,
            shared: Arc::new(Completions::new()?),
            local: Vec::with_capacity(256),
            in_flight: 0,
            live: Vec::with_capacity(256),
        })
    }
}

impl DeviceQueue for RbdQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        let mut guest = Vec::new();
        if let DeviceIo::Read { iov, iovcnt, .. } = io {
            for i in 0..iovcnt as usize {
                // SAFETY: `iov` points to `iovcnt` entries (the `submit` contract).
                let v = unsafe { &*iov.add(i) };
                guest.push((v.iov_base as usize, v.iov_len));
            }
        }
        let ctl = Arc::new(Ctl {
            tag,
            state: Mutex::new(State::InFlight),
            guest,
        });
        let len: usize = ctl.guest.iter().map(|g| g.1).sum();
        let mut op = Box::new(Op {
            shared: self.shared.clone(),
            ctl: ctl.clone(),
            read: matches!(io, DeviceIo::Read { .. }),
            bounce: vec![0u8; len],
            iov: libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: len,
            },
        });
        op.iov.iov_base = op.bounce.as_mut_ptr().cast();
        // The box's heap contents do not move when it is leaked.
        let bounce_iov: *const libc::iovec = &op.iov;
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
                    DeviceIo::Read { offset, .. } => {
                        (ffi::loaded().rbd_aio_readv)(img, bounce_iov, 1, offset, c)
                    }
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
        } else {
            self.live.push(ctl);
        }
        self.in_flight += 1;
    }

    fn kick(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        if !self.shared.take_into(&mut self.local) && self.local.is_empty() {
            return 0;
        }
        let n = self.local.len();
        for (tag, res) in self.local.drain(..) {
            done(tag, res);
        }
        self.in_flight -= n.min(self.in_flight);
        self.live
            .retain(|c| *c.state.lock().unwrap_or_else(|e| e.into_inner()) == State::InFlight);
        n
    }

    fn completion_fd(&self) -> RawFd {
        self.shared.fd()
    }

    fn ack_completion_event(&self) {
        self.shared.ack();
    }

    fn set_completion_events(&mut self, enabled: bool) {
        self.shared.set_notify(enabled);
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Gives up every operation librbd still holds: each completes with -ECANCELED on the
    /// next reap, and its callback, whenever it comes, touches nothing of the guest's.
    fn abandon(&mut self) -> usize {
        let mut n = 0;
        for c in self.live.drain(..) {
            let mut state = c.state.lock().unwrap_or_else(|e| e.into_inner());
            if *state == State::InFlight {
                *state = State::Abandoned;
                self.local.push((c.tag, -libc::ECANCELED));
                n += 1;
            }
        }
        if n > 0 {
            tracing::warn!(
                operations = n,
                "gave up RBD operations the cluster never completed"
            );
        }
        n
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
