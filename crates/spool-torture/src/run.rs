//! Runs a case: builds its world, drives its steps through the engine, keeps the model, and
//! checks every read, every restart and the end (the volume, its snapshots and `pool check`)
//! against it. A write that fails is sent again (as the worker retries a path error) and,
//! failing still, may have landed or not; a restart gives up every request in flight.
//!
//! Owns: [`run`] and what a failure says. Must not know: how steps are drawn.

use std::collections::HashMap;
use std::path::Path;

use crate::case::{Case, Step};
use crate::engine::{Engine, Kind as Io, Request};
use crate::model::{check_allowed, decode, stamp, widen_sets, Model, Wrong, ANY, SECTOR, ZERO};
use crate::world::{World, VOLUME};

mod verify;

/// Requests in flight per queue at most.
const DEPTH: u32 = 8;
/// The bit that marks a flush's id among the reads' (both kept in `racing`).
const FLUSH: u64 = 1 << 62;
/// Times a failed request is sent again before it counts as failed.
const RETRIES: u32 = 4;

/// A case that failed: at which step, and what was wrong.
#[derive(Debug, Clone)]
pub struct Failure {
    pub step: usize,
    pub what: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "step {}: {}", self.step, self.what)
    }
}

/// What a case that passed did.
#[derive(Debug, Default, Clone)]
pub struct Summary {
    pub requests: u64,
    pub failed_requests: u64,
    pub bytes_checked: u64,
    pub restarts: u64,
    pub snapshots: u64,
    /// Reverts, clones and inflates that were done (not refused).
    pub controls: u64,
    pub power_cuts: u64,
    /// Writes the power cuts took back.
    pub writes_lost: u64,
}

struct Runner {
    world: World,
    engine: Option<Engine>,
    model: Model,
    snaps: Vec<(String, Model)>,
    /// Clones made, and what each must hold (they are not written).
    clones: Vec<(String, Model)>,
    generation: u64,
    step: usize,
    sum: Summary,
    /// Failed requests to send again.
    again: Vec<Request>,
    /// Reads in flight (by the id in their `generation`): what each may return, and where
    /// it starts.
    racing: HashMap<u64, Vec<Vec<u64>>>,
    read_at: HashMap<u64, u64>,
    /// Reads (and flushes) sent so far (their ids).
    reads: u64,
    /// What each sector may hold after a power cut: what the last completed flush left
    /// there, and every value allowed since.
    hist: Model,
    /// `hist` as it was when each snapshot (and the clones of it) was taken.
    snap_hist: HashMap<String, Model>,
}

/// Runs `case` in `dir` (a new, empty directory).
pub fn run(case: &Case, dir: &Path) -> Result<Summary, Failure> {
    let fail = |step: usize| move |what: Wrong| Failure { step, what: what.0 };
    let world = World::build(dir, &case.world).map_err(fail(0))?;
    let mut r = Runner {
        world,
        engine: None,
        model: Model::new(
            case.world.size.next_multiple_of(SECTOR),
            case.world.kind.encrypted(),
        ),
        snaps: Vec::new(),
        clones: Vec::new(),
        generation: 0,
        step: 0,
        sum: Summary::default(),
        again: Vec::new(),
        racing: HashMap::new(),
        read_at: HashMap::new(),
        reads: 0,
        hist: Model::new(
            case.world.size.next_multiple_of(SECTOR),
            case.world.kind.encrypted(),
        ),
        snap_hist: HashMap::new(),
    };
    r.open_engine().map_err(fail(0))?;
    // Each step as it starts, to set beside the pool's log (RUST_LOG) when a case is read.
    let trace = std::env::var_os("SPOOL_TORTURE_TRACE").is_some();
    for (i, st) in case.steps.iter().enumerate() {
        r.step = i;
        if trace {
            eprintln!("step {}: {st:?}", i + 1);
        }
        r.one(st).map_err(fail(i))?;
    }
    r.step = case.steps.len();
    r.verify().map_err(fail(r.step))?;
    // The check reads every map: a fault rule left armed would fail it for what it is.
    for (_, d) in r.world.pool().device_handles() {
        d.faults().clear();
    }
    let report = r.world.pool().check();
    if !report.problems.is_empty() {
        return Err(fail(r.step)(Wrong(format!(
            "pool check: {:?}",
            report.problems
        ))));
    }
    Ok(r.sum)
}

impl Runner {
    fn engine(&mut self) -> &mut Engine {
        self.engine.as_mut().expect("engine open")
    }

    fn open_engine(&mut self) -> Result<(), Wrong> {
        let queues = self.world.spec.queues;
        let layout = (self.world.pool().layout(VOLUME)).map_err(|e| format!("layout: {e}"))?;
        self.engine = Some(Engine::open(layout, queues, DEPTH).map_err(|e| e.to_string())?);
        Ok(())
    }

