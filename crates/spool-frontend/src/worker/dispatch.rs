//! From a taken request to device commands: rejected requests completed at once, re-posted
//! heads dropped, the one-piece fast path (`submit_one`), and the general path (`submit`):
//! splitting a request into device pieces along the layout, slicing its iovecs, the health
//! gate (one atomic load per piece), and submission.
//!
//! Knows nothing of completions, retries or device resets (`recovery` decides those).

use std::sync::Arc;

use smallvec::SmallVec;
use spool_devices::{DeviceIo, HealthState, IoVec};

use super::inflight::{used_len, write_status, Inflight};
use super::QueueWorker;
use crate::ratelimit::Verdict;
use crate::request::{self, GuestMemory, IoVecs, Op, Request, SECTOR};
use crate::stats::OpKind;

/// A request's device pieces: (device index, operation).
type Pieces = SmallVec<[(usize, DeviceIo); 4]>;

impl QueueWorker {
    /// Submits a parsed request, or completes a rejected one with its error status.
    #[inline]
    pub(super) fn dispatch(
        &mut self,
        parsed: Result<Request, request::Rejected>,
        mem: &Arc<GuestMemory>,
    ) {
        // A head the guest has not got back yet, offered again (a driver bug or a hostile
        // guest), is dropped: completing it, even with an error status, would complete the
        // request in flight a second time and mark it NONE in the journal while its I/O runs.
        // The original completes once, as it would have.
        match parsed {
            Ok(req) => {
                if self.head_busy(req.head) {
                    return self.note_reposted(req.head);
                }
                match self.one_piece(&req) {
                    Some((d, offset)) => self.submit_one(req, d, offset),
                    None => self.submit(req, mem),
                }
            }
            Err(rej) if self.head_busy(rej.head) => self.note_reposted(rej.head),
            Err(rej) => {
                self.tel.stats.queue(self.index).rejected();
                self.note_rejected(&rej);
                if let Some(a) = rej.status_addr {
                    self.refresh_host(mem);
                    self.guest.host.write(a.0, &[rej.status()]);
                }
                self.complete_used(mem, rej.head, 1);
            }
        }
    }

    /// Logs a refused chain at its failure's level: a malformed chain (a broken or hostile
    /// guest) as a rate-limited warning, what a correct driver can meet at debug level.
    #[cold]
    #[inline(never)]
    fn note_rejected(&mut self, rej: &request::Rejected) {
        if !rej.failure.is_malformed() {
            tracing::debug!(volume = %self.volume, head = rej.head, reason = rej.reason(), "request rejected");
        } else if let Verdict::Log { suppressed } = self.tel.rejected_log.check() {
            tracing::warn!(volume = %self.volume, queue = self.index, head = rej.head, suppressed, reason = rej.reason(), "malformed request rejected");
        }
    }

    #[cold]
    #[inline(never)]
    fn note_reposted(&mut self, head: u16) {
        if let Verdict::Log { suppressed } = self.tel.dup_log.check() {
            tracing::warn!(volume = %self.volume, queue = self.index, head, suppressed, "guest re-posted a descriptor head that is still in flight; ignored");
        }
    }

    /// Whether `head` is still the worker's: in flight, held for a resetting device, or
    /// cancelled and waiting to be submitted again (or out of range of the in-flight table).
    #[inline]
    pub(super) fn head_busy(&self, head: u16) -> bool {
        self.inflight.busy(head)
    }

    /// Where a read or write goes when it can take [`Self::submit_one`]: one healthy device
    /// with an open queue holds all of it, and its head is free.
    #[inline]
    fn one_piece(&self, req: &Request) -> Option<(usize, u64)> {
        if !matches!(req.op, Op::Read | Op::Write) || self.inflight.busy(req.head) {
            return None;
        }
        let (d, offset) = self.dev.layout.map_one(req.sector * SECTOR, req.len)?;
        (d < self.dev.queues.len()
            && self.dev.layout.devices[d].health().state() == HealthState::Healthy)
            .then_some((d, offset))
    }

