//! Sending one request of the worker's on: split at chunk boundaries onto the pool
//! devices' queues, holes read as zeroes, writes to holes parked for the allocator,
//! discards of whole chunks unmapped, flushes to every device the volume uses.
//!
//! Owns: the splitting. Must not know: virtio, the pool.

use spool_devices::iov::split_iov;
use spool_devices::{DeviceIo, DeviceQueue, IoVec};

use super::ThinQueue;
use crate::shared::Unmap;

impl ThinQueue {
    /// Sends request `idx` on (or parks it, or finishes it).
    pub(super) fn dispatch(&mut self, idx: usize) {
        let io = self.ops[idx].as_ref().expect("live op").io;
        match io {
            DeviceIo::Read {
                offset,
                len,
                iov,
                iovcnt,
            } => self.dispatch_data(idx, false, offset, len, iov, iovcnt),
            DeviceIo::Write {
                offset,
                len,
                iov,
                iovcnt,
            } => self.dispatch_data(idx, true, offset, len, iov, iovcnt),
            DeviceIo::Flush => self.dispatch_flush(idx),
            DeviceIo::Discard { offset, len } | DeviceIo::WriteZeroes { offset, len } => {
                self.dispatch_trim(idx, offset, len)
            }
        }
    }

    /// The chunk pieces of `[offset, offset + len)`: (chunk, offset within it, length,
    /// offset within the request).
    fn pieces(&self, offset: u64, len: u64) -> Vec<(u64, u64, u64, u64)> {
        crate::map::chunk_pieces(self.shared.spec.chunk, offset, len).collect()
    }

    fn dispatch_data(
        &mut self,
        idx: usize,
        write: bool,
        offset: u64,
        len: u64,
        iov: *const IoVec,
        iovcnt: u32,
    ) {
        let chunk = self.shared.spec.chunk;
        if len > 0 && offset / chunk == (offset + len - 1) / chunk {
            return self.dispatch_one(idx, write, offset, len, iov, iovcnt);
        }
        let phase = self.shared.grace.enter(&self.readers);
        let pieces = self.pieces(offset, len);
        let map = &self.shared.map;
        let found: Vec<Option<(usize, u64)>> = (pieces.iter())
            .map(|p| match write {
                true => map.get_for_write(p.0),
                false => map.get(p.0),
            })
            .collect();
        if write && found.iter().any(Option::is_none) {
            self.shared.grace.leave(&self.readers, phase);
            for (p, f) in pieces.iter().zip(&found) {
                if f.is_none() {
                    self.ask(p.0);
                }
            }
            self.ops[idx].as_mut().expect("live op").parked = true;
            self.parked.push(idx);
            return;
        }
        self.op(idx).phase = Some(phase);
        // SAFETY: the caller of `submit` keeps the iovec array valid until completion.
        let iovs = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
        let whole = pieces.len() == 1;
        for (&(_, within, n, at), f) in pieces.iter().zip(&found) {
            let Some((d, off)) = *f else {
                zero_fill(iovs, at, n);
                continue;
            };
            let (piov, pcnt) = if whole {
                (iov, iovcnt)
            } else {
                let s = split_iov(iovs, at, n);
                let r = (s.as_ptr(), s.len() as u32);
                self.op(idx).split.push(s);
                r
            };
            match self.queue(d) {
                Ok(q) => {
                    // SAFETY: the pieces' iovecs point into the caller's buffers, valid until
                    // the request completes; split arrays live in the op until then.
                    unsafe {
                        q.submit(
                            DeviceIo::data(write, off + within, n, piov, pcnt),
                            idx as u64,
                        )
                    };
                    self.op(idx).pieces.issue();
                }
                Err(e) => self.op(idx).pieces.set_failure(e),
            }
        }
        self.maybe_finish(idx);
    }

