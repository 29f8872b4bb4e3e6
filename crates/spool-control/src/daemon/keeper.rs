//! The daemon's side of the keeper: what the previous worker left (`Keeping`), and the keeper
//! link seen as the frontend's state store and as the NVMe driver's descriptor store.

use std::sync::{Arc, Mutex};

use spool_frontend::StateStore;
use spool_keeper::{KeeperLink, Restored};

/// The worker's keeper: where state is deposited, and what the previous worker left.
pub struct Keeping {
    pub link: Arc<KeeperLink>,
    pub restored: Mutex<Restored>,
}

impl Keeping {
    /// Takes what the previous worker kept under `key`.
    pub(super) fn take(&self, key: &str) -> Option<(String, Vec<std::fs::File>)> {
        self.restored().take(key)
    }

    /// Keys still kept and not taken, starting with `prefix`.
    pub(super) fn keys(&self, prefix: &str) -> Vec<String> {
        let mut keys = self.restored().keys();
        keys.retain(|k| k.starts_with(prefix));
        keys
    }

    /// What the previous worker left, and how this one was started.
    pub(super) fn restored(&self) -> std::sync::MutexGuard<'_, Restored> {
        self.restored.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The keeper as the frontend's state store.
pub(super) struct KeeperStore(pub Arc<KeeperLink>);

impl StateStore for KeeperStore {
    fn put(&self, key: &str, value: String, fds: &[std::os::fd::RawFd]) -> std::io::Result<()> {
        self.0.put(key, value, fds)
    }
    fn remove(&self, prefix: &str) -> std::io::Result<()> {
        self.0.remove(prefix)
    }
}

/// The keeper as the devices layer's descriptor store (backend state kept across restarts).
pub(super) struct DeviceKeeper(pub Arc<KeeperLink>);

impl spool_devices::handoff::Keeper for DeviceKeeper {
    fn put(&self, key: &str, value: String, fds: &[std::os::fd::RawFd]) {
        if let Err(e) = self.0.put(key, value, fds) {
            tracing::error!(
                key,
                "cannot deposit device state with the keeper: {e}; a crash now loses it (an NVMe controller is reset, a null pool starts anew)"
            );
        }
    }
    fn remove(&self, key: &str) {
        if let Err(e) = self.0.remove(key) {
            tracing::error!(key, "keeper: {e}");
        }
    }
}
