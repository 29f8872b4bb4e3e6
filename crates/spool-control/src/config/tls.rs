//! `[tls]` (docs/security.md): the x509 credentials of spoold's NBD exports and of its
//! `nbds://` connections, a directory laid out as QEMU's `tls-creds-x509` (`ca-cert.pem`,
//! `server-cert.pem`, `server-key.pem`, `client-cert.pem`, `client-key.pem`).

use std::path::PathBuf;

use serde::Deserialize;

use super::ConfigError;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    dir: Option<String>,
}

/// `[tls] dir`, resolved against the config's directory; checked at start (the files are
/// read when spoold starts, so a bad one stops it with the reason).
pub(super) fn tls(t: &RawTls, base: &super::Base<'_>) -> Result<Option<PathBuf>, ConfigError> {
    match &t.dir {
        None => Ok(None),
        Some(d) if d.is_empty() => Err(ConfigError::Invalid(
            "tls.dir is empty: give the directory of ca-cert.pem, server-cert.pem and server-key.pem".into(),
        )),
        Some(d) => Ok(Some(base.abs(std::path::Path::new(d)))),
    }
}
