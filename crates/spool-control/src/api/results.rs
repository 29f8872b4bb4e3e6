//! Result types of the control API, as they appear on the wire, and their conversions from
//! the reports of the lower layers (pool, health monitor, devices).

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// A pool device (`device_list`, `device_add`, inside `pool_show`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub uuid: Uuid,
    pub path: String,
    pub size: u64,
    pub free: u64,
    pub present: bool,
    pub direct_io: bool,
}

impl From<spool_pool::DeviceInfo> for DeviceInfo {
    fn from(d: spool_pool::DeviceInfo) -> Self {
        DeviceInfo {
            uuid: d.uuid,
            path: d.path,
            size: d.size,
            free: d.free,
            present: d.present,
            direct_io: d.direct_io,
        }
    }
}

/// A configured device the pool runs without, and why.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeftOut {
    pub path: String,
    pub reason: String,
}

/// `pool_show`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolInfo {
    pub name: String,
    pub uuid: Uuid,
    pub generation: u64,
    pub min_extent: u64,
    pub size: u64,
    pub free: u64,
    pub devices: Vec<DeviceInfo>,
    pub volumes: usize,
    pub left_out: Vec<LeftOut>,
    /// The sum of thin volumes' sizes (over `size`: over-committed) and the bytes their
    /// chunks take now (docs/thin.md).
    #[serde(default)]
    pub thin_provisioned: u64,
    #[serde(default)]
    pub thin_mapped: u64,
    /// Bytes of chunks named by more than one map (snapshots, clones; docs/snapshots.md).
    #[serde(default)]
    pub thin_shared: u64,
}

impl From<spool_pool::PoolInfo> for PoolInfo {
    fn from(p: spool_pool::PoolInfo) -> Self {
        PoolInfo {
            name: p.name,
            uuid: p.uuid,
            generation: p.generation,
            min_extent: p.min_extent,
            size: p.size,
            free: p.free,
            devices: p.devices.into_iter().map(DeviceInfo::from).collect(),
            volumes: p.volumes,
            left_out: p
                .left_out
                .into_iter()
                .map(|l| LeftOut {
                    path: l.path,
                    reason: l.reason,
                })
                .collect(),
            thin_provisioned: p.thin_provisioned,
            thin_mapped: p.thin_mapped,
            thin_shared: p.thin_shared,
        }
    }
}

/// A volume as the pool keeps it (`volume_delete`, and the first part of [`Volume`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeInfo {
    pub uuid: Uuid,
    pub name: String,
    pub size: u64,
    pub allocated: u64,
    pub read_only: bool,
    pub num_queues: u16,
    pub extents: usize,
    pub devices: Vec<Uuid>,
    /// False when one of its devices is missing.
    pub online: bool,
    /// Its I/O limits; absent when it has none.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub qos: Option<QosLimits>,
    /// `POOL/IMAGE` of a volume on a Ceph RBD image (docs/ceph.md).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub rbd: Option<String>,
    /// Where its data lies on the pool's devices (empty on RBD).
    #[serde(default)]
    pub extent_map: Vec<ExtentInfo>,
    /// Its data is encrypted (docs/encryption.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub encrypted: bool,
    /// The id of the key-encryption key its data key is wrapped under (never the key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kek_id: Option<String>,
    /// A thin volume's chunks (docs/thin.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thin: Option<super::ThinInfo>,
}

/// One extent of a volume: `len` bytes at byte `offset` of `device`, holding the bytes of
/// copy `copy` (the mirror leg's slot; 0 for a plain volume) from `volume_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtentInfo {
    pub copy: u8,
    pub volume_offset: u64,
    pub device: Uuid,
    pub offset: u64,
    pub len: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A volume's I/O limits, per second (`volume_qos`, inside a volume): limits that are not
/// set (0) are left out; `burst_ms` is always there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QosLimits {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_iops: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_iops: u64,
    /// Bytes per second.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_bps: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_bps: u64,
    pub burst_ms: u32,
    /// Fair-share weight; absent: the default (100).
    #[serde(default, skip_serializing_if = "is_zero32")]
    pub weight: u32,
    /// Scheduling class; absent: normal.
    #[serde(default, skip_serializing_if = "spool_pool::Priority::is_normal")]
    pub priority: spool_pool::Priority,
}

