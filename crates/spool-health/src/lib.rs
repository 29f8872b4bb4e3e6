//! Health layer: the per-device failure state machine (docs/failures.md).
//!
//! Owns: the policy (thresholds, timeouts), the monitor thread that reads the workers' error
//! reports and each device's own signals (probe, deleted file, SMART critical warning), moves
//! every device through healthy → resetting → healthy, healthy → failed (media, wear, a reset
//! that never came back) and healthy → removed, counts what it saw, keeps an event log with
//! sequence numbers, and runs the operator's hook command on each event.
//!
//! Must not know: volumes, extents, virtio or the journal. It never touches I/O in flight:
//! the workers obey the state in each device's [`DeviceHealth`] cell (hold while resetting,
//! fail while isolated, resubmit when healthy again). Replacing a failed device is the
//! control plane's job; it tells the monitor with [`Monitor::replace`].
//!
//! This file owns the monitor (its thread, the watched devices, counters, the event log,
//! listeners and the hook); one step of a device's state machine is in `machine.rs`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use spool_devices::{Device, HealthState};
use uuid::Uuid;

mod machine;
use machine::Emitted;

/// Why a controller reset was not started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResetRefused {
    #[error("device {0} is not watched")]
    NotWatched(Uuid),
    #[error("device {device} is {state}: it is isolated until it is replaced (`spoolctl device replace`)")]
    Isolated { device: Uuid, state: &'static str },
}

/// How the monitor decides. The defaults are safe for real devices.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Media errors (ENODATA/EILSEQ, NVMe SCT 2) after which a device is isolated.
    pub media_errors_to_fail: u32,
    /// A request in flight longer than this is a timeout (a path error). Default 30 s, as the
    /// Linux NVMe driver's `io_timeout`.
    pub io_timeout: Duration,
    /// A resetting device that does not answer a probe within this long is failed.
    pub reset_timeout: Duration,
    /// How often healthy devices are probed (deleted file, SMART warning).
    pub poll_interval: Duration,
    /// How many times one request is resubmitted after path errors before it is failed on
    /// its own (the device answers others: the fault is that request's, not the path's).
    pub request_retries: u32,
    /// Shell command run on every event, with SPOOL_EVENT_* variables set.
    pub hook: Option<String>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            media_errors_to_fail: 1,
            io_timeout: Duration::from_secs(30),
            reset_timeout: Duration::from_secs(10),
            poll_interval: Duration::from_secs(1),
            request_retries: 3,
            hook: None,
        }
    }
}

/// SMART critical-warning bits (NVMe log page 02h, byte 0) that mean the medium can no longer
/// be trusted: 0 spare below threshold, 2 reliability degraded, 3 read-only mode.
pub const SMART_FATAL: u8 = 0b0000_1101;
/// Bits that are reported but do not isolate: 1 temperature, 4 volatile backup failed,
/// 5 persistent memory region read-only.
pub const SMART_WARN: u8 = 0b0011_0010;

/// Error counters of one device.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Counters {
    pub media_errors: u64,
    pub path_errors: u64,
    pub timeouts: u64,
    pub gone_errors: u64,
    pub request_errors: u64,
    /// Reports lost because the monitor was behind (should stay 0).
    pub dropped_reports: u64,
    /// Controller resets that brought the device back.
    pub resets: u64,
    /// Probes that failed during resets.
    pub failed_probes: u64,
}

/// One event of the log.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    pub seq: u64,
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    pub device: Uuid,
    pub path: String,
    /// `state` (a transition), `warning`, `replaced`, `restored` (an isolated state carried
    /// over a worker restart), `mirror` (a mirrored volume with a leg on the device degraded,
    /// rebuilding, rebuilt).
    pub kind: String,
    pub from: Option<&'static str>,
    pub to: Option<&'static str>,
    pub reason: String,
}

/// What `device health` shows for one device.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceReport {
    pub device: Uuid,
    pub path: String,
    pub state: &'static str,
    /// Why the device is in this state (empty when healthy and never failed).
    pub reason: String,
    /// Changes with every transition.
    pub epoch: u64,
    pub counters: Counters,
    pub last_error: Option<String>,
    /// SMART critical-warning byte (simulated on file devices, which have no SMART log).
    pub smart_critical_warning: u8,
    /// Armed fault-injection rules.
    pub injected_faults: usize,
    /// Operations failed or held by injection so far.
    pub injected_hits: u64,
    /// Seconds since the last transition.
    pub since_s: f64,
}

