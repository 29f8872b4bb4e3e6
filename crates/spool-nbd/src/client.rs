//! The client side of the protocol: where an export is (an NBD URI), the fixed newstyle
//! handshake up to `NBD_OPT_GO`, and the framing of requests and simple replies. What a
//! device backend needs to send I/O to any NBD server (qemu-nbd, nbdkit, ours).
//!
//! Owns: URIs, connecting with a deadline, option haggling from the client's side, request
//! headers, simple reply headers. Must not know: queues, devices, what the I/O is for.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::proto::*;

/// The port NBD servers listen on unless told otherwise.
pub const DEFAULT_PORT: u16 = 10809;

pub use crate::proto::{
    CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES, TFLAG_CAN_MULTI_CONN,
    TFLAG_SEND_TRIM, TFLAG_SEND_WRITE_ZEROES,
};

/// The largest read or write this client sends in one request (32 MiB: what qemu-nbd takes;
/// smaller when the server says so at the handshake).
pub const MAX_IO: u32 = 32 << 20;

/// Where an export is: `nbd://HOST[:PORT]/EXPORT` or `nbd+unix:///EXPORT?socket=PATH`, the
/// URI form of the NBD project's doc/uri.md (as qemu and libnbd write it); `nbds://` and
/// `nbds+unix://` for the same over TLS (with the credentials [`crate::tls::set_client`]
/// gave).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub addr: Addr,
    pub export: String,
    /// TLS is required (`nbds`).
    pub tls: bool,
}

/// The server's socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Addr {
    Tcp(String),
    Unix(PathBuf),
}

impl Target {
    /// Reads an NBD URI; the error says what a URI looks like.
    pub fn parse(uri: &str) -> Result<Target, crate::Error> {
        let bad = || crate::Error::Uri(uri.to_string());
        let (tls, uri) = match uri.strip_prefix("nbds") {
            Some(rest) => (true, format!("nbd{rest}")),
            None => (false, uri.to_string()),
        };
        let uri = uri.as_str();
        if let Some(rest) = uri.strip_prefix("nbd+unix://") {
            let (path, query) = rest.split_once('?').ok_or_else(bad)?;
            // No host: the socket names the server.
            let export = path.strip_prefix('/').ok_or_else(bad)?;
            let socket = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("socket="))
                .filter(|s| !s.is_empty())
                .ok_or_else(bad)?;
            return Ok(Target {
                addr: Addr::Unix(decode(socket).ok_or_else(bad)?.into()),
                export: decode(export).ok_or_else(bad)?,
                tls,
            });
        }
        let rest = uri.strip_prefix("nbd://").ok_or_else(bad)?;
        let (host, export) = rest.split_once('/').unwrap_or((rest, ""));
        if host.is_empty() || export.contains('?') {
            return Err(bad());
        }
        // A port after the host, or after the brackets of an IPv6 address.
        let port = match host.strip_prefix('[') {
            Some(v6) => v6.split_once("]:").map(|(_, p)| p),
            None => host.rsplit_once(':').map(|(_, p)| p),
        };
        let addr = match port {
            Some(p) => {
                p.parse::<u16>().map_err(|_| bad())?;
                host.to_string()
            }
            None => format!("{host}:{DEFAULT_PORT}"),
        };
        Ok(Target {
            addr: Addr::Tcp(addr),
            export: decode(export).ok_or_else(bad)?,
            tls,
        })
    }
}

/// A URI component with its `%XX` escapes decoded (`None`: a bad escape or not UTF-8).
fn decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = if self.tls { "s" } else { "" };
        match &self.addr {
            Addr::Tcp(a) => write!(f, "nbd{s}://{a}/{}", self.export),
            Addr::Unix(p) => write!(f, "nbd{s}+unix:///{}?socket={}", self.export, p.display()),
        }
    }
}

/// A connected socket of either kind.
#[derive(Debug)]
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// A second handle on the same socket (one thread reads, another writes).
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    /// Ends the connection both ways: a thread blocked reading it returns.
    pub fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }

    /// Bounds every write on the socket (all its handles): a server that stops taking data
    /// fails the writer instead of holding it.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(t),
            Stream::Unix(s) => s.set_write_timeout(t),
        }
    }

    /// Bounds reads and writes on the socket.
    pub fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Stream::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A connection in the transmission phase, with what the server said of the export.
#[derive(Debug)]
pub struct Connection {
    pub stream: Stream,
    /// Bytes.
    pub size: u64,
    /// Transmission flags (`NBD_FLAG_*`).
    pub flags: u16,
    /// The largest read or write to send in one request.
    pub max_io: u32,
}

