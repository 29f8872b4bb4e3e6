//! The daemon's declarative configuration (TOML), and the embedded default used when no
//! config file is given (file-backed devices under a state directory).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::qos::{QosError, RateValue};

mod ceph;
mod encryption;
mod faults;
mod health;
mod io;
mod tls;
mod transfer;

pub use encryption::{read_private, KekError, KeySource};
pub use health::HealthConfig;
use health::{health, RawHealth};
pub use transfer::TransferConfig;

use io::{volume_threads, RawIo};

pub use spool_api::size::SizeValue;

/// A size setting in bytes; the error names the setting.
fn size_bytes(v: &SizeValue, what: impl Into<String>) -> Result<u64, ConfigError> {
    v.bytes().map_err(|why| ConfigError::Size {
        what: what.into(),
        why,
    })
}

/// What is wrong with a config (the message names the setting and what it must be).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config: {0}")]
    Toml(#[from] toml::de::Error),
    #[error("{0}")]
    Invalid(String),
    #[error("{what}: {why}")]
    Size {
        what: String,
        why: crate::size::SizeError,
    },
    #[error("pool.min_extent: {0} must be a power of two of at least 64K")]
    MinExtent(u64),
    #[error("device {path}: null = \"{kind}\" must be \"untouched\" or \"zero\"")]
    NullKind { path: String, kind: String },
    #[error("null device {0}: create_size (its size) is required")]
    NullSize(String),
    #[error(
        "null devices keep nothing across restarts: a pool is either all null devices or none"
    )]
    MixedNull,
    #[error("volume {volume}: num_queues {queues} must be 1..=64")]
    Queues { volume: String, queues: u16 },
    #[error("volume {volume}: mirror = {copies} must be 1, 2 or 3")]
    Mirror { volume: String, copies: u8 },
    #[error("volume {volume}: qos: {source}")]
    Qos { volume: String, source: QosError },
    #[error("volume {0} is listed twice")]
    DuplicateVolume(String),
    #[error("volume {0}: size is required")]
    VolumeSize(String),
    #[error("volume {volume}: rbd: {msg}")]
    Rbd { volume: String, msg: String },
    #[error("ceph.claim_wait_ms: {0} is more than 600000 (10 minutes)")]
    CephClaimWait(u64),
    #[error("ceph.id: {0:?} is not a client id (the name after \"client.\", e.g. \"admin\")")]
    CephId(String),
    #[error("metrics.listen: {0:?} is not an address and port (e.g. \"127.0.0.1:9420\")")]
    MetricsListen(String),
    #[error("io.volume_threads: {0} must be 0 (a thread per queue) to 64")]
    VolumeThreads(u32),
    #[error("encryption: {0}")]
    Encryption(String),
    #[error("health.{0} must be positive")]
    NotPositive(&'static str),
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    InFile {
        path: String,
        source: Box<ConfigError>,
    },
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawPool {
    name: Option<String>,
    min_extent: Option<SizeValue>,
    #[serde(default)]
    no_direct: bool,
    /// Bytes per second a mirror's resync or rebuild may copy ("64M"; 0: unlimited).
    resync_rate: Option<SizeValue>,
    /// Move mirror legs off failed devices onto free space of others (default true).
    auto_rebuild: Option<bool>,
    /// How long a write to a thin volume waits for free space on a full pool before it
    /// fails (default 20000).
    thin_full_wait_ms: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDevice {
    path: PathBuf,
    create_size: Option<SizeValue>,
    /// "untouched" or "zero": a null device named `path` of `create_size` bytes.
    null: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVolume {
    name: String,
    /// Required, except for an attached RBD image (`rbd = "POOL/IMAGE"`: its size).
    size: Option<SizeValue>,
    #[serde(default)]
    read_only: bool,
    num_queues: Option<u16>,
    /// Copies to keep (1: plain, 2 or 3: mirrored), when the volume is created.
    mirror: Option<u8>,
    /// `[volumes.qos]`: the volume's I/O limits, declared.
    qos: Option<RawQos>,
    /// Keep the data in Ceph RBD: "POOL" (image POOL/NAME) or "POOL/IMAGE" (attach).
    rbd: Option<String>,
    /// Encrypt the volume's data (when it is created; docs/encryption.md).
    #[serde(default)]
    encrypt: bool,
    /// Allocate the volume's space on first write (when it is created; docs/thin.md).
    #[serde(default)]
    thin: bool,
}

/// `[volumes.qos]` as written: rates as numbers or strings ("20k", "200M"), burst with a unit.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQos {
    iops: Option<RateValue>,
    read_iops: Option<RateValue>,
    write_iops: Option<RateValue>,
    bps: Option<RateValue>,
    read_bps: Option<RateValue>,
    write_bps: Option<RateValue>,
    burst: Option<RateValue>,
    /// Fair-share weight (1..=10000; default 100).
    weight: Option<u32>,
    /// "latency", "normal" (default) or "batch".
    priority: Option<spool_pool::Priority>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJournal {
    #[serde(default = "yes")]
    enabled: bool,
    dir: Option<PathBuf>,
}

fn yes() -> bool {
    true
}

impl Default for RawJournal {
    fn default() -> Self {
        RawJournal {
            enabled: true,
            dir: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    state_dir: PathBuf,
    rpc_socket: Option<PathBuf>,
    socket_dir: Option<PathBuf>,
    #[serde(default)]
    pool: RawPool,
    #[serde(default)]
    devices: Vec<RawDevice>,
    #[serde(default)]
    volumes: Vec<RawVolume>,
    #[serde(default)]
    io: RawIo,
    #[serde(default)]
    journal: RawJournal,
    #[serde(default)]
    health: RawHealth,
    #[serde(default)]
    metrics: RawMetrics,
    ceph: Option<RawCeph>,
    #[serde(default)]
    encryption: encryption::RawEncryption,
    #[serde(default)]
    transfer: transfer::RawTransfer,
    #[serde(default)]
    tls: tls::RawTls,
    #[serde(default)]
    faults: Vec<faults::RawFault>,
    #[serde(default)]
    debug: RawDebug,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDebug {
    write_witness: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawCeph {
    conf: Option<PathBuf>,
    id: Option<String>,
    claim_wait_ms: Option<u64>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    listen: Option<String>,
}

/// A device to put in the pool.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceConfig {
    pub path: PathBuf,
    pub create_size: Option<u64>,
    pub null: Option<spool_devices::NullReads>,
}

/// A volume that must exist (created at start if missing, grown if smaller).
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeConfig {
    pub name: String,
    pub size: u64,
    pub read_only: bool,
    pub num_queues: u16,
    /// Copies it keeps when created (1: plain, 2 or 3: mirrored).
    pub copies: u8,
    /// Its I/O limits when `[volumes.qos]` is present (all rates 0 = none), applied when
    /// spoold starts; `None` leaves whatever the pool table holds.
    pub qos: Option<spool_pool::QosLimits>,
    /// `rbd = "POOL"` or `"POOL/IMAGE"` (docs/ceph.md), checked; `size` is 0 for an attached
    /// image at its own size.
    pub rbd: Option<String>,
    /// Encrypted when created (docs/encryption.md).
    pub encrypt: bool,
    /// Thin when created (docs/thin.md).
    pub thin: bool,
}

/// The validated daemon configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub state_dir: PathBuf,
    pub rpc_socket: PathBuf,
    pub socket_dir: PathBuf,
    pub pool_name: String,
    pub min_extent: u64,
    pub no_direct: bool,
    /// Bytes per second a mirror's resync or rebuild may copy (0: unlimited).
    pub resync_rate: u64,
    /// `[pool] thin_full_wait_ms`: how long a write to a thin volume waits for space.
    pub thin_full_wait: std::time::Duration,
    /// Move mirror legs off failed devices onto free space of other devices at once.
    pub auto_rebuild: bool,
    pub devices: Vec<DeviceConfig>,
    pub volumes: Vec<VolumeConfig>,
    pub poll_idle_us: u64,
    /// Describe NVMe scatter lists that PRPs cannot with SGLs when the controller offers them
    /// (otherwise such requests go through a bounce buffer).
    pub nvme_sgl: bool,
    /// `[io] fair_share`: busy volumes share by weight (docs/qos.md); off: the kernel's
    /// scheduler alone decides, for the most total throughput.
    pub fair_share: bool,
    /// `[io] volume_threads`: threads serving one volume's queues (0: one per queue).
    pub volume_threads: usize,
    /// Journal directory; `None` = journal disabled (Spool-NoJ, benchmarks only).
    pub journal_dir: Option<PathBuf>,
    pub health: HealthConfig,
    /// `[metrics] listen`: where the Prometheus endpoint listens (off when unset).
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// `[ceph]`: the cluster `rbd:POOL/IMAGE` devices are on (docs/ceph.md).
    pub ceph: spool_devices::CephOptions,
    /// The config has a `[ceph]` table: workers connect to the cluster as they start (a
    /// standby long before it serves), so a restart does not wait for the connection.
    pub ceph_configured: bool,
    /// `[ceph] claim_wait_ms`: how long a VM's start on this host waits for another host to
    /// give an RBD volume back (a migration's source draining), default 10 s.
    pub ceph_claim_wait_ms: u64,
    /// `[encryption]`: where the key-encryption key comes from (docs/encryption.md).
    pub encryption: Option<KeySource>,
    /// `[transfer]`: where other spoolds send volumes here (off when unset).
    pub transfer: Option<TransferConfig>,
    /// `[tls] dir`: the x509 credentials of NBD over TLS (docs/security.md); TCP exports
    /// need it (or their `plaintext` option).
    pub tls: Option<PathBuf>,
    /// `[[faults]]`: fault rules armed on every device from its first open, in every worker
    /// (docs/failures.md).
    pub faults: Vec<spool_devices::FaultRule>,
    /// `[debug] write_witness`: the file every guest page the workers write is recorded in
    /// (docs/upgrade.md, "Checking a migration page by page").
    pub write_witness: Option<PathBuf>,
}

/// Default journal directory (tmpfs: the journal must survive the process, not the host).
pub const DEFAULT_JOURNAL_DIR: &str = "/dev/shm/spool";

/// Default number of queues per volume.
pub const DEFAULT_QUEUES: u16 = 2;

/// The config used when none is given: two sparse 2 GiB files and one 1 GiB volume.
pub fn embedded_default(state_dir: &Path) -> String {
    format!(
        r#"# Spool embedded default: file-backed devices under the state directory.
state_dir = "{dir}"

[pool]
name = "pool0"
min_extent = "4M"

[[devices]]
path = "{dir}/dev0.img"
create_size = "2G"

[[devices]]
path = "{dir}/dev1.img"
create_size = "2G"

[[volumes]]
name = "vol0"
size = "1G"
num_queues = 2
"#,
        dir = state_dir.display()
    )
}

/// Makes config paths absolute: relative to the config file's directory; `nvme:DDDD:BB:DD.F`
/// names a controller and `rbd:POOL/IMAGE` an RBD image, not files.
struct Base<'a>(&'a Path);

impl Base<'_> {
    fn abs(&self, p: &Path) -> PathBuf {
        if p.is_absolute()
            || p.to_str()
                .is_some_and(|s| s.starts_with("nvme:") || s.starts_with("rbd:"))
        {
            p.to_path_buf()
        } else {
            self.0.join(p)
        }
    }
}

fn min_extent(pool: &RawPool) -> Result<u64, ConfigError> {
    let min_extent = match &pool.min_extent {
        Some(s) => size_bytes(s, "pool.min_extent")?,
        None => 4 << 20,
    };
    if !min_extent.is_power_of_two() || min_extent < 64 * 1024 {
        return Err(ConfigError::MinExtent(min_extent));
    }
    Ok(min_extent)
}

fn device(d: &RawDevice, base: &Base) -> Result<DeviceConfig, ConfigError> {
    let path = d.path.display().to_string();
    let null = match d.null.as_deref() {
        None => None,
        Some("untouched") => Some(spool_devices::NullReads::Untouched),
        Some("zero") => Some(spool_devices::NullReads::Zero),
        Some(other) => {
            return Err(ConfigError::NullKind {
                path,
                kind: other.into(),
            })
        }
    };
    if null.is_some() && d.create_size.is_none() {
        return Err(ConfigError::NullSize(path));
    }
    Ok(DeviceConfig {
        null,
        path: if null.is_some() {
            d.path.clone()
        } else {
            base.abs(&d.path)
        },
        create_size: d
            .create_size
            .as_ref()
            .map(|s| size_bytes(s, format!("device {path}: create_size")))
            .transpose()?,
    })
}

fn devices(raw: &[RawDevice], base: &Base) -> Result<Vec<DeviceConfig>, ConfigError> {
    let devices = raw
        .iter()
        .map(|d| device(d, base))
        .collect::<Result<Vec<_>, _>>()?;
    let nulls = devices.iter().filter(|d| d.null.is_some()).count();
    if nulls > 0 && nulls < devices.len() {
        return Err(ConfigError::MixedNull);
    }
    Ok(devices)
}

fn volumes(raw: &[RawVolume]) -> Result<Vec<VolumeConfig>, ConfigError> {
    let mut volumes: Vec<VolumeConfig> = Vec::new();
    for v in raw {
        ceph::check_rbd_volume(v)?;
        let size = match &v.size {
            Some(s) => size_bytes(s, format!("volume {}: size", v.name))?,
            None if v.rbd.is_some() => 0,
            None => return Err(ConfigError::VolumeSize(v.name.clone())),
        };
        let queues = v.num_queues.unwrap_or(DEFAULT_QUEUES);
        if !(1..=64).contains(&queues) {
            return Err(ConfigError::Queues {
                volume: v.name.clone(),
                queues,
            });
        }
        if volumes.iter().any(|x| x.name == v.name) {
            return Err(ConfigError::DuplicateVolume(v.name.clone()));
        }
        let copies = v.mirror.unwrap_or(1);
        if !(1..=spool_pool::MAX_COPIES).contains(&copies) {
            return Err(ConfigError::Mirror {
                volume: v.name.clone(),
                copies,
            });
        }
        let qos = v
            .qos
            .as_ref()
            .map(qos_limits)
            .transpose()
            .map_err(|source| ConfigError::Qos {
                volume: v.name.clone(),
                source,
            })?;
        volumes.push(VolumeConfig {
            name: v.name.clone(),
            size,
            read_only: v.read_only,
            num_queues: queues,
            copies,
            qos,
            rbd: v.rbd.clone(),
            encrypt: v.encrypt,
            thin: v.thin,
        });
    }
    Ok(volumes)
}

/// `[volumes.qos]` into limits; keys left out are no limit, the burst defaults to 1s.
fn qos_limits(q: &RawQos) -> Result<spool_pool::QosLimits, QosError> {
    let iops = |v: &Option<RateValue>, what| v.as_ref().map_or(Ok(0), |v| v.iops(what));
    let bps = |v: &Option<RateValue>, what| v.as_ref().map_or(Ok(0), |v| v.bps(what));
    Ok(spool_pool::QosLimits {
        iops: iops(&q.iops, "iops")?,
        read_iops: iops(&q.read_iops, "read_iops")?,
        write_iops: iops(&q.write_iops, "write_iops")?,
        bps: bps(&q.bps, "bps")?,
        read_bps: bps(&q.read_bps, "read_bps")?,
        write_bps: bps(&q.write_bps, "write_bps")?,
        burst_ms: match &q.burst {
            Some(b) => b.burst_ms()?,
            None => spool_pool::qos::DEFAULT_BURST_MS,
        },
        weight: q.weight.unwrap_or(0),
        priority: q.priority.unwrap_or_default(),
    })
}

/// Volume kinds the config may not ask for yet.
fn refuse_unbuilt(volumes: &[VolumeConfig]) -> Result<(), ConfigError> {
    if let Some(v) = volumes.iter().find(|v| v.thin && v.rbd.is_some()) {
        return Err(ConfigError::Invalid(format!(
            "volume {}: a volume on RBD cannot be thin (RBD images are thin already)",
            v.name
        )));
    }
    if let Some(v) = volumes.iter().find(|v| v.encrypt && v.rbd.is_some()) {
        return Err(ConfigError::Encryption(format!(
            "volume {}: RBD volumes cannot be encrypted by spoold yet (use Ceph's own encryption)",
            v.name
        )));
    }
    Ok(())
}

impl Config {
    /// Parses and validates a TOML config. Relative paths are taken relative to `base`.
    pub fn parse(text: &str, base: &Path) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text)?;
        let base = Base(base);
        let state_dir = base.abs(&raw.state_dir);
        let min_extent = min_extent(&raw.pool)?;
        let devices = devices(&raw.devices, &base)?;
        let volumes = volumes(&raw.volumes)?;
        let health = health(&raw.health, &base)?;
        let metrics_listen = raw
            .metrics
            .listen
            .as_ref()
            .map(|a| a.parse().map_err(|_| ConfigError::MetricsListen(a.clone())));
        let ceph = ceph::options(&raw.ceph.clone().unwrap_or_default(), &base)?;
        let encryption = match raw.encryption.source()? {
            Some(KeySource::File(p)) => Some(KeySource::File(base.abs(&p))),
            other => other,
        };
        refuse_unbuilt(&volumes)?;
        Ok(Config {
            transfer: transfer::transfer(&raw.transfer)?,
            tls: tls::tls(&raw.tls, &base)?,
            faults: faults::faults(&raw.faults)?,
            write_witness: raw.debug.write_witness.as_deref().map(|p| base.abs(p)),
            encryption,
            health,
            metrics_listen: metrics_listen.transpose()?,
            ceph,
            ceph_configured: raw.ceph.is_some(),
            ceph_claim_wait_ms: ceph::claim_wait_ms(raw.ceph.as_ref())?,
            rpc_socket: raw
                .rpc_socket
                .as_deref()
                .map(|p| base.abs(p))
                .unwrap_or_else(|| state_dir.join("spoold.sock")),
            socket_dir: raw
                .socket_dir
                .as_deref()
                .map(|p| base.abs(p))
                .unwrap_or_else(|| state_dir.join("vhost")),
            state_dir,
            pool_name: raw.pool.name.unwrap_or_else(|| "pool0".into()),
            min_extent,
            no_direct: raw.pool.no_direct,
            resync_rate: match &raw.pool.resync_rate {
                Some(r) => size_bytes(r, "pool.resync_rate")?,
                None => spool_pool::DEFAULT_RESYNC_RATE,
            },
            auto_rebuild: raw.pool.auto_rebuild.unwrap_or(true),
            thin_full_wait: raw.pool.thin_full_wait_ms.map_or(
                spool_pool::DEFAULT_FULL_WAIT,
                std::time::Duration::from_millis,
            ),
            devices,
            volumes,
            poll_idle_us: raw.io.poll_idle_us.unwrap_or(50),
            nvme_sgl: raw.io.nvme_sgl.unwrap_or(true),
            fair_share: raw.io.fair_share.unwrap_or(true),
            volume_threads: volume_threads(raw.io.volume_threads)?,
            journal_dir: raw.journal.enabled.then(|| {
                raw.journal
                    .dir
                    .as_deref()
                    .map(|p| base.abs(p))
                    .unwrap_or_else(|| PathBuf::from(DEFAULT_JOURNAL_DIR))
            }),
        })
    }

    /// Reads a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        let base = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        Config::parse(&text, &base).map_err(|e| ConfigError::InFile {
            path: shown,
            source: Box::new(e),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_parses() {
        let c = Config::parse(&embedded_default(Path::new("/tmp/s")), Path::new("/")).unwrap();
        assert_eq!(c.devices.len(), 2);
        assert_eq!(c.devices[0].create_size, Some(2 << 30));
        assert_eq!(c.volumes[0].size, 1 << 30);
        assert_eq!(c.rpc_socket, Path::new("/tmp/s/spoold.sock"));
        assert_eq!(c.socket_dir, Path::new("/tmp/s/vhost"));
    }

    #[test]
    fn bad_configs_say_what_is_wrong() {
        for (text, needle) in [
            ("state_dir = 1", "state_dir"),
            (
                "state_dir = \"/x\"\n[health]\nio_timeout_ms = 0",
                "health.io_timeout_ms must be positive",
            ),
            ("state_dir = \"/x\"\n[health]\nretries = 1", "retries"),
            ("state_dir = \"/x\"\nbogus = 1", "bogus"),
            (
                "state_dir = \"/x\"\n[pool]\nmin_extent = \"3M\"",
                "power of two",
            ),
            (
                "state_dir = \"/x\"\n[metrics]\nlisten = \"localhost\"",
                "metrics.listen: \"localhost\" is not an address and port",
            ),
            (
                "state_dir = \"/x\"\n[transfer]\nlisten = \"127.0.0.1:10810\"",
                "transfer.listen needs transfer.peers",
            ),
            (
                "state_dir = \"/x\"\n[transfer]\npeers = [\"10.0.0.1\"]",
                "transfer.peers without transfer.listen",
            ),
            (
                "state_dir = \"/x\"\n[transfer]\nlisten = \"b:1\"\npeers = [\"10.0.0.1\"]",
                "give IP:PORT",
            ),
            (
                "state_dir = \"/x\"\n[transfer]\nlisten = \"10.0.0.2:1\"\npeers = [\"a\"]",
                "transfer.peers: \"a\" is not an IP address",
            ),
            (
                "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nsize = \"lots\"",
                "volume a: size",
            ),
            (
                "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"",
                "volume a: size is required",
            ),
            (
                "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nrbd = \"rbd\"",
                "volume a: rbd: a size is needed",
            ),
            (
                "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nrbd = \"rbd/x@snap\"",
                "volume a: rbd: rbd image",
            ),
            (
                "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nsize = 512\nrbd = \"rbd\"\nmirror = 2",
                "replicated by Ceph",
            ),
            (
                "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nsize = 512\nnum_queues = 0",
                "num_queues",
            ),
            (
                "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nsize = 512\n[volumes.qos]\niopz = 1",
                "unknown field `iopz`",
            ),
            (
                "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nsize = 512\n[volumes.qos]\niops = \"fast\"",
                "volume a: qos: iops \"fast\" is not an IOPS rate",
            ),
            (
                "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nsize = 512\n[volumes.qos]\nbps = -1",
                "volume a: qos: bps -1 is not a bandwidth",
            ),
            (
                "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nsize = 512\n[volumes.qos]\nburst = \"0ms\"",
                "burst \"0ms\" must be between 1ms",
            ),
            (
                "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nsize = 512\n[volumes.qos]\nburst = 250",
                "burst 250 is not a duration",
            ),
        ] {
            let e = Config::parse(text, Path::new("/")).unwrap_err().to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn volume_qos_applies_to_the_volume_above_it() {
        let c = Config::parse(
            r#"state_dir = "/x"
[[volumes]]
name = "a"
size = "1M"
[volumes.qos]
iops = "20k"
write_bps = "200M"
read_bps = 1048576
burst = "250ms"
[[volumes]]
name = "b"
size = "1M"
"#,
            Path::new("/"),
        )
        .unwrap();
        let q = c.volumes[0].qos.unwrap();
        assert_eq!(
            (q.iops, q.write_bps, q.read_bps),
            (20_000, 200 << 20, 1 << 20)
        );
        assert_eq!((q.read_iops, q.bps, q.burst_ms), (0, 0, 250));
        assert_eq!(c.volumes[1].qos, None);
        let c = Config::parse(
            "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nsize = 512\n[volumes.qos]\n",
            Path::new("/"),
        )
        .unwrap();
        let empty = c.volumes[0].qos.unwrap();
        assert!(empty.is_unlimited() && empty.burst_ms == 1000);
    }

    #[test]
    fn rbd_volumes_name_a_pool_or_an_image() {
        let c = Config::parse(
            "state_dir = \"/x\"\n[[volumes]]\nname = \"a\"\nsize = \"1G\"\nrbd = \"rbd\"\n[[volumes]]\nname = \"b\"\nrbd = \"rbd/img\"",
            Path::new("/"),
        )
        .unwrap();
        assert_eq!(c.volumes[0].rbd.as_deref(), Some("rbd"));
        assert_eq!(
            (c.volumes[1].rbd.as_deref(), c.volumes[1].size),
            (Some("rbd/img"), 0)
        );
        assert!(!c.ceph_configured);
    }

    #[test]
    fn the_ceph_claim_wait_has_a_default_and_a_bound() {
        let parse = |t: &str| Config::parse(&format!("state_dir = \"/x\"\n{t}"), Path::new("/"));
        assert_eq!(parse("").unwrap().ceph_claim_wait_ms, 10_000);
        assert_eq!(
            parse("[ceph]\nclaim_wait_ms = 0")
                .unwrap()
                .ceph_claim_wait_ms,
            0
        );
        let e = parse("[ceph]\nclaim_wait_ms = 600001")
            .unwrap_err()
            .to_string();
        assert!(e.contains("claim_wait_ms") && e.contains("600000"), "{e}");
        assert!(parse("[ceph]\nclaim_wait_ms = -1").is_err());
    }

    /// `[io] volume_threads`: the cores by default, 0 (a thread per queue) to 64, nothing else.
    #[test]
    fn volume_threads_defaults_to_the_cores_and_is_bounded() {
        let parse =
            |io: &str| Config::parse(&format!("state_dir = \"/x\"\n[io]\n{io}"), Path::new("/"));
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(parse("").unwrap().volume_threads, cores.min(64));
        assert_eq!(parse("volume_threads = 0").unwrap().volume_threads, 0);
        assert_eq!(parse("volume_threads = 64").unwrap().volume_threads, 64);
        let e = parse("volume_threads = 65").unwrap_err().to_string();
        assert!(e.contains("io.volume_threads: 65 must be 0"), "{e}");
        assert!(parse("volume_threads = -1").is_err());
        assert!(parse("volume_threads = \"all\"").is_err());
    }

    #[test]
    fn relative_paths_are_relative_to_the_config_file() {
        let c = Config::parse(
            "state_dir = \"st\"\n[[devices]]\npath = \"d.img\"\ncreate_size = 1048576",
            Path::new("/etc/spool"),
        )
        .unwrap();
        assert_eq!(c.state_dir, Path::new("/etc/spool/st"));
        assert_eq!(c.devices[0].path, Path::new("/etc/spool/d.img"));
    }
}
