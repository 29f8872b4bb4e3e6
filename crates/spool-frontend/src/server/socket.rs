//! Socket helpers of the serving thread: binding the volume's socket, bounding how long one
//! message may take, and asking the kernel about the peer. Must not know: vhost-user.

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

pub(super) fn bind(path: &Path) -> std::io::Result<UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            std::fs::remove_file(path)?
        }
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket; refusing to replace it",
                    path.display()
                ),
            ))
        }
        Err(_) => {}
    }
    UnixListener::bind(path)
}

/// How long one vhost-user message may take to arrive in full once its first bytes did (or
/// a reply to be taken by the frontend). The serving thread reads a message with blocking
/// calls: a frontend that sends a header and never the body it announced would otherwise
/// hold the thread, and with it every stop and upgrade of the daemon, forever.
const MESSAGE_TIME_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

pub(super) fn limit_message_time(s: &UnixStream) -> std::io::Result<()> {
    s.set_read_timeout(Some(MESSAGE_TIME_LIMIT))?;
    s.set_write_timeout(Some(MESSAGE_TIME_LIMIT))
}

/// Whether the peer of `s` has closed its end (the connection is over, whatever it left
/// unread).
pub(super) fn peer_closed(s: &UnixStream) -> bool {
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: poll reads and writes the one pollfd we own; a zero timeout never blocks.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// The process id of a Unix socket's peer, for log lines (None if the kernel cannot say).
pub(super) fn peer_pid(s: &UnixStream) -> Option<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` (= size_of::<ucred>) bytes into `cred` on our
    // stack; the peer only chooses the values, which are only logged.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(cred.pid)
}
