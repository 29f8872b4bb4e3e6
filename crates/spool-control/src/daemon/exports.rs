//! `snapshot_export`, `snapshot_unexport`, `volume_diff` (docs/snapshots.md, "Backup"):
//! snapshots served read-only over NBD by spool-nbd, straight from the pool devices.
//!
//! A served snapshot's chunks must not go back to the pool while a client may read them:
//! deleting the snapshot or its volume stops its exports first, and a stopped export fails
//! every read from then on (a read in progress finishes before the stop returns).
//!
//! An export outlives the worker that started it: its listening socket and what it serves
//! are kept with the keeper (`export/VOLUME/NBD`), and the next worker serves it again on
//! that socket, so a backup client connecting during a restart or an upgrade waits in the
//! listen queue instead of being refused. A connection open at the restart is cut (a
//! client with reconnection, such as QEMU's `reconnect-delay`, carries on).

use std::sync::{Arc, RwLock};

use spool_nbd::{Listen, Server};
use spool_pool::SnapshotImage;
use uuid::Uuid;

use super::Daemon;
use crate::api::{self, DiffParams, DiffResult, ExportInfo, ExportParams, SnapshotParams};
use crate::rpc::{MethodTable, RpcError};

/// Key prefix of the exports kept with the keeper.
const KEPT_PREFIX: &str = "export/";

fn kept_key(volume: Uuid, nbd: &str) -> String {
    format!("{KEPT_PREFIX}{volume}/{nbd}")
}

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::VolumeDiff>(Daemon::volume_diff)
        .register::<api::SnapshotExport>(Daemon::snapshot_export)
        .register::<api::SnapshotUnexport>(Daemon::snapshot_unexport);
}

/// A snapshot as an NBD export.
struct SnapshotExport {
    image: SnapshotImage,
    /// False once stopped: reads fail (the snapshot may be deleted next).
    alive: RwLock<bool>,
}

impl spool_nbd::Export for SnapshotExport {
    fn name(&self) -> &str {
        &self.image.name
    }
    fn size(&self) -> u64 {
        self.image.size
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let alive = self.alive.read().unwrap_or_else(|p| p.into_inner());
        if !*alive {
            return Err(std::io::Error::other("the export was stopped"));
        }
        self.image.read_at(buf, offset)
    }
    fn extent(&self) -> u64 {
        self.image.chunk
    }
    fn allocated(&self, i: u64) -> bool {
        self.image.allocated(i)
    }
    fn base(&self) -> Option<&str> {
        self.image.base.as_ref().map(|b| b.0.as_str())
    }
    fn changed(&self, i: u64) -> bool {
        self.image.changed(i)
    }
}

/// One served snapshot.
pub(super) struct Exported {
    volume: Uuid,
    info: ExportInfo,
    export: Arc<SnapshotExport>,
    server: Server,
}

impl Exported {
    fn stop(self) -> ExportInfo {
        *self.export.alive.write().unwrap_or_else(|p| p.into_inner()) = false;
        drop(self.server);
        tracing::info!(export = %self.info.uri, "snapshot export stopped");
        self.info
    }
}

/// `unix:PATH` (absolute, and not one of spoold's own sockets: the RPC socket, the
/// vhost-user socket directory, the journal directory) or `HOST:PORT`, as a listening
/// address of an export.
pub(super) fn parse_listen(nbd: &str, cfg: &crate::Config) -> Result<Listen, RpcError> {
    let listen = Listen::parse(nbd).map_err(|e| RpcError::InvalidParams(e.to_string()))?;
    if let Listen::Unix(path) = &listen {
        if !path.is_absolute() {
            return Err(RpcError::InvalidParams(format!(
                "unix:{}: give an absolute path",
                path.display()
            )));
        }
        let at = resolved(path);
        let own = at == resolved(&cfg.rpc_socket)
            || at.starts_with(resolved(&cfg.socket_dir))
            || cfg
                .journal_dir
                .as_deref()
                .is_some_and(|j| at.starts_with(resolved(j)));
        if own {
            return Err(RpcError::InvalidParams(format!(
                "unix:{}: that is spoold's own (its RPC socket, vhost-user sockets or journal); pick a path outside them",
                path.display()
            )));
        }
    }
    Ok(listen)
}

