//! The keeper channel: a connected `SOCK_SEQPACKET` pair, one JSON message per packet, with
//! descriptors attached as SCM_RIGHTS. Message boundaries are the kernel's, so a reader never
//! sees half a message, and a closed peer reads as end of file.
//!
//! Versioned: the first field of every stored value is checked by its owner, and each
//! `Entry`/`Put` carries a CRC32C of its value so a corrupted blob is refused, not parsed.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixDatagram;

use serde::{Deserialize, Serialize};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Environment variable naming the worker's end of the channel (a descriptor number).
pub const CHANNEL_ENV: &str = "SPOOL_KEEPER_FD";
/// Environment variable with the worker's role: `worker` or `candidate` (upgrade).
pub const ROLE_ENV: &str = "SPOOL_KEEPER_ROLE";
/// Largest message (JSON bytes).
pub const MAX_MSG: usize = 60 * 1024;
/// Most descriptors in one message (the kernel allows 253).
pub const MAX_FDS: usize = 250;
/// Version of this channel protocol; keeper and worker must agree.
pub const PROTOCOL_VERSION: u32 = 1;

/// A named restart phase and how long it took.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Phase {
    pub name: String,
    pub ms: f64,
}

impl Phase {
    /// A phase from a duration.
    pub fn new(name: &str, d: std::time::Duration) -> Phase {
        Phase {
            name: name.to_string(),
            ms: d.as_secs_f64() * 1e3,
        }
    }
}

/// What the keeper tells a worker when it hands over the store.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct StartInfo {
    pub keeper_pid: u32,
    /// How many workers the keeper has started (1 = first start).
    pub generation: u64,
    /// `first-start`, `crash-restart`, `upgrade` or `rollback`.
    pub reason: String,
    /// The previous restart or upgrade, complete (phases, outcome).
    pub last_restart: Option<RestartReport>,
    /// When the restart began (µs since the epoch): the worker measures its first I/O from it.
    pub restart_began_us: u64,
    /// How often the keeper wants `Alive` (ms; 0: never, as with keepers before it).
    #[serde(default)]
    pub alive_every_ms: u64,
}

/// One restart or upgrade, as the keeper measured it.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct RestartReport {
    /// `crash-restart`, `upgrade`, `rollback`.
    pub kind: String,
    pub old_pid: u32,
    pub new_pid: u32,
    /// Binary of the new worker.
    pub binary: String,
    /// µs since the epoch when service stopped (quiesce began, or the worker died).
    pub began_us: u64,
    /// Phases in order; for upgrades `prepare` happens before service stops.
    pub phases: Vec<Phase>,
    /// From service stopping to the new worker serving (ms).
    pub stall_ms: f64,
    /// `ok`, or why it failed and what was done instead.
    pub outcome: String,
    /// Restarts and upgrades so far by kind (`crash-restart`, `upgrade`, `upgrade-failed`,
    /// `keeper-restart`, …), as the keeper counted them, this one included.
    #[serde(default)]
    pub counts: std::collections::BTreeMap<String, u64>,
    /// Every restart and upgrade so far by kind (the keys of `counts`): stall histogram and
    /// phase totals, so that one kind's phases are not lost when another follows.
    #[serde(default)]
    pub history: RestartHistory,
}

/// Upper bounds (ms) of the restart-stall histogram's buckets; one more bucket counts slower.
pub const STALL_BUCKETS_MS: [f64; 12] = [
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
];

/// Restarts and upgrades by kind (as in `RestartReport::counts`).
pub type RestartHistory = std::collections::BTreeMap<String, KindHistory>;

/// The restarts of one kind, accumulated by the keeper.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct KindHistory {
    /// Stalls per bucket of [`STALL_BUCKETS_MS`] (not cumulative; the last: slower).
    pub stall_buckets: Vec<u64>,
    /// Sum of the stalls, ms.
    pub stall_sum_ms: f64,
    /// Each phase's duration summed over these restarts, ms.
    pub phase_sum_ms: std::collections::BTreeMap<String, f64>,
}

impl KindHistory {
    /// Adds one restart.
    pub fn add(&mut self, r: &RestartReport) {
        self.stall_buckets.resize(STALL_BUCKETS_MS.len() + 1, 0);
        let b = STALL_BUCKETS_MS
            .iter()
            .position(|&le| r.stall_ms <= le)
            .unwrap_or(STALL_BUCKETS_MS.len());
        self.stall_buckets[b] += 1;
        self.stall_sum_ms += r.stall_ms;
        for p in &r.phases {
            *self.phase_sum_ms.entry(p.name.clone()).or_default() += p.ms;
        }
    }

    /// Restarts counted.
    pub fn count(&self) -> u64 {
        self.stall_buckets.iter().sum()
    }
}

