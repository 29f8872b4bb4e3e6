//! The per-device failure state machine (docs/failures.md): one step over a watched device
//! per monitor tick. Workers' error reports are counted and classified (media errors fail
//! the device past the policy's threshold, a gone device is removed, a path error starts a
//! reset); a resetting device is probed with backoff until it answers, is gone, or
//! `reset_timeout` fails it; a healthy one is watched for SMART critical warnings and for
//! removal, a failed one for removal.
//!
//! Owns: the transitions of each device's health cell and the events they emit.
//!
//! Must not know: the event log, listeners and the hook (the monitor records what is
//! emitted); volumes, virtio, the journal.

use std::time::Instant;

use spool_devices::{DeviceHealth, ErrorClass, ErrorReport, HealthState, Probe, Signal};

use crate::{
    errno_text, smart_text, Monitor, Watched, FIRST_BACKOFF, MAX_BACKOFF, SMART_FATAL, SMART_WARN,
};

/// An event as the state machine produces it (the log adds device, time and sequence).
pub(crate) struct Emitted {
    pub(crate) from: &'static str,
    pub(crate) to: &'static str,
    pub(crate) reason: String,
    pub(crate) kind: &'static str,
}

/// Moves `health` to `to` and, if that changed the state, records why and emits the event.
/// An isolation (failed, removed) is handed to the monitor's recorder first, so it is kept
/// before anyone (a worker, an RPC) sees the state.
fn go(
    recorder: Option<&crate::Recorder>,
    w: &mut Watched,
    health: &DeviceHealth,
    now: Instant,
    to: HealthState,
    why: String,
    emit: &mut dyn FnMut(Emitted),
) {
    if to.isolated() && health.state() != to {
        if let Some(record) = recorder {
            record(w.uuid, to, &why);
        }
    }
    let from = health.set(to);
    if from != to {
        w.changed = now;
        w.reason = why.clone();
        emit(Emitted {
            from: from.name(),
            to: to.name(),
            reason: why,
            kind: "state",
        });
    }
}

impl Monitor {
    /// Runs one device's state machine; `emit` records events.
    pub(crate) fn step(&self, w: &mut Watched, emit: &mut dyn FnMut(Emitted)) {
        let taken = w.dev.health().take_reports_with_state();
        self.step_taken(w, taken, emit)
    }

    /// [`Monitor::step`] with the reports already taken (and the state seen as they were).
    pub(crate) fn step_taken(
        &self,
        w: &mut Watched,
        (seen, reports, dropped): (HealthState, Vec<ErrorReport>, u64),
        emit: &mut dyn FnMut(Emitted),
    ) {
        let health = w.dev.health().clone();
        w.counters.dropped_reports += dropped;
        let now = Instant::now();
        for r in &reports {
            self.apply_report(w, &health, r, now, emit);
        }
        let state = health.state();
        if seen == HealthState::Healthy
            && state == HealthState::Resetting
            && w.reset_started.is_none()
        {
            // Made resetting since the reports were taken: by a worker's path report, which
            // is waiting (`DeviceHealth::report`), or by an operator. The next round begins
            // the reset with the report's reason; beginning it now would reset the device
            // once for nothing and once more for the report.
            return;
        }
        match state {
            HealthState::Resetting => self.step_resetting(w, &health, now, emit),
            HealthState::Healthy => self.step_healthy(w, &health, now, emit),
            HealthState::Failed => {
                // A failed device can still be pulled: a hot removal must be seen (and, for
                // NVMe, answered by letting go of the device) whatever state it is in.
                self.poll_presence(w, &health, now, emit);
            }
            HealthState::Removed => {}
        }
    }

    /// Counts one worker's error report and acts on its class (unless the device is already
    /// isolated).
    fn apply_report(
        &self,
        w: &mut Watched,
        health: &DeviceHealth,
        r: &ErrorReport,
        now: Instant,
        emit: &mut dyn FnMut(Emitted),
    ) {
        let what = match r.signal {
            Signal::Errno(e) => errno_text(e),
            Signal::Timeout => format!("no completion within {:?}", self.policy.io_timeout),
        };
        let at = format!(
            "{} of {} bytes at {}",
            if r.write { "write" } else { "read" },
            r.len,
            r.offset
        );
        w.last_error = Some(format!("{}: {what} ({at})", r.class().name()));
        match (r.class(), r.signal) {
            (_, Signal::Timeout) => w.counters.timeouts += 1,
            (ErrorClass::Media, _) => w.counters.media_errors += 1,
            (ErrorClass::Path, _) => w.counters.path_errors += 1,
            (ErrorClass::Gone, _) => w.counters.gone_errors += 1,
            (ErrorClass::Request, _) => w.counters.request_errors += 1,
        }
        let state = health.state();
        if state.isolated() {
            return;
        }
        match r.class() {
            ErrorClass::Media
                if w.counters.media_errors >= self.policy.media_errors_to_fail as u64 =>
            {
                go(
                    self.recorder.get(),
                    w,
                    health,
                    now,
                    HealthState::Failed,
                    format!("media error: {what} on {at}; replace the device (`spoolctl device replace`); volumes on it fail I/O until then and their data is lost unless mirrored"),
                    emit,
                );
            }
            ErrorClass::Gone => go(
                self.recorder.get(),
                w,
                health,
                now,
                HealthState::Removed,
                format!("device gone: {what} on {at}"),
                emit,
            ),
            ErrorClass::Path if w.reset_started.is_none() => {
                // The worker that saw it already holds I/O (Healthy → Resetting).
                health.transition(HealthState::Healthy, HealthState::Resetting);
                self.begin_reset(w, now, format!("path error: {what} on {at}"), emit);
            }
            _ => {}
        }
    }

