//! `[ceph]` and the `rbd` key of `[[volumes]]` (docs/ceph.md): where the cluster is, who
//! spoold is to it, and what a volume on an RBD image may say.

use super::{Base, ConfigError, RawCeph, RawVolume};

/// `[ceph]` checked, with its defaults.
pub(super) fn options(c: &RawCeph, base: &Base) -> Result<spool_devices::CephOptions, ConfigError> {
    let d = spool_devices::CephOptions::default();
    let id = c.id.clone().unwrap_or(d.id);
    if id.is_empty() || id.starts_with("client.") || id.contains(['\0', ' ']) {
        return Err(ConfigError::CephId(id));
    }
    Ok(spool_devices::CephOptions {
        conf: c.conf.as_deref().map(|p| base.abs(p)).unwrap_or(d.conf),
        id,
    })
}

/// `[ceph] claim_wait_ms`: 10 s by default, at most 10 minutes.
pub(super) fn claim_wait_ms(c: Option<&RawCeph>) -> Result<u64, ConfigError> {
    match c.and_then(|c| c.claim_wait_ms) {
        None => Ok(10_000),
        Some(ms) if ms <= 600_000 => Ok(ms),
        Some(ms) => Err(ConfigError::CephClaimWait(ms)),
    }
}

/// A volume that names an RBD pool or image: a name Ceph accepts, no mirror (Ceph
/// replicates), and a size unless an existing image is attached.
pub(super) fn check_rbd_volume(v: &RawVolume) -> Result<(), ConfigError> {
    if let Some(r) = &v.rbd {
        let target = spool_pool::RbdTarget::parse(r).map_err(|e| ConfigError::Rbd {
            volume: v.name.clone(),
            msg: match e {
                spool_pool::Error::InvalidArgument(m) => m,
                e => e.to_string(),
            },
        })?;
        let why = if v.mirror.is_some_and(|m| m > 1) {
            Some("an RBD volume is replicated by Ceph: mirror does not apply")
        } else if v.size.is_none() && target.attach.is_none() {
            Some("a size is needed to create an RBD image")
        } else {
            None
        };
        if let Some(msg) = why {
            return Err(ConfigError::Rbd {
                volume: v.name.clone(),
                msg: msg.into(),
            });
        }
    }
    Ok(())
}
