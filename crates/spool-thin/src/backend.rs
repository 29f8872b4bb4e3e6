//! The thin device: a `PoolDevice` of the volume's size whose queues map each request
//! through the chunk map.
//!
//! Owns: opening a thin volume (reading and checking its whole map, starting its allocator),
//! shutting it down, what it tells the pool (chunks mapped, writes waiting for space).
//! Must not know: virtio, the pool.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use spool_devices::{BackendInfo, Device, DeviceQueue, PoolDevice, Probe};
use uuid::Uuid;

use crate::map::{self, ChunkMap, Placement, BLOCK_BYTES, ENTRY_BYTES};
use crate::shared::{Shared, ThinSpec};
use crate::{ChunkSource, Error, ThinQueue};

/// Device offsets a map entry may name (the in-memory table keeps offsets in 48 bits of
/// 4 KiB units).
const MAX_OFFSET: u64 = 1 << 60;

/// The chunks a map names, for the pool to mark as taken.
pub type LoadedMap = Vec<Placement>;

/// A thin volume as a pool device (see the crate doc).
#[derive(Debug)]
pub struct ThinBackend {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl ThinBackend {
    /// Reads a thin volume's whole map, checking every entry. What cannot be served is in
    /// [`MapScan::problem`]; every chunk an entry that decoded names is in
    /// [`MapScan::placements`] either way (the pool marks them taken even for a volume it
    /// will not serve, so no chunk a map may still claim is handed out). `resolve` finds a
    /// pool device by UUID (`None`: not in the pool now; its chunks fail I/O).
    pub fn scan(spec: &ThinSpec, resolve: &dyn Fn(Uuid) -> Option<Arc<Device>>) -> MapScan {
        let chunks = spec.size.div_ceil(spec.chunk);
        let mut scan = MapScan {
            placements: Vec::new(),
            problem: None,
            map: ChunkMap::new(spec.store.capacity()),
            devices: Vec::new(),
        };
        if spec.store.capacity() < chunks {
            scan.problem = Some(ScanProblem::Corrupt(format!(
                "the map holds {} entries, the volume has {chunks} chunks",
                spec.store.capacity()
            )));
            return scan;
        }
        scan_blocks(spec, chunks, resolve, &mut scan);
        scan
    }

    /// Serves a scanned thin volume: starts its allocator thread. Refused when the scan
    /// found a problem.
    pub fn start(
        spec: ThinSpec,
        source: Arc<dyn ChunkSource>,
        scan: MapScan,
    ) -> Result<Arc<Device>, Error> {
        match scan.problem {
            Some(ScanProblem::Corrupt(why)) => return Err(Error::Corrupt(why)),
            Some(ScanProblem::Unreadable(why)) => return Err(Error::Unreadable(why)),
            None => {}
        }
        let shared = Arc::new(Shared::new(spec, source, scan.map, scan.devices));
        let thread = crate::alloc::start(&shared).map_err(Error::Thread)?;
        let dev = Arc::new(Device::new(
            ThinBackend {
                shared: shared.clone(),
                thread: Mutex::new(Some(thread)),
            },
            &[],
        ));
        let _ = shared.health.set(dev.health().clone());
        Ok(dev)
    }

    /// [`ThinBackend::scan`] then [`ThinBackend::start`]: the device and the chunks its map
    /// names.
    pub fn open(
        spec: ThinSpec,
        source: Arc<dyn ChunkSource>,
        resolve: &dyn Fn(Uuid) -> Option<Arc<Device>>,
    ) -> Result<(Arc<Device>, LoadedMap), Error> {
        let scan = Self::scan(&spec, resolve);
        let placements = scan.placements.clone();
        Ok((Self::start(spec, source, scan)?, placements))
    }

    /// The thin backend under a [`Device`] made by [`ThinBackend::open`], if it is one.
    pub fn of(dev: &Device) -> Option<&ThinBackend> {
        dev.backend().as_any()?.downcast_ref()
    }

    /// Bytes of the volume backed by chunks now.
    pub fn allocated(&self) -> u64 {
        self.shared.map.mapped() * self.shared.spec.chunk
    }

