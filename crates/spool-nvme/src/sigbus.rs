//! SIGBUS safety for BAR accesses (Spool §6.1).
//!
//! A load or store to a BAR whose device has gone (surprise removal, memory decoding turned
//! off under us) raises SIGBUS, which would kill the whole daemon and every tenant with it.
//! The handler looks the faulting address up among the registered BAR mappings; if it is in
//! one, it maps a page of all-ones bytes over that BAR (reads then say "gone", as a removed
//! PCIe device does, and doorbell writes go nowhere), flags the BAR and returns, so the
//! access is retried on the dummy memory and only that controller is lost. A fault anywhere
//! else is not ours: the default action is restored and the fault repeats.
//!
//! The handler only reads atomics, calls mmap and writes memory it just mapped, which is
//! async-signal-safe in practice on Linux.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

const SLOTS: usize = 64;

struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
};
static BARS: [Slot; SLOTS] = [EMPTY; SLOTS];
static INSTALL: Once = Once::new();

/// Maps anonymous memory filled with 0xff over `[start, start+len)`; true on success.
///
/// # Safety
/// `[start, start+len)` must be a BAR mapping of this process that nothing will munmap
/// concurrently.
pub(crate) unsafe fn cover_with_ones(start: usize, len: usize) -> bool {
    // SAFETY: replaces the caller-owned mapping in place (MAP_FIXED), per the contract.
    let p = unsafe {
        libc::mmap(
            start as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return false;
    }
    // SAFETY: the fresh anonymous mapping is `len` writable bytes.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0xff, len) };
    true
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for s in BARS.iter() {
        let start = s.start.load(Ordering::Acquire);
        let len = s.len.load(Ordering::Acquire);
        if start != 0 && addr >= start && addr < start + len {
            // SAFETY: the slot describes a live BAR mapping (slots are cleared before unmap).
            if unsafe { cover_with_ones(start, len) } {
                s.faulted.store(true, Ordering::Release);
                return;
            }
        }
    }
    // Not a BAR (or the cover failed): let the default action happen on the re-executed access.
    // SAFETY: resetting a signal disposition; no memory is involved.
    unsafe { libc::signal(sig, libc::SIG_DFL) };
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is valid; we fill handler, flags and an empty mask.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: sigemptyset writes the mask inside our struct; sigaction reads it.
        unsafe {
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0 {
                tracing::warn!(error = %std::io::Error::last_os_error(), "cannot install the SIGBUS handler");
            }
        }
    });
}

/// Watches a BAR mapping; returns its slot (None when all slots are taken: then a fault on
/// it is fatal, as without this module).
pub(crate) fn watch(start: usize, len: usize) -> Option<usize> {
    install();
    for (i, s) in BARS.iter().enumerate() {
        if s.start
            .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            s.len.store(len, Ordering::Release);
            s.faulted.store(false, Ordering::Release);
            s.start.store(start, Ordering::Release);
            return Some(i);
        }
    }
    None
}

/// Whether the BAR in `slot` faulted (and is now covered by the dummy mapping).
pub(crate) fn faulted(slot: usize) -> bool {
    BARS[slot].faulted.load(Ordering::Acquire)
}

/// Stops watching (before the BAR is unmapped).
pub(crate) fn unwatch(slot: usize) {
    BARS[slot].start.store(0, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_on_a_watched_mapping_is_survived() {
        // A real SIGBUS: a shared mapping of a memfd beyond its end faults on access, as a
        // BAR does when its device is gone.
        // SAFETY: memfd_create with a static name; checked.
        let fd = unsafe { libc::memfd_create(c"spool-sigbus-test".as_ptr(), 0) };
        assert!(fd >= 0);
        // SAFETY: a fresh shared mapping of 2 pages of an empty file (accesses fault).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let slot = watch(p as usize, 8192).unwrap();
        // SAFETY: reading the watched mapping: SIGBUS, handled by covering it with ones.
        let v = unsafe { p.cast::<u32>().add(1).read_volatile() };
        assert_eq!(v, u32::MAX, "a gone BAR reads all ones");
        assert!(faulted(slot));
        // Writes go to the dummy page now.
        // SAFETY: the dummy mapping is writable.
        unsafe { p.cast::<u32>().write_volatile(7) };
        unwatch(slot);
        // SAFETY: unmapping the test mapping; closing the test memfd.
        unsafe {
            libc::munmap(p, 8192);
            libc::close(fd);
        }
    }
}
