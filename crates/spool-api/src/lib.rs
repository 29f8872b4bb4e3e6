//! The wire types of spoold's control API: one params type and one result type per JSON-RPC
//! method, the JSON-RPC client, and the sizes and rates people write. spoold registers a
//! handler for each method (spool-control's `daemon::methods`); spoolctl builds the params
//! and renders the result, and depends on this crate alone. docs/rpc.md describes the same
//! surface.
//!
//! Owns: method names and help, the wire shape of params and results (field names, which
//! fields are optional, how sizes and errnos may be written), the client's side of the
//! socket.
//!
//! Must not know: the daemon, the pool, the frontend, the keeper or the monitor; it depends
//! on none of them. Results are plain data the daemon converts from their reports
//! (spool-control's `wire` module).

use std::path::PathBuf;

use serde::de::{DeserializeOwned, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

pub use qos::{Priority, RateValue};
pub use size::SizeValue;

mod check;
pub mod client;
mod mirror;
pub mod qos;
pub mod restart;
mod results;
pub mod size;
pub mod stats;
mod thin;
mod transfer;
pub use thin::{
    ChangedChunks, CloneParams, DiffParams, DiffResult, ExportInfo, ExportParams, Snapshot,
    SnapshotParams, TakeSnapshotParams,
};
pub use transfer::{
    PromoteParams, ReceiveInfo, ReceiveParams, ReceiveStopParams, SendInfo, SendParams,
    TransferChallenge, TransferHello, TransferKey, TransferReply, ANSWER_PROOF, HELLO_PROOF,
    TRANSFER_VERSION,
};

pub use check::CheckReport;
pub use mirror::*;
pub use results::*;
pub use stats::*;
pub use thin::*;

/// The cipher of encrypted volumes (dm-crypt's name for it; docs/encryption.md).
pub const CIPHER: &str = "aes-xts-plain64";

/// One JSON-RPC method: its name, a line of help, and the types of its params and result.
pub trait Method: 'static {
    const NAME: &'static str;
    const HELP: &'static str;
    type Params: Serialize + DeserializeOwned;
    type Result: Serialize + DeserializeOwned;
}

