//! Mirrored volumes in the daemon: `volume_verify`, `volume_mirror` (add or remove a copy
//! online), and the mirror settler: every half second it records legs a rebuild made current
//! as synced in the pool table and, unless `[pool] auto_rebuild = false`, moves legs off
//! failed devices onto free space of other devices (the moved legs rebuild online); and
//! gives a removed leg's extents back to the pool once no queue holds a layout naming them.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use spool_mirror::Mirror;
use spool_pool::VolumeInfo;
use uuid::Uuid;

use super::Daemon;

/// A removed leg's extents the pool holds back (up to `ticket`, the generation of the
/// table without them), and the volume's context: once it holds no layout older than the
/// ticket, no queue of the volume writes there.
pub(super) struct Retiring {
    volume: Uuid,
    ticket: u64,
    ctx: Weak<spool_frontend::VolumeContext>,
    /// The volume's commands abandoned (never completed) when the leg was removed: one
    /// abandoned since may still land on the leg, which then stays taken until a restart.
    abandoned: u64,
}
use crate::api::{self, IdParams, Volume};
use crate::rpc::{MethodTable, RpcError};

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::VolumeVerify>(Daemon::volume_verify)
        .register::<api::VolumeMirror>(Daemon::volume_mirror);
}

impl Daemon {
    /// The mirror of a mirrored volume (built when first served).
    pub(super) fn mirror_of(&self, v: &VolumeInfo) -> Option<Mirror> {
        self.pool().mirror(&v.uuid.to_string()).ok().flatten()
    }

    /// The mirror of mirrored volume `v`, or why there is none (`why`: what a plain volume
    /// lacks for the request).
    fn served_mirror(&self, v: &VolumeInfo, why: &str) -> Result<Mirror, RpcError> {
        if v.copies < 2 {
            return Err(RpcError::InvalidParams(format!(
                "volume '{}' is not mirrored: {why}",
                v.name
            )));
        }
        self.mirror_of(v).ok_or_else(|| {
            RpcError::InvalidParams(format!("volume '{}' has no complete copy present", v.name))
        })
    }

    /// Compares a mirrored volume's copies.
    fn volume_verify(&self, p: IdParams) -> Result<api::VerifyResult, RpcError> {
        let v = self.pool().volume(&p.id)?;
        let m = self.served_mirror(&v, "there is nothing to compare")?;
        let r = m.verify().map_err(|e| RpcError::Pool(e.into()))?;
        Ok(api::VerifyResult {
            volume: v.name,
            regions: r.regions,
            bytes_compared: r.bytes_compared,
            regions_skipped: r.regions_skipped,
            regions_differing: r.regions_differing,
            first_differences: r.first_differences,
        })
    }

    /// Adds or removes a copy and publishes the new layout to the running queues.
    fn volume_mirror(&self, p: api::VolumeMirrorParams) -> Result<Volume, RpcError> {
        let v = {
            let mut pool = self.pool();
            match p.action.as_str() {
                "add" => pool.add_leg(&p.id)?,
                "remove" => pool.remove_leg(&p.id, p.leg)?,
                "accept" => {
                    drop(pool);
                    return self.accept_leg(&p.id, p.leg);
                }
                other => {
                    return Err(RpcError::InvalidParams(format!(
                        "action \"{other}\" must be \"add\", \"remove\" or \"accept\""
                    )))
                }
            }
        };
        self.republish(&v);
        let v = self.pool().volume(&p.id)?;
        Ok(self.volume_view(v))
    }

    /// Makes leg `leg` current where no usable leg is (docs/mirror.md, "Regions with no
    /// current copy"): the operator's decision, never spoold's.
    fn accept_leg(&self, id: &str, leg: Option<u8>) -> Result<Volume, RpcError> {
        let v = self.pool().volume(id)?;
        let Some(leg) = leg else {
            return Err(RpcError::InvalidParams(
                "accept needs the leg (slot) whose bytes become current".into(),
            ));
        };
        let m = self.served_mirror(&v, "there is no leg to accept")?;
        let n = m
            .accept_leg(leg)
            .map_err(|e| RpcError::InvalidParams(e.to_string()))?;
        if let Some(&device) = v
            .legs
            .iter()
            .find(|l| l.slot == leg)
            .and_then(|l| l.devices.first())
        {
            let reason = format!(
                "volume {}: an operator accepted leg {leg} as current in {n} regions that had no current copy",
                v.name
            );
            self.monitor
                .note(device, &self.device_path(device), "mirror", reason);
        }
        Ok(self.volume_view(v))
    }

