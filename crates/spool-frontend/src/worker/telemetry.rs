//! What a queue worker counts and reports: its share of the volume's statistics (counts
//! kept in a tally and published once a busy round), the clock the restart report's "first
//! I/O" is read from, and the warnings a guest can trigger, each rate-limited.
//!
//! Owns: the telemetry state of one queue. Must not know: the ring, the devices, the
//! in-flight table.

use std::sync::Arc;

use crate::ratelimit::{self, LogLimit};
use crate::stats::{Tally, VolumeStats};

/// One queue's telemetry.
pub(super) struct Telemetry {
    /// Whether this worker completed a request yet (the restart report's "first I/O").
    pub(super) served_one: bool,
    /// Guest-triggered warnings, rate-limited per worker (a guest must not flood the log).
    pub(super) dup_log: LogLimit,
    /// Malformed chains refused (rate-limited warnings).
    pub(super) rejected_log: LogLimit,
    pub(super) io_err_log: LogLimit,
    pub(super) clock: Arc<crate::StartClock>,
    pub(super) stats: Arc<VolumeStats>,
    /// The poll round's clock ([`crate::stats::now_ticks`]) once read, 0 until then: requests
    /// are stamped when taken and measured when completed with one read per busy round.
    pub(super) now_ticks: u64,
    /// Counts not yet published to `stats`.
    pub(super) tally: Tally,
    /// Where every guest page the worker writes is recorded, if anywhere.
    pub(super) witness: Option<Arc<crate::witness::WriteWitness>>,
}

impl Telemetry {
    /// Counting into `stats`, the restart report's first I/O read from `clock`, the pages
    /// written recorded in `witness`.
    pub(super) fn new(
        stats: Arc<VolumeStats>,
        clock: Arc<crate::StartClock>,
        witness: Option<Arc<crate::witness::WriteWitness>>,
    ) -> Self {
        Telemetry {
            witness,
            stats,
            tally: Tally::default(),
            now_ticks: 0,
            served_one: false,
            clock,
            dup_log: ratelimit::guest_warning(),
            rejected_log: ratelimit::guest_warning(),
            io_err_log: ratelimit::guest_warning(),
        }
    }
}
