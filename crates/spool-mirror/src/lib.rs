//! Mirrored storage (RAID-1) as one more stacked backend, composed of spool-devices'
//! [`Device`]s: a [`Mirror`] is opened from a [`MirrorSpec`] and hands the data path one
//! [`Device`] (its backend a [`PoolDevice`] whose address space is a volume's, kept as 2–3
//! copies (legs), each leg a linear map onto pieces of other [`Device`]s, each with its own
//! health) and the control plane a typed handle (progress, verify, accept), so nothing
//! downcasts to find it. The data path sees one device; the mirror's queue ([`MirrorQueue`])
//! writes every usable leg and completes when they have, balances reads over the legs that hold current data and retries a failed read
//! on another leg; a leg that fails a write or whose device is not healthy drops out without
//! failing the guest, and the regions it missed are recorded.
//!
//! Crash consistency is md's write-intent bitmap ([`bitmap`]): a region's intent bit is
//! durable before a write to it goes out and cleared lazily once no write is in flight there;
//! after a kill, restart, upgrade or reset only regions with intent (or with legs marked
//! stale) are copied from a current leg. The background thread of [`resync`] does the copying
//! (rate-limited, region by region, and never racing a guest write: a region's copy is
//! redone when a write reached it meanwhile) and clears intent bits.
//!
//! Owns: legs, region bookkeeping, the mirror's health (healthy while some leg is usable).
//! Must not know: volumes, extents or pool metadata (the pool describes the legs), virtio.

pub mod bitmap;
mod copy;
mod gone;
mod grow;
mod handover;
mod legio;
mod op;
mod prepare;
mod queue;
mod regions;
mod resync;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_copy;
#[cfg(test)]
mod tests_fence;
#[cfg(test)]
mod tests_flush;
#[cfg(test)]
mod tests_misses;
#[cfg(test)]
mod tests_stop;
#[cfg(test)]
mod tests_sync;
#[cfg(test)]
mod tests_zeroes;
mod verify;
mod waiting;
mod writes;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

pub use queue::MirrorQueue;
pub(crate) use regions::Regions;
pub use resync::{LegProgress, Progress};
pub use verify::Verify;
use writes::WriteCounts;

use bitmap::{Bitmap, Found, INTENT};
use grow::{grown_legs, keep_grown};
use prepare::{prepare_intents, prepare_legs};
use spool_devices::{BackendInfo, PoolDevice, Probe};
use spool_devices::{Device, DeviceHealth, DeviceQueue, Error, HealthState, Result};

/// Most legs a mirror has (slots 0..3).
pub const MAX_LEGS: usize = 3;
/// A region's writes counter has this bit while the bitmap thread clears its intent bit.
const CLEARING: u32 = 1 << 31;
/// A region's writes counter has this bit while the copy reads a piece of it from its source
/// and writes it to its targets: writes entering then wait (see [`regions::Regions::enter`]).
const COPYING: u32 = 1 << 30;
/// A region's writes counter has this bit while a write waits for the copy there: the copy
/// lets the region go before its next piece until the write got in (writes come first).
const WAITER: u32 = 1 << 29;
/// The flag bits of a region's writes counter (what is not a count of writes).
const FLAGS: u32 = CLEARING | COPYING | WAITER;

/// The device index of a leg piece whose device is not in the pool (never usable).
pub const MISSING: usize = usize::MAX;
/// Most devices one mirror's legs may use (the healthy set is a 64-bit mask).
pub const MAX_DEVICES: usize = 64;

/// One piece of a leg: volume bytes `[logical, logical + len)` at `offset` of
/// `devices[device]` ([`MISSING`]: the device is gone); the fan-out engine's span, as a
/// plain volume's segments are.
pub type LegPiece = spool_devices::fanout::Span;

/// One leg as the pool describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LegSpec {
    /// Stable slot (its bit in the bitmap).
    pub slot: u8,
    /// Identity of the leg's placement (the stale bits in the bitmap belong to it).
    pub id: u64,
    /// Holds a complete copy (false: being rebuilt; never read until caught up).
    pub synced: bool,
    /// A leg behind a network link (a copy on another host): written like any leg, read only
    /// when no other leg can serve the read (md's "write-mostly"). Once it has held a
    /// complete copy (`synced`, or caught up while open) it is *required*: a write completes
    /// only once it took it, and while it cannot the mirror is resetting (every request
    /// waits). A copy elsewhere that was current never silently falls behind: it is what a
    /// VM moving there will read (docs/transfer.md).
    pub far: bool,
    /// Ascending and contiguous over the volume.
    pub pieces: Vec<LegPiece>,
}