    /// A request within one chunk (nearly all of them): no splitting, no allocation.
    #[inline]
    fn dispatch_one(
        &mut self,
        idx: usize,
        write: bool,
        offset: u64,
        len: u64,
        iov: *const IoVec,
        iovcnt: u32,
    ) {
        let chunk = self.shared.spec.chunk;
        let phase = self.shared.grace.enter(&self.readers);
        let found = match write {
            true => self.shared.map.get_for_write(offset / chunk),
            false => self.shared.map.get(offset / chunk),
        };
        match found {
            None if write => {
                self.shared.grace.leave(&self.readers, phase);
                self.ask(offset / chunk);
                self.op(idx).parked = true;
                self.parked.push(idx);
            }
            None => {
                self.shared.grace.leave(&self.readers, phase);
                // SAFETY: the caller of `submit` keeps the iovec array valid until completion.
                zero_fill(
                    unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) },
                    0,
                    len,
                );
                self.maybe_finish(idx);
            }
            Some((d, off)) => {
                self.op(idx).phase = Some(phase);
                let at = off + offset % chunk;
                match self.queue(d) {
                    Ok(q) => {
                        // SAFETY: the caller's iovecs, valid until the request completes.
                        unsafe {
                            q.submit(DeviceIo::data(write, at, len, iov, iovcnt), idx as u64)
                        };
                        self.op(idx).pieces.issue();
                    }
                    Err(e) => self.op(idx).pieces.set_failure(e),
                }
                self.maybe_finish(idx);
            }
        }
    }

    /// A flush goes to every pool device holding a chunk of the volume, whether or not this
    /// queue wrote there (another queue's writes are the guest's too); one not in the pool
    /// or isolated has nothing left to make durable.
    fn dispatch_flush(&mut self, idx: usize) {
        let devices = self
            .shared
            .devices
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .len();
        for d in 0..devices {
            match self.queue(d) {
                Ok(q) => {
                    // SAFETY: a flush carries no buffers.
                    unsafe { q.submit(DeviceIo::Flush, idx as u64) };
                    self.op(idx).pieces.issue();
                }
                Err(e) if e == -libc::ENOMEDIUM => {}
                Err(e) => self.op(idx).pieces.set_failure(e),
            }
        }
        self.maybe_finish(idx);
    }

    /// Discard or write-zeroes: whole chunks are unmapped, partial ones passed on.
    fn dispatch_trim(&mut self, idx: usize, offset: u64, len: u64) {
        let chunk = self.shared.spec.chunk;
        let zeroes = matches!(self.op(idx).io, DeviceIo::WriteZeroes { .. });
        let phase = self.shared.grace.enter(&self.readers);
        self.op(idx).phase = Some(phase);
        let pieces = self.pieces(offset, len);
        // Each partial piece's chunk is read once: the decision to wait and where the
        // zeroes go come from the same read (a snapshot may mark it in between).
        let states: Vec<_> = (pieces.iter())
            .map(|p| (p.2 < chunk).then(|| self.shared.map.state(p.0)))
            .collect();
        // Zeroes written into part of a shared chunk must not reach the other maps naming
        // it: the chunk is copied first (a discard of part of one is only dropped).
        let shared: Vec<u64> = (pieces.iter().zip(&states))
            .filter(|(_, st)| zeroes && st.is_some_and(|s| s.1))
            .map(|(p, _)| p.0)
            .collect();
        if !shared.is_empty() {
            self.op(idx).phase = None;
            self.shared.grace.leave(&self.readers, phase);
            for c in shared {
                self.ask(c);
            }
            self.op(idx).parked = true;
            self.parked.push(idx);
            return;
        }
        // Whole chunks to clear, and chunks whose unsure map blocks to write.
        let (mut clear, mut confirm) = ((u64::MAX, 0), (u64::MAX, 0));
        let widen = |r: &mut (u64, u64), c: u64| *r = (r.0.min(c), r.1.max(c + 1));
        for ((c, within, n, _), st) in pieces.into_iter().zip(states) {
            // Only a chunk covered whole goes back. The last chunk of a volume whose size is
            // not a multiple of it is not (a grow between this and the allocator's unmap
            // would expose a tail the request never covered, and drop a write to it).
            let Some((at, shared)) = st else {
                widen(&mut clear, c);
                widen(&mut confirm, c);
                continue;
            };
            // A hole needs nothing, but where its map block's last write failed (the device
            // may still name a chunk there) zeroes are confirmed by writing the block; a
            // discard of part of a shared chunk is dropped (zeroes into one waited above).
            let (Some((d, off)), false) = (at, shared) else {
                if zeroes && at.is_none() && crate::alloc::unsure(&self.shared, c) {
                    widen(&mut confirm, c);
                }
                continue;
            };
            let (offset, len) = (off + within, n);
            let io = match zeroes {
                true => DeviceIo::WriteZeroes { offset, len },
                false => DeviceIo::Discard { offset, len },
            };
            match self.queue(d) {
                Ok(q) => {
                    // SAFETY: no buffers.
                    unsafe { q.submit(io, idx as u64) };
                    self.op(idx).pieces.issue();
                }
                Err(e) => self.op(idx).pieces.set_failure(e),
            }
        }
        if confirm.0 < confirm.1 {
            self.op(idx).unmapping = true;
            self.seq = self.seq.wrapping_add(1);
            self.op(idx).seq = self.seq;
            self.shared.request_unmap(Unmap {
                first: clear.0,
                end: clear.1,
                confirm: confirm.0..confirm.1,
                token: (idx as u64) << 32 | self.seq as u64,
                mailbox: self.mailbox.clone(),
            });
        }
        self.maybe_finish(idx);
    }
}

/// Zeroes bytes `[at, at + n)` of what `iov` describes.
fn zero_fill(iov: &[IoVec], at: u64, n: u64) {
    for v in split_iov(iov, at, n).iter() {
        // SAFETY: the caller of `submit` keeps the buffers valid and ours to write until the
        // read completes; `split_iov` stays within them.
        unsafe { std::ptr::write_bytes(v.iov_base as *mut u8, 0, v.iov_len) };
    }
}
