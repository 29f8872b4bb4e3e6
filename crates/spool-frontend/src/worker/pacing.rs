//! A queue worker's pacing: the volume's I/O limits (its token buckets, shared by its
//! queues) and its fair share of a contended core or device (`share.rs`), as one queue
//! applies them when it takes requests from its ring (`run.rs`).
//!
//! Owns: the pacing state of one queue. Must not know: the ring, the devices, the
//! in-flight table.

use std::sync::Arc;

use spool_pool::QosLimits;

use crate::qos::VolumeQos;
use crate::share::{ShareGroup, VolumeShare};

/// How one queue paces what it takes.
pub(super) struct Pacing {
    /// The volume's buckets, and the same while the layout sets limits (None: no QoS, and
    /// the take loop is the one without any check).
    pub(super) qos_shared: Arc<VolumeQos>,
    pub(super) qos: Option<Arc<VolumeQos>>,
    /// The limits last seen in a layout (to notice a change).
    pub(super) qos_seen: Option<QosLimits>,
    /// Set by a take loop stopped by a bucket in debt: how long (ns) until it may take
    /// again. The worker then sleeps in epoll for that long instead of on a kick.
    pub(super) throttled: Option<u64>,
    pub(super) share: Arc<VolumeShare>,
    pub(super) share_group: Arc<ShareGroup>,
    pub(super) fair_share: bool,
    /// The scheduling class this thread is in.
    pub(super) priority: spool_pool::Priority,
    /// Set when the volume was ahead of its fair share with requests waiting: the thread
    /// pauses after the round (see `group.rs`).
    pub(super) stepped_aside: bool,
    /// Most requests a round takes (see [`super::INLINE_TAKE_BUDGET`]; unlimited otherwise).
    pub(super) take_budget: u64,
    /// Whether the thread's cores are contended (set by its group).
    pub(super) contended: bool,
    /// Whether this queue counts as busy in the share group (requests waiting or in flight).
    pub(super) share_busy: bool,
    /// Whether it had more than one request in flight since it became busy (`share::LINGER`).
    pub(super) share_deep: bool,
}