struct Watched {
    uuid: Uuid,
    path: String,
    dev: Arc<Device>,
    counters: Counters,
    reason: String,
    last_error: Option<String>,
    changed: Instant,
    reset_started: Option<Instant>,
    next_probe: Instant,
    probe_backoff: Duration,
    last_poll: Instant,
    smart_seen: u8,
}

struct Inner {
    devices: Vec<Watched>,
    events: VecDeque<Event>,
    next_seq: u64,
}

type Listener = Box<dyn Fn(&Event) + Send + Sync>;

/// What keeps an isolation across a worker restart: called with the device, its new state
/// (failed or removed) and why, before the state is set (see [`Monitor::record_isolations`]).
pub(crate) type Recorder = Box<dyn Fn(Uuid, HealthState, &str) + Send + Sync>;

/// The health monitor: one thread for every device of a pool.
pub struct Monitor {
    policy: Policy,
    inner: Mutex<Inner>,
    stop: AtomicBool,
    listeners: Mutex<Vec<Listener>>,
    recorder: std::sync::OnceLock<Recorder>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

const EVENTS_KEPT: usize = 1000;
const TICK_RESETTING: Duration = Duration::from_millis(5);
const TICK_IDLE: Duration = Duration::from_millis(50);
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(50);

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn errno_text(e: i32) -> String {
    format!("{} (errno {e})", std::io::Error::from_raw_os_error(e))
}

impl Monitor {
    /// Starts the monitor thread.
    pub fn start(policy: Policy) -> Arc<Monitor> {
        let m = Arc::new(Monitor {
            policy,
            inner: Mutex::new(Inner {
                devices: Vec::new(),
                events: VecDeque::new(),
                next_seq: 1,
            }),
            stop: AtomicBool::new(false),
            listeners: Mutex::new(Vec::new()),
            recorder: std::sync::OnceLock::new(),
            thread: Mutex::new(None),
        });
        let weak = Arc::downgrade(&m);
        let t = std::thread::Builder::new()
            .name("spool-health".into())
            .spawn(move || loop {
                let Some(m) = weak.upgrade() else { return };
                if m.stop.load(Ordering::Acquire) {
                    return;
                }
                let busy = m.tick();
                drop(m);
                std::thread::sleep(if busy { TICK_RESETTING } else { TICK_IDLE });
            })
            .ok();
        *m.thread.lock().unwrap_or_else(|p| p.into_inner()) = t;
        m
    }

    /// The policy in force.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Stops the monitor thread.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Calls `f(device, state, why)` before each device is isolated (failed or removed),
    /// from the monitor thread under its lock, before any worker or caller can see the new
    /// state: what `f` records (the kept state a restarted worker restores) is then never
    /// behind what was seen, even if the process dies right after. It must not call the
    /// monitor. Set once; later calls are ignored.
    pub fn record_isolations(&self, f: impl Fn(Uuid, HealthState, &str) + Send + Sync + 'static) {
        let _ = self.recorder.set(Box::new(f));
    }

    /// Calls `f` for every event from now on (from the monitor thread; keep it short).
    pub fn subscribe(&self, f: impl Fn(&Event) + Send + Sync + 'static) {
        self.listeners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Box::new(f));
    }

    /// Starts watching a device.
    pub fn watch(&self, uuid: Uuid, dev: Arc<Device>) {
        let mut inner = self.lock();
        inner.devices.retain(|w| w.uuid != uuid);
        let now = Instant::now();
        inner.devices.push(Watched {
            uuid,
            path: dev.path().display().to_string(),
            dev,
            counters: Counters::default(),
            reason: String::new(),
            last_error: None,
            changed: now,
            reset_started: None,
            next_probe: now,
            probe_backoff: FIRST_BACKOFF,
            last_poll: now,
            smart_seen: 0,
        });
    }