fn is_zero32(v: &u32) -> bool {
    *v == 0
}

impl From<spool_pool::QosLimits> for QosLimits {
    fn from(q: spool_pool::QosLimits) -> Self {
        QosLimits {
            iops: q.iops,
            read_iops: q.read_iops,
            write_iops: q.write_iops,
            bps: q.bps,
            read_bps: q.read_bps,
            write_bps: q.write_bps,
            burst_ms: q.burst_ms,
            weight: q.weight,
            priority: q.priority,
        }
    }
}

impl From<QosLimits> for spool_pool::QosLimits {
    fn from(q: QosLimits) -> Self {
        spool_pool::QosLimits {
            iops: q.iops,
            read_iops: q.read_iops,
            write_iops: q.write_iops,
            bps: q.bps,
            read_bps: q.read_bps,
            write_bps: q.write_bps,
            burst_ms: q.burst_ms,
            weight: q.weight,
            priority: q.priority,
        }
    }
}

impl From<spool_pool::VolumeInfo> for VolumeInfo {
    fn from(v: spool_pool::VolumeInfo) -> Self {
        VolumeInfo {
            uuid: v.uuid,
            name: v.name,
            size: v.size,
            allocated: v.allocated,
            read_only: v.read_only,
            num_queues: v.num_queues,
            extents: v.extents,
            devices: v.devices,
            online: v.online,
            qos: v.qos.map(QosLimits::from),
            rbd: v.rbd,
            extent_map: v
                .extent_map
                .into_iter()
                .map(|e| ExtentInfo {
                    copy: e.copy,
                    volume_offset: e.volume_offset,
                    device: e.device,
                    offset: e.offset,
                    len: e.len,
                })
                .collect(),
            encrypted: v.encrypted,
            kek_id: v.kek_id,
            thin: v.thin.map(super::ThinInfo::from),
        }
    }
}

/// A volume and how it is served (`volume_list`, `volume_show`, `volume_create`, …).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Volume {
    #[serde(flatten)]
    pub info: VolumeInfo,
    /// Its vhost-user socket; `None` when it is not served.
    pub socket: Option<String>,
    pub connected: bool,
    /// Device commands of a stopped volume that never completed (its extents are kept).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub quarantined_io: Option<u64>,
    /// A mirrored volume's copies and copying progress.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub mirror: Option<super::MirrorStatus>,
    /// Why an online volume is not served, when spoold knows (an encrypted volume whose key
    /// it cannot unwrap).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub not_served: Option<String>,
}

/// `device_replace`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Replacement {
    pub old: Uuid,
    pub new: DeviceInfo,
    /// Volumes whose extents moved to the new device (their data there reads as zeroes).
    pub volumes: Vec<String>,
    pub extents: usize,
}

impl From<spool_pool::Replacement> for Replacement {
    fn from(r: spool_pool::Replacement) -> Self {
        Replacement {
            old: r.old,
            new: r.new.into(),
            volumes: r.volumes,
            extents: r.extents,
        }
    }
}

/// `device_reset`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceResetResult {
    pub device: Uuid,
    /// Volumes on the device, whose queues resubmit what their journals hold in flight.
    pub volumes: Vec<String>,
}

/// Error counters of one device.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Counters {
    pub media_errors: u64,
    pub path_errors: u64,
    pub timeouts: u64,
    pub gone_errors: u64,
    pub request_errors: u64,
    pub dropped_reports: u64,
    pub resets: u64,
    pub failed_probes: u64,
}

/// One device of `device_health`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceHealthReport {
    pub device: Uuid,
    pub path: String,
    /// healthy, resetting, failed or removed.
    pub state: String,
    pub reason: String,
    pub epoch: u64,
    pub counters: Counters,
    pub last_error: Option<String>,
    pub smart_critical_warning: u8,
    pub injected_faults: usize,
    pub injected_hits: u64,
    pub since_s: f64,
    /// Only for NVMe devices.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub nvme: Option<NvmeHealth>,
}

