//! The thin device: a `PoolDevice` of the volume's size whose queues map each request
//! through the chunk map.
//!
//! Owns: opening a thin volume (reading and checking its whole map, starting its allocator),
//! shutting it down, what it tells the pool (chunks mapped, writes waiting for space).
//! Must not know: virtio, the pool.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};

use spool_devices::{BackendInfo, Device, DeviceQueue, PoolDevice, Probe};
use uuid::Uuid;

use crate::grace::Grace;
use crate::map::{self, ChunkMap, Placement, BLOCK_BYTES, ENTRY_BYTES};
use crate::shared::{Shared, ThinSpec};
use crate::{ChunkSource, Error, ThinQueue};

/// The chunks a map names, for the pool to mark as taken.
pub type LoadedMap = Vec<Placement>;

/// A thin volume as a pool device (see the crate doc).
#[derive(Debug)]
pub struct ThinBackend {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl ThinBackend {
    /// Opens a thin volume: reads its whole map, checking every entry, and starts its
    /// allocator thread. `resolve` finds a pool device by UUID (`None`: not in the pool
    /// now; its chunks fail I/O). Returns the device and the chunks its map names.
    pub fn open(
        spec: ThinSpec,
        source: Arc<dyn ChunkSource>,
        resolve: &dyn Fn(Uuid) -> Option<Arc<Device>>,
    ) -> Result<(Arc<Device>, LoadedMap), Error> {
        let chunks = spec.size.div_ceil(spec.chunk);
        if spec.store.capacity() < chunks {
            return Err(Error::Corrupt(format!(
                "the map holds {} entries, the volume has {chunks} chunks",
                spec.store.capacity()
            )));
        }
        let shared = Arc::new(Shared {
            map: ChunkMap::new(chunks),
            devices: RwLock::default(),
            source,
            work: Mutex::default(),
            wake: Condvar::new(),
            grace: Grace::default(),
            health: OnceLock::new(),
            followed: Mutex::default(),
            stop: AtomicBool::new(false),
            waiting_for_space: AtomicU64::new(0),
            spec,
        });
        let loaded = load(&shared, resolve)?;
        let thread = crate::alloc::start(&shared).map_err(Error::Thread)?;
        let dev = Arc::new(Device::new(
            ThinBackend {
                shared: shared.clone(),
                thread: Mutex::new(Some(thread)),
            },
            &[],
        ));
        let _ = shared.health.set(dev.health().clone());
        Ok((dev, loaded))
    }

    /// The thin backend under a [`Device`] made by [`ThinBackend::open`], if it is one.
    pub fn of(dev: &Device) -> Option<&ThinBackend> {
        dev.backend().as_any()?.downcast_ref()
    }

    /// Bytes of the volume backed by chunks now.
    pub fn allocated(&self) -> u64 {
        self.shared.map.mapped() * self.shared.spec.chunk
    }

    /// Every chunk the volume holds now (to give them back when it is deleted).
    pub fn placements(&self) -> Vec<Placement> {
        (0..self.shared.map.len())
            .filter_map(|c| self.shared.map.get(c))
            .filter_map(|(d, off)| self.shared.placement(d, off))
            .collect()
    }

    /// Writes waiting for free space now.
    pub fn waiting_for_space(&self) -> u64 {
        self.shared.waiting_for_space.load(Ordering::Relaxed)
    }

    /// Stops the allocator thread and waits for it: afterwards the map changes no more,
    /// and writes to holes fail.
    pub fn shut_down(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake.notify_all();
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for ThinBackend {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Reads every map block, checks every entry, and fills the in-memory table.
fn load(s: &Shared, resolve: &dyn Fn(Uuid) -> Option<Arc<Device>>) -> Result<LoadedMap, Error> {
    let chunks = s.map.len();
    let blocks = map::map_bytes(chunks) / BLOCK_BYTES;
    let mut buf = vec![0u8; BLOCK_BYTES as usize];
    let mut loaded = Vec::new();
    for b in 0..blocks {
        s.spec.store.read_block(b, &mut buf)?;
        for i in map::block_entries(b, chunks) {
            let at = ((i % (BLOCK_BYTES / ENTRY_BYTES)) * ENTRY_BYTES) as usize;
            let entry = map::decode(s.spec.volume, i, &buf[at..at + ENTRY_BYTES as usize])
                .map_err(Error::Corrupt)?;
            let Some(p) = entry else { continue };
            if p.offset % s.spec.chunk != 0 {
                return Err(Error::Corrupt(format!(
                    "entry {i}: offset {} is not a multiple of the chunk size",
                    p.offset
                )));
            }
            let idx = {
                let mut d = s.devices.write().unwrap_or_else(|p| p.into_inner());
                match d.iter().position(|(u, _)| *u == p.device) {
                    Some(x) => x,
                    None => {
                        d.push((p.device, resolve(p.device)));
                        d.len() - 1
                    }
                }
            };
            s.map.set(i, Some((idx, p.offset)));
            loaded.push(p);
        }
    }
    Ok(loaded)
}

impl PoolDevice for ThinBackend {
    fn path(&self) -> &Path {
        &self.shared.spec.path
    }

    fn size(&self) -> u64 {
        self.shared.spec.size
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            backend: "thin",
            direct_align: None,
            inline_io: self.shared.spec.inline_io,
        }
    }

    fn read_at(&self, _buf: &mut [u8], _offset: u64) -> spool_devices::Result<()> {
        Err(self.no_sync_io())
    }

    fn write_at_durable(&self, _buf: &[u8], _offset: u64) -> spool_devices::Result<()> {
        Err(self.no_sync_io())
    }

    fn zero_range(&self, _offset: u64, _len: u64) -> spool_devices::Result<()> {
        Err(self.no_sync_io())
    }

    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        Ok(Box::new(ThinQueue::new(self.shared.clone(), depth)?))
    }

    fn probe(&self) -> Probe {
        Probe::Ok
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

impl ThinBackend {
    fn no_sync_io(&self) -> spool_devices::Error {
        spool_devices::Error::Invalid {
            path: self.shared.spec.path.display().to_string(),
            msg: "a thin volume has no synchronous I/O (its chunks are on the pool devices)".into(),
        }
    }
}