impl Connection {
    pub fn read_only(&self) -> bool {
        self.flags & TFLAG_READ_ONLY != 0
    }
    pub fn can_flush(&self) -> bool {
        self.flags & TFLAG_SEND_FLUSH != 0
    }
    pub fn can_trim(&self) -> bool {
        self.flags & TFLAG_SEND_TRIM != 0
    }
    pub fn can_write_zeroes(&self) -> bool {
        self.flags & TFLAG_SEND_WRITE_ZEROES != 0
    }
    /// A flush on one connection covers writes completed on every connection.
    pub fn multi_conn(&self) -> bool {
        self.flags & TFLAG_CAN_MULTI_CONN != 0
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Connects to `t` and negotiates its export (`NBD_OPT_GO`), all within `deadline`. The
/// connection then blocks without a timeout (a queue's reader waits for replies).
pub fn connect(t: &Target, deadline: Duration) -> io::Result<Connection> {
    let until = Instant::now() + deadline;
    let stream = match &t.addr {
        Addr::Tcp(a) => {
            let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{a}: no address"));
            let mut found = None;
            for sa in a.to_socket_addrs()? {
                match TcpStream::connect_timeout(&sa, deadline) {
                    Ok(s) => {
                        found = Some(s);
                        break;
                    }
                    Err(e) => last = e,
                }
            }
            let s = found.ok_or(last)?;
            s.set_nodelay(true)?;
            Stream::Tcp(s)
        }
        Addr::Unix(p) => Stream::Unix(UnixStream::connect(p)?),
    };
    let mut s = stream;
    let (size, flags, max_io) = match t.tls {
        false => handshake(&mut s, &t.export, until)?,
        true => {
            s = starttls(s, t, until)?;
            go(&mut s, &t.export, &mut |s: &Stream| {
                self::deadline(s, until)
            })?
        }
    };
    s.set_timeouts(None)?;
    Ok(Connection {
        stream: s,
        size,
        flags,
        max_io,
    })
}

/// Bounds the next read or write on `s` by what is left until `until`.
fn deadline(s: &Stream, until: Instant) -> io::Result<()> {
    let left = until.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the NBD handshake took too long",
        ));
    }
    s.set_timeouts(Some(left))
}

/// The client's half of the fixed newstyle handshake, all of it before `until`: size,
/// transmission flags and the largest request the server takes.
fn handshake(s: &mut Stream, export: &str, until: Instant) -> io::Result<(u64, u16, u32)> {
    negotiate(s, export, &mut |s: &Stream| deadline(s, until))
}

/// The handshake of [`connect`] over any byte stream, with no deadline: what the fuzz
/// target `nbd_client` feeds a hostile server's bytes to.
pub fn handshake_io<S: Read + Write>(s: &mut S, export: &str) -> io::Result<(u64, u16, u32)> {
    negotiate(s, export, &mut |_: &S| Ok(()))
}

/// The greeting, the client's flags and `NBD_OPT_STARTTLS` in the clear, the TLS handshake,
/// then the plaintext end of the encrypted connection.
fn starttls(mut s: Stream, t: &Target, until: Instant) -> io::Result<Stream> {
    let tls = crate::tls::client().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{t}: no TLS credentials for nbds:// (spoold: [tls] dir)"),
        )
    })?;
    let bound = &mut |s: &Stream| deadline(s, until);
    greet(&mut s, bound)?;
    s.write_all(&option(OPT_STARTTLS, &[]))?;
    let (kind, msg) = read_option_reply(&mut s, bound)?;
    if kind != REP_ACK {
        return Err(io::Error::other(format!(
            "{t}: the server refused TLS ({})",
            String::from_utf8_lossy(&msg)
        )));
    }
    let host = match &t.addr {
        Addr::Tcp(a) => a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h),
        Addr::Unix(_) => "localhost",
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let app = match &s {
        Stream::Tcp(tcp) => tls.connect(tcp.try_clone()?, host, until)?,
        Stream::Unix(u) => tls.connect(u.try_clone()?, host, until)?,
    };
    Ok(Stream::Unix(app))
}

/// An option for the server: its number and payload, framed.
fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut o = IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&opt.to_be_bytes());
    o.extend_from_slice(&(data.len() as u32).to_be_bytes());
    o.extend_from_slice(data);
    o
}

