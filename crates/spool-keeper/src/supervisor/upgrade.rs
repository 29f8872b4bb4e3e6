//! Graceful upgrade, step by step: the candidate previews the kept state, the old worker
//! quiesces and exits, the store is handed to the candidate, the candidate serves; an upgrade
//! that fails before the old worker stopped is aborted, one that fails after is rolled back to
//! the old binary (docs/upgrade.md).
//!
//! Owns: [`Upgrade`] (the upgrade in progress, its stage, phases and RPC reply) and every
//! transition between its stages, including their deadlines.
//!
//! Must not know: what the kept values mean; crash restarts outside an upgrade.

use std::fs::File;
use std::path::PathBuf;
use std::time::Instant;

use serde_json::Value;

use super::child::{kill, Start};
use super::{reply, status_text, Keeper, Refused};
use crate::now_us;
use crate::proto::{Msg, Phase, RestartReport, StartInfo};

#[derive(PartialEq, Debug)]
pub(super) enum Stage {
    Preview,
    Quiesce,
    Handover,
}

pub(super) struct Upgrade {
    pub(super) binary: PathBuf,
    pub(super) reply: Option<(File, Value)>,
    pub(super) stage: Stage,
    pub(super) step_began: Instant,
    pub(super) prepare_began: Instant,
    pub(super) phases: Vec<Phase>,
    pub(super) began_us: u64,
    pub(super) began: Instant,
    pub(super) old_pid: u32,
    pub(super) candidate_died: Option<String>,
    /// The old worker reported `Quiesced`; its exit (which releases the devices) is next.
    pub(super) old_quiesced: bool,
}

impl Keeper {
    /// An upgrade asked for over RPC (`binary`, else the serving worker's own); the reply goes
    /// to the descriptor that came with the message.
    pub(super) fn upgrade_requested(
        &mut self,
        binary: Option<String>,
        rpc_id: Option<Value>,
        files: Vec<File>,
    ) {
        let reply_to = files.into_iter().next().zip(rpc_id);
        let b = binary.map(PathBuf::from).unwrap_or_else(|| {
            self.worker
                .as_ref()
                .map(|w| w.binary.clone())
                .unwrap_or_else(|| self.cfg.binary.clone())
        });
        self.begin_upgrade(b, reply_to);
    }

    pub(super) fn begin_upgrade(&mut self, binary: PathBuf, reply_to: Option<(File, Value)>) {
        if self.up.is_some() {
            reply(reply_to, Err(Refused::Upgrading));
            return;
        }
        if self.worker.as_ref().is_none_or(|w| !w.ready) {
            reply(reply_to, Err(Refused::NotServing));
            return;
        }
        if self.shutting_down.is_some() {
            reply(reply_to, Err(Refused::ShuttingDown));
            return;
        }
        self.drop_standby();
        match self.spawn(&binary, "candidate", None) {
            Ok(c) => {
                self.cand = Some(c);
                self.sd_notify(&format!(
                    "RELOADING=1\nSTATUS=upgrading to {}",
                    binary.display()
                ));
                self.up = Some(Upgrade {
                    binary,
                    reply: reply_to,
                    stage: Stage::Preview,
                    step_began: Instant::now(),
                    prepare_began: Instant::now(),
                    phases: vec![],
                    began_us: 0,
                    began: Instant::now(),
                    old_pid: 0,
                    candidate_died: None,
                    old_quiesced: false,
                });
            }
            Err(e) => {
                let why = format!(
                    "cannot start {}: {e}; the old worker keeps serving",
                    binary.display()
                );
                tracing::error!("keeper: upgrade aborted: {why}");
                reply(reply_to, Err(Refused::Failed(why)));
            }
        }
    }

    /// The candidate said hello: it gets a preview of the store (keys and values, no
    /// descriptors) to accept or reject.
    pub(super) fn send_preview(&mut self) {
        let entries: Vec<(String, String)> = self
            .store
            .iter()
            .map(|(k, v)| (k.clone(), v.value.clone()))
            .collect();
        let prep = self.up.as_ref().map(|u| u.prepare_began);
        if let Some(c) = &self.cand {
            if let Err(e) = c.chan.send(&Msg::Preview { entries }, &[]) {
                self.abort_candidate(&format!("cannot send the state preview: {e}"));
            }
        }
        if let (Some(u), Some(p)) = (self.up.as_mut(), prep) {
            u.phases
                .push(Phase::new("prepare (spawn new binary)", p.elapsed()));
            u.step_began = Instant::now();
        }
    }