    /// `new` takes `old`'s place (the control plane has moved the extents).
    pub fn replace(&self, old: Uuid, new: Uuid, dev: Arc<Device>) {
        let (path, old_path) = {
            let mut inner = self.lock();
            let old_path = inner
                .devices
                .iter()
                .find(|w| w.uuid == old)
                .map(|w| w.path.clone())
                .unwrap_or_default();
            inner.devices.retain(|w| w.uuid != old);
            (dev.path().display().to_string(), old_path)
        };
        self.watch(new, dev);
        let ev = {
            let mut inner = self.lock();
            Self::push_event(
                &mut inner,
                new,
                &path,
                "replaced",
                None,
                Some("healthy"),
                format!("replaces device {old} ({old_path}); volumes on it are back online, their old data is lost"),
            )
        };
        self.announce(ev);
    }

    /// Puts a watched device back in the isolated state (failed or removed) a previous worker
    /// left it in, so a worker restart never brings an isolated device back into service.
    /// Returns false when the device is not watched, not healthy now, or `state` is not an
    /// isolated one.
    pub fn restore(&self, uuid: Uuid, state: HealthState, reason: &str) -> bool {
        if !matches!(state, HealthState::Failed | HealthState::Removed) {
            return false;
        }
        let ev = {
            let mut inner = self.lock();
            let Some(w) = inner.devices.iter_mut().find(|w| w.uuid == uuid) else {
                return false;
            };
            if !w.dev.health().transition(HealthState::Healthy, state) {
                return false;
            }
            w.reason = reason.to_string();
            w.changed = Instant::now();
            let path = w.path.clone();
            Self::push_event(
                &mut inner,
                uuid,
                &path,
                "restored",
                Some("healthy"),
                Some(state.name()),
                format!("{reason} (state kept across a worker restart)"),
            )
        };
        self.announce(ev);
        true
    }

    /// Stops watching a device.
    pub fn unwatch(&self, uuid: Uuid) {
        self.lock().devices.retain(|w| w.uuid != uuid);
    }

    /// Asks for a controller reset of a device (operator or control plane).
    pub fn request_reset(&self, uuid: Uuid, why: &str) -> Result<(), ResetRefused> {
        let inner = self.lock();
        let w = inner
            .devices
            .iter()
            .find(|w| w.uuid == uuid)
            .ok_or(ResetRefused::NotWatched(uuid))?;
        match w.dev.health().state() {
            HealthState::Healthy => {
                w.dev
                    .health()
                    .transition(HealthState::Healthy, HealthState::Resetting);
                tracing::info!(device = %uuid, why, "controller reset requested");
                Ok(())
            }
            HealthState::Resetting => Ok(()),
            s => Err(ResetRefused::Isolated {
                device: uuid,
                state: s.name(),
            }),
        }
    }

    /// Reports of every watched device (or one).
    pub fn reports(&self) -> Vec<DeviceReport> {
        let inner = self.lock();
        inner
            .devices
            .iter()
            .map(|w| {
                let (state, epoch) = w.dev.health().load();
                DeviceReport {
                    device: w.uuid,
                    path: w.path.clone(),
                    state: state.name(),
                    reason: w.reason.clone(),
                    epoch,
                    counters: w.counters.clone(),
                    last_error: w.last_error.clone(),
                    smart_critical_warning: w.dev.smart_warning(),
                    injected_faults: w.dev.faults().list().len(),
                    injected_hits: w.dev.faults().injected(),
                    since_s: w.changed.elapsed().as_secs_f64(),
                }
            })
            .collect()
    }

    /// Events with `seq > since`, oldest first, and the sequence number to ask from next.
    pub fn events(&self, since: u64) -> (Vec<Event>, u64) {
        let inner = self.lock();
        (
            inner
                .events
                .iter()
                .filter(|e| e.seq > since)
                .cloned()
                .collect(),
            inner.next_seq - 1,
        )
    }

    /// Records an event about `device` that changes no health state, of `kind` (e.g.
    /// "mirror": a mirrored volume with a leg on it degraded, rebuilding or rebuilt), and
    /// tells the subscribers.
    pub fn note(&self, device: Uuid, path: &str, kind: &str, reason: String) {
        let ev = {
            let mut inner = self.lock();
            Self::push_event(&mut inner, device, path, kind, None, None, reason)
        };
        self.announce(ev);
    }

