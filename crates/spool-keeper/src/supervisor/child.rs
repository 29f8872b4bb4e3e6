//! The keeper's worker processes: starting one (channel on descriptor 3, killed with the
//! keeper) and the thread that reads its messages and then reaps it.
//!
//! Owns: [`Child`] (one running worker or candidate as the keeper sees it) and [`Start`]
//! (why a worker was started to serve at once, for its restart report).
//!
//! Must not know: the upgrade stages or what the worker deposits.

use std::fs::File;
use std::os::fd::RawFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use serde_json::Value;

use super::{Ev, Keeper};
use crate::proto::{Channel, Phase, CHANNEL_ENV, ROLE_ENV};

pub(super) struct Child {
    pub(super) id: u64,
    pub(super) pid: u32,
    pub(super) chan: Channel,
    pub(super) binary: PathBuf,
    pub(super) spawned: Instant,
    pub(super) hello: Option<Instant>,
    pub(super) ready: bool,
    pub(super) exiting: bool,
    pub(super) failed: Option<String>,
    /// Set for a worker started to serve at once: why (handed over on Hello).
    pub(super) start: Option<Start>,
    /// A standby promoted to serve (its process started long before).
    pub(super) promoted: bool,
    /// Its last `Alive` (the worker watchdog).
    pub(super) last_alive: Option<Instant>,
}

pub(super) struct Start {
    pub(super) reason: String,
    pub(super) began_us: u64,
    pub(super) began: Instant,
    pub(super) old_pid: u32,
    pub(super) phases: Vec<Phase>,
    /// An upgrade whose RPC reply is due when this worker is ready.
    pub(super) reply: Option<(File, Value)>,
}

/// Kills a child of the keeper with SIGKILL.
pub(super) fn kill(pid: u32) {
    // SAFETY: kill(2) takes integers only. Our child, though its pid may be stale:
    // its rx thread reaps it before `Ev::Exited` reaches this loop (see `spawn`).
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
}

impl Keeper {
    pub(super) fn spawn(
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
        for v in crate::systemd::SYSTEMD_ENV {
            cmd.env_remove(v);
        }
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
                            if tx.send(Ev::Msg(id, Box::new(m), files)).is_err() {
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
            promoted: false,
            last_alive: None,
        })
    }
}
