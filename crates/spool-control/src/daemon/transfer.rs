//! The transfer listener (`[transfer] listen`, docs/transfer.md): a spoold about to send a
//! volume here says hello first, one JSON line each way after this side's challenge
//! (`hello.rs`). The hello proves the token the operator gave both hosts (`volume receive
//! NAME --token` here, `volume send NAME --to HOST:PORT --token` there) and carries the
//! volume as the sender has it; the answer is the NBD URI of the volume's receive export, on
//! a port of its own, after the volume was created here as the sender has it (size, queues,
//! copies, I/O limits) if it did not exist. Only the configured peers may connect, to the
//! listener and to the exports it starts.
//!
//! Owns: the listener, the transfers expected, what a hello is answered. Must not know: the
//! NBD protocol, the mirror, the hello's framing and proofs (`hello.rs`).

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use spool_frontend::ratelimit::Verdict;
use spool_nbd::Listen;
use spool_pool::metadata::VolumeKey;
use spool_pool::VolumeInfo;

use super::expected::Expected;
use super::hello::{answer_proof, check_token, hello_proved_by, untagged, HelloStream, HELLO_WAIT};
use super::Daemon;
use crate::api::{ReceiveInfo, TransferHello, TransferReply, TRANSFER_VERSION};
use crate::rpc::RpcError;

/// Where the keeper keeps the listening socket across worker restarts.
const KEPT_KEY: &str = "transfer-listen";
/// Hellos answered at once; more connections are closed.
const HELLOS_AT_ONCE: usize = 8;

impl Daemon {
    /// The TLS of the transfer listener and the exports it opens: `[tls]`'s server
    /// credentials when it has them (read again each time: renewed certificates are taken).
    pub(super) fn transfer_tls(&self) -> Result<Option<spool_nbd::tls::ServerTls>, RpcError> {
        match &self.cfg.tls {
            Some(dir) if dir.join("server-cert.pem").exists() => {
                spool_nbd::tls::ServerTls::load(dir)
                    .map(Some)
                    .map_err(|e| RpcError::InvalidParams(e.to_string()))
            }
            _ => Ok(None),
        }
    }

    /// `volume receive NAME --token T`: volume NAME (which need not exist) may be sent here
    /// by a peer that says hello with token T; replaces an earlier expectation of NAME.
    pub(super) fn expect_transfer(
        &self,
        name: &str,
        token: &str,
        max_size: Option<u64>,
        replica: bool,
    ) -> Result<ReceiveInfo, RpcError> {
        let Some(t) = &self.cfg.transfer else {
            return Err(RpcError::InvalidParams(
                "no transfer listener: set [transfer] listen and peers in the config (docs/transfer.md), or give --nbd".into(),
            ));
        };
        check_token(token)?;
        // Not in the `if let`: its guard would hold the pool's lock through the block.
        let found = self.pool().volume(name);
        if let Ok(v) = found {
            self.pool()
                .check_writable_outside(&v.uuid.to_string(), true)?;
        }
        let mut expected = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        expected.retain(|e| e.volume != name);
        let e = Expected {
            volume: name.into(),
            token: token.into(),
            max_size,
            replica,
            answered: None,
        };
        self.keep_expected(&e);
        expected.push(e);
        let at = self.transfer_at.get().copied().unwrap_or(t.listen);
        tracing::info!(volume = %name, listen = %at, "a transfer of the volume is expected");
        Ok(ReceiveInfo {
            volume: name.into(),
            nbd: at.to_string(),
            uri: String::new(),
            size: 0,
            written: 0,
            ended: None,
            expecting: true,
        })
    }

    /// Forgets the expected transfer of volume `name`; how it stood, if it was expected.
    pub(super) fn forget_expected(&self, name: &str) -> Option<ReceiveInfo> {
        let mut expected = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        let i = expected.iter().position(|e| e.volume == name)?;
        expected.remove(i);
        self.forget_kept_expected(name);
        Some(ReceiveInfo {
            volume: name.into(),
            nbd: self
                .cfg
                .transfer
                .as_ref()
                .map(|t| t.listen.to_string())
                .unwrap_or_default(),
            uri: String::new(),
            size: 0,
            written: 0,
            ended: Some("stopped".into()),
            expecting: false,
        })
    }

