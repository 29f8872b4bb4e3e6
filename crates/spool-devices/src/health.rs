//! A device's health cell: the state the data path obeys, and the error reports it sends.
//!
//! Owns: the per-device state word (state + epoch, one atomic the workers read per request),
//! the classification of an I/O error number into a failure class, and the queue of error
//! reports from workers to whoever runs the state machine (the `spool-health` monitor).
//!
//! Must not know: policy (thresholds, timeouts, what to do about a class): the monitor
//! decides; workers only obey the state. The one transition taken here is Healthy →
//! Resetting on a path error, so that every worker holds new I/O at once instead of waiting
//! for the monitor to notice.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

/// What the data path does with I/O for a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum HealthState {
    /// Submit.
    Healthy = 0,
    /// Hold new and failed I/O (the guest sees latency, not errors) until the device is
    /// healthy again or declared failed.
    Resetting = 1,
    /// Isolated after a media error or a failed reset: fail its I/O with an I/O error.
    Failed = 2,
    /// Gone (hot-removed, file deleted): fail its I/O with an I/O error.
    Removed = 3,
}

impl HealthState {
    fn from_bits(b: u64) -> HealthState {
        match b & 0xff {
            0 => HealthState::Healthy,
            1 => HealthState::Resetting,
            2 => HealthState::Failed,
            _ => HealthState::Removed,
        }
    }

    /// Lower-case name, as shown over RPC.
    pub fn name(self) -> &'static str {
        match self {
            HealthState::Healthy => "healthy",
            HealthState::Resetting => "resetting",
            HealthState::Failed => "failed",
            HealthState::Removed => "removed",
        }
    }

    /// Whether I/O to the device must fail at once.
    pub fn isolated(self) -> bool {
        matches!(self, HealthState::Failed | HealthState::Removed)
    }
}

/// The failure class of one I/O error.
///
/// Linux's block layer maps its status codes to errnos (`blk_errors[]` in block/blk-core.c):
/// BLK_STS_MEDIUM → ENODATA (the NVMe driver's unrecovered read, write fault, unwritten
/// block), BLK_STS_PROTECTION → EILSEQ (end-to-end protection check failed),
/// BLK_STS_TRANSPORT → ENOLINK (host path error), BLK_STS_TIMEOUT → ETIMEDOUT,
/// BLK_STS_OFFLINE/removed queues → ENODEV/ENXIO, and everything the driver could not name →
/// EIO. EIO is therefore ambiguous; it is treated as a path error (reset and retry), and a
/// request that keeps failing after the device has been reset and answers probes is then
/// failed on its own (the monitor counts it), which is the evidence a plain errno cannot give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The medium cannot return or keep the data: isolate the device.
    Media,
    /// The path to the device (link, controller, transport) failed: hold, reset, resubmit.
    Path,
    /// The device is gone.
    Gone,
    /// The request itself was refused (bad range, unsupported, no space): fail it alone.
    Request,
}

impl ErrorClass {
    /// The class of a positive errno.
    pub fn of_errno(errno: i32) -> ErrorClass {
        match errno {
            libc::ENODATA | libc::EILSEQ | libc::EBADMSG | libc::EREMOTEIO => ErrorClass::Media,
            libc::EIO
            | libc::ENOLINK
            | libc::ETIMEDOUT
            | libc::ECANCELED
            | libc::EAGAIN
            | libc::EBUSY
            | libc::ECONNRESET
            | libc::ENOTCONN
            | libc::ECONNREFUSED
            | libc::EPIPE
            | libc::EHOSTUNREACH
            | libc::ENETUNREACH
            | libc::EBADE => ErrorClass::Path,
            libc::ENODEV | libc::ENXIO | libc::ESHUTDOWN | libc::ESTALE => ErrorClass::Gone,
            _ => ErrorClass::Request,
        }
    }

    /// Lower-case name, as shown over RPC.
    pub fn name(self) -> &'static str {
        match self {
            ErrorClass::Media => "media",
            ErrorClass::Path => "path",
            ErrorClass::Gone => "gone",
            ErrorClass::Request => "request",
        }
    }
}

/// What went wrong, as a worker saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// A completion carried this errno.
    Errno(i32),
    /// A request stayed in flight longer than the I/O timeout.
    Timeout,
}

/// One report from the data path.
#[derive(Debug, Clone, Copy)]
pub struct ErrorReport {
    pub signal: Signal,
    /// Device byte offset and length of the failed piece (0, 0 when unknown).
    pub offset: u64,
    pub len: u64,
    pub write: bool,
}

impl ErrorReport {
    /// The report's failure class.
    pub fn class(&self) -> ErrorClass {
        match self.signal {
            Signal::Errno(e) => ErrorClass::of_errno(e),
            Signal::Timeout => ErrorClass::Path,
        }
    }
}

const REPORT_QUEUE_MAX: usize = 1024;
const EPOCH_SHIFT: u32 = 8;

/// The health cell of one device, shared by its workers and its monitor.
#[derive(Debug, Default)]
pub struct DeviceHealth {
    /// State in the low 8 bits, epoch (bumped on every change) above.
    word: AtomicU64,
    reports: Mutex<VecDeque<ErrorReport>>,
    dropped: AtomicU64,
    wake: Condvar,
}

