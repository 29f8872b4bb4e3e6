//! One vhost-user listening socket per volume; connections are served one at a time, and the
//! socket keeps accepting after a client disconnects (a VM can reboot or reconnect).

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vhost::vhost_user::{BackendReqHandler, Error as VhostError};

use crate::session::Session;
use crate::VolumeContext;

/// A running vhost-user-blk server for one volume.
pub struct VolumeServer {
    path: PathBuf,
    ctx: Arc<VolumeContext>,
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Option<UnixStream>>>,
    session: Arc<Mutex<Option<Arc<Mutex<Session>>>>>,
    thread: Option<JoinHandle<()>>,
}

impl VolumeServer {
    /// Binds `path` (replacing a stale socket file) and starts serving.
    pub fn start(path: &Path, ctx: Arc<VolumeContext>) -> std::io::Result<VolumeServer> {
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
        let listener = UnixListener::bind(path)?;
        let stop = Arc::new(AtomicBool::new(false));
        let current = Arc::new(Mutex::new(None));
        let session = Arc::new(Mutex::new(None));
        let thread = {
            let (ctx, stop, current, session) =
                (ctx.clone(), stop.clone(), current.clone(), session.clone());
            let name: String = format!("vu-{}", ctx.name()).chars().take(15).collect();
            std::thread::Builder::new()
                .name(name)
                .spawn(move || accept_loop(listener, ctx, stop, current, session))?
        };
        tracing::info!(volume = %ctx.name(), socket = %path.display(), "serving vhost-user-blk");
        Ok(VolumeServer {
            path: path.to_path_buf(),
            ctx,
            stop,
            current,
            session,
            thread: Some(thread),
        })
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
        self.current.lock().map(|c| c.is_some()).unwrap_or(false)
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
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        let Some(t) = self.thread.take() else { return };
        self.stop.store(true, Ordering::Release);
        if let Ok(c) = self.current.lock() {
            if let Some(s) = c.as_ref() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        // Wake the blocking accept().
        let _ = UnixStream::connect(&self.path);
        let _ = t.join();
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for VolumeServer {
    fn drop(&mut self) {
        self.stop_inner();
    }
}

fn accept_loop(
    listener: UnixListener,
    ctx: Arc<VolumeContext>,
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Option<UnixStream>>>,
    current_session: Arc<Mutex<Option<Arc<Mutex<Session>>>>>,
) {
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(volume = %ctx.name(), error = %e, "accept failed");
                continue;
            }
        };
        if let Ok(clone) = stream.try_clone() {
            *current.lock().expect("connection slot") = Some(clone);
        }
        tracing::info!(volume = %ctx.name(), "frontend connected");
        let session = Arc::new(Mutex::new(Session::new(ctx.clone())));
        *current_session.lock().expect("session slot") = Some(session.clone());
        let mut handler = BackendReqHandler::from_stream(stream, session.clone());
        loop {
            match handler.handle_request() {
                Ok(()) => {}
                Err(VhostError::Disconnected) | Err(VhostError::PartialMessage) => {
                    tracing::info!(volume = %ctx.name(), "frontend disconnected");
                    break;
                }
                Err(e) => {
                    if !stop.load(Ordering::Acquire) {
                        tracing::warn!(volume = %ctx.name(), error = %e, "closing vhost-user connection after a bad message");
                    }
                    break;
                }
            }
        }
        drop(handler);
        *current_session.lock().expect("session slot") = None;
        if let Ok(mut s) = session.lock() {
            s.stop_all();
        }
        *current.lock().expect("connection slot") = None;
    }
}
