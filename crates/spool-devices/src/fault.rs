//! Fault injection: make a healthy device fail in chosen ways, for tests and rehearsals.
//!
//! Owns: the per-device rule set ([`FaultSet`]: by operation and byte range, once, N times or
//! until cleared, optionally for a duration), the simulated SMART critical-warning byte of
//! devices that have no SMART log (files), and [`FaultyQueue`], the wrapper every device
//! queue goes through. With no rule armed the wrapper costs one relaxed atomic load per
//! submission; a matching rule completes the operation with its errno without touching the
//! device, or holds it ("hang") until the queue is aborted, as a controller reset would.
//!
//! Must not know: what the errors mean (the health layer classifies them) or who asked.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::queue::{DeviceIo, DeviceQueue};
use crate::write_log::{Logging, WriteLog};

/// Which operations a rule matches. `Read`, `Write` and `Any` are the queues' I/O (guest
/// data, mirror copies); the `Meta*` kinds are the device's synchronous metadata I/O
/// ([`crate::Device::read_at`], [`crate::Device::write_at_durable`],
/// [`crate::Device::zero_range`]: pool tables, thin maps, chunk zeroing, copy-on-write
/// copies), so that every durable metadata step can be made to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOps {
    Read,
    /// Writes, write-zeroes, discards and flushes.
    Write,
    Any,
    /// Synchronous metadata reads.
    MetaRead,
    /// Synchronous durable metadata writes.
    MetaWrite,
    /// Synchronous zeroing of a range.
    MetaZero,
    /// Any synchronous metadata operation.
    Meta,
}

/// A synchronous metadata operation of a [`crate::Device`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaOp {
    Read,
    Write,
    Zero,
}

impl FaultOps {
    /// Whether a rule on these ops matches a queue operation (`write`: not a read).
    fn matches_queue(self, write: bool) -> bool {
        match self {
            FaultOps::Any => true,
            FaultOps::Read => !write,
            FaultOps::Write => write,
            FaultOps::MetaRead | FaultOps::MetaWrite | FaultOps::MetaZero | FaultOps::Meta => false,
        }
    }

    /// Whether a rule on these ops matches a synchronous metadata operation.
    fn matches_meta(self, op: MetaOp) -> bool {
        matches!(
            (self, op),
            (FaultOps::Meta, _)
                | (FaultOps::MetaRead, MetaOp::Read)
                | (FaultOps::MetaWrite, MetaOp::Write)
                | (FaultOps::MetaZero, MetaOp::Zero)
        )
    }

    /// Whether these ops are the synchronous metadata kinds.
    pub fn is_meta(self) -> bool {
        self.matches_meta(MetaOp::Read)
            || self.matches_meta(MetaOp::Write)
            || self.matches_meta(MetaOp::Zero)
    }
}

/// What a matching operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultEffect {
    /// Completes with this (positive) errno, without reaching the device.
    Errno(i32),
    /// Never completes until the queue is aborted (a hung command).
    Hang,
    /// Never completes, not even when the queue is aborted: a controller that lost the
    /// command and may still carry it out at any time (what a reset is not guaranteed to
    /// fence). Simulated: the command is held and never reaches the device.
    Stuck,
    /// Aborts the whole process when submitted: a request that crashes the worker (a bug
    /// some request triggers). Armed from the config at start (`[[faults]]`, through
    /// [`crate::OpenOptions::faults`]), every restarted worker crashes on it again: what a
    /// poison request does.
    Crash,
    /// Not an I/O effect: the worker's queue thread that resets this device panics there,
    /// with requests in flight (a bug on the reset path). The keeper restarts the worker.
    PanicOnReset,
    /// Not an I/O effect: that queue thread stops there for good (a wedged worker, which
    /// the worker watchdog finds and the keeper replaces).
    WedgeOnReset,
}

impl FaultEffect {
    /// Whether it acts on the worker's reset path rather than on I/O.
    pub fn on_reset(&self) -> bool {
        matches!(self, FaultEffect::PanicOnReset | FaultEffect::WedgeOnReset)
    }
}

/// One injection rule.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultRule {
    pub effect: FaultEffect,
    pub ops: FaultOps,
    /// Device byte range; `len == 0` means the whole device.
    pub offset: u64,
    pub len: u64,
    /// How many operations it hits before it disarms; `None` = until cleared.
    pub count: Option<u64>,
    /// Disarms after this long.
    pub duration: Option<Duration>,
    /// Also fails the health monitor's probe (the link is down, not just some commands).
    pub fails_probe: bool,
}

#[derive(Debug)]
struct Armed {
    id: u64,
    rule: FaultRule,
    until: Option<Instant>,
    hits: u64,
}

