//! The snapshot methods (`volume_snapshot`, `volume_snapshots`, `snapshot_delete`,
//! `volume_clone`; docs/snapshots.md): pool operations, and serving a new clone.

use super::Daemon;
use crate::api::{self, ChangedChunks, CloneParams, IdParams, Snapshot, SnapshotParams, Volume};
use crate::rpc::{MethodTable, RpcError};
use crate::wire::ToWire;

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::VolumeSnapshot>(Daemon::volume_snapshot)
        .register::<api::VolumeSnapshots>(Daemon::volume_snapshots)
        .register::<api::SnapshotDelete>(Daemon::snapshot_delete)
        .register::<api::VolumeClone>(Daemon::volume_clone)
        .register::<api::VolumeRevert>(Daemon::volume_revert)
        .register::<api::VolumeInflate>(Daemon::volume_inflate);
}

impl Daemon {
    fn volume_snapshot(&self, p: SnapshotParams) -> Result<Snapshot, RpcError> {
        Ok(self.pool().snapshot_volume(&p.id, &p.snapshot)?.wire())
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
