//! A worker's life outside upgrades: handing it the store when it says hello, its restart
//! report when it is ready, and what its exit means: the end of the keeper (shutdown), the
//! next upgrade step, or a crash restart with the kept descriptors.
//!
//! Owns: crash accounting (workers that die before they serve, within `crash_window`) and the
//! restart reports of first starts, crash restarts and rollbacks.
//!
//! Must not know: the upgrade's stages beyond "the old worker is stopping".

use std::process::ExitCode;
use std::time::Instant;

use serde_json::Value;

use super::child::Start;
use super::upgrade::Stage;
use super::{phase_text, reply, status_text, Keeper, Refused};
use crate::now_us;
use crate::proto::{Phase, RestartReport, StartInfo};

impl Keeper {
    /// A worker started to serve said hello: it gets the store (and why it was started).
    pub(super) fn hand_over_to_worker(&mut self, id: u64) {
        let Some(mut start) = self.child(id).and_then(|c| c.start.take()) else {
            return;
        };
        let (spawned, promoted) = self
            .child(id)
            .map(|c| (c.spawned.elapsed(), c.promoted))
            .unwrap_or_default();
        if promoted {
            // The standby's process start-up happened long before, off the critical path.
            start
                .phases
                .push(Phase::new("wake standby", start.began.elapsed()));
        } else {
            start.phases.push(Phase::new("spawn worker", spawned));
        }
        let t = Instant::now();
        self.generation += 1;
        self.publish_store();
        let info = StartInfo {
            keeper_pid: std::process::id(),
            generation: self.generation,
            reason: start.reason.clone(),
            last_restart: self.last_report.clone(),
            restart_began_us: start.began_us,
            alive_every_ms: (self.cfg.worker_watchdog / 4).as_millis() as u64,
        };
        if let Err(e) = self.hand_over(id, info) {
            tracing::error!("keeper: handing over to the worker failed: {e}");
        }
        start
            .phases
            .push(Phase::new("hand over descriptors", t.elapsed()));
        if let Some(c) = self.child(id) {
            c.start = Some(start);
        }
    }

    /// A worker (or the upgrade's candidate) reports ready: it serves; a restart's report is
    /// recorded and its RPC, if any, answered.
    pub(super) fn ready(&mut self, id: u64, phases: Vec<Phase>) {
        if self.is_cand(id) {
            self.candidate_ready(phases);
            return;
        }
        let Some(w) = self.worker.as_mut().filter(|w| w.id == id) else {
            return;
        };
        w.ready = true;
        let pid = w.pid;
        self.last_ready_pid = Some(pid);
        let binary = w.binary.display().to_string();
        if let Some(start) = w.start.take() {
            if start.reason == "first-start" {
                self.sd_notify(&format!("READY=1\nSTATUS=serving (worker {pid})"));
                return;
            }
            let mut all = start.phases;
            all.extend(phases);
            let report = RestartReport {
                counts: Default::default(),
                history: Default::default(),
                kind: start.reason.clone(),
                old_pid: start.old_pid,
                new_pid: pid,
                binary,
                began_us: start.began_us,
                phases: all,
                stall_ms: start.began.elapsed().as_secs_f64() * 1e3,
                outcome: match &self.last_report {
                    Some(r) if start.reason == "rollback" => r.outcome.clone(),
                    _ => "ok".into(),
                },
            };
            tracing::info!(kind = %report.kind, new_pid = pid, stall_ms = format!("{:.2}", report.stall_ms), phases = %phase_text(&report.phases), "keeper: worker restarted");
            let r = if start.reason == "rollback" {
                Err(Refused::Failed(report.outcome.clone()))
            } else {
                Ok(serde_json::to_value(&report).unwrap_or(Value::Null))
            };
            self.set_report(report);
            reply(start.reply, r);
        }
    }

    /// A child process exited; `Some` ends the keeper with that code.
    pub(super) fn exited(&mut self, id: u64, status: std::process::ExitStatus) -> Option<ExitCode> {
        if let Some(i) = self.retiring.iter().position(|&r| r == id) {
            self.retiring.remove(i);
            return None;
        }
        if self.is_cand(id) {
            self.candidate_exited(&status);
            return None;
        }
        if self.standby_exited(id, &status) {
            return None;
        }
        if !self.is_worker(id) {
            return None;
        }
        self.worker_exited(status)
    }

    /// The serving worker exited: stop with it (shutdown), go on with the upgrade (it was
    /// stopping for one), or restart it.
    fn worker_exited(&mut self, status: std::process::ExitStatus) -> Option<ExitCode> {
        let w = self.worker.as_ref()?;
        if w.exiting || self.shutting_down.is_some() {
            tracing::info!(
                pid = w.pid,
                "keeper: worker exited ({}); stopping",
                status_text(&status)
            );
            self.abort_candidate("spoold is shutting down");
            return Some(if status.success() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            });
        }
        let (old_pid, binary) = (w.pid, w.binary.clone());
        let why = format!(
            "worker {} died ({}){}",
            w.pid,
            status_text(&status),
            w.failed
                .as_ref()
                .map(|f| format!(": {f}"))
                .unwrap_or_default()
        );
        if let Some(u) = self.up.as_ref().filter(|u| u.stage == Stage::Quiesce) {
            if !u.old_quiesced {
                tracing::warn!("keeper: {why} while stopping for the upgrade; the new worker recovers from the journals");
            }
            self.old_stopped();
            return None;
        }
        self.worker = None;
        if self.up.is_some() {
            self.abort_candidate_then(&why, "restarting it with the kept descriptors");
        }
        tracing::warn!("keeper: {why}; restarting it with the kept descriptors");
        self.sd_notify(&format!("STATUS=restarting the worker: {why}"));
        let now = Instant::now();
        if self.gives_up(old_pid, now) {
            return Some(ExitCode::FAILURE);
        }
        let start = Start {
            reason: "crash-restart".into(),
            began_us: now_us(),
            began: now,
            old_pid,
            phases: vec![],
            reply: None,
        };
        let start = match self.promote_standby(&binary, start) {
            Ok(()) => return None,
            Err(start) => start,
        };
        match self.spawn(&binary, "worker", Some(start)) {
            Ok(c) => {
                self.worker = Some(c);
                None
            }
            Err(e) => {
                tracing::error!("keeper: cannot restart the worker: {e}");
                Some(ExitCode::FAILURE)
            }
        }
    }

    /// Counts the death of worker `old_pid` at `now`; true (logged) when workers keep dying
    /// before they serve and the keeper should give up.
    fn gives_up(&mut self, old_pid: u32, now: Instant) -> bool {
        // A worker that served and then died is always restarted (the journal makes that
        // safe); only workers that keep dying before they serve count towards giving up.
        let was_ready = self.last_ready_pid == Some(old_pid);
        if was_ready {
            self.crashes.clear();
        } else {
            self.crashes.push_back(now);
        }
        while self
            .crashes
            .front()
            .is_some_and(|t| now.duration_since(*t) > self.cfg.crash_window)
        {
            self.crashes.pop_front();
        }
        if self.crashes.len() >= self.cfg.max_crashes {
            tracing::error!(
                failures = self.crashes.len(),
                "keeper: the worker keeps dying before it serves; giving up (VMs reconnect when spoold is started again)"
            );
            return true;
        }
        false
    }
}