    /// A resetting device: probed (with backoff) until it answers, is gone, or has been
    /// resetting for `reset_timeout`.
    fn step_resetting(
        &self,
        w: &mut Watched,
        health: &DeviceHealth,
        now: Instant,
        emit: &mut dyn FnMut(Emitted),
    ) {
        if w.reset_started.is_none() {
            self.begin_reset(w, now, "reset requested".into(), emit);
        }
        let started = w.reset_started.unwrap_or(now);
        if now < w.next_probe {
            return;
        }
        match w.dev.probe() {
            Probe::Ok => {
                w.counters.resets += 1;
                w.reset_started = None;
                go(
                    self.recorder.get(),
                    w,
                    health,
                    now,
                    HealthState::Healthy,
                    format!(
                        "reset done in {:.1} ms; held requests are resubmitted",
                        started.elapsed().as_secs_f64() * 1e3
                    ),
                    emit,
                );
            }
            Probe::Gone(why) => {
                w.reset_started = None;
                go(
                    self.recorder.get(),
                    w,
                    health,
                    now,
                    HealthState::Removed,
                    format!("device gone: {why}"),
                    emit,
                );
            }
            Probe::Failed(e) => {
                w.counters.failed_probes += 1;
                if now.duration_since(started) >= self.policy.reset_timeout {
                    w.reset_started = None;
                    go(
                        self.recorder.get(),
                        w,
                        health,
                        now,
                        HealthState::Failed,
                        format!(
                            "did not come back within {:?} of resetting (last probe: {}); replace it",
                            self.policy.reset_timeout,
                            errno_text(e)
                        ),
                        emit,
                    );
                } else {
                    w.next_probe = now + w.probe_backoff;
                    w.probe_backoff = (w.probe_backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// A healthy device: a new fatal SMART critical warning fails it, a lesser one is a
    /// warning event; every `poll_interval` its presence is checked.
    fn step_healthy(
        &self,
        w: &mut Watched,
        health: &DeviceHealth,
        now: Instant,
        emit: &mut dyn FnMut(Emitted),
    ) {
        w.reset_started = None;
        let smart = w.dev.smart_warning();
        if smart != w.smart_seen {
            w.smart_seen = smart;
            if smart & SMART_FATAL != 0 {
                go(
                    self.recorder.get(),
                    w,
                    health,
                    now,
                    HealthState::Failed,
                    format!("SMART critical warning 0x{smart:02x} ({}); the medium is wearing out: replace the device", smart_text(smart)),
                    emit,
                );
                return;
            } else if smart & SMART_WARN != 0 {
                emit(Emitted {
                    from: "healthy",
                    to: "healthy",
                    reason: format!(
                        "SMART critical warning 0x{smart:02x} ({}); not isolating",
                        smart_text(smart)
                    ),
                    kind: "warning",
                });
            }
        }
        self.poll_presence(w, health, now, emit);
    }

    /// Every `poll_interval`: a device found gone (deleted file, hot removal) is removed.
    fn poll_presence(
        &self,
        w: &mut Watched,
        health: &DeviceHealth,
        now: Instant,
        emit: &mut dyn FnMut(Emitted),
    ) {
        if now.duration_since(w.last_poll) >= self.policy.poll_interval {
            w.last_poll = now;
            if let Probe::Gone(why) = w.dev.presence() {
                go(
                    self.recorder.get(),
                    w,
                    health,
                    now,
                    HealthState::Removed,
                    format!("device gone: {why}"),
                    emit,
                );
            }
        }
    }

    fn begin_reset(
        &self,
        w: &mut Watched,
        now: Instant,
        why: String,
        emit: &mut dyn FnMut(Emitted),
    ) {
        w.reset_started = Some(now);
        w.next_probe = now;
        w.probe_backoff = FIRST_BACKOFF;
        w.changed = now;
        w.reason = format!("{why}; resetting");
        emit(Emitted {
            from: "healthy",
            to: "resetting",
            reason: w.reason.clone(),
            kind: "state",
        });
        // A device with a controller of ours (NVMe) is really reset; the probes that follow
        // say whether it came back. Files and block devices are only probed.
        if let Some(Err(e)) = w.dev.reset_controller() {
            tracing::warn!(path = %w.dev.path().display(), error = %e, "controller reset failed; probing until reset_timeout");
        }
    }
}