    fn push_event(
        inner: &mut Inner,
        device: Uuid,
        path: &str,
        kind: &str,
        from: Option<&'static str>,
        to: Option<&'static str>,
        reason: String,
    ) -> Event {
        let ev = Event {
            seq: inner.next_seq,
            time_ms: now_ms(),
            device,
            path: path.to_string(),
            kind: kind.into(),
            from,
            to,
            reason,
        };
        inner.next_seq += 1;
        if inner.events.len() >= EVENTS_KEPT {
            inner.events.pop_front();
        }
        inner.events.push_back(ev.clone());
        ev
    }

    fn announce(&self, ev: Event) {
        match (ev.kind.as_str(), ev.to) {
            ("state", Some("healthy")) | ("replaced", _) => {
                tracing::info!(device = %ev.device, path = %ev.path, from = ?ev.from, "device healthy: {}", ev.reason)
            }
            ("state", Some("resetting")) => {
                tracing::warn!(device = %ev.device, path = %ev.path, "device resetting: {}", ev.reason)
            }
            ("state", _) => {
                tracing::error!(device = %ev.device, path = %ev.path, state = ?ev.to, "device isolated: {}", ev.reason)
            }
            _ => {
                tracing::warn!(device = %ev.device, path = %ev.path, kind = %ev.kind, "{}", ev.reason)
            }
        }
        for l in self
            .listeners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            l(&ev);
        }
        if let Some(hook) = &self.policy.hook {
            run_hook(hook, &ev);
        }
    }

    /// One round over every device; returns whether any device is resetting.
    fn tick(&self) -> bool {
        let mut out = Vec::new();
        let mut busy = false;
        {
            let mut inner = self.lock();
            let mut pending: Vec<(usize, Emitted)> = Vec::new();
            for (i, w) in inner.devices.iter_mut().enumerate() {
                self.step(w, &mut |e| pending.push((i, e)));
                busy |= w.dev.health().state() == HealthState::Resetting;
            }
            for (i, e) in pending {
                let (uuid, path) = (inner.devices[i].uuid, inner.devices[i].path.clone());
                let (from, to) = if e.kind == "warning" {
                    (None, None)
                } else {
                    (Some(e.from), Some(e.to))
                };
                out.push(Self::push_event(
                    &mut inner, uuid, &path, e.kind, from, to, e.reason,
                ));
            }
        }
        for ev in out {
            self.announce(ev);
        }
        busy
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// Names the bits of a SMART critical-warning byte.
pub fn smart_text(bits: u8) -> String {
    const NAMES: [&str; 6] = [
        "spare below threshold",
        "temperature",
        "reliability degraded",
        "read-only",
        "volatile backup failed",
        "PMR read-only",
    ];
    let v: Vec<&str> = (0..6)
        .filter(|b| bits & (1 << b) != 0)
        .map(|b| NAMES[b])
        .collect();
    v.join(", ")
}

fn run_hook(hook: &str, ev: &Event) {
    let child = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(hook)
        .env("SPOOL_EVENT_SEQ", ev.seq.to_string())
        .env("SPOOL_EVENT_KIND", &ev.kind)
        .env("SPOOL_EVENT_DEVICE", ev.device.to_string())
        .env("SPOOL_EVENT_PATH", &ev.path)
        .env("SPOOL_EVENT_FROM", ev.from.unwrap_or(""))
        .env("SPOOL_EVENT_TO", ev.to.unwrap_or(""))
        .env("SPOOL_EVENT_REASON", &ev.reason)
        .stdin(std::process::Stdio::null())
        .spawn();
    match child {
        Ok(mut c) => {
            // Reaped on its own thread so a slow hook never delays the monitor.
            let _ = std::thread::Builder::new()
                .name("spool-hook".into())
                .spawn(move || {
                    let _ = c.wait();
                });
        }
        Err(e) => tracing::error!(hook, error = %e, "cannot run the health hook"),
    }
}

#[cfg(test)]
mod tests;
