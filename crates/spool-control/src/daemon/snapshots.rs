//! The snapshot methods (`volume_snapshot`, `volume_snapshots`, `snapshot_delete`,
//! `volume_clone`; docs/snapshots.md): pool operations, and serving a new clone.

use super::Daemon;
use crate::api::{
    self, ChangedChunks, CloneParams, IdParams, Snapshot, SnapshotParams, TakeSnapshotParams,
    Volume,
};
use crate::rpc::{MethodTable, RpcError};
use crate::wire::ToWire;
use spool_api::size::format_size;

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::VolumeSnapshot>(Daemon::volume_snapshot)
        .register::<api::VolumeSnapshots>(Daemon::volume_snapshots)
        .register::<api::SnapshotDelete>(Daemon::snapshot_delete)
        .register::<api::VolumeClone>(Daemon::volume_clone)
        .register::<api::VolumeRevert>(Daemon::volume_revert)
        .register::<api::VolumeInflate>(Daemon::volume_inflate);
}

impl Daemon {
    /// Says what the snapshot could cost the pool later: each chunk the volume maps is
    /// copied on its first write after it, so a pool with less free space than the volume
    /// maps may fail those writes. A warning in the answer (and the log), or with
    /// `require_space` a refusal before anything is taken (issue 57).
    fn volume_snapshot(&self, p: TakeSnapshotParams) -> Result<Snapshot, RpcError> {
        let mut pool = self.pool();
        let space = pool.snapshot_space(&p.id)?;
        let short = space.filter(|&(need, free)| need > free);
        if let (Some((need, free)), true) = (short, p.require_space) {
            return Err(RpcError::Pool(spool_pool::Error::InvalidArgument(format!(
                "volume '{}': its writes after a snapshot could need {} for copies (every chunk \
                 it maps), the pool has {} free: snapshot '{}' not taken (add space, or take it \
                 without --require-space)",
                p.id,
                format_size(need),
                format_size(free),
                p.snapshot
            ))));
        }
        let mut s = pool.snapshot_volume(&p.id, &p.snapshot)?.wire();
        drop(pool);
        if let Some((need, free)) = space {
            (s.copies_could_need, s.pool_free) = (Some(need), Some(free));
        }
        if let Some((need, free)) = short {
            let w = format!(
                "its writes could need {} for copies, the pool has {} free: writes may fail \
                 for want of space once it is full (add space or delete snapshots)",
                format_size(need),
                format_size(free)
            );
            tracing::warn!(volume = %s.volume, snapshot = %s.name, need, free, "snapshot taken on a pool that may not hold its copies");
            s.warning = Some(w);
        }
        Ok(s)
    }

    fn volume_snapshots(&self, p: IdParams) -> Result<Vec<Snapshot>, RpcError> {
        let list = self.pool().snapshots(&p.id)?;
        Ok(list.into_iter().map(ToWire::wire).collect())
    }

    fn snapshot_delete(&self, p: SnapshotParams) -> Result<Snapshot, RpcError> {
        // Its chunks may go to another volume next: no export may read them any more.
        let v = self.pool().volume(&p.id)?;
        let (_, deleted) = self.with_exports_stopped(v.uuid, Some(&p.snapshot), || {
            self.pool().delete_snapshot(&p.id, &p.snapshot)
        });
        Ok(deleted?.wire())
    }

    /// Offline only: a VM connected to the volume would see its data change under it. The
    /// volume's server keeps new frontends out for the whole revert (one that connects
    /// meanwhile waits for it to end), so no VM comes in between the check and the revert.
    fn volume_revert(&self, p: SnapshotParams) -> Result<ChangedChunks, RpcError> {
        let v = self.pool().volume(&p.id)?;
        if v.replica.is_some() {
            return Err(RpcError::InvalidParams(format!(
                "volume '{}' is another host's replica: reverting it would change it behind its primary's back (promote it first)",
                v.name
            )));
        }
        let hold = match self.servers().get(&v.uuid).map(|s| s.hold_admission()) {
            Some(None) => return Err(RpcError::InUse(v.name.clone())),
            Some(Some(h)) => Some(h),
            None => None,
        };
        let chunks = self.pool().revert_volume(&p.id, &p.snapshot);
        drop(hold);
        let chunks = chunks?;
        Ok(ChangedChunks {
            volume: v.name,
            chunks,
        })
    }

    fn volume_inflate(&self, p: IdParams) -> Result<ChangedChunks, RpcError> {
        let v = self.pool().volume(&p.id)?;
        // The copying goes on without the pool's lock: other methods are served meanwhile.
        let dev = self.pool().inflating(&p.id)?;
        let chunks = spool_pool::inflate(&dev)?;
        self.pool().inflated(&p.id, chunks)?;
        Ok(ChangedChunks {
            volume: v.name,
            chunks,
        })
    }

    fn volume_clone(&self, p: CloneParams) -> Result<Volume, RpcError> {
        let v = self.pool().clone_snapshot(&p.id, &p.snapshot, &p.name)?;
        if let Err(e) = self.serve(&v) {
            return Err(RpcError::NotServed(e.to_string()));
        }
        Ok(self.volume_view(v))
    }
}
