//! The keeper process: starts the worker, keeps what it deposits, restarts it when it dies,
//! and runs graceful upgrades (candidate preview → old worker quiesces → store handed to the
//! candidate → candidate serves), rolling back to the old binary when the new one fails.
//!
//! Single-threaded state machine fed by one event channel; helper threads only read the
//! worker channels, wait for child exits and catch signals.
//!
//! This module owns the event loop, the store of kept values and descriptors, signals and
//! the message dispatch; the rest is split by job: `child` (starting workers, reading their
//! channels), `restart` (a worker's start, readiness and crash restart) and `upgrade`
//! (the graceful upgrade's stages). It must not know what the kept values mean.

mod child;
mod fdstore;
mod restart;
mod standby;
mod upgrade;

use std::collections::{BTreeMap, VecDeque};
use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use child::{kill, Child, Start};
use fdstore::FdStore;
use upgrade::{Stage, Upgrade};

use crate::now_us;
use crate::proto::{crc, Msg, Phase, RestartHistory, RestartReport, StartInfo, PROTOCOL_VERSION};
use crate::systemd::{self, Notifier};

/// How the keeper runs its workers.
#[derive(Debug, Clone)]
pub struct KeeperConfig {
    /// The worker binary (normally our own executable).
    pub binary: PathBuf,
    /// Arguments for every worker (our own, minus keeper-only ones).
    pub args: Vec<OsString>,
    /// Give up (and exit) after this many workers in a row died before serving, within
    /// `crash_window`.
    pub max_crashes: usize,
    pub crash_window: Duration,
    /// Longest each upgrade step (candidate preview, quiesce, restore) may take.
    pub step_timeout: Duration,
    /// Keep a standby worker started ahead of need (see `standby`).
    pub standby: bool,
    /// A serving worker that reports no progress (`Alive`) for this long is killed and
    /// restarted (zero: no watchdog).
    pub worker_watchdog: Duration,
}

impl KeeperConfig {
    /// Defaults for `binary` and `args`.
    pub fn new(binary: PathBuf, args: Vec<OsString>) -> Self {
        KeeperConfig {
            binary,
            args,
            max_crashes: 5,
            crash_window: Duration::from_secs(60),
            step_timeout: Duration::from_secs(10),
            standby: true,
            worker_watchdog: Duration::from_secs(10),
        }
    }
}

enum Ev {
    Msg(u64, Box<Msg>, Vec<File>),
    Exited(u64, std::process::ExitStatus),
    Signal(i32),
}

struct Kept {
    value: String,
    files: Vec<File>,
    /// Under systemd: each file's name in its descriptor store, and its identity.
    names: Vec<String>,
    ids: Vec<fdstore::FileId>,
}

struct Keeper {
    cfg: KeeperConfig,
    tx: Sender<Ev>,
    store: BTreeMap<String, Kept>,
    worker: Option<Child>,
    cand: Option<Child>,
    /// A worker process waiting to be handed the store (see `standby`), and when the next
    /// may be started after one died.
    standby: Option<Child>,
    standby_retry: Option<Instant>,
    /// Old workers that quiesced and are exiting: their exit is expected.
    retiring: Vec<u64>,
    up: Option<Upgrade>,
    generation: u64,
    crashes: VecDeque<Instant>,
    last_report: Option<RestartReport>,
    shutting_down: Option<Instant>,
    next_id: u64,
    /// The last worker that reported Ready.
    last_ready_pid: Option<u32>,
    /// Under systemd: notifications and the descriptor-store mirror.
    sd: Option<FdStore>,
    last_watchdog: Instant,
    /// Restarts and upgrades by kind (see `RestartReport::counts`).
    restarts: BTreeMap<String, u64>,
    /// Their stalls and phases by kind (see `RestartReport::history`).
    history: RestartHistory,
}

fn status_text(s: &std::process::ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (_, Some(sig)) => format!("signal {sig}"),
        _ => "unknown status".into(),
    }
}

/// Why an upgrade or restart a client asked for did not happen (its text is the JSON-RPC
/// error message the client gets).
#[derive(Debug)]
enum Refused {
    Upgrading,
    NotServing,
    ShuttingDown,
    /// Failed or rolled back: the outcome the restart report keeps.
    Failed(String),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Upgrading => f.write_str("an upgrade is already in progress"),
            Refused::NotServing => {
                f.write_str("the worker is not serving yet; try again in a moment")
            }
            Refused::ShuttingDown => f.write_str("spoold is shutting down"),
            Refused::Failed(why) => f.write_str(why),
        }
    }
}