/// What a mirror is built from.
#[derive(Debug, Clone)]
pub struct MirrorSpec {
    /// Shown as the device path (`mirror:NAME`).
    pub name: String,
    /// Volume bytes (a multiple of the region size is not required).
    pub size: u64,
    pub devices: Vec<Arc<Device>>,
    pub legs: Vec<LegSpec>,
    /// Where the write-intent bitmap lives (`None`: memory only, no crash consistency).
    pub bitmap: Option<PathBuf>,
    /// Bytes per second the background copy may use (0: unlimited).
    pub resync_rate: u64,
}

/// Where the write counters of the mirror whose bitmap is at `bitmap` live (see [`writes`]).
fn writes_path(bitmap: &Path) -> PathBuf {
    let mut p = bitmap.as_os_str().to_owned();
    p.push(".writes");
    PathBuf::from(p)
}

/// Writes the bitmap of a new mirrored volume whose legs are identical (freshly zeroed), so
/// that a bitmap found missing later means lost (every region resynced), not new.
pub fn create_clean_bitmap(path: &Path, size: u64) -> std::io::Result<()> {
    let shift = region_shift(size);
    let n = size.div_ceil(1 << shift).max(1) as usize;
    let _ = std::fs::remove_file(path);
    Bitmap::open(Some(path), n, shift).map(|_| ())
}

/// Region size for a volume of `size` bytes: 1 MiB, larger for volumes over 4 TiB (so the
/// bitmap stays at most 4 MiB).
pub fn region_shift(size: u64) -> u32 {
    let bits = 64 - size.max(1).leading_zeros();
    20u32.max(bits.saturating_sub(22))
}

/// A run of the volume where every leg stays on one device: `dev[slot]` (or [`MISSING`],
/// also for slots without a leg). Usability is decided per stripe, so a leg spread over
/// devices loses only the ranges on a failed one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stripe {
    pub(crate) logical: u64,
    pub(crate) dev: [usize; MAX_LEGS],
}

/// The stripes of `legs` (the union of their piece boundaries), ascending.
fn stripes(legs: &[LegSpec]) -> Vec<Stripe> {
    let mut cuts: Vec<u64> = legs
        .iter()
        .flat_map(|l| l.pieces.iter().map(|p| p.logical))
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    cuts.iter()
        .map(|&at| {
            let mut dev = [MISSING; MAX_LEGS];
            for l in legs {
                if let Some(p) = l
                    .pieces
                    .iter()
                    .find(|p| p.logical <= at && at < p.logical + p.len)
                {
                    dev[l.slot as usize] = p.device;
                }
            }
            Stripe { logical: at, dev }
        })
        .collect()
}

/// Everything one mirror's queues and background thread share.
pub(crate) struct Shared {
    pub(crate) spec: MirrorSpec,
    pub(crate) stripes: Vec<Stripe>,
    /// Stale bits of the far legs (read only when no other leg can serve a read).
    pub(crate) far: u8,
    /// Stale bits of the required legs (see [`LegSpec::far`]); only grows while open.
    pub(crate) required: AtomicU8,
    /// Stale bits of the legs taking over from the others ([`Mirror::begin_hand_over`]).
    pub(crate) taking_over: AtomicU8,
    pub(crate) regions: Arc<Regions>,
    /// The health cell of the `Device` wrapping this mirror (set once it exists).
    pub(crate) health: OnceLock<Arc<DeviceHealth>>,
    pub(crate) progress: Arc<resync::ProgressCell>,
    /// Set when the backend is dropped (or replaced by one with other regions): the
    /// background thread ends, and sets `stopped` when it has let go of everything it held
    /// (its leg queues and its hold on this state, and so on the leg devices:
    /// `resync::start`).
    pub(crate) stop: AtomicBool,
    pub(crate) stopped: Arc<AtomicBool>,
    /// Regions found needing a resync when the mirror was opened (after a crash).
    pub(crate) resync_at_open: u64,
}

impl Shared {
    /// The devices that are healthy now, as a mask of device indices.
    pub(crate) fn healthy(&self) -> u64 {
        let mut mask = 0;
        for (i, d) in self.spec.devices.iter().enumerate() {
            if d.health().state() == HealthState::Healthy {
                mask |= 1 << i;
            }
        }
        mask
    }

    /// The devices not isolated now (healthy, or resetting and so may come back).
    pub(crate) fn alive(&self) -> u64 {
        let mut mask = 0;
        for (i, d) in self.spec.devices.iter().enumerate() {
            if !d.health().state().isolated() {
                mask |= 1 << i;
            }
        }
        mask
    }