    fn one(&mut self, st: &Step) -> Result<(), Wrong> {
        match *st {
            Step::Io {
                q,
                kind,
                offset,
                len,
            } => self.io(q, kind, offset, len),
            Step::Drain => self.drain(),
            Step::Verify => self.verify(),
            Step::Grow { by } => self.grow(by),
            Step::Snapshot => self.snapshot(),
            Step::Revert { of } => self.revert(of),
            Step::Clone { of } => self.clone_snapshot(of),
            Step::DeleteSnapshot { of } => {
                self.delete_snapshot(of);
                Ok(())
            }
            Step::Inflate => self.inflate(),
            Step::Fault {
                dev,
                meta,
                write,
                count,
            } => {
                self.world.fault(dev, meta, write, count);
                Ok(())
            }
            Step::Restart => self.restart(),
            Step::PowerCut { seed } => self.power_cut(seed),
        }
    }

    /// Submits one request once its queue has room and, for an update, no other update
    /// over its range is in flight (two would land in either order). Reads race anything:
    /// each keeps the sets of its range as they were when it went out, widened by every
    /// update submitted while it is in flight.
    fn io(&mut self, q: usize, kind: Io, offset: u64, len: u64) -> Result<(), Wrong> {
        let size = self.model.sectors() * SECTOR;
        let (offset, len) = (offset.min(size), len.min(size - offset.min(size)));
        if kind != Io::Flush && len == 0 {
            return Ok(());
        }
        let update = !matches!(kind, Io::Read | Io::Flush);
        self.settle(move |e| e.has_room(q) && !(update && e.overlaps_update(offset, len)))?;
        let mut buf = Vec::new();
        let mut generation = 0;
        match kind {
            Io::Write => {
                self.generation += 1;
                generation = self.generation;
                buf = vec![0u8; len as usize];
                stamp(&mut buf, offset, generation);
                self.allow(offset, len, generation);
            }
            Io::Read => {
                // A read's "generation" names it among the reads in flight.
                self.reads += 1;
                generation = self.reads;
                buf = vec![0xeeu8; len as usize];
                let mut sets = self.model.sets_of(offset, len);
                // An update in flight already races it too: a sector may be torn there.
                for (o, l) in self.engine().updates_in_flight() {
                    widen_sets(&mut sets, offset, o, l, ANY);
                }
                self.racing.insert(generation, sets);
                self.read_at.insert(generation, offset);
            }
            Io::Discard => {
                self.allow(offset, len, ZERO);
                if self.world.spec.kind.encrypted() {
                    // Ciphertext discarded decrypts to noise (or stays as it was).
                    self.allow(offset, len, ANY);
                }
            }
            Io::Zero => self.allow(offset, len, ZERO),
            Io::Flush => {
                // What the flush will have made durable: the sets now, widened by what is
                // allowed while it is in flight (kept as a read of the whole volume is).
                self.reads += 1;
                generation = FLUSH | self.reads;
                self.racing.insert(generation, self.model.sets_of(0, size));
                self.read_at.insert(generation, 0);
            }
        }
        self.sum.requests += 1;
        self.engine().submit(q, kind, offset, len, generation, buf);
        Ok(())
    }

    /// `[offset, offset + len)` may hold `value` from now on, and so may what every read in
    /// flight over it returns.
    ///
    /// A read racing an update may also see a sector torn between the two (a file's page
    /// cache copies bytes, not sectors, and no device promises more for a read and a write
    /// of one block in flight together): anything but another block's data.
    fn allow(&mut self, offset: u64, len: u64, value: u64) {
        self.model.allow(offset, len, value);
        self.hist.allow(offset, len, value);
        for (&id, sets) in self.racing.iter_mut() {
            let start = self.read_at.get(&id).copied();
            if let Some(start) = start {
                widen_sets(sets, start, offset, len, value);
                if id & FLUSH == 0 {
                    widen_sets(sets, start, offset, len, ANY);
                }
            }
        }
    }

    /// Reaps until `until` holds and no failed request waits to be sent again, settling
    /// every request that finishes.
    fn settle(&mut self, until: impl Fn(&Engine) -> bool) -> Result<(), Wrong> {
        loop {
            self.resend();
            if until(self.engine.as_ref().expect("engine open")) {
                return Ok(());
            }
            let done = self.engine().reap_until(&until)?;
            for r in done {
                self.finished(r)?;
            }
        }
    }

    fn drain(&mut self) -> Result<(), Wrong> {
        self.settle(|e| e.in_flight(None) == 0)
    }