fn reply(r: Option<(File, Value)>, result: Result<Value, Refused>) {
    let Some((mut f, id)) = r else { return };
    let resp = match result {
        Ok(v) => json!({"jsonrpc": "2.0", "id": id, "result": v}),
        Err(m) => {
            let m = m.to_string();
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32000, "message": m}})
        }
    };
    let _ = writeln!(f, "{resp}");
}

/// Runs the keeper until the worker shuts down for good (exit 0) or keeps crashing (exit 1).
pub fn run(cfg: KeeperConfig) -> ExitCode {
    let (tx, rx) = channel();
    {
        let tx = tx.clone();
        let signals = signal_hook::iterator::Signals::new([
            libc::SIGTERM,
            libc::SIGINT,
            libc::SIGHUP,
            libc::SIGUSR2,
        ]);
        match signals {
            Ok(mut s) => {
                let _ = std::thread::Builder::new()
                    .name("keeper-signals".into())
                    .spawn(move || {
                        for sig in s.forever() {
                            if tx.send(Ev::Signal(sig)).is_err() {
                                return;
                            }
                        }
                    });
            }
            Err(e) => {
                tracing::error!("keeper: cannot install signal handlers: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let mut k = Keeper {
        cfg,
        tx,
        store: BTreeMap::new(),
        worker: None,
        cand: None,
        standby: None,
        standby_retry: None,
        retiring: Vec::new(),
        up: None,
        generation: 0,
        crashes: VecDeque::new(),
        last_report: None,
        shutting_down: None,
        next_id: 1,
        last_ready_pid: None,
        sd: Notifier::from_env().map(FdStore::new),
        last_watchdog: Instant::now(),
        restarts: BTreeMap::new(),
        history: RestartHistory::new(),
    };
    let reason = k.restore_from_systemd();
    let binary = k.cfg.binary.clone();
    let start = Start {
        reason: reason.into(),
        began_us: now_us(),
        began: Instant::now(),
        old_pid: 0,
        phases: vec![],
        reply: None,
    };
    match k.spawn(&binary, "worker", Some(start)) {
        Ok(c) => k.worker = Some(c),
        Err(e) => {
            tracing::error!(binary = %binary.display(), "keeper: cannot start the worker: {e}");
            return ExitCode::FAILURE;
        }
    }
    tracing::info!(
        keeper_pid = std::process::id(),
        "keeper holding descriptors; worker restarts and upgrades keep VM connections open"
    );
    k.run(rx)
}

impl Keeper {
    fn run(&mut self, rx: Receiver<Ev>) -> ExitCode {
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(ev) => {
                    if let Some(code) = self.event(ev) {
                        return code;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return ExitCode::FAILURE,
            }
            if let Some(code) = self.check_deadlines() {
                return code;
            }
        }
    }

    fn child(&mut self, id: u64) -> Option<&mut Child> {
        if self.worker.as_ref().is_some_and(|w| w.id == id) {
            return self.worker.as_mut();
        }
        if self.cand.as_ref().is_some_and(|c| c.id == id) {
            return self.cand.as_mut();
        }
        if self.standby.as_ref().is_some_and(|c| c.id == id) {
            return self.standby.as_mut();
        }
        None
    }

    fn is_worker(&self, id: u64) -> bool {
        self.worker.as_ref().is_some_and(|w| w.id == id)
    }

    fn is_cand(&self, id: u64) -> bool {
        self.cand.as_ref().is_some_and(|c| c.id == id)
    }

    fn event(&mut self, ev: Ev) -> Option<ExitCode> {
        match ev {
            Ev::Msg(id, m, files) => self.message(id, *m, files),
            Ev::Exited(id, status) => return self.exited(id, status),
            Ev::Signal(sig) => return self.signal(sig),
        }
        None
    }

    fn signal(&mut self, sig: i32) -> Option<ExitCode> {
        if sig == libc::SIGUSR2 {
            let b = self
                .worker
                .as_ref()
                .map(|w| w.binary.clone())
                .unwrap_or_else(|| self.cfg.binary.clone());
            tracing::info!(binary = %b.display(), "keeper: SIGUSR2: upgrading the worker");
            self.begin_upgrade(b, None);
            return None;
        }
        tracing::info!(signal = sig, "keeper: shutting down");
        self.sd_notify("STOPPING=1\nSTATUS=stopping: draining in-flight I/O");
        self.drop_standby();
        self.shutting_down = Some(Instant::now());
        self.abort_candidate("spoold is shutting down");
        match &self.worker {
            Some(w) => {
                let _ = w.chan.send(&Msg::Shutdown, &[]);
                None
            }
            None => Some(ExitCode::SUCCESS),
        }
    }

    fn message(&mut self, id: u64, m: Msg, files: Vec<File>) {
        match m {
            Msg::Hello { protocol, pid } => self.hello(id, protocol, pid),
            Msg::Put { key, value, crc: c } => {
                if !self.may_store(id) {
                    return;
                }
                if crc(&value) != c {
                    tracing::error!(key = %key, "keeper: refusing a deposit whose checksum does not match");
                    return;
                }
                self.keep(key, value, files);
            }
            Msg::Remove { prefix } => {
                if !self.may_store(id) {
                    return;
                }
                self.store.retain(|k, _| !k.starts_with(&prefix));
                self.publish_store();
            }
            Msg::Ready { phases } => self.ready(id, phases),
            Msg::Failed { reason } => {
                tracing::error!(reason = %reason, "keeper: worker reports failure");
                if let Some(c) = self.child(id) {
                    c.failed = Some(reason);
                }
            }
            Msg::Accept => self.accepted(id),
            Msg::Reject { reason } => {
                if self.is_cand(id) {
                    self.abort_candidate(&format!("the new binary refused the state: {reason}"));
                }
            }
            Msg::Quiesced { phases } => self.quiesced(id, phases),
            Msg::Alive => {
                if let Some(c) = self.child(id) {
                    c.last_alive = Some(Instant::now());
                }
            }
            Msg::Exiting => {
                if let Some(c) = self.child(id) {
                    c.exiting = true;
                }
            }
            Msg::Upgrade { binary, rpc_id } => self.upgrade_requested(binary, rpc_id, files),
            other => tracing::warn!("keeper: unexpected message from worker: {other:?}"),
        }
    }

    /// A child reports in: one speaking another protocol is killed; a candidate gets the
    /// preview, a worker the store.
    fn hello(&mut self, id: u64, protocol: u32, pid: u32) {
        let Some(c) = self.child(id) else { return };
        c.hello = Some(Instant::now());
        if protocol != PROTOCOL_VERSION {
            let why = format!(
                "worker {pid} speaks keeper protocol {protocol}, this keeper {PROTOCOL_VERSION}"
            );
            tracing::error!("keeper: {why}");
            kill(c.pid);
            c.failed = Some(why);
            return;
        }
        if self.is_cand(id) {
            self.send_preview();
        } else {
            self.hand_over_to_worker(id);
        }
    }

    /// Deposits are taken from the serving worker, and from a candidate once it has the store.
    fn may_store(&self, id: u64) -> bool {
        self.is_worker(id)
            || (self.is_cand(id) && self.up.as_ref().map(|u| &u.stage) == Some(&Stage::Handover))
    }

    /// Stores a deposit (and mirrors it into systemd's descriptor store).
    fn keep(&mut self, key: String, value: String, files: Vec<File>) {
        let (names, ids) = match self.sd.as_mut() {
            Some(sd) => {
                let ids: Vec<_> = files.iter().map(fdstore::file_id).collect();
                (sd.name_files(&self.store, &files, &ids), ids)
            }
            None => (Vec::new(), Vec::new()),
        };
        self.store.insert(
            key,
            Kept {
                value,
                files,
                names,
                ids,
            },
        );
        self.publish_store();
    }

    pub(super) fn publish_store(&mut self) {
        if let Some(sd) = self.sd.as_mut() {
            sd.publish(&self.store, self.generation, &self.restarts, &self.history);
        }
    }

    /// Under systemd, after this keeper's predecessor died: the store from systemd's
    /// descriptor store, and why the first worker starts (`keeper-restart` or `first-start`).
    fn restore_from_systemd(&mut self) -> &'static str {
        let inherited = systemd::take_inherited();
        let Some(sd) = self.sd.as_mut() else {
            return "first-start";
        };
        let n = inherited.len();
        let restored = sd.restore(inherited);
        let reason = match restored {
            Some((store, generation, restarts, history)) if !store.is_empty() => {
                tracing::info!(
                    descriptors = n,
                    entries = store.len(),
                    "keeper: restarted by systemd; taking the kept connections back from its descriptor store"
                );
                self.store = store;
                self.generation = generation;
                self.restarts = restarts;
                self.history = history;
                "keeper-restart"
            }
            _ => "first-start",
        };
        self.publish_store();
        reason
    }

    /// Tells systemd (if it runs us) `state`; errors are logged once by the store.
    pub(super) fn sd_notify(&self, state: &str) {
        if let Some(sd) = &self.sd {
            if let Err(e) = sd.notifier().notify(state) {
                tracing::debug!("keeper: sd_notify: {e}");
            }
        }
    }

    /// Feeds systemd's watchdog (`WatchdogSec=`) at half its interval while this loop runs.
    fn feed_watchdog(&mut self) {
        let Some(every) = self.sd.as_ref().and_then(|s| s.notifier().watchdog()) else {
            return;
        };
        if self.last_watchdog.elapsed() >= every / 2 {
            self.last_watchdog = Instant::now();
            self.sd_notify("WATCHDOG=1");
        }
    }

    fn hand_over(&mut self, id: u64, info: StartInfo) -> std::io::Result<()> {
        let chan = match self.child(id) {
            Some(c) => c.chan.try_clone()?,
            None => return Ok(()),
        };
        for (k, v) in &self.store {
            let fds: Vec<RawFd> = v.files.iter().map(|f| f.as_raw_fd()).collect();
            chan.send(
                &Msg::Entry {
                    key: k.clone(),
                    value: v.value.clone(),
                    crc: crc(&v.value),
                },
                &fds,
            )?;
        }
        chan.send(&Msg::End { info }, &[])
    }

    /// Records the latest report and tells the serving worker (for `daemon_status`).
    fn set_report(&mut self, mut r: RestartReport) {
        let kind = if r.outcome == "ok" {
            r.kind.clone()
        } else {
            format!("{}-failed", r.kind)
        };
        *self.restarts.entry(kind.clone()).or_default() += 1;
        r.counts = self.restarts.clone();
        self.history.entry(kind).or_default().add(&r);
        r.history = self.history.clone();
        self.publish_store();
        self.sd_notify(&format!(
            "READY=1\nSTATUS=serving (worker {}); last {}: {} ({:.1} ms)",
            self.worker.as_ref().map(|w| w.pid).unwrap_or(0),
            r.kind,
            r.outcome,
            r.stall_ms
        ));
        if let Some(w) = &self.worker {
            let _ = w.chan.send(&Msg::Report { report: r.clone() }, &[]);
        }
        self.last_report = Some(r);
    }

    fn check_deadlines(&mut self) -> Option<ExitCode> {
        self.feed_watchdog();
        self.keep_standby();
        let timeout = self.cfg.step_timeout;
        if let Some(t) = self.shutting_down {
            if t.elapsed() > Duration::from_secs(30) {
                if let Some(w) = &self.worker {
                    tracing::error!(
                        pid = w.pid,
                        "keeper: worker did not stop in 30 s; killing it"
                    );
                    kill(w.pid);
                }
                return Some(ExitCode::FAILURE);
            }
        }
        if let Some(w) = &self.worker {
            if w.hello.is_none() && w.spawned.elapsed() > timeout {
                tracing::error!(pid = w.pid, "keeper: worker did not report in; killing it");
                kill(w.pid);
            }
        }
        self.check_worker_progress();
        self.check_upgrade_deadline();
        None
    }
}

impl Keeper {
    /// The worker watchdog: a serving worker that said it was alive and then stopped saying
    /// so (a queue thread wedged, or the whole process) is killed; its exit restarts it with
    /// the kept descriptors, as after a crash.
    fn check_worker_progress(&mut self) {
        let limit = self.cfg.worker_watchdog;
        let Some(w) = self.worker.as_mut().filter(|w| w.ready && !limit.is_zero()) else {
            return;
        };
        if w.last_alive.is_some_and(|t| t.elapsed() > limit) {
            let why = format!(
                "no progress reported for {} ms (worker watchdog)",
                limit.as_millis()
            );
            tracing::error!(pid = w.pid, "keeper: {why}; killing it");
            w.failed = Some(why);
            w.last_alive = None;
            kill(w.pid);
        }
    }
}

/// "name 1.23 ms, name 0.40 ms".
pub fn phase_text(p: &[Phase]) -> String {
    p.iter()
        .map(|p| format!("{} {:.2} ms", p.name, p.ms))
        .collect::<Vec<_>>()
        .join(", ")
}