    /// Slots whose leg can take I/O for all of `[offset, offset + len)` when the devices in
    /// `healthy` are healthy.
    #[inline]
    pub(crate) fn usable(&self, healthy: u64, offset: u64, len: u64) -> u8 {
        let first = self
            .stripes
            .partition_point(|s| s.logical <= offset)
            .saturating_sub(1);
        let end = offset + len.max(1);
        let mut mask = 0b111;
        for s in self.stripes[first..].iter().take_while(|s| s.logical < end) {
            for (slot, &d) in s.dev.iter().enumerate() {
                if d == MISSING || healthy & (1 << d) == 0 {
                    mask &= !(1 << slot);
                }
            }
        }
        mask
    }

    /// Slots whose leg can take I/O over the whole volume now.
    pub(crate) fn writable(&self) -> u8 {
        self.usable(self.healthy(), 0, self.spec.size)
    }

    /// Stale bits of every slot the mirror has (present or not).
    pub(crate) fn all_slots(&self) -> u8 {
        self.spec
            .legs
            .iter()
            .fold(0, |m, l| m | bitmap::stale(l.slot))
    }

    pub(crate) fn leg(&self, slot: u8) -> Option<&LegSpec> {
        self.spec.legs.iter().find(|l| l.slot == slot)
    }
}

/// A mirror of legs on other devices, as a pool device (inside the [`Device`] a [`Mirror`]
/// hands the data path).
struct MirrorBackend {
    shared: Arc<Shared>,
    path: PathBuf,
}

impl std::fmt::Debug for MirrorBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MirrorBackend({})", self.path.display())
    }
}

/// A mirror, open: the [`Device`] the data path opens queues on, and the control plane's
/// handle on the same mirror (progress, verify, an operator's accept, leg states). Cheap to
/// clone; the mirror's background thread ends when the device is dropped.
#[derive(Clone)]
pub struct Mirror {
    device: Arc<Device>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mirror({})", self.device.path().display())
    }
}

impl Mirror {
    /// Builds a mirror, opens (or creates) its bitmap, marks what needs copying (intent
    /// regions left by a crash, legs not yet synced or placed anew) and starts the background
    /// thread.
    pub fn open(spec: MirrorSpec) -> Result<Mirror> {
        Self::open_after(spec, None)
    }

    /// As [`Mirror::open`], for a mirror whose legs changed (a leg added, replaced or gone)
    /// while `previous` serves it: the region state (bitmap, writes in flight) is shared with
    /// `previous` when the size is unchanged, so queues of both agree while workers move
    /// over.
    pub fn open_after(spec: MirrorSpec, previous: Option<&Mirror>) -> Result<Mirror> {
        let path = PathBuf::from(format!("mirror:{}", spec.name));
        if spec.legs.is_empty()
            || spec.legs.len() > MAX_LEGS
            || spec.legs.iter().any(|l| l.slot as usize >= MAX_LEGS)
        {
            return Err(Error::io(
                &path,
                "open",
                std::io::Error::other("a mirror has 1 to 3 legs in slots 0..3"),
            ));
        }
        if spec.devices.len() > MAX_DEVICES {
            return Err(Error::io(
                &path,
                "open",
                std::io::Error::other(format!("a mirror's legs use at most {MAX_DEVICES} devices")),
            ));
        }
        let shift = region_shift(spec.size);
        let n = spec.size.div_ceil(1 << shift).max(1) as usize;
        let reuse = previous
            .filter(|m| m.shared.regions.shift == shift && m.shared.regions.writes.len() == n);
        // Other regions over the same bitmap file (a resize): the previous mirror's thread
        // would copy and clear by its own counts behind the new one's back, and the bitmap
        // may be rewritten under it. It ends first; if this open fails, it runs again.
        // A leg gone (a copy removed): the previous thread would go on copying to and from
        // it, and its space is about to be given back. It ends too.
        let leg_gone = |m: &&Mirror| {
            (m.shared.spec.legs.iter()).any(|old| {
                !spec
                    .legs
                    .iter()
                    .any(|l| l.slot == old.slot && l.id == old.id)
            })
        };
        let replaced = match reuse {
            None => previous.filter(|m| m.stop_resync()),
            Some(_) => previous.filter(leg_gone).filter(|m| m.stop_resync()),
        };
        let grown = previous.map_or_else(Vec::new, |m| grown_legs(&m.shared.spec, &spec));
        let opened = Self::open_regions(spec, &path, reuse, &grown);
        if let (Err(_), Some(m)) = (&opened, replaced) {
            m.shared.stop.store(false, Ordering::Release);
            m.shared.stopped.store(false, Ordering::Release);
            let _ = resync::start(&m.shared);
        }
        opened
    }

