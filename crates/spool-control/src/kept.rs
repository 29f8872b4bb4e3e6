//! What spoold keeps with the keeper across worker restarts, by key: the names of the keys and
//! the typed values of those this crate writes (the kept device health, the state format).
//! The values under `vol/` (listener, session) and the devices layer's prefix (`nvme/` today)
//! belong to the frontend and to device backends; this module only names their prefixes.
//!
//! Must not know: the keeper's protocol (it stores strings and descriptors) or the daemon.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Key prefix of kept device health states (`health/UUID`).
pub const HEALTH_PREFIX: &str = "health/";
/// Key of the RPC listening socket.
pub const RPC_LISTEN_KEY: &str = "rpc/listen";
/// The metrics endpoint's listening TCP socket (`[metrics] listen`).
pub const METRICS_LISTEN_KEY: &str = "metrics/listen";
/// Key of the key-encryption keys a worker hands the next (`daemon::kept_keys`).
pub const KEK_KEY: &str = "keys/kek";
/// Key naming the state formats the running worker writes.
pub const FORMAT_KEY: &str = "meta/state-format";
/// Key prefix of everything the frontend keeps for a volume (`vol/UUID/…`).
pub const VOLUME_PREFIX: &str = "vol/";
/// Key suffix of a volume's session state (`vol/UUID/session`).
pub const SESSION_SUFFIX: &str = "/session";
/// Key prefix of the NVMe controllers the driver hands over.
pub use spool_devices::handoff::PREFIX as DEVICE_PREFIX;

/// The key of a device's kept health state.
pub fn health_key(device: Uuid) -> String {
    format!("{HEALTH_PREFIX}{device}")
}

/// The state formats a worker writes (`meta/state-format`, and `state_format` in
/// `daemon_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateFormat {
    /// Format of the frontend's `SessionState`.
    pub session: u32,
}

impl StateFormat {
    /// The formats this binary writes.
    pub fn current() -> StateFormat {
        StateFormat {
            session: spool_frontend::SESSION_STATE_FORMAT,
        }
    }
}

/// An isolated device state, the only states kept (isolation outlives the worker).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IsolatedState {
    Failed,
    Removed,
}

impl IsolatedState {
    /// The isolated state named `name` (`None` for healthy or resetting).
    pub fn from_name(name: &str) -> Option<IsolatedState> {
        match name {
            "failed" => Some(IsolatedState::Failed),
            "removed" => Some(IsolatedState::Removed),
            _ => None,
        }
    }

    /// As the device layer's health state.
    pub fn health_state(self) -> spool_devices::HealthState {
        match self {
            IsolatedState::Failed => spool_devices::HealthState::Failed,
            IsolatedState::Removed => spool_devices::HealthState::Removed,
        }
    }
}

/// A device's kept health state (`health/UUID` → `{"state": "failed", "reason": "…"}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptHealth {
    // In this order, the bytes are those earlier workers wrote (sorted keys).
    #[serde(default)]
    pub reason: String,
    pub state: IsolatedState,
}

impl KeptHealth {
    /// Reads a kept entry: the device of `key` and its state; `None` when unreadable.
    pub fn parse(key: &str, value: &str) -> Option<(Uuid, KeptHealth)> {
        let uuid = key.strip_prefix(HEALTH_PREFIX)?.parse().ok()?;
        let v: serde_json::Value = serde_json::from_str(value).ok()?;
        let state = IsolatedState::from_name(v.get("state")?.as_str()?)?;
        let reason = v.get("reason").and_then(|r| r.as_str()).unwrap_or("");
        Some((
            uuid,
            KeptHealth {
                state,
                reason: reason.to_string(),
            },
        ))
    }

    /// The value to keep.
    pub fn to_value(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_health_round_trips_in_the_old_format() {
        let u = Uuid::new_v4();
        let k = KeptHealth {
            state: IsolatedState::Removed,
            reason: "gone".into(),
        };
        // Byte for byte what earlier workers wrote (json! sorts the keys).
        let old = serde_json::json!({"state": "removed", "reason": "gone"}).to_string();
        assert_eq!(k.to_value(), old);
        assert_eq!(KeptHealth::parse(&health_key(u), &old), Some((u, k)));
        assert_eq!(
            KeptHealth::parse(&health_key(u), r#"{"state":"healthy"}"#),
            None
        );
        assert_eq!(KeptHealth::parse("health/x", &old), None);
        assert_eq!(
            serde_json::to_string(&StateFormat { session: 3 }).unwrap(),
            r#"{"session":3}"#
        );
    }
}
