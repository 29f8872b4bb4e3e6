//! The volume's devices as one queue's worker holds them: the layout it follows (as the pool
//! publishes it, checked once a round), a queue per device of that layout (an encrypted
//! volume's wrapped in a `CryptQueue` by the layout), each device's health epoch the worker
//! last acted on, and whether every device does its I/O inline.
//!
//! Owns: [`WorkerDevices`], opening a device's queue. Must not know: requests, the ring,
//! pacing, health transitions (the worker reads the epochs and acts).

use std::sync::Arc;

use arc_swap::{ArcSwap, Cache};
use spool_devices::DeviceQueue;
use spool_pool::VolumeLayout;

/// A queue's view of its volume's devices (module doc).
pub(super) struct WorkerDevices {
    /// The volume's layout as the pool publishes it.
    pub(super) src: Arc<ArcSwap<VolumeLayout>>,
    /// `src` as checked every round (one atomic load).
    pub(super) now: Cache<Arc<ArcSwap<VolumeLayout>>, Arc<VolumeLayout>>,
    /// The layout the queues were opened on.
    pub(super) layout: Arc<VolumeLayout>,
    /// A queue per device of `layout`, by index.
    pub(super) queues: Vec<Box<dyn DeviceQueue>>,
    /// The health epoch of each device this worker last acted on.
    pub(super) seen_epochs: Vec<u64>,
    /// Whether every device of the volume does its I/O inline.
    pub(super) inline: bool,
    /// Tests: opens device `d`'s queue instead of the device (a scripted queue).
    #[cfg(test)]
    pub(super) factory: Option<super::QueueFactory>,
}

impl WorkerDevices {
    /// Following `src`, whose layout now is `layout`; no queue open yet.
    pub(super) fn new(src: Arc<ArcSwap<VolumeLayout>>, layout: Arc<VolumeLayout>) -> Self {
        WorkerDevices {
            now: Cache::new(src.clone()),
            src,
            layout,
            queues: Vec::new(),
            seen_epochs: Vec::new(),
            inline: false,
            #[cfg(test)]
            factory: None,
        }
    }

    /// Device `d`'s queue; an encrypted volume's is wrapped in a `CryptQueue` whose tweaks
    /// are the volume offsets of the layout's segments on that device
    /// (`VolumeLayout::wrap_queue`).
    pub(super) fn open_queue(
        &mut self,
        d: usize,
        depth: u32,
    ) -> std::io::Result<Box<dyn DeviceQueue>> {
        let q = self.open_device_queue(d, depth)?;
        Ok(self.layout.wrap_queue(d, q))
    }

    #[cfg(not(test))]
    fn open_device_queue(&mut self, d: usize, depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        self.layout.devices[d].open_queue(depth)
    }

    #[cfg(test)]
    fn open_device_queue(&mut self, d: usize, depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        match &mut self.factory {
            Some(open) => open(d),
            None => self.layout.devices[d].open_queue(depth),
        }
    }
}
