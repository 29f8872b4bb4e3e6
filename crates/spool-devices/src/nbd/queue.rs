//! `NbdQueue`: one worker's queue on an NBD export, over a connection of its own. `submit`
//! frames each request (a write's data copied out of the caller's buffers at once), `kick`
//! hands the batch to the connection's writer thread, and a reader thread matches each
//! reply to its request by cookie, copies a read's data into the caller's buffers and
//! queues the completion; the worker reaps them, woken by an eventfd while it sleeps.
//!
//! A request larger than the server takes is split; it completes when its last part does,
//! with the first error any part had. A connection that breaks fails everything in flight
//! and everything after with `ENOTCONN` (a path error: the health monitor decides). A
//! server that never answers holds requests until the worker gives them up
//! ([`DeviceQueue::abandon`]): nothing touches the caller's memory after that, since reads
//! copy only under the operation's lock while it is still in flight.
//!
//! Owns: framing requests, matching replies, splitting, giving up. Must not know: health,
//! pools, what the requests are for.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use spool_nbd::client::{
    self, Connection, Stream, CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES,
};

use crate::completions::Completions;
use crate::queue::{DeviceIo, DeviceQueue};

/// The largest trim or write-zeroes range sent in one request.
const MAX_RANGE: u64 = 1 << 30;
/// How long the writer may wait for the server to take data before the connection is
/// treated as broken.
const WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// What write-zeroes sent as data writes from (a server without `NBD_CMD_WRITE_ZEROES`).
static ZEROES: [u8; 64 << 10] = [0u8; 64 << 10];

/// What the writer thread sends: bytes framed at submit, or a run of zeroes (a write's
/// payload for write-zeroes), written from [`ZEROES`] without being held in memory.
enum Out {
    Bytes(Vec<u8>),
    Zeroes(u64),
}

/// Where an operation is: with the server, completed, or given up by the queue.
#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    InFlight,
    Done,
    Abandoned,
}

/// One request of the worker's, in one or more parts on the wire.
struct Op {
    tag: u64,
    /// What it reports on success: the bytes read or written, else 0.
    bytes: i32,
    parts: AtomicU32,
    /// The first error a part had (a negative errno), 0 while none.
    error: AtomicI32,
    state: Mutex<State>,
    /// A read's destination: the caller's buffers (alive while the op is in flight).
    guest: Vec<(usize, usize)>,
}

// SAFETY: `guest` holds addresses of the caller's memory, written only by the reader thread
// under `state`'s lock while the operation is in flight (when the caller guarantees the
// memory is alive, the `submit` contract).
unsafe impl Send for Op {}
// SAFETY: as above.
unsafe impl Sync for Op {}

/// One request on the wire: its op, and for a read where its data goes in the op's buffers.
struct Part {
    op: Arc<Op>,
    read_at: Option<(usize, usize)>,
}

/// What the worker, the reader and the writer share.
pub(crate) struct Shared {
    completions: Completions,
    pending: Mutex<HashMap<u64, Part>>,
    dead: AtomicBool,
    /// A handle on the connection, for [`Shared::cut`].
    socket: Stream,
}

impl Shared {
    /// Cuts the connection (the device was aborted: its leg is given up for good): the
    /// reader sees it end and fails what is in flight with `ENOTCONN`, so a caller waiting
    /// on a request a server never answers returns.
    pub(crate) fn cut(&self) {
        self.socket.shutdown();
    }

    fn complete(&self, tag: u64, res: i32) {
        self.completions.push(tag, res);
    }

    /// One part answered (`err`: 0 or a negative errno); the op completes with its last part.
    fn part_done(&self, op: &Op, err: i32) {
        if err != 0 {
            let _ = op
                .error
                .compare_exchange(0, err, Ordering::SeqCst, Ordering::SeqCst);
        }
        if op.parts.fetch_sub(1, Ordering::SeqCst) != 1 {
            return;
        }
        let mut state = op.state.lock().unwrap_or_else(|e| e.into_inner());
        if *state != State::InFlight {
            return;
        }
        *state = State::Done;
        drop(state);
        let e = op.error.load(Ordering::SeqCst);
        self.complete(op.tag, if e != 0 { e } else { op.bytes });
    }

    /// The connection is gone: every op still in flight fails with ENOTCONN. `dead` is set
    /// under the pending lock, so no part is added after the drain.
    fn fail_all(&self) {
        let parts: Vec<Part> = {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            self.dead.store(true, Ordering::SeqCst);
            pending.drain().map(|(_, p)| p).collect()
        };
        for p in parts {
            let mut state = p.op.state.lock().unwrap_or_else(|e| e.into_inner());
            if *state == State::InFlight {
                *state = State::Done;
                drop(state);
                self.complete(p.op.tag, -libc::ENOTCONN);
            }
        }
    }
}

