//! Sending a volume to another host (`volume send`, docs/transfer.md): the copy there is one
//! more mirror leg, a *remote leg*, whose device is an NBD export (normally the destination
//! spoold's `volume receive`). The mirror's rebuild is the copy, every write reaches both
//! hosts before it completes, and a leg the link dropped is resynced from the write-intent
//! bitmap when its connection is back.
//!
//! Owns: the table side of a send (adding, resuming and removing the remote leg), the open
//! connections to remote legs ([`RemoteCache`]) and reconnecting them. Must not know: how
//! the mirror copies, the NBD protocol, who runs the volume.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use spool_devices::{Device, HealthState};
use uuid::Uuid;

use crate::metadata::{LegEntry, RemoteLeg, VolumeEntry};
use crate::mirror::MAX_COPIES;
use crate::{Error, Pool, Result, VolumeInfo};

/// The first wait before connecting again to a remote leg that could not be reached; it
/// doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// The back-off's cap for a leg whose copy was complete: the volume's requests wait for it
/// (see `LegSpec::far`), so the link is tried again often.
const REQUIRED_MAX_BACKOFF: Duration = Duration::from_secs(1);

/// How long a remote leg's connection must stay healthy for its loss to be reconnected at
/// once: one lost sooner (a server that shakes hands and then fails every request) waits
/// out a back-off that keeps growing, instead of a reconnect on every settler round.
const STABLE_FOR: Duration = Duration::from_secs(30);

/// A remote leg's connection, or when to try again.
pub(crate) enum Remote {
    /// Connected at `since`, after a wait of `backoff` (what the next one is if it is lost
    /// before [`STABLE_FOR`]).
    Open {
        dev: Arc<Device>,
        since: Instant,
        backoff: Duration,
    },
    /// A connect is under way ([`RemoteDue::connect`]), with the connection it replaces.
    Connecting(Option<Arc<Device>>),
    Unreachable {
        next: Instant,
        backoff: Duration,
        why: String,
    },
}

impl Remote {
    /// Connected now, by an operator's send (a first wait if it is lost soon).
    fn opened(dev: Arc<Device>) -> Remote {
        Remote::Open {
            dev,
            since: Instant::now(),
            backoff: FIRST_BACKOFF,
        }
    }

    fn healthy(&self) -> bool {
        matches!(self, Remote::Open { dev, .. } if dev.health().state() == HealthState::Healthy)
    }
}

/// The remote legs' devices by leg id.
pub(crate) type RemoteCache = HashMap<Uuid, Remote>;

/// A remote leg to connect again ([`Pool::remotes_due`]).
pub struct RemoteDue {
    /// The volume being sent.
    pub volume: String,
    leg: RemoteLeg,
    need: u64,
    backoff: Duration,
    /// The longest back-off for this leg.
    cap: Duration,
    links: Arc<Mutex<RemoteCache>>,
}

impl RemoteDue {
    /// Connects (without the pool's lock: an unreachable host may take the connect
    /// timeout); true when connected, and the volume's layout must then be published again
    /// for its queues to use the new connection. A failure waits out the back-off.
    pub fn connect(self) -> bool {
        let entry = match open_remote(&self.volume, &self.leg.uri, self.need) {
            Ok(dev) => {
                tracing::info!(volume = %self.volume, to = %self.leg.uri, "remote leg connected; resyncing what it missed");
                Remote::Open {
                    dev,
                    since: Instant::now(),
                    backoff: self.backoff,
                }
            }
            Err(e) => {
                tracing::debug!(volume = %self.volume, to = %self.leg.uri, error = %e, "remote leg unreachable");
                Remote::Unreachable {
                    next: Instant::now() + self.backoff,
                    backoff: (self.backoff * 2).min(self.cap),
                    why: e.to_string(),
                }
            }
        };
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        // A send cancelled or finished meanwhile has no entry to come back to: the new
        // connection is dropped with it.
        match links.get_mut(&self.leg.id) {
            Some(e @ Remote::Connecting(_)) => {
                let connected = matches!(entry, Remote::Open { .. });
                *e = entry;
                connected
            }
            _ => false,
        }
    }
}