/// A public view of an armed rule.
#[derive(Debug, Clone)]
pub struct FaultStatus {
    pub id: u64,
    pub rule: FaultRule,
    pub hits: u64,
    pub remaining: Option<u64>,
}

/// The fault rules of one device.
#[derive(Debug, Default)]
pub struct FaultSet {
    /// Some rule acts on I/O (what the data path checks, one relaxed load per request).
    armed: AtomicBool,
    /// Some rule acts on the worker's reset path (kept apart, so that it costs I/O nothing).
    reset_armed: AtomicBool,
    rules: Mutex<Vec<Armed>>,
    next_id: AtomicU64,
    smart_warning: AtomicU8,
    injected: AtomicU64,
    /// The power-cut log, when a test armed one (queues opened after it log their writes).
    log: std::sync::OnceLock<std::sync::Arc<WriteLog>>,
}

impl FaultSet {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Armed>> {
        self.rules.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Arms the power-cut log (tests: [`WriteLog`]); queues opened from now on log their
    /// writes and flushes in it. False when one is armed already.
    pub fn set_write_log(&self, log: std::sync::Arc<WriteLog>) -> bool {
        self.log.set(log).is_ok()
    }

    /// The power-cut log, if armed.
    pub fn write_log(&self) -> Option<&std::sync::Arc<WriteLog>> {
        self.log.get()
    }

    /// Arms a rule; returns its id.
    pub fn add(&self, rule: FaultRule) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let until = rule.duration.map(|d| Instant::now() + d);
        let on_reset = rule.effect.on_reset();
        let mut rules = self.lock();
        rules.push(Armed {
            id,
            rule,
            until,
            hits: 0,
        });
        match on_reset {
            true => self.reset_armed.store(true, Ordering::Release),
            false => self.armed.store(true, Ordering::Release),
        }
        id
    }

    /// Disarms every rule and clears the simulated SMART warning; returns how many rules there were.
    pub fn clear(&self) -> usize {
        let mut rules = self.lock();
        let n = rules.len();
        rules.clear();
        self.armed.store(false, Ordering::Release);
        self.reset_armed.store(false, Ordering::Release);
        self.smart_warning.store(0, Ordering::Release);
        n
    }

    /// The armed rules.
    pub fn list(&self) -> Vec<FaultStatus> {
        let mut rules = self.lock();
        Self::expire(&mut rules);
        rules
            .iter()
            .map(|a| FaultStatus {
                id: a.id,
                rule: a.rule.clone(),
                hits: a.hits,
                remaining: a.rule.count.map(|c| c.saturating_sub(a.hits)),
            })
            .collect()
    }

    /// How many operations were failed or held by injection so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// Sets the simulated SMART critical-warning byte (NVMe log page 02h, byte 0).
    pub fn set_smart_warning(&self, bits: u8) {
        self.smart_warning.store(bits, Ordering::Release);
    }

    /// The simulated SMART critical-warning byte.
    pub fn smart_warning(&self) -> u8 {
        self.smart_warning.load(Ordering::Acquire)
    }

    fn expire(rules: &mut Vec<Armed>) {
        let now = Instant::now();
        rules
            .retain(|a| a.until.is_none_or(|u| now < u) && a.rule.count.is_none_or(|c| a.hits < c));
    }

    /// What an operation does under the armed rules (`None`: it goes to the device).
    #[inline]
    pub fn check(&self, write: bool, offset: u64, len: u64) -> Option<FaultEffect> {
        if !self.armed.load(Ordering::Relaxed) {
            return None;
        }
        self.check_slow(write, offset, len)
    }

    #[cold]
    fn check_slow(&self, write: bool, offset: u64, len: u64) -> Option<FaultEffect> {
        self.check_with(|ops| ops.matches_queue(write), offset, len)
    }

    /// The errno a synchronous metadata operation fails with under the armed rules (`None`:
    /// it goes to the device). A rule that would hold a queue operation (hang, stuck) fails
    /// a synchronous one with `ETIMEDOUT`, as a caller's timeout would; the others (crash,
    /// reset-path effects) act on queue operations only and never match here.
    pub fn check_meta(&self, op: MetaOp, offset: u64, len: u64) -> Option<i32> {
        if !self.armed.load(Ordering::Relaxed) {
            return None;
        }
        match self.check_with(|ops| ops.matches_meta(op), offset, len)? {
            FaultEffect::Errno(e) => Some(e),
            _ => Some(libc::ETIMEDOUT),
        }
    }