macro_rules! methods {
    ($($(#[$doc:meta])* $ty:ident = $name:literal, $params:ty => $result:ty, $help:literal;)*) => {
        $(
            $(#[$doc])*
            pub enum $ty {}
            impl Method for $ty {
                const NAME: &'static str = $name;
                const HELP: &'static str = $help;
                type Params = $params;
                type Result = $result;
            }
        )*
    };
}

methods! {
    PoolShow = "pool_show", NoParams => PoolInfo,
        "the pool: name, uuid, generation, size, free, min_extent, devices";
    PoolCheck = "pool_check", NoParams => CheckReport,
        "check the pool's metadata against itself and the allocators: problems, leaks";
    DeviceList = "device_list", NoParams => Vec<DeviceInfo>,
        "devices: uuid, path, size, free, present, direct_io";
    DeviceAdd = "device_add", DeviceAddParams => DeviceInfo,
        "add a file or block device to the pool";
    DeviceReset = "device_reset", IdParams => DeviceResetResult,
        "controller reset: hold the device's I/O, probe it, resubmit what was in flight";
    DeviceHealth = "device_health", DeviceHealthParams => Vec<DeviceHealthReport>,
        "health of every device (or one): state, reason, counters, SMART";
    EventsList = "events_list", EventsParams => EventsResult,
        "health events after `since`, waiting up to `wait_ms` for one";
    DeviceReplace = "device_replace", DeviceReplaceParams => Replacement,
        "replace a failed or removed device with a blank one";
    DeviceInject = "device_inject", InjectParams => InjectResult,
        "inject a fault into a device (docs/failures.md)";
    DeviceFaults = "device_faults", IdParams => FaultsResult,
        "armed fault-injection rules of a device and its simulated SMART byte";
    DeviceClearFaults = "device_clear_faults", IdParams => ClearFaultsResult,
        "disarm every injected fault of a device";
    VolumeList = "volume_list", NoParams => Vec<Volume>,
        "volumes with their sockets";
    VolumeShow = "volume_show", IdParams => Volume,
        "one volume (by name or UUID)";
    VolumeCreate = "volume_create", VolumeCreateParams => Volume,
        "create a volume and serve it";
    VolumeResize = "volume_resize", VolumeResizeParams => Volume,
        "grow a volume";
    VolumeDelete = "volume_delete", VolumeDeleteParams => VolumeInfo,
        "delete a volume and its journals";
    VolumeVerify = "volume_verify", IdParams => VerifyResult,
        "compare a mirrored volume's copies region by region (a scrub)";
    VolumeMirror = "volume_mirror", VolumeMirrorParams => Volume,
        "add a copy to a volume (a plain one becomes a mirror) or remove one, online";
    VolumeRekey = "volume_rekey", RekeyParams => RekeyResult,
        "rewrap every encrypted volume's data key under a new key-encryption key (no data is touched)";
    VolumeSnapshot = "volume_snapshot", TakeSnapshotParams => Snapshot,
        "take a crash-consistent snapshot of a running thin volume";
    VolumeSnapshots = "volume_snapshots", IdParams => Vec<Snapshot>,
        "a thin volume's snapshots, oldest first";
    SnapshotDelete = "snapshot_delete", SnapshotParams => Snapshot,
        "delete a snapshot (the chunks no other map names go back to the pool)";
    VolumeClone = "volume_clone", CloneParams => Volume,
        "create a writable thin volume from a snapshot (sharing its chunks until written) and serve it";
    VolumeRevert = "volume_revert", SnapshotParams => ChangedChunks,
        "make a volume no VM uses hold a snapshot's data again";
    VolumeInflate = "volume_inflate", IdParams => ChangedChunks,
        "copy every chunk a volume shares with a snapshot, so it depends on none";
    VolumeDiff = "volume_diff", DiffParams => DiffResult,
        "the byte ranges that differ between a snapshot and another one (or the volume now)";
    SnapshotExport = "snapshot_export", ExportParams => ExportInfo,
        "serve a snapshot read-only over NBD, with base:allocation and, given a base, qemu:dirty-bitmap:BASE";
    SnapshotUnexport = "snapshot_unexport", SnapshotParams => ExportInfo,
        "stop serving a snapshot over NBD (open connections fail their next request)";
    VolumeReceive = "volume_receive", ReceiveParams => ReceiveInfo,
        "serve a volume no VM uses as a writable NBD export, for another host or qemu-img/nbdcopy to write its data into";
    VolumeReceiveStop = "volume_receive_stop", ReceiveStopParams => ReceiveInfo,
        "stop receiving a volume (open connections fail their next request)";
    VolumePromote = "volume_promote", PromoteParams => Volume,
        "make a replica of another host's volume this host's own, at a higher epoch, and let VMs run it";
    VolumeSend = "volume_send", SendParams => SendInfo,
        "send a volume to another host's NBD export (a remote copy kept in step while it runs), or cancel or finish that";
    VolumeQos = "volume_qos", VolumeQosParams => Volume,
        "set or clear a volume's I/O limits (IOPS, bytes/s, read/write, burst); running queues apply them at once";
    VolumeStatsGet = "volume_stats", VolumeStatsParams => Vec<VolumeStats>,
        "I/O counters of every volume (or one): requests, bytes, errors, latency, in flight";
    DaemonStatus = "daemon_status", NoParams => Status,
        "worker and keeper, restart phases, state formats";
    DaemonUpgrade = "daemon_upgrade", UpgradeParams => restart::RestartReport,
        "replace the worker with a new binary, answered by the keeper";
}

/// Params of a method that takes none: `null` or `{}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoParams;

impl Serialize for NoParams {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        s.serialize_map(Some(0))?.end()
    }
}

impl<'de> Deserialize<'de> for NoParams {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<NoParams, D::Error> {
        struct Empty;
        impl<'de> Visitor<'de> for Empty {
            type Value = NoParams;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("no parameters")
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<NoParams, E> {
                Ok(NoParams)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<NoParams, A::Error> {
                match m.next_key::<serde::de::IgnoredAny>()? {
                    None => Ok(NoParams),
                    Some(_) => Err(serde::de::Error::custom("this method takes no parameters")),
                }
            }
        }
        d.deserialize_any(Empty)
    }
}

/// `{"id": …}`: a device or volume by name, path or UUID.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdParams {
    pub id: String,
}

/// `device_add`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceAddParams {
    pub path: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub create_size: Option<SizeValue>,
    #[serde(default)]
    pub force: bool,
}

/// `device_health`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceHealthParams {
    pub id: Option<String>,
}

/// `events_list`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsParams {
    #[serde(default)]
    pub since: u64,
    /// At most 30 000: how long to wait for an event when there is none.
    #[serde(default)]
    pub wait_ms: u64,
}

/// `device_replace`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceReplaceParams {
    pub old: String,
    pub new: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub create_size: Option<SizeValue>,
    #[serde(default)]
    pub force: bool,
}

/// `device_inject`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InjectParams {
    pub id: String,
    /// A [`FaultKind`] name (checked by the handler, so the error lists the kinds).
    pub kind: String,
    /// read | write | any (default any).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub op: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<SizeValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub len: Option<SizeValue>,
    /// Operations it hits before it disarms (0 = until cleared).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// For kind errno: the errno, a number or a name such as EIO.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errno: Option<ErrnoArg>,
    /// For kind smart: the critical-warning byte.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits: Option<u8>,
}

/// What kind of fault `device_inject` arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    Media,
    Transient,
    LinkDown,
    Timeout,
    Stuck,
    Removed,
    Errno,
    Smart,
    ResetPanic,
    ResetWedge,
    Crash,
}

