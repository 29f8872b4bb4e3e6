//! The volume methods (`volume_list`, `volume_show`, `volume_create`, `volume_resize`,
//! `volume_delete`, `volume_qos`): pool operations plus starting and stopping the volume's
//! server, and publishing a changed layout to its running queues.

use spool_pool::VolumeInfo;
use uuid::Uuid;

use super::Daemon;
use crate::api::{self, IdParams, NoParams, SizeValue, Volume};
use crate::config::DEFAULT_QUEUES;
use crate::rpc::{MethodTable, RpcError};
use crate::wire::ToWire;

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::VolumeList>(Daemon::volume_list)
        .register::<api::VolumeShow>(Daemon::volume_show)
        .register::<api::VolumeCreate>(Daemon::volume_create)
        .register::<api::VolumeResize>(Daemon::volume_resize)
        .register::<api::VolumeDelete>(Daemon::volume_delete)
        .register::<api::VolumeQos>(Daemon::volume_qos)
        .register::<api::VolumeRekey>(Daemon::volume_rekey);
}

/// A size param in bytes.
pub(super) fn size_arg(s: &SizeValue, what: &str) -> Result<u64, RpcError> {
    match s {
        SizeValue::Bytes(n) => Ok(*n),
        SizeValue::Text(t) => {
            crate::size::parse_size(t).map_err(|e| RpcError::InvalidParams(format!("{what}: {e}")))
        }
    }
}

/// An optional size param in bytes.
pub(super) fn opt_size(s: Option<SizeValue>, what: &str) -> Result<Option<u64>, RpcError> {
    s.map(|s| size_arg(&s, what)).transpose()
}

impl Daemon {
    /// Rewraps every data key under the key-encryption key read from `key_file`, or from the
    /// configured source read again; nothing of the data is touched, and a failure changes
    /// nothing (docs/encryption.md, "Rotating the key-encryption key").
    fn volume_rekey(&self, p: api::RekeyParams) -> Result<api::RekeyResult, RpcError> {
        let new = match (&p.key_file, &self.cfg.encryption) {
            (Some(f), _) => crate::config::KeySource::File(f.into()).load(),
            (None, Some(source)) => source.load(),
            (None, None) => {
                return Err(RpcError::InvalidParams(
                    "spoold has no [encryption] key source; pass key_file".into(),
                ))
            }
        }
        .map_err(|e| RpcError::InvalidParams(e.to_string()))?;
        let mut pool = self.pool();
        let old = pool.kek_id().ok_or_else(|| {
            RpcError::InvalidParams("spoold has no key-encryption key to rekey from".into())
        })?;
        // The key in use again is refused, unless a rekey to it failed part way (both
        // keys held): running it again finishes that one.
        if old == new.id() && pool.kek_ids().len() == 1 {
            return Err(RpcError::InvalidParams(format!(
                "the new key is the key in use ({old}): put the new key in place first"
            )));
        }
        let kek_id = new.id();
        let rewrapped = pool.rekey(std::sync::Arc::new(new));
        // Kept whatever came of it: a rekey that failed part way holds both keys.
        if let Some(s) = &self.store {
            super::kept_keys::keep(&**s, &pool.keks());
        }
        let rewrapped = rewrapped?;
        Ok(api::RekeyResult {
            rewrapped,
            kek_id,
            old_kek_id: old,
        })
    }

    fn volume_list(&self, _: NoParams) -> Result<Vec<Volume>, RpcError> {
        let vols = self.pool().volumes();
        Ok(vols.into_iter().map(|v| self.volume_view(v)).collect())
    }

    fn volume_show(&self, p: IdParams) -> Result<Volume, RpcError> {
        let v = self.pool().volume(&p.id)?;
        Ok(self.volume_view(v))
    }

    pub(super) fn volume_create(&self, p: api::VolumeCreateParams) -> Result<Volume, RpcError> {
        let size = p.size.as_ref().map(|s| size_arg(s, "size")).transpose()?;
        let queues = p.num_queues.unwrap_or(DEFAULT_QUEUES);
        let v = match &p.rbd {
            Some(_) if p.thin => {
                return Err(RpcError::InvalidParams(
                    "an RBD image is thin already: thin does not apply".into(),
                ))
            }
            None if p.thin => self.pool().create_thin_copies(
                &p.name,
                size.ok_or_else(|| RpcError::InvalidParams("size is required".into()))?,
                p.read_only,
                queues,
                p.mirror.unwrap_or(1),
                p.encrypt,
            )?,
            Some(_) if p.encrypt => {
                return Err(RpcError::InvalidParams(
                    "RBD volumes cannot be encrypted by spoold yet (use Ceph's own encryption)"
                        .into(),
                ))
            }
            Some(target) => {
                if p.mirror.is_some_and(|m| m > 1) {
                    return Err(RpcError::InvalidParams(
                        "an RBD volume is replicated by Ceph: mirror does not apply".into(),
                    ));
                }
                let target = spool_pool::RbdTarget::parse(target)?;
                self.pool()
                    .create_rbd_volume(&p.name, size, p.read_only, queues, &target)?
            }
            None => self.pool().create_volume_opts(
                &p.name,
                size.ok_or_else(|| RpcError::InvalidParams("size is required".into()))?,
                p.read_only,
                queues,
                p.mirror.unwrap_or(1),
                p.encrypt,
            )?,
        };
        if let Err(e) = self.serve(&v) {
            return Err(RpcError::NotServed(e.to_string()));
        }
        Ok(self.volume_view(v))
    }

