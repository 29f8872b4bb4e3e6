//! NVMe register offsets, command and completion formats, status decoding (NVMe Base
//! Specification 1.4/2.0: §3.1 controller registers, §4.2 SQ entry, §4.6 CQ entry).

/// Controller Capabilities.
pub const REG_CAP: usize = 0x00;
/// Version.
pub const REG_VS: usize = 0x08;
/// Controller Configuration.
pub const REG_CC: usize = 0x14;
/// Controller Status.
pub const REG_CSTS: usize = 0x1c;
/// Admin Queue Attributes.
pub const REG_AQA: usize = 0x24;
/// Admin Submission Queue base.
pub const REG_ASQ: usize = 0x28;
/// Admin Completion Queue base.
pub const REG_ACQ: usize = 0x30;
/// First doorbell.
pub const REG_DOORBELLS: usize = 0x1000;

/// CC.EN.
pub const CC_EN: u32 = 1;
/// CC.IOSQES = 6 (64-byte SQ entries), CC.IOCQES = 4 (16-byte CQ entries).
pub const CC_ENTRY_SIZES: u32 = (6 << 16) | (4 << 20);
/// CC.SHN = normal shutdown.
pub const CC_SHN_NORMAL: u32 = 1 << 14;
/// CSTS.RDY.
pub const CSTS_RDY: u32 = 1;
/// CSTS.CFS (controller fatal status).
pub const CSTS_CFS: u32 = 1 << 1;
/// CSTS.SHST = shutdown complete.
pub const CSTS_SHST_DONE: u32 = 2 << 2;

/// CDW0 PSDT = 01b: the data pointer is an SGL (metadata pointer an address).
pub const PSDT_SGL: u32 = 1 << 14;

/// Admin opcodes.
pub mod admin {
    pub const DELETE_SQ: u8 = 0x00;
    pub const CREATE_SQ: u8 = 0x01;
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const DELETE_CQ: u8 = 0x04;
    pub const CREATE_CQ: u8 = 0x05;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
}

/// NVM command set opcodes.
pub mod io {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DSM: u8 = 0x09;
}

/// Log page identifiers.
pub const LOG_ERROR: u8 = 0x01;
/// SMART / Health Information.
pub const LOG_SMART: u8 = 0x02;
/// Feature: Number of Queues.
pub const FEAT_NUM_QUEUES: u8 = 0x07;

/// Controller Capabilities, decoded.
#[derive(Debug, Clone, Copy)]
pub struct Cap {
    /// Maximum queue entries (1-based).
    pub mqes: u32,
    /// Worst-case time to become ready, in milliseconds.
    pub timeout_ms: u64,
    /// Doorbell stride in bytes.
    pub doorbell_stride: usize,
    /// Smallest memory page size, in bytes.
    pub mps_min: u64,
    /// The NVM command set is supported.
    pub nvm: bool,
}

impl Cap {
    pub fn decode(cap: u64) -> Cap {
        Cap {
            mqes: (cap & 0xffff) as u32 + 1,
            timeout_ms: ((cap >> 24) & 0xff).max(1) * 500,
            doorbell_stride: 4 << ((cap >> 32) & 0xf),
            mps_min: 1 << (12 + ((cap >> 48) & 0xf)),
            nvm: (cap >> 37) & 1 == 1,
        }
    }
}

/// One 64-byte submission queue entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C, align(64))]
pub struct Sqe {
    pub cdw0: u32,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub mptr: u64,
    pub prp1: u64,
    pub prp2: u64,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}

const _: () = assert!(std::mem::size_of::<Sqe>() == 64);

impl Sqe {
    /// A command with `opcode` for namespace `nsid`; the command identifier is set on submit.
    pub fn new(opcode: u8, nsid: u32) -> Sqe {
        Sqe {
            cdw0: opcode as u32,
            nsid,
            ..Sqe::default()
        }
    }

    /// Read/Write/Write Zeroes: starting LBA and number of blocks (1-based).
    pub fn lba(mut self, slba: u64, blocks: u32) -> Sqe {
        self.cdw10 = slba as u32;
        self.cdw11 = (slba >> 32) as u32;
        self.cdw12 = blocks.saturating_sub(1) & 0xffff;
        self
    }

    pub fn opcode(&self) -> u8 {
        self.cdw0 as u8
    }

    pub fn set_cid(&mut self, cid: u16) {
        self.cdw0 = (self.cdw0 & 0xffff) | ((cid as u32) << 16);
    }
}

/// One 16-byte completion queue entry.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub struct Cqe {
    pub dw0: u32,
    pub dw1: u32,
    pub sq_head: u16,
    pub sq_id: u16,
    pub cid: u16,
    /// Bit 0: phase tag; bits 15:1: status field.
    pub status: u16,
}

