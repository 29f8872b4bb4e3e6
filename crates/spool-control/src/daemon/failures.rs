//! The daemon's side of failure handling: the RPC methods over the health monitor (health,
//! events, fault injection, reset, replace) and the spare watcher that replaces an isolated
//! device with a configured spare as soon as one is present (hot-plug pick-up).

use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};
use spool_devices::{FaultEffect, FaultOps, FaultRule, HealthState};
use spool_pool::{DeviceSpec, Replacement};

use super::{opt_size, params_of, size_arg, Daemon, IdParam};
use crate::config::SizeValue;
use crate::rpc::RpcError;

/// `device_inject` parameters.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Inject {
    id: String,
    /// media | transient | link-down | timeout | removed | errno | smart
    kind: String,
    /// read | write | any (default any)
    op: Option<String>,
    offset: Option<SizeValue>,
    len: Option<SizeValue>,
    /// Operations it hits before it disarms (0 = until cleared).
    count: Option<u64>,
    duration_ms: Option<u64>,
    /// For kind = errno: the errno (a number or a name such as EIO).
    errno: Option<Value>,
    /// For kind = smart: the critical-warning byte.
    bits: Option<u8>,
}

fn errno_of(v: &Value) -> Result<i32, RpcError> {
    if let Some(n) = v.as_i64() {
        if (1..4096).contains(&n) {
            return Ok(n as i32);
        }
    }
    let named = [
        ("EIO", libc::EIO),
        ("ENODATA", libc::ENODATA),
        ("EILSEQ", libc::EILSEQ),
        ("ENOLINK", libc::ENOLINK),
        ("ETIMEDOUT", libc::ETIMEDOUT),
        ("ENODEV", libc::ENODEV),
        ("ENXIO", libc::ENXIO),
        ("ENOSPC", libc::ENOSPC),
        ("EINVAL", libc::EINVAL),
        ("EREMOTEIO", libc::EREMOTEIO),
    ];
    v.as_str()
        .and_then(|s| named.iter().find(|(n, _)| n.eq_ignore_ascii_case(s)))
        .map(|(_, e)| *e)
        .ok_or_else(|| {
            RpcError::invalid_params(format!(
                "errno {v} must be a number 1..4095 or one of {}",
                named.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ))
        })
}