    /// Starts the transfer listener if the config asks for one, on the socket the previous
    /// worker kept if any (a sender's hello then waits in its backlog), kept for the next.
    pub fn serve_transfers(self: &Arc<Self>) -> std::io::Result<()> {
        let Some(t) = &self.cfg.transfer else {
            return Ok(());
        };
        let kept = self
            .keeping
            .as_ref()
            .and_then(|k| k.take(KEPT_KEY))
            .and_then(|(_, f)| f.into_iter().next())
            .map(|f| TcpListener::from(std::os::fd::OwnedFd::from(f)))
            .filter(|l| {
                // Port 0 (any free port) keeps the port the first worker got.
                l.local_addr().is_ok_and(|a| {
                    a == t.listen || (t.listen.port() == 0 && a.ip() == t.listen.ip())
                })
            });
        let listener = match kept {
            Some(l) => l,
            None => TcpListener::bind(t.listen)?,
        };
        listener.set_nonblocking(true)?;
        if let Some(s) = &self.store {
            if let Err(e) = s.put(KEPT_KEY, "{}".into(), &[listener.as_raw_fd()]) {
                tracing::error!("cannot keep the transfer listener with the keeper: {e}");
            }
        }
        let weak = Arc::downgrade(self);
        let at = listener.local_addr()?;
        let _ = self.transfer_at.set(at);
        std::thread::Builder::new()
            .name("transfer".into())
            .spawn(move || accept_loop(listener, weak))?;
        tracing::info!(listen = %at, "transfer listener: other spoolds may send volumes here");
        Ok(())
    }

    /// Answers one hello from `peer` that reached this host at `here`, in answer to the
    /// challenge `nonce`: the NBD URI of the volume's receive export (bound to that address,
    /// for that peer only) and the token the hello proved, or why not.
    fn answer(
        &self,
        h: &TransferHello,
        nonce: &str,
        here: IpAddr,
        peer: IpAddr,
    ) -> Result<(String, String), Refused> {
        if self.cfg.transfer.is_none() {
            return Err(Refused::NoListener);
        }
        check_fresh(h, nonce)?;
        let e = self.expected_for(h)?;
        let (token, answered, max_size, replica) = (e.token, e.answered, e.max_size, e.replica);
        check_role(replica, h)?;
        // Promoted here since that sender's epoch: it is fenced off (docs/replicas.md).
        let found = self.pool().volume(&h.volume);
        if let Some(v) = found.ok().filter(|v| v.epoch > h.epoch) {
            return Err(Refused::Fenced(v.name, v.epoch));
        }
        if let Some(uuid) = answered {
            self.replica_hello_again(h, uuid, peer)?;
            // Said hello again (a send resumed): the same export while it runs.
            let receiving = self.receiving.lock().unwrap_or_else(|e| e.into_inner());
            return super::receive::uri_of(&receiving, uuid)
                .map(|uri| (uri, token))
                .ok_or_else(|| Refused::Ended(h.volume.clone()));
        }
        // A replica's sender asking about a transfer never starts one.
        if h.ask {
            return Err(Refused::NotExpected(h.volume.clone()));
        }
        if let Some(max) = max_size.filter(|&m| h.size > m) {
            return Err(Refused::TooLarge(h.volume.clone(), h.size, max));
        }
        // Before the transfers' lock: creating the volume shows it, which looks at them.
        let v = self.volume_as_sent(h, peer)?;
        let v = match h.replica {
            true => self.become_replica(&v, &peer.to_string(), h.epoch)?,
            false => v,
        };
        let mut receiving = self.receiving.lock().unwrap_or_else(|e| e.into_inner());
        // Again under the transfers' lock: while the volume was made, a `--stop` may have
        // ended the expectation, or a second hello of the same send (the sender tries
        // again after its wait) may have been answered: one export per volume, never two.
        // And a replica promoted meanwhile (`volume promote` stops transfers under this
        // lock) is written by no export.
        if h.replica
            && (self.pool().volume(&v.uuid.to_string())).map_or(true, |v| v.replica.is_none())
        {
            return Err(Refused::Ended(h.volume.clone()));
        }
        {
            let expected = self.expected.lock().unwrap_or_else(|e| e.into_inner());
            let e = expected
                .iter()
                .find(|e| e.volume == h.volume && e.token == token);
            match e.map(|e| e.answered) {
                None => return Err(Refused::Ended(h.volume.clone())),
                Some(Some(uuid)) => {
                    return super::receive::uri_of(&receiving, uuid)
                        .map(|uri| (uri, token))
                        .ok_or_else(|| Refused::Ended(h.volume.clone()))
                }
                Some(None) => {}
            }
        }
        let at = Listen::Tcp(SocketAddr::new(here, 0).to_string());
        let only = Arc::from([peer]);
        // Bound to the hello, not to the address alone: the export answers only to the name
        // this answer tells the sender (anything else sharing its address gets nothing).
        let secret = Some(super::receive::new_secret());
        let info = self.start_receiving(&mut receiving, &v, at, None, Some(only), secret)?;
        let mut expected = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = expected.iter_mut().find(|e| e.volume == h.volume) {
            e.answered = Some(v.uuid);
            self.keep_expected(e);
        }
        Ok((info.uri, token))
    }

