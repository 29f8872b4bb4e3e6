//! TLS for NBD (the protocol's `NBD_OPT_STARTTLS`), with rustls (pure Rust, no C library to
//! keep in step; its `ring` provider): x509 credentials laid out as QEMU's `tls-creds-x509`
//! directory (`ca-cert.pem`, `server-cert.pem`, `server-key.pem`, `client-cert.pem`,
//! `client-key.pem`), so the same directory serves `qemu-img`, `nbdcopy` and `nbdinfo`;
//! the handshake on a connected socket; and the pump that carries the connection's plaintext
//! over a socket pair, so the rest of the crate (and the device layer's queue, whose reader
//! and writer are two threads) reads and writes it as it does any Unix stream.
//!
//! A server with a `ca-cert.pem` requires a client certificate it signed; without one it
//! authenticates itself only. A client always checks the server's certificate against its
//! `ca-cert.pem` and the host it connected to, and presents `client-cert.pem` when there is one.
//!
//! Owns: loading credentials, the TLS handshake, the pump. Must not know: NBD options, exports.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// A server's TLS: what it proves and whom it lets in.
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<rustls::ServerConfig>,
    /// Whether clients must present a certificate the CA signed.
    pub client_certs: bool,
    pub dir: PathBuf,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ServerTls({})", self.dir.display())
    }
}

/// A client's TLS: whom it trusts and what it presents.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<rustls::ClientConfig>,
    pub dir: PathBuf,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ClientTls({})", self.dir.display())
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn bad(dir: &Path, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("TLS credentials in {}: {what}", dir.display()),
    )
}

fn certs(dir: &Path, name: &str) -> io::Result<Vec<CertificateDer<'static>>> {
    let path = dir.join(name);
    let found: Result<Vec<_>, _> = CertificateDer::pem_file_iter(&path)
        .map_err(|e| bad(dir, format!("{name}: {e}")))?
        .collect();
    let found = found.map_err(|e| bad(dir, format!("{name}: {e}")))?;
    if found.is_empty() {
        return Err(bad(dir, format!("{name} holds no certificate")));
    }
    Ok(found)
}

fn key(dir: &Path, name: &str) -> io::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(dir.join(name)).map_err(|e| bad(dir, format!("{name}: {e}")))
}

fn roots(dir: &Path) -> io::Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(dir, "ca-cert.pem")? {
        roots
            .add(c)
            .map_err(|e| bad(dir, format!("ca-cert.pem: {e}")))?;
    }
    Ok(roots)
}

impl ServerTls {
    /// The server side of the credentials in `dir`: `server-cert.pem` (the chain) and
    /// `server-key.pem`; with `ca-cert.pem`, client certificates it signed are required.
    pub fn load(dir: &Path) -> io::Result<ServerTls> {
        let chain = certs(dir, "server-cert.pem")?;
        let key = key(dir, "server-key.pem")?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(dir, e))?;
        let client_certs = dir.join("ca-cert.pem").exists();
        let builder = match client_certs {
            true => {
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots(dir)?),
                    provider(),
                )
                .build()
                .map_err(|e| bad(dir, e))?;
                builder.with_client_cert_verifier(verifier)
            }
            false => builder.with_no_client_auth(),
        };
        let config = builder
            .with_single_cert(chain, key)
            .map_err(|e| bad(dir, format!("server-cert.pem and server-key.pem: {e}")))?;
        Ok(ServerTls {
            config: Arc::new(config),
            client_certs,
            dir: dir.into(),
        })
    }

    /// The TLS handshake as the server on a TCP connection (another protocol than NBD: the
    /// transfer hello), all of it before `until`; then the plaintext end.
    pub fn accept_tcp(&self, s: std::net::TcpStream, until: Instant) -> io::Result<UnixStream> {
        self.accept(s, until)
    }

    /// The TLS handshake as the server on `s`, all of it before `until`; then the plaintext
    /// end of the connection.
    pub(crate) fn accept<S: Pumpable>(&self, s: S, until: Instant) -> io::Result<UnixStream> {
        let conn = rustls::ServerConnection::new(self.config.clone()).map_err(io::Error::other)?;
        establish(rustls::Connection::Server(conn), s, until)
    }
}

