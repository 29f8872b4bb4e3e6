//! Result types of the control API, as they appear on the wire (the daemon converts the
//! reports of the lower layers, pool, health monitor and devices, into these).

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
    /// The address of the host whose copy this is (a replica: no VM runs it here until
    /// `volume_promote`; docs/replicas.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_of: Option<String>,
    /// A replica whose primary said its copy here is complete (current there).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replica_complete: bool,
    /// The epoch the volume is served under here (a replica: its primary's); absent: 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u64,
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
    #[serde(default, skip_serializing_if = "crate::Priority::is_normal")]
    pub priority: crate::Priority,
}

impl QosLimits {
    /// Each limit by name, as spoolctl and the RPC spell them.
    pub fn rates(&self) -> [(&'static str, u64); 6] {
        [
            ("iops", self.iops),
            ("read_iops", self.read_iops),
            ("write_iops", self.write_iops),
            ("bps", self.bps),
            ("read_bps", self.read_bps),
            ("write_bps", self.write_bps),
        ]
    }

    /// No rate limited.
    pub fn is_unlimited(&self) -> bool {
        self.rates().iter().all(|(_, r)| *r == 0)
    }

    /// No limit, the default weight and priority: nothing worth showing.
    pub fn is_default(&self) -> bool {
        self.is_unlimited() && self.weight == 0 && self.priority.is_normal()
    }
}

fn is_zero32(v: &u32) -> bool {
    *v == 0
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
    /// The transfer writing the volume's data from elsewhere (`volume receive`), if any.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub receiving: Option<super::ReceiveInfo>,
    /// Its copy being sent to another host (`volume send`), if any.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub sending: Option<super::SendInfo>,
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
    /// A volume being sent to another host (device: the volume's UUID, path: the
    /// destination's URI): copying (at every quarter), current, disconnected, waiting.
    Send,
    /// A standing replica here (device: the volume's UUID, path: its primary's address):
    /// complete, promoted (docs/replicas.md).
    Replica,
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
    pub start_phases: Vec<crate::restart::Phase>,
    pub first_io_after_restart_ms: Option<f64>,
    pub last_restart: Option<crate::restart::RestartReport>,
    pub state_format: StateFormat,
}

/// The formats of the state a worker keeps with the keeper (an upgrade needs the new
/// binary to read them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateFormat {
    /// Format of the frontend's session state.
    pub session: u32,
}
