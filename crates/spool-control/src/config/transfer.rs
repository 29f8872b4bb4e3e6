//! `[transfer]` (docs/transfer.md): where spoold listens for another spoold sending it a
//! volume, and which peers may.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use serde::Deserialize;

use super::ConfigError;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTransfer {
    listen: Option<String>,
    #[serde(default)]
    peers: Vec<String>,
}

/// The transfer listener, when configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferConfig {
    /// `IP:PORT`.
    pub listen: SocketAddr,
    /// The addresses senders may connect from (the hello and the NBD connections alike).
    pub peers: Arc<[IpAddr]>,
}

/// `[transfer]` checked: off without `listen`; with it, `peers` lists at least one address.
pub(super) fn transfer(t: &RawTransfer) -> Result<Option<TransferConfig>, ConfigError> {
    let Some(listen) = &t.listen else {
        if !t.peers.is_empty() {
            return Err(ConfigError::Invalid(
                "transfer.peers without transfer.listen".into(),
            ));
        }
        return Ok(None);
    };
    let listen: SocketAddr = listen.parse().map_err(|_| {
        ConfigError::Invalid(format!(
            "transfer.listen = {listen:?}: give IP:PORT (for example \"10.0.0.2:10810\")"
        ))
    })?;
    if t.peers.is_empty() {
        return Err(ConfigError::Invalid(
            "transfer.listen needs transfer.peers: the addresses of the hosts that may send volumes here".into(),
        ));
    }
    let peers = t
        .peers
        .iter()
        .map(|p| {
            p.parse::<IpAddr>().map_err(|_| {
                ConfigError::Invalid(format!("transfer.peers: {p:?} is not an IP address"))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(TransferConfig {
        listen,
        peers: peers.into(),
    }))
}
