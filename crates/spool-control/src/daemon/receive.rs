//! `volume_receive`, `volume_receive_stop` (docs/transfer.md): a volume no frontend serves,
//! served as a writable NBD export for another host (or `qemu-img convert`, `nbdcopy`) to
//! write its data into, through the volume's layout devices.
//!
//! The transfer ends, for good, when a frontend starts one of the volume's queues (the
//! guest writes it from then on: the switchover of a move; the frontend's
//! `VolumeContext::on_serving` hook), when the operator stops it, or when the volume is
//! deleted; from then on every request of a sender fails. A request in progress finishes
//! before the end returns, so nothing it writes lands after the guest's first request.
//!
//! A worker restart does not end it: its listening socket is kept with the keeper, and the
//! next worker serves it again there (a sender reconnects to the same address; what was
//! written is on the devices).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use spool_frontend::VolumeContext;
use spool_nbd::{Listen, Server};
use uuid::Uuid;

use super::Daemon;
use crate::api::{self, ReceiveInfo, ReceiveParams, ReceiveStopParams};
use crate::rpc::{MethodTable, RpcError};

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::VolumeReceive>(Daemon::volume_receive)
        .register::<api::VolumeReceiveStop>(Daemon::volume_receive_stop);
}

/// Where the keeper keeps a transfer's listening socket (value: `{"nbd": ADDRESS}`).
const KEPT_PREFIX: &str = "receive/";

fn kept_key(volume: Uuid) -> String {
    format!("{KEPT_PREFIX}{volume}")
}

/// Drops the kept socket of the transfer into `volume`: the next worker does not serve it.
fn forget_kept(store: &Option<Arc<dyn spool_frontend::StateStore>>, volume: Uuid) {
    if let Some(s) = store {
        if let Err(e) = s.remove(&kept_key(volume)) {
            tracing::error!(%volume, "keeper: {e}");
        }
    }
}

/// The largest range one zeroing call covers.
const ZERO_PIECE: u64 = 64 << 20;

/// Extent size the export reports `base:allocation` in (everything is allocated).
const EXTENT: u64 = 1 << 20;

/// A volume as a writable NBD export.
struct ReceiveExport {
    name: String,
    size: u64,
    ctx: Arc<VolumeContext>,
    /// Set first when the transfer ends: requests not yet begun fail at once, and a long
    /// write-zeroes stops between its pieces.
    ending: AtomicBool,
    /// Why the transfer ended (None: it goes on); taken for writing to end it, so a
    /// request in progress finishes first.
    ended: RwLock<Option<String>>,
    written: AtomicU64,
    /// Held shared by writes of whole [`PAGE`]s and alone by a write (or zeroes) that
    /// covers one in part: a device may read such a page, change it and write it back (an
    /// NVMe namespace's blocks, a mirror's legs), which would undo a write to another part
    /// of it from another connection made meanwhile.
    partial: RwLock<()>,
    /// The name a sender must ask for (a transfer the listener opened: told only to the
    /// peer that said hello with the token), else `None` (the volume's name, or none).
    secret: Option<String>,
}