    /// The candidate accepted the preview: the old worker is asked to quiesce.
    pub(super) fn accepted(&mut self, id: u64) {
        if !self.is_cand(id) || self.up.as_ref().map(|u| &u.stage) != Some(&Stage::Preview) {
            return;
        }
        let Some(w) = &self.worker else {
            self.abort_candidate("no worker to take over from");
            return;
        };
        let old_pid = w.pid;
        if let Err(e) = w.chan.send(&Msg::Quiesce, &[]) {
            self.abort_candidate(&format!("cannot ask the old worker to stop: {e}"));
            return;
        }
        if let Some(u) = self.up.as_mut() {
            u.phases
                .push(Phase::new("preview state", u.step_began.elapsed()));
            u.stage = Stage::Quiesce;
            u.step_began = Instant::now();
            u.began = Instant::now();
            u.began_us = now_us();
            u.old_pid = old_pid;
        }
    }

    /// The old worker stopped its queues; its exit (which releases the devices) is next.
    pub(super) fn quiesced(&mut self, id: u64, phases: Vec<Phase>) {
        if self.is_worker(id) && self.up.as_ref().map(|u| &u.stage) == Some(&Stage::Quiesce) {
            if let Some(u) = self.up.as_mut() {
                u.phases.extend(phases);
                u.phases
                    .push(Phase::new("stop old worker", u.step_began.elapsed()));
                u.step_began = Instant::now();
                u.old_quiesced = true;
            }
        }
    }

    /// Ends an upgrade before the old worker stopped: kill the candidate, answer the RPC.
    pub(super) fn abort_candidate(&mut self, why: &str) {
        self.abort_candidate_then(why, "the old worker keeps serving");
    }

    /// [`Self::abort_candidate`], saying what happens next (`then`): the old worker serves
    /// on, or (it died) is restarted.
    pub(super) fn abort_candidate_then(&mut self, why: &str, then: &str) {
        if let Some(c) = self.cand.take() {
            kill(c.pid);
            self.retiring.push(c.id);
        }
        if let Some(u) = self.up.take() {
            let why = format!("upgrade to {} aborted: {why}; {then}", u.binary.display());
            tracing::error!("keeper: {why}");
            self.set_report(RestartReport {
                counts: Default::default(),
                history: Default::default(),
                kind: "upgrade".into(),
                old_pid: self.worker.as_ref().map(|w| w.pid).unwrap_or(0),
                new_pid: 0,
                binary: u.binary.display().to_string(),
                began_us: now_us(),
                phases: u.phases,
                stall_ms: 0.0,
                outcome: why.clone(),
            });
            reply(u.reply, Err(Refused::Failed(why)));
        }
    }

    /// The old worker has exited (after quiescing, or died while quiescing): hand over.
    pub(super) fn old_stopped(&mut self) {
        self.worker = None;
        let Some(u) = self.up.as_mut() else { return };
        u.phases.push(Phase::new(
            if u.old_quiesced {
                "old worker exit"
            } else {
                "old worker died while stopping"
            },
            u.step_began.elapsed(),
        ));
        if let Some(why) = u.candidate_died.clone() {
            self.rollback(&why);
            return;
        }
        u.stage = Stage::Handover;
        u.step_began = Instant::now();
        let t = Instant::now();
        let began_us = u.began_us;
        let Some(cid) = self.cand.as_ref().map(|c| c.id) else {
            return;
        };
        self.generation += 1;
        let info = StartInfo {
            keeper_pid: std::process::id(),
            generation: self.generation,
            reason: "upgrade".into(),
            last_restart: self.last_report.clone(),
            restart_began_us: began_us,
            alive_every_ms: (self.cfg.worker_watchdog / 4).as_millis() as u64,
        };
        if let Err(e) = self.hand_over(cid, info) {
            tracing::error!("keeper: handing over to the new worker failed: {e}");
        }
        if let Some(u) = self.up.as_mut() {
            u.phases
                .push(Phase::new("hand over descriptors", t.elapsed()));
        }
    }

