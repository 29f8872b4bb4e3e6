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
use crate::shared::{Shared, SnapImage, SnapshotSpec, ThinSpec};
use crate::{ChunkSource, Error, ThinQueue};

/// Device offsets a map entry may name (the in-memory table keeps offsets in 47 bits of
/// 4 KiB units).
const MAX_OFFSET: u64 = 1 << 59;

/// The chunks the maps of a volume and its snapshots name, with the index of the entry
/// naming each (a chunk is named at one index only, by however many maps).
pub type LoadedMap = Vec<(u64, Placement)>;

/// A thin volume as a pool device (see the crate doc).
#[derive(Debug)]
pub struct ThinBackend {
    pub(crate) shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The queue of synchronous calls (`read_at`, `write_at_durable`, `zero_range`).
    pub(crate) sync_io: crate::sync_io::SyncIo,
}

impl ThinBackend {
    /// Reads a thin volume's whole map, checking every entry. What cannot be served is in
    /// [`MapScan::problem`]; every chunk an entry that decoded names is in
    /// [`MapScan::placements`] either way (the pool marks them taken even for a volume it
    /// will not serve, so no chunk a map may still claim is handed out). `resolve` finds a
    /// pool device by UUID (`None`: not in the pool now; its chunks fail I/O).
    pub fn scan(spec: &ThinSpec, resolve: &dyn Fn(Uuid) -> Option<Arc<Device>>) -> MapScan {
        let mut scan = MapScan {
            placements: Vec::new(),
            problem: None,
            map: ChunkMap::new(spec.store.capacity()),
            devices: Vec::new(),
            snapshots: Vec::new(),
            damaged: Vec::new(),
        };
        let (map, devices) = (&scan.map, &mut scan.devices);
        let mut live = |i: u64, p: Placement| {
            let idx = match devices.iter().position(|(u, _)| *u == p.device) {
                Some(x) => x,
                None => {
                    devices.push((p.device, resolve(p.device)));
                    devices.len() - 1
                }
            };
            map.set(i, Some((idx, p.offset)));
        };
        let (volume, chunk) = (spec.volume, (spec.chunk, spec.chunk_base));
        let mut named = Vec::new();
        let mut problem = scan_map(volume, &spec.store, spec.size, chunk, &mut |i, p| {
            live(i, p);
            named.push((i, p));
        });
        for snap in &spec.snapshots {
            let mut entries = Vec::new();
            let why = scan_map(snap.uuid, &snap.store, snap.size, chunk, &mut |i, p| {
                entries.push((i, p))
            });
            // A corrupt snapshot map costs only that snapshot: the entries that decode still
            // count (their chunks stay taken and shared), and it can only be deleted. One
            // that cannot be read leaves unknown which chunks it shares with the volume, so
            // the volume is not served either.
            let damage = match why {
                Some(ScanProblem::Corrupt(w)) => Some(w),
                Some(u) => {
                    problem = problem.or(Some(u.within(&format!("snapshot {}", snap.uuid))));
                    None
                }
                None => None,
            };
            if let Some(w) = &damage {
                scan.damaged.push((snap.uuid, w.clone()));
            }
            named.extend_from_slice(&entries);
            scan.snapshots.push(SnapImage {
                uuid: snap.uuid,
                entries,
                damage,
                store: Some(snap.store.clone()),
            });
        }
        scan.placements = named;
        scan.problem = problem;
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
        // A chunk another map names too is copied before it is written.
        let refs = shared.source.shared_chunks();
        for (c, d, off) in shared.map.entries() {
            if shared.placement(d, off).is_some_and(|p| refs.is_shared(p)) {
                shared.map.mark_shared(c);
            }
        }
        *shared.snapshots.lock().unwrap_or_else(|p| p.into_inner()) = scan.snapshots;
        let thread = crate::alloc::start(&shared).map_err(Error::Thread)?;
        let dev = Arc::new(Device::new(
            ThinBackend {
                shared: shared.clone(),
                thread: Mutex::new(Some(thread)),
                sync_io: Default::default(),
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

    /// Every chunk the volume and its snapshots name now: mapped, unmapped and not let go
    /// yet, or a snapshot's. A chunk named by several of these maps comes once per map:
    /// when the volume is deleted (after [`ThinBackend::shut_down`]) each is released once
    /// ([`SharedChunks::release`](crate::SharedChunks::release)), and what no map names any
    /// more goes back.
    pub fn placements(&self) -> Vec<Placement> {
        let mut out: Vec<Placement> = (self.shared.map.entries())
            .filter_map(|(_, d, off)| self.shared.placement(d, off))
            .collect();
        let r = self.shared.retire.lock().unwrap_or_else(|p| p.into_inner());
        out.extend(r.waiting.iter().flat_map(|w| w.1.iter().copied()));
        out.extend(r.next.iter().copied());
        drop(r);
        let snaps = self
            .shared
            .snapshots
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        out.extend(snaps.iter().flat_map(|s| s.entries.iter().map(|e| e.1)));
        out
    }

    /// Chunks unmapped or copied from and waiting out their grace period: still counted as
    /// named (by this volume) in the sharing counts until it ends.
    pub fn retiring(&self) -> Vec<Placement> {
        let r = self.shared.retire.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<Placement> = r.waiting.iter().flat_map(|w| w.1.clone()).collect();
        out.extend(r.next.iter().copied());
        out
    }

    /// The chunks of map blocks whose last write failed (what the device holds there may
    /// differ from memory until the block's next successful write): those memory names in
    /// them and those held for them. Their sharing counts follow memory, not the device.
    pub fn unsure_placements(&self) -> Vec<Placement> {
        let unsure = (self.shared.unsure_blocks.lock()).unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        for (&b, held) in unsure.iter() {
            out.extend(held.iter().copied());
            for i in crate::map::block_entries(b, self.shared.map.capacity()) {
                let p = self.shared.map.get(i);
                out.extend(p.and_then(|(d, o)| self.shared.placement(d, o)));
            }
        }
        out
    }

    /// Chunks the allocator has taken and not published or given back yet.
    pub fn in_hand(&self) -> Vec<Placement> {
        (self.shared.in_hand.lock())
            .unwrap_or_else(|p| p.into_inner())
            .clone()
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

    /// Takes a crash-consistent snapshot of the running volume (see `snapshot.rs`): every
    /// write completed before the call is in it, none started after it. Its map is written
    /// durably to `snap.store` (new and zeroed) under `snap.uuid`; the caller then records
    /// it, or calls [`ThinBackend::drop_snapshot`] when it cannot. Returns how many chunks
    /// it names.
    pub fn snapshot(&self, snap: &SnapshotSpec) -> Result<u64, Error> {
        let reply = crate::handoff::Handoff::new();
        let mut w = self.shared.work.lock().unwrap_or_else(|p| p.into_inner());
        w.snapshots.push(reply.clone());
        drop(w);
        self.shared.wake.notify_one();
        let wait = crate::snapshot::DRAIN_WAIT + std::time::Duration::from_secs(60);
        // Given up, a late answer goes back to the allocator, which lets its names go.
        let entries = reply
            .wait(wait)
            .ok_or_else(|| Error::Snapshot("the volume's allocator did not answer".into()))??;
        if let Err(e) = map::write_image(&snap.store, snap.uuid, &entries) {
            self.release(entries.iter().map(|e| e.1));
            return Err(e);
        }
        let n = entries.len() as u64;
        let mut snaps = self
            .shared
            .snapshots
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        snaps.push(SnapImage {
            uuid: snap.uuid,
            entries,
            damage: None,
            store: Some(snap.store.clone()),
        });
        Ok(n)
    }

    /// Forgets snapshot `uuid` (no longer recorded): its chunks that no other map names
    /// go back to the pool. False when the volume has no such snapshot.
    pub fn drop_snapshot(&self, uuid: Uuid) -> bool {
        let mut snaps = self
            .shared
            .snapshots
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(i) = snaps.iter().position(|s| s.uuid == uuid) else {
            return false;
        };
        let image = snaps.remove(i);
        drop(snaps);
        // Nothing reads a snapshot's chunks through it: they go back at once.
        self.release(image.entries.iter().map(|e| e.1));
        true
    }

    /// The chunks snapshot `uuid` names: (chunk index, where); `None` when the volume has
    /// no such snapshot or its map is corrupt ([`ThinBackend::snapshot_damage`]).
    pub fn snapshot_entries(&self, uuid: Uuid) -> Option<Vec<(u64, Placement)>> {
        self.with_snapshot(uuid, |s| s.damage.is_none().then(|| s.entries.clone()))?
    }

    /// The chunks snapshot `uuid` names, damaged or not (what it holds in the pool).
    pub fn snapshot_chunks(&self, uuid: Uuid) -> Option<Vec<(u64, Placement)>> {
        self.with_snapshot(uuid, |s| s.entries.clone())
    }

    /// Why snapshot `uuid`'s map was found corrupt at open, if it was: the snapshot can only
    /// be deleted.
    pub fn snapshot_damage(&self, uuid: Uuid) -> Option<String> {
        self.with_snapshot(uuid, |s| s.damage.clone())?
    }

    /// `f` of snapshot `uuid`, if the volume has it.
    fn with_snapshot<T>(&self, uuid: Uuid, f: impl FnOnce(&SnapImage) -> T) -> Option<T> {
        let snaps = self
            .shared
            .snapshots
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        snaps.iter().find(|s| s.uuid == uuid).map(f)
    }

    /// Makes the volume hold snapshot `uuid`'s data again (the caller made sure nothing
    /// uses the volume): its map names the snapshot's chunks, shared with it, and what it
    /// named before is let go. Returns how many chunk entries changed.
    pub fn revert(&self, uuid: Uuid) -> Result<u64, Error> {
        let entries = self.snapshot_entries(uuid).ok_or_else(|| {
            Error::Revert(match self.snapshot_damage(uuid) {
                Some(why) => {
                    format!("the snapshot's map is corrupt ({why}): it can only be deleted")
                }
                None => format!("no snapshot {uuid}"),
            })
        })?;
        let (tx, rx) = std::sync::mpsc::channel();
        let mut w = self.shared.work.lock().unwrap_or_else(|p| p.into_inner());
        w.reverts.push((entries, tx));
        drop(w);
        self.shared.wake.notify_one();
        rx.recv()
            .map_err(|_| Error::Revert("the volume's allocator stopped".into()))?
    }

    /// Device `device` leaves the pool (replaced): every entry of the volume's and its
    /// snapshots' maps naming a chunk on it becomes a hole, durably (their data is lost, as
    /// a thick volume's on a replaced device). Returns how many entries were cleared.
    pub fn evict(&self, device: Uuid) -> Result<u64, Error> {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut w = self.shared.work.lock().unwrap_or_else(|p| p.into_inner());
        w.evictions.push((device, tx));
        drop(w);
        self.shared.wake.notify_one();
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .map_err(|_| Error::Evict("the volume's allocator did not answer within 60 s".into()))?
    }

    /// Copies every chunk the volume shares with another map (a clone stops depending on
    /// its snapshot), as the first write to each would; returns how many it copied. Fails
    /// with the first chunk that could not be copied (the pool is full: the wait for space
    /// applies as to a write).
    pub fn inflate(&self) -> Result<u64, Error> {
        let shared: Vec<u64> = (self.shared.map.entries())
            .map(|(c, _, _)| c)
            .filter(|&c| self.shared.map.is_shared(c))
            .collect();
        self.copy_shared(&shared)?;
        Ok(shared.len() as u64)
    }

    /// Copies each of `chunks` that is still shared when the allocator gets to it; one that
    /// is not shared any more is left alone, and one unmapped since stays a hole.
    pub(crate) fn copy_shared(&self, chunks: &[u64]) -> Result<(), Error> {
        let mailbox = Arc::new(crate::shared::Mailbox::for_copies().map_err(Error::Thread)?);
        // In batches: the allocator answers each once its map block is durable.
        for batch in chunks.chunks(64) {
            for &c in batch {
                self.shared.request_chunk(c, &mailbox);
            }
            let mut left: std::collections::HashSet<u64> = batch.iter().copied().collect();
            while !left.is_empty() {
                if self.shared.stopping() {
                    return Err(Error::Snapshot("the volume is shutting down".into()));
                }
                for n in mailbox.take() {
                    match n {
                        crate::shared::Note::Mapped { chunk } => {
                            left.remove(&chunk);
                        }
                        crate::shared::Note::Failed { chunk, errno } => {
                            return Err(Error::Snapshot(format!(
                                "chunk {chunk} could not be copied (errno {})",
                                -errno
                            )))
                        }
                        crate::shared::Note::Unmapped { .. } => {}
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        Ok(())
    }

    /// The chunks the volume's own map names now: (chunk index, where).
    pub fn live_entries(&self) -> Vec<(u64, Placement)> {
        (self.shared.map.entries())
            .filter_map(|(c, d, off)| Some((c, self.shared.placement(d, off)?)))
            .collect()
    }

    /// Chunks the volume maps that another map names too (a snapshot's, a clone's).
    pub fn shared_chunks(&self) -> u64 {
        let refs = self.shared.source.shared_chunks();
        (self.shared.map.entries())
            .filter_map(|(_, d, off)| self.shared.placement(d, off))
            .filter(|&p| refs.is_shared(p))
            .count() as u64
    }

    /// One name fewer for each of `chunks`; those no map names any more go back.
    fn release(&self, chunks: impl Iterator<Item = Placement>) {
        let source = &self.shared.source;
        for p in chunks {
            if source.shared_chunks().release(p) {
                source.give_back(p.device, p.offset);
            }
        }
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
        // After the stop: a synchronous write waiting for space fails at once then, and
        // lets go of the calls' queue.
        self.sync_io.close();
    }
}

impl Drop for ThinBackend {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// What a thin volume's map and its snapshots' say (see [`ThinBackend::scan`]).
pub struct MapScan {
    /// Every chunk named by an entry that decoded, once per map naming it.
    pub placements: LoadedMap,
    /// Why the volume cannot be served (the first one found).
    pub problem: Option<ScanProblem>,
    /// Snapshots whose map is corrupt, and why: the volume is served, they can only be
    /// deleted.
    pub damaged: Vec<(Uuid, String)>,
    map: ChunkMap,
    devices: Vec<(Uuid, Option<Arc<Device>>)>,
    snapshots: Vec<SnapImage>,
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

impl ScanProblem {
    fn within(self, what: &str) -> ScanProblem {
        match self {
            ScanProblem::Corrupt(w) => ScanProblem::Corrupt(format!("{what}: {w}")),
            ScanProblem::Unreadable(w) => ScanProblem::Unreadable(format!("{what}: {w}")),
        }
    }
}

/// Reads every block of the map of `volume` (`size` bytes in chunks: (size, where they
/// start on a device)) from `store`, giving each entry that decodes to `found`; goes on past
/// problems and returns the first one (an unreadable block wins: which chunks it names is
/// unknown).
fn scan_map(
    volume: Uuid,
    store: &map::MapStore,
    size: u64,
    (chunk, base): (u64, u64),
    found: &mut dyn FnMut(u64, Placement),
) -> Option<ScanProblem> {
    let chunks = size.div_ceil(chunk);
    if store.capacity() < chunks {
        return Some(ScanProblem::Corrupt(format!(
            "the map holds {} entries, the volume has {chunks} chunks",
            store.capacity()
        )));
    }
    let mut problem = None;
    let blocks = map::map_bytes(chunks) / BLOCK_BYTES;
    let mut buf = vec![0u8; BLOCK_BYTES as usize];
    for b in 0..blocks {
        if let Err(e) = store.read_block(b, &mut buf) {
            let why = format!("map block {b} cannot be read: {e}");
            problem = Some(ScanProblem::Unreadable(why));
            continue;
        }
        for i in map::block_entries(b, chunks) {
            let at = ((i % (BLOCK_BYTES / ENTRY_BYTES)) * ENTRY_BYTES) as usize;
            match map::decode(volume, i, &buf[at..at + ENTRY_BYTES as usize]) {
                Ok(Some(p))
                    if p.offset >= base
                        && (p.offset - base) % chunk == 0
                        && p.offset < MAX_OFFSET =>
                {
                    found(i, p)
                }
                Ok(None) => {}
                Ok(Some(p)) => {
                    let why = format!(
                        "entry {i}: offset {} is not {base} plus a multiple of the chunk size, below 2^59",
                        p.offset
                    );
                    problem.get_or_insert(ScanProblem::Corrupt(why));
                }
                Err(why) => {
                    problem.get_or_insert(ScanProblem::Corrupt(why.to_string()));
                }
            }
        }
    }
    problem
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

    fn read_at(&self, buf: &mut [u8], offset: u64) -> spool_devices::Result<()> {
        crate::sync_io::SyncCalls(&self.shared, &self.sync_io).read(buf, offset)
    }

    fn write_at_durable(&self, buf: &[u8], offset: u64) -> spool_devices::Result<()> {
        crate::sync_io::SyncCalls(&self.shared, &self.sync_io).write(buf, offset)
    }

    fn zero_range(&self, offset: u64, len: u64) -> spool_devices::Result<()> {
        crate::sync_io::SyncCalls(&self.shared, &self.sync_io).zero(offset, len)
    }

    /// Every chunk of the range is a hole in the map now: it reads as zeroes (a thin
    /// device has no backing image; a clone's chunks are mapped, shared), and durably so:
    /// none is in a map block whose last write failed (the device may still name a chunk
    /// there, which a restart would read back). The answer holds while no write reaches the
    /// range (the caller keeps them out: a mirror's copy holds the region).
    fn known_unwritten(&self, offset: u64, len: u64) -> bool {
        let chunk = self.shared.spec.chunk;
        let end = match offset.checked_add(len) {
            Some(end) if len > 0 && end <= self.size() => end,
            _ => return false,
        };
        let (first, last) = (offset / chunk, (end - 1) / chunk);
        let unsure = (self.shared.unsure_blocks.lock()).unwrap_or_else(|p| p.into_inner());
        if (unsure.range(crate::map::block_of(first)..=crate::map::block_of(last)))
            .next()
            .is_some()
        {
            return false;
        }
        drop(unsure);
        (first..=last).all(|c| self.shared.map.get(c).is_none())
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