    fn check_with(
        &self,
        matches: impl Fn(FaultOps) -> bool,
        offset: u64,
        len: u64,
    ) -> Option<FaultEffect> {
        let mut rules = self.lock();
        Self::expire(&mut rules);
        if rules.iter().all(|a| a.rule.effect.on_reset()) {
            self.armed.store(false, Ordering::Release);
            return None;
        }
        let hit = rules.iter_mut().find(|a| {
            if a.rule.effect.on_reset()
                || a.rule.effect == FaultEffect::Crash && a.rule.ops.is_meta()
            {
                return false;
            }
            let ops = matches(a.rule.ops);
            let range = a.rule.len == 0
                || len == 0
                || (offset < a.rule.offset.saturating_add(a.rule.len)
                    && a.rule.offset < offset.saturating_add(len));
            ops && range
        })?;
        hit.hits += 1;
        self.injected.fetch_add(1, Ordering::Relaxed);
        Some(hit.rule.effect)
    }

    /// What the worker's reset path does under the armed rules: a panic or a wedge rule
    /// (counted as hit), or `None`.
    pub fn check_reset(&self) -> Option<FaultEffect> {
        if !self.reset_armed.load(Ordering::Relaxed) {
            return None;
        }
        let mut rules = self.lock();
        Self::expire(&mut rules);
        let hit = rules.iter_mut().find(|a| a.rule.effect.on_reset())?;
        hit.hits += 1;
        self.injected.fetch_add(1, Ordering::Relaxed);
        Some(hit.rule.effect)
    }

    /// The errno a health probe fails with, if a rule says the device does not answer.
    pub fn probe_fault(&self) -> Option<i32> {
        if !self.armed.load(Ordering::Relaxed) {
            return None;
        }
        let mut rules = self.lock();
        Self::expire(&mut rules);
        rules
            .iter()
            .find(|a| a.rule.fails_probe)
            .map(|a| match a.rule.effect {
                FaultEffect::Errno(e) => e,
                FaultEffect::Hang
                | FaultEffect::Stuck
                | FaultEffect::Crash
                | FaultEffect::PanicOnReset
                | FaultEffect::WedgeOnReset => libc::ETIMEDOUT,
            })
    }
}

/// A device queue with fault injection in front of it.
pub struct FaultyQueue<Q> {
    inner: Q,
    faults: std::sync::Arc<FaultSet>,
    done: VecDeque<(u64, i32)>,
    hung: Vec<u64>,
    stuck: Vec<u64>,
    /// The power-cut log's bookkeeping, when the device had one armed at open.
    logging: Option<Logging>,
}

impl<Q: DeviceQueue> FaultyQueue<Q> {
    /// Wraps `inner`; rules are read from `faults`.
    pub fn new(inner: Q, faults: std::sync::Arc<FaultSet>) -> Self {
        let logging = faults.write_log().cloned().map(Logging::new);
        FaultyQueue {
            inner,
            faults,
            done: VecDeque::new(),
            hung: Vec::new(),
            stuck: Vec::new(),
            logging,
        }
    }
}

