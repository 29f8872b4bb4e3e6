//! `volume_send` (docs/transfer.md): a volume's copy on another host, kept as a remote
//! mirror leg on that host's NBD export (normally its spoold's `volume receive`). The
//! mirror's rebuild is the copy; every write completes only once both hosts have it, so
//! when the VM's migration stops the rings here, the other host holds every write. The
//! mirror settler connects a remote leg again after its link dropped (or this worker
//! restarted), and the rebuild then carries over what the write-intent bitmap says it
//! missed.
//!
//! Owns: the RPC, how a send stands ([`SendInfo`]), reconnecting. Must not know: the NBD
//! protocol, how the mirror copies.

use std::collections::HashMap;

use spool_pool::VolumeInfo;
use uuid::Uuid;

use super::Daemon;
use crate::api::{self, SendInfo, SendParams};
use crate::rpc::{MethodTable, RpcError};

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::VolumeSend>(Daemon::volume_send);
}

impl Daemon {
    fn volume_send(&self, p: SendParams) -> Result<SendInfo, RpcError> {
        let flags = [p.to.is_some(), p.cancel, p.finish];
        if flags.iter().filter(|f| **f).count() > 1 {
            return Err(RpcError::InvalidParams(
                "give one of to, cancel and finish".into(),
            ));
        }
        if p.replica && p.token.is_none() {
            return Err(RpcError::InvalidParams(
                "a replica goes through the destination's transfer listener: give to (HOST:PORT) and token".into(),
            ));
        }
        if p.token.is_some() && p.to.is_none() {
            return Err(RpcError::InvalidParams(
                "a token goes with to (the destination's transfer listener, HOST:PORT)".into(),
            ));
        }
        if let Some(to) = &p.to {
            // Through the destination's transfer listener: its answer is the export.
            let to = match &p.token {
                Some(token) => {
                    // Refused here before the destination creates anything.
                    let v = {
                        let pool = self.pool();
                        pool.check_sendable(&p.id, true)?;
                        pool.volume(&p.id)?
                    };
                    let kind = match p.replica {
                        true => super::hello::HelloKind::Replicate,
                        false => super::hello::HelloKind::Send,
                    };
                    self.say_hello(to, token, &v, kind)?
                }
                None => to.clone(),
            };
            // Through the listener, the hello gave the destination the data key.
            let key_there = p.token.is_some();
            let v = self.pool().send_volume(&p.id, &to, key_there)?;
            self.republish(&v);
            if let (true, Some(listener), Some(token)) = (p.replica, &p.to, &p.token) {
                self.remember_replication(&v, listener, token);
            }
            return self.send_info(&p.id, None);
        }
        if p.cancel {
            let before = self.send_info(&p.id, None)?;
            if before.state == "fenced" {
                return Err(RpcError::InvalidParams(format!(
                    "volume '{}' was promoted on {}: cancelling would let its writes complete here again, making this host a second primary; its copy there is the volume now (delete this one once its VM is stopped)",
                    before.volume, before.to
                )));
            }
            let v = self.pool().cancel_send(&p.id)?;
            self.republish(&v);
            return Ok(SendInfo {
                state: "cancelled".into(),
                ..before
            });
        }
        if p.finish {
            return self.finish_send(&p.id);
        }
        self.send_info(&p.id, None)
    }

    /// Deletes the volume here once its copy there is complete and no frontend runs it
    /// (the VM has moved).
    fn finish_send(&self, id: &str) -> Result<SendInfo, RpcError> {
        let info = self.send_info(id, None)?;
        // A thin volume's snapshots stay here (the copy there has none): finishing would
        // delete them with the volume.
        let snapshots = self.pool().snapshots(id).map_or(0, |s| s.len());
        if snapshots > 0 {
            return Err(RpcError::InvalidParams(format!(
                "volume '{}' has {snapshots} snapshot(s) here, which its copy on {} does not have: finishing would delete them with the volume; delete them first (volume snapshot delete), or cancel the send",
                info.volume, info.to
            )));
        }
        if !self.pool().send_complete(id)? {
            return Err(RpcError::InvalidParams(format!(
                "the copy of volume '{}' on {} is not complete yet ({} bytes left): finishing now would lose data; wait, or cancel the send",
                info.volume, info.to, info.remaining_bytes
            )));
        }
        self.volume_delete(api::VolumeDeleteParams {
            id: id.into(),
            force: false,
            remove_image: false,
        })?;
        tracing::info!(volume = %info.volume, to = %info.to, "volume send finished: the volume here is deleted");
        Ok(SendInfo {
            state: "finished".into(),
            ..info
        })
    }

    /// How sending volume `id` stands (`v`: its info, when the caller has it).
    fn send_info(&self, id: &str, v: Option<VolumeInfo>) -> Result<SendInfo, RpcError> {
        let v = match v {
            Some(v) => v,
            None => self.pool().volume(id)?,
        };
        self.sending(&v).ok_or_else(|| {
            RpcError::InvalidParams(format!(
                "volume '{}' is not being sent anywhere (volume send {} --to URI)",
                v.name, v.name
            ))
        })
    }

