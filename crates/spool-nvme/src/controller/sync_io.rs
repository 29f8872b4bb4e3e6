//! Synchronous I/O for pool metadata and probes (never the data path): block-aligned reads,
//! durable writes and durable zeroing on the controller's own queue pair and 1 MiB DMA buffer.
//!
//! Owns: the synchronous queue pair and its buffer ([`SyncIo`]), chunking by the controller's
//! largest transfer, the PRP list in the buffer's last page.
//!
//! Must not know: what the bytes are (pool metadata is the caller's business).

use super::{Controller, SYNC_BUF};
use crate::spec::{self, io, Sqe};
use crate::{DmaBuf, Error, QueuePair, Result, PAGE};

/// The controller's queue pair for synchronous I/O and the buffer its data goes through.
pub(super) struct SyncIo {
    pub(super) qp: QueuePair,
    pub(super) buf: DmaBuf,
}

impl Controller {
    fn sync_io<F>(&self, what: &'static str, mut f: F) -> Result<()>
    where
        F: FnMut(&mut dyn FnMut(Sqe) -> Result<()>, &mut DmaBuf) -> Result<()>,
    {
        self.check_present()?;
        let mut g = self.sync.lock().unwrap_or_else(|p| p.into_inner());
        let s = g
            .as_mut()
            .ok_or_else(|| Error::Invalid(format!("{}: no synchronous queue", self.bdf)))?;
        let SyncIo { qp, buf } = s;
        let buf_iova = buf.iova();
        let bdf = self.bdf.clone();
        let csts = || self.rd32(spec::REG_CSTS);
        let mut run = |mut sqe: Sqe| -> Result<()> {
            if sqe.prp1 == u64::MAX {
                // Data in the sync buffer: PRP1 its start, PRP2 a list if needed (built in
                // the buffer's last page, which data never uses).
                let len = ((sqe.cdw12 & 0xffff) as u64 + 1) * self.ns.lba_size;
                let pages = len.div_ceil(PAGE);
                sqe.prp1 = buf_iova;
                if pages == 2 {
                    sqe.prp2 = buf_iova + PAGE;
                } else if pages > 2 {
                    sqe.prp2 = buf_iova + (SYNC_BUF as u64 - PAGE);
                }
            }
            Self::run_sync(&bdf, qp, sqe, what, &csts).map(|_| ())
        };
        f(&mut run, buf)
    }

    /// Largest data chunk the synchronous path moves per command.
    fn sync_chunk(&self) -> u64 {
        (SYNC_BUF as u64 - PAGE).min(self.info.max_transfer)
    }

    fn write_prp_list(buf: &mut DmaBuf, pages: u64) {
        let iova = buf.iova();
        let last = SYNC_BUF - PAGE as usize;
        let list = &mut buf.bytes_mut()[last..];
        for i in 1..pages.min(512) {
            list[(i as usize - 1) * 8..i as usize * 8]
                .copy_from_slice(&(iova + i * PAGE).to_le_bytes());
        }
    }

    fn check(&self, offset: u64, len: u64) -> Result<()> {
        let lba = self.ns.lba_size;
        if !offset.is_multiple_of(lba)
            || !len.is_multiple_of(lba)
            || offset.checked_add(len).is_none_or(|e| e > self.size())
        {
            return Err(Error::Invalid(format!(
                "{}: access {offset}+{len} is not whole {lba}-byte blocks inside the namespace",
                self.bdf
            )));
        }
        Ok(())
    }

    /// Synchronous block-aligned read (pool metadata, probes; never the data path).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len() as u64)?;
        let chunk = self.sync_chunk();
        let lba = self.ns.lba_size;
        let nsid = self.ns.nsid;
        self.sync_io("read", |run, buf| {
            let mut done = 0u64;
            while done < out.len() as u64 {
                let n = (out.len() as u64 - done).min(chunk);
                Self::write_prp_list(buf, n.div_ceil(PAGE));
                let sqe = Sqe {
                    prp1: u64::MAX,
                    ..Sqe::new(io::READ, nsid).lba((offset + done) / lba, (n / lba) as u32)
                };
                run(sqe)?;
                out[done as usize..(done + n) as usize].copy_from_slice(&buf.bytes()[..n as usize]);
                done += n;
            }
            Ok(())
        })
    }

    /// Synchronous block-aligned write followed by a flush (durable when it returns).
    pub fn write_durable(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len() as u64)?;
        let chunk = self.sync_chunk();
        let lba = self.ns.lba_size;
        let nsid = self.ns.nsid;
        let flush = self.info.write_cache;
        self.sync_io("write", |run, buf| {
            let mut done = 0u64;
            while done < data.len() as u64 {
                let n = (data.len() as u64 - done).min(chunk);
                buf.bytes_mut()[..n as usize]
                    .copy_from_slice(&data[done as usize..(done + n) as usize]);
                Self::write_prp_list(buf, n.div_ceil(PAGE));
                let sqe = Sqe {
                    prp1: u64::MAX,
                    ..Sqe::new(io::WRITE, nsid).lba((offset + done) / lba, (n / lba) as u32)
                };
                run(sqe)?;
                done += n;
            }
            if flush {
                run(Sqe::new(io::FLUSH, nsid))?;
            }
            Ok(())
        })
    }

    /// Makes a block-aligned range read back as zeroes, durably: Write Zeroes when the
    /// controller has it, zero-filled writes otherwise.
    pub fn zero_durable(&self, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        let lba = self.ns.lba_size;
        let nsid = self.ns.nsid;
        let has_wz = self.info.oncs & (1 << 3) != 0;
        let chunk = if has_wz {
            0x10000 * lba
        } else {
            self.sync_chunk()
        };
        let flush = self.info.write_cache;
        self.sync_io("write zeroes", |run, buf| {
            let mut done = 0u64;
            if !has_wz {
                buf.bytes_mut().fill(0);
            }
            while done < len {
                let n = (len - done).min(chunk);
                let mut sqe = Sqe::new(if has_wz { io::WRITE_ZEROES } else { io::WRITE }, nsid)
                    .lba((offset + done) / lba, (n / lba) as u32);
                if !has_wz {
                    Self::write_prp_list(buf, n.div_ceil(PAGE));
                    sqe.prp1 = u64::MAX;
                }
                run(sqe)?;
                done += n;
            }
            if flush {
                run(Sqe::new(io::FLUSH, nsid))?;
            }
            Ok(())
        })
    }
}
