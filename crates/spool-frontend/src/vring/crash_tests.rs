//! Exhaustive crash-point test of Algorithms 1 and 2 on a real virtqueue in guest memory and a
//! real journal file.
//!
//! A simulated guest driver submits requests (reusing descriptor heads as they come back),
//! a simulated device completes them last-in-first-out (out of order), and the backend is
//! the production `JournaledQueue` + `resume`. A crash is a panic at a chosen step: all
//! process state (the `Queue`, the device's pending list, the journal mapping) is dropped;
//! guest memory and the journal file survive, like after SIGKILL. The restarted backend is
//! told to resume at the ring's used index, as QEMU does after a backend death. What is
//! simulated: the guest driver and the device (only these cannot exist in a unit test).
//!
//! The device completes either one request at a time or in batches published by one
//! used-index update ([`JournaledQueue::complete_batch`], what the worker does).
//!
//! Every request must complete exactly once; a completion for a head that is not
//! outstanding ("id N is not a head" in Linux) fails the test.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use spool_journal::{Journal, RingAddrs};
use uuid::Uuid;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::queue_start::{resume, ring_indices, ResumeFrom, RingView};
use crate::request::GuestMemory;

const QSIZE: u16 = 8;
const TOTAL: u64 = 24;
/// Where the rings start their indices: near the 16-bit wrap, so it is crossed.
const START_IDX: u16 = 65530;

struct Crash;

#[derive(Default)]
struct Counter {
    n: usize,
    crash_at: Vec<usize>,
}

impl Counter {
    fn tick(&mut self) {
        self.n += 1;
        if self.crash_at.contains(&self.n) {
            std::panic::panic_any(Crash);
        }
    }
}

// Ring layout (virtio-queue's MockSplitQueue computes an overlapping used ring for sizes
// above 4, so the rings are placed by hand).
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;

struct Guest<'a> {
    mem: &'a GuestMemory,
    free: Vec<u16>,
    outstanding: HashMap<u16, u64>,
    completions: HashMap<u64, u32>,
    next_seq: u64,
    last_used: u16,
    errors: Vec<String>,
}

impl<'a> Guest<'a> {
    fn new(mem: &'a GuestMemory) -> Self {
        mem.write_obj(START_IDX.to_le(), GuestAddress(AVAIL + 2))
            .unwrap();
        mem.write_obj(START_IDX.to_le(), GuestAddress(USED + 2))
            .unwrap();
        Guest {
            mem,
            free: (0..QSIZE).rev().collect(),
            outstanding: HashMap::new(),
            completions: HashMap::new(),
            next_seq: 0,
            last_used: START_IDX,
            errors: Vec::new(),
        }
    }

    fn rings(&self) -> RingAddrs {
        RingAddrs {
            desc: DESC,
            avail: AVAIL,
            used: USED,
        }
    }

    fn queue(&self) -> Queue {
        let mut q = Queue::new(QSIZE).unwrap();
        q.set_size(QSIZE);
        q.set_desc_table_address(Some(DESC as u32), Some(0));
        q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
        q.set_used_ring_address(Some(USED as u32), Some(0));
        q.set_ready(true);
        q
    }

    fn avail_idx(&self) -> u16 {
        u16::from_le(self.mem.read_obj(GuestAddress(AVAIL + 2)).unwrap())
    }

    fn submit(&mut self, n: usize) {
        for _ in 0..n {
            if self.next_seq == TOTAL {
                return;
            }
            let Some(h) = self.free.pop() else { return };
            let d = Descriptor::new(0x10_0000 + h as u64 * 0x1000, 512, 0, 0);
            self.mem
                .write_obj(d, GuestAddress(DESC + 16 * h as u64))
                .unwrap();
            let idx = self.avail_idx();
            let slot = GuestAddress(AVAIL + 4 + 2 * (idx % QSIZE) as u64);
            self.mem.write_obj(h.to_le(), slot).unwrap();
            self.mem
                .write_obj(idx.wrapping_add(1).to_le(), GuestAddress(AVAIL + 2))
                .unwrap();
            self.outstanding.insert(h, self.next_seq);
            self.next_seq += 1;
        }
    }