    /// A replica's sender said hello again for the transfer answered into `volume`: its
    /// copy became current (`current`: the replica is complete), or (neither `current` nor
    /// `ask`) its `volume replicate` starts a replication anew, which copies everything
    /// again (the replica is not complete until it says so again).
    fn replica_hello_again(
        &self,
        h: &TransferHello,
        volume: uuid::Uuid,
        peer: IpAddr,
    ) -> Result<(), Refused> {
        let id = volume.to_string();
        if h.current {
            let v = (self.pool().replica_complete(&id)).map_err(RpcError::from)?;
            let why = format!("volume {}: the replica here is complete", v.name);
            self.monitor.note(v.uuid, &peer.to_string(), "replica", why);
        } else if h.replica && !h.ask {
            let v = self.pool().volume(&id).map_err(RpcError::from)?;
            self.become_replica(&v, &peer.to_string(), h.epoch)?;
        }
        Ok(())
    }

    /// The expectation hello `h` proves its token for.
    fn expected_for(&self, h: &TransferHello) -> Result<Expected, Refused> {
        let expected = self.expected.lock().unwrap_or_else(|e| e.into_inner());
        let e = expected
            .iter()
            .find(|e| e.volume == h.volume && hello_proved_by(&e.token, h));
        // The same answer for an unknown volume and a wrong token: no oracle.
        let Some(e) = e else {
            return Err(Refused::NotExpected(h.volume.clone()));
        };
        Ok(e.clone())
    }

    /// The volume a hello names: created as the sender has it if it does not exist (an
    /// encrypted one under the sender's data key), else checked (as large, the same data
    /// key, receivable).
    fn volume_as_sent(&self, h: &TransferHello, peer: IpAddr) -> Result<VolumeInfo, RpcError> {
        if let Some(k) = &h.key {
            // Before anything else: only a holder of this host's key-encryption key sends
            // a data key that is taken.
            self.pool()
                .check_transfer_tag(&k.kek_id, &untagged(h), &k.tag)?;
        }
        let key = h.key.clone().map(|k| VolumeKey {
            cipher: k.cipher,
            kek_id: k.kek_id,
            wrapped: k.wrapped,
        });
        let found = self.pool().volume(&h.volume);
        match found {
            Ok(v) if v.size < h.size => Err(RpcError::InvalidParams(format!(
                "volume '{}' here has {} bytes, fewer than the sender's {}",
                v.name, v.size, h.size
            ))),
            // Promoted here since that sender's epoch: it is fenced off (docs/replicas.md).
            Ok(v) if v.epoch > h.epoch => Err(RpcError::InvalidParams(format!(
                "volume '{}' here was promoted (epoch {}): a sender at epoch {} is behind it and may not write it",
                v.name, v.epoch, h.epoch
            ))),
            Ok(v) => {
                let pool = self.pool();
                let id = v.uuid.to_string();
                pool.check_same_key(&id, key.as_ref())?;
                pool.check_writable_outside(&id, true).map_err(Into::into)
            }
            Err(_) => {
                let qos = h.qos.map(crate::wire::qos_from_wire);
                if let Some(q) = &qos {
                    q.validate()
                        .map_err(|e| RpcError::InvalidParams(e.to_string()))?;
                }
                let created = if h.thin {
                    if h.copies > 1 {
                        return Err(RpcError::InvalidParams(format!(
                            "volume '{}' is thin with {} copies on the sender: a thin volume here keeps one copy",
                            h.volume, h.copies
                        )));
                    }
                    let pool = &mut self.pool();
                    pool.create_received_thin_volume(&h.volume, h.size, h.num_queues, key)
                } else {
                    self.pool().create_received_volume(
                        &h.volume,
                        h.size,
                        h.num_queues,
                        h.copies,
                        key,
                    )
                };
                // A replica is one before it is served: no frontend comes in first.
                let created = created.and_then(|v| match h.replica {
                    true => (self.pool()).make_replica(&v.name, &peer.to_string(), h.epoch),
                    false => Ok(v),
                });
                if let Err(e) = self.serve(&created?) {
                    return Err(RpcError::NotServed(e.to_string()));
                }
                if let Some(q) = qos {
                    let (v, layout) = {
                        let mut pool = self.pool();
                        let v = pool.set_qos(&h.volume, Some(q))?;
                        let l = pool.layout(&v.uuid.to_string());
                        (v, l)
                    };
                    if let Ok(l) = layout {
                        self.publish_layout(&v, l);
                    }
                }
                tracing::info!(volume = ?h.volume, size = h.size, queues = h.num_queues, copies = h.copies, thin = h.thin, "volume created for a transfer");
                self.pool()
                    .check_writable_outside(&h.volume, true)
                    .map_err(Into::into)
            }
        }
    }
}

