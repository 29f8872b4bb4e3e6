//! One vhost-user listening socket per volume, serving one frontend at a time: a second
//! connection while one is served is closed at once and logged (the connected VM notices
//! nothing), and the socket accepts the next frontend after the current one disconnects (a
//! VM can reboot or reconnect).
//!
//! With a [`StateStore`] (the keeper), the listening socket, the live connection and the
//! session state are deposited after every vhost-user message, so a new process can continue
//! the same connection ([`Restore`]). [`VolumeServer::detach`] stops serving without closing
//! anything the frontend can see (the graceful-upgrade path).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vhost::vhost_user::{BackendReqHandler, Error as VhostError};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

mod admission;
mod kept;
mod socket;

pub use admission::{Admission, AdmissionHold};
use kept::{restore_connection, Kept};
use socket::{bind, limit_message_time, peer_closed, peer_pid};

use crate::ratelimit::{self, LogLimit, Verdict};
use crate::session::Session;
use crate::{StateStore, VolumeContext};

const RUN: u8 = 0;
const SHUTDOWN: u8 = 1;
const DETACH: u8 = 2;

const TOKEN_WAKE: u64 = 0;
const TOKEN_LISTEN: u64 = 1;
const TOKEN_CONN: u64 = 2;
const TOKEN_FAULT: u64 = 3;

/// Keeper key of a volume's listening socket.
pub fn listen_key(volume: uuid::Uuid) -> String {
    format!("vol/{volume}/listen")
}

/// Keeper key of a volume's live connection and session state.
pub fn session_key(volume: uuid::Uuid) -> String {
    format!("vol/{volume}/session")
}

/// What a previous process left for this volume.
#[derive(Default)]
pub struct Restore {
    /// The listening socket (clients queued in its backlog are kept).
    pub listener: Option<UnixListener>,
    /// The live connection's state (JSON [`SessionState`]) and its descriptors.
    pub session: Option<(String, Vec<File>)>,
}

type SessionSlot = Arc<Mutex<Option<Arc<Mutex<Session>>>>>;

/// A running vhost-user-blk server for one volume.
pub struct VolumeServer {
    path: PathBuf,
    ctx: Arc<VolumeContext>,
    mode: Arc<AtomicU8>,
    wake: EventFd,
    connected: Arc<AtomicBool>,
    admission: Arc<Admission>,
    session: SessionSlot,
    thread: Option<JoinHandle<()>>,
}

/// Everything the serving thread owns.
struct Serve {
    ctx: Arc<VolumeContext>,
    store: Option<Arc<dyn StateStore>>,
    mode: Arc<AtomicU8>,
    epoll: Epoll,
    connected: Arc<AtomicBool>,
    admission: Arc<Admission>,
    slot: SessionSlot,
}

impl VolumeServer {
    /// Serves `path`: binds it (replacing a stale socket file) unless `restore` brings the
    /// listening socket, and continues the kept connection first if there is one.
    pub fn start(
        path: &Path,
        ctx: Arc<VolumeContext>,
        store: Option<Arc<dyn StateStore>>,
        restore: Restore,
    ) -> std::io::Result<VolumeServer> {
        Ok(Self::start_gated(path, ctx, store, restore, false)?.0)
    }

    /// [`VolumeServer::start`] with new frontends kept out (waiting) from the first moment
    /// until the hold is dropped: a volume no VM may run yet (another host's replica).
    pub fn start_held(
        path: &Path,
        ctx: Arc<VolumeContext>,
        store: Option<Arc<dyn StateStore>>,
        restore: Restore,
    ) -> std::io::Result<(VolumeServer, AdmissionHold)> {
        let (server, hold) = Self::start_gated(path, ctx, store, restore, true)?;
        Ok((server, hold.expect("no frontend before the server starts")))
    }

