//! Replacing a device (the `device_replace` method and the spare watcher share it), and the
//! spare watcher that replaces an isolated device with a configured spare as soon as one is
//! present (hot-plug pick-up).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use spool_pool::{DeviceSpec, Replacement};

use super::Daemon;

impl Daemon {
    /// Starts the spare watcher (only when spares are configured).
    pub(super) fn start_spare_watcher(self: &Arc<Self>) {
        if self.cfg.health.spares.is_empty() {
            return;
        }
        let weak: Weak<Daemon> = Arc::downgrade(self);
        let _ = std::thread::Builder::new()
            .name("spool-spares".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(100));
                let Some(d) = weak.upgrade() else { return };
                if d.stopping.load(Ordering::Acquire) {
                    return;
                }
                d.use_spares();
            });
    }

    /// Replaces every isolated device with the first present, unused spare.
    fn use_spares(&self) {
        let isolated: Vec<_> = self
            .pool()
            .device_handles()
            .into_iter()
            .filter(|(_, dev)| dev.health().state().isolated())
            .collect();
        for (uuid, _) in isolated {
            let Some(spare) = self.take_spare() else {
                return;
            };
            match self.replace(&uuid.to_string(), spare.clone(), None, false) {
                Ok(r) => {
                    tracing::warn!(old = %uuid, spare = %spare.display(), volumes = ?r.volumes, "isolated device replaced by a spare")
                }
                Err(e) => {
                    tracing::error!(old = %uuid, spare = %spare.display(), "spare not usable: {e}")
                }
            }
        }
    }

    /// The first configured spare that is present and not tried yet, marked as tried.
    fn take_spare(&self) -> Option<PathBuf> {
        let mut used = self.spares_used.lock().unwrap_or_else(|p| p.into_inner());
        let spare = self
            .cfg
            .health
            .spares
            .iter()
            .find(|p| p.exists() && !used.contains(*p))
            .cloned()?;
        used.push(spare.clone());
        Some(spare)
    }

    /// Replaces `old` with the device at `path` and brings its volumes back online.
    pub(super) fn replace(
        &self,
        old: &str,
        path: PathBuf,
        create_size: Option<u64>,
        force: bool,
    ) -> Result<Replacement, spool_pool::Error> {
        let (rep, layouts, handle) = {
            let mut pool = self.pool();
            let spec = DeviceSpec {
                path,
                create_size,
                null: None,
            };
            let rep = pool.replace_device(old, &spec, force)?;
            let layouts: Vec<_> = pool
                .volumes()
                .into_iter()
                .filter(|v| rep.volumes.contains(&v.name))
                .map(|v| {
                    let l = pool.layout(&v.uuid.to_string());
                    // A mirrored thin copy made anew: its old map is held until the
                    // queues are off it.
                    let ticket = pool.retired_ticket(v.uuid);
                    (v, l, ticket)
                })
                .collect();
            let handle = pool
                .device_handles()
                .into_iter()
                .find(|(u, _)| *u == rep.new.uuid)
                .map(|(_, h)| h);
            (rep, layouts, handle)
        };
        if let Some(h) = handle {
            self.monitor.replace(rep.old, rep.new.uuid, h);
        }
        for (v, layout, ticket) in layouts {
            let layout = match layout {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(volume = %v.name, "no layout after replacement: {e}");
                    // What the queues hold goes once they are off it (or at once).
                    let ctx = self.servers().get(&v.uuid).map(|s| s.context().clone());
                    self.hold_retired(v.uuid, ticket, ctx);
                    continue;
                }
            };
            let servers = self.servers();
            match servers.get(&v.uuid) {
                Some(s) => {
                    s.context().update_layout(layout);
                    // Reopens the device queues on the new layout and resubmits what the
                    // journal says is in flight.
                    s.device_reset();
                    let ctx = s.context().clone();
                    drop(servers);
                    self.hold_retired(v.uuid, ticket, Some(ctx));
                }
                None => {
                    drop(servers);
                    // Nothing served it: no queue holds an older layout.
                    self.hold_retired(v.uuid, ticket, None);
                    if let Err(e) = self.serve(&v) {
                        tracing::error!(volume = %v.name, "not served after replacement: {e}");
                    }
                }
            }
        }
        Ok(rep)
    }
}
