//! Standing replicas (docs/replicas.md): a volume that is another host's copy, written by
//! that host (its primary) through a transfer, which no frontend here runs until the
//! operator (or an orchestrator) promotes it; and the promotion, which ends the transfer
//! first, so nothing the old primary sends lands after it, and serves the volume at an
//! epoch above the primary's, which a hello from that primary never passes again.
//!
//! Owns: the replicas' admission holds, `volume_promote`. Must not know: the NBD protocol,
//! the hello's proofs, the table's layout (`spool_pool::Pool::make_replica`, `promote`).

use spool_frontend::AdmissionHold;
use spool_pool::VolumeInfo;

use super::Daemon;
use crate::api::{self, IdParams, Volume};
use crate::rpc::{MethodTable, RpcError};

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::VolumePromote>(Daemon::volume_promote);
}

impl Daemon {
    /// Keeps `hold`, replica `v`'s gate, until `v` is promoted or deleted.
    pub(super) fn hold_replica(&self, v: &VolumeInfo, hold: AdmissionHold) {
        let primary = v.replica.as_ref().map_or("", |r| r.primary.as_str());
        tracing::info!(volume = %v.name, %primary, "a replica of another host's volume: VMs connecting here wait until `volume promote`");
        let mut holds = self.replica_holds.lock().unwrap_or_else(|p| p.into_inner());
        holds.insert(v.uuid, hold);
    }

    /// Lets frontends into volume `v` again (promoted, or deleted).
    pub(super) fn release_replica(&self, v: &VolumeInfo) {
        let mut holds = self.replica_holds.lock().unwrap_or_else(|p| p.into_inner());
        holds.remove(&v.uuid);
    }

    /// Makes served volume `v` the copy of the primary at `peer`, at `epoch`: its gate is
    /// closed first (refused while a frontend is connected), then the table says so.
    pub(super) fn become_replica(
        &self,
        v: &VolumeInfo,
        peer: &str,
        epoch: u64,
    ) -> Result<VolumeInfo, RpcError> {
        let held =
            (self.replica_holds.lock().unwrap_or_else(|p| p.into_inner())).contains_key(&v.uuid);
        let hold = match held {
            true => None,
            false => match self.servers().get(&v.uuid).map(|s| s.hold_admission()) {
                Some(Some(h)) => Some(h),
                Some(None) => return Err(RpcError::InUse(v.name.clone())),
                None => {
                    return Err(RpcError::InvalidParams(format!(
                        "volume '{}' is not served here (offline?)",
                        v.name
                    )))
                }
            },
        };
        let r = self.pool().make_replica(&v.uuid.to_string(), peer, epoch)?;
        if let Some(h) = hold {
            self.hold_replica(&r, h);
        }
        Ok(r)
    }

    /// `volume promote NAME`: the old primary's transfer ends (a request in progress
    /// finishes first; every later one fails), the table records the volume as this host's
    /// at a higher epoch, and the frontends waiting go in.
    fn volume_promote(&self, p: IdParams) -> Result<Volume, RpcError> {
        let v = self.pool().volume(&p.id)?;
        if v.replica.is_none() {
            return Err(RpcError::InvalidParams(format!(
                "volume '{}' is not a replica here: nothing to promote (docs/replicas.md)",
                v.name
            )));
        }
        self.forget_expected(&v.name);
        if let Some(r) = self.stop_receiving(v.uuid, "the replica was promoted") {
            tracing::info!(volume = %v.name, written = r.written, "the primary's transfer ended for the promotion");
        }
        let v = self.pool().promote(&p.id)?;
        self.release_replica(&v);
        Ok(self.volume_view(v))
    }
}
