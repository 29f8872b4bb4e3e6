//! The wire form of receiving a volume's data from another host (docs/transfer.md): the
//! volume served as a writable NBD export until a frontend starts it or the operator stops
//! the transfer.

use serde::{Deserialize, Serialize};

/// `volume_receive`: serve volume `id` as a writable NBD export on `nbd` (`unix:PATH` or
/// `HOST:PORT`), for a sender (another spoold, `qemu-img convert`, `nbdcopy`) to write.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiveParams {
    pub id: String,
    pub nbd: String,
}

/// `volume_receive_stop`: stop receiving volume `id`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiveStopParams {
    pub id: String,
}

/// A volume being received, or (from `volume_receive_stop`) one that was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiveInfo {
    pub volume: String,
    /// Where it listens (`unix:PATH` or `HOST:PORT`).
    pub nbd: String,
    /// The NBD URI senders use.
    pub uri: String,
    pub size: u64,
    /// Bytes written (data and zeroes) so far.
    pub written: u64,
    /// Why it ended, once it has (`stopped`, `a frontend started the volume`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<String>,
}