/// Every message on the channel.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Msg {
    // ---- worker → keeper ----
    /// First message of every worker: its protocol version and the state formats it reads.
    Hello { protocol: u32, pid: u32 },
    /// Store `value` and the attached descriptors under `key`, replacing what was there.
    Put {
        key: String,
        value: String,
        crc: u32,
    },
    /// Forget every key starting with `prefix` (closing its descriptors).
    Remove { prefix: String },
    /// Restore done; serving. Phases measured inside the worker.
    Ready { phases: Vec<Phase> },
    /// Startup or restore failed; the worker exits next.
    Failed { reason: String },
    /// Candidate: the state preview is readable.
    Accept,
    /// Candidate: the state cannot be taken over (the old worker keeps running).
    Reject { reason: String },
    /// The worker stopped serving, released its devices and stored its final state.
    Quiesced { phases: Vec<Phase> },
    /// The worker is shutting down for good (operator asked); do not restart it.
    Exiting,
    /// Every queue thread is making progress (sent every `StartInfo::alive_every_ms` when
    /// the keeper asked for it; a worker that stops sending is killed and restarted).
    Alive,
    /// Operator asked for an upgrade. An attached descriptor is the RPC connection to answer
    /// on with a JSON-RPC response carrying `rpc_id`.
    Upgrade {
        binary: Option<String>,
        rpc_id: Option<serde_json::Value>,
    },
    // ---- keeper → worker ----
    /// Candidate only: the keys and values (no descriptors) it would take over.
    Preview { entries: Vec<(String, String)> },
    /// One stored entry with its descriptors.
    Entry {
        key: String,
        value: String,
        crc: u32,
    },
    /// The store has been handed over; start serving.
    End { info: StartInfo },
    /// Stop serving, drain, store final state, release devices, then send `Quiesced`.
    Quiesce,
    /// Shut down for good (the keeper is stopping).
    Shutdown,
    /// The latest restart or upgrade report (sent when it completes or fails).
    Report { report: RestartReport },
}

/// CRC32C of a stored value.
pub fn crc(value: &str) -> u32 {
    crc32c::crc32c(value.as_bytes())
}

/// One end of the keeper channel.
#[derive(Debug)]
pub struct Channel(UnixDatagram);

impl Channel {
    /// A connected pair (both ends close-on-exec).
    pub fn pair() -> std::io::Result<(Channel, Channel)> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: socketpair writes two descriptors into the array on our stack.
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just created and are owned by nobody else.
        // A SEQPACKET socket is driven through the same send/recv calls as a datagram one.
        Ok(unsafe {
            (
                Channel(UnixDatagram::from_raw_fd(fds[0])),
                Channel(UnixDatagram::from_raw_fd(fds[1])),
            )
        })
    }

    /// Adopts the channel inherited from the keeper (from [`CHANNEL_ENV`]).
    pub fn from_env() -> Option<std::io::Result<Channel>> {
        let v = std::env::var(CHANNEL_ENV).ok()?;
        let fd: RawFd = match v.parse() {
            Ok(fd) if fd >= 3 => fd,
            _ => {
                return Some(Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("{CHANNEL_ENV}={v} is not a descriptor number"),
                )))
            }
        };
        let mut ty: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes an int into `ty` on our stack; it only checks the fd.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_TYPE,
                (&mut ty as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if r != 0 || ty != libc::SOCK_SEQPACKET {
            return Some(Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{CHANNEL_ENV}={fd} is not a keeper channel"),
            )));
        }
        // SAFETY: the keeper put our channel on this number (`spawn`'s pre_exec) for our
        // exclusive use; we checked it is a seqpacket socket, and `from_env` runs once per
        // process (spoold's `KeeperLink::from_env`), so it gets one owner. Close-on-exec.
        unsafe {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            Some(Ok(Channel(UnixDatagram::from_raw_fd(fd))))
        }
    }

    /// The raw descriptor (to hand to a child process).
    pub fn raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Another handle on the same channel end.
    pub fn try_clone(&self) -> std::io::Result<Channel> {
        Ok(Channel(self.0.try_clone()?))
    }

    /// Sends one message with descriptors.
    pub fn send(&self, msg: &Msg, fds: &[RawFd]) -> std::io::Result<()> {
        let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
        if body.len() > MAX_MSG {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("keeper message of {} bytes exceeds {MAX_MSG}", body.len()),
            ));
        }
        if fds.len() > MAX_FDS {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} descriptors exceed {MAX_FDS} per message", fds.len()),
            ));
        }
        let n = self
            .0
            .send_with_fds(&[&body[..]], fds)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        if n != body.len() {
            return Err(std::io::Error::other("short send on keeper channel"));
        }
        Ok(())
    }

    /// Receives one message; `None` when the peer has closed its end. Its descriptors are
    /// installed close-on-exec by the kernel as they arrive (`MSG_CMSG_CLOEXEC`): a child
    /// another thread starts meanwhile (the health hook, the key command) inherits none of
    /// them. (They were marked after `recvmsg` returned, which left that window open.)
    pub fn recv(&self) -> std::io::Result<Option<(Msg, Vec<File>)>> {
        let mut buf = vec![0u8; MAX_MSG + 1];
        let (n, files) = recv_cloexec(&self.0, &mut buf)?;
        if n == 0 {
            return Ok(None);
        }
        if n > MAX_MSG {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "oversized keeper message",
            ));
        }
        let msg: Msg = serde_json::from_slice(&buf[..n]).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("malformed keeper message: {e}"),
            )
        })?;
        Ok(Some((msg, files)))
    }
}

