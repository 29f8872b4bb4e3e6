//! Turning one [`DeviceIo`] into NVMe commands on a worker's queue pair: reads and writes
//! (zero copy by PRPs or an SGL, or through a bounce buffer; split at the transfer limit),
//! flushes, write-zeroes and deallocates (split at the command's block-count limit).
//!
//! Must not know: completions, resets and queue-pair lifetime (`queue.rs`).

use std::sync::atomic::Ordering;

use spool_nvme::spec::{io, Sqe};
use spool_nvme::{prp, DmaBuf, PAGE};

use super::queue::{Bounce, NvmeQueue};
use crate::queue::{DeviceIo, IoVec};

/// A read or write as the command builder sees it.
#[derive(Clone, Copy)]
struct Transfer {
    read: bool,
    offset: u64,
    len: u64,
    iov: *const IoVec,
    iovcnt: u32,
}

/// SGL descriptors one list page holds.
const SGL_PER_PAGE: usize = (PAGE / 16) as usize;

/// Most blocks one Write Zeroes command covers (NLB is 16 bits, zero-based).
const ZEROES_PER_COMMAND: u64 = 0x10000;
/// Most blocks one Dataset Management range covers (as many as fit in 32 bits, page aligned).
const DEALLOCATE_PER_COMMAND: u64 = 0xffff_0000;

impl NvmeQueue {
    /// How many commands `io` becomes.
    fn commands_needed(&self, io: &DeviceIo) -> u64 {
        match *io {
            DeviceIo::Read { len, .. } | DeviceIo::Write { len, .. } => {
                len.div_ceil(self.max_xfer).max(1)
            }
            DeviceIo::WriteZeroes { len, .. } => {
                (len / self.lba).div_ceil(ZEROES_PER_COMMAND).max(1)
            }
            DeviceIo::Discard { len, .. } => {
                (len / self.lba).div_ceil(DEALLOCATE_PER_COMMAND).max(1)
            }
            DeviceIo::Flush => 1,
        }
    }

    /// Turns `io` into commands, or returns false when the queue lacks room for all of them.
    ///
    /// # Safety
    /// As [`crate::DeviceQueue::submit`].
    pub(super) unsafe fn try_submit(&mut self, io: DeviceIo, tag: u64) -> bool {
        let Some(qp) = self.qp.as_ref() else {
            let e = if self.ctrl.is_gone() {
                libc::ENODEV
            } else {
                libc::EIO
            };
            self.done.push_back((tag, -e));
            return true;
        };
        let need = self.commands_needed(&io);
        if need > qp.free() as u64 {
            if need >= self.depth as u64 {
                // Can never fit: the request is larger than the whole queue can carry.
                self.done.push_back((tag, -libc::EINVAL));
                return true;
            }
            return false;
        }
        match io {
            DeviceIo::Read {
                offset,
                len,
                iov,
                iovcnt,
            }
            | DeviceIo::Write {
                offset,
                len,
                iov,
                iovcnt,
            } => {
                let t = Transfer {
                    read: matches!(io, DeviceIo::Read { .. }),
                    offset,
                    len,
                    iov,
                    iovcnt,
                };
                // SAFETY: the caller's guarantee is passed on unchanged.
                unsafe { self.submit_rw(t, tag, need) }
            }
            DeviceIo::Flush => self.submit_flush(tag),
            DeviceIo::WriteZeroes { offset, len } => {
                self.submit_zero_or_deallocate(true, offset, len, tag, need)
            }
            DeviceIo::Discard { offset, len } => {
                self.submit_zero_or_deallocate(false, offset, len, tag, need)
            }
        }
        true
    }