    /// The common case of [`Self::submit`]: a read or write that lies on one healthy device
    /// (one piece, no health hold, no error), without the general path's piece lists.
    #[inline]
    fn submit_one(&mut self, req: Request, d: usize, offset: u64) {
        let head = req.head;
        let write = req.op == Op::Write;
        let len = req.len;
        let mut inf = Inflight::new(req.status_host, used_len(write, len), 1, self.sweep.count);
        inf.kind = if write { OpKind::Write } else { OpKind::Read };
        inf.bytes = len as u32;
        inf.taken = self.round_now();
        let bufs = self.inflight.bufs_mut(head);
        bufs.pieces.clear();
        bufs.pieces.push((d as u16, offset, len, write));
        bufs.iov = req.iov;
        let (iov, iovcnt) = (bufs.iov.as_ptr(), bufs.iov.len() as u32);
        self.inflight.submit(head, inf);
        let io = DeviceIo::data(write, offset, len, iov, iovcnt);
        // SAFETY: as in `submit`: the array lives in this slot's buffers, refilled only for
        // a free head (`one_piece` and `head_busy`), untouched until reaped; each iovec lies
        // in one region of `host_of` (`host_iovecs`), mapped until completion.
        unsafe { self.dev.queues[d].submit(io, head as u64) };
    }

    /// Any request [`Self::submit_one`] does not take: split into device pieces, through the
    /// health gate, then submitted (or held, or completed at once).
    pub(super) fn submit(&mut self, req: Request, mem: &Arc<GuestMemory>) {
        let head = req.head;
        let bufs = self.inflight.bufs_mut(head);
        bufs.parts.clear();
        bufs.pieces.clear();
        let mut ios = Pieces::new();
        let status = req.status_host;
        let (kind, bytes) = match req.op {
            Op::Read => (OpKind::Read, req.len as u32),
            Op::Write => (OpKind::Write, req.len as u32),
            _ => (OpKind::Other, 0),
        };
        let used = self.plan_pieces(req, &mut ios);
        let mut inf = Inflight::new(status, used, ios.len() as u32, 0);
        inf.kind = kind;
        inf.bytes = bytes;
        inf.taken = self.round_now();
        if !self.health_gate(head, &mut inf, &ios, mem) {
            return;
        }
        self.issue(head, inf, ios);
    }

    /// Fills `ios` with the request's device pieces (and its slot's iovec arrays); returns
    /// its used length.
    fn plan_pieces(&mut self, req: Request, ios: &mut Pieces) -> u32 {
        match &req.op {
            Op::Read | Op::Write => {
                let write = req.op == Op::Write;
                let used = used_len(write, req.len);
                self.plan_rw(req.head, req.sector, req.len, req.iov, write, ios);
                used
            }
            Op::Flush => {
                for d in 0..self.dev.layout.devices.len() {
                    ios.push((d, DeviceIo::Flush));
                }
                1
            }
            Op::GetId => self.copy_serial(&req.iov) + 1,
            Op::Discard(ranges) | Op::WriteZeroes { ranges, .. } => {
                let zeroes = matches!(req.op, Op::WriteZeroes { .. });
                for r in ranges {
                    let (offset, len) = (r.sector * SECTOR, r.sectors as u64 * SECTOR);
                    self.dev.layout.map(offset, len, |d, offset, len, _| {
                        ios.push((
                            d,
                            if zeroes {
                                DeviceIo::WriteZeroes { offset, len }
                            } else {
                                DeviceIo::Discard { offset, len }
                            },
                        ))
                    });
                }
                1
            }
        }
    }

    /// A read or write split along the layout: one piece per device extent, each with its
    /// own slice of the request's iovecs (kept in the slot's `parts`).
    fn plan_rw(
        &mut self,
        head: u16,
        sector: u64,
        len: u64,
        iov: IoVecs,
        write: bool,
        ios: &mut Pieces,
    ) {
        let parts = &mut self.inflight.bufs_mut(head).parts;
        let mut pieces: SmallVec<[(usize, u64, u64, u64); 4]> = SmallVec::new();
        self.dev
            .layout
            .map(sector * SECTOR, len, |d, off, len, at| {
                pieces.push((d, off, len, at))
            });
        if pieces.len() == 1 {
            parts.push(iov);
        } else {
            for &(_, _, len, at) in &pieces {
                parts.push(slice_iov(&iov, at, len));
            }
        }
        for (i, &(d, offset, len, _)) in pieces.iter().enumerate() {
            // The arrays are pointed at once the request sits in its slot (`issue`); until
            // then `iovcnt` says which part.
            let iov = std::ptr::null();
            let iovcnt = i as u32;
            ios.push((d, DeviceIo::data(write, offset, len, iov, iovcnt)));
        }
    }

    /// GET_ID: copies the serial into the request's buffers; returns the bytes written.
    fn copy_serial(&self, iov: &IoVecs) -> u32 {
        let mut left = &self.serial[..];
        let mut written = 0u32;
        for v in iov {
            let n = v.iov_len.min(left.len());
            // SAFETY: `v` comes from `host_iovecs` (each iovec inside one region, by
            // `HostMap::host`/`pieces`) of `host_of`, which is `mem` here (refreshed by the
            // caller); n <= v.iov_len. A guest race only changes what it reads.
            unsafe { std::ptr::copy_nonoverlapping(left.as_ptr(), v.iov_base.cast::<u8>(), n) };
            left = &left[n..];
            written += n as u32;
        }
        written
    }

