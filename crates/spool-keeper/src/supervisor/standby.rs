//! The standby worker: a worker process started ahead of need, which has been through
//! fork, exec, dynamic loading and its own start-up up to `Hello`, and then waits (blocked
//! on the channel) for the store. When the serving worker dies the keeper hands the store to
//! the standby instead of starting a process, taking process start-up off the restart's
//! critical path: on a busy host that start-up was the largest and most variable phase.
//!
//! Owns: when a standby is started (a worker serves, no upgrade runs, not shutting down) and
//! replaced (the binary changed), its promotion and its death.
//! Must not know: the upgrade's stages (it only stays out of their way).

use std::time::{Duration, Instant};

use super::child::{kill, Start};
use super::Keeper;

/// After a standby died on its own, wait this long before starting another.
const RETRY: Duration = Duration::from_secs(1);

impl Keeper {
    /// Starts a standby if the keeper is steady and has none (called every loop tick).
    pub(super) fn keep_standby(&mut self) {
        if !self.cfg.standby
            || self.standby.is_some()
            || self.up.is_some()
            || self.shutting_down.is_some()
            || self.standby_retry.is_some_and(|t| Instant::now() < t)
        {
            return;
        }
        let Some(binary) = self
            .worker
            .as_ref()
            .filter(|w| w.ready)
            .map(|w| w.binary.clone())
        else {
            return;
        };
        match self.spawn(&binary, "worker", None) {
            Ok(c) => {
                tracing::debug!(pid = c.pid, "keeper: standby worker started");
                self.standby = Some(c);
            }
            Err(e) => {
                tracing::warn!("keeper: cannot start a standby worker: {e}");
                self.standby_retry = Some(Instant::now() + RETRY);
            }
        }
    }

    /// Hands the store to the standby (if one of `binary` has said hello) to serve after
    /// `start`; gives `start` back when there is none.
    pub(super) fn promote_standby(
        &mut self,
        binary: &std::path::Path,
        start: Start,
    ) -> Result<(), Start> {
        let ready = self
            .standby
            .as_ref()
            .is_some_and(|s| s.hello.is_some() && s.binary == binary);
        if !ready {
            self.drop_standby();
            return Err(start);
        }
        let Some(mut s) = self.standby.take() else {
            return Err(start);
        };
        s.start = Some(start);
        s.promoted = true;
        let id = s.id;
        self.worker = Some(s);
        self.hand_over_to_worker(id);
        Ok(())
    }

    /// Stops the standby (shutdown, upgrade, a binary that changed).
    pub(super) fn drop_standby(&mut self) {
        if let Some(s) = self.standby.take() {
            kill(s.pid);
            self.retiring.push(s.id);
        }
    }

    /// A child exited: true if it was the standby (started again later).
    pub(super) fn standby_exited(&mut self, id: u64, status: &std::process::ExitStatus) -> bool {
        if self.standby.as_ref().is_none_or(|s| s.id != id) {
            return false;
        }
        tracing::warn!(
            "keeper: the standby worker exited ({}); starting another in {} s",
            super::status_text(status),
            RETRY.as_secs()
        );
        self.standby = None;
        self.standby_retry = Some(Instant::now() + RETRY);
        true
    }
}