const _: () = assert!(std::mem::size_of::<Cqe>() == 16);

/// A completion's status field (without the phase bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Status(pub u16);

impl Status {
    pub fn from_cqe(status: u16) -> Status {
        Status(status >> 1)
    }
    /// Status Code Type.
    pub fn sct(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }
    /// Status Code.
    pub fn sc(self) -> u8 {
        self.0 as u8
    }
    /// Do Not Retry.
    pub fn dnr(self) -> bool {
        self.0 & (1 << 14) != 0
    }
    pub fn ok(self) -> bool {
        self.sct() == 0 && self.sc() == 0
    }

    /// The negative errno this status means to the data path. The mapping follows the Linux
    /// NVMe driver's `nvme_error_status()`, so the health layer's errno classes apply
    /// unchanged: media and data-integrity errors → ENODATA/EILSEQ (medium), transport,
    /// internal and path errors → EIO/ENOLINK (path), invalid commands → EINVAL/EOPNOTSUPP
    /// (the request alone), aborts → ECANCELED.
    pub fn errno(self) -> i32 {
        let e = match (self.sct(), self.sc()) {
            (0, 0) => return 0,
            (0, 0x01) => libc::EOPNOTSUPP,            // invalid opcode
            (0, 0x02) | (0, 0x0b) => libc::EINVAL,    // invalid field / namespace
            (0, 0x80) => libc::EINVAL,                // LBA out of range
            (0, 0x81) => libc::ENOSPC,                // capacity exceeded
            (0, 0x07) | (0, 0x08) => libc::ECANCELED, // aborted
            (0, 0x82) => libc::EAGAIN,                // namespace not ready
            (0, 0x04) | (0, 0x06) => libc::EIO,       // data transfer / internal error
            (1, _) => libc::EINVAL,                   // command specific
            (2, 0x85) | (2, 0x86) => libc::EILSEQ,    // compare failure / access denied
            (2, 0x82) | (2, 0x83) | (2, 0x84) => libc::EILSEQ, // end-to-end protection
            (2, _) => libc::ENODATA,                  // write fault, unrecovered read error, ...
            (3, _) => libc::ENOLINK,                  // path related
            _ => libc::EIO,
        };
        -e
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "0x{:03x} (SCT {} SC 0x{:02x}{})",
            self.0 & 0x7ff,
            self.sct(),
            self.sc(),
            if self.dnr() { ", DNR" } else { "" }
        )
    }
}

/// Little-endian field readers for identify data and log pages.
pub fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
pub fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
pub fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
/// An ASCII identify string, trimmed.
pub fn ascii(b: &[u8]) -> String {
    String::from_utf8_lossy(b).trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_decoding_follows_the_block_layer() {
        // QEMU's blkdebug media errors: reads 0x281, writes 0x280 (SCT 2).
        assert_eq!(Status(0x281).errno(), -libc::ENODATA);
        assert_eq!(Status(0x280).errno(), -libc::ENODATA);
        assert_eq!(Status(0x0004).errno(), -libc::EIO);
        assert_eq!(Status(0x0001).errno(), -libc::EOPNOTSUPP);
        assert_eq!(Status(0x0080).errno(), -libc::EINVAL);
        assert_eq!(Status(0x0300).errno(), -libc::ENOLINK);
        assert_eq!(Status(0x0007).errno(), -libc::ECANCELED);
        assert_eq!(Status(0).errno(), 0);
        let dnr = Status(0x4281);
        assert!(dnr.dnr());
        assert_eq!(dnr.sct(), 2);
        assert_eq!(dnr.sc(), 0x81);
        assert_eq!(Status::from_cqe(0x0281 << 1 | 1), Status(0x281));
        assert_eq!(dnr.to_string(), "0x281 (SCT 2 SC 0x81, DNR)");
    }

    #[test]
    fn cap_decoding() {
        // QEMU 7.2: MQES 2047, CQR, TO 15 (7.5 s), DSTRD 0, CSS NVM, MPSMIN 0.
        let cap = 2047u64 | (1 << 16) | (15 << 24) | (1 << 37);
        let c = Cap::decode(cap);
        assert_eq!(c.mqes, 2048);
        assert_eq!(c.timeout_ms, 7500);
        assert_eq!(c.doorbell_stride, 4);
        assert_eq!(c.mps_min, 4096);
        assert!(c.nvm);
    }

    #[test]
    fn sqe_fields() {
        let mut s = Sqe::new(io::READ, 1).lba(0x1_0000_0002, 8);
        s.set_cid(0x1234);
        assert_eq!(s.cdw0, 0x1234_0002);
        assert_eq!(s.cdw10, 2);
        assert_eq!(s.cdw11, 1);
        assert_eq!(s.cdw12, 7);
    }
}
