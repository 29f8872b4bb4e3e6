//! The service manager's side channel, spoken by the keeper (the unit's main process): the
//! `sd_notify` datagram protocol (`READY=1`, `STATUS=`, `RELOADING=1`, `STOPPING=1`,
//! `WATCHDOG=1`, and `FDSTORE=1` with descriptors) and the descriptors a restarted service
//! gets back (`LISTEN_FDS`, `LISTEN_FDNAMES`).
//!
//! Implemented here on the documented wire protocol (sd_notify(3), sd_listen_fds(3)) rather
//! than by linking libsystemd: it is one datagram per message, and the keeper must keep
//! working on machines without systemd, where `NOTIFY_SOCKET` is simply unset.
//!
//! Owns: the notify socket and the parsing of the inherited descriptors.
//! Must not know: what the descriptors are, or the keeper's store.

use std::fs::File;
use std::os::fd::{FromRawFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Environment variables systemd sets for the main process, cleared for workers (they talk to
/// the keeper, never to systemd).
pub const SYSTEMD_ENV: [&str; 7] = [
    "NOTIFY_SOCKET",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "FDSTORE",
];

/// A connected notify socket (`NOTIFY_SOCKET`), if the service manager gave one.
pub struct Notifier {
    sock: UnixDatagram,
    /// `WATCHDOG_USEC` for this process: how often systemd wants `WATCHDOG=1`.
    watchdog: Option<Duration>,
}

impl Notifier {
    /// The notifier from the environment; `None` without systemd (or with an unusable socket,
    /// which is logged).
    pub fn from_env() -> Option<Notifier> {
        Self::connect(&std::env::var_os("NOTIFY_SOCKET")?)
    }

    /// The notifier on socket `path` (`@name` for an abstract socket).
    pub fn connect(path: &std::ffi::OsStr) -> Option<Notifier> {
        let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path).to_vec();
        let addr = match bytes.first() {
            Some(b'@') => SocketAddr::from_abstract_name(&bytes[1..]),
            Some(b'/') => SocketAddr::from_pathname(std::path::Path::new(path)),
            _ => {
                tracing::warn!(socket = ?path, "NOTIFY_SOCKET is neither a path nor abstract; not notifying systemd");
                return None;
            }
        };
        let sock = UnixDatagram::unbound().and_then(|s| {
            s.connect_addr(&addr?)?;
            s.set_write_timeout(Some(Duration::from_secs(1)))?;
            Ok(s)
        });
        match sock {
            Ok(sock) => Some(Notifier {
                sock,
                watchdog: watchdog_interval(),
            }),
            Err(e) => {
                tracing::warn!(socket = ?path, "cannot connect to systemd's notify socket: {e}");
                None
            }
        }
    }

    /// The watchdog interval systemd asked for (`WatchdogSec=`), if any.
    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog
    }

    /// Sends one notification (lines `KEY=value`).
    pub fn notify(&self, state: &str) -> std::io::Result<()> {
        self.send(state, &[])
    }

    /// Sends one notification with descriptors attached (`FDSTORE=1`).
    pub fn send(&self, state: &str, fds: &[RawFd]) -> std::io::Result<()> {
        let n = self
            .sock
            .send_with_fds(&[state.as_bytes()], fds)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        if n != state.len() {
            return Err(std::io::Error::other(
                "short send to systemd's notify socket",
            ));
        }
        Ok(())
    }
}

fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.parse::<u32>().ok() != Some(std::process::id()) {
            return None;
        }
    }
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// One descriptor systemd handed back, with the name it was stored under.
pub struct Inherited {
    pub name: String,
    pub file: File,
}

/// Takes the descriptors systemd passed to this process (`LISTEN_FDS` from descriptor 3, named
/// by `LISTEN_FDNAMES`), marks them close-on-exec and clears the variables. Empty when none
/// were passed or they are meant for another process.
pub fn take_inherited() -> Vec<Inherited> {
    let pid_ok = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        == Some(std::process::id());
    let n: usize = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
    for v in ["LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"] {
        std::env::remove_var(v);
    }
    if !pid_ok || n == 0 {
        return Vec::new();
    }
    let mut names = names.split(':');
    (0..n)
        .filter_map(|i| {
            let fd = 3 + i as RawFd;
            let name = names.next().unwrap_or("unknown").to_string();
            // SAFETY: fcntl on an integer; a descriptor systemd did not actually pass fails
            // with EBADF and is skipped.
            if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
                tracing::warn!(fd, name, "systemd named a descriptor that is not open");
                return None;
            }
            // SAFETY: systemd passed descriptor `fd` to this process (LISTEN_PID is ours) and
            // nothing else in this process has taken it: this runs once, at start.
            Some(Inherited {
                name,
                file: unsafe { File::from_raw_fd(fd) },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_and_descriptors_reach_an_abstract_socket() {
        let name = format!("spool-notify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let server = UnixDatagram::bind_addr(&addr).unwrap();
        let n = Notifier::connect(format!("@{name}").as_ref()).expect("notifier");
        n.notify("READY=1\nSTATUS=serving").unwrap();
        let f = tempfile::tempfile().unwrap();
        n.send(
            "FDSTORE=1\nFDNAME=x",
            &[std::os::fd::AsRawFd::as_raw_fd(&f)],
        )
        .unwrap();
        let mut buf = [0u8; 64];
        let k = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..k], b"READY=1\nSTATUS=serving");
        let mut fds = [0; 2];
        let mut iov = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        // SAFETY: the iovec points at `buf`, which outlives the call; recvmsg writes at most
        // two descriptors into our array.
        let (k, nfds) = unsafe { server.recv_with_fds(&mut iov, &mut fds) }.unwrap();
        assert_eq!(&buf[..k], b"FDSTORE=1\nFDNAME=x");
        assert_eq!(nfds, 1);
        // SAFETY: the descriptor was just received and is ours.
        drop(unsafe { File::from_raw_fd(fds[0]) });
    }
}