/// A queue on an NBD export for one worker.
pub struct NbdQueue {
    shared: Arc<Shared>,
    out: Option<mpsc::Sender<Vec<Out>>>,
    batch: Vec<Out>,
    /// Queues open on the device (one connection each), this one included.
    open: Arc<AtomicUsize>,
    size: u64,
    flags: (bool, bool, bool, bool),
    max_io: u64,
    next_cookie: u64,
    in_flight: usize,
    stream: Stream,
    /// Ops submitted and not yet reaped (for `abandon`).
    live: Vec<Arc<Op>>,
    reader: Option<std::thread::JoinHandle<()>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl NbdQueue {
    /// A queue over `conn`, counted in `open` and listed in `live` (for an abort).
    pub(crate) fn new(
        conn: Connection,
        open: Arc<AtomicUsize>,
        live: &Mutex<Vec<std::sync::Weak<Shared>>>,
    ) -> std::io::Result<Self> {
        conn.stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
        let shared = Arc::new(Shared {
            completions: Completions::new()?,
            pending: Mutex::new(HashMap::new()),
            dead: AtomicBool::new(false),
            socket: conn.stream.try_clone()?,
        });
        let mut queues = live.lock().unwrap_or_else(|e| e.into_inner());
        queues.retain(|q| q.strong_count() > 0);
        queues.push(Arc::downgrade(&shared));
        drop(queues);
        let (tx, rx) = mpsc::channel::<Vec<Out>>();
        let mut w = conn.stream.try_clone()?;
        let r = conn.stream.try_clone()?;
        let writer = std::thread::Builder::new()
            .name("spool-nbd-send".into())
            .spawn(move || {
                for batch in rx {
                    if send(&mut w, batch).is_err() {
                        // The reader sees the connection end and fails what is in flight.
                        w.shutdown();
                        return;
                    }
                }
                let _ = client::disconnect(&mut w);
            })?;
        let s = shared.clone();
        let reader = std::thread::Builder::new()
            .name("spool-nbd-recv".into())
            .spawn(move || receive(r, &s))?;
        open.fetch_add(1, Ordering::SeqCst);
        Ok(NbdQueue {
            shared,
            out: Some(tx),
            batch: Vec::new(),
            open,
            size: conn.size,
            flags: (
                conn.read_only(),
                conn.can_flush(),
                conn.can_trim(),
                conn.can_write_zeroes(),
            ),
            max_io: conn.max_io as u64,
            next_cookie: 1,
            in_flight: 0,
            stream: conn.stream,
            live: Vec::with_capacity(256),
            reader: Some(reader),
            writer: Some(writer),
        })
    }

    /// Frames one part's header (a write's data follows it); false when the connection is
    /// gone (the part failed at once).
    fn part(
        &mut self,
        op: &Arc<Op>,
        kind: u16,
        offset: u64,
        len: u64,
        read_at: Option<usize>,
    ) -> bool {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let part = Part {
            op: op.clone(),
            read_at: read_at.map(|at| (at, len as usize)),
        };
        {
            let mut pending = self
                .shared
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if self.shared.dead.load(Ordering::SeqCst) {
                drop(pending);
                self.shared.part_done(op, -libc::ENOTCONN);
                return false;
            }
            pending.insert(cookie, part);
        }
        let header = client::request(kind, cookie, offset, len as u32);
        self.bytes(header.len()).copy_from_slice(&header);
        true
    }

    /// `n` more bytes at the end of the batch, to fill.
    fn bytes(&mut self, n: usize) -> &mut [u8] {
        if !matches!(self.batch.last(), Some(Out::Bytes(_))) {
            self.batch.push(Out::Bytes(Vec::new()));
        }
        let Some(Out::Bytes(b)) = self.batch.last_mut() else {
            unreachable!("pushed above");
        };
        let from = b.len();
        b.resize(from + n, 0);
        &mut b[from..]
    }

    /// The result of a request that goes nowhere: refused (the connection is gone, out of
    /// range, a write to a read-only export), or done at once (nothing to do: no bytes, a
    /// flush or trim the server does not take).
    fn answered_here(&self, io: DeviceIo) -> Option<i32> {
        let (read_only, flush, trim, _) = self.flags;
        let range = match io {
            DeviceIo::Read { offset, len, .. }
            | DeviceIo::Write { offset, len, .. }
            | DeviceIo::Discard { offset, len }
            | DeviceIo::WriteZeroes { offset, len } => Some((offset, len)),
            DeviceIo::Flush => None,
        };
        let refused = match io {
            _ if self.shared.dead.load(Ordering::SeqCst) => Some(-libc::ENOTCONN),
            _ if range.is_some_and(|(o, l)| o.checked_add(l).is_none_or(|e| e > self.size)) => {
                Some(-libc::EINVAL)
            }
            DeviceIo::Read { .. } | DeviceIo::Flush => None,
            _ if read_only => Some(-libc::EROFS),
            _ => None,
        };
        let nothing = range.is_some_and(|(_, l)| l == 0)
            || match io {
                DeviceIo::Flush => !flush,
                DeviceIo::Discard { .. } => !trim,
                _ => false,
            };
        refused.or(nothing.then_some(0))
    }

    /// Splits `[offset, offset + len)` into parts of at most `max` bytes.
    fn split(offset: u64, len: u64, max: u64) -> Vec<(u64, u64)> {
        let mut v = Vec::new();
        let mut at = 0;
        while at < len {
            let n = (len - at).min(max);
            v.push((offset + at, n));
            at += n;
        }
        v
    }
}

/// One batch onto the connection.
fn send(w: &mut Stream, batch: Vec<Out>) -> std::io::Result<()> {
    for o in batch {
        match o {
            Out::Bytes(b) => w.write_all(&b)?,
            Out::Zeroes(mut n) => {
                while n > 0 {
                    let k = n.min(ZEROES.len() as u64) as usize;
                    w.write_all(&ZEROES[..k])?;
                    n -= k as u64;
                }
            }
        }
    }
    Ok(())
}

/// The reader thread: replies until the connection ends.
fn receive(mut r: Stream, s: &Shared) {
    let mut buf = Vec::new();
    while let Ok((cookie, err)) = client::read_reply(&mut r) {
        let Some(part) = s
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&cookie)
        else {
            tracing::warn!(
                cookie,
                "an NBD server answered a request never sent: disconnecting"
            );
            break;
        };
        // A server shutting down (ESHUTDOWN) is a path that may come back, not a device
        // that is gone.
        let mut e = match err {
            108 => -libc::ENOTCONN,
            n => -(n.min(i32::MAX as u32) as i32),
        };
        if let (Some((at, len)), 0) = (part.read_at, err) {
            buf.resize(len, 0);
            if r.read_exact(&mut buf).is_err() {
                s.part_done(&part.op, -libc::ENOTCONN);
                break;
            }
            let state = part.op.state.lock().unwrap_or_else(|e| e.into_inner());
            if *state == State::InFlight {
                // SAFETY: the op is in flight (checked under the lock `abandon` takes), so
                // the caller's buffers are alive and ours to fill until it is reaped.
                unsafe { copy_into(&part.op.guest, at, &buf) };
            }
        } else if err != 0 && e == 0 {
            e = -libc::EIO;
        }
        s.part_done(&part.op, e);
    }
    r.shutdown();
    s.fail_all();
}

