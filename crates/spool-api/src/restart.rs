//! Restarts and upgrades as `daemon_status` and `daemon_upgrade` report them: the keeper's
//! measurement of each (phases, stall) and its running totals by kind.
//!
//! Owns: the wire shape of those reports. Must not know: the keeper's channel (the daemon
//! converts the keeper's own report into these).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A named restart phase and how long it took.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Phase {
    pub name: String,
    pub ms: f64,
}

/// One restart or upgrade, as the keeper measured it.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct RestartReport {
    /// `crash-restart`, `upgrade`, `rollback`.
    pub kind: String,
    pub old_pid: u32,
    pub new_pid: u32,
    /// Binary of the new worker.
    pub binary: String,
    /// µs since the epoch when service stopped (quiesce began, or the worker died).
    pub began_us: u64,
    /// Phases in order; for upgrades `prepare` happens before service stops.
    pub phases: Vec<Phase>,
    /// From service stopping to the new worker serving (ms).
    pub stall_ms: f64,
    /// `ok`, or why it failed and what was done instead.
    pub outcome: String,
    /// Restarts and upgrades so far by kind, this one included.
    #[serde(default)]
    pub counts: BTreeMap<String, u64>,
    /// Every restart and upgrade so far by kind (the keys of `counts`).
    #[serde(default)]
    pub history: BTreeMap<String, KindHistory>,
}

/// The restarts of one kind, accumulated by the keeper.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct KindHistory {
    /// Stalls per bucket of [`STALL_BUCKETS_MS`] (not cumulative; the last: slower).
    pub stall_buckets: Vec<u64>,
    /// Sum of the stalls, ms.
    pub stall_sum_ms: f64,
    /// Each phase's duration summed over these restarts, ms.
    pub phase_sum_ms: BTreeMap<String, f64>,
}

/// Upper bounds (ms) of the restart-stall histogram's buckets; one more bucket counts slower.
pub const STALL_BUCKETS_MS: [f64; 12] = [
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
];