    /// The health gate: one atomic load per piece. A piece for a resetting device holds the
    /// request (journaled INFLIGHT, not submitted); one for an isolated device, or for a
    /// device whose queue cannot be had, fails it. Returns whether to submit: a request held,
    /// or with nothing left to submit (failed, or no pieces at all), is not.
    fn health_gate(
        &mut self,
        head: u16,
        inf: &mut Inflight,
        ios: &Pieces,
        mem: &Arc<GuestMemory>,
    ) -> bool {
        let mut hold = false;
        for (d, _) in ios {
            match self.dev.layout.devices[*d].health().state() {
                HealthState::Healthy => {}
                HealthState::Resetting => hold = true,
                HealthState::Failed | HealthState::Removed => {
                    inf.pieces.fail_unsent();
                }
            }
        }
        if hold && inf.pieces.pending() != 0 {
            self.inflight.hold(head);
            return false;
        }
        if inf.pieces.pending() != 0 && ios.iter().any(|(d, _)| *d >= self.dev.queues.len()) {
            // A device queue that could not be reopened (after a reset or a replacement):
            // try again; if it still cannot be had, this request fails cleanly.
            if let Err(e) = self.open_device_queues() {
                tracing::error!(volume = %self.volume, error = %e, "no device queue; failing the request");
                inf.pieces.fail_unsent();
            }
        }
        if inf.pieces.pending() == 0 {
            self.refresh_host(mem);
            write_status(inf.status, inf.status_code());
            self.complete_used(mem, head, inf.used_len);
            return false;
        }
        true
    }

    /// Puts the request in its slot and submits its pieces.
    fn issue(&mut self, head: u16, mut inf: Inflight, ios: Pieces) {
        for (d, io) in &ios {
            let (offset, len, write) = match *io {
                DeviceIo::Read { offset, len, .. } => (offset, len, false),
                DeviceIo::Write { offset, len, .. } => (offset, len, true),
                DeviceIo::Flush => (0, 0, true),
                DeviceIo::Discard { offset, len } | DeviceIo::WriteZeroes { offset, len } => {
                    (offset, len, true)
                }
            };
            self.inflight
                .bufs_mut(head)
                .pieces
                .push((*d as u16, offset, len, write));
        }
        inf.sweep = self.sweep.count;
        self.inflight.submit(head, inf);
        let parts = &self.inflight.bufs(head).parts;
        for (i, (d, mut io)) in ios.into_iter().enumerate() {
            if let DeviceIo::Read { iov, iovcnt, .. } | DeviceIo::Write { iov, iovcnt, .. } =
                &mut io
            {
                let part = &parts[*iovcnt as usize];
                *iov = part.as_ptr();
                *iovcnt = part.len() as u32;
            }
            // SAFETY: the arrays live in `slot_bufs[slot].parts` (never grown), refilled only
            // for a head `dispatch` found free (`head_busy`: none of its pieces is in a
            // device); each iovec lies in one region of `host_of` (`host_iovecs`; `slice_iov`
            // stays inside), which stays mapped until completion (`retired_maps`).
            unsafe { self.dev.queues[d].submit(io, piece_tag(head, i)) };
        }
    }
}

/// The device tag of piece `piece` of request `head`: the head in the low 16 bits, the
/// piece's index above them, so a completion names the very piece it is for (two pieces of
/// one request can be on one device: a layout whose segments are not contiguous).
#[inline]
pub(super) fn piece_tag(head: u16, piece: usize) -> u64 {
    head as u64 | (piece as u64) << 16
}

/// The (head, piece index) a device tag names ([`piece_tag`]).
#[inline]
pub(super) fn tag_piece(tag: u64) -> (u16, usize) {
    (tag as u16, (tag >> 16) as usize)
}

/// The iovecs covering `[at, at + len)` of the data described by `iov`.
pub(super) fn slice_iov(iov: &[IoVec], at: u64, len: u64) -> IoVecs {
    let mut out = IoVecs::new();
    let mut pos = 0u64;
    let end = at + len;
    for v in iov {
        let vstart = pos;
        let vend = pos + v.iov_len as u64;
        pos = vend;
        if vend <= at || vstart >= end {
            continue;
        }
        let s = at.max(vstart);
        let e = end.min(vend);
        out.push(IoVec {
            iov_base: (v.iov_base as usize + (s - vstart) as usize) as *mut libc::c_void,
            iov_len: (e - s) as usize,
        });
    }
    out
}