impl DeviceHealthReport {
    /// The monitor's report of a device, with its NVMe controller's status if it has one.
    pub fn new(
        r: spool_health::DeviceReport,
        nvme: Option<spool_devices::ControllerStatus>,
    ) -> Self {
        let c = r.counters;
        DeviceHealthReport {
            device: r.device,
            path: r.path,
            state: r.state.to_string(),
            reason: r.reason,
            epoch: r.epoch,
            counters: Counters {
                media_errors: c.media_errors,
                path_errors: c.path_errors,
                timeouts: c.timeouts,
                gone_errors: c.gone_errors,
                request_errors: c.request_errors,
                dropped_reports: c.dropped_reports,
                resets: c.resets,
                failed_probes: c.failed_probes,
            },
            last_error: r.last_error,
            smart_critical_warning: r.smart_critical_warning,
            injected_faults: r.injected_faults,
            injected_hits: r.injected_hits,
            since_s: r.since_s,
            nvme: nvme.map(NvmeHealth::from),
        }
    }
}

/// The NVMe part of a device's health report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NvmeHealth {
    pub pci: String,
    pub model: String,
    pub serial: String,
    pub firmware: String,
    pub version: String,
    pub lba_size: u64,
    pub blocks: u64,
    pub io_queues: u16,
    pub max_transfer: u64,
    pub resets: u64,
    pub attached: bool,
    pub zero_copy_requests: u64,
    pub bounced_requests: u64,
    pub sgl: u8,
    pub sgl_requests: u64,
    pub flush_commands: u64,
    pub deallocate_commands: u64,
    pub write_zeroes_commands: u64,
    pub gone: bool,
    pub error_log: Vec<NvmeErrorEntry>,
    pub smart: Option<NvmeSmart>,
}

/// One entry of an NVMe controller's error log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NvmeErrorEntry {
    pub error_count: u64,
    pub sqid: u16,
    pub cid: u16,
    pub status: String,
    pub lba: u64,
    pub nsid: u32,
}

/// An NVMe controller's SMART / health log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NvmeSmart {
    pub critical_warning: u8,
    pub temperature_k: u16,
    pub available_spare_pct: u8,
    pub percentage_used: u8,
    pub media_errors: u64,
    pub error_log_entries: u64,
}

impl From<spool_devices::ControllerStatus> for NvmeHealth {
    fn from(n: spool_devices::ControllerStatus) -> Self {
        NvmeHealth {
            pci: n.pci,
            model: n.model,
            serial: n.serial,
            firmware: n.firmware,
            version: n.version,
            lba_size: n.lba_size,
            blocks: n.blocks,
            io_queues: n.io_queues,
            max_transfer: n.max_transfer,
            resets: n.resets,
            attached: n.attached,
            zero_copy_requests: n.zero_copy_requests,
            bounced_requests: n.bounced_requests,
            sgl: n.sgl,
            sgl_requests: n.sgl_requests,
            flush_commands: n.flush_commands,
            deallocate_commands: n.deallocate_commands,
            write_zeroes_commands: n.write_zeroes_commands,
            gone: n.gone,
            error_log: n
                .error_log
                .iter()
                .map(|e| NvmeErrorEntry {
                    error_count: e.error_count,
                    sqid: e.sqid,
                    cid: e.cid,
                    status: e.status.to_string(),
                    lba: e.lba,
                    nsid: e.nsid,
                })
                .collect(),
            smart: n.smart.map(|s| NvmeSmart {
                critical_warning: s.critical_warning,
                temperature_k: s.temperature,
                available_spare_pct: s.available_spare,
                percentage_used: s.percentage_used,
                media_errors: s.media_errors,
                error_log_entries: s.error_log_entries,
            }),
        }
    }
}

