//! Keeping controllers alive across worker restarts (Spool §5.2): the VFIO container, group
//! and device descriptors and each controller's *arena* (a memfd with the admin queue and a
//! header describing the queues) are deposited with a keeper process; the next worker gets
//! them back, re-attaches to the live admin queue, retires the previous worker's I/O queues
//! with Delete SQ/CQ (the controller aborts what they still held, so no old command can land
//! after a resubmitted one) and carries on, without a controller reset.
//!
//! This module only moves descriptors: the daemon makes a [`Handoff`], supplies its
//! [`Keeper`] (its keeper link), offers what the previous worker left with
//! [`Handoff::offer`], and passes it to every device it opens. Other backends of the devices
//! layer keep theirs through it too, under their own prefix in [`PREFIXES`] (the null
//! device's metadata memfd: a pool on null devices survives a worker restart).

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

/// Where descriptors are deposited (the daemon's keeper link).
pub trait Keeper: Send + Sync {
    /// Stores `value` and copies of `fds` under `key`, replacing what was there.
    fn put(&self, key: &str, value: String, fds: &[RawFd]);
    /// Forgets `key` (the keeper closes its copies).
    fn remove(&self, key: &str);
}

type Offered = HashMap<String, (String, Vec<File>)>;

/// Key prefix of everything this driver deposits.
pub const PREFIX: &str = "nvme/";
/// Key prefix of the null devices' metadata (`null/NAME`).
pub const NULL_PREFIX: &str = "null/";
/// Every prefix deposited through this module: what the daemon offers back.
pub const PREFIXES: [&str; 2] = [PREFIX, NULL_PREFIX];

/// One daemon's handoff: the keeper it deposits with, and what the previous worker left for
/// it. Made by the daemon and passed down to the devices it opens (`OpenOptions`); the
/// default has no keeper (nothing is kept: a process without one) and nothing offered.
#[derive(Default)]
pub struct Handoff {
    keeper: Mutex<Option<Arc<dyn Keeper>>>,
    offered: Mutex<Offered>,
}

impl std::fmt::Debug for Handoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoff")
            .field("keeper", &self.has_keeper())
            .field("offered", &self.lock_offered().len())
            .finish()
    }
}

impl Handoff {
    fn lock_offered(&self) -> std::sync::MutexGuard<'_, Offered> {
        self.offered.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn keeper(&self) -> Option<Arc<dyn Keeper>> {
        self.keeper
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Deposit descriptors with `k` from now on.
    pub fn set_keeper(&self, k: Arc<dyn Keeper>) {
        *self.keeper.lock().unwrap_or_else(|p| p.into_inner()) = Some(k);
    }

    /// Hands over what the previous worker deposited under [`PREFIXES`].
    pub fn offer(&self, key: String, value: String, files: Vec<File>) {
        self.lock_offered().insert(key, (value, files));
    }

    /// What the previous worker deposited under `key`, taken (once).
    pub fn take(&self, key: &str) -> Option<(String, Vec<File>)> {
        self.lock_offered().remove(key)
    }

    /// Keys of offered controllers (`nvme/ctrl/<bdf>`), in order.
    pub(crate) fn offered_controllers(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .lock_offered()
            .keys()
            .filter_map(|k| k.strip_prefix(CTRL_PREFIX).map(str::to_string))
            .collect();
        v.sort();
        v
    }

    pub(crate) fn has_keeper(&self) -> bool {
        self.keeper
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Deposits `value` and copies of `fds` under `key` (nothing without a keeper).
    pub fn keep(&self, key: &str, value: String, fds: &[RawFd]) {
        if let Some(k) = self.keeper() {
            k.put(key, value, fds);
        }
    }

    pub(crate) fn withdraw(&self, key: &str) {
        if let Some(k) = self.keeper() {
            k.remove(key);
        }
    }
}

pub(crate) const CONTAINER_KEY: &str = "nvme/container";
pub(crate) const CTRL_PREFIX: &str = "nvme/ctrl/";
pub(crate) fn group_key(n: u32) -> String {
    format!("nvme/group/{n}")
}
pub(crate) fn ctrl_key(bdf: &str) -> String {
    format!("{CTRL_PREFIX}{bdf}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<String>>);

    impl Keeper for Recorder {
        fn put(&self, key: &str, value: String, fds: &[RawFd]) {
            let mut log = self.0.lock().unwrap();
            log.push(format!("put {key} {value} {}", fds.len()));
        }
        fn remove(&self, key: &str) {
            self.0.lock().unwrap().push(format!("remove {key}"));
        }
    }

    #[test]
    fn a_handoff_keeps_through_its_keeper_and_gives_each_offer_once() {
        let h = Handoff::default();
        h.keep("nvme/ctrl/a", "{}".into(), &[]);
        h.withdraw("nvme/ctrl/a");
        assert!(!h.has_keeper(), "nothing is kept without a keeper");
        let k = Arc::new(Recorder::default());
        h.set_keeper(k.clone());
        h.keep("null/x", "v".into(), &[0]);
        h.withdraw("null/x");
        assert_eq!(*k.0.lock().unwrap(), ["put null/x v 1", "remove null/x"]);
        for key in ["nvme/ctrl/0000:02:00.0", "null/y", "nvme/ctrl/0000:01:00.0"] {
            h.offer(key.into(), key.into(), Vec::new());
        }
        assert_eq!(
            h.offered_controllers(),
            ["0000:01:00.0", "0000:02:00.0"],
            "controllers only, in order"
        );
        assert_eq!(h.take("null/y").map(|(v, _)| v).as_deref(), Some("null/y"));
        assert!(h.take("null/y").is_none(), "taken once");
        // Another daemon's handoff shares nothing with this one.
        assert!(Handoff::default().take("nvme/ctrl/0000:01:00.0").is_none());
    }
}
