//! `volume_receive`, `volume_receive_stop` (docs/transfer.md): a volume no frontend serves,
//! served as a writable NBD export for another host (or `qemu-img convert`, `nbdcopy`) to
//! write its data into, through the volume's layout devices.
//!
//! The transfer ends, for good, when a frontend starts one of the volume's queues (the
//! guest writes it from then on: the switchover of a move), when the operator stops it, or
//! when the volume is deleted; from then on every request of a sender fails. A request in
//! progress finishes before the end returns, so nothing it writes lands after the guest's
//! first request. It also ends with the worker process: a restarted worker does not serve it
//! again, and the sender reconnects to a new `volume receive` (docs/transfer.md, "Limits").

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use spool_frontend::VolumeContext;
use spool_nbd::Server;
use uuid::Uuid;

use super::Daemon;
use crate::api::{self, ReceiveInfo, ReceiveParams, ReceiveStopParams};
use crate::rpc::{MethodTable, RpcError};

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::VolumeReceive>(Daemon::volume_receive)
        .register::<api::VolumeReceiveStop>(Daemon::volume_receive_stop);
}

/// Extent size the export reports `base:allocation` in (everything is allocated).
const EXTENT: u64 = 1 << 20;

/// A volume as a writable NBD export.
struct ReceiveExport {
    name: String,
    size: u64,
    ctx: Arc<VolumeContext>,
    /// Why the transfer ended (None: it goes on); taken for writing to end it, so a
    /// request in progress finishes first.
    ended: RwLock<Option<String>>,
    written: AtomicU64,
}

impl ReceiveExport {
    /// Runs `f` on the volume's current layout unless the transfer ended.
    fn with_layout<R>(
        &self,
        f: impl FnOnce(&spool_pool::VolumeLayout) -> std::io::Result<R>,
    ) -> std::io::Result<R> {
        let ended = self.ended.read().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &*ended {
            return Err(std::io::Error::other(format!("the transfer ended: {why}")));
        }
        f(&self.ctx.layout().load())
    }

    /// Ends the transfer (the first reason stays).
    fn end(&self, why: &str) {
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
        self.with_layout(|l| l.write_at(buf, offset))?;
        self.written.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.with_layout(|l| l.zero(offset, len))?;
        self.written.fetch_add(len, Ordering::Relaxed);
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
        let listen = super::exports::parse_listen(&p.nbd)?;
        // Lock order: the transfers, then the pool, the servers; the exports' lock is
        // never held with it (`snapshot_export` looks at the transfers without its own).
        let exported = self.export_listens(&listen.to_string());
        let mut receiving = self.receiving.lock().unwrap_or_else(|e| e.into_inner());
        let v = self.pool().check_writable_outside(&p.id)?;
        if receiving.iter().any(|r| r.volume == v.uuid) {
            return Err(RpcError::InvalidParams(format!(
                "volume '{}' is being received already; `spoolctl volume receive {} --stop` ends that first",
                v.name, v.name
            )));
        }
        if exported || receiving.iter().any(|r| r.nbd == listen.to_string()) {
            return Err(RpcError::InvalidParams(format!(
                "{listen} serves another export already"
            )));
        }
        let ctx = self
            .servers()
            .get(&v.uuid)
            .map(|s| s.context().clone())
            .ok_or_else(|| {
                RpcError::InvalidParams(format!("volume '{}' is not served (offline?)", v.name))
            })?;
        let export = Arc::new(ReceiveExport {
            name: v.name.clone(),
            size: v.size,
            ctx: ctx.clone(),
            ended: RwLock::new(None),
            written: AtomicU64::new(0),
        });
        // The hook first, then the look at the queues: a queue that starts between the two
        // still ends the transfer.
        let ending = export.clone();
        ctx.on_serving(Box::new(move || {
            ending.end("a frontend started the volume")
        }));
        if ctx.stats().snapshot().queue_size > 0 {
            export.end("the volume was in use");
            return Err(RpcError::InvalidParams(format!(
                "volume '{}' is in use: a frontend runs its queues, and a transfer would write behind its back; stop the VM first",
                v.name
            )));
        }
        let server = Server::start(listen.clone(), export.clone())
            .map_err(|e| RpcError::InvalidParams(e.to_string()))?;
        let r = Receiving {
            volume: v.uuid,
            nbd: listen.to_string(),
            uri: super::exports::uri(&listen, &v.name),
            export,
            server,
        };
        tracing::info!(volume = %v.name, uri = %r.uri, "receiving the volume over NBD");
        let info = r.info();
        receiving.push(r);
        Ok(info)
    }

    fn volume_receive_stop(&self, p: ReceiveStopParams) -> Result<ReceiveInfo, RpcError> {
        let v = self.pool().volume(&p.id)?;
        self.stop_receiving(v.uuid, "stopped").ok_or_else(|| {
            RpcError::InvalidParams(format!("volume '{}' is not being received", v.name))
        })
    }

    /// Ends and forgets the transfer into volume `volume`, if any.
    pub(super) fn stop_receiving(&self, volume: Uuid, why: &str) -> Option<ReceiveInfo> {
        let mut receiving = self.receiving.lock().unwrap_or_else(|e| e.into_inner());
        let i = receiving.iter().position(|r| r.volume == volume)?;
        Some(receiving.remove(i).stop(why))
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