    /// What a finished request makes of the model, or what is wrong with it.
    fn finished(&mut self, r: Request) -> Result<(), Wrong> {
        if r.error != 0 {
            return self.failed(r);
        }
        match r.kind {
            Io::Write => self.model.set(r.offset, r.len, r.generation),
            Io::Zero => self.model.set(r.offset, r.len, ZERO),
            Io::Read => {
                let sets = self.racing.remove(&r.generation).unwrap_or_default();
                self.read_at.remove(&r.generation);
                for (k, s) in r.buf.chunks_exact(SECTOR as usize).enumerate() {
                    let at = r.offset + k as u64 * SECTOR;
                    let allowed = sets.get(k).map_or(self.model.allowed(at / SECTOR), |v| v);
                    check_allowed(allowed, at, decode(s)).map_err(|e| {
                        let e = match decode(s) {
                            crate::model::Seen::Garbage => {
                                format!("{e}: {}", crate::model::describe(s))
                            }
                            _ => e.to_string(),
                        };
                        Wrong(format!(
                            "read at {} (+{}): sector {at} {e}",
                            r.offset,
                            k as u64 * SECTOR
                        ))
                    })?;
                }
                self.sum.bytes_checked += r.len;
            }
            Io::Flush => {
                // Durable now: what a power cut may leave starts from here.
                if let Some(sets) = self.racing.remove(&r.generation) {
                    self.read_at.remove(&r.generation);
                    self.hist.replace(sets);
                }
            }
            Io::Discard => {}
        }
        Ok(())
    }

    /// A failed request: sent again up to RETRIES times, as the worker retries a path error
    /// (an encrypted volume's write-zeroes is refused for good, and a full pool fails a
    /// write for good); failing still, its effect stays possible.
    fn failed(&mut self, r: Request) -> Result<(), Wrong> {
        let final_ = (r.error == -libc::EOPNOTSUPP && r.kind == Io::Zero)
            || r.error == -libc::ENOSPC
            || r.tries >= RETRIES;
        match final_ {
            true => {
                self.sum.failed_requests += 1;
                if r.kind == Io::Read {
                    self.racing.remove(&r.generation);
                    self.read_at.remove(&r.generation);
                }
            }
            false => self.again.push(r),
        }
        Ok(())
    }

    /// Sends the failed requests again, after a pause that grows with their tries (a device
    /// reset takes a moment).
    fn resend(&mut self) {
        let again = std::mem::take(&mut self.again);
        if let Some(most) = again.iter().map(|r| r.tries).max() {
            std::thread::sleep(std::time::Duration::from_millis(1 << most.min(5)));
        }
        for mut r in again {
            match r.kind {
                Io::Read => {
                    r.buf.fill(0xee);
                    let updates = self.engine().updates_in_flight();
                    if let (Some(sets), Some(&at)) = (
                        self.racing.get_mut(&r.generation),
                        self.read_at.get(&r.generation),
                    ) {
                        for (o, l) in updates {
                            widen_sets(sets, at, o, l, ANY);
                        }
                    }
                }
                // Sent again, it races the reads in flight over it as a new one would (its
                // value is allowed already: this widens them by a torn sector).
                Io::Write => self.allow(r.offset, r.len, r.generation),
                Io::Discard | Io::Zero => self.allow(r.offset, r.len, ZERO),
                Io::Flush => {}
            }
            self.engine().resubmit(r);
        }
    }

    /// Checks `buf`, read at volume offset `offset`, against `m`, sector by sector.
    fn check(&self, m: &Model, offset: u64, buf: &[u8], what: &str) -> Result<(), Wrong> {
        for (k, s) in buf.chunks_exact(SECTOR as usize).enumerate() {
            let at = offset + k as u64 * SECTOR;
            if let Err(e) = m.check(at, decode(s)) {
                return Err(Wrong(format!(
                    "{what} at {offset} (+{}): sector {at} {e}",
                    k as u64 * SECTOR
                )));
            }
        }
        Ok(())
    }

    /// Reads the whole volume (1 MiB at a time, on queue 0) and every snapshot, and checks
    /// them.
    fn verify(&mut self) -> Result<(), Wrong> {
        self.drain()?;
        let size = self.model.sectors() * SECTOR;
        let mut at = 0;
        while at < size {
            let len = (1 << 20).min(size - at);
            self.io(0, Io::Read, at, len)?;
            at += len;
        }
        self.drain()?;
        let snaps = std::mem::take(&mut self.snaps);
        let result = self.verify_snapshots(&snaps);
        self.snaps = snaps;
        result?;
        let clones = std::mem::take(&mut self.clones);
        let result = clones.iter().try_for_each(|(n, m)| self.verify_clone(n, m));
        self.clones = clones;
        result
    }

    /// Snapshot `of` (modulo how many there are), if any.
    fn snap(&self, of: usize) -> Option<(String, Model)> {
        (!self.snaps.is_empty()).then(|| self.snaps[of % self.snaps.len()].clone())
    }

