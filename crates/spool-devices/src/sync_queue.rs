//! A device queue used synchronously, outside the data path: one command submitted and
//! waited for, into page-aligned buffers (what O_DIRECT and DMA want). For the callers that
//! need the data path's own way to a device (a mirror's copy, a thin volume written while
//! it is received from another host), not its page cache.
//!
//! Owns: the wait, and the abort of a command that does not come back. Must not know: what
//! the command is for, which device the queue is on.

use std::time::Duration;

use crate::{DeviceIo, DeviceQueue};

/// A byte buffer whose usable part is page aligned.
#[derive(Default)]
pub struct AlignedBuf {
    v: Vec<u8>,
}

impl AlignedBuf {
    const ALIGN: usize = 4096;

    /// `len` bytes, page aligned (contents unspecified).
    pub fn get(&mut self, len: usize) -> &mut [u8] {
        if self.v.len() < len + Self::ALIGN {
            self.v = vec![0; len + Self::ALIGN];
        }
        let at = self.v.as_ptr().align_offset(Self::ALIGN);
        &mut self.v[at..at + len]
    }
}

/// Submits `io` on `q` and waits for its completion, polling (every 50 µs for the first
/// few milliseconds, then every millisecond: a command that takes long costs no core);
/// returns its result (bytes or 0 on success, a negative errno on failure). A command that
/// has not come back after `abort_after` is aborted once; the wait goes on until the queue
/// gives it back. It is never given up here: a write whose fate is unknown could still land
/// after whatever the caller does next (a copy stopped, then the leg written anew), which
/// the torture tester showed as a mirror leg serving old data (seed 7017).
///
/// # Safety
///
/// The buffers `io` points at must stay valid until this call returns (it returns only once
/// the command's completion is reaped), and `q` must have no other command in flight.
pub unsafe fn run_one(q: &mut dyn DeviceQueue, io: DeviceIo, abort_after: Duration) -> i32 {
    // SAFETY: the caller keeps the buffers valid until this returns, after the completion.
    unsafe { q.submit(io, 1) };
    let t0 = std::time::Instant::now();
    let mut aborted = false;
    loop {
        let _ = q.kick();
        let mut res = None;
        q.reap(&mut |_, r| res = Some(r));
        if let Some(r) = res {
            return r;
        }
        let waited = t0.elapsed();
        std::thread::sleep(match waited < SPIN_FOR {
            true => Duration::from_micros(50),
            false => Duration::from_millis(1),
        });
        if !aborted && waited >= abort_after {
            aborted = true;
            q.abort();
        }
    }
}

/// How long [`run_one`] polls at its fastest.
const SPIN_FOR: Duration = Duration::from_millis(5);
