//! Listening for NBD clients and serving each on a thread of its own: the handshake (option
//! haggling), then requests until the client disconnects.
//!
//! Owns: the sockets, the per-connection state (structured replies on, the meta contexts
//! chosen). Must not know: what the export reads from.

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, TcpListener};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::proto::*;
use crate::tls::ServerTls;
use crate::{Error, Export};

/// Where a server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Unix(PathBuf),
    Tcp(String),
}

impl Listen {
    /// `unix:PATH` or `HOST:PORT`.
    pub fn parse(s: &str) -> Result<Listen, Error> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(Error::Address(s.into()));
            }
            return Ok(Listen::Unix(p.into()));
        }
        match s.rsplit_once(':') {
            Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => Ok(Listen::Tcp(s.into())),
            _ => Err(Error::Address(s.into())),
        }
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
            Listen::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// Clients served at once by one server; more are turned away (each may make the server
/// hold up to `transmit::IN_FLIGHT_BYTES` of data).
pub const MAX_CONNECTIONS: usize = 16;

/// How long a client may take over the greeting and the option phase, all of it (qemu-nbd's
/// `--handshake-limit` default): one that connects and then says nothing, or haggles on,
/// would otherwise hold one of the [`MAX_CONNECTIONS`] places for as long as it likes.
pub const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);

/// The connections open now, by number (shut down when the server stops).
type Conns = Arc<std::sync::Mutex<Vec<(u64, Box<dyn Stream>)>>>;

/// A running server: when dropped it stops accepting, closes its socket and shuts every open
/// connection down.
pub struct Server {
    pub listen: Listen,
    /// The listening socket (owned by the accepting thread), for a daemon that keeps it
    /// across its restarts.
    listener_fd: std::os::fd::RawFd,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    conns: Conns,
}

enum Listener {
    Unix(UnixListener),
    /// With the peers it accepts (`None`: any).
    Tcp(TcpListener, Option<Arc<[IpAddr]>>),
}

/// A stream either kind of socket gives.
trait Stream: Read + Write + Send {
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>>;
    /// Ends the connection both ways (a thread blocked reading it returns).
    fn shut(&self);
    /// How long a read may wait (`None`: for ever); the socket's, so every handle of it.
    fn read_limit(&self, t: Option<Duration>) -> io::Result<()>;
}

impl Stream for std::os::unix::net::UnixStream {
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn read_limit(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(t)
    }
    fn shut(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}

impl Stream for std::net::TcpStream {
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn read_limit(&self, t: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(t)
    }
    fn shut(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}

impl Listener {
    fn accept(&self) -> io::Result<Box<dyn Stream>> {
        match self {
            Listener::Unix(l) => {
                let (s, _) = l.accept()?;
                s.set_nonblocking(false)?;
                Ok(Box::new(s))
            }
            Listener::Tcp(l, peers) => {
                let (s, from) = l.accept()?;
                let ip = from.ip().to_canonical();
                if (peers.as_ref()).is_some_and(|p| !p.iter().any(|a| a.to_canonical() == ip)) {
                    // Logged by the accept loop, a few a minute (anyone can knock).
                    return Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!("an NBD client from {from}, a peer not allowed, was turned away"),
                    ));
                }
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                Ok(Box::new(s))
            }
        }
    }
}

impl Server {
    /// Listens on `listen` and serves `export` to every client until dropped. A Unix
    /// socket path is replaced if it exists.
    pub fn start(listen: Listen, export: Arc<dyn Export>) -> Result<Server, Error> {
        Self::start_for(listen, None, export, None)
    }

    /// [`Server::start`] on `kept` (see [`Server::start_on`]) when given, accepting TCP
    /// clients only from `peers` when given. A TCP port 0 is bound to a free port, which
    /// the server's `listen` then names.
    pub fn start_for(
        listen: Listen,
        kept: Option<std::os::fd::OwnedFd>,
        export: Arc<dyn Export>,
        peers: Option<Arc<[IpAddr]>>,
    ) -> Result<Server, Error> {
        Self::start_tls(listen, kept, export, peers, None)
    }