    /// The new binary failed after the old worker stopped: start the old binary again.
    pub(super) fn rollback(&mut self, why: &str) {
        let Some(u) = self.up.take() else { return };
        if let Some(c) = self.cand.take() {
            kill(c.pid);
            self.retiring.push(c.id);
        }
        let old_binary = self.cfg.binary.clone();
        let outcome = format!(
            "upgrade to {} failed after the old worker stopped: {why}; rolled back to {}",
            u.binary.display(),
            old_binary.display()
        );
        tracing::error!("keeper: {outcome}");
        let start = Start {
            reason: "rollback".into(),
            began_us: u.began_us,
            began: u.began,
            old_pid: u.old_pid,
            phases: u.phases,
            reply: u.reply,
        };
        self.last_report = Some(RestartReport {
            counts: Default::default(),
            history: Default::default(),
            kind: "upgrade".into(),
            outcome: outcome.clone(),
            binary: u.binary.display().to_string(),
            ..Default::default()
        });
        match self.spawn(&old_binary, "worker", Some(start)) {
            Ok(c) => self.worker = Some(c),
            Err(e) => tracing::error!("keeper: cannot restart the old binary either: {e}"),
        }
    }

    /// The candidate exited before it served: abort, wait for the old worker's exit, or roll
    /// back, depending on how far the upgrade got.
    pub(super) fn candidate_exited(&mut self, status: &std::process::ExitStatus) {
        let Some(c) = self.cand.as_ref() else { return };
        let why = format!(
            "new worker {} exited ({}){}",
            c.pid,
            status_text(status),
            c.failed
                .as_ref()
                .map(|f| format!(": {f}"))
                .unwrap_or_default()
        );
        let stage = self.up.as_ref().map(|u| &u.stage);
        match stage {
            Some(Stage::Preview) | None => {
                self.cand = None;
                self.abort_candidate(&why);
            }
            Some(Stage::Quiesce) => {
                self.cand = None;
                if let Some(u) = self.up.as_mut() {
                    u.candidate_died = Some(why);
                }
            }
            Some(Stage::Handover) => {
                self.cand = None;
                self.rollback(&why);
            }
        }
    }

    /// The candidate reports ready: the upgrade is complete and it is the worker now.
    pub(super) fn candidate_ready(&mut self, phases: Vec<Phase>) {
        let Some(u) = self.up.take() else { return };
        let Some(mut c) = self.cand.take() else {
            return;
        };
        c.ready = true;
        self.last_ready_pid = Some(c.pid);
        let mut all = u.phases;
        all.extend(phases);
        let report = RestartReport {
            counts: Default::default(),
            history: Default::default(),
            kind: "upgrade".into(),
            old_pid: u.old_pid,
            new_pid: c.pid,
            binary: u.binary.display().to_string(),
            began_us: u.began_us,
            phases: all,
            stall_ms: u.began.elapsed().as_secs_f64() * 1e3,
            outcome: "ok".into(),
        };
        tracing::info!(old_pid = report.old_pid, new_pid = report.new_pid, stall_ms = format!("{:.2}", report.stall_ms), phases = %super::phase_text(&report.phases), "keeper: upgrade complete");
        self.cfg.binary = u.binary;
        self.worker = Some(c);
        self.set_report(report.clone());
        reply(
            u.reply,
            Ok(serde_json::to_value(&report).unwrap_or(Value::Null)),
        );
    }

    /// An upgrade step that took longer than `step_timeout`: abort during the preview, kill
    /// the old worker that does not stop, kill the candidate that does not take over.
    pub(super) fn check_upgrade_deadline(&mut self) {
        let timeout = self.cfg.step_timeout;
        let (stage, late) = match &self.up {
            Some(u) => (
                Some(match u.stage {
                    Stage::Preview => 0,
                    Stage::Quiesce => 1,
                    Stage::Handover => 2,
                }),
                u.step_began.elapsed() > timeout,
            ),
            None => (None, false),
        };
        if !late {
            return;
        }
        match stage {
            Some(0) => self.abort_candidate(&format!(
                "the new binary did not accept the state within {timeout:?}"
            )),
            Some(1) => {
                if let Some(w) = &self.worker {
                    tracing::error!(pid = w.pid, "keeper: old worker did not stop within {timeout:?}; killing it (the journal covers its in-flight I/O)");
                    kill(w.pid);
                }
                if let Some(u) = self.up.as_mut() {
                    u.step_began = Instant::now();
                }
            }
            Some(2) => {
                if let Some(c) = &self.cand {
                    kill(c.pid);
                }
                if let Some(u) = self.up.as_mut() {
                    u.step_began = Instant::now();
                }
            }
            _ => {}
        }
    }
}