/// One option reply: its kind and payload (`bound` runs before each read).
fn read_option_reply<S: Read>(
    s: &mut S,
    bound: &mut dyn FnMut(&S) -> io::Result<()>,
) -> io::Result<(u32, Vec<u8>)> {
    bound(s)?;
    let mut r = [0u8; 20];
    s.read_exact(&mut r)?;
    if u64::from_be_bytes(r[0..8].try_into().expect("8 bytes")) != REPLY_MAGIC {
        return Err(invalid("bad option reply magic".into()));
    }
    let kind = u32::from_be_bytes(r[12..16].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(r[16..20].try_into().expect("4 bytes"));
    if len > MAX_OPTION {
        return Err(invalid("option reply too long".into()));
    }
    let mut p = vec![0u8; len as usize];
    bound(s)?;
    s.read_exact(&mut p)?;
    Ok((kind, p))
}

/// The handshake; `bound` runs before each read (the caller's deadline).
fn negotiate<S: Read + Write>(
    s: &mut S,
    export: &str,
    bound: &mut dyn FnMut(&S) -> io::Result<()>,
) -> io::Result<(u64, u16, u32)> {
    greet(s, bound)?;
    go(s, export, bound)
}

/// The server's greeting, and the client's flags: whether the server takes no zeroes.
fn greet<S: Read + Write>(
    s: &mut S,
    bound: &mut dyn FnMut(&S) -> io::Result<()>,
) -> io::Result<bool> {
    bound(s)?;
    let mut h = [0u8; 18];
    s.read_exact(&mut h)?;
    if u64::from_be_bytes(h[0..8].try_into().expect("8 bytes")) != NBDMAGIC
        || u64::from_be_bytes(h[8..16].try_into().expect("8 bytes")) != IHAVEOPT
    {
        return Err(invalid("not an NBD server (or not newstyle)".into()));
    }
    let server = u16::from_be_bytes([h[16], h[17]]);
    if server & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(invalid("the server does not speak fixed newstyle".into()));
    }
    let no_zeroes = server & FLAG_NO_ZEROES != 0;
    let client = FLAG_FIXED_NEWSTYLE as u32 | if no_zeroes { CLIENT_NO_ZEROES } else { 0 };
    s.write_all(&client.to_be_bytes())?;
    Ok(no_zeroes)
}