    /// [`Server::start_for`], with TLS required of every client when `tls` is given (see
    /// `starttls.rs`).
    pub fn start_tls(
        listen: Listen,
        kept: Option<std::os::fd::OwnedFd>,
        export: Arc<dyn Export>,
        peers: Option<Arc<[IpAddr]>>,
        tls: Option<ServerTls>,
    ) -> Result<Server, Error> {
        if let Some(fd) = kept {
            return Self::start_kept(listen, fd, export, peers, tls);
        }
        let named = listen.to_string();
        let err = |e| Error::Listen(named.clone(), e);
        let mut bound = None;
        let l = match &listen {
            Listen::Unix(p) => {
                // A socket left by an earlier export is replaced; one something listens on
                // (another server, spoold's own sockets) and anything else are not ours.
                use std::os::unix::fs::FileTypeExt;
                match std::fs::symlink_metadata(p) {
                    Ok(m) if m.file_type().is_socket() => {
                        if std::os::unix::net::UnixStream::connect(p).is_ok() {
                            let e = io::Error::new(
                                io::ErrorKind::AddrInUse,
                                "a socket something listens on",
                            );
                            return Err(err(e));
                        }
                        std::fs::remove_file(p).map_err(err)?
                    }
                    Ok(_) => {
                        let e = io::Error::new(
                            io::ErrorKind::AlreadyExists,
                            "exists and is not a socket",
                        );
                        return Err(err(e));
                    }
                    Err(_) => {}
                }
                let l = UnixListener::bind(p).map_err(err)?;
                l.set_nonblocking(true).map_err(err)?;
                Listener::Unix(l)
            }
            Listen::Tcp(a) => {
                let l = TcpListener::bind(a).map_err(err)?;
                l.set_nonblocking(true).map_err(err)?;
                if let (Some((host, "0")), Ok(at)) = (a.rsplit_once(':'), l.local_addr()) {
                    bound = Some(Listen::Tcp(format!("{host}:{}", at.port())));
                }
                Listener::Tcp(l, peers)
            }
        };
        Self::serve_on(bound.unwrap_or(listen), l, export, tls)
    }

    /// Serves `export` on `fd`, a socket listening on `listen` that an earlier process of
    /// the daemon kept (clients that connected meanwhile wait in its backlog): nothing is
    /// bound or replaced. Refused when `fd` is not a listening socket of that kind and
    /// address.
    pub fn start_on(
        listen: Listen,
        fd: std::os::fd::OwnedFd,
        export: Arc<dyn Export>,
    ) -> Result<Server, Error> {
        Self::start_kept(listen, fd, export, None, None)
    }

    fn start_kept(
        listen: Listen,
        fd: std::os::fd::OwnedFd,
        export: Arc<dyn Export>,
        peers: Option<Arc<[IpAddr]>>,
        tls: Option<ServerTls>,
    ) -> Result<Server, Error> {
        let err = |e| Error::Listen(listen.to_string(), e);
        let other = |what: String| err(io::Error::new(io::ErrorKind::InvalidInput, what));
        let l = match &listen {
            Listen::Unix(p) => {
                let l = UnixListener::from(fd);
                let at = l.local_addr().map_err(err)?;
                if at.as_pathname() != Some(p.as_path()) {
                    return Err(other(format!("the kept socket listens on {at:?}")));
                }
                l.set_nonblocking(true).map_err(err)?;
                Listener::Unix(l)
            }
            Listen::Tcp(a) => {
                let l = TcpListener::from(fd);
                let at = l.local_addr().map_err(err)?;
                if !a.ends_with(&format!(":{}", at.port())) {
                    return Err(other(format!("the kept socket listens on {at}")));
                }
                l.set_nonblocking(true).map_err(err)?;
                Listener::Tcp(l, peers)
            }
        };
        Self::serve_on(listen, l, export, tls)
    }

    /// The listening socket, to keep across a restart ([`Server::start_on`]); valid while
    /// the server runs.
    pub fn listener_fd(&self) -> std::os::fd::RawFd {
        self.listener_fd
    }