impl DeviceHealth {
    /// The state and its epoch (which changes with every transition).
    #[inline]
    pub fn load(&self) -> (HealthState, u64) {
        let w = self.word.load(Ordering::Acquire);
        (HealthState::from_bits(w), w >> EPOCH_SHIFT)
    }

    /// The state.
    #[inline]
    pub fn state(&self) -> HealthState {
        self.load().0
    }

    /// Moves to `to` unconditionally; returns the previous state.
    pub fn set(&self, to: HealthState) -> HealthState {
        let mut cur = self.word.load(Ordering::Acquire);
        loop {
            let next = (((cur >> EPOCH_SHIFT) + 1) << EPOCH_SHIFT) | to as u64;
            match self
                .word
                .compare_exchange(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return HealthState::from_bits(cur),
                Err(c) => cur = c,
            }
        }
    }

    /// Moves `from` → `to` if the state is still `from`.
    pub fn transition(&self, from: HealthState, to: HealthState) -> bool {
        let cur = self.word.load(Ordering::Acquire);
        if HealthState::from_bits(cur) != from {
            return false;
        }
        let next = (((cur >> EPOCH_SHIFT) + 1) << EPOCH_SHIFT) | to as u64;
        self.word
            .compare_exchange(cur, next, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Called by a worker for a failed or timed-out piece of I/O. A path error or a timeout
    /// on a healthy device holds the device's I/O at once (Healthy → Resetting); everything
    /// else waits for the monitor.
    ///
    /// The state change and the report are made under one lock, the one
    /// [`DeviceHealth::take_reports_with_state`] reads both under: a monitor never sees a
    /// device this report made resetting without seeing the report too (it would reset the
    /// device for nothing, then again for the report).
    pub fn report(&self, r: ErrorReport) {
        let mut q = self.reports.lock().unwrap_or_else(|p| p.into_inner());
        if r.class() == ErrorClass::Path {
            self.transition(HealthState::Healthy, HealthState::Resetting);
        }
        if q.len() >= REPORT_QUEUE_MAX {
            q.pop_front();
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        q.push_back(r);
        drop(q);
        self.wake.notify_all();
    }

    /// Takes every waiting report (and how many were dropped because nobody read them).
    pub fn take_reports(&self) -> (Vec<ErrorReport>, u64) {
        let mut q = self.reports.lock().unwrap_or_else(|p| p.into_inner());
        (
            q.drain(..).collect(),
            self.dropped.swap(0, Ordering::Relaxed),
        )
    }

    /// Takes every waiting report, how many were dropped, and the state the device was in
    /// when they were taken (read under the lock [`DeviceHealth::report`] changes it under):
    /// a device that was healthy then and is resetting later has a report still waiting.
    pub fn take_reports_with_state(&self) -> (HealthState, Vec<ErrorReport>, u64) {
        let mut q = self.reports.lock().unwrap_or_else(|p| p.into_inner());
        let state = self.state();
        (
            state,
            q.drain(..).collect(),
            self.dropped.swap(0, Ordering::Relaxed),
        )
    }

    /// Waits up to `timeout` for a report.
    pub fn wait_report(&self, timeout: std::time::Duration) {
        let q = self.reports.lock().unwrap_or_else(|p| p.into_inner());
        if q.is_empty() {
            let _ = self.wake.wait_timeout(q, timeout);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_follow_the_block_layer() {
        assert_eq!(ErrorClass::of_errno(libc::ENODATA), ErrorClass::Media);
        assert_eq!(ErrorClass::of_errno(libc::EILSEQ), ErrorClass::Media);
        assert_eq!(ErrorClass::of_errno(libc::EIO), ErrorClass::Path);
        assert_eq!(ErrorClass::of_errno(libc::ENOLINK), ErrorClass::Path);
        assert_eq!(ErrorClass::of_errno(libc::ETIMEDOUT), ErrorClass::Path);
        assert_eq!(ErrorClass::of_errno(libc::ENODEV), ErrorClass::Gone);
        assert_eq!(ErrorClass::of_errno(libc::ENOSPC), ErrorClass::Request);
        assert_eq!(ErrorClass::of_errno(libc::EINVAL), ErrorClass::Request);
    }

    #[test]
    fn path_reports_hold_io_at_once_and_epochs_move() {
        let h = DeviceHealth::default();
        assert_eq!(h.load(), (HealthState::Healthy, 0));
        h.report(ErrorReport {
            signal: Signal::Errno(libc::ENODATA),
            offset: 0,
            len: 0,
            write: false,
        });
        assert_eq!(
            h.state(),
            HealthState::Healthy,
            "media waits for the monitor"
        );
        h.report(ErrorReport {
            signal: Signal::Timeout,
            offset: 0,
            len: 0,
            write: false,
        });
        assert_eq!(h.load(), (HealthState::Resetting, 1));
        assert!(!h.transition(HealthState::Healthy, HealthState::Failed));
        assert_eq!(h.set(HealthState::Healthy), HealthState::Resetting);
        assert_eq!(h.load(), (HealthState::Healthy, 2));
        assert_eq!(h.take_reports().0.len(), 2);
    }
}