fn rule_json(id: u64, r: &FaultRule, hits: u64, remaining: Option<u64>) -> Value {
    json!({
        "id": id,
        "effect": match r.effect {
            FaultEffect::Errno(e) => format!("errno {e} ({})", std::io::Error::from_raw_os_error(e)),
            FaultEffect::Hang => "hang".into(),
            FaultEffect::Stuck => "stuck".into(),
            FaultEffect::Crash => "crash".into(),
        },
        "op": match r.ops { FaultOps::Read => "read", FaultOps::Write => "write", FaultOps::Any => "any" },
        "offset": r.offset,
        "len": r.len,
        "count": r.count,
        "remaining": remaining,
        "duration_ms": r.duration.map(|d| d.as_millis() as u64),
        "fails_probe": r.fails_probe,
        "hits": hits,
    })
}

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
                if d.stopping.load(std::sync::atomic::Ordering::Acquire) {
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
            let spare = {
                let used = self.spares_used.lock().unwrap_or_else(|p| p.into_inner());
                self.cfg
                    .health
                    .spares
                    .iter()
                    .find(|p| p.exists() && !used.contains(*p))
                    .cloned()
            };
            let Some(spare) = spare else { return };
            self.spares_used
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(spare.clone());
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

    /// Replaces `old` with the device at `path` and brings its volumes back online.
    fn replace(
        &self,
        old: &str,
        path: PathBuf,
        create_size: Option<u64>,
        force: bool,
    ) -> Result<Replacement, String> {
        let (rep, layouts, handle) = {
            let mut pool = self.pool();
            let rep = pool
                .replace_device(
                    old,
                    &DeviceSpec {
                        path,
                        create_size,
                        null: None,
                    },
                    force,
                )
                .map_err(|e| e.to_string())?;
            let layouts: Vec<_> = pool
                .volumes()
                .into_iter()
                .filter(|v| rep.volumes.contains(&v.name))
                .map(|v| {
                    let l = pool.layout(&v.uuid.to_string());
                    (v, l)
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
        for (v, layout) in layouts {
            let layout = match layout {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(volume = %v.name, "no layout after replacement: {e}");
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
                }
                None => {
                    drop(servers);
                    if let Err(e) = self.serve(&v) {
                        tracing::error!(volume = %v.name, "not served after replacement: {e}");
                    }
                }
            }
        }
        Ok(rep)
    }

    /// The failure-handling RPC methods; `None` when `method` is not one of them.
    pub(super) fn call_failures(
        &self,
        method: &str,
        params: &Value,
    ) -> Option<Result<Value, RpcError>> {
        let params = params.clone();
        Some(match method {
            "device_health" => (|| {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct P {
                    id: Option<String>,
                }
                let p: P = params_of(params)?;
                let only = match &p.id {
                    Some(id) => Some(self.pool().device_uuid(id).map_err(RpcError::app)?),
                    None => None,
                };
                let reports: Vec<_> = self
                    .monitor
                    .reports()
                    .into_iter()
                    .filter(|r| only.is_none_or(|u| u == r.device))
                    .collect();
                let handles = self.pool().device_handles();
                let mut out = Vec::new();
                for r in reports {
                    let mut v = serde_json::to_value(&r).unwrap_or(Value::Null);
                    let nvme = handles
                        .iter()
                        .find(|(u, _)| *u == r.device)
                        .and_then(|(_, d)| d.controller_status());
                    if let (Some(n), Some(obj)) = (nvme, v.as_object_mut()) {
                        obj.insert("nvme".into(), nvme_json(&n));
                    }
                    out.push(v);
                }
                Ok(Value::Array(out))
            })(),
            "events_list" => (|| {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct P {
                    #[serde(default)]
                    since: u64,
                    #[serde(default)]
                    wait_ms: u64,
                }
                let p: P = params_of(params)?;
                let deadline = Instant::now() + Duration::from_millis(p.wait_ms.min(30_000));
                loop {
                    let (events, last) = self.monitor.events(p.since);
                    if !events.is_empty() || Instant::now() >= deadline {
                        return Ok(json!({"events": events, "last": last}));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            })(),
            "device_inject" => (|| {
                let p: Inject = params_of(params)?;
                let uuid = self.pool().device_uuid(&p.id).map_err(RpcError::app)?;
                let dev = self
                    .pool()
                    .device_handles()
                    .into_iter()
                    .find(|(u, _)| *u == uuid)
                    .map(|(_, d)| d)
                    .ok_or_else(|| RpcError::app(format!("device {uuid} is not present")))?;
                if p.kind == "smart" {
                    let bits = p.bits.ok_or_else(|| {
                        RpcError::invalid_params("kind smart needs bits (the critical-warning byte, e.g. 4 = reliability degraded)")
                    })?;
                    dev.faults().set_smart_warning(bits);
                    return Ok(json!({"device": uuid, "smart_critical_warning": bits}));
                }
                let ops = match p.op.as_deref().unwrap_or("any") {
                    "read" => FaultOps::Read,
                    "write" => FaultOps::Write,
                    "any" => FaultOps::Any,
                    o => {
                        return Err(RpcError::invalid_params(format!(
                            "op '{o}' must be read, write or any"
                        )))
                    }
                };
                // (effect, default count, fails the probe)
                let (effect, count, fails_probe) = match p.kind.as_str() {
                    "media" => (FaultEffect::Errno(libc::ENODATA), 0, false),
                    "transient" => (FaultEffect::Errno(libc::EIO), 1, false),
                    "link-down" => (FaultEffect::Errno(libc::EIO), 0, true),
                    "timeout" => (FaultEffect::Hang, 1, false),
                    "stuck" => (FaultEffect::Stuck, 1, false),
                    "removed" => (FaultEffect::Errno(libc::ENODEV), 0, true),
                    "errno" => {
                        let e = p.errno.as_ref().ok_or_else(|| {
                            RpcError::invalid_params("kind errno needs errno (e.g. \"EIO\" or 61)")
                        })?;
                        (FaultEffect::Errno(errno_of(e)?), 1, false)
                    }
                    k => {
                        return Err(RpcError::invalid_params(format!(
                            "kind '{k}' must be one of media, transient, link-down, timeout, stuck, removed, errno, smart"
                        )))
                    }
                };
                let offset = p
                    .offset
                    .as_ref()
                    .map(|s| size_arg(s, "offset"))
                    .transpose()?
                    .unwrap_or(0);
                let len = p
                    .len
                    .as_ref()
                    .map(|s| size_arg(s, "len"))
                    .transpose()?
                    .unwrap_or(0);
                if offset.saturating_add(len) > dev.size() {
                    return Err(RpcError::invalid_params(format!(
                        "range {offset}+{len} is beyond the device's {} bytes",
                        dev.size()
                    )));
                }
                let rule = FaultRule {
                    effect,
                    ops,
                    offset,
                    len,
                    count: match p.count.unwrap_or(count) {
                        0 => None,
                        n => Some(n),
                    },
                    duration: p.duration_ms.map(Duration::from_millis),
                    fails_probe,
                };
                let id = dev.faults().add(rule.clone());
                tracing::warn!(device = %uuid, kind = %p.kind, id, "fault injected");
                Ok(json!({"device": uuid, "rule": rule_json(id, &rule, 0, rule.count)}))
            })(),
            "device_faults" => (|| {
                let p: IdParam = params_of(params)?;
                let uuid = self.pool().device_uuid(&p.id).map_err(RpcError::app)?;
                let dev = self.device_handle(uuid)?;
                let rules: Vec<_> = dev
                    .faults()
                    .list()
                    .iter()
                    .map(|f| rule_json(f.id, &f.rule, f.hits, f.remaining))
                    .collect();
                Ok(
                    json!({"device": uuid, "rules": rules, "smart_critical_warning": dev.faults().smart_warning()}),
                )
            })(),
            "device_clear_faults" => (|| {
                let p: IdParam = params_of(params)?;
                let uuid = self.pool().device_uuid(&p.id).map_err(RpcError::app)?;
                let n = self.device_handle(uuid)?.faults().clear();
                tracing::info!(device = %uuid, rules = n, "injected faults cleared");
                Ok(json!({"device": uuid, "cleared": n}))
            })(),
            "device_replace" => (|| {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct P {
                    old: String,
                    new: PathBuf,
                    create_size: Option<SizeValue>,
                    #[serde(default)]
                    force: bool,
                }
                let p: P = params_of(params)?;
                let create_size = opt_size(p.create_size, "create_size")?;
                let r = self
                    .replace(&p.old, p.new, create_size, p.force)
                    .map_err(RpcError::app)?;
                Ok(serde_json::to_value(r).unwrap_or(Value::Null))
            })(),
            "device_reset" => (|| {
                // A controller reset: hold the device's I/O, probe it, resume; and resubmit,
                // from the journal, everything in flight on every volume that lives on it.
                let p: IdParam = params_of(params)?;
                let uuid = self.pool().device_uuid(&p.id).map_err(RpcError::app)?;
                let dev = self.device_handle(uuid)?;
                if dev.health().state() == HealthState::Healthy {
                    self.monitor
                        .request_reset(uuid, "operator")
                        .map_err(RpcError::app)?;
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
                Ok(
                    json!({"device": uuid, "volumes": vols.iter().map(|v| v.name.clone()).collect::<Vec<_>>()}),
                )
            })(),
            _ => return None,
        })
    }

    fn device_handle(&self, uuid: uuid::Uuid) -> Result<Arc<spool_devices::Device>, RpcError> {
        self.pool()
            .device_handles()
            .into_iter()
            .find(|(u, _)| *u == uuid)
            .map(|(_, d)| d)
            .ok_or_else(|| RpcError::app(format!("device {uuid} is not present")))
    }
}

/// The NVMe part of a device's health report.
fn nvme_json(n: &spool_devices::ControllerStatus) -> Value {
    serde_json::json!({
        "pci": n.pci,
        "model": n.model,
        "serial": n.serial,
        "firmware": n.firmware,
        "version": n.version,
        "lba_size": n.lba_size,
        "blocks": n.blocks,
        "io_queues": n.io_queues,
        "max_transfer": n.max_transfer,
        "resets": n.resets,
        "attached": n.attached,
        "zero_copy_requests": n.zero_copy_requests,
        "bounced_requests": n.bounced_requests,
        "sgl": n.sgl,
        "sgl_requests": n.sgl_requests,
        "flush_commands": n.flush_commands,
        "deallocate_commands": n.deallocate_commands,
        "write_zeroes_commands": n.write_zeroes_commands,
        "gone": n.gone,
        "error_log": n.error_log.iter().map(|e| serde_json::json!({
            "error_count": e.error_count,
            "sqid": e.sqid,
            "cid": e.cid,
            "status": e.status.to_string(),
            "lba": e.lba,
            "nsid": e.nsid,
        })).collect::<Vec<_>>(),
        "smart": n.smart.map(|s| serde_json::json!({
            "critical_warning": s.critical_warning,
            "temperature_k": s.temperature,
            "available_spare_pct": s.available_spare,
            "percentage_used": s.percentage_used,
            "media_errors": s.media_errors,
            "error_log_entries": s.error_log_entries,
        })),
    })
}