    /// How sending volume `v` stands, if it is being sent (for `volume show` too). Takes
    /// the pool's lock.
    pub(super) fn sending(&self, v: &VolumeInfo) -> Option<SendInfo> {
        let leg = v.legs.iter().find(|l| l.remote.is_some())?;
        let to = leg.remote.clone()?;
        let status = self.volume_view_mirror(v);
        let here = status
            .as_ref()
            .and_then(|m| m.legs.iter().find(|l| l.slot == leg.slot));
        let cut_off = leg.remote_trouble.is_some()
            || here.is_some_and(|l| matches!(l.state.as_str(), "missing" | "unusable"));
        let mirror = self.pool().mirror(&v.uuid.to_string());
        let fenced = mirror.ok().flatten().is_some_and(|m| m.fenced());
        let state = match (&leg.remote_trouble, here.map(|l| l.state.as_str())) {
            _ if fenced => "fenced",
            _ if cut_off && here.is_some_and(|l| l.required) => "waiting",
            (Some(_), _) => "disconnected",
            // Current once required too: from then on no write completes without it.
            (None, Some("current")) if here.is_some_and(|l| l.required) => "current",
            _ => "copying",
        };
        let m = status.as_ref();
        Some(SendInfo {
            volume: v.name.clone(),
            to,
            state: state.into(),
            synced: leg.synced,
            remaining_bytes: here.map_or(0, |l| l.stale_bytes),
            copied_bytes: m.map_or(0, |m| m.copied_bytes),
            rate: m.map_or(0, |m| m.rate),
            eta_secs: m.and_then(|m| m.eta_secs),
            trouble: leg.remote_trouble.clone(),
        })
    }

    /// Records a health event (kind `send`) when a send of a served volume changes state
    /// (copying, current, disconnected) and at every quarter of a copy; `seen` holds each
    /// volume's last (state, quarter). The event's device is the volume's UUID, its path
    /// the destination's URI.
    pub(super) fn report_sends(&self, seen: &mut HashMap<Uuid, (String, u8)>) {
        let volumes = self.pool().volumes();
        let mut sending = Vec::new();
        for v in volumes {
            if let Some(s) = self.sending(&v) {
                sending.push((v, s));
            }
        }
        seen.retain(|u, _| sending.iter().any(|(v, _)| v.uuid == *u));
        (self.last_current.lock().unwrap_or_else(|p| p.into_inner()))
            .retain(|u, _| sending.iter().any(|(v, _)| v.uuid == *u));
        for (v, s) in sending {
            if s.state == "current" {
                self.seen_current(&v);
            }
            if !self.servers().contains_key(&v.uuid) {
                continue;
            }
            let done = 100 - (s.remaining_bytes.min(v.size) * 100 / v.size.max(1)) as u8;
            let now = (
                s.state.clone(),
                if s.state == "copying" { done / 25 } else { 0 },
            );
            if seen.insert(v.uuid, now.clone()).as_ref() == Some(&now) {
                continue;
            }
            self.monitor
                .note(v.uuid, &s.to, "send", format!("volume {}", line_of(&s)));
        }
    }

    /// Connects again the remote legs whose link dropped (from the mirror settler), and
    /// publishes the volumes' layouts with the new connections.
    pub(super) fn reconnect_remotes(&self) {
        let due = self.pool().remotes_due();
        for d in due {
            let name = d.volume.clone();
            if d.connect() {
                // Not in the match: its guard would hold the pool's lock through republish.
                let v = self.pool().volume(&name);
                match v {
                    Ok(v) => self.republish(&v),
                    Err(e) => tracing::warn!(volume = %name, "remote leg connected: {e}"),
                }
            }
        }
    }
}

/// How a send stands, in words (the event's reason).
fn line_of(s: &SendInfo) -> String {
    match s.state.as_str() {
        "copying" => format!(
            "{}: copying to {}, {} bytes left",
            s.volume, s.to, s.remaining_bytes
        ),
        "disconnected" => format!(
            "{}: the link to {} is down ({}); {} bytes to copy when it is back",
            s.volume,
            s.to,
            s.trouble.as_deref().unwrap_or("no link"),
            s.remaining_bytes
        ),
        "waiting" => format!(
            "{}: the link to {} is down ({}) and the copy there was current: the volume's I/O \
             waits until it is back (or volume send {} --cancel)",
            s.volume,
            s.to,
            s.trouble.as_deref().unwrap_or("no link"),
            s.volume
        ),
        "fenced" => format!(
            "{}: the copy on {} was promoted there: fenced off, its writes fail here",
            s.volume, s.to
        ),
        state => format!("{}: {state} on {}", s.volume, s.to),
    }
}
