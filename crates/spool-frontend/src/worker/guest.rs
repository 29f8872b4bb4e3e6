//! The guest's memory as one queue worker maps it: the frontend's current map (one atomic
//! load to check per round), the host addresses of the map the worker last loaded, and the
//! earlier maps kept mapped while requests taken under them are in flight.
//!
//! Owns: which maps a worker holds. Must not know: the ring, the devices, the in-flight
//! table (the worker retires a map when the table says nothing taken under it is left).

use std::sync::Arc;

use arc_swap::{ArcSwap, Cache};

use crate::hostmem::HostMap;
use crate::request::GuestMemory;

/// One worker's guest memory maps.
pub(super) struct GuestMaps {
    /// Host addresses of `host_of`, the guest memory map the worker last loaded.
    pub(super) host: HostMap,
    pub(super) host_of: Option<Arc<GuestMemory>>,
    /// Earlier memory maps, kept mapped until the requests taken under them have completed
    /// (devices and status bytes point into them).
    pub(super) retired_maps: Vec<Arc<GuestMemory>>,
    /// The frontend's current memory map (one atomic load to check per round).
    pub(super) mem: Cache<Arc<ArcSwap<GuestMemory>>, Arc<GuestMemory>>,
}