/// Copies `data` into the buffers `guest` describe, from byte `at` of them on.
///
/// # Safety
/// The buffers must be alive and writable.
unsafe fn copy_into(guest: &[(usize, usize)], mut at: usize, mut data: &[u8]) {
    for &(addr, len) in guest {
        if data.is_empty() {
            return;
        }
        if at >= len {
            at -= len;
            continue;
        }
        let k = (len - at).min(data.len());
        // SAFETY: `addr + at .. + k` lies inside this buffer (the caller's guarantee).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (addr + at) as *mut u8, k) };
        data = &data[k..];
        at = 0;
    }
}

/// The iovecs of a read or write as (address, length) pairs.
///
/// # Safety
/// `iov` must point to `iovcnt` iovecs.
unsafe fn iovecs(iov: *const libc::iovec, iovcnt: u32) -> Vec<(usize, usize)> {
    (0..iovcnt as usize)
        .map(|i| {
            // SAFETY: `iov` points to `iovcnt` entries (the caller's guarantee).
            let v = unsafe { &*iov.add(i) };
            (v.iov_base as usize, v.iov_len)
        })
        .collect()
}

impl DeviceQueue for NbdQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        self.in_flight += 1;
        if let Some(res) = self.answered_here(io) {
            self.shared.complete(tag, res);
            return;
        }
        let (_, _, _, zeroes) = self.flags;
        // SAFETY: the caller's `submit` contract: iovecs valid until reaped.
        let guest = match io {
            DeviceIo::Read { iov, iovcnt, .. } | DeviceIo::Write { iov, iovcnt, .. } => unsafe {
                iovecs(iov, iovcnt)
            },
            _ => Vec::new(),
        };
        let (kind, offset, len, max) = match io {
            DeviceIo::Read { offset, len, .. } => (CMD_READ, offset, len, self.max_io),
            DeviceIo::Write { offset, len, .. } => (CMD_WRITE, offset, len, self.max_io),
            DeviceIo::Flush => (CMD_FLUSH, 0, 0, 1),
            DeviceIo::Discard { offset, len } => (CMD_TRIM, offset, len, MAX_RANGE),
            DeviceIo::WriteZeroes { offset, len } if zeroes => {
                (CMD_WRITE_ZEROES, offset, len, MAX_RANGE)
            }
            // No write-zeroes at the server: zeroes written as data.
            DeviceIo::WriteZeroes { offset, len } => (CMD_WRITE, offset, len, self.max_io),
        };
        let parts = if kind == CMD_FLUSH {
            vec![(0, 0)]
        } else {
            Self::split(offset, len, max)
        };
        let data = matches!(io, DeviceIo::Read { .. } | DeviceIo::Write { .. });
        let op = Arc::new(Op {
            tag,
            bytes: if data {
                len.min(i32::MAX as u64) as i32
            } else {
                0
            },
            parts: AtomicU32::new(parts.len() as u32),
            error: AtomicI32::new(0),
            state: Mutex::new(State::InFlight),
            guest,
        });
        for (o, l) in parts {
            let at = (o - offset) as usize;
            let read_at = (kind == CMD_READ).then_some(at);
            if !self.part(&op, kind, o, l, read_at) || kind != CMD_WRITE {
                continue;
            }
            match io {
                DeviceIo::Write { .. } => {
                    let to = self.bytes(l as usize);
                    // SAFETY: the caller's buffers are alive until reaped; only read here.
                    unsafe { copy_from(&op.guest, at, to) };
                }
                _ => self.batch.push(Out::Zeroes(l)),
            }
        }
        self.live.push(op);
    }

    fn kick(&mut self) -> std::io::Result<()> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let b = std::mem::take(&mut self.batch);
        if self.out.as_ref().is_none_or(|o| o.send(b).is_err()) {
            self.stream.shutdown();
        }
        Ok(())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        let mut got = Vec::new();
        self.shared.completions.take_into(&mut got);
        let n = got.len();
        for (tag, res) in got {
            done(tag, res);
        }
        self.in_flight -= n.min(self.in_flight);
        if n > 0 {
            self.live
                .retain(|o| *o.state.lock().unwrap_or_else(|e| e.into_inner()) == State::InFlight);
        }
        n
    }

    fn completion_fd(&self) -> RawFd {
        self.shared.completions.fd()
    }

    fn ack_completion_event(&self) {
        self.shared.completions.ack();
    }

    fn set_completion_events(&mut self, enabled: bool) {
        self.shared.completions.set_notify(enabled);
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// A request on the network cannot be taken back, so `abort` (a reset, a health epoch)
    /// leaves it to complete; a device declared failed gives it up here: it completes with
    /// -ECANCELED now and its reply, whenever it comes, touches nothing of the caller's.
    fn abandon(&mut self) -> usize {
        let mut n = 0;
        for op in self.live.drain(..) {
            let mut state = op.state.lock().unwrap_or_else(|e| e.into_inner());
            if *state == State::InFlight {
                *state = State::Abandoned;
                drop(state);
                self.shared.complete(op.tag, -libc::ECANCELED);
                n += 1;
            }
        }
        if n > 0 {
            tracing::warn!(
                operations = n,
                "gave up NBD requests the server never answered"
            );
        }
        n
    }
}