/// Hello `h` speaks this version and answers challenge `nonce` with a nonce of its own.
fn check_fresh(h: &TransferHello, nonce: &str) -> Result<(), Refused> {
    if h.version != TRANSFER_VERSION {
        return Err(Refused::Version(h.version));
    }
    if h.nonce != nonce {
        return Err(Refused::Replayed);
    }
    // Its own nonce, which the answer's proof covers: 32 bytes in hex.
    if h.sender_nonce.len() != 64 || spool_crypt::from_hex(&h.sender_nonce).is_none() {
        return Err(Refused::NoSenderNonce);
    }
    // A replica at it could never be promoted (the epoch above cannot be written).
    if h.epoch >= u64::MAX - 1 {
        return Err(Refused::Epoch(h.epoch));
    }
    Ok(())
}

/// A replica expected (`replica`) is asked for by the hello, and a one-time send is not.
fn check_role(replica: bool, h: &TransferHello) -> Result<(), Refused> {
    match (replica, h.replica) {
        (true, false) => Err(Refused::ReplicaExpected(h.volume.clone())),
        (false, true) => Err(Refused::ReplicaNotExpected(h.volume.clone())),
        _ => Ok(()),
    }
}

/// Accepts senders until the daemon stops: each hello on a thread of its own, at most
/// [`HELLOS_AT_ONCE`] at a time.
fn accept_loop(l: TcpListener, weak: std::sync::Weak<Daemon>) {
    let busy = Arc::new(AtomicUsize::new(0));
    // Anyone who reaches the port can knock: their refusals are logged a few a minute.
    let mut refused_log = spool_frontend::ratelimit::LogLimit::new(5, Duration::from_secs(60));
    loop {
        let Some(d) = weak.upgrade() else { return };
        if d.stopping.load(Ordering::Acquire) {
            return;
        }
        match l.accept() {
            Ok((s, from)) => {
                let ip = from.ip().to_canonical();
                let allowed = d
                    .cfg
                    .transfer
                    .as_ref()
                    .is_some_and(|t| t.peers.iter().any(|p| p.to_canonical() == ip));
                if !allowed {
                    if let Verdict::Log { suppressed } = refused_log.check() {
                        tracing::warn!(peer = %from, suppressed, "a transfer hello from a peer not in [transfer] peers was turned away");
                    }
                    continue;
                }
                if busy.fetch_add(1, Ordering::AcqRel) >= HELLOS_AT_ONCE {
                    busy.fetch_sub(1, Ordering::AcqRel);
                    if let Verdict::Log { suppressed } = refused_log.check() {
                        tracing::warn!(peer = %from, suppressed, "a transfer hello was turned away: {HELLOS_AT_ONCE} are being answered");
                    }
                    continue;
                }
                let (w, b) = (weak.clone(), busy.clone());
                let spawned = std::thread::Builder::new()
                    .name("transfer-hello".into())
                    .spawn(move || {
                        hello(s, ip, w);
                        b.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    busy.fetch_sub(1, Ordering::AcqRel);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                drop(d);
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a transfer hello failed");
                drop(d);
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Why a sender's hello is refused (the text is sent back to it).
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("no transfer listener")]
    NoListener,
    #[error("transfer version {0} is not spoken here (this spoold speaks {TRANSFER_VERSION})")]
    Version(u32),
    #[error("the hello carries no nonce of the sender's own (32 bytes in hex)")]
    NoSenderNonce,
    #[error("a bad hello ({0})")]
    Bad(serde_json::Error),
    #[error("the hello does not answer this listener's challenge (a replayed hello?)")]
    Replayed,
    #[error("volume '{0}' is {1} bytes on the sender, more than the {2} this host allows (`volume receive {0} --max-size`)")]
    TooLarge(String, u64, u64),
    #[error("no transfer of volume '{0}' with that token is expected here (`spoolctl volume receive {0} --token TOKEN` on this host first)")]
    NotExpected(String),
    #[error("the transfer of volume '{0}' here has ended; `spoolctl volume receive {0} --token TOKEN` on this host allows another")]
    Ended(String),
    #[error("volume '{0}' is expected here as a standing replica (`volume receive --replica`): send it with `spoolctl volume replicate {0}`")]
    ReplicaExpected(String),
    #[error("volume '{0}' is expected here for one transfer, not as a replica: `spoolctl volume receive {0} --token TOKEN --replica` on this host expects a replica")]
    ReplicaNotExpected(String),
    #[error("volume '{0}' here was promoted (epoch {1}): a sender at a lower epoch is behind it and may not write it")]
    Fenced(String, u64),
    #[error("epoch {0} leaves no room for a promotion")]
    Epoch(u64),
    /// Creating, checking or exporting the volume failed.
    #[error(transparent)]
    Volume(#[from] RpcError),
    #[error("no local address ({0})")]
    NoLocalAddress(std::io::Error),
}

/// One sender's hello and its answer.
fn hello(s: TcpStream, peer: IpAddr, weak: std::sync::Weak<Daemon>) {
    let _ = s.set_nonblocking(false);
    let _ = s.set_write_timeout(Some(HELLO_WAIT));
    let here = s.local_addr().map(|a| a.ip().to_canonical());
    // With server credentials ([tls] dir), a hello comes over TLS or not at all.
    let tls = match weak.upgrade().map(|d| d.transfer_tls()) {
        Some(Ok(t)) => t,
        Some(Err(e)) => {
            tracing::warn!(%peer, "a transfer hello cannot be answered over TLS: {e}");
            return;
        }
        None => return,
    };
    let s = match tls {
        Some(t) => match t.accept_tcp(s, Instant::now() + HELLO_WAIT) {
            Ok(plain) => HelloStream::Tls(plain),
            Err(e) => {
                tracing::warn!(%peer, error = %e, "a transfer hello's TLS handshake failed");
                return;
            }
        },
        None => HelloStream::Tcp(s),
    };
    let challenge = match super::hello::challenge() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(%peer, "no nonce for a transfer hello: {e}");
            return;
        }
    };
    if s.send(&challenge).is_err() {
        return;
    }
    let mut fenced = None;
    let (nbd, proof, error) = match s.line(HELLO_WAIT).map(|l| parse_hello(&l)) {
        Err(e) => (None, None, format!("no hello ({e})")),
        Ok(Err(why)) => (None, None, why.to_string()),
        Ok(Ok(h)) => {
            let Some(d) = weak.upgrade() else { return };
            let answer = match here {
                Ok(here) => d.answer(&h, &challenge.nonce, here, peer),
                Err(e) => Err(Refused::NoLocalAddress(e)),
            };
            match answer {
                Ok((uri, token)) => {
                    tracing::info!(volume = ?h.volume, %peer, %uri, "a sender said hello: receiving the volume");
                    let proof = answer_proof(&token, &h, &uri);
                    let _ = s.send(&TransferReply {
                        nbd: Some(uri),
                        proof: Some(proof),
                        error: None,
                        fenced: None,
                    });
                    return;
                }
                Err(e) => {
                    // The reason may quote the peer's words: escaped, as the name is.
                    let why = e.to_string();
                    tracing::warn!(volume = ?h.volume, %peer, why = ?why, "a transfer hello was refused");
                    if let Refused::Fenced(_, epoch) = e {
                        fenced = Some(epoch);
                    }
                    (None, None, why)
                }
            }
        }
    };
    let _ = s.send(&TransferReply {
        nbd,
        proof,
        error: Some(error),
        fenced,
    });
}

/// A hello line, or why it is not one: another version's is refused as such, not as bad JSON.
fn parse_hello(line: &str) -> Result<TransferHello, Refused> {
    let version = serde_json::from_str::<serde_json::Value>(line)
        .ok()
        .and_then(|v| v.get("version").and_then(|v| v.as_u64()));
    match version {
        Some(v) if v != u64::from(TRANSFER_VERSION) => {
            Err(Refused::Version(v.min(u64::from(u32::MAX)) as u32))
        }
        _ => serde_json::from_str(line).map_err(Refused::Bad),
    }
}
