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
pub(crate) fn check_backing(file: &File, offset: u64, size: u64) -> Result<(), String> {
    let m = file
        .metadata()
        .map_err(|e| format!("cannot stat its descriptor: {e}"))?;
    if !m.file_type().is_file() {
        return Err("its descriptor is not a regular file or memfd".into());
    }
    let end = offset
        .checked_add(size)
        .ok_or("mmap_offset + size overflows")?;
    if m.len() < end {
        return Err(format!(
            "mmap_offset {offset:#x} + size {size:#x} lies past the end of its file ({:#x} bytes)",
            m.len()
        ));
    }
    if !offset.is_multiple_of(page_size()) {
        return Err(format!("mmap_offset {offset:#x} is not page-aligned"));
    }
    Ok(())
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
