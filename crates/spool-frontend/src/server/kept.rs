//! Continuing a connection a previous process served: its session state back in place, and
//! a fresh `vhost` request handler primed to the features the frontend negotiated.
//!
//! Must not know: the keeper (the caller hands over the kept JSON and descriptors).

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use vhost::vhost_user::{BackendReqHandler, VhostUserVirtioFeatures};

use super::socket::limit_message_time;
use crate::session::{RestoreClock, RestoreError, Session, SessionState};
use crate::VolumeContext;

/// Sends the raw vhost-user messages that bring a fresh request handler to the feature state
/// the frontend negotiated with the previous process (the `vhost` crate keeps acked features
/// and REPLY_ACK privately and has no way to set them).
fn prime(
    handler: &mut BackendReqHandler<Mutex<Session>>,
    to_handler: &mut UnixStream,
    acked: u64,
    acked_protocol: u64,
) -> Result<(), RestoreError> {
    let mut send = |code: u32, body: Option<u64>| -> Result<(), RestoreError> {
        let mut m = Vec::with_capacity(20);
        m.extend_from_slice(&code.to_le_bytes());
        m.extend_from_slice(&1u32.to_le_bytes()); // version 1, no flags
        m.extend_from_slice(&(if body.is_some() { 8u32 } else { 0 }).to_le_bytes());
        if let Some(b) = body {
            m.extend_from_slice(&b.to_le_bytes());
        }
        to_handler.write_all(&m).map_err(RestoreError::Priming)?;
        handler
            .handle_request()
            .map_err(|why| RestoreError::Prime { code, why })
    };
    const GET_FEATURES: u32 = 1;
    const SET_FEATURES: u32 = 2;
    const GET_PROTOCOL_FEATURES: u32 = 15;
    const SET_PROTOCOL_FEATURES: u32 = 16;
    send(GET_FEATURES, None)?;
    send(SET_FEATURES, Some(acked))?;
    if acked & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
        send(GET_PROTOCOL_FEATURES, None)?;
        send(SET_PROTOCOL_FEATURES, Some(acked_protocol))?;
    }
    Ok(())
}

/// A request handler for a kept connection, in the negotiated state.
fn continue_connection(
    session: Arc<Mutex<Session>>,
    conn: &UnixStream,
) -> Result<BackendReqHandler<Mutex<Session>>, RestoreError> {
    let (acked, acked_protocol) = session.lock().map_err(|_| RestoreError::Poisoned)?.acked();
    let (a, mut b) = UnixStream::pair().map_err(RestoreError::Priming)?;
    let handler_fd: RawFd = a.as_raw_fd();
    let mut handler = BackendReqHandler::from_stream(a, session);
    prime(&mut handler, &mut b, acked, acked_protocol)?;
    // SAFETY: dup2 takes integers only. `handler_fd` is open and owned by the handler's socket
    // (moved into `handler`, alive here): the number stays owned and later closed by it, now
    // naming the kept connection; `conn` keeps its own. The priming end is closed by dup2.
    if unsafe { libc::dup2(conn.as_raw_fd(), handler_fd) } < 0 {
        return Err(RestoreError::Adopt(std::io::Error::last_os_error()));
    }
    Ok(handler)
}

pub(super) type Kept = (
    UnixStream,
    Arc<Mutex<Session>>,
    BackendReqHandler<Mutex<Session>>,
);

/// Continues a kept connection: session state back in place, queues recovered and running,
/// a request handler primed to the negotiated features.
pub(super) fn restore_connection(
    ctx: &Arc<VolumeContext>,
    json: &str,
    files: Vec<File>,
) -> Result<Kept, RestoreError> {
    {
        let st: SessionState = serde_json::from_str(json).map_err(RestoreError::Parse)?;
        let mut files: Vec<Option<File>> = files.into_iter().map(Some).collect();
        let conn_file = files
            .get_mut(st.conn)
            .and_then(Option::take)
            .ok_or(RestoreError::NoConnection)?;
        // SAFETY: `into_raw_fd` consumes the keeper-supplied `File`, so the descriptor keeps
        // exactly one owner; one that is not a socket only makes the socket calls fail.
        let conn =
            unsafe { UnixStream::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(conn_file)) };
        limit_message_time(&conn).map_err(RestoreError::Connection)?;
        let mut clock = RestoreClock::default();
        let session = Session::restore(ctx.clone(), &st, &mut files, &mut clock)?;
        ctx.settings().clock.add_restore(clock);
        let session = Arc::new(Mutex::new(session));
        let handler = continue_connection(session.clone(), &conn)?;
        tracing::info!(volume = %ctx.name(), "continuing the kept vhost-user connection");
        Ok((conn, session, handler))
    }
}