/// `p` with its directory resolved (symlinks, `..`), the file itself perhaps not there yet.
fn resolved(p: &std::path::Path) -> std::path::PathBuf {
    match (p.parent(), p.file_name()) {
        (Some(dir), Some(name)) => std::fs::canonicalize(dir)
            .map(|d| d.join(name))
            .unwrap_or_else(|_| p.to_path_buf()),
        _ => std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()),
    }
}

pub(super) fn uri(listen: &Listen, name: &str) -> String {
    match listen {
        Listen::Unix(p) => format!("nbd+unix:///{name}?socket={}", p.display()),
        Listen::Tcp(a) => format!("nbd://{a}/{name}"),
    }
}

/// The TLS a snapshot export on `listen` is served with: none on a Unix socket (its mode
/// guards it); over TCP `[tls]`'s credentials, or none when the operator asked for
/// plaintext, else refused with what to do.
fn export_tls(
    cfg: &crate::config::Config,
    listen: &Listen,
    plaintext: bool,
) -> Result<Option<spool_nbd::tls::ServerTls>, RpcError> {
    if matches!(listen, Listen::Unix(_)) {
        return Ok(None);
    }
    match (&cfg.tls, plaintext) {
        (_, true) => {
            tracing::warn!(listen = %listen, "a snapshot is exported over TCP without TLS: whoever reaches the address reads it");
            Ok(None)
        }
        (Some(dir), false) => spool_nbd::tls::ServerTls::load(dir)
            .map(Some)
            .map_err(|e| RpcError::InvalidParams(e.to_string())),
        (None, false) => Err(RpcError::InvalidParams(format!(
            "an export over TCP ({listen}) is served with TLS: set [tls] dir in the config (docs/security.md), or pass --plaintext (RPC: plaintext) to serve it in the clear to whoever reaches that address"
        ))),
    }
}

impl Daemon {
    fn volume_diff(&self, p: DiffParams) -> Result<DiffResult, RpcError> {
        let (chunk, ranges) = self.pool().diff(&p.id, &p.from, p.to.as_deref())?;
        let changed = ranges.iter().map(|r| r.1).sum();
        Ok(DiffResult {
            chunk,
            ranges,
            changed,
        })
    }

    fn snapshot_export(&self, p: ExportParams) -> Result<ExportInfo, RpcError> {
        self.start_export(p, None)
    }

    /// Serves snapshot export `p` (on `kept`, the listening socket a previous worker left,
    /// if given), kept with the keeper for the next worker.
    fn start_export(
        &self,
        p: ExportParams,
        kept: Option<std::os::fd::OwnedFd>,
    ) -> Result<ExportInfo, RpcError> {
        let listen = parse_listen(&p.nbd, &self.cfg)?;
        // Not under the exports' lock: `volume_receive` takes the transfers' lock, then
        // looks at the exports.
        let receiving = self.receiving_listens(&listen.to_string());
        // Lock order: exports, then the pool. Held until the export is registered, so a
        // delete (which stops exports under this lock first) cannot free its chunks between.
        let mut exports = self.exports.lock().unwrap_or_else(|e| e.into_inner());
        let (volume, image) = {
            let pool = self.pool();
            let v = pool.volume(&p.id)?;
            if v.encrypted && !p.decrypt {
                return Err(spool_pool::Error::InvalidArgument(format!(
                    "volume '{}' is encrypted: its snapshot would be served decrypted, in the clear, to whoever reaches {}; pass --decrypt (RPC: decrypt) to do so (docs/encryption.md)",
                    v.name, p.nbd
                ))
                .into());
            }
            (
                v,
                pool.snapshot_image(&p.id, &p.snapshot, p.since.as_deref())?,
            )
        };
        if exports.iter().any(|e| e.info.nbd == listen.to_string()) || receiving {
            return Err(RpcError::InvalidParams(format!(
                "{listen} serves another export already"
            )));
        }
        let tls = export_tls(&self.cfg, &listen, p.plaintext)?;
        let secure = tls.is_some();
        let (name, size) = (image.name.clone(), image.size);
        let export = Arc::new(SnapshotExport {
            image,
            alive: RwLock::new(true),
        });
        let server = Server::start_tls(listen, kept, export.clone(), None, tls)
            .map_err(|e| RpcError::InvalidParams(e.to_string()))?;
        // What it listens on (a TCP port 0 is the free port it got).
        let mut uri = uri(&server.listen, &name);
        if secure {
            uri = uri.replacen("nbd://", "nbds://", 1);
        }
        let info = ExportInfo {
            volume: volume.name.clone(),
            snapshot: p.snapshot.clone(),
            nbd: server.listen.to_string(),
            uri,
            size,
            base: p.since.clone(),
        };
        tracing::info!(export = %info.uri, base = ?info.base, "snapshot exported over NBD");
        if let Some(s) = &self.store {
            let again = ExportParams {
                id: volume.uuid.to_string(),
                nbd: info.nbd.clone(),
                ..p
            };
            let value = serde_json::to_string(&again).unwrap_or_default();
            let key = kept_key(volume.uuid, &info.nbd);
            if let Err(e) = s.put(&key, value, &[server.listener_fd()]) {
                tracing::error!(export = %info.uri, "cannot keep the export's socket with the keeper ({e}): a worker restart ends it");
            }
        }
        exports.push(Exported {
            volume: volume.uuid,
            info: info.clone(),
            export,
            server,
        });
        Ok(info)
    }

