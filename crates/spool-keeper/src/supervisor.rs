//! The keeper process: starts the worker, keeps what it deposits, restarts it when it dies,
//! and runs graceful upgrades (candidate preview → old worker quiesces → store handed to the
//! candidate → candidate serves), rolling back to the old binary when the new one fails.
//!
//! Single-threaded state machine fed by one event channel; helper threads only read the
//! worker channels, wait for child exits and catch signals.

use std::collections::{BTreeMap, VecDeque};
use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::now_us;
use crate::proto::{
    crc, Channel, Msg, Phase, RestartReport, StartInfo, CHANNEL_ENV, PROTOCOL_VERSION, ROLE_ENV,
};

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
        }
    }
}

enum Ev {
    Msg(u64, Msg, Vec<File>),
    Exited(u64, std::process::ExitStatus),
    Signal(i32),
}

struct Child {
    id: u64,
    pid: u32,
    chan: Channel,
    binary: PathBuf,
    spawned: Instant,
    hello: Option<Instant>,
    ready: bool,
    exiting: bool,
    failed: Option<String>,
    /// Set for a worker started to serve at once: why (handed over on Hello).
    start: Option<Start>,
}

struct Start {
    reason: String,
    began_us: u64,
    began: Instant,
    old_pid: u32,
    phases: Vec<Phase>,
    /// An upgrade whose RPC reply is due when this worker is ready.
    reply: Option<(File, Value)>,
}

#[derive(PartialEq, Debug)]
enum Stage {
    Preview,
    Quiesce,
    Handover,
}

struct Upgrade {
    binary: PathBuf,
    reply: Option<(File, Value)>,
    stage: Stage,
    step_began: Instant,
    prepare_began: Instant,
    phases: Vec<Phase>,
    began_us: u64,
    began: Instant,
    old_pid: u32,
    candidate_died: Option<String>,
    /// The old worker reported `Quiesced`; its exit (which releases the devices) is next.
    old_quiesced: bool,
}

struct Kept {
    value: String,
    files: Vec<File>,
}

struct Keeper {
    cfg: KeeperConfig,
    tx: Sender<Ev>,
    store: BTreeMap<String, Kept>,
    worker: Option<Child>,
    cand: Option<Child>,
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
}

fn status_text(s: &std::process::ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (_, Some(sig)) => format!("signal {sig}"),
        _ => "unknown status".into(),
    }
}