    fn volume_resize(&self, p: api::VolumeResizeParams) -> Result<Volume, RpcError> {
        let size = size_arg(&p.size, "size")?;
        let (v, layout) = {
            let mut pool = self.pool();
            let v = pool.resize_volume(&p.id, size)?;
            let l = pool.layout(&v.uuid.to_string())?;
            (v, l)
        };
        self.publish_layout(&v, layout);
        Ok(self.volume_view(v))
    }

    /// Changes a volume's I/O limits (the given ones replace the current ones) and
    /// publishes them to its running queues.
    fn volume_qos(&self, p: api::VolumeQosParams) -> Result<Volume, RpcError> {
        let change = p
            .change()
            .map_err(|e| RpcError::InvalidParams(e.to_string()))?;
        let (v, layout) = {
            let mut pool = self.pool();
            let limits = crate::qos::apply(&change, pool.volume(&p.id)?.qos);
            limits
                .validate()
                .map_err(|e| RpcError::InvalidParams(e.to_string()))?;
            let v = pool.set_qos(&p.id, Some(limits))?;
            let l = pool.layout(&v.uuid.to_string());
            (v, l)
        };
        match layout {
            Ok(l) => self.publish_layout(&v, l),
            Err(e) if self.servers().contains_key(&v.uuid) => {
                tracing::error!(volume = %v.name, error = %e, "I/O limits kept but not published to the running queues")
            }
            Err(_) => {}
        }
        Ok(self.volume_view(v))
    }

    /// Hands a volume's new layout (size, limits) to its running queues, if it is served.
    pub(super) fn publish_layout(&self, v: &VolumeInfo, layout: spool_pool::VolumeLayout) {
        if let Some(s) = self.servers().get(&v.uuid) {
            s.context().update_layout(layout);
        }
    }

    /// Deletes a volume once its server is stopped; a volume whose device commands never
    /// completed keeps its extents (quarantined) until restart.
    pub(super) fn volume_delete(
        &self,
        p: api::VolumeDeleteParams,
    ) -> Result<api::VolumeInfo, RpcError> {
        let v = self.pool().volume(&p.id)?;
        let stuck = |commands: u64| RpcError::Quarantined {
            volume: v.name.clone(),
            commands,
        };
        if let Some(n) = self.quarantined_io(v.uuid) {
            return Err(stuck(n));
        }
        self.pool().check_delete(&p.id, p.remove_image)?;
        let server = self.servers().remove(&v.uuid);
        if let Some(s) = server {
            if s.connected() && !p.force {
                self.servers().insert(v.uuid, s);
                return Err(RpcError::InUse(v.name.clone()));
            }
            let ctx = s.context().clone();
            s.shutdown();
            let n = ctx.abandoned_io();
            if n > 0 {
                self.quarantined
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(v.uuid, n);
                tracing::error!(volume = %v.name, commands = n, "volume stopped with device commands that never completed; its extents are quarantined until restart");
                return Err(stuck(n));
            }
        }
        self.stop_receiving(v.uuid, "the volume was deleted");
        self.release_replica(&v);
        // Its snapshots' chunks go back to the pool: no export may read them any more.
        let (_, deleted) = self.with_exports_stopped(v.uuid, None, || {
            self.pool()
                .delete_volume_with(&v.uuid.to_string(), p.remove_image)
        });
        Ok(deleted?.wire())
    }

    /// A volume and how it is served.
    /// The volume with how it is served. Takes the pool's lock for a mirror's progress, and
    /// never while holding the servers' lock (or the caller's pool guard: pass `v` in).
    pub(super) fn volume_view(&self, v: VolumeInfo) -> Volume {
        let served = self.servers().contains_key(&v.uuid);
        let mirror = self.volume_view_mirror(&v);
        let sending = self.sending(&v);
        // An encrypted volume that is not served: the key's reason, if that is it.
        let thin_error = v.thin.as_ref().and_then(|t| t.error.clone());
        let not_served = (!served && v.encrypted && v.online)
            .then(|| self.pool().export_data_key(&v.uuid.to_string()).err())
            .flatten()
            .map(|e| e.to_string())
            .or(thin_error.filter(|_| !served));
        // Before the servers' lock: `volume_receive` takes the transfers' lock, then it.
        let receiving = self.receive_info(v.uuid);
        let servers = self.servers();
        let s = servers.get(&v.uuid);
        Volume {
            receiving,
            sending,
            not_served,
            socket: s.map(|s| s.path().display().to_string()),
            connected: s.is_some_and(|s| s.connected()),
            quarantined_io: self.quarantined_io(v.uuid),
            mirror,
            info: v.wire(),
        }
    }

    /// A mirrored volume's copies and copying progress (the progress only while served).
    /// Takes the pool's lock and the servers' (not at once).
    pub(super) fn volume_view_mirror(&self, v: &VolumeInfo) -> Option<crate::api::MirrorStatus> {
        let served = self.servers().contains_key(&v.uuid);
        (v.copies > 1).then(|| {
            let progress = served
                .then(|| self.mirror_of(v))
                .flatten()
                .map(|m| m.progress());
            crate::wire::mirror_status(v, progress)
        })
    }

    /// Device commands of a stopped volume that never completed, if any.
    fn quarantined_io(&self, volume: Uuid) -> Option<u64> {
        self.quarantined
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&volume)
            .copied()
    }
}