/// What a health event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthEventKind {
    /// A transition (`from` → `to`).
    State,
    /// Something worth knowing that changes no state (a SMART warning bit).
    Warning,
    /// The device was replaced.
    Replaced,
    /// An isolated state carried over a worker restart.
    Restored,
    /// A mirrored volume with a leg on the device: degraded, rebuilding (with progress),
    /// rebuilt.
    Mirror,
    /// The pool's free space while thin volumes may take chunks (device: nil, path: the
    /// pool's name): below 20%, 10% or 5%, above again, writes waiting for space.
    #[serde(rename = "pool-space")]
    PoolSpace,
}

impl HealthEventKind {
    /// The kind the monitor names `s` (spool-health keeps them as strings).
    pub fn parse(s: &str) -> Option<HealthEventKind> {
        serde_json::from_value(serde_json::Value::String(s.to_string())).ok()
    }
}

/// One health event (`events_list`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HealthEvent {
    pub seq: u64,
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    pub device: Uuid,
    pub path: String,
    pub kind: HealthEventKind,
    pub from: Option<String>,
    pub to: Option<String>,
    pub reason: String,
}

impl HealthEvent {
    /// The monitor's event; `None` for a kind this layer does not know.
    pub fn new(e: &spool_health::Event) -> Option<HealthEvent> {
        Some(HealthEvent {
            seq: e.seq,
            time_ms: e.time_ms,
            device: e.device,
            path: e.path.clone(),
            kind: HealthEventKind::parse(&e.kind)?,
            from: e.from.map(str::to_string),
            to: e.to.map(str::to_string),
            reason: e.reason.clone(),
        })
    }
}

/// `events_list`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventsResult {
    pub events: Vec<HealthEvent>,
    /// The newest sequence number.
    pub last: u64,
}

/// An armed fault-injection rule.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FaultRuleInfo {
    pub id: u64,
    /// `errno N (text)`, `hang`, `stuck` or `crash`.
    pub effect: String,
    /// read, write or any.
    pub op: String,
    pub offset: u64,
    pub len: u64,
    pub count: Option<u64>,
    pub remaining: Option<u64>,
    pub duration_ms: Option<u64>,
    pub fails_probe: bool,
    pub hits: u64,
}

impl FaultRuleInfo {
    pub fn new(id: u64, r: &spool_devices::FaultRule, hits: u64, remaining: Option<u64>) -> Self {
        use spool_devices::{FaultEffect, FaultOps};
        FaultRuleInfo {
            id,
            effect: match r.effect {
                FaultEffect::Errno(e) => {
                    format!("errno {e} ({})", std::io::Error::from_raw_os_error(e))
                }
                FaultEffect::Hang => "hang".into(),
                FaultEffect::Stuck => "stuck".into(),
                FaultEffect::Crash => "crash".into(),
            },
            op: match r.ops {
                FaultOps::Read => "read",
                FaultOps::Write => "write",
                FaultOps::Any => "any",
            }
            .into(),
            offset: r.offset,
            len: r.len,
            count: r.count,
            remaining,
            duration_ms: r.duration.map(|d| d.as_millis() as u64),
            fails_probe: r.fails_probe,
            hits,
        }
    }
}

/// `device_inject`: the armed rule, or the simulated SMART byte for kind smart.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InjectResult {
    pub device: Uuid,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub rule: Option<FaultRuleInfo>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub smart_critical_warning: Option<u8>,
}

/// `device_faults`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FaultsResult {
    pub device: Uuid,
    pub rules: Vec<FaultRuleInfo>,
    pub smart_critical_warning: u8,
}

/// `device_clear_faults`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClearFaultsResult {
    pub device: Uuid,
    pub cleared: usize,
}

/// The keeper part of `daemon_status` (`None` with `--no-keeper`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KeeperStatus {
    pub pid: u32,
    pub generation: u64,
    pub start_reason: String,
}

/// `daemon_status`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    /// The worker's pid.
    pub pid: u32,
    pub version: String,
    pub binary: Option<String>,
    pub keeper: Option<KeeperStatus>,
    pub start_phases: Vec<spool_keeper::Phase>,
    pub first_io_after_restart_ms: Option<f64>,
    pub last_restart: Option<spool_keeper::RestartReport>,
    pub state_format: crate::kept::StateFormat,
}