impl<Q: DeviceQueue> DeviceQueue for FaultyQueue<Q> {
    #[inline]
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        let (write, offset, len) = match io {
            DeviceIo::Read { offset, len, .. } => (false, offset, len),
            DeviceIo::Write { offset, len, .. } => (true, offset, len),
            DeviceIo::Flush => (true, 0, 0),
            DeviceIo::Discard { offset, len } | DeviceIo::WriteZeroes { offset, len } => {
                (true, offset, len)
            }
        };
        match self.faults.check(write, offset, len) {
            // (`check` never answers with a reset-path effect.)
            None | Some(FaultEffect::PanicOnReset | FaultEffect::WedgeOnReset) => {
                // SAFETY: the caller's guarantee (valid buffers until reaped) covers the
                // log's copy of a write's data, made here, and is passed on unchanged.
                let tag = match &mut self.logging {
                    None => tag,
                    Some(l) => unsafe { l.submitted(io, tag) },
                };
                // SAFETY: as above.
                unsafe { self.inner.submit(io, tag) }
            }
            Some(FaultEffect::Errno(e)) => self.done.push_back((tag, -e)),
            Some(FaultEffect::Hang) => self.hung.push(tag),
            Some(FaultEffect::Stuck) => self.stuck.push(tag),
            Some(FaultEffect::Crash) => {
                let what = if write { "write" } else { "read" };
                eprintln!("spoold: injected crash on a {what} at {offset} (a crash fault rule)");
                std::process::abort();
            }
        }
    }

    fn kick(&mut self) -> std::io::Result<()> {
        self.inner.kick()
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        let n = crate::queue::drain_done(&mut self.done, done);
        match &mut self.logging {
            None => n + self.inner.reap(done),
            Some(l) => {
                n + self.inner.reap(&mut |id, res| {
                    if let Some(tag) = l.completed(id, res) {
                        done(tag, res)
                    }
                })
            }
        }
    }

    fn completion_fd(&self) -> RawFd {
        self.inner.completion_fd()
    }

    fn ack_completion_event(&self) {
        self.inner.ack_completion_event()
    }

    fn set_completion_events(&mut self, enabled: bool) {
        self.inner.set_completion_events(enabled)
    }

    fn polled(&self) -> bool {
        self.inner.polled()
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.done.len() + self.hung.len() + self.stuck.len()
    }

    fn abort(&mut self) -> usize {
        let n = self.hung.len();
        for t in self.hung.drain(..) {
            self.done.push_back((t, -libc::ECANCELED));
        }
        n + self.inner.abort()
    }

    fn abandon(&mut self) -> usize {
        let n = self.hung.len();
        for t in self.hung.drain(..) {
            self.done.push_back((t, -libc::ECANCELED));
        }
        n + self.inner.abandon()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(effect: FaultEffect, ops: FaultOps, offset: u64, len: u64) -> FaultRule {
        FaultRule {
            effect,
            ops,
            offset,
            len,
            count: None,
            duration: None,
            fails_probe: false,
        }
    }

    #[test]
    fn rules_match_by_op_and_range_and_run_out() {
        let f = FaultSet::default();
        assert_eq!(f.check(false, 0, 4096), None);
        f.add(FaultRule {
            count: Some(2),
            ..rule(
                FaultEffect::Errno(libc::ENODATA),
                FaultOps::Read,
                8192,
                4096,
            )
        });
        assert_eq!(f.check(true, 8192, 4096), None, "writes pass");
        assert_eq!(f.check(false, 0, 4096), None, "other ranges pass");
        assert_eq!(
            f.check(false, 4096, 8192),
            Some(FaultEffect::Errno(libc::ENODATA))
        );
        assert_eq!(
            f.check(false, 12287, 1),
            Some(FaultEffect::Errno(libc::ENODATA))
        );
        assert_eq!(f.check(false, 8192, 512), None, "two hits and it is spent");
        assert_eq!(f.injected(), 2);
        assert!(f.list().is_empty());
    }

    #[test]
    fn durations_expire_and_probe_faults_are_seen() {
        let f = FaultSet::default();
        f.add(FaultRule {
            duration: Some(Duration::from_millis(30)),
            fails_probe: true,
            ..rule(FaultEffect::Errno(libc::EIO), FaultOps::Any, 0, 0)
        });
        assert_eq!(f.probe_fault(), Some(libc::EIO));
        assert_eq!(
            f.check(true, 1 << 30, 512),
            Some(FaultEffect::Errno(libc::EIO))
        );
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(f.probe_fault(), None);
        assert_eq!(f.check(true, 0, 512), None);
    }

    #[test]
    fn hung_operations_complete_only_when_aborted() {
        let faults = std::sync::Arc::new(FaultSet::default());
        faults.add(FaultRule {
            count: Some(1),
            ..rule(FaultEffect::Hang, FaultOps::Any, 0, 0)
        });
        let mut q = FaultyQueue::new(
            crate::NullQueue::new(crate::NullReads::Untouched).unwrap(),
            faults,
        );
        // SAFETY: flushes carry no buffers.
        unsafe {
            q.submit(DeviceIo::Flush, 1);
            q.submit(DeviceIo::Flush, 2);
        }
        let mut got = Vec::new();
        q.reap(&mut |t, r| got.push((t, r)));
        assert_eq!(got, vec![(2, 0)]);
        assert_eq!(q.in_flight(), 1);
        assert_eq!(q.abort(), 1);
        got.clear();
        q.reap(&mut |t, r| got.push((t, r)));
        assert_eq!(got, vec![(1, -libc::ECANCELED)]);
        assert_eq!(q.in_flight(), 0);
    }

    #[test]
    fn reset_rules_act_on_the_reset_path_only_and_run_out() {
        let f = FaultSet::default();
        f.add(FaultRule {
            effect: FaultEffect::PanicOnReset,
            ops: FaultOps::Any,
            offset: 0,
            len: 0,
            count: Some(1),
            duration: None,
            fails_probe: false,
        });
        assert_eq!(f.check(true, 0, 4096), None, "no I/O is touched");
        assert_eq!(f.probe_fault(), None);
        assert_eq!(f.check_reset(), Some(FaultEffect::PanicOnReset));
        assert_eq!(f.check_reset(), None, "once");
        assert_eq!(f.injected(), 1);
    }
}