/// `NBD_OPT_GO` for `export`: its size, transmission flags and the largest request.
fn go<S: Read + Write>(
    s: &mut S,
    export: &str,
    bound: &mut dyn FnMut(&S) -> io::Result<()>,
) -> io::Result<(u64, u16, u32)> {
    // NBD_OPT_GO: the export's name, and a request for its block sizes.
    let mut data = (export.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    s.write_all(&option(OPT_GO, &data))?;
    let (mut size, mut flags, mut max_io) = (None, 0u16, MAX_IO);
    loop {
        let (kind, p) = read_option_reply(s, bound)?;
        match kind {
            REP_ACK => break,
            REP_INFO => match u16_at(&p, 0) {
                Some(INFO_EXPORT) if p.len() >= 12 => {
                    size = Some(u64::from_be_bytes(p[2..10].try_into().expect("8 bytes")));
                    flags = u16_at(&p, 10).expect("checked length");
                }
                Some(INFO_BLOCK_SIZE) if p.len() >= 14 => {
                    // The data path sends whole sectors: a smaller maximum is not one
                    // a block device's server gives.
                    let max = u32_at(&p, 10).expect("checked length");
                    max_io = max_io.min(max.max(512) / 512 * 512);
                }
                _ => {}
            },
            k if k & (1 << 31) != 0 => {
                let msg = String::from_utf8_lossy(&p);
                let what = match k {
                    REP_ERR_UNKNOWN => "no such export",
                    REP_ERR_UNSUP => "the server does not support NBD_OPT_GO",
                    _ => "refused",
                };
                return Err(io::Error::other(format!(
                    "export '{export}': {what} ({msg})"
                )));
            }
            _ => {}
        }
    }
    let size = size.ok_or_else(|| invalid("the server did not describe the export".into()))?;
    Ok((size, flags, max_io))
}

/// A request's header (28 bytes); a write's payload follows it.
pub fn request(kind: u16, cookie: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut h = [0u8; 28];
    h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    h[6..8].copy_from_slice(&kind.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..24].copy_from_slice(&offset.to_be_bytes());
    h[24..28].copy_from_slice(&len.to_be_bytes());
    h
}

/// A simple reply's header: the request's cookie and the error (0: success; NBD's errors
/// are Linux errnos). A successful read's data follows it.
pub fn read_reply(r: &mut impl Read) -> io::Result<(u64, u32)> {
    let mut h = [0u8; 16];
    r.read_exact(&mut h)?;
    if u32_at(&h, 0) != Some(SIMPLE_REPLY_MAGIC) {
        return Err(invalid(
            "not a simple reply (the server sent something this client did not ask for)".into(),
        ));
    }
    let err = u32_at(&h, 4).expect("in the header");
    Ok((
        u64::from_be_bytes(h[8..16].try_into().expect("8 bytes")),
        err,
    ))
}

/// The disconnect request (`NBD_CMD_DISC`): the server closes after what is in flight.
pub fn disconnect(w: &mut impl Write) -> io::Result<()> {
    w.write_all(&request(CMD_DISC, 0, 0, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_as_qemu_and_libnbd_write_them() {
        let t = Target::parse("nbd://10.0.0.2:10810/vol0").unwrap();
        assert_eq!(t.addr, Addr::Tcp("10.0.0.2:10810".into()));
        assert_eq!(t.export, "vol0");
        let t = Target::parse("nbd://backup.example/").unwrap();
        assert_eq!(t.addr, Addr::Tcp("backup.example:10809".into()));
        assert_eq!(t.export, "");
        let t = Target::parse("nbd://[::1]:10900/x").unwrap();
        assert_eq!(t.addr, Addr::Tcp("[::1]:10900".into()));
        let t = Target::parse("nbd://[::1]/x").unwrap();
        assert_eq!(t.addr, Addr::Tcp("[::1]:10809".into()));
        let t = Target::parse("nbd+unix:///snap?socket=/run/x.sock").unwrap();
        assert_eq!(t.addr, Addr::Unix("/run/x.sock".into()));
        assert_eq!(t.export, "snap");
        let u = Target::parse("nbd+unix:///db%40s1?socket=/run/a%20b.sock").unwrap();
        assert_eq!(u.addr, Addr::Unix("/run/a b.sock".into()));
        assert_eq!(u.export, "db@s1");
        assert_eq!(t.to_string(), "nbd+unix:///snap?socket=/run/x.sock");
        for bad in [
            "nbd:/x",
            "nbd://",
            "nbd://h:port/x",
            "nbd+unix:///x",
            "nbd+unix:///x?socket=",
            "nbd+unix://host/x?socket=/s",
            "nbd://h/x%4",
            "nbd://h/x%zz",
            "http://h/x",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    /// A connection whose reads are a server's bytes; what the client writes is dropped.
    struct FromServer(std::io::Cursor<Vec<u8>>);

    impl Read for FromServer {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.0.read(buf)
        }
    }

    impl Write for FromServer {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A server's option reply to `NBD_OPT_GO`.
    fn reply(kind: u32, payload: &[u8]) -> Vec<u8> {
        let mut r = REPLY_MAGIC.to_be_bytes().to_vec();
        r.extend_from_slice(&OPT_GO.to_be_bytes());
        r.extend_from_slice(&kind.to_be_bytes());
        r.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        r.extend_from_slice(payload);
        r
    }

    /// The handshake as a server's bytes drive it: the export's size and flags taken, a
    /// block size below a sector raised to one, and every short or refused answer an error.
    #[test]
    fn a_servers_handshake_is_taken_and_its_odd_answers_refused() {
        let mut server = NBDMAGIC.to_be_bytes().to_vec();
        server.extend_from_slice(&IHAVEOPT.to_be_bytes());
        server.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        let head = server.clone();
        let mut export = INFO_EXPORT.to_be_bytes().to_vec();
        export.extend_from_slice(&(8u64 << 20).to_be_bytes());
        export.extend_from_slice(&TFLAG_CAN_MULTI_CONN.to_be_bytes());
        server.extend(reply(REP_INFO, &export));
        let mut block = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [1u32, 1, 1000] {
            block.extend_from_slice(&v.to_be_bytes());
        }
        server.extend(reply(REP_INFO, &block));
        server.extend(reply(REP_ACK, &[]));
        let mut io = FromServer(std::io::Cursor::new(server.clone()));
        let (size, flags, max_io) = handshake_io(&mut io, "v").unwrap();
        assert_eq!((size, flags, max_io), (8 << 20, TFLAG_CAN_MULTI_CONN, 512));

        let go = |bytes: Vec<u8>| handshake_io(&mut FromServer(std::io::Cursor::new(bytes)), "v");
        for cut in [0, 10, head.len(), server.len() - 1] {
            assert!(go(server[..cut].to_vec()).is_err(), "cut at {cut}");
        }
        let mut no_export = head.clone();
        no_export.extend(reply(REP_ACK, &[]));
        let e = go(no_export).unwrap_err().to_string();
        assert!(e.contains("did not describe the export"), "{e}");
        let mut refused = head.clone();
        refused.extend(reply(REP_ERR_UNKNOWN, b"nope"));
        assert!(go(refused)
            .unwrap_err()
            .to_string()
            .contains("no such export"));
        let mut long = head;
        long.extend(&reply(REP_INFO, &[])[..16]);
        long.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(go(long).unwrap_err().to_string().contains("too long"));
    }
}
