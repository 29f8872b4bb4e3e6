//! Standing replicas (docs/replicas.md): a volume that is another host's copy, written by
//! that host (its primary) through a transfer, which no frontend here runs until the
//! operator (or an orchestrator) promotes it; and the promotion, which ends the transfer
//! first, so nothing the old primary sends lands after it, and serves the volume at an
//! epoch above the primary's, which a hello from that primary never passes again.
//!
//! The primary's side: once its copy there is current, it says hello again with the token
//! (kept with the keeper meanwhile) so the replica's host records it complete; a replica
//! never said complete is promoted only with `force`.
//!
//! Owns: the replicas' admission holds, `volume_promote`, the replications to tell.
//! Must not know: the NBD protocol, the hello's proofs, the table's layout
//! (`spool_pool::Pool::make_replica`, `replica_complete`, `promote`).

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use spool_frontend::AdmissionHold;
use spool_pool::VolumeInfo;
use uuid::Uuid;

use super::Daemon;
use crate::api::{self, PromoteParams, Volume};
use crate::rpc::{MethodTable, RpcError};

/// A replication started here: where its destination's listener is and the token, until
/// that destination was told the copy is current.
#[derive(Serialize, Deserialize)]
pub(super) struct Replicating {
    to: String,
    token: String,
    /// The destination was told the copy is current.
    #[serde(default)]
    told: bool,
    /// Telling it failed once (said in the log once).
    #[serde(skip)]
    warned: bool,
    /// When it was last said hello to (told, or asked whether it promoted its copy while
    /// the link is down).
    #[serde(skip)]
    asked: Option<std::time::Instant>,
    /// A hello to it is under way.
    #[serde(skip)]
    busy: bool,
}

/// How often a primary whose replica is away asks its host whether it promoted it.
const ASK_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// Where the keeper keeps each replication to tell (`replicate/UUID`).
const KEPT_PREFIX: &str = "replicate/";

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
    fn volume_promote(&self, p: PromoteParams) -> Result<Volume, RpcError> {
        let v = self.pool().volume(&p.id)?;
        // Refused before anything ends.
        self.pool().check_promotable(&p.id, p.force)?;
        // The expectation stays: a later hello of the old primary's (its token) is told it
        // is fenced off.
        if let Some(r) = self.stop_receiving(v.uuid, "the replica was promoted") {
            tracing::info!(volume = %v.name, written = r.written, "the primary's transfer ended for the promotion");
        }
        let primary = v
            .replica
            .as_ref()
            .map_or(String::new(), |r| r.primary.clone());
        let v = self.pool().promote(&p.id, p.force)?;
        self.release_replica(&v);
        let why = format!("volume {}: promoted here at epoch {}", v.name, v.epoch);
        self.monitor.note(v.uuid, &primary, "replica", why);
        Ok(self.volume_view(v))
    }
}

impl Daemon {
    /// Remembers (with the keeper too) that volume `v`'s copy at listener `to` is a replica
    /// to tell once it is current.
    pub(super) fn remember_replication(&self, v: &VolumeInfo, to: &str, token: &str) {
        let r = Replicating {
            to: to.into(),
            token: token.into(),
            told: false,
            warned: false,
            asked: None,
            busy: false,
        };
        self.keep_replication(v.uuid, &r);
        let mut all = self.replicating.lock().unwrap_or_else(|p| p.into_inner());
        all.insert(v.uuid, r);
    }

    fn keep_replication(&self, volume: Uuid, r: &Replicating) {
        let Some(s) = &self.store else { return };
        let value = serde_json::to_string(r).unwrap_or_default();
        if let Err(e) = s.put(&format!("{KEPT_PREFIX}{volume}"), value, &[]) {
            tracing::error!(%volume, "cannot keep the replication with the keeper ({e}): after a worker restart its destination is not told when the copy is current");
        }
    }

    /// Takes over the replications the previous worker had still to tell.
    pub(super) fn restore_replications(&self) {
        let Some(k) = &self.keeping else { return };
        let mut all = self.replicating.lock().unwrap_or_else(|p| p.into_inner());
        for key in k.keys(KEPT_PREFIX) {
            let kept = k
                .take(&key)
                .map(|(v, _)| serde_json::from_str::<Replicating>(&v));
            match (key[KEPT_PREFIX.len()..].parse::<Uuid>(), kept) {
                (Ok(volume), Some(Ok(r))) => {
                    self.keep_replication(volume, &r);
                    all.insert(volume, r);
                }
                _ => tracing::warn!(%key, "a kept replication cannot be read: forgotten"),
            }
        }
    }

