//! The mirror's background thread and its synchronous I/O: copying stale regions from a
//! current leg (resync after a crash, catching up a leg that missed writes, rebuilding a new
//! leg), rate-limited; clearing intent bits of quiet regions; keeping the mirror's health
//! (healthy while every region has a usable current leg), also during a long pass; the leg
//! I/O that `verify` shares.
//!
//! Each region is copied by `copy.rs` (in pieces, writes kept out while one moves); reads
//! never go to a leg stale in the region, so a copy in progress is never seen.
//!
//! Owns: [`Progress`]. Must not know: the data path's queues, the pool.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::bitmap::{stale, sync_source, INTENT, SYNC_SOURCE};
use super::copy::copy_region;
use super::legio::{leg_read, leg_write, AlignedBuf, LegIo};
use super::regions::Entry;
use super::waiting;
use super::{Shared, MAX_LEGS, MISSING};
use spool_devices::{Error, HealthState, Result};

/// How often the thread looks for work when there is none.
const IDLE_TICK: Duration = Duration::from_millis(200);
/// The most of the copy's rate saved up while it walks regions needing no I/O.
const MAX_CREDIT: Duration = Duration::from_secs(1);
/// A region's intent bit is cleared after this long without a new write there.
const CLEAR_AFTER: Duration = Duration::from_secs(1);

/// What the copying has done since it last started.
#[derive(Default)]
pub(crate) struct ProgressCell {
    copied: AtomicU64,
    /// Bytes copied that count against the rate: `copied` less what was neither read nor
    /// written (`unwritten`).
    paced: AtomicU64,
    /// When copying last started, with `copied` and `paced` then, and where the rate's
    /// clock stands (moved on past time spent without I/O, see [`throttle`]).
    started: Mutex<Option<(Instant, u64, u64, Instant)>>,
    pub(crate) resynced: AtomicU64,
    /// Bytes copied as write-zeroes (pieces of zeroes): no data crossed for them.
    pub(crate) zeroes: AtomicU64,
    /// Bytes of regions copied that neither the source nor the targets ever wrote, by their
    /// devices (a thin copy's holes): neither read nor written.
    unwritten: AtomicU64,
}

/// One leg's state, as the control plane shows it.
#[derive(Debug, Clone)]
pub struct LegProgress {
    pub slot: u8,
    /// "current" (all data, usable), "catching-up" (usable, some regions stale),
    /// "unusable" (a device not healthy), "missing" (a device not in the pool).
    pub state: &'static str,
    pub stale_bytes: u64,
    /// A far leg that held a complete copy: writes wait for it (see `LegSpec::far`).
    pub required: bool,
}

/// A mirror's copying progress.
#[derive(Debug, Clone)]
pub struct Progress {
    pub legs: Vec<LegProgress>,
    pub region_size: u64,
    /// Bytes copied since copying last started, and bytes still to copy to usable legs.
    pub copied_bytes: u64,
    pub remaining_bytes: u64,
    /// Bytes per second since copying last started (0 when idle).
    pub rate: u64,
    pub eta_secs: Option<u64>,
    /// Regions resynced because the mirror was not shut down cleanly, and regions copied
    /// in all since the mirror was opened.
    pub resync_at_open: u64,
    pub regions_copied: u64,
    /// Bytes the copy wrote to target legs as write-zeroes (pieces that read as zeroes)
    /// since the mirror was opened: per target leg, and again for a piece copied again.
    /// Zeroes written as data to a device without write-zeroes are not counted (an NBD
    /// server without it gets them as data from the NBD client: counted all the same).
    pub zeroed_bytes: u64,
    /// Bytes copied that neither the source nor the targets ever wrote, by their devices (a
    /// thin copy's holes): neither read nor written, and not counted against `resync_rate`.
    pub unwritten_bytes: u64,
    /// Bytes in regions out of sync (after an unclean stop): every current leg holds every
    /// acknowledged write there, one serves the reads until the resync makes them agree.
    pub out_of_sync_bytes: u64,
    /// Regions where no leg is current, and the volume offsets of the first few: nothing
    /// can be read there until an operator accepts a leg (`Mirror::accept_leg`).
    pub regions_without_current: u64,
    pub without_current_offsets: Vec<u64>,
    /// Write-intent bitmap syncs since the mirror was opened, and their mean latency (µs):
    /// what crash consistency costs the data path (a write to a quiet region waits for one).
    pub bitmap_syncs: u64,
    pub bitmap_sync_us: f64,
}

