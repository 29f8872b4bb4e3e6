//! SIGBUS safety for shared mappings whose backing another party controls: guest memory (a
//! frontend can truncate the memfd it gave us) and device BARs (a device can go away).
//!
//! Owns: the process's one SIGBUS handler and the table of watched mappings. A load or store
//! to a watched mapping that faults does not kill the process (and every tenant with it): the
//! handler maps anonymous memory filled with the mapping's fill byte over the whole mapping
//! (0x00 for guest memory, 0xff for a BAR: a gone PCIe device reads all ones), flags the
//! watch and returns, so the access is retried on the dummy memory. The owner polls
//! [`Watch::faulted`] (or the cheap process-wide [`faults`] counter first) and fails only what
//! depended on that mapping. A fault anywhere else is not ours: the default action is
//! restored and the access faults again, as without this crate.
//!
//! It also keeps crash marks (`mark_on_crash`): bytes of shared memory set when the process
//! dies of a fault, so the next process can tell a crash from being killed.
//!
//! Must not know: what the mappings are (guests, devices, sessions); that is the owner's.
//!
//! The handler only reads atomics, calls mmap and writes memory it just mapped, which is
//! async-signal-safe in practice on Linux. An owner must drop its [`Watch`] (or call
//! [`unwatch`]) before it unmaps the range, so the handler never covers an address that has
//! been reused for something else.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Once;

/// Watched mappings at most (guest regions of every session plus BARs). A mapping that finds
/// no free slot is not watched: a fault on it is fatal, as without this crate.
pub const SLOTS: usize = 16384;

struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    fill: AtomicU8,
    /// Set when the handler begins on the mapping, before it covers it (see [`Watch::hit`]).
    hit: AtomicBool,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    fill: AtomicU8::new(0),
    hit: AtomicBool::new(false),
    faulted: AtomicBool::new(false),
};
static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];
/// One past the highest slot ever used: the handler scans no further.
static HIGH: AtomicUsize = AtomicUsize::new(0);
/// Faults handled so far, process-wide.
static FAULTS: AtomicU64 = AtomicU64::new(0);
/// Faults begun so far, process-wide: counted before the cover, like each slot's `hit`.
static HITS: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();