    fn consume(&mut self) {
        let used: u16 = u16::from_le(self.mem.read_obj(GuestAddress(USED + 2)).unwrap());
        while self.last_used != used {
            let elem = GuestAddress(USED + 4 + 8 * (self.last_used % QSIZE) as u64);
            let id = u32::from_le(self.mem.read_obj::<u32>(elem).unwrap()) as u16;
            match self.outstanding.remove(&id) {
                Some(seq) => {
                    *self.completions.entry(seq).or_default() += 1;
                    self.free.push(id);
                }
                None => self
                    .errors
                    .push(format!("id {id} is not a head (completed twice)")),
            }
            self.last_used = self.last_used.wrapping_add(1);
        }
    }
}

struct Backend {
    jq: JournaledQueue,
    device: Vec<u16>,
}

fn start(
    g: &Guest,
    dir: &std::path::Path,
    vol: Uuid,
    journal: bool,
    base: u16,
    c: &mut Counter,
) -> Backend {
    let mut q = g.queue();
    let (avail_idx, used_idx) = ring_indices(&q, g.mem).unwrap();
    let mut device = Vec::new();
    let j = if journal {
        let (mut j, _) = Journal::open_or_create(dir, vol, 0, QSIZE).unwrap();
        let view = RingView {
            rings: g.rings(),
            size: QSIZE,
            avail_idx,
            used_idx,
            memory: None,
        };
        let r = resume(&mut j, view, ResumeFrom::Frontend(base), &mut |_| c.tick()).unwrap();
        q.set_next_avail(r.next_avail);
        device.extend(r.resubmit);
        Some(j)
    } else {
        q.set_next_avail(base);
        None
    };
    q.set_next_used(used_idx);
    Backend {
        jq: JournaledQueue::new(q, j),
        device,
    }
}

/// Runs the whole workload with crashes at the given step numbers; returns the guest's
/// verdict (Ok when every request completed exactly once) and the number of steps taken.
fn run(journal: bool, crash_at: Vec<usize>) -> (Result<(), String>, usize) {
    run_completing(journal, crash_at, 1)
}

/// [`run`] with the device completing up to `batch` requests per used-index update.
fn run_completing(
    journal: bool,
    crash_at: Vec<usize>,
    batch: usize,
) -> (Result<(), String>, usize) {
    run_with(journal, crash_at, batch, false)
}

/// [`run_completing`]; with `inline`, every other request is completed as soon as it is
/// taken, before the round's takes are finished (step 7), as the worker completes a request
/// it rejects at parse time.
fn run_with(
    journal: bool,
    crash_at: Vec<usize>,
    batch: usize,
    inline: bool,
) -> (Result<(), String>, usize) {
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let vol = Uuid::new_v4();
    let mut g = Guest::new(&mem);
    let mut c = Counter { n: 0, crash_at };
    // Initial start, before any request: the frontend says START_IDX.
    let mut backend: Option<Backend> = None;
    let mut restarts = 0;
    for _round in 0..400 {
        if g.next_seq == TOTAL && g.outstanding.is_empty() {
            break;
        }
        g.submit(3);
        let res = catch_unwind(AssertUnwindSafe(|| {
            let b = match backend.as_mut() {
                Some(b) => b,
                None => {
                    // A fresh process: the frontend (like QEMU after a backend death) asks to
                    // resume at the ring's used index.
                    let (_, used) = ring_indices(&g.queue(), &mem).unwrap();
                    let base = if restarts == 0 { START_IDX } else { used };
                    backend = Some(start(&g, dir.path(), vol, journal, base, &mut c));
                    backend.as_mut().unwrap()
                }
            };
            let host = crate::hostmem::HostMap::new(&mem);
            let mut taken = 0;
            while let Some(head) = b.jq.pop(&host, &mut |_| c.tick()).unwrap() {
                taken += 1;
                if inline && taken % 2 == 1 {
                    b.jq.complete(&host, head, 1, &mut |_| c.tick()).unwrap();
                } else {
                    b.device.push(head);
                }
            }
            // Step 7, once for the round's takes (as the worker's poll round ends).
            b.jq.finish_takes(&mut |_| c.tick());
            if batch == 1 {
                for _ in 0..2 {
                    if let Some(h) = b.device.pop() {
                        b.jq.complete(&host, h, 1, &mut |_| c.tick()).unwrap();
                    }
                }
            } else {
                let n = b.device.len().min(batch);
                let done: Vec<(u16, u32)> = (0..n).map(|_| (b.device.pop().unwrap(), 1)).collect();
                b.jq.complete_batch(&host, &done, &mut |_| c.tick())
                    .unwrap();
            }
        }));
        if let Err(p) = res {
            if p.downcast_ref::<Crash>().is_none() {
                std::panic::resume_unwind(p);
            }
            backend = None; // process state lost; guest memory and journal file kept
            restarts += 1;
        }
        g.consume();
    }
    let mut verdict = Ok(());
    if !g.errors.is_empty() {
        verdict = Err(g.errors.join("; "));
    } else if g.next_seq < TOTAL || !g.outstanding.is_empty() {
        verdict = Err(format!(
            "hung: {} of {TOTAL} submitted, {} never completed",
            g.next_seq,
            g.outstanding.len()
        ));
    } else if let Some((seq, n)) = g.completions.iter().find(|(_, &n)| n != 1) {
        verdict = Err(format!("request {seq} completed {n} times"));
    }
    (verdict, c.n)
}