    fn serve_on(
        listen: Listen,
        l: Listener,
        export: Arc<dyn Export>,
        tls: Option<ServerTls>,
    ) -> Result<Server, Error> {
        use std::os::fd::AsRawFd;
        let err = |e| Error::Listen(listen.to_string(), e);
        let listener_fd = match &l {
            Listener::Unix(u) => u.as_raw_fd(),
            Listener::Tcp(t, _) => t.as_raw_fd(),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Conns::default();
        let (s, c) = (stop.clone(), conns.clone());
        let thread = std::thread::Builder::new()
            .name("spool-nbd".into())
            .spawn(move || accept_loop(l, export, s, c, tls))
            .map_err(err)?;
        Ok(Server {
            listen,
            listener_fd,
            stop,
            thread: Some(thread),
            conns,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for (_, c) in self.conns.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            c.shut();
        }
        if let Listen::Unix(p) = &self.listen {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn accept_loop(
    l: Listener,
    export: Arc<dyn Export>,
    stop: Arc<AtomicBool>,
    conns: Conns,
    tls: Option<ServerTls>,
) {
    let mut next = 0u64;
    let mut refused = RefusedLog::default();
    while !stop.load(Ordering::SeqCst) {
        match l.accept() {
            Ok(s) => {
                let mut open = conns.lock().unwrap_or_else(|p| p.into_inner());
                if open.len() >= MAX_CONNECTIONS {
                    tracing::warn!(
                        export = export.name(),
                        "an NBD client was turned away: {MAX_CONNECTIONS} are connected already"
                    );
                    continue;
                }
                let Ok(kept) = s.try_clone_box() else {
                    continue;
                };
                next += 1;
                let id = next;
                open.push((id, kept));
                drop(open);
                let (e, st, c, t) = (export.clone(), stop.clone(), conns.clone(), tls.clone());
                let spawned = std::thread::Builder::new()
                    .name("spool-nbd-conn".into())
                    .spawn(move || {
                        if let Err(err) = serve(s, &*e, &st, t.as_ref()) {
                            tracing::debug!(export = e.name(), error = %err, "NBD connection ended");
                        }
                        c.lock().unwrap_or_else(|p| p.into_inner()).retain(|x| x.0 != id);
                    });
                if spawned.is_err() {
                    conns
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .retain(|x| x.0 != id);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                if refused.allow() {
                    tracing::warn!(suppressed = refused.take_suppressed(), "{e}");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting an NBD client failed");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// A connection's reading side with a deadline on the whole handshake, not on each read
/// (a client trickling a byte now and then would otherwise keep its place for ever): before
/// each read the socket may wait only what is left. `until: None`: no deadline.
struct Bounded {
    s: Box<dyn Stream>,
    until: Option<std::time::Instant>,
}

impl Read for Bounded {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(until) = self.until {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            self.s.read_limit(Some(left))?;
        }
        self.s.read(buf)
    }
}

fn serve(
    s: Box<dyn Stream>,
    e: &dyn Export,
    stop: &AtomicBool,
    tls: Option<&ServerTls>,
) -> io::Result<()> {
    s.read_limit(Some(HANDSHAKE_LIMIT))?;
    let until = std::time::Instant::now() + HANDSHAKE_LIMIT;
    // With TLS: the greeting and the options before it in the clear, then the rest of the
    // handshake and the requests over the encrypted connection's plaintext end.
    let (s, greeted) = match tls {
        None => (s, None),
        Some(t) => match greet_tls(s, t, until)? {
            Some((app, no_zeroes)) => (Box::new(app) as Box<dyn Stream>, Some(no_zeroes)),
            None => return Ok(()),
        },
    };
    let mut r = BufReader::new(Bounded {
        s: s.try_clone_box()?,
        until: Some(until),
    });
    let limit = s.try_clone_box()?;
    let mut w = BufWriter::new(s);
    let sess = match greeted {
        None => handshake(&mut r, &mut w, e),
        Some(no_zeroes) => crate::handshake::run(&mut r, &mut w, e, no_zeroes),
    };
    let sess = match sess {
        Ok(Some(sess)) => sess,
        Ok(None) => return Ok(()),
        Err(err)
            if matches!(
                err.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            tracing::warn!(export = e.name(), "an NBD client did not finish its handshake within {HANDSHAKE_LIMIT:?}: disconnected");
            return Err(err);
        }
        Err(err) => return Err(err),
    };
    // What an operator (and a test timing a restart after it) looks for: a client past its
    // handshake, reading. A few a backup: not a flood.
    tracing::info!(export = e.name(), "an NBD client connected");
    // Requests may be far apart (a mirror's writes): no limit from here on.
    r.get_mut().until = None;
    limit.read_limit(None)?;
    crate::transmit::run(&mut r, &mut w, e, &sess, stop, crate::transmit::IN_FLIGHT)
}

/// Serves one client on any byte stream: the greeting, the option phase, then requests
/// until the client leaves or `stop` is set, one at a time (the fuzz target's entry point;
/// a connection runs the same with its requests served [`crate::transmit::IN_FLIGHT`] at a
/// time).
pub fn serve_io(
    r: &mut impl Read,
    w: &mut (impl Write + Send),
    e: &dyn Export,
    stop: &AtomicBool,
) -> io::Result<()> {
    serve_threads(r, w, e, stop, 1)
}

fn serve_threads(
    r: &mut impl Read,
    w: &mut (impl Write + Send),
    e: &dyn Export,
    stop: &AtomicBool,
    threads: usize,
) -> io::Result<()> {
    let Some(sess) = handshake(r, w, e)? else {
        return Ok(());
    };
    crate::transmit::run(r, w, e, &sess, stop, threads)
}

/// The greeting, the client's flags and the options before TLS on `s`: the encrypted
/// connection's plaintext end and whether the client takes no zeroes, or `None` when it left.
fn greet_tls(
    mut s: Box<dyn Stream>,
    tls: &ServerTls,
    until: std::time::Instant,
) -> io::Result<Option<(std::os::unix::net::UnixStream, bool)>> {
    s.write_all(&NBDMAGIC.to_be_bytes())?;
    s.write_all(&IHAVEOPT.to_be_bytes())?;
    s.write_all(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes())?;
    let mut r = Bounded {
        s: s.try_clone_box()?,
        until: Some(until),
    };
    let mut flags = [0u8; 4];
    r.read_exact(&mut flags)?;
    let no_zeroes = u32::from_be_bytes(flags) & CLIENT_NO_ZEROES != 0;
    let app = crate::starttls::until_tls(s, &mut r, tls, until)?;
    Ok(app.map(|a| (a, no_zeroes)))
}

impl crate::tls::Pumpable for Box<dyn Stream> {
    fn clone_handle(&self) -> io::Result<Self> {
        self.try_clone_box()
    }
    fn timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        self.read_limit(t)
    }
    fn shut(&self) {
        Stream::shut(&**self)
    }
}

/// The greeting and the option phase: the session to serve, or `None` when the client
/// left during it.
fn handshake(
    r: &mut impl Read,
    w: &mut impl Write,
    e: &dyn Export,
) -> io::Result<Option<crate::handshake::Session>> {
    w.write_all(&NBDMAGIC.to_be_bytes())?;
    w.write_all(&IHAVEOPT.to_be_bytes())?;
    w.write_all(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes())?;
    w.flush()?;
    let mut flags = [0u8; 4];
    r.read_exact(&mut flags)?;
    let no_zeroes = u32::from_be_bytes(flags) & CLIENT_NO_ZEROES != 0;
    crate::handshake::run(r, w, e, no_zeroes)
}

/// At most a few lines a minute for refused clients (anyone who reaches the port can make
/// one); the next line logged says how many were left out.
#[derive(Default)]
struct RefusedLog {
    window: Option<std::time::Instant>,
    logged: u32,
    suppressed: u64,
}

impl RefusedLog {
    const BURST: u32 = 5;
    const PERIOD: std::time::Duration = std::time::Duration::from_secs(60);

    fn allow(&mut self) -> bool {
        let now = std::time::Instant::now();
        if self
            .window
            .is_none_or(|w| now.duration_since(w) >= Self::PERIOD)
        {
            self.window = Some(now);
            self.logged = 0;
        }
        if self.logged < Self::BURST {
            self.logged += 1;
            true
        } else {
            self.suppressed += 1;
            false
        }
    }

    fn take_suppressed(&mut self) -> u64 {
        std::mem::take(&mut self.suppressed)
    }
}