    fn start_gated(
        path: &Path,
        ctx: Arc<VolumeContext>,
        store: Option<Arc<dyn StateStore>>,
        restore: Restore,
        held: bool,
    ) -> std::io::Result<(VolumeServer, Option<AdmissionHold>)> {
        let listener = match restore.listener {
            Some(l) => l,
            None => bind(path)?,
        };
        if let Some(s) = &store {
            if let Err(e) = s.put(
                &listen_key(ctx.uuid()),
                format!("{{\"path\":{:?}}}", path.display().to_string()),
                &[listener.as_raw_fd()],
            ) {
                tracing::error!(volume = %ctx.name(), "cannot deposit the listening socket: {e}; a crash now makes frontends reconnect");
            }
        }
        let wake = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?;
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            wake.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_WAKE),
        )?;
        if let Some(fd) = ctx.fault().fd() {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, TOKEN_FAULT),
            )?;
        }
        let mode = Arc::new(AtomicU8::new(RUN));
        let connected = Arc::new(AtomicBool::new(false));
        let admission = Admission::new(connected.clone());
        let hold = held.then(|| admission.hold()).flatten();
        let session: SessionSlot = Arc::new(Mutex::new(None));
        let serve = Serve {
            ctx: ctx.clone(),
            store,
            mode: mode.clone(),
            epoll,
            connected: connected.clone(),
            admission: admission.clone(),
            slot: session.clone(),
        };
        let name: String = format!("vu-{}", ctx.name()).chars().take(15).collect();
        // The kept connection is restored before start returns, so "serving" means serving.
        let kept = restore.session.and_then(|(json, files)| {
            match restore_connection(&ctx, &json, files) {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::error!(volume = %ctx.name(), "cannot continue the kept connection: {e}; the frontend has to reconnect");
                    serve.forget();
                    None
                }
            }
        });
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || serve.run(listener, kept))?;
        tracing::info!(volume = %ctx.name(), socket = %path.display(), "serving vhost-user-blk");
        let server = VolumeServer {
            path: path.to_path_buf(),
            ctx,
            mode,
            wake,
            connected,
            admission,
            session,
            thread: Some(thread),
        };
        Ok((server, hold))
    }

    /// Socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The shared volume context (to publish a new layout after a resize).
    pub fn context(&self) -> &Arc<VolumeContext> {
        &self.ctx
    }

    /// Whether a frontend is connected now.
    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    /// Keeps new frontends out (waiting) until the hold is dropped, unless one is connected
    /// now (`None`): what an operation that must not run under a VM holds while it runs.
    pub fn hold_admission(&self) -> Option<AdmissionHold> {
        self.admission.hold()
    }

    /// The device-reset hook: every running queue abandons its device queues and resubmits
    /// what its journal records as in flight.
    pub fn device_reset(&self) {
        let s = self.session.lock().ok().and_then(|s| s.clone());
        if let Some(s) = s {
            if let Ok(s) = s.lock() {
                s.device_reset();
            }
        }
    }

    /// Disconnects the current client, stops accepting and removes the socket.
    pub fn shutdown(mut self) {
        self.stop(SHUTDOWN);
    }

    /// Stops serving for a handoff: queues drain and stop, the final state goes to the store,
    /// and neither the connection nor the listening socket is closed for the frontend.
    pub fn detach(mut self) {
        self.stop(DETACH);
    }

    fn stop(&mut self, mode: u8) {
        let Some(t) = self.thread.take() else { return };
        self.mode.store(mode, Ordering::Release);
        let _ = self.wake.write(1);
        let _ = t.join();
        if mode == SHUTDOWN {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for VolumeServer {
    fn drop(&mut self) {
        self.stop(SHUTDOWN);
    }
}

impl Serve {
    /// Deposits the session's state. A deposit that fails leaves the store with the state
    /// of an earlier message (an old memory table, say), which a restarted process must never
    /// continue: the kept session is withdrawn instead (a crash then makes the frontend
    /// reconnect). [`Deposit::Failed`] when even that failed: the connection must end.
    fn save(&self, session: &Mutex<Session>, conn: &UnixStream) -> Deposit {
        let Some(store) = &self.store else {
            return Deposit::Kept;
        };
        let Ok(s) = session.lock() else {
            return Deposit::Failed;
        };
        let (st, mut fds) = s.snapshot();
        drop(s);
        fds[st.conn] = conn.as_raw_fd();
        let put = serde_json::to_string(&st)
            .map_err(|e| std::io::Error::other(format!("cannot encode session state: {e}")))
            .and_then(|json| store.put(&session_key(self.ctx.uuid()), json, &fds));
        let Err(e) = put else {
            return Deposit::Kept;
        };
        match store.remove(&session_key(self.ctx.uuid())) {
            Ok(()) => {
                tracing::error!(volume = %self.ctx.name(), "cannot deposit session state: {e}; withdrew the kept session (a crash now makes this frontend reconnect)");
                Deposit::Withdrawn
            }
            Err(e2) => {
                tracing::error!(volume = %self.ctx.name(), "cannot deposit session state: {e}, nor withdraw the stale one: {e2}; closing the connection");
                Deposit::Failed
            }
        }
    }

    fn forget(&self) {
        if let Some(store) = &self.store {
            if let Err(e) = store.remove(&session_key(self.ctx.uuid())) {
                tracing::error!(volume = %self.ctx.name(), "keeper: {e}");
            }
        }
    }

    fn running(&self) -> bool {
        self.mode.load(Ordering::Acquire) == RUN
    }

    /// Waits until a descriptor is ready; returns which (`Ready::listen`, `Ready::conn`), or
    /// None when woken to stop.
    fn wait(&self) -> Option<Ready> {
        let mut ev = [EpollEvent::default(); 4];
        loop {
            match self.epoll.wait(-1, &mut ev) {
                Ok(n) => {
                    if ev[..n].iter().any(|e| e.data() == TOKEN_WAKE) {
                        return None;
                    }
                    let r = Ready {
                        listen: ev[..n].iter().any(|e| e.data() == TOKEN_LISTEN),
                        conn: ev[..n].iter().any(|e| e.data() == TOKEN_CONN),
                        fault: ev[..n].iter().any(|e| e.data() == TOKEN_FAULT)
                            && self.ctx.fault().take(),
                    };
                    if r.listen || r.conn || r.fault {
                        return Some(r);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::error!(volume = %self.ctx.name(), "epoll: {e}");
                    return None;
                }
            }
        }
    }

    fn run(self, listener: UnixListener, kept: Option<Kept>) {
        // The listening socket is watched from the start, also while a kept connection is
        // served: a second frontend is refused at once instead of waiting in the backlog.
        if self
            .epoll
            .ctl(
                ControlOperation::Add,
                listener.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_LISTEN),
            )
            .is_err()
        {
            tracing::error!(volume = %self.ctx.name(), "cannot watch the listening socket");
            return;
        }
        if let Some((conn, session, handler)) = kept {
            self.serve_connection(&listener, conn, session, handler);
        }
        self.accept_loop(&listener);
        if self.mode.load(Ordering::Acquire) == SHUTDOWN {
            if let Some(store) = &self.store {
                if let Err(e) = store.remove(&format!("vol/{}/", self.ctx.uuid())) {
                    tracing::error!(volume = %self.ctx.name(), "keeper: {e}");
                }
            }
        }
    }

    /// A second frontend while one is connected: closed at once and logged (rate-limited).
    /// The connected VM keeps the volume and notices nothing; letting the newcomer in would
    /// hand it another tenant's disk.
    fn refuse(&self, listener: &UnixListener, log: &mut LogLimit) {
        if let Ok((s, _)) = listener.accept() {
            let peer = peer_pid(&s);
            if let Verdict::Log { suppressed } = log.check() {
                tracing::warn!(volume = %self.ctx.name(), peer_pid = peer, suppressed, "refused a second vhost-user connection: the volume is in use by another frontend");
            }
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    fn accept_loop(&self, listener: &UnixListener) {
        while self.running() {
            let Some(ready) = self.wait() else { break };
            if !ready.listen {
                continue; // a late fault signal of the session that already ended
            }
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(volume = %self.ctx.name(), error = %e, "accept failed");
                    continue;
                }
            };
            if let Err(e) = limit_message_time(&stream) {
                tracing::warn!(volume = %self.ctx.name(), error = %e, "cannot set the connection's time limits");
                continue;
            }
            tracing::info!(volume = %self.ctx.name(), "frontend connected");
            let session = Arc::new(Mutex::new(Session::new(self.ctx.clone())));
            let handler = match stream.try_clone() {
                Ok(s) => BackendReqHandler::from_stream(s, session.clone()),
                Err(e) => {
                    tracing::warn!(volume = %self.ctx.name(), error = %e, "cannot use connection");
                    continue;
                }
            };
            if self.save(&session, &stream) == Deposit::Failed {
                continue; // the connection is closed: a stale session must not be continued
            }
            self.serve_connection(listener, stream, session, handler);
        }
    }
}

/// What became of a session state deposit.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Deposit {
    /// The store holds the current state.
    Kept,
    /// The store holds no state for the session (a crash makes the frontend reconnect).
    Withdrawn,
    /// The store may hold stale state.
    Failed,
}

/// Which of the serving thread's descriptors are ready.
#[derive(Clone, Copy)]
struct Ready {
    listen: bool,
    conn: bool,
    /// A worker found the session's memory faulted.
    fault: bool,
}

impl Serve {
    /// Marks the frontend connected under the gate: it waits for an operation holding it
    /// (said in the log). False once the server stops meanwhile.
    fn enter_gate(&self) -> bool {
        if self.admission.held() {
            tracing::info!(volume = %self.ctx.name(), "a frontend connected while new ones are held (a replica not promoted yet, or a revert): it waits");
        }
        self.admission.enter(&|| self.running())
    }

    fn serve_connection(
        &self,
        listener: &UnixListener,
        stream: UnixStream,
        session: Arc<Mutex<Session>>,
        mut handler: BackendReqHandler<Mutex<Session>>,
    ) {
        let mut refused_log = ratelimit::guest_warning();
        if !self.enter_gate() {
            return;
        }
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(session.clone());
        let added = self.epoll.ctl(
            ControlOperation::Add,
            stream.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_CONN),
        );
        while added.is_ok() && self.running() {
            let Some(ready) = self.wait() else { break };
            if ready.fault {
                tracing::error!(volume = %self.ctx.name(), "closing the vhost-user connection: a worker cannot go on with the frontend's memory (see its error above); other volumes are unaffected");
                break;
            }
            // The connection first: if it just ended, a waiting newcomer is the next client.
            if ready.conn {
                match handler.handle_request() {
                    Ok(()) => {
                        if self.save(&session, &stream) == Deposit::Failed {
                            break;
                        }
                    }
                    Err(VhostError::Disconnected) | Err(VhostError::PartialMessage) => {
                        tracing::info!(volume = %self.ctx.name(), "frontend disconnected");
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(volume = %self.ctx.name(), error = %e, "closing vhost-user connection after a bad message");
                        break;
                    }
                }
            }
            if ready.listen {
                // A client that closed its connection and connected again at once is not a
                // second frontend: its old connection's end may just not have been read yet.
                if peer_closed(&stream) {
                    tracing::info!(volume = %self.ctx.name(), "frontend disconnected");
                    break;
                }
                self.refuse(listener, &mut refused_log);
            }
        }
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            stream.as_raw_fd(),
            EpollEvent::default(),
        );
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let detach = self.mode.load(Ordering::Acquire) == DETACH;
        if let Ok(mut s) = session.lock() {
            if detach {
                s.stop_all_for_handoff();
            } else {
                s.stop_all();
            }
        }
        if detach && self.save(&session, &stream) == Deposit::Kept {
            // Queues are drained and stopped: their resume points went to the keeper, and the
            // connection stays open there for the next process.
        } else {
            // The frontend is gone (or spoold stops): another host may serve the volume.
            if let Ok(mut s) = session.lock() {
                s.release_claims();
            }
            self.forget();
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        drop(handler);
        self.connected.store(false, Ordering::Release);
    }
}