#[test]
fn no_crash_baseline() {
    let (v, steps) = run(true, vec![]);
    v.unwrap();
    assert!(
        steps >= TOTAL as usize * 7,
        "every request goes through 7 journaled steps (and step 7 once per round of takes)"
    );
}

#[test]
fn crash_after_every_single_step() {
    let (_, total) = run(true, vec![]);
    for k in 1..=total {
        let (v, _) = run(true, vec![k]);
        if let Err(e) = v {
            panic!("crash after step {k} of {total}: {e}");
        }
    }
}

#[test]
fn crash_again_during_recovery_and_after() {
    // A second crash at every one of the 40 steps that follow the first, which includes every
    // step of Algorithm 2 itself (recovery runs right after the restart).
    let (_, total) = run(true, vec![]);
    let mut runs = 0;
    for k1 in (1..=total).step_by(3) {
        for k2 in k1 + 1..=k1 + 40 {
            let (v, _) = run(true, vec![k1, k2]);
            if let Err(e) = v {
                panic!("crashes after steps {k1} and {k2}: {e}");
            }
            runs += 1;
        }
    }
    assert!(runs > 1000);
}

#[test]
fn batched_completions_survive_a_crash_after_every_step() {
    // Batches of up to 3 published by one used-index update: a crash between the journal's
    // used index moving and the ring's must roll the whole batch back, one after it must
    // roll the whole batch forward.
    let (v, total) = run_completing(true, vec![], 3);
    v.unwrap();
    for k in 1..=total {
        let (v, _) = run_completing(true, vec![k], 3);
        if let Err(e) = v {
            panic!("batched completions, crash after step {k} of {total}: {e}");
        }
    }
}

#[test]
fn batched_completions_survive_a_second_crash_during_recovery() {
    let (_, total) = run_completing(true, vec![], 3);
    for k1 in (1..=total).step_by(5) {
        for k2 in k1 + 1..=k1 + 30 {
            let (v, _) = run_completing(true, vec![k1, k2], 3);
            if let Err(e) = v {
                panic!("batched completions, crashes after steps {k1} and {k2}: {e}");
            }
        }
    }
}

#[test]
fn completions_inside_a_round_of_takes_survive_a_crash_after_every_step() {
    // A request completed while the round's takes are still open (rejected at parse) must
    // have its take finished first: otherwise recovery would find START naming a head whose
    // completion the guest already has, mark it INFLIGHT and complete it again.
    let (v, total) = run_with(true, vec![], 3, true);
    v.unwrap();
    for k in 1..=total {
        let (v, _) = run_with(true, vec![k], 3, true);
        if let Err(e) = v {
            panic!("completion inside a round of takes, crash after step {k} of {total}: {e}");
        }
    }
    for k1 in (1..=total).step_by(5) {
        for k2 in k1 + 1..=k1 + 30 {
            let (v, _) = run_with(true, vec![k1, k2], 3, true);
            if let Err(e) = v {
                panic!("completion inside a round of takes, crashes after {k1} and {k2}: {e}");
            }
        }
    }
}

#[test]
fn without_the_journal_crashes_lose_or_duplicate_requests() {
    // The contrast that shows the test can fail: Spool-NoJ resumes where the frontend says
    // (the used index after a crash), which re-takes requests already in flight or done.
    let (v, total) = run(false, vec![]);
    v.unwrap();
    let failures = (1..=total)
        .filter(|&k| run(false, vec![k]).0.is_err())
        .count();
    assert!(
        failures > total / 4,
        "only {failures} of {total} crash points broke without a journal"
    );
}