/// One datagram into `buf` and the descriptors that came with it (at most [`MAX_FDS`]),
/// installed close-on-exec atomically. A message whose descriptors did not all fit is refused
/// (the kernel closed the rest; those received are closed with the error).
fn recv_cloexec(sock: &UnixDatagram, buf: &mut [u8]) -> std::io::Result<(usize, Vec<File>)> {
    let fd_bytes = (MAX_FDS * std::mem::size_of::<libc::c_int>()) as libc::c_uint;
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    // u64s: the control buffer aligned as a cmsghdr needs.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: a zeroed msghdr is a valid empty one; its pointers are set below to memory
    // that outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = (control.len() * 8) as _;
    // SAFETY: `msg` points at `buf` and `control`, both alive and writable for their lengths;
    // recvmsg writes at most those.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut files = Vec::new();
    // SAFETY: the CMSG_* walk stays inside `msg.msg_control[..msg_controllen]`, which the
    // kernel filled; each SCM_RIGHTS payload is an array of descriptors it installed for us,
    // each owned once, here.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            let h = &*c;
            if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const libc::c_int;
                let len = (h.cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                for i in 0..len / std::mem::size_of::<libc::c_int>() {
                    files.push(File::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a keeper message carried more than {MAX_FDS} descriptors"),
        ));
    }
    Ok((n as usize, files))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn a_kinds_history_buckets_stalls_and_sums_phases() {
        let mut h = KindHistory::default();
        let r = |stall_ms: f64, spawn: f64| RestartReport {
            stall_ms,
            phases: vec![Phase {
                name: "spawn worker".into(),
                ms: spawn,
            }],
            ..Default::default()
        };
        h.add(&r(0.5, 0.25));
        h.add(&r(7.0, 3.0));
        h.add(&r(9000.0, 1.0));
        assert_eq!(h.count(), 3);
        assert_eq!(h.stall_buckets.len(), STALL_BUCKETS_MS.len() + 1);
        assert_eq!(h.stall_buckets[0], 1, "0.5 ms <= 1 ms");
        assert_eq!(h.stall_buckets[3], 1, "7 ms <= 10 ms");
        assert_eq!(
            h.stall_buckets[STALL_BUCKETS_MS.len()],
            1,
            "slower than every bound"
        );
        assert_eq!(h.stall_sum_ms, 9007.5);
        assert_eq!(h.phase_sum_ms["spawn worker"], 4.25);
        // Reports of keepers before the history still parse.
        let old: RestartReport = serde_json::from_str(
            r#"{"kind":"upgrade","old_pid":1,"new_pid":2,"binary":"b","began_us":0,"phases":[],"stall_ms":1.0,"outcome":"ok"}"#,
        )
        .unwrap();
        assert!(old.history.is_empty());
    }

    #[test]
    fn messages_and_descriptors_cross_the_channel() {
        let (a, b) = Channel::pair().unwrap();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(b"kept").unwrap();
        let v = "{\"x\":1}".to_string();
        a.send(
            &Msg::Put {
                key: "vol/a".into(),
                value: v.clone(),
                crc: crc(&v),
            },
            &[f.as_raw_fd()],
        )
        .unwrap();
        let (m, mut files) = b.recv().unwrap().unwrap();
        assert_eq!(
            m,
            Msg::Put {
                key: "vol/a".into(),
                value: v.clone(),
                crc: crc(&v)
            }
        );
        assert_eq!(files.len(), 1);
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let flags = unsafe { libc::fcntl(files[0].as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC, "close-on-exec");
        let mut s = String::new();
        files[0].rewind().unwrap();
        files[0].read_to_string(&mut s).unwrap();
        assert_eq!(s, "kept");
        drop(a);
        assert!(b.recv().unwrap().is_none(), "closed peer reads as EOF");
    }

    #[test]
    fn oversized_and_garbage_messages_are_refused() {
        let (a, b) = Channel::pair().unwrap();
        let big = "x".repeat(MAX_MSG + 10);
        assert!(a
            .send(
                &Msg::Remove {
                    prefix: big.clone()
                },
                &[]
            )
            .is_err());
        a.0.send(b"not json").unwrap();
        let e = b.recv().unwrap_err();
        assert!(e.to_string().contains("malformed"), "{e}");
    }
}