    /// Publishes volume `v`'s current layout to its running queues. The extents of a leg
    /// just removed go back to the pool once no queue holds a layout that names them (at
    /// once when the volume is not served).
    pub(super) fn republish(&self, v: &VolumeInfo) {
        // Not in a match: its guard would hold the pool's lock while publishing takes the
        // servers' (the other order is taken elsewhere).
        let (layout, ticket) = {
            let pool = self.pool();
            (
                pool.layout(&v.uuid.to_string()),
                pool.retired_ticket(v.uuid),
            )
        };
        let ctx = self.servers().get(&v.uuid).map(|s| s.context().clone());
        match (layout, &ctx) {
            (Ok(l), Some(c)) => c.update_layout(l),
            (Ok(_), None) => {}
            (Err(e), _) => {
                tracing::error!(volume = %v.name, "no layout after a change of copies: {e}")
            }
        }
        self.hold_retired(v.uuid, ticket, ctx);
    }

    /// Holds volume `volume`'s retired extents and maps (up to `ticket`: none when `None`)
    /// until no queue of `ctx` holds a layout older than the ticket; gives them back at once
    /// when the volume is not served.
    pub(super) fn hold_retired(
        &self,
        volume: Uuid,
        ticket: Option<u64>,
        ctx: Option<Arc<spool_frontend::VolumeContext>>,
    ) {
        let Some(ticket) = ticket else { return };
        match ctx {
            // The queues keep what they have until a newer layout comes: the extents stay
            // taken until then (or a restart).
            Some(c) => self
                .retiring
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Retiring {
                    volume,
                    ticket,
                    abandoned: c.abandoned_io(),
                    ctx: Arc::downgrade(&c),
                }),
            None => {
                self.pool().release_retired(volume, ticket);
            }
        }
    }

    /// Gives back the removed legs' extents no queue can reach any more (unless a command
    /// of the volume was abandoned since: those stay taken).
    fn release_retired(&self) {
        let done: Vec<Retiring> = {
            let mut all = self.retiring.lock().unwrap_or_else(|p| p.into_inner());
            let (done, keep) = std::mem::take(&mut *all).into_iter().partition(|r| {
                (r.ctx.upgrade()).is_none_or(|c| !c.holds_layout_older_than(r.ticket))
            });
            *all = keep;
            done
        };
        for r in done {
            // A volume stopped with commands that never completed (quarantined): its
            // context is gone, and those commands may still land on the removed leg.
            let stuck = self
                .quarantined
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(&r.volume);
            if stuck
                || r.ctx
                    .upgrade()
                    .is_some_and(|c| c.abandoned_io() > r.abandoned)
            {
                tracing::error!(volume = %r.volume, "device commands were abandoned while a removed copy was still in use: its extents stay taken until spoold restarts");
                continue;
            }
            self.pool().release_retired(r.volume, r.ticket);
        }
    }

    /// Starts the mirror settler (see the module doc); it also reports thin volumes' space
    /// (`thin.rs`).
    pub(super) fn start_mirror_settler(self: &Arc<Self>) {
        let weak: Weak<Daemon> = Arc::downgrade(self);
        let _ = std::thread::Builder::new()
            .name("spool-mirrors".into())
            .spawn(move || {
                let (mut seen, mut sends) = (HashMap::new(), HashMap::new());
                let mut space = super::thin::SpaceWatch::default();
                loop {
                    std::thread::sleep(Duration::from_millis(500));
                    let Some(d) = weak.upgrade() else { return };
                    if d.stopping.load(Ordering::Acquire) {
                        return;
                    }
                    d.settle_mirrors();
                    d.release_retired();
                    d.reconnect_remotes();
                    d.report_mirrors(&mut seen);
                    d.report_sends(&mut sends);
                    d.watch_replications();
                    d.report_thin_space(&mut space);
                }
            });
    }

    fn settle_mirrors(&self) {
        let settled = self.pool().settle_mirrors();
        if let Err(e) = settled {
            tracing::warn!("cannot record rebuilt mirror legs: {e}");
        }
        // Thin volumes whose added copies are current give up their own map.
        let finished = self.pool().finish_thin_copies();
        match finished {
            Ok(done) => {
                for name in done {
                    let v = self.pool().volume(&name);
                    if let Ok(v) = v {
                        self.republish(&v);
                    }
                }
            }
            Err(e) => tracing::warn!("cannot finish adding copies to a thin volume: {e}"),
        }
        if !self.cfg.auto_rebuild {
            return;
        }
        let moved = self.pool().relocate_failed_legs();
        match moved {
            Ok(moved) => {
                for r in moved {
                    let v = self.pool().volume(&r.volume);
                    if let Ok(v) = v {
                        self.republish(&v);
                    }
                }
            }
            Err(e) => tracing::warn!("cannot move mirror legs off a failed device: {e}"),
        }
    }

    /// Records a health event (kind "mirror") when a served mirrored volume changes state
    /// (degraded, rebuilding, healthy, offline) and at every quarter of a rebuild; `seen`
    /// holds each volume's last (state, quarter).
    fn report_mirrors(&self, seen: &mut HashMap<Uuid, (String, u8)>) {
        let volumes = self.pool().volumes();
        for v in volumes.into_iter().filter(|v| v.copies > 1) {
            let Some(m) = self.volume_view(v.clone()).mirror else {
                continue;
            };
            if m.legs.iter().any(|l| l.state == "idle") {
                continue; // not served
            }
            let quarter = (m.percent / 25.0) as u8;
            let now = (
                m.state.clone(),
                if m.state == "rebuilding" { quarter } else { 0 },
            );
            let before = seen.insert(v.uuid, now.clone());
            if before.as_ref() == Some(&now) || (before.is_none() && m.state == "healthy") {
                continue;
            }
            // A leg on this pool's devices (a remote copy's events are `send`'s).
            let mut local = m.legs.iter().filter(|l| !l.devices.is_empty());
            let leg = local
                .clone()
                .find(|l| l.state != "current")
                .or(local.next());
            let Some(device) = leg.and_then(|l| l.devices.first().copied()) else {
                continue;
            };
            let current = m.legs.iter().filter(|l| l.state == "current").count();
            let reason = match m.state.as_str() {
                "rebuilding" => format!(
                    "volume {}: rebuilding leg {} {:.0}% ({} bytes left at {} bytes/s, ETA {}s)",
                    v.name,
                    leg.map_or(0, |l| l.slot),
                    m.percent,
                    m.remaining_bytes,
                    m.rate,
                    m.eta_secs.map_or("-".into(), |s| s.to_string())
                ),
                "resyncing" => format!(
                    "volume {}: resyncing {} bytes left out of sync by an unclean stop ({current} of {} copies current)",
                    v.name, m.out_of_sync_bytes, m.copies
                ),
                "no-current-copy" => format!(
                    "volume {}: {} regions have no usable current copy (first at byte {}): reads there wait; see docs/mirror.md",
                    v.name,
                    m.regions_without_current,
                    m.without_current_offsets.first().copied().unwrap_or(0)
                ),
                state => format!(
                    "volume {}: mirror {state}, {current} of {} copies current",
                    v.name, m.copies
                ),
            };
            let path = self.device_path(device);
            self.monitor.note(device, &path, "mirror", reason);
        }
    }

    /// A pool device's path, for an event ("" when it is gone from the pool).
    fn device_path(&self, uuid: Uuid) -> String {
        let devices = self.pool().devices();
        devices
            .into_iter()
            .find(|d| d.uuid == uuid)
            .map(|d| d.path)
            .unwrap_or_default()
    }
}
