//! The worker's side of the keeper channel: deposit descriptors and state as they change,
//! take the store over at start, and receive the keeper's commands.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::RawFd;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Mutex;

use crate::proto::{crc, Channel, Msg, Phase, StartInfo, PROTOCOL_VERSION, ROLE_ENV};

/// What the keeper handed over at start.
#[derive(Debug, Default)]
pub struct Restored {
    entries: BTreeMap<String, (String, Vec<File>)>,
    /// Why and how this worker was started.
    pub info: StartInfo,
    /// Entries refused because their checksum did not match (their descriptors are closed).
    pub refused: Vec<String>,
}

impl Restored {
    /// Takes one entry out (value and descriptors).
    pub fn take(&mut self, key: &str) -> Option<(String, Vec<File>)> {
        self.entries.remove(key)
    }

    /// Keys still not taken.
    pub fn keys(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }

    /// True when nothing is left.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A command from the keeper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Stop serving for an upgrade (see [`Msg::Quiesce`]).
    Quiesce,
    /// Shut down for good.
    Shutdown,
    /// The channel closed: the keeper is gone (we are about to be killed with it).
    KeeperGone,
}

/// The worker's link to its keeper.
pub struct KeeperLink {
    chan: Mutex<Channel>,
    candidate: bool,
    report: std::sync::Arc<Mutex<Option<crate::proto::RestartReport>>>,
}

fn io_err(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

impl KeeperLink {
    /// The link, if this process was started by a keeper.
    pub fn from_env() -> Option<std::io::Result<KeeperLink>> {
        let chan = match Channel::from_env()? {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        let candidate = std::env::var(ROLE_ENV).as_deref() == Ok("candidate");
        let link = KeeperLink {
            chan: Mutex::new(chan),
            candidate,
            report: Default::default(),
        };
        let hello = Msg::Hello {
            protocol: PROTOCOL_VERSION,
            pid: std::process::id(),
        };
        Some(link.send(&hello, &[]).map(|_| link))
    }

    /// Whether this worker was started as an upgrade candidate.
    pub fn is_candidate(&self) -> bool {
        self.candidate
    }

    fn send(&self, msg: &Msg, fds: &[RawFd]) -> std::io::Result<()> {
        self.chan
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(msg, fds)
    }

    fn recv(&self) -> std::io::Result<(Msg, Vec<File>)> {
        let c = self
            .chan
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .try_clone()?;
        c.recv()?
            .ok_or_else(|| io_err("keeper closed the channel".into()))
    }

    /// Candidate: reads the preview of the state and answers whether `validate` accepts it
    /// (its error, as text, is the reason the keeper is told). Returns whether it was accepted.
    pub fn preview(
        &self,
        validate: impl FnOnce(&[(String, String)]) -> Result<(), Box<dyn std::error::Error>>,
    ) -> std::io::Result<bool> {
        match self.recv()? {
            (Msg::Preview { entries }, _) => match validate(&entries) {
                Ok(()) => self.send(&Msg::Accept, &[]).map(|_| true),
                Err(e) => {
                    let reason = e.to_string();
                    self.send(&Msg::Reject { reason }, &[]).map(|_| false)
                }
            },
            (m, _) => Err(io_err(format!("expected a state preview, got {m:?}"))),
        }
    }

    /// Receives the whole store (entries, then the start info).
    pub fn receive_store(&self) -> std::io::Result<Restored> {
        let mut r = Restored::default();
        loop {
            match self.recv()? {
                (Msg::Entry { key, value, crc: c }, files) => {
                    if crc(&value) != c {
                        tracing::error!(key = %key, "kept state failed its checksum; not restoring it");
                        r.refused.push(key);
                        continue;
                    }
                    r.entries.insert(key, (value, files));
                }
                (Msg::End { info }, _) => {
                    r.info = info;
                    return Ok(r);
                }
                (Msg::Shutdown, _) => return Err(io_err("keeper is shutting down".into())),
                (m, _) => return Err(io_err(format!("unexpected keeper message {m:?}"))),
            }
        }
    }

    /// Stores `value` and `fds` under `key` in the keeper (the keeper gets its own copies).
    pub fn put(&self, key: &str, value: String, fds: &[RawFd]) -> std::io::Result<()> {
        let c = crc(&value);
        self.send(
            &Msg::Put {
                key: key.to_string(),
                value,
                crc: c,
            },
            fds,
        )
    }

    /// Forgets every key starting with `prefix`.
    pub fn remove(&self, prefix: &str) -> std::io::Result<()> {
        self.send(
            &Msg::Remove {
                prefix: prefix.to_string(),
            },
            &[],
        )
    }

    /// Serving.
    pub fn ready(&self, phases: Vec<Phase>) -> std::io::Result<()> {
        self.send(&Msg::Ready { phases }, &[])
    }

    /// Start or restore failed.
    pub fn failed(&self, reason: &str) -> std::io::Result<()> {
        self.send(
            &Msg::Failed {
                reason: reason.to_string(),
            },
            &[],
        )
    }

    /// Quiesced for an upgrade.
    pub fn quiesced(&self, phases: Vec<Phase>) -> std::io::Result<()> {
        self.send(&Msg::Quiesced { phases }, &[])
    }

    /// Exiting for good.
    pub fn exiting(&self) -> std::io::Result<()> {
        self.send(&Msg::Exiting, &[])
    }

    /// Tells the keeper every queue thread is making progress (its watchdog).
    pub fn alive(&self) -> std::io::Result<()> {
        self.send(&Msg::Alive, &[])
    }

    /// Asks the keeper to upgrade; it answers on `reply` (a JSON-RPC connection) if given.
    pub fn upgrade(
        &self,
        binary: Option<String>,
        rpc_id: Option<serde_json::Value>,
        reply: Option<RawFd>,
    ) -> std::io::Result<()> {
        let fds: Vec<RawFd> = reply.into_iter().collect();
        self.send(&Msg::Upgrade { binary, rpc_id }, &fds)
    }

    /// The latest restart report the keeper sent (at start: the one before this worker).
    pub fn last_report(&self) -> Option<crate::proto::RestartReport> {
        self.report
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records the report handed over at start.
    pub fn set_report(&self, r: Option<crate::proto::RestartReport>) {
        *self.report.lock().unwrap_or_else(|p| p.into_inner()) = r;
    }

    /// Starts a thread that turns keeper commands into a channel.
    pub fn commands(&self) -> std::io::Result<Receiver<Command>> {
        let c = self
            .chan
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .try_clone()?;
        let (tx, rx) = channel();
        let report = self.report.clone();
        std::thread::Builder::new()
            .name("keeper-link".into())
            .spawn(move || loop {
                let cmd = match c.recv() {
                    Ok(Some((Msg::Quiesce, _))) => Command::Quiesce,
                    Ok(Some((Msg::Shutdown, _))) => Command::Shutdown,
                    Ok(Some((Msg::Report { report: r }, _))) => {
                        *report.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
                        continue;
                    }
                    Ok(Some((m, _))) => {
                        tracing::warn!("ignoring unexpected keeper message {m:?}");
                        continue;
                    }
                    Ok(None) | Err(_) => Command::KeeperGone,
                };
                let gone = cmd == Command::KeeperGone;
                if tx.send(cmd).is_err() || gone {
                    return;
                }
            })?;
        Ok(rx)
    }
}
