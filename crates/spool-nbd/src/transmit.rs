//! The transmission phase: requests read in order and served [`IN_FLIGHT`] at a time, one
//! reply each (simple, or structured chunks when the client asked for them), sent as each
//! finishes: clients match replies to requests by cookie (the protocol allows any order),
//! and a writable export's writes, made durable one by one, overlap instead of queueing
//! behind each other.
//!
//! Owns: bounds checks, reads, block status descriptors. Must not know: what the export
//! reads from.

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::Mutex;

use crate::handshake::{Session, DIRTY_ID};
use crate::proto::*;
use crate::Export;

/// Requests of one connection served at once (each on a thread of the connection's own).
pub const IN_FLIGHT: usize = 4;
/// Bytes of data one connection's requests in progress may hold (reads and writes; one
/// request larger than the rest goes alone): what a client can make the server keep in memory.
pub const IN_FLIGHT_BYTES: u64 = 2 * MAX_READ as u64;

/// The bytes a connection's requests in progress hold, and the wait for some to be freed.
struct Budget {
    used: Mutex<u64>,
    freed: std::sync::Condvar,
}

impl Budget {
    /// Waits until `n` more bytes fit (always, with nothing in progress), and takes them.
    fn take(&self, n: u64) {
        let used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let mut used = self
            .freed
            .wait_while(used, |u| *u > 0 && *u + n > IN_FLIGHT_BYTES)
            .unwrap_or_else(|p| p.into_inner());
        *used += n;
    }

    fn give(&self, n: u64) {
        *self.used.lock().unwrap_or_else(|p| p.into_inner()) -= n;
        self.freed.notify_all();
    }
}

/// The data bytes request `q` makes the server hold.
fn cost(q: &Request) -> u64 {
    match q.kind {
        CMD_READ | CMD_WRITE => q.len.min(MAX_READ) as u64,
        _ => 0,
    }
}

/// Serves requests until the client disconnects, or the server stops (the next request
/// then fails with `ESHUTDOWN` and the connection closes), `threads` at a time ([`IN_FLIGHT`]
/// on a connection; 1: one after the other on this thread, what the fuzz target drives). A
/// reply that cannot be sent ends the connection.
pub fn run<W: Write + Send>(
    r: &mut impl Read,
    w: &mut W,
    e: &dyn Export,
    sess: &Session,
    stop: &AtomicBool,
    threads: usize,
) -> io::Result<()> {
    if threads <= 1 {
        return run_inline(r, w, e, sess, stop);
    }
    let out = Mutex::new(w);
    let failed: Mutex<Option<io::Error>> = Mutex::new(None);
    let send = |reply: &Kept| -> io::Result<()> {
        let mut w = out.lock().unwrap_or_else(|p| p.into_inner());
        for (part, from) in &reply.parts {
            w.write_all(&part[*from..])?;
        }
        w.flush()
    };
    // No queue: the reader hands a request over only to a free server thread.
    let (tx, rx) = sync_channel::<(Request, Vec<u8>)>(0);
    let rx = Mutex::new(rx);
    let budget = Budget {
        used: Mutex::new(0),
        freed: std::sync::Condvar::new(),
    };
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| loop {
                let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                let Ok((q, payload)) = job else { return };
                let mut reply = Kept::default();
                let sent = serve(&mut reply, e, sess, &q, &payload).and_then(|()| send(&reply));
                drop((reply, payload));
                budget.give(cost(&q));
                if let Err(err) = sent {
                    failed
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(err);
                    return;
                }
            });
        }
        let read = (|| loop {
            if failed.lock().unwrap_or_else(|p| p.into_inner()).is_some() {
                return Ok(());
            }
            let q = read_request(r)?;
            if q.kind == CMD_DISC {
                return Ok(());
            }
            budget.take(cost(&q));
            let payload = read_payload(r, e, &q)?;
            if stop.load(Ordering::SeqCst) {
                let mut reply = Kept::default();
                error(
                    &mut reply,
                    sess,
                    q.cookie,
                    ESHUTDOWN,
                    "the export was stopped",
                )?;
                return send(&reply);
            }
            if tx.send((q, payload)).is_err() {
                return Ok(()); // every server thread ended: a reply failed
            }
        })();
        drop(tx);
        read
    })?;
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(err) => Err(err),
        None => Ok(()),
    }
}

/// [`run`] one request at a time on this thread.
fn run_inline(
    r: &mut impl Read,
    w: &mut impl Write,
    e: &dyn Export,
    sess: &Session,
    stop: &AtomicBool,
) -> io::Result<()> {
    loop {
        let q = read_request(r)?;
        if q.kind == CMD_DISC {
            return Ok(());
        }
        let payload = read_payload(r, e, &q)?;
        if stop.load(Ordering::SeqCst) {
            error(w, sess, q.cookie, ESHUTDOWN, "the export was stopped")?;
            return w.flush();
        }
        serve(&mut Now(w), e, sess, &q, &payload)?;
        w.flush()?;
    }
}