    fn open_regions(
        spec: MirrorSpec,
        path: &Path,
        reuse: Option<&Mirror>,
        grown: &[(u8, u64, u64)],
    ) -> Result<Mirror> {
        let shift = region_shift(spec.size);
        let n = spec.size.div_ceil(1 << shift).max(1) as usize;
        let (regions, progress, resync_at_open) = match reuse {
            Some(m) => {
                keep_grown(&m.shared.regions, grown);
                prepare_legs(&spec, &m.shared.regions, Found::Kept);
                (
                    m.shared.regions.clone(),
                    m.shared.progress.clone(),
                    m.shared.resync_at_open,
                )
            }
            None => {
                let (bitmap, found) = Bitmap::open(spec.bitmap.as_deref(), n, shift)
                    .map_err(|e| Error::io(path, "open write-intent bitmap", e))?;
                let counts = spec.bitmap.as_deref().map(writes_path);
                let left = match (&counts, found) {
                    (Some(c), Found::Kept) => WriteCounts::left_behind(c, n),
                    _ => None,
                };
                let writes = WriteCounts::create(counts.as_deref(), n)
                    .map_err(|e| Error::io(path, "create the write counters", e))?;
                let regions = Regions::new(bitmap, shift, writes);
                keep_grown(&regions, grown);
                prepare_legs(&spec, &regions, found);
                let intents = prepare_intents(&spec, &regions, found, left.as_deref());
                (Arc::new(regions), Default::default(), intents)
            }
        };
        let far = spec
            .legs
            .iter()
            .filter(|l| l.far)
            .fold(0, |m, l| m | bitmap::stale(l.slot));
        let required = regions.required_legs(&spec.legs);
        let shared = Arc::new(Shared {
            stripes: stripes(&spec.legs),
            far,
            required: AtomicU8::new(required),
            taking_over: AtomicU8::new(0),
            spec,
            regions,
            health: OnceLock::new(),
            progress,
            stop: AtomicBool::new(false),
            stopped: Arc::new(AtomicBool::new(false)),
            resync_at_open,
        });
        if resync_at_open > 0 && reuse.is_none() {
            tracing::warn!(mirror = %path.display(), regions = resync_at_open, "mirror was not shut down cleanly: resyncing the regions that had writes in flight");
        }
        let backend = MirrorBackend {
            shared: shared.clone(),
            path: path.to_path_buf(),
        };
        let device = Arc::new(Device::new(backend, &[]));
        let _ = shared.health.set(device.health().clone());
        resync::start(&shared).map_err(|e| Error::io(device.path(), "start resync thread", e))?;
        Ok(Mirror { device, shared })
    }

    /// The mirror as the data path sees it: one device of the volume's size.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Copying progress and leg states.
    pub fn progress(&self) -> Progress {
        resync::progress(&self.shared)
    }

    /// Compares the legs region by region (a scrub); regions with writes in flight are
    /// compared again until quiet.
    pub fn verify(&self) -> Result<Verify> {
        verify::verify(&self.shared)
    }

    /// The identity of leg `slot` as this mirror was built (`None`: no such leg).
    pub fn leg_id(&self, slot: u8) -> Option<u64> {
        self.shared.leg(slot).map(|l| l.id)
    }

    /// Fences the volume off: its copy elsewhere was promoted there (docs/replicas.md), so
    /// no write may complete here any more. Writes, write-zeroes and flushes fail at once
    /// (`EROFS`), those waiting for the copy elsewhere too; reads go on. Kept by the
    /// mirrors that reuse these regions (a grow, a copy changed) until the volume closes.
    pub fn fence(&self) {
        if !self.shared.regions.fenced.swap(true, Ordering::AcqRel) {
            tracing::error!(mirror = %self.shared.spec.name, "the volume was promoted on another host: its writes fail here from now on");
        }
    }

    /// Whether the volume is fenced off ([`Mirror::fence`]).
    pub fn fenced(&self) -> bool {
        self.shared.regions.fenced.load(Ordering::Acquire)
    }

    /// Whether leg `slot` holds a complete, current copy (present, nothing stale).
    pub fn leg_current(&self, slot: u8) -> bool {
        self.shared.writable() & bitmap::stale(slot) != 0
            && self.shared.regions.stale[slot as usize % MAX_LEGS].load(Ordering::Acquire) == 0
    }