    fn snapshot_unexport(&self, p: SnapshotParams) -> Result<ExportInfo, RpcError> {
        let v = self.pool().volume(&p.id)?;
        let stopped = self.stop_exports(v.uuid, Some(&p.snapshot));
        stopped.into_iter().next().ok_or_else(|| {
            RpcError::InvalidParams(format!(
                "snapshot {}@{} is not exported",
                v.name, p.snapshot
            ))
        })
    }

    /// Whether a snapshot export listens on `nbd` (as [`Listen`] prints it).
    pub(super) fn export_listens(&self, nbd: &str) -> bool {
        let exports = self.exports.lock().unwrap_or_else(|e| e.into_inner());
        exports.iter().any(|e| e.info.nbd == nbd)
    }

    /// Stops the exports of volume `volume` (of its snapshot `snapshot` only, if given).
    pub(super) fn stop_exports(&self, volume: Uuid, snapshot: Option<&str>) -> Vec<ExportInfo> {
        self.with_exports_stopped(volume, snapshot, || ()).0
    }

    /// Stops the exports of volume `volume` (of `snapshot` only, if given) and runs `then`
    /// (a delete) before any new export of it can start: their chunks may go back to the
    /// pool in `then`.
    pub(super) fn with_exports_stopped<R>(
        &self,
        volume: Uuid,
        snapshot: Option<&str>,
        then: impl FnOnce() -> R,
    ) -> (Vec<ExportInfo>, R) {
        let mut exports = self.exports.lock().unwrap_or_else(|e| e.into_inner());
        let (stop, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut *exports)
            .into_iter()
            .partition(|e| e.volume == volume && snapshot.is_none_or(|s| e.info.snapshot == s));
        *exports = keep;
        if let Some(s) = &self.store {
            for e in &stop {
                if let Err(why) = s.remove(&kept_key(e.volume, &e.info.nbd)) {
                    tracing::error!(export = %e.info.uri, "keeper: {why}");
                }
            }
        }
        let stopped = stop.into_iter().map(Exported::stop).collect();
        (stopped, then())
    }

    /// Serves again the exports the previous worker kept, on their kept sockets (at start,
    /// once the volumes are served). One that cannot be (its snapshot gone meanwhile) is
    /// let go, its socket closed.
    pub(super) fn restore_exports(&self) {
        let (Some(k), Some(s)) = (&self.keeping, &self.store) else {
            return;
        };
        for key in k.keys(KEPT_PREFIX) {
            let Some((value, fds)) = k.take(&key) else {
                continue;
            };
            let r = match (
                serde_json::from_str::<ExportParams>(&value),
                fds.into_iter().next(),
            ) {
                (Ok(p), Some(fd)) => self.start_export(p, Some(fd.into())),
                _ => Err(RpcError::InvalidParams(format!(
                    "kept export {key}: {value}"
                ))),
            };
            match r {
                Ok(info) => {
                    tracing::info!(export = %info.uri, "snapshot exported again after the worker's restart")
                }
                Err(e) => {
                    tracing::warn!(key = %key, "a kept export is not served again: {e}");
                    if let Err(e) = s.remove(&key) {
                        tracing::error!(key = %key, "keeper: {e}");
                    }
                }
            }
        }
    }
}