impl Pool {
    /// Starts (or resumes) sending volume `id` to the NBD export `uri`: the export becomes a
    /// remote leg of the volume (a plain volume becomes a mirror), rebuilt online while the
    /// volume serves. Sending again to the same address reconnects and resumes from what
    /// the write-intent bitmap says the leg missed. An encrypted volume is sent as its
    /// ciphertext, only where the destination has its data key (`key_there`).
    pub fn send_volume(&mut self, id: &str, uri: &str, key_there: bool) -> Result<VolumeInfo> {
        if !spool_devices::is_nbd_uri(uri) {
            return Err(Error::InvalidArgument(format!(
                "'{uri}' is not an NBD URI: nbd://HOST[:PORT]/NAME or nbd+unix:///NAME?socket=PATH (nbds:// over TLS)"
            )));
        }
        let i = self.find(id)?;
        let v = self.table.volumes[i].clone();
        self.refuse_send(&v, key_there)?;
        if let Some(l) = v.remote_leg() {
            let r = l.remote.as_ref().expect("a remote leg");
            if r.uri != uri {
                return Err(Error::InvalidArgument(format!(
                    "volume '{}' is being sent to {} already; cancel that first (volume send {} --cancel)",
                    v.name, r.uri, v.name
                )));
            }
            let dev = open_remote(&v.name, uri, v.size)?;
            self.remote_cache().insert(r.id, Remote::opened(dev));
            tracing::info!(volume = %v.name, to = %uri, "volume send resumed");
            return Ok(self.volume_info(&v));
        }
        let mut v = v;
        let plain = !v.is_mirrored();
        v.make_mirrored();
        if v.legs.len() >= MAX_COPIES as usize {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' has {} copies, the most a volume has; remove one first (volume mirror {} remove)",
                v.name,
                v.legs.len(),
                v.name
            )));
        }
        let dev = open_remote(&v.name, uri, v.size)?;
        let slot = (0..MAX_COPIES)
            .find(|s| !v.legs.iter().any(|l| l.slot == *s))
            .expect("fewer legs than slots");
        let leg_id = Uuid::new_v4();
        v.legs.push(LegEntry {
            slot,
            synced: false,
            extents: Vec::new(),
            remote: Some(RemoteLeg {
                uri: uri.into(),
                id: leg_id,
            }),
            thin: None,
        });
        v.copies = v.copies.max(v.legs.len() as u8);
        if plain {
            if let Some(path) = self.bitmap_path(v.uuid) {
                let bytes = self.mirror_size(&v);
                spool_mirror::create_clean_bitmap(&path, bytes).map_err(|e| {
                    Error::InvalidArgument(format!(
                        "cannot create the write-intent bitmap {}: {e}",
                        path.display()
                    ))
                })?;
            }
        }
        self.remote_cache().insert(leg_id, Remote::opened(dev));
        let r = self.replace_volume(i, v, &[], &[]);
        if r.is_err() {
            self.remote_cache().remove(&leg_id);
        } else {
            tracing::info!(volume = %id, to = %uri, "volume send started: the copy on the other host is rebuilt online");
        }
        r
    }

    /// Ends sending volume `id`: its remote leg is removed (the volume here is as it was
    /// before the send; what the other host received stays there).
    pub fn cancel_send(&mut self, id: &str) -> Result<VolumeInfo> {
        let v = &self.table.volumes[self.find(id)?];
        let Some(l) = v.remote_leg() else {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' is not being sent anywhere",
                v.name
            )));
        };
        let (slot, leg_id) = (l.slot, l.remote.as_ref().expect("a remote leg").id);
        let info = self.remove_leg(id, Some(slot))?;
        self.remote_cache().remove(&leg_id);
        tracing::info!(volume = %id, "volume send ended: the remote leg is removed");
        Ok(info)
    }

    /// Whether volume `id`'s remote leg holds every write completed here: it was copied
    /// whole once (the table says so) and has missed nothing since (the write-intent
    /// bitmap says so: no region stale for it, none out of sync). Its link may be down: the
    /// other host stops taking writes once it serves the volume.
    pub fn send_complete(&mut self, id: &str) -> Result<bool> {
        self.settle_mirrors()?;
        let v = self.table.volumes[self.find(id)?].clone();
        let Some(slot) = v.remote_leg().filter(|l| l.synced).map(|l| l.slot) else {
            return Ok(false);
        };
        let p = self.open_mirror(&v)?.progress();
        let missed = p
            .legs
            .iter()
            .find(|l| l.slot == slot)
            .map(|l| l.stale_bytes);
        Ok(missed == Some(0) && p.out_of_sync_bytes == 0)
    }

    /// The remote legs to connect again now: not connected, or whose connection broke
    /// (their device left the healthy state: the link dropped, the other host's worker
    /// restarted), each at most once per back-off step. Connecting is left to the caller,
    /// outside the pool's lock ([`RemoteDue::connect`]).
    pub fn remotes_due(&self) -> Vec<RemoteDue> {
        let now = Instant::now();
        let mut cache = self.remote_cache();
        // Connections of legs the table no longer has (a send cancelled, finished, the leg
        // or the volume removed) are closed here.
        let legs: Vec<Uuid> = self
            .table
            .volumes
            .iter()
            .filter_map(|v| Some(v.remote_leg()?.remote.as_ref()?.id))
            .collect();
        cache.retain(|id, _| legs.contains(id));
        let mut due = Vec::new();
        for v in &self.table.volumes {
            let Some((leg, synced)) = v
                .remote_leg()
                .and_then(|l| Some((l.remote.clone()?, l.synced)))
            else {
                continue;
            };
            let cap = if synced {
                REQUIRED_MAX_BACKOFF
            } else {
                MAX_BACKOFF
            };
            let (backoff, was) = match cache.remove(&leg.id) {
                Some(e @ Remote::Open { .. }) if e.healthy() => {
                    cache.insert(leg.id, e);
                    continue;
                }
                // Lost soon after it connected: not again before a longer wait.
                Some(Remote::Open {
                    dev,
                    since,
                    backoff,
                    ..
                }) if now.duration_since(since) < STABLE_FOR => {
                    let backoff = (backoff * 2).min(cap).max(FIRST_BACKOFF);
                    let why = format!(
                        "link {} {:.1} s after connecting; connecting again in {:.1} s",
                        dev.health().state().name(),
                        now.duration_since(since).as_secs_f64(),
                        backoff.as_secs_f64()
                    );
                    tracing::debug!(volume = %v.name, to = %leg.uri, "{why}");
                    cache.insert(
                        leg.id,
                        Remote::Unreachable {
                            next: now + backoff,
                            backoff,
                            why,
                        },
                    );
                    continue;
                }
                Some(e @ Remote::Unreachable { next, .. }) if next > now => {
                    cache.insert(leg.id, e);
                    continue;
                }
                Some(e @ Remote::Connecting(_)) => {
                    cache.insert(leg.id, e);
                    continue;
                }
                Some(Remote::Unreachable { backoff, .. }) => (backoff.min(cap), None),
                Some(Remote::Open { dev, .. }) => (FIRST_BACKOFF, Some(dev)),
                None => (FIRST_BACKOFF, None),
            };
            cache.insert(leg.id, Remote::Connecting(was));
            due.push(RemoteDue {
                volume: v.name.clone(),
                leg,
                need: v.size,
                backoff,
                cap,
                links: self.remotes.clone(),
            });
        }
        due
    }

    /// The open device of remote leg `r` (`None`: not connected now).
    pub(crate) fn remote_device(&self, r: &RemoteLeg) -> Option<Arc<Device>> {
        match self.remote_cache().get(&r.id) {
            Some(Remote::Open { dev: d, .. }) | Some(Remote::Connecting(Some(d))) => {
                Some(d.clone())
            }
            _ => None,
        }
    }

    /// Why remote leg `r` is not connected, if it is not.
    pub fn remote_trouble(&self, r: &RemoteLeg) -> Option<String> {
        match self.remote_cache().get(&r.id) {
            Some(e @ Remote::Open { .. }) if e.healthy() => None,
            Some(Remote::Open { dev, .. }) => Some(format!("link {}", dev.health().state().name())),
            Some(Remote::Connecting(_)) => Some("connecting".into()),
            Some(Remote::Unreachable { why, .. }) => Some(why.clone()),
            None => Some("not connected yet".into()),
        }
    }

    /// Cuts the connections of remote leg `leg_id`, which is being removed (checked
    /// removable already): the copy may wait on a request the other host never answers,
    /// and so ends when the mirror is stopped (the leg is given up: what its writes do there
    /// no longer matters) instead of running on, and the stop does not hold the pool's lock
    /// for its 5 s.
    pub(crate) fn abort_remote(&self, leg_id: Uuid) {
        if let Some(Remote::Open { dev, .. } | Remote::Connecting(Some(dev))) =
            self.remote_cache().get(&leg_id)
        {
            dev.backend().abort();
        }
    }

    fn remote_cache(&self) -> std::sync::MutexGuard<'_, RemoteCache> {
        self.remotes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether volume `id` may be sent (before anything is asked of a destination): not on
    /// RBD, encrypted only when the destination has its data key (`key_there`: a
    /// transfer listener took it in the hello), and with room for one more copy unless it
    /// is sent already.
    pub fn check_sendable(&self, id: &str, key_there: bool) -> Result<()> {
        let v = &self.table.volumes[self.find(id)?];
        self.refuse_send(v, key_there)?;
        if v.remote_leg().is_none() && v.legs.len() >= MAX_COPIES as usize {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' has {} copies, the most a volume has; remove one first (volume mirror {} remove)",
                v.name,
                v.legs.len(),
                v.name
            )));
        }
        Ok(())
    }

    /// Refuses to drop remote leg `slot` of `v` while no local leg is current (holds every
    /// write, on a usable device; a write that failed here, such as a thin volume's that found
    /// the pool full, completed on the other host alone).
    pub(crate) fn check_remote_leg_removable(&self, v: &VolumeEntry, slot: u8) -> Result<()> {
        let Some(uri) = v
            .legs
            .iter()
            .find(|l| l.slot == slot)
            .and_then(|l| l.remote.as_ref())
        else {
            return Ok(());
        };
        self.check_copy_here_complete(v, &format!("dropping its copy on {}", uri.uri))
    }

    /// Refuses `what` on volume `v`, which has a copy on another host, while no leg here is
    /// current: the other host may then hold the only copy of some writes. A volume whose
    /// mirror cannot be opened is refused too (what it misses is not known), and so is a thin
    /// volume with chunks on an isolated device (its thin device still reads as current).
    pub(crate) fn check_copy_here_complete(&self, v: &VolumeEntry, what: &str) -> Result<()> {
        let progress = match self.open_mirror(v) {
            Ok(m) => m.progress(),
            Err(e) => {
                return Err(Error::InvalidArgument(format!(
                    "volume '{}': {what} is refused, since what its copy here misses cannot be told ({e}); bring the volume back first",
                    v.name
                )))
            }
        };
        let here = |l: &&spool_mirror::LegProgress| {
            v.legs
                .iter()
                .any(|e| e.slot == l.slot && e.remote.is_none())
        };
        let lost = v.thin.is_some()
            && (self.members.iter()).any(|m| m.isolated() && self.thin_chunks_on(v, m.uuid));
        if !lost
            && progress
                .legs
                .iter()
                .filter(here)
                .any(|l| l.state == "current")
        {
            return Ok(());
        }
        let legs: Vec<String> = progress
            .legs
            .iter()
            .filter(here)
            .map(|l| format!("leg {} {}, {} bytes stale", l.slot, l.state, l.stale_bytes))
            .collect();
        Err(Error::InvalidArgument(format!(
            "volume '{}' has no current copy here ({}): its copy on another host may hold the only copy of some writes, and {what} now would lose them; wait until the copy here is current again (rebuilt from there), or finish the send",
            v.name,
            legs.join("; ")
        )))
    }

    /// What a send cannot carry, refused with the reason.
    fn refuse_send(&self, v: &VolumeEntry, key_there: bool) -> Result<()> {
        let why = if v.rbd.is_some() {
            Some("it is an RBD image: every host of the cluster reaches it already")
        } else if v.is_mirrored_thin() {
            Some("it is a mirrored thin volume, which cannot be sent yet")
        } else if v.encryption.is_some() && !key_there && v.remote_leg().is_none() {
            Some("it is encrypted, and an export given by hand has no data key for its ciphertext: send it through the destination's transfer listener (--to HOST:PORT --token T), which creates it there under the same data key")
        } else {
            None
        };
        match why {
            Some(why) => Err(Error::InvalidArgument(format!(
                "volume '{}' cannot be sent: {why}",
                v.name
            ))),
            None => Ok(()),
        }
    }
}

/// Connects to `uri` as the remote leg of volume `name`: it must take writes and hold all
/// of the volume (`need` bytes: its size).
fn open_remote(name: &str, uri: &str, need: u64) -> Result<Arc<Device>> {
    let dev = Device::open(std::path::Path::new(uri), &Default::default())
        .map_err(|e| Error::InvalidArgument(format!("cannot reach the destination {uri}: {e}")))?;
    if dev.size() < need {
        return Err(Error::InvalidArgument(format!(
            "the destination {uri} holds {} bytes; volume '{name}' needs {need} (its size): create the volume there with at least that size",
            dev.size()
        )));
    }
    Ok(Arc::new(dev))
}
