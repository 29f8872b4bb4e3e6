//! The pool and device methods: `pool_show`, `pool_check`, `device_list`, `device_add`, and the failure
//! handling ones over the health monitor (`device_reset`, `device_health`, `events_list`,
//! `device_replace`, `device_inject`, `device_faults`, `device_clear_faults`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use spool_devices::{Device, HealthState};
use spool_pool::DeviceSpec;
use uuid::Uuid;

use super::volumes::opt_size;
use super::Daemon;
use crate::api::{self, IdParams, NoParams};
use crate::rpc::{MethodTable, RpcError};
use crate::wire::{self, ToWire};

pub(super) fn register(t: &mut MethodTable<Daemon>) {
    t.register::<api::PoolShow>(Daemon::pool_show)
        .register::<api::PoolCheck>(Daemon::pool_check)
        .register::<api::DeviceList>(Daemon::device_list)
        .register::<api::DeviceAdd>(Daemon::device_add)
        .register::<api::DeviceReset>(Daemon::device_reset)
        .register::<api::DeviceHealth>(Daemon::device_health)
        .register::<api::EventsList>(Daemon::events_list)
        .register::<api::DeviceReplace>(Daemon::device_replace)
        .register::<api::DeviceInject>(Daemon::device_inject)
        .register::<api::DeviceFaults>(Daemon::device_faults)
        .register::<api::DeviceClearFaults>(Daemon::device_clear_faults);
}

impl Daemon {
    fn pool_show(&self, _: NoParams) -> Result<api::PoolInfo, RpcError> {
        Ok(self.pool().info().wire())
    }

    /// `pool check`: reads every thin map from the devices under the pool lock (a few KiB
    /// per GiB of thin volume), so volume changes wait for it.
    fn pool_check(&self, _: NoParams) -> Result<api::CheckReport, RpcError> {
        Ok(self.pool().check().wire())
    }

    fn device_list(&self, _: NoParams) -> Result<Vec<api::DeviceInfo>, RpcError> {
        Ok(self
            .pool()
            .devices()
            .into_iter()
            .map(ToWire::wire)
            .collect())
    }

    fn device_add(&self, p: api::DeviceAddParams) -> Result<api::DeviceInfo, RpcError> {
        let create_size = opt_size(p.create_size, "create_size")?;
        let spec = DeviceSpec {
            path: p.path,
            create_size,
            null: None,
        };
        Ok(self.pool().add_device(&spec, p.force)?.wire())
    }

    /// A controller reset: hold the device's I/O, probe it, resume; and resubmit, from the
    /// journal, everything in flight on every volume that lives on it.
    fn device_reset(&self, p: IdParams) -> Result<api::DeviceResetResult, RpcError> {
        let uuid = self.pool().device_uuid(&p.id)?;
        let dev = self.device_handle(uuid)?;
        if dev.health().state() == HealthState::Healthy {
            self.monitor
                .request_reset(uuid, "operator")
                .map_err(|e| RpcError::Health(e.to_string()))?;
        }
        let vols: Vec<_> = self
            .pool()
            .volumes()
            .into_iter()
            .filter(|v| v.devices.contains(&uuid))
            .collect();
        let servers = self.servers();
        for v in &vols {
            if let Some(s) = servers.get(&v.uuid) {
                s.device_reset();
            }
        }
        Ok(api::DeviceResetResult {
            device: uuid,
            volumes: vols.into_iter().map(|v| v.name).collect(),
        })
    }

    fn device_health(
        &self,
        p: api::DeviceHealthParams,
    ) -> Result<Vec<api::DeviceHealthReport>, RpcError> {
        let only = match &p.id {
            Some(id) => Some(self.pool().device_uuid(id)?),
            None => None,
        };
        let reports: Vec<_> = self
            .monitor
            .reports()
            .into_iter()
            .filter(|r| only.is_none_or(|u| u == r.device))
            .collect();
        let handles = self.pool().device_handles();
        Ok(reports
            .into_iter()
            .map(|r| {
                let nvme = handles
                    .iter()
                    .find(|(u, _)| *u == r.device)
                    .and_then(|(_, d)| d.controller_status());
                wire::health_report(r, nvme)
            })
            .collect())
    }

    /// Events after `since`; waits (at most 30 s) for one when there is none yet.
    fn events_list(&self, p: api::EventsParams) -> Result<api::EventsResult, RpcError> {
        let deadline = Instant::now() + Duration::from_millis(p.wait_ms.min(30_000));
        loop {
            let (events, last) = self.monitor.events(p.since);
            if !events.is_empty() || Instant::now() >= deadline {
                let events = events.iter().filter_map(wire::health_event).collect();
                return Ok(api::EventsResult { events, last });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn device_replace(&self, p: api::DeviceReplaceParams) -> Result<api::Replacement, RpcError> {
        let create_size = opt_size(p.create_size, "create_size")?;
        Ok(self.replace(&p.old, p.new, create_size, p.force)?.wire())
    }

    fn device_inject(&self, p: api::InjectParams) -> Result<api::InjectResult, RpcError> {
        let uuid = self.pool().device_uuid(&p.id)?;
        let dev = self.device_handle(uuid)?;
        if api::FaultKind::parse(&p.kind) == Some(api::FaultKind::Smart) {
            let bits = p.bits.ok_or_else(crate::faults::smart_needs_bits)?;
            dev.faults().set_smart_warning(bits);
            return Ok(api::InjectResult {
                device: uuid,
                rule: None,
                smart_critical_warning: Some(bits),
            });
        }
        let rule = crate::faults::rule_of(&p, dev.size())?;
        let id = dev.faults().add(rule.clone());
        tracing::warn!(device = %uuid, kind = %p.kind, id, "fault injected");
        Ok(api::InjectResult {
            device: uuid,
            rule: Some(wire::fault_rule(id, &rule, 0, rule.count)),
            smart_critical_warning: None,
        })
    }

    fn device_faults(&self, p: IdParams) -> Result<api::FaultsResult, RpcError> {
        let uuid = self.pool().device_uuid(&p.id)?;
        let dev = self.device_handle(uuid)?;
        let rules = dev.faults().list();
        Ok(api::FaultsResult {
            device: uuid,
            rules: rules
                .iter()
                .map(|f| wire::fault_rule(f.id, &f.rule, f.hits, f.remaining))
                .collect(),
            smart_critical_warning: dev.faults().smart_warning(),
        })
    }

    fn device_clear_faults(&self, p: IdParams) -> Result<api::ClearFaultsResult, RpcError> {
        let uuid = self.pool().device_uuid(&p.id)?;
        let cleared = self.device_handle(uuid)?.faults().clear();
        tracing::info!(device = %uuid, rules = cleared, "injected faults cleared");
        Ok(api::ClearFaultsResult {
            device: uuid,
            cleared,
        })
    }

    /// The open device `uuid`.
    fn device_handle(&self, uuid: Uuid) -> Result<Arc<Device>, RpcError> {
        self.pool()
            .device_handles()
            .into_iter()
            .find(|(u, _)| *u == uuid)
            .map(|(_, d)| d)
            .ok_or(RpcError::NotPresent(uuid))
    }
}
