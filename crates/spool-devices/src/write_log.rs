//! [`WriteLog`]: what a power cut may take back from a device, for crash-consistency tests
//! (the torture tester's power cuts, as dm-log-writes replays do). Armed on a device's fault
//! set before its queues open, it records every write, discard and write-zeroes its queues
//! are given (where, what was there before, what is written) and every flush; a write is
//! *durable* once a flush submitted after it completed has completed. What is not durable a
//! cut may lose, in part: [`WriteLog::volatile`] lists it, oldest first, for the tester to
//! keep a random subset of.
//!
//! The device's synchronous metadata I/O is durable when it returns (`write_at_durable`,
//! `zero_range`) and is not logged; it syncs the whole device, so every write completed
//! before it is durable too. Never armed in spoold: queues opened without a log pay
//! one branch per request.
//!
//! Owns: the log. Must not know: what the writes are for.

use std::collections::HashMap;
use std::sync::Mutex;

/// Reads `buf.len()` bytes of the device at an offset, as they are now (what a write about
/// to be submitted replaces).
pub type ReadNow = Box<dyn Fn(u64, &mut [u8]) + Send + Sync>;

/// One logged write (a discard or write-zeroes writes zeroes).
#[derive(Debug, Clone)]
pub struct Logged {
    /// Order of submission.
    pub seq: u64,
    pub offset: u64,
    /// The bytes before it.
    pub old: Vec<u8>,
    /// The bytes it writes.
    pub new: Vec<u8>,
}

#[derive(Default)]
struct State {
    next: u64,
    /// Not durable yet, by seq; `done` once completed (successfully or not).
    writes: Vec<(Logged, bool)>,
    /// Flushes in flight: the seqs of the writes complete when each was submitted.
    flushes: HashMap<u64, Vec<u64>>,
}

/// The writes of one device a power cut may lose.
pub struct WriteLog {
    state: Mutex<State>,
    read_now: ReadNow,
}

impl std::fmt::Debug for WriteLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteLog").finish_non_exhaustive()
    }
}

impl WriteLog {
    /// A log reading the device's current bytes with `read_now`.
    pub fn new(read_now: ReadNow) -> WriteLog {
        WriteLog {
            state: Mutex::default(),
            read_now,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A write of `new` at `offset` is being submitted; returns its seq.
    pub(crate) fn write(&self, offset: u64, new: Vec<u8>) -> u64 {
        let mut old = vec![0u8; new.len()];
        (self.read_now)(offset, &mut old);
        let mut s = self.lock();
        let seq = s.next;
        s.next += 1;
        s.writes.push((
            Logged {
                seq,
                offset,
                old,
                new,
            },
            false,
        ));
        seq
    }

    /// Write `seq` completed.
    pub(crate) fn write_done(&self, seq: u64) {
        let mut s = self.lock();
        if let Some(w) = s.writes.iter_mut().find(|w| w.0.seq == seq) {
            w.1 = true;
        }
    }

    /// A flush is being submitted; returns its seq.
    pub(crate) fn flush(&self) -> u64 {
        let mut s = self.lock();
        let seq = s.next;
        s.next += 1;
        let covered = s.writes.iter().filter(|w| w.1).map(|w| w.0.seq).collect();
        s.flushes.insert(seq, covered);
        seq
    }

    /// Flush `seq` completed (`ok`): the writes complete at its submission are durable.
    pub(crate) fn flush_done(&self, seq: u64, ok: bool) {
        let mut s = self.lock();
        let covered = s.flushes.remove(&seq).unwrap_or_default();
        if ok {
            s.writes.retain(|w| !covered.contains(&w.0.seq));
        }
    }

    /// The whole device was synced (a durable metadata write): every write completed
    /// before is durable.
    pub(crate) fn synced(&self) {
        self.lock().writes.retain(|w| !w.1);
    }

    /// What a power cut now may lose, oldest first.
    pub fn volatile(&self) -> Vec<Logged> {
        self.lock().writes.iter().map(|w| w.0.clone()).collect()
    }

    /// Forgets everything (the device was cut and rewritten, or starts anew).
    pub fn clear(&self) {
        let mut s = self.lock();
        s.writes.clear();
        s.flushes.clear();
    }
}

/// What one queue keeps for the log: its operations under ids of its own (one request's
/// pieces share a tag), each with what it is in the log.
pub(crate) struct Logging {
    log: std::sync::Arc<WriteLog>,
    ops: crate::Slots<(u64, Op)>,
}

#[derive(Clone, Copy)]
enum Op {
    Write(u64),
    Flush(u64),
    Other,
}

impl Logging {
    pub(crate) fn new(log: std::sync::Arc<WriteLog>) -> Logging {
        Logging {
            log,
            ops: crate::Slots::default(),
        }
    }

    /// Logs `io`, about to be submitted under `tag`; returns the id to submit it under.
    ///
    /// # Safety
    /// A write's iovecs describe readable buffers valid for the call (the submit contract).
    pub(crate) unsafe fn submitted(&mut self, io: crate::DeviceIo, tag: u64) -> u64 {
        use crate::DeviceIo;
        let op = match io {
            DeviceIo::Write {
                offset,
                len,
                iov,
                iovcnt,
            } => {
                let mut data = Vec::with_capacity(len as usize);
                for i in 0..iovcnt as usize {
                    // SAFETY: the caller's contract: `iovcnt` valid iovecs, readable buffers.
                    let v = unsafe { *iov.add(i) };
                    // SAFETY: as above.
                    let b =
                        unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) };
                    data.extend_from_slice(b);
                }
                data.truncate(len as usize);
                Op::Write(self.log.write(offset, data))
            }
            DeviceIo::Discard { offset, len } | DeviceIo::WriteZeroes { offset, len } => {
                Op::Write(self.log.write(offset, vec![0u8; len as usize]))
            }
            DeviceIo::Flush => Op::Flush(self.log.flush()),
            DeviceIo::Read { .. } => Op::Other,
        };
        self.ops.insert((tag, op))
    }

    /// Operation `id` completed with `res`: logged, and its caller's tag returned.
    pub(crate) fn completed(&mut self, id: u64, res: i32) -> Option<u64> {
        let (tag, op) = self.ops.remove(id)?;
        match op {
            Op::Write(seq) => self.log.write_done(seq),
            Op::Flush(seq) => self.log.flush_done(seq, res >= 0),
            Op::Other => {}
        }
        Some(tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_become_durable_under_a_flush_submitted_after_them() {
        let log = WriteLog::new(Box::new(|_, b: &mut [u8]| b.fill(7)));
        let a = log.write(0, vec![1; 4]);
        let b = log.write(8, vec![2; 4]);
        log.write_done(a);
        let f = log.flush();
        log.write_done(b);
        assert_eq!(log.volatile().len(), 2);
        log.flush_done(f, true);
        let v = log.volatile();
        assert_eq!(v.len(), 1, "b completed after the flush went out");
        assert_eq!(
            (v[0].seq, v[0].offset, &v[0].old[..]),
            (b, 8, &[7u8; 4][..])
        );
        let g = log.flush();
        log.flush_done(g, false);
        assert_eq!(
            log.volatile().len(),
            1,
            "a failed flush makes nothing durable"
        );
        let h = log.flush();
        log.flush_done(h, true);
        assert!(log.volatile().is_empty());
    }
}
