//! The I/O statistics methods: `volume_stats` (each served volume's counters, as the queue
//! workers count them) and the snapshot the metrics endpoint renders.

use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::sync::Arc;

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
                api::VolumeStats::new(
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
            .map(|r| api::DeviceHealthReport::new(r, None))
            .collect();
        Snapshot {
            volumes,
            devices,
            status: self.status_now(),
        }
    }
}