/// Maps anonymous memory filled with `fill` over `[start, start+len)`; true on success.
///
/// # Safety
/// `[start, start+len)` must be a mapping of this process that the caller owns and that
/// nothing unmaps concurrently; whatever referenced its old contents now sees `fill` bytes.
pub unsafe fn cover(start: usize, len: usize, fill: u8) -> bool {
    // SAFETY: replaces the caller-owned mapping in place (MAP_FIXED), per the contract.
    let p = unsafe {
        libc::mmap(
            start as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return false;
    }
    if fill != 0 {
        // SAFETY: the fresh anonymous mapping is `len` writable bytes.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), fill, len) };
    }
    true
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    let high = HIGH.load(Ordering::Acquire).min(SLOTS);
    for s in TABLE[..high].iter() {
        let start = s.start.load(Ordering::Acquire);
        let len = s.len.load(Ordering::Acquire);
        if start != 0 && start != usize::MAX && addr >= start && addr - start < len {
            // SAFETY: `start` is loaded (Acquire) before `len`, which `watch` stores before
            // `start`, so both are one watch's; owners clear the slot before unmapping and
            // touch nothing there meanwhile, so a fault here means it is still live.
            s.hit.store(true, Ordering::SeqCst);
            HITS.fetch_add(1, Ordering::SeqCst);
            if unsafe { cover(start, len, s.fill.load(Ordering::Acquire)) } {
                s.faulted.store(true, Ordering::Release);
                FAULTS.fetch_add(1, Ordering::AcqRel);
                return;
            }
        }
    }
    // Not a watched mapping (or the cover failed): the process dies of it. The default
    // action happens on the re-executed access.
    set_crash_marks();
    // SAFETY: resetting a signal disposition; no memory is involved.
    unsafe { libc::signal(sig, libc::SIG_DFL) };
}

/// Crash marks: bytes (in shared memory that outlives the process) set to 1 when the process
/// dies of a fault. A replayed request that kills the process leaves its mark for the next.
const MARKS: usize = 1024;
#[allow(clippy::declare_interior_mutable_const)]
const NO_MARK: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
static MARK_TABLE: [AtomicPtr<u8>; MARKS] = [NO_MARK; MARKS];
static FATAL_INSTALL: Once = Once::new();

fn set_crash_marks() {
    for m in MARK_TABLE.iter() {
        let p = m.load(Ordering::Acquire);
        if !p.is_null() {
            // SAFETY: a registered mark is a live byte of shared memory its owner keeps mapped
            // until it withdraws the registration (`unmark_on_crash`) first.
            unsafe { std::ptr::write_volatile(p, 1) };
        }
    }
}

extern "C" fn on_fatal(sig: libc::c_int) {
    set_crash_marks();
    // The default action (terminate, dump core) happens when the faulting instruction runs
    // again, or when abort() raises again.
    // SAFETY: resetting a signal disposition; no memory is involved.
    unsafe { libc::signal(sig, libc::SIG_DFL) };
}

fn install_fatal() {
    FATAL_INSTALL.call_once(|| {
        install();
        for sig in [libc::SIGSEGV, libc::SIGABRT, libc::SIGILL, libc::SIGFPE] {
            // SAFETY: a zeroed sigaction is valid; we fill handler, flags and an empty mask.
            let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
            sa.sa_sigaction = on_fatal as *const () as usize;
            sa.sa_flags = libc::SA_ONSTACK;
            // SAFETY: sigemptyset writes the mask inside our struct; sigaction reads it.
            unsafe {
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    });
}

/// Sets `*mark = 1` if the process dies of a fault (SIGSEGV, SIGBUS outside watched
/// mappings, SIGABRT including panics that abort, SIGILL, SIGFPE); not on SIGKILL. Returns
/// the registration, or None when the table is full.
///
/// # Safety
/// `mark` must stay a valid, writable byte until [`unmark_on_crash`] is called with the
/// returned slot.
pub unsafe fn mark_on_crash(mark: *mut u8) -> Option<usize> {
    install_fatal();
    for (i, m) in MARK_TABLE.iter().enumerate() {
        if m.compare_exchange(
            std::ptr::null_mut(),
            mark,
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_ok()
        {
            return Some(i);
        }
    }
    None
}

/// Withdraws a crash mark (before its memory goes away).
pub fn unmark_on_crash(slot: usize) {
    if let Some(m) = MARK_TABLE.get(slot) {
        m.store(std::ptr::null_mut(), Ordering::Release);
    }
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
                eprintln!(
                    "spoold: cannot install the SIGBUS handler: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    });
}

/// Watches `[start, start+len)`; a fault in it is covered with `fill` bytes. Returns the
/// slot, or None when every slot is taken (then a fault on it is fatal).
pub fn watch(start: usize, len: usize, fill: u8) -> Option<usize> {
    if start == 0 || len == 0 {
        return None;
    }
    install();
    for (i, s) in TABLE.iter().enumerate() {
        if s.start
            .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            s.len.store(len, Ordering::Release);
            s.fill.store(fill, Ordering::Release);
            s.hit.store(false, Ordering::Release);
            s.faulted.store(false, Ordering::Release);
            s.start.store(start, Ordering::Release);
            HIGH.fetch_max(i + 1, Ordering::AcqRel);
            return Some(i);
        }
    }
    None
}

/// Whether the mapping in `slot` faulted (and is now covered by dummy memory).
pub fn faulted(slot: usize) -> bool {
    TABLE
        .get(slot)
        .is_some_and(|s| s.faulted.load(Ordering::Acquire))
}

/// Whether a fault on the mapping in `slot` began: set before the handler covers it, so a
/// store that landed in the cover is always followed by a `hit` that reads true (a store
/// into the mapping, a `SeqCst` fence, then `hit`). For writers that must never report a
/// store into dummy memory as done.
pub fn hit(slot: usize) -> bool {
    TABLE
        .get(slot)
        .is_some_and(|s| s.hit.load(Ordering::SeqCst))
}

/// Faults begun so far in this process (see [`hit`]): 0 means no watched mapping was ever
/// covered, so no copy can have read or written a cover.
#[inline]
pub fn hits() -> u64 {
    HITS.load(Ordering::SeqCst)
}

/// Whether `[start, start+len)` overlaps a watched mapping a fault hit: its bytes there may
/// be the cover's, not the owner's. A scan of the slots in use: for after [`hits`] said so.
pub fn hit_in(start: usize, len: usize) -> bool {
    let high = HIGH.load(Ordering::Acquire).min(SLOTS);
    TABLE[..high].iter().any(|s| {
        let (a, l) = (
            s.start.load(Ordering::Acquire),
            s.len.load(Ordering::Acquire),
        );
        a != 0
            && a != usize::MAX
            && s.hit.load(Ordering::SeqCst)
            && start < a.saturating_add(l)
            && a < start.saturating_add(len)
    })
}

/// Stops watching `slot` (before the mapping is unmapped).
pub fn unwatch(slot: usize) {
    if let Some(s) = TABLE.get(slot) {
        s.start.store(0, Ordering::Release);
    }
}

/// Faults handled so far in this process: one relaxed load tells a poller whether any
/// watched mapping faulted since it last looked.
#[inline]
pub fn faults() -> u64 {
    FAULTS.load(Ordering::Relaxed)
}

/// A watched mapping, unwatched on drop (drop it before unmapping).
#[derive(Debug)]
pub struct Watch {
    slot: Option<usize>,
}

impl Watch {
    /// Watches `[start, start+len)` with `fill` as the cover byte. A watch that found no
    /// slot is inert (`is_watched` is false).
    pub fn new(start: usize, len: usize, fill: u8) -> Watch {
        Watch {
            slot: watch(start, len, fill),
        }
    }

    /// Whether a fault on the mapping is survived.
    pub fn is_watched(&self) -> bool {
        self.slot.is_some()
    }

    /// Whether the mapping faulted (its contents are now dummy memory).
    pub fn faulted(&self) -> bool {
        self.slot.is_some_and(faulted)
    }

    /// Whether a fault on the mapping began (see [`hit`]); true for an unwatched mapping,
    /// whose stores cannot be vouched for.
    pub fn hit(&self) -> bool {
        self.slot.is_none_or(hit)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(s) = self.slot {
            unwatch(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The watch slots are one table for the process: tests that take slots run one at a
    /// time, or one's slot shows up in the other's (a CI run failed that way: the slot a
    /// test freed was taken by the test beside it before it took it again).
    static SLOTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A real SIGBUS: a shared mapping of a memfd beyond its end faults on access (as a BAR
    /// does when its device is gone, and guest memory does when the frontend truncates it).
    fn beyond_end(pages: usize) -> (libc::c_int, *mut libc::c_void) {
        // SAFETY: memfd_create with a static name; checked.
        let fd = unsafe { libc::memfd_create(c"spool-sigbus-test".as_ptr(), 0) };
        assert!(fd >= 0);
        // SAFETY: a fresh shared mapping of an empty file (accesses fault).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096 * pages,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        (fd, p)
    }

    #[test]
    fn a_fault_on_a_watched_mapping_is_survived_with_its_fill() {
        let _alone = SLOTS.lock().unwrap_or_else(|p| p.into_inner());
        for fill in [0xffu8, 0x00] {
            let (fd, p) = beyond_end(2);
            let before = faults();
            let w = Watch::new(p as usize, 8192, fill);
            assert!(w.is_watched());
            // SAFETY: reading the watched mapping: SIGBUS, handled by covering it.
            let v = unsafe { p.cast::<u32>().add(1).read_volatile() };
            assert_eq!(v, u32::from_ne_bytes([fill; 4]));
            assert!(w.faulted());
            assert!(faults() > before);
            // Writes go to the dummy memory now.
            // SAFETY: the dummy mapping is writable.
            unsafe { p.cast::<u32>().write_volatile(7) };
            drop(w);
            // SAFETY: unmapping the test mapping; closing the test memfd.
            unsafe {
                libc::munmap(p, 8192);
                libc::close(fd);
            }
        }
    }

    #[test]
    fn slots_are_reused_after_unwatch() {
        let _alone = SLOTS.lock().unwrap_or_else(|p| p.into_inner());
        let a = Watch::new(0x1000, 4096, 0);
        let slot = a.slot.unwrap();
        drop(a);
        let b = Watch::new(0x2000, 4096, 0);
        assert_eq!(b.slot, Some(slot));
        assert!(!Watch::new(0, 4096, 0).is_watched());
    }
}