fn reply(r: Option<(File, Value)>, result: Result<Value, String>) {
    let Some((mut f, id)) = r else { return };
    let resp = match result {
        Ok(v) => json!({"jsonrpc": "2.0", "id": id, "result": v}),
        Err(m) => json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32000, "message": m}}),
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
        retiring: Vec::new(),
        up: None,
        generation: 0,
        crashes: VecDeque::new(),
        last_report: None,
        shutting_down: None,
        next_id: 1,
        last_ready_pid: None,
    };
    let binary = k.cfg.binary.clone();
    let start = Start {
        reason: "first-start".into(),
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
    fn spawn(
        &mut self,
        binary: &PathBuf,
        role: &str,
        start: Option<Start>,
    ) -> std::io::Result<Child> {
        let (mine, theirs) = Channel::pair()?;
        let fd: RawFd = theirs.raw_fd();
        let keeper_pid = std::process::id() as libc::pid_t;
        let mut cmd = Command::new(binary);
        cmd.args(&self.cfg.args)
            .env(CHANNEL_ENV, "3")
            .env(ROLE_ENV, role);
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe system calls on integers: it puts the channel on descriptor 3
        // (dup2 clears close-on-exec), asks to be killed with the keeper, and refuses to run
        // if the keeper already died.
        unsafe {
            cmd.pre_exec(move || {
                if fd == 3 {
                    libc::fcntl(3, libc::F_SETFD, 0);
                } else if libc::dup2(fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::getppid() != keeper_pid {
                    return Err(std::io::Error::other("keeper exited"));
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        drop(theirs);
        let id = self.next_id;
        self.next_id += 1;
        let pid = child.id();
        let reader = mine.try_clone()?;
        let tx = self.tx.clone();
        // One thread per child reads its messages until the channel closes (the process
        // exited), then reaps it: every message is handled before the exit.
        std::thread::Builder::new()
            .name(format!("keeper-rx{id}"))
            .spawn(move || {
                loop {
                    match reader.recv() {
                        Ok(Some((m, files))) => {
                            if tx.send(Ev::Msg(id, m, files)).is_err() {
                                break;
                            }
                        }
                        Ok(None) => break,
                        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                            tracing::error!(pid, "keeper: {e}");
                        }
                        Err(_) => break,
                    }
                }
                if let Ok(s) = child.wait() {
                    let _ = tx.send(Ev::Exited(id, s));
                }
            })?;
        tracing::info!(pid, role, binary = %binary.display(), "keeper: started worker process");
        Ok(Child {
            id,
            pid,
            chan: mine,
            binary: binary.clone(),
            spawned: Instant::now(),
            hello: None,
            ready: false,
            exiting: false,
            failed: None,
            start,
        })
    }

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
            Ev::Msg(id, m, files) => self.message(id, m, files),
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
            Msg::Hello { protocol, pid } => {
                let Some(c) = self.child(id) else { return };
                c.hello = Some(Instant::now());
                if protocol != PROTOCOL_VERSION {
                    let why = format!(
                        "worker {pid} speaks keeper protocol {protocol}, this keeper {PROTOCOL_VERSION}"
                    );
                    tracing::error!("keeper: {why}");
                    // SAFETY: kill(2) takes integers only. Our child, though its pid may be stale:
                    // its rx thread reaps it before `Ev::Exited` reaches this loop (see `spawn`).
                    unsafe { libc::kill(c.pid as libc::pid_t, libc::SIGKILL) };
                    c.failed = Some(why);
                    return;
                }
                if self.is_cand(id) {
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
                } else {
                    let Some(mut start) = self.child(id).and_then(|c| c.start.take()) else {
                        return;
                    };
                    let spawned = self.child(id).map(|c| c.spawned.elapsed());
                    start
                        .phases
                        .push(Phase::new("spawn worker", spawned.unwrap_or_default()));
                    let t = Instant::now();
                    self.generation += 1;
                    let info = StartInfo {
                        keeper_pid: std::process::id(),
                        generation: self.generation,
                        reason: start.reason.clone(),
                        last_restart: self.last_report.clone(),
                        restart_began_us: start.began_us,
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
            }
            Msg::Put { key, value, crc: c } => {
                if !self.may_store(id) {
                    return;
                }
                if crc(&value) != c {
                    tracing::error!(key = %key, "keeper: refusing a deposit whose checksum does not match");
                    return;
                }
                self.store.insert(key, Kept { value, files });
            }
            Msg::Remove { prefix } => {
                if !self.may_store(id) {
                    return;
                }
                self.store.retain(|k, _| !k.starts_with(&prefix));
            }
            Msg::Ready { phases } => self.ready(id, phases),
            Msg::Failed { reason } => {
                tracing::error!(reason = %reason, "keeper: worker reports failure");
                if let Some(c) = self.child(id) {
                    c.failed = Some(reason);
                }
            }
            Msg::Accept => {
                if !self.is_cand(id) || self.up.as_ref().map(|u| &u.stage) != Some(&Stage::Preview)
                {
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
            Msg::Reject { reason } => {
                if self.is_cand(id) {
                    self.abort_candidate(&format!("the new binary refused the state: {reason}"));
                }
            }
            Msg::Quiesced { phases } => {
                if self.is_worker(id) && self.up.as_ref().map(|u| &u.stage) == Some(&Stage::Quiesce)
                {
                    if let Some(u) = self.up.as_mut() {
                        u.phases.extend(phases);
                        u.phases
                            .push(Phase::new("stop old worker", u.step_began.elapsed()));
                        u.step_began = Instant::now();
                        u.old_quiesced = true;
                    }
                }
            }
            Msg::Exiting => {
                if let Some(c) = self.child(id) {
                    c.exiting = true;
                }
            }
            Msg::Upgrade { binary, rpc_id } => {
                let reply_to = files.into_iter().next().zip(rpc_id);
                let b = binary.map(PathBuf::from).unwrap_or_else(|| {
                    self.worker
                        .as_ref()
                        .map(|w| w.binary.clone())
                        .unwrap_or_else(|| self.cfg.binary.clone())
                });
                self.begin_upgrade(b, reply_to);
            }
            other => tracing::warn!("keeper: unexpected message from worker: {other:?}"),
        }
    }

    /// Deposits are taken from the serving worker, and from a candidate once it has the store.
    fn may_store(&self, id: u64) -> bool {
        self.is_worker(id)
            || (self.is_cand(id) && self.up.as_ref().map(|u| &u.stage) == Some(&Stage::Handover))
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

    fn begin_upgrade(&mut self, binary: PathBuf, reply_to: Option<(File, Value)>) {
        if self.up.is_some() {
            reply(reply_to, Err("an upgrade is already in progress".into()));
            return;
        }
        if self.worker.as_ref().is_none_or(|w| !w.ready) {
            reply(
                reply_to,
                Err("the worker is not serving yet; try again in a moment".into()),
            );
            return;
        }
        if self.shutting_down.is_some() {
            reply(reply_to, Err("spoold is shutting down".into()));
            return;
        }
        match self.spawn(&binary, "candidate", None) {
            Ok(c) => {
                self.cand = Some(c);
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
                reply(reply_to, Err(why));
            }
        }
    }

    /// Ends an upgrade before the old worker stopped: kill the candidate, answer the RPC.
    fn abort_candidate(&mut self, why: &str) {
        if let Some(c) = self.cand.take() {
            // SAFETY: kill(2) takes integers only. Our child, though its pid may be stale:
            // its rx thread reaps it before `Ev::Exited` reaches this loop (see `spawn`).
            unsafe { libc::kill(c.pid as libc::pid_t, libc::SIGKILL) };
            self.retiring.push(c.id);
        }
        if let Some(u) = self.up.take() {
            let why = format!(
                "upgrade to {} aborted: {why}; the old worker keeps serving",
                u.binary.display()
            );
            tracing::error!("keeper: {why}");
            self.set_report(RestartReport {
                kind: "upgrade".into(),
                old_pid: self.worker.as_ref().map(|w| w.pid).unwrap_or(0),
                new_pid: 0,
                binary: u.binary.display().to_string(),
                began_us: now_us(),
                phases: u.phases,
                stall_ms: 0.0,
                outcome: why.clone(),
            });
            reply(u.reply, Err(why));
        }
    }

    /// The old worker has exited (after quiescing, or died while quiescing): hand over.
    fn old_stopped(&mut self) {
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
    fn rollback(&mut self, why: &str) {
        let Some(u) = self.up.take() else { return };
        if let Some(c) = self.cand.take() {
            // SAFETY: kill(2) takes integers only. Our child, though its pid may be stale:
            // its rx thread reaps it before `Ev::Exited` reaches this loop (see `spawn`).
            unsafe { libc::kill(c.pid as libc::pid_t, libc::SIGKILL) };
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

    fn ready(&mut self, id: u64, phases: Vec<Phase>) {
        if self.is_cand(id) {
            let Some(u) = self.up.take() else { return };
            let Some(mut c) = self.cand.take() else {
                return;
            };
            c.ready = true;
            self.last_ready_pid = Some(c.pid);
            let mut all = u.phases;
            all.extend(phases);
            let report = RestartReport {
                kind: "upgrade".into(),
                old_pid: u.old_pid,
                new_pid: c.pid,
                binary: u.binary.display().to_string(),
                began_us: u.began_us,
                phases: all,
                stall_ms: u.began.elapsed().as_secs_f64() * 1e3,
                outcome: "ok".into(),
            };
            tracing::info!(old_pid = report.old_pid, new_pid = report.new_pid, stall_ms = format!("{:.2}", report.stall_ms), phases = %phase_text(&report.phases), "keeper: upgrade complete");
            self.cfg.binary = u.binary;
            self.worker = Some(c);
            self.set_report(report.clone());
            reply(
                u.reply,
                Ok(serde_json::to_value(&report).unwrap_or(Value::Null)),
            );
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
                return;
            }
            let mut all = start.phases;
            all.extend(phases);
            let report = RestartReport {
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
                Err(report.outcome.clone())
            } else {
                Ok(serde_json::to_value(&report).unwrap_or(Value::Null))
            };
            self.set_report(report);
            reply(start.reply, r);
        }
    }

    fn exited(&mut self, id: u64, status: std::process::ExitStatus) -> Option<ExitCode> {
        if let Some(i) = self.retiring.iter().position(|&r| r == id) {
            self.retiring.remove(i);
            return None;
        }
        if self.is_cand(id) {
            let c = self.cand.as_ref()?;
            let why = format!(
                "new worker {} exited ({}){}",
                c.pid,
                status_text(&status),
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
            return None;
        }
        if !self.is_worker(id) {
            return None;
        }
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
            self.abort_candidate(&why);
        }
        tracing::warn!("keeper: {why}; restarting it with the kept descriptors");
        let now = Instant::now();
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

    /// Records the latest report and tells the serving worker (for `daemon_status`).
    fn set_report(&mut self, r: RestartReport) {
        if let Some(w) = &self.worker {
            let _ = w.chan.send(&Msg::Report { report: r.clone() }, &[]);
        }
        self.last_report = Some(r);
    }

    fn check_deadlines(&mut self) -> Option<ExitCode> {
        let timeout = self.cfg.step_timeout;
        if let Some(t) = self.shutting_down {
            if t.elapsed() > Duration::from_secs(30) {
                if let Some(w) = &self.worker {
                    tracing::error!(
                        pid = w.pid,
                        "keeper: worker did not stop in 30 s; killing it"
                    );
                    // SAFETY: kill(2) takes integers only. Our child, though its pid may be stale:
                    // its rx thread reaps it before `Ev::Exited` reaches this loop (see `spawn`).
                    unsafe { libc::kill(w.pid as libc::pid_t, libc::SIGKILL) };
                }
                return Some(ExitCode::FAILURE);
            }
        }
        if let Some(w) = &self.worker {
            if w.hello.is_none() && w.spawned.elapsed() > timeout {
                tracing::error!(pid = w.pid, "keeper: worker did not report in; killing it");
                // SAFETY: kill(2) takes integers only. Our child, though its pid may be stale:
                // its rx thread reaps it before `Ev::Exited` reaches this loop (see `spawn`).
                unsafe { libc::kill(w.pid as libc::pid_t, libc::SIGKILL) };
            }
        }
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
            return None;
        }
        match stage {
            Some(0) => self.abort_candidate(&format!(
                "the new binary did not accept the state within {timeout:?}"
            )),
            Some(1) => {
                if let Some(w) = &self.worker {
                    tracing::error!(pid = w.pid, "keeper: old worker did not stop within {timeout:?}; killing it (the journal covers its in-flight I/O)");
                    // SAFETY: kill(2) takes integers only. Our child, though its pid may be stale:
                    // its rx thread reaps it before `Ev::Exited` reaches this loop (see `spawn`).
                    unsafe { libc::kill(w.pid as libc::pid_t, libc::SIGKILL) };
                }
                if let Some(u) = self.up.as_mut() {
                    u.step_began = Instant::now();
                }
            }
            Some(2) => {
                if let Some(c) = &self.cand {
                    // SAFETY: kill(2) takes integers only. Our child, though its pid may be stale:
                    // its rx thread reaps it before `Ev::Exited` reaches this loop (see `spawn`).
                    unsafe { libc::kill(c.pid as libc::pid_t, libc::SIGKILL) };
                }
                if let Some(u) = self.up.as_mut() {
                    u.step_began = Instant::now();
                }
            }
            _ => {}
        }
        None
    }
}

/// "name 1.23 ms, name 0.40 ms".
pub fn phase_text(p: &[Phase]) -> String {
    p.iter()
        .map(|p| format!("{} {:.2} ms", p.name, p.ms))
        .collect::<Vec<_>>()
        .join(", ")
}