    /// Every chunk the volume holds now: mapped, or unmapped and not given back yet (to
    /// give them all back when it is deleted, after [`ThinBackend::shut_down`]).
    pub fn placements(&self) -> Vec<Placement> {
        let mut out: Vec<Placement> = (self.shared.map.entries())
            .filter_map(|(_, d, off)| self.shared.placement(d, off))
            .collect();
        let r = self.shared.retire.lock().unwrap_or_else(|p| p.into_inner());
        out.extend(r.waiting.iter().flat_map(|w| w.1.iter().copied()));
        out.extend(r.next.iter().copied());
        out
    }

    /// The largest size the volume can grow to without a bigger map: every entry its map's
    /// extents hold.
    pub fn max_size(&self) -> u64 {
        self.shared.map.capacity() * self.shared.spec.chunk
    }

    /// Grows the volume to `size` bytes (the pool has recorded it); its new chunks are holes.
    /// Refused past [`ThinBackend::max_size`] or below the current size.
    pub fn grow(&self, size: u64) -> Result<(), Error> {
        let now = self.shared.size.load(Ordering::Acquire);
        if size < now || size > self.max_size() {
            return Err(Error::Corrupt(format!(
                "cannot grow from {now} to {size} bytes: the map holds chunks for {} bytes",
                self.max_size()
            )));
        }
        self.shared.size.store(size, Ordering::Release);
        Ok(())
    }

    /// Makes the allocator die at `at` (crash-point tests).
    #[cfg(test)]
    pub(crate) fn arm_crash(&self, at: crate::shared::CrashPoint) {
        *self.shared.crash_at.lock().unwrap() = Some(at);
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

/// What a thin volume's map says (see [`ThinBackend::scan`]).
pub struct MapScan {
    /// Every chunk named by an entry that decoded.
    pub placements: LoadedMap,
    /// Why the volume cannot be served (the first one found).
    pub problem: Option<ScanProblem>,
    map: ChunkMap,
    devices: Vec<(Uuid, Option<Arc<Device>>)>,
}

/// Why a map cannot be served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanProblem {
    /// An entry is not one (a checksum, a magic, an offset): the volume is refused.
    Corrupt(String),
    /// A block could not be read: which chunks it names is unknown, so no chunk may be
    /// handed out by the pool until it can be read.
    Unreadable(String),
}

/// Reads every map block into `scan`, going on past problems (the first one is kept).
fn scan_blocks(
    spec: &ThinSpec,
    chunks: u64,
    resolve: &dyn Fn(Uuid) -> Option<Arc<Device>>,
    scan: &mut MapScan,
) {
    let blocks = map::map_bytes(chunks) / BLOCK_BYTES;
    let mut buf = vec![0u8; BLOCK_BYTES as usize];
    for b in 0..blocks {
        if let Err(e) = spec.store.read_block(b, &mut buf) {
            let why = format!("map block {b} cannot be read: {e}");
            scan.problem = Some(ScanProblem::Unreadable(why));
            continue;
        }
        for i in map::block_entries(b, chunks) {
            let at = ((i % (BLOCK_BYTES / ENTRY_BYTES)) * ENTRY_BYTES) as usize;
            let p = match map::decode(spec.volume, i, &buf[at..at + ENTRY_BYTES as usize]) {
                Ok(Some(p)) if p.offset % spec.chunk == 0 && p.offset < MAX_OFFSET => p,
                Ok(None) => continue,
                Ok(Some(p)) => {
                    let why = format!(
                        "entry {i}: offset {} is not a multiple of the chunk size below 2^60",
                        p.offset
                    );
                    scan.problem.get_or_insert(ScanProblem::Corrupt(why));
                    continue;
                }
                Err(why) => {
                    scan.problem.get_or_insert(ScanProblem::Corrupt(why));
                    continue;
                }
            };
            let idx = match scan.devices.iter().position(|(u, _)| *u == p.device) {
                Some(x) => x,
                None => {
                    scan.devices.push((p.device, resolve(p.device)));
                    scan.devices.len() - 1
                }
            };
            scan.map.set(i, Some((idx, p.offset)));
            scan.placements.push(p);
        }
    }
}

impl PoolDevice for ThinBackend {
    fn path(&self) -> &Path {
        &self.shared.spec.path
    }

    fn size(&self) -> u64 {
        self.shared.size.load(Ordering::Acquire)
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
