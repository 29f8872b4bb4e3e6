//! [`Admission`]: whether a new frontend may connect to a volume now. An operation that must
//! not run under a connected VM (a revert changes the volume's data under it) closes the
//! gate with [`Admission::hold`], which fails when a frontend is connected already; one that
//! arrives while the gate is held waits (its connection accepted, its handshake not read)
//! until the operation ends. The check and the connection's start take one lock, so no
//! frontend slips in between the check and the operation.
//!
//! Owns: the gate. Must not know: what the operation is, the vhost-user protocol.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The gate of one volume's server.
#[derive(Debug, Default)]
pub struct Admission {
    /// Holds taken and not yet released.
    held: Mutex<u32>,
    opened: Condvar,
    /// A frontend is connected (set only under `held`'s lock on the way in).
    connected: Arc<AtomicBool>,
}

/// A hold on the gate: new frontends wait until it is dropped.
#[derive(Debug)]
pub struct AdmissionHold(Arc<Admission>);

impl Drop for AdmissionHold {
    fn drop(&mut self) {
        let mut held = self.0.held.lock().unwrap_or_else(|p| p.into_inner());
        *held = held.saturating_sub(1);
        drop(held);
        self.0.opened.notify_all();
    }
}

impl Admission {
    /// A gate whose connected flag is `connected`.
    pub(crate) fn new(connected: Arc<AtomicBool>) -> Arc<Admission> {
        Arc::new(Admission {
            held: Mutex::new(0),
            opened: Condvar::new(),
            connected,
        })
    }

    /// Closes the gate, unless a frontend is connected (then `None`).
    pub fn hold(self: &Arc<Self>) -> Option<AdmissionHold> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if self.connected.load(Ordering::Acquire) {
            return None;
        }
        *held += 1;
        Some(AdmissionHold(self.clone()))
    }

    /// Whether the gate is held now.
    pub(crate) fn held(&self) -> bool {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) > 0
    }

    /// A frontend comes in: waits while the gate is held, then marks the volume connected.
    /// Returns false (nothing marked) once `go_on` says the server is stopping.
    pub(crate) fn enter(&self, go_on: &dyn Fn() -> bool) -> bool {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        while *held > 0 {
            if !go_on() {
                return false;
            }
            held = (self.opened.wait_timeout(held, Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        self.connected.store(true, Ordering::Release);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hold fails under a connected frontend; a frontend arriving under a hold waits for
    /// its release, and then the next hold fails.
    #[test]
    fn a_hold_keeps_new_frontends_waiting_and_fails_under_one() {
        let connected = Arc::new(AtomicBool::new(false));
        let gate = Admission::new(connected.clone());
        let hold = gate.hold().expect("nobody is connected");
        let (g, entered) = (gate.clone(), Arc::new(AtomicBool::new(false)));
        let e = entered.clone();
        let t = std::thread::spawn(move || {
            assert!(g.enter(&|| true));
            e.store(true, Ordering::SeqCst);
        });
        // However long the holder takes, the frontend is not in while it holds.
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(5));
            assert!(!entered.load(Ordering::SeqCst));
            assert!(!connected.load(Ordering::SeqCst));
        }
        drop(hold);
        t.join().unwrap();
        assert!(connected.load(Ordering::SeqCst));
        assert!(gate.hold().is_none(), "a frontend is connected");
        // A stopping server lets a waiting frontend go without marking it.
        connected.store(false, Ordering::SeqCst);
        let _h = gate.hold().unwrap();
        assert!(!gate.enter(&|| false));
        assert!(!connected.load(Ordering::SeqCst));
    }
}