    /// A read or write: straight at the caller's buffers when they lie in registered memory
    /// and PRPs (or, where PRPs cannot, an SGL) describe them; through a bounce buffer
    /// otherwise.
    ///
    /// # Safety
    /// As [`crate::DeviceQueue::submit`] for `iov`/`iovcnt`.
    unsafe fn submit_rw(&mut self, t: Transfer, tag: u64, need: u64) {
        let Transfer {
            read,
            offset,
            len,
            iov,
            iovcnt,
        } = t;
        if len == 0 || !offset.is_multiple_of(self.lba) || !len.is_multiple_of(self.lba) {
            self.done.push_back((tag, -libc::EINVAL));
            return;
        }
        // SAFETY: `iovcnt` valid iovecs (the `submit` contract, passed on by `submit` and
        // `kick`); the worker's each lie in one guest region (`HostMap`).
        let iovs = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
        let zero_copy = self.translate_segments(iovs);
        let total: u64 = self.segs.iter().map(|s| s.1).sum();
        let prp_ok = prp::describable(&self.segs);
        // Scatter lists PRPs cannot describe go as an SGL when the controller has them.
        let sgl = zero_copy
            && total == len
            && !prp_ok
            && prp::sgl_describable(&self.segs, self.sgl, SGL_PER_PAGE);
        let mut bounce = None;
        if !zero_copy || total != len || (!prp_ok && !sgl) {
            // SAFETY: the caller's guarantee is passed on unchanged.
            match unsafe { self.bounce(&t) } {
                Some(b) => bounce = Some(b),
                None => {
                    self.done.push_back((tag, -libc::ENOMEM));
                    return;
                }
            }
        }
        if bounce.is_none() {
            self.ctrl.zero_copy_requests.fetch_add(1, Ordering::Relaxed);
        }
        if sgl {
            self.ctrl.sgl_requests.fetch_add(1, Ordering::Relaxed);
        }
        let req = self.new_request(tag, need as u32, len, bounce);
        let opcode = if read { io::READ } else { io::WRITE };
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(self.max_xfer);
            self.chunk.clear();
            prp::slice(&self.segs, done, n, &mut self.chunk);
            let sqe =
                Sqe::new(opcode, self.nsid).lba((offset + done) / self.lba, (n / self.lba) as u32);
            if sgl {
                self.push_sgl(sqe, req);
            } else {
                self.push_prps(sqe, req);
            }
            done += n;
        }
    }

    /// Fills `segs` with the DMA addresses of `iovs`; false when some buffer is not in
    /// registered memory (then the request is bounced).
    fn translate_segments(&mut self, iovs: &[IoVec]) -> bool {
        self.segs.clear();
        for v in iovs.iter().filter(|v| v.iov_len > 0) {
            match spool_nvme::dma::translate(v.iov_base as u64, v.iov_len as u64) {
                Some(a) => self.segs.push((a, v.iov_len as u64)),
                None => return false,
            }
        }
        true
    }

    /// Allocates a bounce buffer of `len` bytes (filled from the iovecs for a write) and
    /// makes it the request's only segment; `None` when no DMA memory is left.
    ///
    /// # Safety
    /// As [`crate::DeviceQueue::submit`] for the transfer's iovecs.
    unsafe fn bounce(&mut self, t: &Transfer) -> Option<Bounce> {
        let &Transfer {
            read,
            len,
            iov,
            iovcnt,
            ..
        } = t;
        let buf = match DmaBuf::new(len as usize) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "no DMA memory for a bounce buffer");
                return None;
            }
        };
        if !read {
            // SAFETY: `iovcnt` valid iovecs (the `submit` contract).
            let iovs = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
            let mut at = 0usize;
            for v in iovs {
                let n = v.iov_len.min(len as usize - at);
                // SAFETY: each iovec is `iov_len` readable bytes (`submit` contract);
                // `n <= len - at` keeps the copy inside the `len`-byte bounce buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(v.iov_base.cast::<u8>(), buf.as_ptr().add(at), n)
                };
                at += n;
                if at == len as usize {
                    break;
                }
            }
        }
        self.segs.clear();
        self.segs.push((buf.iova(), len));
        self.ctrl.bounced_requests.fetch_add(1, Ordering::Relaxed);
        Some(Bounce {
            buf,
            iov,
            iovcnt,
            read,
        })
    }

    /// Pushes `sqe` with the current chunk described by an SGL (its segment list in the
    /// command's list page).
    fn push_sgl(&mut self, mut sqe: Sqe, req: u32) {
        let chunk = std::mem::take(&mut self.chunk);
        let (dptr, list) = prp::sgl(&chunk, u64::MAX);
        sqe.cdw0 |= spool_nvme::spec::PSDT_SGL;
        sqe.prp1 = dptr.0;
        sqe.prp2 = dptr.1;
        self.push(sqe, req, |page| {
            for (i, d) in list.iter().enumerate() {
                page[i * 16..i * 16 + 16].copy_from_slice(d);
            }
        });
        self.chunk = chunk;
    }

    /// Pushes `sqe` with the current chunk described by PRPs (a PRP list in the command's
    /// list page beyond two entries).
    fn push_prps(&mut self, mut sqe: Sqe, req: u32) {
        self.entries.clear();
        prp::entries(&self.chunk, &mut self.entries);
        let entries = std::mem::take(&mut self.entries);
        sqe.prp1 = entries[0];
        sqe.prp2 = match entries.len() {
            1 => 0,
            2 => entries[1],
            _ => u64::MAX,
        };
        self.push(sqe, req, |page| {
            if entries.len() > 2 {
                for (i, e) in entries[1..].iter().enumerate() {
                    page[i * 8..i * 8 + 8].copy_from_slice(&e.to_le_bytes());
                }
            }
        });
        self.entries = entries;
    }

    /// A flush: one command, or done at once when the controller has no volatile write cache.
    fn submit_flush(&mut self, tag: u64) {
        if !self.write_cache {
            self.done.push_back((tag, 0));
            return;
        }
        let req = self.new_request(tag, 1, 0, None);
        self.ctrl.flush_commands.fetch_add(1, Ordering::Relaxed);
        self.push(Sqe::new(io::FLUSH, self.nsid), req, |_| {});
    }

    /// Write Zeroes (`zeroes`) or a deallocate (Dataset Management), split at the command's
    /// limit. Discard is advisory: without controller support it succeeds at once; Write
    /// Zeroes without it is refused with EOPNOTSUPP so the caller writes zeroes itself.
    fn submit_zero_or_deallocate(
        &mut self,
        zeroes: bool,
        offset: u64,
        len: u64,
        tag: u64,
        need: u64,
    ) {
        if !offset.is_multiple_of(self.lba) || !len.is_multiple_of(self.lba) {
            self.done.push_back((tag, -libc::EINVAL));
            return;
        }
        let supported = self.oncs & (1 << if zeroes { 3 } else { 2 }) != 0;
        if !supported || len == 0 {
            let result = if zeroes && len > 0 {
                -libc::EOPNOTSUPP
            } else {
                0
            };
            self.done.push_back((tag, result));
            return;
        }
        let per = if zeroes {
            ZEROES_PER_COMMAND
        } else {
            DEALLOCATE_PER_COMMAND
        };
        let req = self.new_request(tag, need as u32, 0, None);
        let mut blk = offset / self.lba;
        let mut left = len / self.lba;
        while left > 0 {
            let n = left.min(per);
            if zeroes {
                self.ctrl
                    .write_zeroes_commands
                    .fetch_add(1, Ordering::Relaxed);
                let sqe = Sqe::new(io::WRITE_ZEROES, self.nsid).lba(blk, n as u32);
                self.push(sqe, req, |_| {});
            } else {
                self.ctrl
                    .deallocate_commands
                    .fetch_add(1, Ordering::Relaxed);
                // One range: context attributes 0, length, starting LBA; AD (deallocate).
                let sqe = Sqe {
                    prp1: u64::MAX,
                    cdw10: 0,
                    cdw11: 1 << 2,
                    ..Sqe::new(io::DSM, self.nsid)
                };
                self.push(sqe, req, |page| {
                    page[..4].copy_from_slice(&0u32.to_le_bytes());
                    page[4..8].copy_from_slice(&(n as u32).to_le_bytes());
                    page[8..16].copy_from_slice(&blk.to_le_bytes());
                });
            }
            blk += n;
            left -= n;
        }
    }
}
