//! [`Locked`]: a value on the heap whose pages are locked in memory (`mlock`: never written
//! to swap) and left out of core dumps (`MADV_DONTDUMP`), for keys and the ciphers made from
//! them. The value's own `Drop` zeroes it (keys here, round keys in the `aes` crate).
//!
//! Locking is best effort: past `RLIMIT_MEMLOCK` the value is still used, and one warning
//! says so.
//!
//! [`scrubbed`]: code that builds key schedules (the `aes` crate computes them on the stack
//! and returns them by value, through several frames) runs below a frame of its own, and the
//! stack it used is overwritten once it returns, so no copy stays behind in memory that a
//! core dump includes.
//!
//! Must not know: what the value is.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

/// A heap value kept out of swap and core dumps.
pub struct Locked<T> {
    value: Box<T>,
}

static WARNED: AtomicBool = AtomicBool::new(false);

impl<T> Locked<T> {
    pub fn new(value: T) -> Locked<T> {
        let value = Box::new(value);
        let (start, len) = pages(&*value);
        if len > 0 {
            // SAFETY: system calls on the pages of a live allocation of ours; they change
            // only how the kernel treats those pages (kept resident, not dumped), never their
            // contents, and other allocations sharing the pages are affected the same way.
            let locked = unsafe { libc::mlock(start as *const libc::c_void, len) } == 0;
            // SAFETY: as above.
            unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTDUMP) };
            if !locked && !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    error = %std::io::Error::last_os_error(),
                    "cannot lock key memory; keys may reach swap (raise LimitMEMLOCK=)"
                );
            }
        }
        Locked { value }
    }
}

/// The page-aligned range covering `v`.
fn pages<T>(v: &T) -> (usize, usize) {
    let size = std::mem::size_of::<T>();
    if size == 0 {
        return (0, 0);
    }
    let page = 4096usize;
    let a = v as *const T as usize;
    let start = a & !(page - 1);
    let end = (a + size).next_multiple_of(page);
    (start, end - start)
}

impl<T> Drop for Locked<T> {
    fn drop(&mut self) {
        let (start, len) = pages(&*self.value);
        if len > 0 {
            // SAFETY: the allocation is still live (the box is freed after this); munlock
            // changes no contents. Locks do not stack: a page shared with another locked value
            // is unlocked early, which costs only the guarantee, never memory safety.
            unsafe { libc::munlock(start as *const libc::c_void, len) };
        }
    }
}

impl<T> std::fmt::Debug for Locked<T> {
    /// Never the value (a key).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Locked(..)")
    }
}

impl<T> Deref for Locked<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> DerefMut for Locked<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.value
    }
}

/// Bytes of stack [`scrubbed`] overwrites below its frame: far more than key setup uses
/// (the `aes` crate's deepest path takes a few KiB).
const SCRUB_BYTES: usize = 32 << 10;

/// Runs `f` and returns its result (which must own no key material by value: a [`Locked`]
/// box, a flag), then overwrites the stack `f` used. For key setup, whose intermediate
/// copies on the stack would otherwise outlive it.
#[inline(never)]
pub fn scrubbed<R>(f: impl FnOnce() -> R) -> R {
    let r = below(f);
    scrub();
    r
}

/// A frame under [`scrubbed`]'s, where `f` runs.
#[inline(never)]
fn below<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Overwrites [`SCRUB_BYTES`] of stack starting where [`below`]'s frame was.
#[inline(never)]
fn scrub() {
    let mut area = [0u8; SCRUB_BYTES];
    // Volatile writes: not optimised away although nothing reads them.
    zeroize::Zeroize::zeroize(&mut area[..]);
    std::hint::black_box(&area);
}

/// [`scrubbed`] for the data path, per request: `f` runs, then `N` bytes of stack from where
/// its frame was are zeroed with an ordinary (vectorised) fill, kept by `black_box` from
/// being optimised away; a few tens of nanoseconds where `scrubbed`'s volatile bytes take
/// microseconds. `N` covers the deepest frame of the cipher call `f` makes (measured by
/// `keys.rs`'s test, which fails if a round key is left below).
#[inline(always)]
pub(crate) fn scrubbed_fast<const N: usize, R>(f: impl FnOnce() -> R) -> R {
    let r = below(f);
    scrub_fast::<N>();
    r
}

#[inline(never)]
fn scrub_fast<const N: usize>() {
    let mut area = std::mem::MaybeUninit::<[u8; N]>::uninit();
    // SAFETY: N bytes of this frame's own array, written as bytes.
    unsafe { std::ptr::write_bytes(area.as_mut_ptr().cast::<u8>(), 0, N) };
    std::hint::black_box(&mut area);
}