/// A write's payload follows its header: read before replying (a read-only export drops
/// it).
fn read_payload(r: &mut impl Read, e: &dyn Export, q: &Request) -> io::Result<Vec<u8>> {
    let mut payload = Vec::new();
    if q.kind == CMD_WRITE {
        if q.len > MAX_READ {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "write too large",
            ));
        }
        match e.writable() {
            true => {
                payload.resize(q.len as usize, 0);
                r.read_exact(&mut payload)?;
            }
            false => {
                io::copy(&mut r.take(q.len as u64), &mut io::sink())?;
            }
        }
    }
    Ok(payload)
}

/// Where a reply goes: the connection, or a reply kept whole to be sent under the
/// connection's lock. A read's data goes by value ([`Sink::data`]), so a kept reply holds
/// the buffer it was read into, not a copy of it (at most [`IN_FLIGHT_BYTES`] of data per
/// connection, as the budget says).
trait Sink: Write {
    /// Sends `buf[from..]` after what was written so far.
    fn data(&mut self, buf: Vec<u8>, from: usize) -> io::Result<()>;
}

/// Straight to the connection (one request at a time).
struct Now<'a, W>(&'a mut W);

impl<W: Write> Write for Now<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

impl<W: Write> Sink for Now<'_, W> {
    fn data(&mut self, buf: Vec<u8>, from: usize) -> io::Result<()> {
        self.0.write_all(&buf[from..])
    }
}

/// A reply kept whole: its parts in order, each sent from its offset.
#[derive(Default)]
struct Kept {
    parts: Vec<(Vec<u8>, usize)>,
    /// The last part is a read's data (what is written next starts a new part).
    data_last: bool,
}

