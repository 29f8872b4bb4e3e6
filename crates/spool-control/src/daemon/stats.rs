//! The I/O statistics methods: `volume_stats` (each served volume's counters, as the queue
//! workers count them) and the snapshot the metrics endpoint renders.

use std::collections::HashMap;
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use spool_frontend::stats::QueueState;
use uuid::Uuid;

use super::Daemon;
use crate::api::{self, VolumeStatsParams};
use crate::kept::METRICS_LISTEN_KEY;
use crate::metrics::{self, Snapshot};
use crate::rpc::{MethodTable, RpcError};

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::VolumeStatsGet>(Daemon::volume_stats);
}

impl Daemon {
    fn volume_stats(&self, p: VolumeStatsParams) -> Result<Vec<api::VolumeStats>, RpcError> {
        let only = match &p.id {
            Some(id) => Some(self.pool().volume(id)?.uuid),
            None => None,
        };
        let uptime_s = self.started.elapsed().as_secs_f64();
        Ok(self
            .servers()
            .iter()
            .filter(|(u, _)| only.is_none_or(|o| o == **u))
            .map(|(u, s)| {
                let ctx = s.context();
                crate::wire::volume_stats(
                    ctx.name().to_string(),
                    *u,
                    ctx.num_queues(),
                    &ctx.stats().snapshot(),
                    uptime_s,
                )
            })
            .collect())
    }

    /// Starts the metrics endpoint if the config asks for one: on the listening socket the
    /// previous worker kept (a restart drops no scrape target), or a new one, kept with the
    /// keeper for the next worker.
    pub fn serve_metrics(self: &Arc<Self>) -> std::io::Result<()> {
        let Some(addr) = self.cfg.metrics_listen else {
            return Ok(());
        };
        let kept = self
            .keeping
            .as_ref()
            .and_then(|k| k.take(METRICS_LISTEN_KEY))
            .and_then(|(_, f)| f.into_iter().next())
            .map(|f| TcpListener::from(std::os::fd::OwnedFd::from(f)))
            .filter(|l| l.local_addr().is_ok_and(|a| a == addr));
        let listener = match kept {
            Some(l) => l,
            None => TcpListener::bind(addr)?,
        };
        if let Some(s) = &self.store {
            if let Err(e) = s.put(METRICS_LISTEN_KEY, "{}".into(), &[listener.as_raw_fd()]) {
                tracing::error!("cannot deposit the metrics socket with the keeper: {e}");
            }
        }
        let weak = Arc::downgrade(self);
        metrics::serve(listener, move || {
            let d = weak.upgrade()?;
            (!d.stopping.load(std::sync::atomic::Ordering::Acquire)).then(|| d.metrics_snapshot())
        })?;
        tracing::info!(%addr, "metrics endpoint: http://{addr}/metrics");
        Ok(())
    }

    /// The worker's side of the keeper's watchdog: every `alive_every_ms` the keeper asked
    /// for, `Alive` while every running queue thread keeps counting poll rounds (or sleeps);
    /// a queue thread stuck for two periods stops the reports (logged), and the keeper
    /// restarts the worker.
    pub fn start_progress_reports(self: &Arc<Self>) {
        let Some(k) = &self.keeping else { return };
        let every = Duration::from_millis(k.restored().info.alive_every_ms);
        if every.is_zero() {
            return;
        }
        let link = k.link.clone();
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("progress".into())
            .spawn(move || {
                let mut seen = HashMap::new();
                let mut logged = false;
                loop {
                    std::thread::sleep(every);
                    let Some(d) = weak.upgrade() else { return };
                    if d.stopping.load(Ordering::Acquire) {
                        return;
                    }
                    let stuck = d.stuck_queues(&mut seen, 2 * every);
                    if stuck.is_empty() {
                        let _ = link.alive();
                        logged = false;
                    } else if !logged {
                        tracing::error!(queues = %stuck.join(", "), "queue threads made no progress for {} ms: no longer telling the keeper this worker is alive (it will be restarted)", (2 * every).as_millis());
                        logged = true;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start the progress reports (worker watchdog): {e}");
        }
    }

    /// Queues ("q<N>-<volume>") whose running worker thread counted no poll round for `limit`.
    fn stuck_queues(
        &self,
        seen: &mut HashMap<(Uuid, usize), (u64, Instant)>,
        limit: Duration,
    ) -> Vec<String> {
        let now = Instant::now();
        let mut stuck = Vec::new();
        for (uuid, server) in self.servers().iter() {
            let ctx = server.context();
            for (i, (state, rounds)) in ctx.stats().heartbeats().into_iter().enumerate() {
                let last = seen.entry((*uuid, i)).or_insert((rounds, now));
                if state != QueueState::Running || rounds != last.0 {
                    *last = (rounds, now);
                } else if now.duration_since(last.1) > limit {
                    stuck.push(format!("q{i}-{}", ctx.name()));
                }
            }
        }
        stuck
    }

    /// What the metrics endpoint shows: every volume's counters, every device's health, the
    /// worker and keeper status.
    pub(crate) fn metrics_snapshot(&self) -> Snapshot {
        let volumes = self
            .volume_stats(VolumeStatsParams::default())
            .unwrap_or_default();
        let devices = self
            .monitor
            .reports()
            .into_iter()
            .map(|r| crate::wire::health_report(r, None))
            .collect();
        Snapshot {
            volumes,
            devices,
            status: self.status_now(),
            space: self.space(),
            replication: self.replication(),
        }
    }
}
