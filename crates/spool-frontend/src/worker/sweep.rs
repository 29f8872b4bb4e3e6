//! The timeout sweep's clock: a sweep runs every `io_timeout / TIMEOUT_SWEEPS` while requests
//! are in flight, each one numbered; a request submitted during sweep `n` and still in flight
//! at sweep `n + TIMEOUT_SWEEPS + 1` has been in flight for at least `io_timeout`.
//!
//! Owns: [`TimeoutSweep`]. Must not know: the requests (the in-flight table stamps each with
//! [`TimeoutSweep::count`]), devices, what a timeout does (the worker reports it).

use std::time::{Duration, Instant};

use super::TIMEOUT_SWEEPS;

/// When the next sweep is due, and how many ran (module doc).
pub(super) struct TimeoutSweep {
    /// How long a request may be in flight before it is reported.
    pub(super) io_timeout: Duration,
    /// Sweeps run so far (wrapping); requests are stamped with it.
    pub(super) count: u32,
    /// When the last one ran (or, with nothing in flight, when that was last seen).
    pub(super) last: Instant,
}

impl TimeoutSweep {
    pub(super) fn new(io_timeout: Duration) -> Self {
        TimeoutSweep {
            io_timeout,
            count: 0,
            last: Instant::now(),
        }
    }

    /// The number of the sweep to run now, if one is due; `busy`: requests are in flight
    /// (with none, no sweep is due, and the next comes a full interval after the first).
    pub(super) fn due(&mut self, busy: bool) -> Option<u32> {
        let now = Instant::now();
        if !busy {
            self.last = now;
            return None;
        }
        if now.duration_since(self.last) < self.io_timeout / TIMEOUT_SWEEPS {
            return None;
        }
        self.last = now;
        self.count = self.count.wrapping_add(1);
        Some(self.count)
    }

    /// Milliseconds between sweeps (1 to 1000): how long the worker may sleep while busy.
    pub(super) fn interval_ms(&self) -> i32 {
        (self.io_timeout.as_millis() as u32 / TIMEOUT_SWEEPS).clamp(1, 1000) as i32
    }
}