    /// With no queue open (the daemon refuses a revert under a connected VM): the volume
    /// holds the snapshot's data after, or (a failure part way) either.
    fn revert(&mut self, of: usize) -> Result<(), Wrong> {
        let Some((name, m)) = self.snap(of) else {
            return Ok(());
        };
        self.drain()?;
        self.engine = None;
        match self.world.pool().revert_volume(VOLUME, &name) {
            Ok(_) => {
                self.sum.controls += 1;
                self.model.take(&m);
                let h = self.snap_hist.get(&name).cloned().unwrap_or(m);
                self.hist.take(&h);
            }
            Err(_) => {
                self.model.widen(&m);
                let h = self.snap_hist.get(&name).cloned().unwrap_or(m);
                self.hist.widen(&h);
            }
        }
        self.open_engine()
    }

    fn clone_snapshot(&mut self, of: usize) -> Result<(), Wrong> {
        let Some((name, m)) = self.snap(of) else {
            return Ok(());
        };
        let clone = format!("c{}", self.step);
        if self
            .world
            .pool()
            .clone_snapshot(VOLUME, &name, &clone)
            .is_ok()
        {
            if let Some(h) = self.snap_hist.get(&name).cloned() {
                self.snap_hist.insert(clone.clone(), h);
            }
            self.clones.push((clone, m));
        }
        Ok(())
    }

    fn delete_snapshot(&mut self, of: usize) {
        if let Some((name, _)) = self.snap(of) {
            if self.world.pool().delete_snapshot(VOLUME, &name).is_ok() {
                self.snaps.retain(|(n, _)| *n != name);
            }
        }
    }

    /// Copies what the volume shares, with its queues open and idle (as the daemon does it
    /// under a running VM): nothing it holds changes.
    fn inflate(&mut self) -> Result<(), Wrong> {
        self.drain()?;
        if self.world.pool().inflate_volume(VOLUME).is_ok() {
            self.sum.controls += 1;
        }
        Ok(())
    }

    fn grow(&mut self, by: u64) -> Result<(), Wrong> {
        self.drain()?;
        let size = self.model.sectors() * SECTOR + by;
        match self.world.pool().resize_volume(VOLUME, size) {
            Ok(_) => {
                self.model.grow(size);
                self.hist.grow(size);
                self.open_engine()
            }
            // A grow the pool has no room for, or whose table commit failed (a metadata
            // fault), changes nothing this process serves.
            Err(_) => Ok(()),
        }
    }

    fn snapshot(&mut self) -> Result<(), Wrong> {
        self.drain()?;
        let name = format!("s{}", self.step);
        match self.world.pool().snapshot_volume(VOLUME, &name) {
            Ok(_) => {
                self.snap_hist.insert(name.clone(), self.hist.clone());
                self.snaps.push((name, self.model.clone()));
                self.sum.snapshots += 1;
                Ok(())
            }
            // Refused, or its commit failed: no snapshot to check (one whose commit was
            // unsure may come back at a restart; it is not checked).
            Err(_) => Ok(()),
        }
    }

    /// Gives up what is in flight, cuts the power (each device keeps what its flushes
    /// covered and a random subset of the rest) and checks everything against what a cut
    /// may leave: since the last flush, any value written (snapshots and clones alike).
    fn power_cut(&mut self, seed: u64) -> Result<(), Wrong> {
        self.again.clear();
        self.engine().reap_until(|e| e.in_flight(None) == 0)?;
        self.racing.clear();
        self.read_at.clear();
        self.engine = None;
        let lost = self.world.power_cut(&mut crate::rng::Rng::new(seed))?;
        self.sum.power_cuts += 1;
        self.sum.writes_lost += lost;
        self.model = self.hist.clone();
        for (n, m) in self.snaps.iter_mut().chain(self.clones.iter_mut()) {
            if let Some(h) = self.snap_hist.get(n) {
                m.widen(h);
            }
        }
        self.open_engine()?;
        self.verify()
    }

    /// Gives up what is in flight (each may have landed or not: the model allows both
    /// already), opens the pool again from its devices and checks everything.
    fn restart(&mut self) -> Result<(), Wrong> {
        self.restart_quiet()?;
        self.verify()
    }

    /// Disarms every fault rule still armed on the pool's devices.
    fn clear_faults(&mut self) {
        for (_, d) in self.world.pool().device_handles() {
            d.faults().clear();
        }
    }

    /// [`Self::restart`] without the check.
    fn restart_quiet(&mut self) -> Result<(), Wrong> {
        self.again.clear();
        self.engine().reap_until(|e| e.in_flight(None) == 0)?;
        self.racing.clear();
        self.read_at.clear();
        self.engine = None;
        self.clear_faults();
        self.world.reopen()?;
        self.sum.restarts += 1;
        self.open_engine()
    }
}