impl ClientTls {
    /// The client side of the credentials in `dir`: `ca-cert.pem` (whom to trust), and
    /// `client-cert.pem` with `client-key.pem` when present.
    pub fn load(dir: &Path) -> io::Result<ClientTls> {
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(dir, e))?
            .with_root_certificates(roots(dir)?);
        let config = match dir.join("client-cert.pem").exists() {
            true => builder
                .with_client_auth_cert(certs(dir, "client-cert.pem")?, key(dir, "client-key.pem")?)
                .map_err(|e| bad(dir, format!("client-cert.pem and client-key.pem: {e}")))?,
            false => builder.with_no_client_auth(),
        };
        Ok(ClientTls {
            config: Arc::new(config),
            dir: dir.into(),
        })
    }

    /// The TLS handshake as the client of `host` on a TCP connection (the transfer hello)
    /// before `until`; then the plaintext end.
    pub fn connect_tcp(
        &self,
        s: std::net::TcpStream,
        host: &str,
        until: Instant,
    ) -> io::Result<UnixStream> {
        self.connect(s, host, until)
    }

    /// The TLS handshake as the client of `host` on `s` before `until`; then the plaintext
    /// end of the connection.
    pub(crate) fn connect<S: Pumpable>(
        &self,
        s: S,
        host: &str,
        until: Instant,
    ) -> io::Result<UnixStream> {
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{host}: {e}")))?;
        let conn =
            rustls::ClientConnection::new(self.config.clone(), name).map_err(io::Error::other)?;
        establish(rustls::Connection::Client(conn), s, until)
    }
}

/// The credentials `nbds://` connections of this process use (spoold's `[tls] dir`).
static CLIENT: OnceLock<ClientTls> = OnceLock::new();

/// Sets the credentials this process's `nbds://` connections use (once; later calls keep
/// the first).
pub fn set_client(tls: ClientTls) {
    let _ = CLIENT.set(tls);
}

/// The credentials set by [`set_client`], if any.
pub fn client() -> Option<&'static ClientTls> {
    CLIENT.get()
}

/// A socket the pump can carry: cloned for its reader and writer, timed out while the
/// handshake runs, shut down when either side ends.
pub(crate) trait Pumpable: Read + Write + Send + 'static {
    fn clone_handle(&self) -> io::Result<Self>
    where
        Self: Sized;
    fn timeouts(&self, t: Option<std::time::Duration>) -> io::Result<()>;
    fn shut(&self);
}

/// Both socket kinds hand out handles, time out and shut down alike.
macro_rules! pumpable {
    ($($t:ty),*) => {$(
        impl Pumpable for $t {
            fn clone_handle(&self) -> io::Result<Self> {
                self.try_clone()
            }
            fn timeouts(&self, t: Option<std::time::Duration>) -> io::Result<()> {
                self.set_read_timeout(t)?;
                self.set_write_timeout(t)
            }
            fn shut(&self) {
                let _ = self.shutdown(std::net::Shutdown::Both);
            }
        }
    )*};
}

pumpable!(std::net::TcpStream, UnixStream);