    /// Watches each replication started here (from the mirror settler): a replica's host
    /// whose copy became current is told so (once); while the link is down and writes
    /// wait, the host is asked every [`ASK_EVERY`] whether it promoted its copy, and if it
    /// did, the volume is fenced off here (its writes fail). A replication whose volume is
    /// gone, or no longer sent, is dropped.
    pub(super) fn watch_replications(self: &Arc<Self>) {
        let volumes: Vec<Uuid> = {
            let all = self.replicating.lock().unwrap_or_else(|p| p.into_inner());
            all.keys().copied().collect()
        };
        for uuid in volumes {
            let v = self.pool().volume(&uuid.to_string());
            let state = (v.as_ref().ok())
                .and_then(|v| self.sending(v))
                .map(|s| s.state);
            let (v, current) = match (v, state.as_deref()) {
                (Ok(v), Some("current")) => (v, true),
                // Cut off: while its writes wait (or, before the copy was current, go on
                // here alone), ask whether the copy there was promoted.
                (Ok(v), Some("waiting" | "disconnected")) => (v, false),
                (Ok(_), Some(_)) => continue,
                _ => {
                    self.forget_replication(uuid);
                    continue;
                }
            };
            let now = std::time::Instant::now();
            let due = |r: &mut Replicating| {
                let due = !r.busy
                    && match current {
                        true => !r.told,
                        false => r.asked.is_none_or(|t| now.duration_since(t) >= ASK_EVERY),
                    };
                if due {
                    r.busy = true;
                    r.asked = Some(now);
                }
                due
            };
            let Some((to, token)) = self.replication_due(&v, due) else {
                continue;
            };
            // Off the settler's thread: a listener that does not answer holds a hello for
            // up to a minute, and the settler reconnects links meanwhile.
            let d = self.clone();
            let spawned = std::thread::Builder::new()
                .name("replica-hello".into())
                .spawn(move || {
                    let kind = match current {
                        true => super::hello::HelloKind::Current,
                        false => super::hello::HelloKind::Ask,
                    };
                    let res = d.say_hello(&to, &token, &v, kind);
                    match current {
                        true => d.told_current(&v, &to, res),
                        false => d.asked_if_promoted(&v, &to, res),
                    }
                    d.replication_idle(v.uuid);
                });
            if spawned.is_err() {
                self.replication_idle(uuid);
            }
        }
    }

    fn forget_replication(&self, uuid: Uuid) {
        (self.replicating.lock().unwrap_or_else(|p| p.into_inner())).remove(&uuid);
        if let Some(s) = &self.store {
            let _ = s.remove(&format!("{KEPT_PREFIX}{uuid}"));
        }
    }

    /// No hello to the replica's host of volume `uuid` is under way any more.
    fn replication_idle(&self, uuid: Uuid) {
        let mut all = self.replicating.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = all.get_mut(&uuid) {
            r.busy = false;
        }
    }

    /// The listener and token of `v`'s replication, if `due` says it is to be asked now.
    fn replication_due(
        &self,
        v: &VolumeInfo,
        due: impl FnOnce(&mut Replicating) -> bool,
    ) -> Option<(String, String)> {
        let mut all = self.replicating.lock().unwrap_or_else(|p| p.into_inner());
        let r = all.get_mut(&v.uuid)?;
        due(r).then(|| (r.to.clone(), r.token.clone()))
    }

    /// What `v`'s replica's host answered the hello saying its copy is current.
    fn told_current(&self, v: &VolumeInfo, to: &str, told: Result<String, RpcError>) {
        let mut all = self.replicating.lock().unwrap_or_else(|p| p.into_inner());
        let Some(r) = all.get_mut(&v.uuid) else {
            return;
        };
        match told {
            Ok(_) => {
                tracing::info!(volume = %v.name, %to, "the replica there is told its copy is complete");
                r.told = true;
                self.keep_replication(v.uuid, r);
            }
            Err(e) if !r.warned => {
                r.warned = true;
                tracing::warn!(volume = %v.name, %to, "cannot tell the replica there its copy is complete (tried again every half second): {e}");
            }
            Err(_) => {}
        }
    }

    /// What `v`'s replica's host answered when asked (its link down, `v`'s writes
    /// waiting): `v` is fenced off here if the host promoted its copy.
    fn asked_if_promoted(&self, v: &VolumeInfo, to: &str, asked: Result<String, RpcError>) {
        let Err(RpcError::Fenced { epoch, .. }) = asked else {
            return;
        };
        let mirror = self.pool().mirror(&v.uuid.to_string());
        if let Ok(Some(m)) = mirror {
            if !m.fenced() {
                m.fence();
                let why = format!(
                    "volume {}: promoted on {to} at epoch {epoch}; fenced off here, its writes fail",
                    v.name
                );
                self.monitor.note(v.uuid, to, "send", why);
            }
        }
    }
}

impl Daemon {
    /// Each volume's replication, for the metrics endpoint.
    pub(crate) fn replication(&self) -> Vec<crate::metrics::Replication> {
        let volumes = self.pool().volumes();
        let seen = self
            .last_current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut rows = Vec::new();
        for v in volumes {
            let send = self.sending(&v).map(|s| {
                let at = seen.get(&v.uuid).copied().unwrap_or(0.0);
                (s.remaining_bytes, s.state == "current", at)
            });
            if v.replica.is_none() && v.epoch == 0 && send.is_none() {
                continue;
            }
            rows.push(crate::metrics::Replication {
                volume: v.name.clone(),
                replica: v.replica.as_ref().map(|r| r.complete),
                epoch: v.epoch,
                send,
            });
        }
        rows
    }

    /// Volume `v`'s copy elsewhere was seen current now (from the mirror settler).
    pub(super) fn seen_current(&self, v: &VolumeInfo) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let mut seen = self.last_current.lock().unwrap_or_else(|p| p.into_inner());
        seen.insert(v.uuid, now);
    }
}