impl FaultKind {
    pub const ALL: [(FaultKind, &'static str); 11] = [
        (FaultKind::Media, "media"),
        (FaultKind::Transient, "transient"),
        (FaultKind::LinkDown, "link-down"),
        (FaultKind::Timeout, "timeout"),
        (FaultKind::Stuck, "stuck"),
        (FaultKind::Removed, "removed"),
        (FaultKind::Errno, "errno"),
        (FaultKind::Smart, "smart"),
        (FaultKind::ResetPanic, "reset-panic"),
        (FaultKind::ResetWedge, "reset-wedge"),
        (FaultKind::Crash, "crash"),
    ];

    /// The kind named `s` (as on the wire).
    pub fn parse(s: &str) -> Option<FaultKind> {
        Self::ALL.iter().find(|(_, n)| *n == s).map(|(k, _)| *k)
    }
}

/// An errno as given: a number, a name (`"EIO"`), or anything else (refused by the handler
/// with a message that shows it).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ErrnoArg {
    Number(i64),
    Name(String),
    Other(Value),
}

impl ErrnoArg {
    /// As the user wrote it on the command line: a number if it parses as one.
    pub fn from_cli(s: &str) -> ErrnoArg {
        match s.parse::<i64>() {
            Ok(n) => ErrnoArg::Number(n),
            Err(_) => ErrnoArg::Name(s.to_string()),
        }
    }
}

impl std::fmt::Display for ErrnoArg {
    /// As JSON (a name in quotes), the way error messages show it.
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match serde_json::to_value(self) {
            Ok(v) => write!(f, "{v}"),
            Err(_) => f.write_str("?"),
        }
    }
}

/// `volume_create`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeCreateParams {
    pub name: String,
    /// Required, except when attaching an existing RBD image (then its size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<SizeValue>,
    #[serde(default)]
    pub read_only: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_queues: Option<u16>,
    /// Copies to keep: 1 (plain, the default), 2 or 3 (mirrored on distinct devices).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mirror: Option<u8>,
    /// Keep the data in Ceph RBD (docs/ceph.md): `POOL` creates image POOL/NAME,
    /// `POOL/IMAGE` attaches an existing image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rbd: Option<String>,
    /// Encrypt the volume's data under a data key of its own (docs/encryption.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub encrypt: bool,
    /// Take the volume's space from the pool on first write, chunk by chunk (docs/thin.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub thin: bool,
}

/// `volume_rekey`: where the new key-encryption key is (default: the configured source,
/// read again, after the operator put the new key there).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RekeyParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<String>,
}

/// What `volume_rekey` did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RekeyResult {
    /// Data keys rewrapped (one per encrypted volume).
    pub rewrapped: usize,
    /// The id of the key-encryption key in use now, and of the one before.
    pub kek_id: String,
    pub old_kek_id: String,
}

/// `volume_mirror`: `action` "add" (one more copy, rebuilt online) or "remove" (copy `leg`,
/// default one that is not current, else the newest).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeMirrorParams {
    pub id: String,
    pub action: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leg: Option<u8>,
}

/// `volume_delete`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeDeleteParams {
    pub id: String,
    /// Disconnect a connected client first.
    #[serde(default)]
    pub force: bool,
    /// Also remove an attached RBD image (one spoold created is removed anyway).
    #[serde(default)]
    pub remove_image: bool,
}

/// `volume_resize`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeResizeParams {
    pub id: String,
    pub size: SizeValue,
}

/// `volume_qos`: each given limit replaces the current one (0 removes it), the others stay;
/// `clear` first removes every limit (then the given ones apply). Rates are numbers or
/// strings: IOPS "20k" (k = 1000), bytes per second "200M" (K/M/G = powers of 1024).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeQosParams {
    pub id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops: Option<RateValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_iops: Option<RateValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_iops: Option<RateValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bps: Option<RateValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_bps: Option<RateValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_bps: Option<RateValue>,
    /// Burst allowance in milliseconds (1..=60000; default 1000 for a volume without limits).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst_ms: Option<u32>,
    /// Fair-share weight against the other busy volumes (1..=10000; 0: the default, 100).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    /// Scheduling class: "latency", "normal" or "batch".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub clear: bool,
}

impl VolumeQosParams {
    /// The change these params ask for, every rate read.
    pub fn change(&self) -> Result<crate::qos::QosChange, crate::qos::QosError> {
        let iops = |v: &Option<RateValue>, what| v.as_ref().map(|v| v.iops(what)).transpose();
        let bps = |v: &Option<RateValue>, what| v.as_ref().map(|v| v.bps(what)).transpose();
        Ok(crate::qos::QosChange {
            clear: self.clear,
            iops: iops(&self.iops, "iops")?,
            read_iops: iops(&self.read_iops, "read_iops")?,
            write_iops: iops(&self.write_iops, "write_iops")?,
            bps: bps(&self.bps, "bps")?,
            read_bps: bps(&self.read_bps, "read_bps")?,
            write_bps: bps(&self.write_bps, "write_bps")?,
            burst_ms: self.burst_ms,
            weight: self.weight,
            priority: self.priority,
        })
    }
}

/// `daemon_upgrade`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpgradeParams {
    /// The new binary (default: the binary the worker runs now).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub binary: Option<PathBuf>,
}

#[cfg(test)]
mod tests;
