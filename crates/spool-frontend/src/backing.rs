//! A frontend's file as something to map shared: the page size, and that the file really
//! holds the range (a shared mapping past the end of its file raises SIGBUS on first access).
//! Used for guest memory (`memory`) and the dirty log (`dirty_log`).
//!
//! Must not know: what the mapping is for.

use std::fs::File;

/// Checks that `file` really holds `[offset, offset+size)`: a shared mapping past the end of
/// its file raises SIGBUS on first access. A file sealed against shrinking (QEMU's memfd
/// backend seals by default) cannot be cut short later either; any other can, which the
/// SIGBUS watch on the mapping covers.
pub(crate) fn check_backing(file: &File, offset: u64, size: u64) -> Result<(), BackingError> {
    let m = file.metadata().map_err(BackingError::Stat)?;
    if !m.file_type().is_file() {
        return Err(BackingError::NotAFile);
    }
    let end = offset.checked_add(size).ok_or(BackingError::Overflow)?;
    if m.len() < end {
        return Err(BackingError::PastEnd {
            offset,
            size,
            len: m.len(),
        });
    }
    if !offset.is_multiple_of(page_size()) {
        return Err(BackingError::Unaligned(offset));
    }
    Ok(())
}

/// Why a frontend's file cannot be mapped for a range.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    #[error("cannot stat its descriptor: {0}")]
    Stat(std::io::Error),
    #[error("its descriptor is not a regular file or memfd")]
    NotAFile,
    #[error("mmap_offset + size overflows")]
    Overflow,
    #[error(
        "mmap_offset {offset:#x} + size {size:#x} lies past the end of its file ({len:#x} bytes)"
    )]
    PastEnd { offset: u64, size: u64, len: u64 },
    #[error("mmap_offset {0:#x} is not page-aligned")]
    Unaligned(u64),
}

pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf takes and returns integers only.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}
