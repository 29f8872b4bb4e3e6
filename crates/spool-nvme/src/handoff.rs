//! Keeping controllers alive across worker restarts (Spool §5.2): the VFIO container, group
//! and device descriptors and each controller's *arena* (a memfd with the admin queue and a
//! header describing the queues) are deposited with a keeper process; the next worker gets
//! them back, re-attaches to the live admin queue, retires the previous worker's I/O queues
//! with Delete SQ/CQ (the controller aborts what they still held, so no old command can land
//! after a resubmitted one) and carries on, without a controller reset.
//!
//! This module only moves descriptors: the daemon supplies a [`Keeper`] (its keeper link)
//! and offers what the previous worker left with [`offer`]. Other backends of the devices
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

static KEEPER: Mutex<Option<Arc<dyn Keeper>>> = Mutex::new(None);
type Offered = HashMap<String, (String, Vec<File>)>;
static OFFERED: Mutex<Option<Offered>> = Mutex::new(None);

/// Key prefix of everything this driver deposits.
pub const PREFIX: &str = "nvme/";
/// Key prefix of the null devices' metadata (`null/NAME`).
pub const NULL_PREFIX: &str = "null/";
/// Every prefix deposited through this module: what the daemon offers back.
pub const PREFIXES: [&str; 2] = [PREFIX, NULL_PREFIX];

/// Deposit descriptors with `k` from now on.
pub fn set_keeper(k: Arc<dyn Keeper>) {
    *KEEPER.lock().unwrap_or_else(|p| p.into_inner()) = Some(k);
}

/// Hands over what the previous worker deposited under [`PREFIXES`].
pub fn offer(key: String, value: String, files: Vec<File>) {
    OFFERED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, (value, files));
}

/// What the previous worker deposited under `key`, taken (once).
pub fn take(key: &str) -> Option<(String, Vec<File>)> {
    OFFERED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_mut()?
        .remove(key)
}

/// Keys of offered controllers (`nvme/ctrl/<bdf>`), in order.
pub(crate) fn offered_controllers() -> Vec<String> {
    let g = OFFERED.lock().unwrap_or_else(|p| p.into_inner());
    let mut v: Vec<String> = g
        .iter()
        .flat_map(|m| m.keys())
        .filter_map(|k| k.strip_prefix(CTRL_PREFIX).map(str::to_string))
        .collect();
    v.sort();
    v
}

pub(crate) fn has_keeper() -> bool {
    KEEPER.lock().unwrap_or_else(|p| p.into_inner()).is_some()
}

/// Deposits `value` and copies of `fds` under `key` (nothing without a keeper).
pub fn keep(key: &str, value: String, fds: &[RawFd]) {
    if let Some(k) = KEEPER.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        k.put(key, value, fds);
    }
}

pub(crate) fn withdraw(key: &str) {
    if let Some(k) = KEEPER.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        k.remove(key);
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
