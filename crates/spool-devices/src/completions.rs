//! Completions that arrive on threads other than the worker's (a network library's callback,
//! a connection's reader thread): a list the worker reaps, and an eventfd signalled only
//! while the worker sleeps, as the queues of RBD and NBD devices need.
//!
//! Owns: the list, the wake-up. Must not know: what completed.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Completions handed over between threads.
#[derive(Debug)]
pub(crate) struct Completions {
    done: Mutex<Vec<(u64, i32)>>,
    /// The worker wants the eventfd signalled (it is about to sleep).
    notify: AtomicBool,
    event: File,
}

impl Completions {
    pub(crate) fn new() -> std::io::Result<Completions> {
        Ok(Completions {
            done: Mutex::new(Vec::with_capacity(256)),
            notify: AtomicBool::new(false),
            event: crate::queue::completion_eventfd()?,
        })
    }

    /// Operation `tag` finished with `res`.
    pub(crate) fn push(&self, tag: u64, res: i32) {
        self.done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((tag, res));
        if self.notify.load(Ordering::SeqCst) {
            let _ = (&self.event).write(&1u64.to_ne_bytes());
        }
    }

    /// Moves what finished into `out`; false when nothing did.
    pub(crate) fn take_into(&self, out: &mut Vec<(u64, i32)>) -> bool {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        if done.is_empty() {
            return false;
        }
        out.append(&mut done);
        true
    }

    /// The queue's completion descriptor.
    pub(crate) fn fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    /// Resets the descriptor's readiness (non-blocking: nothing to read is fine).
    pub(crate) fn ack(&self) {
        let _ = (&self.event).read(&mut [0u8; 8]);
    }

    /// Whether completions signal the descriptor. The worker reaps after turning them on,
    /// so a completion that came in between is never left unsignalled.
    pub(crate) fn set_notify(&self, enabled: bool) {
        self.notify.store(enabled, Ordering::SeqCst);
    }
}
