//! The admin commands that return a page: Identify Controller and Identify Namespace at
//! bring-up, and the SMART / Health and Error Information log pages the health layer reads.
//!
//! Owns: decoding those pages into [`ControllerInfo`], [`NamespaceInfo`], [`SmartLog`] and
//! [`ErrorLogEntry`], and granting the I/O queue count at identify time.
//!
//! Must not know: what the health layer does with a log, the data path.

use super::{Controller, ControllerInfo, NamespaceInfo, PRP_LIMIT};
use crate::spec::{self, admin, le16, le32, le64, Sqe, Status};
use crate::{Error, Result, PAGE};

/// SMART / Health Information log (log page 0x02), the fields the health layer reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SmartLog {
    pub critical_warning: u8,
    /// Kelvin.
    pub temperature: u16,
    pub available_spare: u8,
    pub percentage_used: u8,
    pub media_errors: u64,
    pub error_log_entries: u64,
}

/// One Error Information log entry (log page 0x01).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorLogEntry {
    pub error_count: u64,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
    pub lba: u64,
    pub nsid: u32,
}

impl Controller {
    pub(super) fn identify(&mut self, set_queues: bool) -> Result<()> {
        let page = self.admin_page(
            Sqe {
                cdw10: 1,
                ..Sqe::new(admin::IDENTIFY, 0)
            },
            "identify controller",
        )?;
        let mdts = page[77];
        let max_transfer = if mdts == 0 {
            PRP_LIMIT
        } else {
            (PAGE << mdts).min(PRP_LIMIT)
        };
        let mut info = ControllerInfo {
            serial: spec::ascii(&page[4..24]),
            model: spec::ascii(&page[24..64]),
            firmware: spec::ascii(&page[64..72]),
            max_transfer,
            oncs: le16(&page, 520),
            sgl: (le32(&page, 536) & 3) as u8,
            write_cache: page[525] & 1 == 1,
            max_queue_entries: self.cap.mqes,
            ..ControllerInfo::default()
        };
        let nn = le32(&page, 516);
        if nn == 0 {
            return Err(Error::Invalid(format!(
                "{}: controller has no namespaces",
                self.bdf
            )));
        }
        let ns = self.admin_page(
            Sqe {
                cdw10: 0,
                ..Sqe::new(admin::IDENTIFY, 1)
            },
            "identify namespace 1",
        )?;
        let blocks = le64(&ns, 0);
        let flbas = (ns[26] & 0xf) as usize;
        let lbads = ns[128 + 4 * flbas + 2];
        if blocks == 0 || !(9..=16).contains(&lbads) {
            return Err(Error::Invalid(format!(
                "{}: namespace 1 is not usable (size {blocks} blocks, LBA data size 2^{lbads})",
                self.bdf
            )));
        }
        let max_qid = self.qids.get_mut().unwrap_or_else(|p| p.into_inner()).len() as u32 - 1;
        let want = max_qid.min(64);
        let hdr = &self.arena.header().io_queues;
        let kept = hdr.load(std::sync::atomic::Ordering::Acquire);
        info.io_queues = if set_queues || kept == 0 {
            // Number of Queues may be set once per controller reset.
            self.set_queue_count(want)?
        } else {
            kept.min(want) as u16
        };
        hdr.store(info.io_queues as u32, std::sync::atomic::Ordering::Release);
        let qids = self.qids.get_mut().unwrap_or_else(|p| p.into_inner());
        qids.truncate(info.io_queues as usize + 1);
        qids[0] = true;
        self.info = info;
        self.ns = NamespaceInfo {
            nsid: 1,
            lba_size: 1 << lbads,
            blocks,
        };
        Ok(())
    }

    /// Runs an admin command that returns one 4 KiB page (PRP1 = the admin buffer).
    pub(super) fn admin_page(&self, mut sqe: Sqe, what: &'static str) -> Result<Vec<u8>> {
        self.check_present()?;
        let mut adm = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        let (ptr, iova) = adm.buf;
        // SAFETY: arena page 3 is 4 KiB reserved for admin data; the admin lock is held.
        unsafe { std::ptr::write_bytes(ptr, 0, PAGE as usize) };
        sqe.prp1 = iova;
        Self::run_sync(&self.bdf, &mut adm.qp, sqe, what, &|| {
            self.rd32(spec::REG_CSTS)
        })?;
        // SAFETY: as above; the command has completed, the controller no longer writes it.
        Ok(unsafe { std::slice::from_raw_parts(ptr, PAGE as usize) }.to_vec())
    }

    /// Reads the SMART / Health Information log.
    pub fn smart_log(&self) -> Result<SmartLog> {
        let p = self.admin_page(
            Sqe {
                cdw10: ((512 / 4 - 1) << 16) | spec::LOG_SMART as u32,
                ..Sqe::new(admin::GET_LOG_PAGE, 0xffff_ffff)
            },
            "get SMART log",
        )?;
        Ok(SmartLog {
            critical_warning: p[0],
            temperature: le16(&p, 1),
            available_spare: p[3],
            percentage_used: p[5],
            media_errors: le64(&p, 160),
            error_log_entries: le64(&p, 176),
        })
    }

    /// Reads the newest `n` (≤ 64) Error Information log entries (non-empty ones).
    pub fn error_log(&self, n: usize) -> Result<Vec<ErrorLogEntry>> {
        let n = n.clamp(1, 64);
        let p = self.admin_page(
            Sqe {
                cdw10: (((n * 64 / 4 - 1) as u32) << 16) | spec::LOG_ERROR as u32,
                ..Sqe::new(admin::GET_LOG_PAGE, 0)
            },
            "get error log",
        )?;
        Ok((0..n)
            .map(|i| &p[i * 64..(i + 1) * 64])
            .map(|e| ErrorLogEntry {
                error_count: le64(e, 0),
                sqid: le16(e, 8),
                cid: le16(e, 10),
                status: Status::from_cqe(le16(e, 12)),
                lba: le64(e, 16),
                nsid: le32(e, 24),
            })
            .filter(|e| e.error_count != 0)
            .collect())
    }
}