    /// Whether some region's only current legs are among `slots` (a bit per slot): one
    /// where every other leg missed a write it took (a transient failure the copy has not
    /// caught up with yet), so removing those legs would lose acknowledged writes.
    pub fn only_current_in(&self, slots: u8) -> bool {
        let (all, r) = (self.shared.all_slots(), &self.shared.regions);
        (0..r.bitmap.regions()).any(|i| {
            let current = all & !r.bitmap.byte(i).load(Ordering::Acquire) & 0b111;
            current != 0 && current & !slots == 0
        })
    }

    /// Clears the intent bit of every region with no write in flight (a clean stop: the
    /// next start then resyncs only what was really in flight). Safe while writes run.
    pub fn clear_quiet_intents(&self) {
        let r = &self.shared.regions;
        for i in 0..r.bitmap.regions() {
            if r.bitmap.byte(i).load(Ordering::Acquire) & INTENT != 0 {
                r.try_clear_intent(i, r.gens[i].load(Ordering::SeqCst));
            }
        }
    }

    /// Whether the background thread has ended (after a stop) and let go of what it held.
    pub fn copying_ended(&self) -> bool {
        self.shared.stopped.load(Ordering::Acquire)
    }

    /// Stops the background thread (its copying and health keeping) for good and waits, at
    /// most 5 s, until it has: after a `true`, nothing it does reaches a leg any more (a
    /// volume being deleted, whose space is about to be given back). After a `false` (a
    /// piece's read or write still waiting, on a hung link), the thread starts no write
    /// after the stop; only a write already submitted to a hung leg device can still land.
    pub fn stop_copying(&self) -> bool {
        self.stop_resync()
    }

    /// Ends the background thread and waits for it (bounded: a copy in progress finishes
    /// first); false, logged, when it did not end in time.
    fn stop_resync(&self) -> bool {
        resync::end(&self.shared, self.device.path())
    }

    /// An operator's decision for regions where no usable leg is current (every leg missed
    /// acknowledged writes there, or the only current one's device failed): leg `slot`'s
    /// bytes become the region's content and are copied to the other legs. Whatever
    /// acknowledged writes that leg missed there are lost, which is why spoold never does
    /// this by itself. Returns how many regions changed; the leg must be usable.
    pub fn accept_leg(&self, slot: u8) -> Result<u64> {
        let all = self.shared.all_slots();
        if all & bitmap::stale(slot) == 0 || self.shared.writable() & bitmap::stale(slot) == 0 {
            return Err(Error::io(
                self.device.path(),
                "accept leg",
                std::io::Error::other(format!(
                    "leg {slot} is not a usable leg of this mirror (see `volume show`)"
                )),
            ));
        }
        let r = &self.shared.regions;
        let mut changed = 0;
        for i in self.shared.regions_without_current() {
            r.accept(i, all, slot);
            changed += 1;
        }
        if changed > 0 {
            r.bitmap.sync(0, r.bitmap.regions() - 1);
            tracing::warn!(mirror = %self.device.path().display(), slot, regions = changed, "an operator accepted a leg as current where no leg was: acknowledged writes it missed there are lost");
        }
        Ok(changed)
    }

    /// Regions resynced because the mirror was not shut down cleanly.
    pub fn resync_at_open(&self) -> u64 {
        self.shared.resync_at_open
    }
}

impl Drop for MirrorBackend {
    /// Returns once the background thread let go of the legs: whoever dropped the mirror
    /// (a pool closing, a power cut in the torture tester) may then take the devices for
    /// itself. A copy finishing behind its back once wrote a leg and marked it current
    /// after the torture tester had put the devices back to what a power cut leaves: the
    /// leg read old data after the cut (seed 4).
    fn drop(&mut self) {
        resync::end(&self.shared, &self.path);
    }
}

impl PoolDevice for MirrorBackend {
    fn path(&self) -> &Path {
        &self.path
    }

    fn size(&self) -> u64 {
        self.shared.spec.size
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            backend: "mirror",
            direct_align: None,
            inline_io: false,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        resync::read_current(&self.shared, buf, offset)
    }

    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        resync::write_all_legs(&self.shared, offset, Some(buf), buf.len() as u64)
    }

    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        resync::write_all_legs(&self.shared, offset, None, len)
    }

    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        Ok(Box::new(MirrorQueue::new(self.shared.clone(), depth)?))
    }

    fn probe(&self) -> Probe {
        match self.shared.writable() {
            0 => Probe::Gone("no leg of the mirror is usable".into()),
            _ => Probe::Ok,
        }
    }
}
