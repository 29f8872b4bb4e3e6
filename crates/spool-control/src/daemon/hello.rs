//! The transfer hello on the wire (docs/transfer.md): the listener's challenge (a fresh
//! nonce), the sender's hello with its proof of the token over the nonce and every field, and
//! the answer with the listener's proof over the nonce and the URI. The token never crosses
//! the network, so a sniffed hello opens nothing, replays nowhere (the next challenge has
//! another nonce), and cannot be altered (a data key stripped, a size raised); a sender sends
//! only where the token's other holder answered.
//!
//! Owns: the lines, their deadlines and proofs, and the sender's side of the exchange
//! ([`Daemon::say_hello`]). Must not know: which transfers are expected or what an answer
//! starts (the listener, `transfer.rs`), the NBD protocol.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use spool_crypt::proof;
use spool_pool::VolumeInfo;

use super::Daemon;
use crate::api::{self, TransferChallenge, TransferHello, TransferReply};
use crate::api::{ANSWER_PROOF, HELLO_PROOF, TRANSFER_VERSION};
use crate::rpc::RpcError;

/// The longest hello line either way.
const HELLO_MAX: u64 = 16 << 10;
/// How long either side waits for the other's line during the hello (not the answer).
pub(super) const HELLO_WAIT: Duration = Duration::from_secs(5);
/// How long a sender waits for the answer (the volume may be created first).
const ANSWER_WAIT: Duration = Duration::from_secs(60);
/// A token's length bounds (printable ASCII, no spaces).
const TOKEN_LEN: std::ops::RangeInclusive<usize> = 16..=256;

pub(super) fn check_token(t: &str) -> Result<(), RpcError> {
    if TOKEN_LEN.contains(&t.len()) && t.bytes().all(|b| b.is_ascii_graphic()) {
        return Ok(());
    }
    Err(RpcError::InvalidParams(format!(
        "a transfer token is {} to {} printable characters without spaces (for example `openssl rand -hex 16`)",
        TOKEN_LEN.start(),
        TOKEN_LEN.end()
    )))
}

/// What a hello's proof and its data key's tag cover: the hello as JSON, both empty.
pub(super) fn untagged(h: &TransferHello) -> Vec<u8> {
    let mut h = h.clone();
    h.proof.clear();
    if let Some(k) = &mut h.key {
        k.tag.clear();
    }
    serde_json::to_vec(&h).unwrap_or_default()
}

/// The proof a holder of `token` gives for hello `h` (which carries the challenge's nonce).
pub fn hello_proof(token: &str, h: &TransferHello) -> String {
    spool_crypt::to_hex(&proof::prove(
        token.as_bytes(),
        HELLO_PROOF,
        &[&untagged(h)],
    ))
}

/// Whether hello `h`'s proof was made with `token` (in constant time: no oracle of where a
/// wrong token differs, or of its length).
pub(super) fn hello_proved_by(token: &str, h: &TransferHello) -> bool {
    let tag = spool_crypt::from_hex(&h.proof).unwrap_or_default();
    proof::check(token.as_bytes(), HELLO_PROOF, &[&untagged(h)], &tag)
}

/// The proof a holder of `token` gives for answering hello `h` (to its challenge and its own
/// nonce) with `uri`.
pub fn answer_proof(token: &str, h: &TransferHello, uri: &str) -> String {
    let parts: [&[u8]; 3] = [
        h.nonce.as_bytes(),
        h.sender_nonce.as_bytes(),
        uri.as_bytes(),
    ];
    spool_crypt::to_hex(&proof::prove(token.as_bytes(), ANSWER_PROOF, &parts))
}

/// A fresh challenge, or why none can be made.
pub(super) fn challenge() -> Result<TransferChallenge, spool_crypt::KeyError> {
    Ok(TransferChallenge {
        version: TRANSFER_VERSION,
        nonce: spool_crypt::to_hex(&proof::nonce()?),
    })
}

/// A hello's connection: TCP, or the plaintext end of TLS over it.
pub(super) enum HelloStream {
    Tcp(TcpStream),
    Tls(std::os::unix::net::UnixStream),
}

impl HelloStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        match self {
            HelloStream::Tcp(s) => s.set_read_timeout(t),
            HelloStream::Tls(s) => s.set_read_timeout(t),
        }
    }
    fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            HelloStream::Tcp(s) => (&*s).read(buf),
            HelloStream::Tls(s) => (&*s).read(buf),
        }
    }
    fn write_all(&self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            HelloStream::Tcp(s) => (&*s).write_all(buf),
            HelloStream::Tls(s) => (&*s).write_all(buf),
        }
    }

    /// Sends `msg` as one JSON line.
    pub(super) fn send(&self, msg: &impl serde::Serialize) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
        line.push(b'\n');
        self.write_all(&line)
    }

    /// Reads one line of at most [`HELLO_MAX`] bytes, all of it within `wait`. One byte at a
    /// time: what follows the line (an answer's NBD session is another connection, but a
    /// peer may send early) stays unread.
    pub(super) fn line(&self, wait: Duration) -> std::io::Result<String> {
        let deadline = Instant::now() + wait;
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while !line.ends_with(b"\n") {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || line.len() as u64 >= HELLO_MAX {
                return Err(std::io::Error::other("no complete line in time"));
            }
            self.set_read_timeout(Some(left))?;
            match self.read(&mut byte)? {
                0 => return Err(std::io::Error::other("no complete line")),
                _ => line.push(byte[0]),
            }
        }
        String::from_utf8(line).map_err(|_| std::io::Error::other("not UTF-8"))
    }
}