impl Write for Kept {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self.parts.last_mut() {
            Some((last, _)) if !self.data_last => last.extend_from_slice(buf),
            _ => self.parts.push((buf.to_vec(), 0)),
        }
        self.data_last = false;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Sink for Kept {
    fn data(&mut self, buf: Vec<u8>, from: usize) -> io::Result<()> {
        self.parts.push((buf, from));
        self.data_last = true;
        Ok(())
    }
}

/// Serves request `q` (a write's `payload` with it) and writes its reply to `w`.
fn serve(
    w: &mut impl Sink,
    e: &dyn Export,
    sess: &Session,
    q: &Request,
    payload: &[u8],
) -> io::Result<()> {
    let end = q.offset.checked_add(q.len as u64);
    match q.kind {
        // Past the end: the spec's ENOSPC for what would write, EINVAL for the rest.
        CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM
            if e.writable() && end.is_none_or(|end| end > e.size()) =>
        {
            error(w, sess, q.cookie, ENOSPC, "beyond the end of the export")
        }
        _ if end.is_none_or(|end| end > e.size()) => {
            error(w, sess, q.cookie, EINVAL, "beyond the end of the export")
        }
        CMD_READ if q.len > MAX_READ => error(w, sess, q.cookie, EOVERFLOW, "read too large"),
        CMD_READ if q.len == 0 => error(w, sess, q.cookie, EINVAL, "a read of no bytes"),
        CMD_READ => read(w, e, sess, q),
        CMD_CACHE => done(w, sess, q.cookie),
        CMD_FLUSH => result(w, e, sess, q, e.flush()),
        CMD_BLOCK_STATUS => block_status(w, e, sess, q),
        CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES if !e.writable() => {
            error(w, sess, q.cookie, EPERM, "the export is read-only")
        }
        CMD_WRITE => result(w, e, sess, q, e.write_at(payload, q.offset)),
        CMD_WRITE_ZEROES => result(w, e, sess, q, e.write_zeroes(q.offset, q.len as u64)),
        // A hint: the data may stay.
        CMD_TRIM => done(w, sess, q.cookie),
        _ => error(w, sess, q.cookie, EINVAL, "command not supported"),
    }
}

fn error(w: &mut impl Write, sess: &Session, cookie: u64, err: u32, msg: &str) -> io::Result<()> {
    match sess.structured {
        true => error_chunk(w, cookie, err, msg),
        false => simple_reply(w, cookie, err, &[]),
    }
}

/// The reply to a write, write-zeroes or flush: done, or (logged) the error as NBD names it:
/// the errno when the protocol has it, else EIO.
fn result(
    w: &mut impl Write,
    e: &dyn Export,
    sess: &Session,
    q: &Request,
    r: io::Result<()>,
) -> io::Result<()> {
    match r {
        Ok(()) => done(w, sess, q.cookie),
        Err(err) => {
            tracing::warn!(export = e.name(), kind = q.kind, offset = q.offset, len = q.len, error = %err, "an NBD write failed");
            let known = [
                EPERM, EIO, ENOMEM, EINVAL, ENOSPC, EOVERFLOW, ENOTSUP, ESHUTDOWN,
            ];
            let errno = err
                .raw_os_error()
                .map(|n| n as u32)
                .filter(|n| known.contains(n))
                .unwrap_or(EIO);
            error(w, sess, q.cookie, errno, "write failed")
        }
    }
}

fn done(w: &mut impl Write, sess: &Session, cookie: u64) -> io::Result<()> {
    match sess.structured {
        true => chunk(w, cookie, REPLY_FLAG_DONE, REPLY_TYPE_NONE, &[]),
        false => simple_reply(w, cookie, 0, &[]),
    }
}

fn read(w: &mut impl Sink, e: &dyn Export, sess: &Session, q: &Request) -> io::Result<()> {
    let mut payload = vec![0u8; 8 + q.len as usize];
    payload[..8].copy_from_slice(&q.offset.to_be_bytes());
    if let Err(err) = e.read_at(&mut payload[8..], q.offset) {
        tracing::warn!(export = e.name(), offset = q.offset, len = q.len, error = %err, "an NBD read failed");
        return error(w, sess, q.cookie, EIO, "read failed");
    }
    // The header, then the data as it is (no second copy of up to MAX_READ bytes).
    match sess.structured {
        true => {
            let n = payload.len();
            chunk_header(w, q.cookie, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, n)?;
            w.data(payload, 0)
        }
        false => {
            simple_reply(w, q.cookie, 0, &[])?;
            w.data(payload, 8)
        }
    }
}

/// One chunk per meta context chosen: runs of extents with the same state, from the
/// request's offset to its end (the first run only with `NBD_CMD_FLAG_REQ_ONE`).
fn block_status(w: &mut impl Write, e: &dyn Export, sess: &Session, q: &Request) -> io::Result<()> {
    if !sess.structured || sess.contexts.is_empty() || q.len == 0 {
        return error(w, sess, q.cookie, EINVAL, "no meta context negotiated");
    }
    let end = q.offset + q.len as u64;
    for (n, &id) in sess.contexts.iter().enumerate() {
        let mut runs: Vec<(u32, u32)> = Vec::new();
        let mut at = q.offset;
        while at < end {
            let i = at / e.extent();
            // Saturating: an export within one extent of 2^64 bytes must not overflow.
            let next = (i + 1).saturating_mul(e.extent()).min(end);
            let state = match id {
                DIRTY_ID => STATE_DIRTY * e.changed(i) as u32,
                _ if e.allocated(i) => 0,
                _ => STATE_HOLE | STATE_ZERO,
            };
            let len = (next - at) as u32;
            let only_one = q.flags & CMD_FLAG_REQ_ONE != 0 && !runs.is_empty();
            match runs.last_mut() {
                Some((l, s)) if *s == state => *l += len,
                _ if only_one => break,
                _ => runs.push((len, state)),
            }
            at = next;
        }
        let mut p = id.to_be_bytes().to_vec();
        for (len, state) in runs {
            p.extend_from_slice(&len.to_be_bytes());
            p.extend_from_slice(&state.to_be_bytes());
        }
        let last = n + 1 == sess.contexts.len();
        let flags = if last { REPLY_FLAG_DONE } else { 0 };
        chunk(w, q.cookie, flags, REPLY_TYPE_BLOCK_STATUS, &p)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::CMD_READ;

    /// An export of 1 MiB of 0x5a that remembers where its last read went.
    struct Remembers(Mutex<usize>);

    impl Export for Remembers {
        fn name(&self) -> &str {
            "r"
        }
        fn size(&self) -> u64 {
            1 << 20
        }
        fn read_at(&self, buf: &mut [u8], _offset: u64) -> io::Result<()> {
            buf.fill(0x5a);
            *self.0.lock().unwrap() = buf.as_ptr() as usize;
            Ok(())
        }
        fn extent(&self) -> u64 {
            1 << 20
        }
        fn allocated(&self, _i: u64) -> bool {
            true
        }
    }

    /// A read's reply kept to be sent under the connection's lock holds the very buffer the
    /// export read into: one buffer per read in flight, not a second copy of its data (the
    /// kept reply used to be a Vec the data was copied into, twice the documented memory).
    #[test]
    fn a_kept_read_reply_holds_the_buffer_read_into() {
        let e = Remembers(Mutex::new(0));
        for structured in [true, false] {
            let sess = Session {
                structured,
                contexts: Vec::new(),
            };
            let q = Request {
                flags: 0,
                kind: CMD_READ,
                cookie: 7,
                offset: 4096,
                len: 65536,
            };
            let mut reply = Kept::default();
            serve(&mut reply, &e, &sess, &q, &[]).unwrap();
            let (data, _) = reply.parts.last().unwrap();
            let read_into = (*e.0.lock().unwrap()).wrapping_sub(data.as_ptr() as usize);
            assert!(
                read_into <= 8,
                "the data was copied out of the buffer read into"
            );
            // And what goes out is the header, then the data.
            let mut sent = Vec::new();
            for (p, from) in &reply.parts {
                sent.extend_from_slice(&p[*from..]);
            }
            let header = if structured { 20 + 8 } else { 16 };
            assert_eq!(sent.len(), header + 65536, "structured {structured}");
            assert!(sent[header..].iter().all(|&b| b == 0x5a));
            let mut now = Vec::new();
            serve(&mut Now(&mut now), &e, &sess, &q, &[]).unwrap();
            assert_eq!(now, sent);
        }
    }
}