/// Runs the handshake on `s` before `until`, then starts the pump; returns the plaintext end.
fn establish<S: Pumpable>(
    mut conn: rustls::Connection,
    mut s: S,
    until: Instant,
) -> io::Result<UnixStream> {
    while conn.is_handshaking() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the TLS handshake took too long",
            ));
        }
        s.timeouts(Some(left))?;
        conn.complete_io(&mut s)?;
    }
    while conn.wants_write() {
        conn.write_tls(&mut s)?;
    }
    s.timeouts(None)?;
    // The pump reads at most its buffer's worth at a time and sends it at once.
    conn.set_buffer_limit(None);
    let (app, mut end) = UnixStream::pair()?;
    // What came with the handshake's last records (a client sends its first options right
    // after its Finished) is decrypted already: it goes first, or it would wait for the
    // next record to arrive.
    let mut early = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = conn.reader().read(&mut buf) {
        early.extend_from_slice(&buf[..n]);
    }
    end.write_all(&early)?;
    let conn = Arc::new(Mutex::new(conn));
    let tls_w = Arc::new(Mutex::new(s.clone_handle()?));
    let (c, w, end_w) = (conn.clone(), tls_w.clone(), end.try_clone()?);
    std::thread::Builder::new()
        .name("spool-tls-in".into())
        .spawn(move || inbound(&c, s, &w, end_w))?;
    std::thread::Builder::new()
        .name("spool-tls-out".into())
        .spawn(move || outbound(&conn, &tls_w, end))?;
    Ok(app)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes what the connection has to send (records, alerts) to the socket, in order: the
/// socket's lock is taken first and held while they go out.
fn flush_tls<S: Write>(conn: &Mutex<rustls::Connection>, tls_w: &Mutex<S>) -> io::Result<()> {
    let mut w = lock(tls_w);
    let mut out = Vec::new();
    {
        let mut c = lock(conn);
        while c.wants_write() {
            c.write_tls(&mut out)?;
        }
    }
    w.write_all(&out)
}

/// Ciphertext from the socket, decrypted into the plaintext end, until either side ends.
fn inbound<S: Pumpable>(
    conn: &Mutex<rustls::Connection>,
    mut tls_r: S,
    tls_w: &Mutex<S>,
    mut end: UnixStream,
) {
    let mut buf = vec![0u8; 64 << 10];
    let mut plain = vec![0u8; 64 << 10];
    'outer: loop {
        let n = match tls_r.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut out = Vec::new();
        let (mut closed, mut reply) = (false, false);
        {
            let mut c = lock(conn);
            let mut rd = &buf[..n];
            while !rd.is_empty() {
                if c.read_tls(&mut rd).is_err() || c.process_new_packets().is_err() {
                    // A bad record: the alert goes out, the connection ends.
                    drop(c);
                    let _ = flush_tls(conn, tls_w);
                    break 'outer;
                }
                loop {
                    match c.reader().read(&mut plain) {
                        Ok(0) => {
                            closed = true;
                            break;
                        }
                        Ok(k) => out.extend_from_slice(&plain[..k]),
                        Err(_) => break,
                    }
                }
            }
            reply |= c.wants_write();
        }
        if reply && flush_tls(conn, tls_w).is_err() {
            break;
        }
        if end.write_all(&out).is_err() || closed {
            break;
        }
    }
    // Whoever reads the plaintext end sees it end; the outbound pump stops with it.
    let _ = end.shutdown(std::net::Shutdown::Both);
    tls_r.shut();
}

/// Plaintext written to the plaintext end, encrypted onto the socket, until either ends;
/// then a `close_notify`.
fn outbound<S: Pumpable>(conn: &Mutex<rustls::Connection>, tls_w: &Mutex<S>, mut end: UnixStream) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match end.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut w = lock(tls_w);
        let mut out = Vec::with_capacity(n + 64);
        {
            let mut c = lock(conn);
            if c.writer().write_all(&buf[..n]).is_err() {
                break;
            }
            while c.wants_write() {
                if c.write_tls(&mut out).is_err() {
                    break;
                }
            }
        }
        if w.write_all(&out).is_err() {
            break;
        }
    }
    lock(conn).send_close_notify();
    let _ = flush_tls(conn, tls_w);
    lock(tls_w).shut();
    let _ = end.shutdown(std::net::Shutdown::Both);
}
