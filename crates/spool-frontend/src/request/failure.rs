//! Why a chain is refused: each kind with the status the guest gets and how loudly it is
//! logged. Must not know: descriptors, guest memory.

use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_UNSUPP};
use vm_memory::GuestAddress;

/// A chain the device refuses, answered with its failure's status when a status byte
/// could be located.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub head: u16,
    pub status_addr: Option<GuestAddress>,
    pub failure: Failure,
}

impl Rejected {
    /// The status byte the guest gets.
    pub fn status(&self) -> u8 {
        self.failure.status()
    }

    /// Why, in words (for logs).
    pub fn reason(&self) -> &'static str {
        self.failure.reason()
    }
}

/// Why a chain is refused. Each kind carries the status the guest gets and how loudly it is
/// logged (crosvm's virtio/block `ExecuteError` does the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    ChainTooLong,
    NoStatusByte,
    OutsideMemory,
    HeaderTooShort,
    HeaderWritable,
    HeaderUnreadable,
    UnsupportedType,
    WrongDirection,
    ReadOnly,
    Unaligned,
    TooLarge,
    OutOfRange,
    GetIdNotWritable,
    RangeWrongDirection,
    RangeReadOnly,
    RangeListLength,
    TooManySegments,
    RangeListUnreadable,
    UnsupportedFlags,
    SegmentTooLarge,
}

impl Failure {
    /// The virtio-blk status of the failure: UNSUPP for what a well-behaved guest may probe
    /// (request types and flags we do not offer), IOERR for everything malformed.
    pub fn status(self) -> u8 {
        (match self {
            Failure::UnsupportedType | Failure::UnsupportedFlags => VIRTIO_BLK_S_UNSUPP,
            _ => VIRTIO_BLK_S_IOERR,
        }) as u8
    }

    /// Whether the failure says the guest is broken or hostile (logged as a warning, rate
    /// limited) rather than something a correct driver can meet (logged at debug level:
    /// probing an unsupported type, a write to a read-only volume, a sector past the end).
    pub fn is_malformed(self) -> bool {
        !matches!(
            self,
            Failure::UnsupportedType
                | Failure::UnsupportedFlags
                | Failure::ReadOnly
                | Failure::RangeReadOnly
                | Failure::OutOfRange
        )
    }

    /// Why, in words.
    pub fn reason(self) -> &'static str {
        match self {
            Failure::ChainTooLong => "descriptor chain loops or is too long",
            Failure::NoStatusByte => "no writable status byte at the end of the chain",
            Failure::OutsideMemory => "buffer outside guest memory",
            Failure::HeaderTooShort => "request header too short",
            Failure::HeaderWritable => "request header is device-writable",
            Failure::HeaderUnreadable => "request header unreadable",
            Failure::UnsupportedType => "unsupported request type",
            Failure::WrongDirection => "data buffer has the wrong direction",
            Failure::ReadOnly => "write to a read-only volume",
            Failure::Unaligned => "data length is not a multiple of 512",
            Failure::TooLarge => "request larger than the device accepts",
            Failure::OutOfRange => "sector range beyond the end of the volume",
            Failure::GetIdNotWritable => "GET_ID needs a writable buffer",
            Failure::RangeWrongDirection => "range buffer has the wrong direction",
            Failure::RangeReadOnly => "discard/write-zeroes on a read-only volume",
            Failure::RangeListLength => "range list is not a multiple of 16 bytes",
            Failure::TooManySegments => "too many discard/write-zeroes segments",
            Failure::RangeListUnreadable => "range list unreadable",
            Failure::UnsupportedFlags => "unsupported discard/write-zeroes flags",
            Failure::SegmentTooLarge => "discard/write-zeroes segment too large",
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.reason())
    }
}