/// What a sender's hello is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HelloKind {
    /// A send (`volume send --token`): a transfer starts (or resumes).
    Send,
    /// A standing replica (`volume replicate`): a replication starts, anew.
    Replicate,
    /// A replica's sender asks whether its copy there is still a replica (starts nothing).
    Ask,
    /// A replica's sender says its copy there became current (starts nothing).
    Current,
}

impl Daemon {
    /// The sender's side: says hello to the transfer listener at `to` (`HOST:PORT`) for
    /// volume `v` with `token`, as `kind` says; returns the NBD URI to send to.
    pub(super) fn say_hello(
        &self,
        to: &str,
        token: &str,
        v: &VolumeInfo,
        kind: HelloKind,
    ) -> Result<String, RpcError> {
        check_token(token)?;
        let fail = |why: String| RpcError::InvalidParams(format!("transfer listener {to}: {why}"));
        let s = connect(to, &fail)?;
        let line = s
            .line(HELLO_WAIT)
            .map_err(|e| fail(format!("no challenge ({e})")))?;
        let nonce = match serde_json::from_str::<TransferChallenge>(&line) {
            Ok(c) if c.version == TRANSFER_VERSION => c.nonce,
            Ok(c) => return Err(fail(format!(
                "it speaks transfer version {}, this spoold {TRANSFER_VERSION}: run spoolds of one version on both hosts (docs/transfer.md)",
                c.version
            ))),
            // A listener of version 1 waits for a hello, then answers that it got none.
            Err(_) => return Err(fail(format!(
                "no challenge (it said {:?}): the listener may be a spoold older than transfer version {TRANSFER_VERSION}",
                line.trim_end().chars().take(200).collect::<String>()
            ))),
        };
        let hello = self.hello_for(v, token, nonce, kind)?;
        s.send(&hello).map_err(|e| fail(e.to_string()))?;
        let answer = s
            .line(ANSWER_WAIT)
            .map_err(|e| fail(format!("no answer ({e})")))?;
        let reply: TransferReply =
            serde_json::from_str(&answer).map_err(|e| fail(format!("a bad answer ({e})")))?;
        if let Some(epoch) = reply.fenced {
            return Err(RpcError::Fenced {
                volume: v.name.clone(),
                epoch,
            });
        }
        match (reply.nbd, reply.proof, reply.error) {
            (Some(uri), Some(p), None)
                if (uri.starts_with("nbd://") || uri.starts_with("nbds://"))
                    && uri.len() <= 1024 =>
            {
                // Constant time is not needed here: the answer's proof is the listener's.
                if p != answer_proof(token, &hello, &uri) {
                    return Err(fail(
                        "its answer does not prove it holds the token: not sending there (an on-path party, or a listener given another token)".into(),
                    ));
                }
                Ok(uri)
            }
            (_, _, Some(e)) => Err(fail(format!("refused: {e}"))),
            _ => Err(fail("a bad answer".into())),
        }
    }

    /// The hello for volume `v` answering challenge `nonce`, with its proofs.
    fn hello_for(
        &self,
        v: &VolumeInfo,
        token: &str,
        nonce: String,
        kind: HelloKind,
    ) -> Result<TransferHello, RpcError> {
        let remote = v.legs.iter().any(|l| l.remote.is_some()) as u8;
        let mine = proof::nonce()
            .map_err(|e| RpcError::InvalidParams(format!("no nonce for the hello: {e}")))?;
        let mut hello = TransferHello {
            version: TRANSFER_VERSION,
            nonce,
            sender_nonce: spool_crypt::to_hex(&mine),
            proof: String::new(),
            volume: v.name.clone(),
            size: v.size,
            num_queues: v.num_queues,
            copies: v.copies.saturating_sub(remote).max(1),
            qos: v.qos.map(crate::wire::ToWire::wire),
            key: self.pool().wrapped_key(&v.name)?.map(|k| api::TransferKey {
                cipher: k.cipher,
                kek_id: k.kek_id,
                wrapped: k.wrapped,
                tag: String::new(),
            }),
            thin: v.thin.is_some(),
            replica: kind != HelloKind::Send,
            epoch: v.epoch,
            current: kind == HelloKind::Current,
            ask: matches!(kind, HelloKind::Ask | HelloKind::Current),
        };
        if hello.key.is_some() {
            let tag = self.pool().transfer_tag(&untagged(&hello))?;
            if let Some(k) = &mut hello.key {
                k.tag = tag;
            }
        }
        hello.proof = hello_proof(token, &hello);
        Ok(hello)
    }
}

/// Connects to the listener at `to`: over TLS with client credentials (`[tls] dir`), the
/// listener's certificate checked against this host's CA and the address given.
fn connect(to: &str, fail: &dyn Fn(String) -> RpcError) -> Result<HelloStream, RpcError> {
    let addr = to
        .to_socket_addrs()
        .map_err(|e| fail(format!("not a HOST:PORT address ({e})")))?
        .next()
        .ok_or_else(|| fail("no address".into()))?;
    let s = TcpStream::connect_timeout(&addr, HELLO_WAIT).map_err(|e| fail(e.to_string()))?;
    s.set_write_timeout(Some(HELLO_WAIT))
        .map_err(|e| fail(e.to_string()))?;
    Ok(match spool_nbd::tls::client() {
        Some(tls) => {
            let host = to.rsplit_once(':').map_or(to, |(h, _)| h);
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let until = Instant::now() + HELLO_WAIT;
            let plain = (tls.connect_tcp(s, host, until)).map_err(|e| fail(format!("TLS: {e}")))?;
            HelloStream::Tls(plain)
        }
        None => HelloStream::Tcp(s),
    })
}
