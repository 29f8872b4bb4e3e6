//! The daemon methods: `daemon_status` (worker, keeper, restart phases) and `daemon_upgrade`
//! (handed to the keeper, which answers on the caller's connection).

use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;

use super::Daemon;
use crate::api::{self, KeeperStatus, NoParams, Status, UpgradeParams};
use crate::kept::StateFormat;
use crate::rpc::{Call, MethodTable, RpcError};
use crate::wire::ToWire;

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::DaemonStatus>(Daemon::status)
        .register_deferred::<api::DaemonUpgrade>(Daemon::upgrade);
}

impl Daemon {
    fn status(&self, _: NoParams) -> Result<Status, RpcError> {
        Ok(self.status_now())
    }

    /// The worker's and keeper's status, restart phases, state formats.
    pub(super) fn status_now(&self) -> Status {
        let info = self.keeping.as_ref().map(|k| k.restored().info.clone());
        let first_io_ms = info.as_ref().and_then(|i| {
            let t = self.settings.clock.first_completion()?;
            let us = t.duration_since(std::time::UNIX_EPOCH).ok()?.as_micros() as u64;
            (i.restart_began_us > 0 && i.reason != "first-start")
                .then(|| us.saturating_sub(i.restart_began_us) as f64 / 1e3)
        });
        Status {
            pid: std::process::id(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            binary: std::env::current_exe()
                .ok()
                .map(|p| p.display().to_string()),
            keeper: info.map(|i| KeeperStatus {
                pid: i.keeper_pid,
                generation: i.generation,
                start_reason: i.reason,
            }),
            start_phases: self.start_phases().into_iter().map(ToWire::wire).collect(),
            first_io_after_restart_ms: first_io_ms,
            last_restart: self
                .keeper()
                .and_then(|l| l.last_report())
                .map(ToWire::wire),
            state_format: StateFormat::current().wire(),
        }
    }

    /// Asks the keeper to replace this worker with `binary` (default: the same binary); the
    /// keeper answers on the call's connection when the new worker serves or rolls back.
    fn upgrade(&self, p: UpgradeParams, call: &Call<'_>) -> Result<(), RpcError> {
        let Some(link) = self.keeper() else {
            return Err(RpcError::NoKeeper);
        };
        let binary = match p.binary {
            Some(b) => {
                let b = std::path::absolute(&b).unwrap_or(b);
                let meta = std::fs::metadata(&b)
                    .map_err(|e| RpcError::InvalidParams(format!("binary {}: {e}", b.display())))?;
                if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
                    return Err(RpcError::InvalidParams(format!(
                        "binary {} is not an executable file",
                        b.display()
                    )));
                }
                Some(b.display().to_string())
            }
            None => None,
        };
        link.upgrade(binary, call.id.clone(), call.conn.map(|c| c.as_raw_fd()))
            .map_err(RpcError::Keeper)
    }
}