/// Copies from the buffers `guest` describe, from byte `at` of them on, into `out`.
///
/// # Safety
/// The buffers must be alive and readable.
unsafe fn copy_from(guest: &[(usize, usize)], mut at: usize, mut out: &mut [u8]) {
    for &(addr, len) in guest {
        if out.is_empty() {
            return;
        }
        if at >= len {
            at -= len;
            continue;
        }
        let k = (len - at).min(out.len());
        // SAFETY: `addr + at .. + k` lies inside this buffer (the caller's guarantee).
        unsafe { std::ptr::copy_nonoverlapping((addr + at) as *const u8, out.as_mut_ptr(), k) };
        out = &mut out[k..];
        at = 0;
    }
}

impl Drop for NbdQueue {
    /// Leaves politely when the server answers: the writer sends `NBD_CMD_DISC` once its
    /// channel closes, the server then closes the connection and the reader ends. A server
    /// that does not within a second is cut off.
    fn drop(&mut self) {
        self.out = None;
        self.abandon();
        self.open.fetch_sub(1, Ordering::SeqCst);
        let t0 = std::time::Instant::now();
        let ended =
            |t: &Option<std::thread::JoinHandle<()>>| t.as_ref().is_none_or(|t| t.is_finished());
        while !(ended(&self.writer) && ended(&self.reader))
            && t0.elapsed() < std::time::Duration::from_secs(1)
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Whatever still blocks on the socket returns now.
        self.stream.shutdown();
        for t in [self.writer.take(), self.reader.take()]
            .into_iter()
            .flatten()
        {
            let _ = t.join();
        }
    }
}