/// Starts the background thread; `stopped` once it let go of its leg queues and the state.
pub(crate) fn start(shared: &Arc<Shared>) -> std::io::Result<()> {
    let (weak, stopped) = (Arc::downgrade(shared), shared.stopped.clone());
    let name = format!("mirror-{}", shared.spec.name);
    let body = move || (run(weak), stopped.store(true, Ordering::Release));
    let thread = std::thread::Builder::new().name(name.chars().take(15).collect());
    thread.spawn(body).map(|_| ())
}

/// Ends `shared`'s background thread and waits for it (bounded: a copy in progress finishes
/// its piece first); false, logged, when it did not end in time.
pub(crate) fn end(shared: &Shared, path: &std::path::Path) -> bool {
    shared.stop.store(true, Ordering::Release);
    if on_resync_thread() {
        return false; // (never waits for itself)
    }
    let t0 = std::time::Instant::now();
    while !shared.stopped.load(Ordering::Acquire) {
        if t0.elapsed() > std::time::Duration::from_secs(5) {
            tracing::error!(mirror = %path.display(), "the mirror's resync thread did not stop");
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    true
}

thread_local! {
    /// Set on a mirror's background thread (which must never wait for itself to end).
    static RESYNC_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the caller runs on a mirror's background thread.
pub(crate) fn on_resync_thread() -> bool {
    RESYNC_THREAD.with(|t| t.get())
}

fn run(weak: Weak<Shared>) {
    RESYNC_THREAD.with(|t| t.set(true));
    let mut seen: Vec<(u32, Instant)> = Vec::new();
    let (mut io, mut buf) = (LegIo::default(), AlignedBuf::default());
    loop {
        let Some(shared) = weak.upgrade() else { return };
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        keep_health(&shared);
        let copied = copy_pass(&shared, &mut io, &mut buf);
        clear_pass(&shared, &mut seen);
        drop(shared);
        if !copied {
            std::thread::sleep(IDLE_TICK);
        }
    }
}

/// Healthy while every stripe has a usable leg and every region a usable current one;
/// failed when some stripe has every leg on a missing or isolated device; resetting
/// otherwise: some stripe has no usable leg, or some region's current legs are all on
/// resetting devices (a device may come back: the worker holds requests meanwhile, and
/// would otherwise burn their retries on each region it cannot serve).
fn keep_health(shared: &Shared) {
    let Some(cell) = shared.health.get() else {
        return;
    };
    let healthy = shared.healthy();
    let required = require_caught_up_far_legs(shared, healthy);
    let to = match stripes_health(shared, healthy) {
        HealthState::Healthy if waiting::spans(shared, healthy) => HealthState::Resetting,
        HealthState::Healthy if waiting::stripes(shared, healthy) => HealthState::Resetting,
        // A copy elsewhere that was current cannot take writes (its link is down): every
        // request waits until it can, or until the operator drops it.
        // (Fenced off, nothing waits for it: its writes fail.)
        HealthState::Healthy
            if required & !shared.writable() != 0
                && !shared.regions.fenced.load(Ordering::Acquire) =>
        {
            HealthState::Resetting
        }
        h => h,
    };
    let state = cell.state();
    if state != to {
        cell.set(to);
        match to {
            HealthState::Healthy => {
                tracing::info!(mirror = %shared.spec.name, "a current leg is usable everywhere again: mirror healthy")
            }
            _ => {
                tracing::error!(mirror = %shared.spec.name, state = to.name(), "part of the mirror has no usable current leg")
            }
        }
    }
}

/// Makes every far leg that holds a complete copy now required (see `LegSpec::far`);
/// returns the required legs.
fn require_caught_up_far_legs(shared: &Shared, healthy: u64) -> u8 {
    let required = shared.required.load(Ordering::Acquire);
    let candidates = shared.far & !required & shared.usable(healthy, 0, shared.spec.size);
    if candidates == 0 {
        return required;
    }
    let mut now = required;
    for l in shared
        .spec
        .legs
        .iter()
        .filter(|l| candidates & stale(l.slot) != 0)
    {
        if shared.regions.stale[l.slot as usize].load(Ordering::Acquire) == 0 {
            shared.regions.required_ids[l.slot as usize].store(l.id, Ordering::Relaxed);
            now |= stale(l.slot);
            tracing::info!(mirror = %shared.spec.name, leg = l.slot, "the far leg holds a complete copy: every write now waits for it");
        }
    }
    shared.required.fetch_or(now, Ordering::AcqRel) | now
}

/// The mirror's health as its stripes say (see [`keep_health`]).
fn stripes_health(shared: &Shared, healthy: u64) -> HealthState {
    let gone = |d: usize| d == MISSING || shared.spec.devices[d].health().state().isolated();
    let mut to = HealthState::Healthy;
    for s in &shared.stripes {
        if s.dev
            .iter()
            .any(|&d| d != MISSING && healthy & (1 << d) != 0)
        {
            continue;
        }
        if s.dev.iter().all(|&d| gone(d)) {
            to = HealthState::Failed;
            break;
        }
        to = HealthState::Resetting;
    }
    to
}

/// Copies every region where a usable leg is stale, or that is out of sync, from a usable
/// current leg (an out-of-sync region: from its read source); returns whether it copied
/// anything.
fn copy_pass(shared: &Shared, io: &mut LegIo, buf: &mut AlignedBuf) -> bool {
    let healthy = shared.healthy();
    let n = shared.regions.bitmap.regions();
    let mut any = false;
    let mut health_kept = Instant::now();
    for r in 0..n {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        if health_kept.elapsed() >= IDLE_TICK {
            // A pass over a big volume is long even unthrottled.
            keep_health(shared);
            health_kept = Instant::now();
        }
        let byte = shared.regions.bitmap.byte(r).load(Ordering::Acquire);
        if byte & (0b111 | SYNC_SOURCE) == 0 {
            continue;
        }
        let (off, len) = region_range(shared, r);
        let writable = shared.usable(healthy, off, len);
        let current = writable & !byte & 0b111;
        let (source, targets) = match shared.regions.read_source(r, current) {
            // Every usable leg but the source gets the source's bytes.
            Some(s) => (s, writable & !stale(s) & 0b111),
            None if sync_source(byte).is_some() => continue,
            None => match current {
                0 => continue,
                c => (
                    near_first(shared, c).trailing_zeros() as u8,
                    byte & writable & 0b111,
                ),
            },
        };
        if targets == 0 && sync_source(byte).is_none() {
            continue;
        }
        match copy_region(shared, io, buf, (r, source, targets)) {
            Ok(Some(unwritten)) => {
                any = true;
                // A far leg current now takes every write from now on (before anyone
                // sees it current: see `Daemon::sending`).
                require_caught_up_far_legs(shared, healthy);
                note_copied(shared, r, unwritten);
            }
            Ok(None) => {}
            Err(e) => {
                // The device's health has the error: the next pass sees what it decided.
                tracing::warn!(mirror = %shared.spec.name, region = r, error = %e, "copying a mirror region failed; will retry");
                break;
            }
        }
    }
    if !any {
        *shared
            .progress
            .started
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
    }
    any
}

/// Region `r` was copied, `unwritten` bytes of it never written on the source: those do not
/// count against the rate (nothing was read for them).
fn note_copied(shared: &Shared, r: usize, unwritten: u64) {
    let (_, len) = region_range(shared, r);
    let p = &shared.progress;
    p.copied.fetch_add(len, Ordering::Relaxed);
    p.paced.fetch_add(len - unwritten, Ordering::Relaxed);
    p.unwritten.fetch_add(unwritten, Ordering::Relaxed);
    p.resynced.fetch_add(1, Ordering::Relaxed);
    let mut s = p.started.lock().unwrap_or_else(|p| p.into_inner());
    if s.is_none() {
        let now = Instant::now();
        *s = Some((
            now,
            p.copied.load(Ordering::Relaxed) - len,
            p.paced.load(Ordering::Relaxed) - (len - unwritten),
            now,
        ));
    }
    drop(s);
    throttle(shared);
}

/// Sleeps so the copy stays under the configured rate, keeping the mirror's health every
/// [`IDLE_TICK`] meanwhile.
fn throttle(shared: &Shared) {
    let rate = shared.spec.resync_rate;
    if rate == 0 {
        return;
    }
    let mut started = (shared.progress.started.lock()).unwrap_or_else(|p| p.into_inner());
    let Some((_, _, p0, clock)) = started.as_mut() else {
        return;
    };
    let paced = shared.progress.paced.load(Ordering::Relaxed) - *p0;
    let due = Duration::from_secs_f64(paced as f64 / rate as f64);
    // Time spent walking regions without I/O (a thin copy's holes) paced nothing: at most
    // MAX_CREDIT of it is saved up for the data after, not the whole walk (which let the
    // next few hundred MiB go unthrottled).
    if let Some(ahead) = clock.elapsed().checked_sub(due + MAX_CREDIT) {
        *clock += ahead;
    }
    let t0 = *clock;
    drop(started);
    // In slices: a pass over a big volume at a low rate lasts hours, and the mirror's
    // health (a current leg's device resetting) and a stop must not wait for it.
    while let Some(wait) = due.checked_sub(t0.elapsed()) {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        std::thread::sleep(wait.min(IDLE_TICK));
        keep_health(shared);
    }
}

/// Volume byte range of region `r`.
pub(super) fn region_range(shared: &Shared, r: usize) -> (u64, u64) {
    shared.region_range(r)
}

/// Clears the intent bit of regions without a write for [`CLEAR_AFTER`].
fn clear_pass(shared: &Shared, seen: &mut Vec<(u32, Instant)>) {
    let n = shared.regions.bitmap.regions();
    let now = Instant::now();
    seen.resize(n, (0, now));
    for (r, s) in seen.iter_mut().enumerate() {
        if shared.regions.bitmap.byte(r).load(Ordering::Relaxed) & INTENT == 0 {
            continue;
        }
        let g = shared.regions.gens[r].load(Ordering::SeqCst);
        if g != s.0 {
            *s = (g, now);
        } else if now.duration_since(s.1) >= CLEAR_AFTER {
            shared.regions.try_clear_intent(r, g);
        }
    }
}

/// `mask` without its far legs, unless only far legs are in it.
fn near_first(shared: &Shared, mask: u8) -> u8 {
    match mask & !shared.far {
        0 => mask,
        near => near,
    }
}

/// Synchronous read from a current leg, a near one first (not the data path).
pub(crate) fn read_current(shared: &Shared, buf: &mut [u8], off: u64) -> Result<()> {
    let regions = shared.regions.span(off, buf.len() as u64);
    let mask = near_first(
        shared,
        shared.readable(shared.healthy(), off, buf.len() as u64, regions),
    );
    match (0..MAX_LEGS as u8).find(|s| mask & stale(*s) != 0) {
        Some(s) => {
            let mut aligned = AlignedBuf::default();
            let b = aligned.get(buf.len());
            leg_read(shared, &mut LegIo::default(), s, off, b)?;
            buf.copy_from_slice(b);
            Ok(())
        }
        None => Err(no_current_leg(shared, "read")),
    }
}

/// A path error (`ENOLINK`): no usable leg holds every acknowledged write of the range.
fn no_current_leg(shared: &Shared, what: &'static str) -> Error {
    Error::io(
        std::path::Path::new(&shared.spec.name),
        what,
        std::io::Error::from_raw_os_error(libc::ENOLINK),
    )
}

/// Synchronous write (or zeroing, `data` None, of `len` bytes) to every usable leg.
pub(crate) fn write_all_legs(
    shared: &Shared,
    off: u64,
    data: Option<&[u8]>,
    len: u64,
) -> Result<()> {
    let writable = shared.usable(shared.healthy(), off, len);
    let (first, last) = shared.regions.span(off, len);
    loop {
        match (shared.regions).enter_write(first, last, shared.all_slots(), writable) {
            // A piece of the copy is landing there: one device write.
            Entry::Held => std::thread::sleep(Duration::from_micros(100)),
            Entry::Entered { .. } => break,
            Entry::NoCurrent => return Err(no_current_leg(shared, "write")),
        }
    }
    shared.regions.bitmap.sync(first, last);
    let mut res = Ok(());
    let (mut io, mut aligned) = (LegIo::default(), AlignedBuf::default());
    let mut written = Vec::new();
    for s in (0..MAX_LEGS as u8).filter(|s| writable & stale(*s) != 0) {
        let r = match data {
            Some(d) => {
                let b = aligned.get(d.len());
                b.copy_from_slice(d);
                leg_write(shared, &mut io, s, off, Some(b), len, &mut written)
            }
            None => leg_write(shared, &mut io, s, off, None, len, &mut written),
        };
        if r.is_err() {
            res = r;
        }
    }
    for d in written {
        if let Err(e) = io.flush(shared, d) {
            res = Err(e);
        }
    }
    shared.regions.leave(first, last);
    res
}

/// The mirror's progress as the control plane shows it.
pub(crate) fn progress(shared: &Shared) -> super::Progress {
    let writable = shared.writable();
    let size = 1u64 << shared.regions.shift;
    let legs: Vec<LegProgress> = shared
        .spec
        .legs
        .iter()
        .map(|l| {
            let stale_regions = shared.regions.stale[l.slot as usize].load(Ordering::Relaxed);
            let missing = l.pieces.iter().any(|p| p.device == MISSING);
            let state = match (missing, writable & stale(l.slot) != 0, stale_regions) {
                (true, _, _) => "missing",
                (_, false, _) => "unusable",
                (_, true, 0) => "current",
                _ => "catching-up",
            };
            LegProgress {
                slot: l.slot,
                state,
                stale_bytes: stale_regions * size,
                required: shared.required.load(Ordering::Relaxed) & stale(l.slot) != 0,
            }
        })
        .collect();
    let out_of_sync_bytes = shared.regions.out_of_sync.load(Ordering::Relaxed) * size;
    let remaining_bytes: u64 = legs
        .iter()
        .filter(|l| l.state == "catching-up")
        .map(|l| l.stale_bytes)
        .sum::<u64>()
        + out_of_sync_bytes;
    let (regions_without_current, without_current_offsets) = shared.without_current();
    let (syncs, sync_ns) = shared.regions.bitmap.syncs();
    let copied = shared.progress.copied.load(Ordering::Relaxed);
    let started = *shared
        .progress
        .started
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let (copied_bytes, rate) = match started {
        Some((t0, c0, _, _)) => {
            let secs = t0.elapsed().as_secs_f64().max(1e-3);
            (copied - c0, ((copied - c0) as f64 / secs) as u64)
        }
        None => (0, 0),
    };
    Progress {
        legs,
        region_size: size,
        copied_bytes,
        remaining_bytes,
        rate,
        eta_secs: (rate > 0).then(|| remaining_bytes / rate),
        resync_at_open: shared.resync_at_open,
        regions_copied: shared.progress.resynced.load(Ordering::Relaxed),
        zeroed_bytes: shared.progress.zeroes.load(Ordering::Relaxed),
        unwritten_bytes: shared.progress.unwritten.load(Ordering::Relaxed),
        out_of_sync_bytes,
        regions_without_current,
        without_current_offsets,
        bitmap_syncs: syncs,
        bitmap_sync_us: sync_ns as f64 / 1000.0 / syncs.max(1) as f64,
    }
}