/// A new export name no one can guess: 256 bits from the operating system's generator
/// (two v4 UUIDs' random bits), in hex.
pub(super) fn new_secret() -> String {
    format!("{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple())
}

/// The unit a device writes whole (every block size spoold serves divides it).
const PAGE: u64 = 4096;

impl ReceiveExport {
    fn new(v: &spool_pool::VolumeInfo, ctx: Arc<VolumeContext>, secret: Option<String>) -> Self {
        ReceiveExport {
            name: v.name.clone(),
            size: v.size,
            ctx,
            ending: AtomicBool::new(false),
            ended: RwLock::new(None),
            written: AtomicU64::new(0),
            partial: RwLock::new(()),
            secret,
        }
    }

    /// Runs `f` on the volume's current layout unless the transfer ended.
    fn with_layout<R>(
        &self,
        f: impl FnOnce(&spool_pool::VolumeLayout) -> std::io::Result<R>,
    ) -> std::io::Result<R> {
        let ended = self.ended.read().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &*ended {
            return Err(std::io::Error::other(format!("the transfer ended: {why}")));
        }
        if self.ending.load(Ordering::Acquire) {
            return Err(std::io::Error::other("the transfer is ending"));
        }
        f(&self.ctx.layout().load())
    }

    /// Runs `f` on the current layout for bytes `[offset, offset + len)`: beside other
    /// whole-page writes, or alone when it covers a page in part.
    fn write_with_layout(
        &self,
        offset: u64,
        len: u64,
        f: impl FnOnce(&spool_pool::VolumeLayout) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        if offset.is_multiple_of(PAGE) && len.is_multiple_of(PAGE) {
            let _shared = self.partial.read().unwrap_or_else(|p| p.into_inner());
            self.with_layout(f)
        } else {
            let _alone = self.partial.write().unwrap_or_else(|p| p.into_inner());
            self.with_layout(f)
        }?;
        self.written.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// Ends the transfer (the first reason stays), once the request in progress, if any,
    /// is done: at most one write (8 MiB, NBD's largest payload here), or one piece of
    /// [`ZERO_PIECE`] bytes of zeroes.
    fn end(&self, why: &str) {
        self.ending.store(true, Ordering::SeqCst);
        let mut ended = self.ended.write().unwrap_or_else(|p| p.into_inner());
        if ended.is_none() {
            tracing::info!(volume = %self.name, written = self.written.load(Ordering::Relaxed), "volume transfer ended: {why}");
            *ended = Some(why.to_string());
        }
    }
}

impl spool_nbd::Export for ReceiveExport {
    fn name(&self) -> &str {
        &self.name
    }
    fn secret(&self) -> Option<&str> {
        self.secret.as_deref()
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.with_layout(|l| l.read_at(buf, offset))
    }
    fn extent(&self) -> u64 {
        EXTENT
    }
    fn allocated(&self, _: u64) -> bool {
        true
    }
    fn base(&self) -> Option<&str> {
        None
    }
    fn changed(&self, _: u64) -> bool {
        false
    }
    fn writable(&self) -> bool {
        true
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.write_with_layout(offset, buf.len() as u64, |l| l.write_at(buf, offset))
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        // The pages covered in part alone (a few bytes each: a device that writes them as
        // data needs no more memory than that), the whole pages between in pieces, each
        // under the transfer's lock: an end waits for one piece at most.
        let end = offset.saturating_add(len);
        let (first, last) = (offset.div_ceil(PAGE) * PAGE, end / PAGE * PAGE);
        if first >= last {
            return self.write_with_layout(offset, len, |l| l.zero(offset, len));
        }
        if offset < first {
            self.write_with_layout(offset, first - offset, |l| l.zero(offset, first - offset))?;
        }
        let mut at = first;
        while at < last {
            let n = (last - at).min(ZERO_PIECE);
            self.write_with_layout(at, n, |l| l.zero(at, n))?;
            at += n;
        }
        if last < end {
            self.write_with_layout(last, end - last, |l| l.zero(last, end - last))?;
        }
        Ok(())
    }
}

/// One volume being received.
pub(super) struct Receiving {
    volume: Uuid,
    nbd: String,
    uri: String,
    export: Arc<ReceiveExport>,
    server: Server,
}

impl Receiving {
    fn info(&self) -> ReceiveInfo {
        ReceiveInfo {
            volume: self.export.name.clone(),
            nbd: self.nbd.clone(),
            uri: self.uri.clone(),
            size: self.export.size,
            written: self.export.written.load(Ordering::Relaxed),
            ended: self
                .export
                .ended
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            expecting: false,
        }
    }

    fn stop(self, why: &str) -> ReceiveInfo {
        self.export.end(why);
        let info = self.info();
        drop(self.server);
        tracing::info!(volume = %info.volume, uri = %info.uri, "volume no longer received");
        info
    }
}

impl Daemon {
    fn volume_receive(&self, p: ReceiveParams) -> Result<ReceiveInfo, RpcError> {
        let nbd = match (&p.nbd, &p.token) {
            (None, Some(token)) => {
                let max = super::volumes::opt_size(p.max_size, "max_size")?;
                return self.expect_transfer(&p.id, token, max, p.replica);
            }
            _ if p.replica => {
                return Err(RpcError::InvalidParams(
                    "a replica comes through the transfer listener: give token, not nbd".into(),
                ))
            }
            (Some(_), _) if p.max_size.is_some() => {
                return Err(RpcError::InvalidParams(
                    "max_size bounds what a sender's hello creates: give it with token, not nbd".into(),
                ))
            }
            (Some(nbd), None) => nbd,
            _ => {
                return Err(RpcError::InvalidParams(
                    "give one of nbd (where to listen) and token (a sender's hello on the transfer listener)".into(),
                ))
            }
        };
        let listen = super::exports::parse_listen(nbd, &self.cfg)?;
        // Lock order: the transfers, then the pool, the servers; the exports' lock is
        // never held with it (`snapshot_export` looks at the transfers without its own).
        let exported = self.export_listens(&listen.to_string());
        let mut receiving = self.receiving.lock().unwrap_or_else(|e| e.into_inner());
        let v = self.pool().check_writable_outside(&p.id, false)?;
        refuse_twice(&receiving, &v)?;
        if exported || receiving.iter().any(|r| r.nbd == listen.to_string()) {
            return Err(RpcError::InvalidParams(format!(
                "{listen} serves another export already"
            )));
        }
        self.start_receiving(&mut receiving, &v, listen, None, None, None)
    }

    /// Serves the transfer into `v` on `listen` (on `kept`, the socket a previous worker
    /// left, if given; only to `peers` when given: the transfer listener's; under the name
    /// `secret` only, when given), kept with the keeper for the next worker.
    pub(super) fn start_receiving(
        &self,
        receiving: &mut Vec<Receiving>,
        v: &spool_pool::VolumeInfo,
        listen: Listen,
        kept: Option<std::os::fd::OwnedFd>,
        peers: Option<Arc<[std::net::IpAddr]>>,
        secret: Option<String>,
    ) -> Result<ReceiveInfo, RpcError> {
        refuse_twice(receiving, v)?;
        let ctx = self
            .servers()
            .get(&v.uuid)
            .map(|s| s.context().clone())
            .ok_or_else(|| {
                RpcError::InvalidParams(format!("volume '{}' is not served (offline?)", v.name))
            })?;
        let export = Arc::new(ReceiveExport::new(v, ctx.clone(), secret));
        // Registered only while no frontend's queue runs (the context decides that under the
        // lock its queue starts take): a queue that starts later ends the transfer first.
        // The hook holds the export weakly: a transfer stopped meanwhile is gone.
        let (ending, store, volume) = (Arc::downgrade(&export), self.store.clone(), v.uuid);
        let hook = Box::new(move || {
            if let Some(e) = ending.upgrade() {
                e.end("a frontend started the volume");
                forget_kept(&store, volume);
            }
        });
        if ctx.on_serving(hook).is_err() {
            return Err(RpcError::InvalidParams(format!(
                "volume '{}' is in use: a frontend runs its queues, and a transfer would write behind its back; stop the VM first",
                v.name
            )));
        }
        let allowed: Option<Vec<String>> =
            (peers.as_ref()).map(|p| p.iter().map(|ip| ip.to_string()).collect());
        // The transfer listener's exports go over TLS when this host has server credentials.
        let tls = peers
            .as_ref()
            .map(|_| self.transfer_tls())
            .transpose()?
            .flatten();
        let secure = tls.is_some();
        let started = Server::start_tls(listen, kept, export.clone(), peers, tls);
        let server = started.map_err(|e| {
            export.end("it could not listen");
            RpcError::InvalidParams(e.to_string())
        })?;
        let listen = server.listen.clone();
        let r = Receiving {
            volume: v.uuid,
            nbd: listen.to_string(),
            uri: receive_uri(&listen, export.secret.as_deref().unwrap_or(&v.name), secure),
            export,
            server,
        };
        if let Some(s) = &self.store {
            let value = serde_json::json!({
                "nbd": r.nbd,
                "peers": allowed.is_some(),
                "allowed": allowed,
                "secret": r.export.secret,
            })
            .to_string();
            if let Err(e) = s.put(&kept_key(v.uuid), value, &[r.server.listener_fd()]) {
                tracing::error!(volume = %v.name, "cannot keep the transfer's socket with the keeper ({e}): a worker restart ends it");
            }
            // A queue that started since the hook was registered ended the transfer, and its
            // hook may have forgotten the key before it was kept: forget it again, or the
            // next worker would serve an ended transfer. (The hook sets `ending` before it
            // forgets; this looks after keeping.)
            if r.export.ending.load(Ordering::SeqCst) {
                forget_kept(&self.store, v.uuid);
            }
        }
        tracing::info!(volume = %v.name, uri = %r.uri, "receiving the volume over NBD");
        let info = r.info();
        receiving.push(r);
        Ok(info)
    }

    /// Serves again the transfers the previous worker kept, on their kept sockets (at
    /// start, once the volumes are served): a sender reconnecting finds each where it was.
    pub(super) fn restore_receiving(&self) {
        let Some(k) = &self.keeping else { return };
        for key in k.keys(KEPT_PREFIX) {
            let Some((value, fds)) = k.take(&key) else {
                continue;
            };
            let r = (|| -> Result<ReceiveInfo, RpcError> {
                let bad = || RpcError::InvalidParams(format!("kept transfer {key}: {value}"));
                let uuid: Uuid = key[KEPT_PREFIX.len()..].parse().map_err(|_| bad())?;
                let kept: serde_json::Value = serde_json::from_str(&value).map_err(|_| bad())?;
                let nbd = kept["nbd"].as_str().ok_or_else(bad)?.to_string();
                // Started by the transfer listener: only the peer that said hello (the
                // peers, from a worker that did not record it), as configured now.
                let peers = match kept["peers"].as_bool() {
                    Some(true) => Some(self.kept_peers(&kept["allowed"])?),
                    _ => None,
                };
                // (None from a worker before secret names: its sender was told no name.)
                let secret = kept["secret"].as_str().map(String::from);
                let fd = fds.into_iter().next().ok_or_else(bad)?;
                let listen = super::exports::parse_listen(&nbd, &self.cfg)?;
                // The transfer listener's carry another spoold's ciphertext, if encrypted.
                let ciphertext = peers.is_some();
                let v = self
                    .pool()
                    .check_writable_outside(&uuid.to_string(), ciphertext)?;
                let mut receiving = self.receiving.lock().unwrap_or_else(|e| e.into_inner());
                let fd = Some(fd.into());
                self.start_receiving(&mut receiving, &v, listen, fd, peers, secret)
            })();
            match r {
                Ok(info) => {
                    tracing::info!(volume = %info.volume, uri = %info.uri, "receiving the volume again after the worker's restart")
                }
                Err(e) => {
                    tracing::warn!(key = %key, "a kept transfer is not served again: {e}");
                    if let Ok(uuid) = key[KEPT_PREFIX.len()..].parse() {
                        forget_kept(&self.store, uuid);
                    }
                }
            }
        }
    }

    /// The peers a kept transfer may serve: those it recorded (`allowed`, if any) that the
    /// config's `[transfer] peers` still names.
    fn kept_peers(&self, allowed: &serde_json::Value) -> Result<Arc<[std::net::IpAddr]>, RpcError> {
        let configured = (self.cfg.transfer.as_ref())
            .map(|t| t.peers.clone())
            .ok_or_else(|| {
                RpcError::InvalidParams("the config has no [transfer] peers any more".into())
            })?;
        let Some(list) = allowed.as_array() else {
            return Ok(configured);
        };
        let recorded: Vec<std::net::IpAddr> = list
            .iter()
            .filter_map(|v| v.as_str()?.parse().ok())
            .filter(|ip: &std::net::IpAddr| {
                configured
                    .iter()
                    .any(|c| c.to_canonical() == ip.to_canonical())
            })
            .collect();
        if recorded.is_empty() {
            return Err(RpcError::InvalidParams(
                "the peer it was started for is not in [transfer] peers any more".into(),
            ));
        }
        Ok(recorded.into())
    }

    fn volume_receive_stop(&self, p: ReceiveStopParams) -> Result<ReceiveInfo, RpcError> {
        let was_expected = self.forget_expected(&p.id);
        let found = self.pool().volume(&p.id);
        let v = match (found, &was_expected) {
            (Err(_), Some(info)) => return Ok(info.clone()),
            (found, _) => found?,
        };
        let stopped = self.stop_receiving(v.uuid, "stopped");
        stopped.or(was_expected).ok_or_else(|| {
            RpcError::InvalidParams(format!("volume '{}' is not being received", v.name))
        })
    }

    /// Ends and forgets the transfer into volume `volume`, if any.
    pub(super) fn stop_receiving(&self, volume: Uuid, why: &str) -> Option<ReceiveInfo> {
        let mut receiving = self.receiving.lock().unwrap_or_else(|e| e.into_inner());
        stop_in(&mut receiving, &self.store, volume, why)
    }

    /// The transfer into volume `volume`, as `volume show` reports it.
    pub(super) fn receive_info(&self, volume: Uuid) -> Option<ReceiveInfo> {
        let receiving = self.receiving.lock().unwrap_or_else(|e| e.into_inner());
        receiving
            .iter()
            .find(|r| r.volume == volume)
            .map(Receiving::info)
    }

    /// Whether a transfer listens on `nbd` (as `Listen` prints it).
    pub(super) fn receiving_listens(&self, nbd: &str) -> bool {
        let receiving = self.receiving.lock().unwrap_or_else(|e| e.into_inner());
        receiving.iter().any(|r| r.nbd == nbd)
    }
}

/// Ends and forgets the transfer into volume `volume` in `receiving` (the transfers, locked
/// by the caller), if any.
pub(super) fn stop_in(
    receiving: &mut Vec<Receiving>,
    store: &Option<Arc<dyn spool_frontend::StateStore>>,
    volume: Uuid,
    why: &str,
) -> Option<ReceiveInfo> {
    let i = receiving.iter().position(|r| r.volume == volume)?;
    forget_kept(store, volume);
    Some(receiving.remove(i).stop(why))
}

/// Refuses a second export of volume `v`: it would write on after the first is stopped (a
/// delete stops one), into space given back.
fn refuse_twice(receiving: &[Receiving], v: &spool_pool::VolumeInfo) -> Result<(), RpcError> {
    if receiving.iter().any(|r| r.volume == v.uuid) {
        return Err(RpcError::InvalidParams(format!(
            "volume '{}' is being received already; `spoolctl volume receive {} --stop` ends that first",
            v.name, v.name
        )));
    }
    Ok(())
}

/// The URI the transfer into `volume` is served at, if it is received and has not ended.
/// A receive export's URI: `nbds://` when served over TLS.
fn receive_uri(listen: &Listen, name: &str, tls: bool) -> String {
    let uri = super::exports::uri(listen, name);
    match tls {
        true => uri.replacen("nbd://", "nbds://", 1),
        false => uri,
    }
}

pub(super) fn uri_of(receiving: &[Receiving], volume: Uuid) -> Option<String> {
    receiving
        .iter()
        .find(|r| r.volume == volume && !r.export.ending.load(Ordering::SeqCst))
        .map(|r| r.uri.clone())
}
