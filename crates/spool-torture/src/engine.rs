//! The I/O engine: a volume's requests split over its layout and submitted to the real device
//! queues (file queues, mirror, thin and crypt queues as the pool stacks them), several
//! volume queues at once, many requests in flight on each, as a worker does. Every piece of
//! a request goes under the request's tag, as the worker's did when the crypt queue lost
//! pieces: a queue must accept repeated tags.
//!
//! Owns: the queues, the requests in flight and their buffers. Must not know: the model, what
//! a request is for.

use std::time::{Duration, Instant};

use spool_devices::{DeviceIo, DeviceQueue, IoVec};
use spool_pool::VolumeLayout;

use crate::model::Wrong;

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Read,
    Write,
    Discard,
    Zero,
    Flush,
}

/// A request in flight (or done).
pub struct Request {
    pub kind: Kind,
    pub queue: usize,
    pub offset: u64,
    pub len: u64,
    /// A write's stamp generation (0 for the others).
    pub generation: u64,
    /// The data: what a write sends, where a read lands.
    pub buf: Vec<u8>,
    /// The iovecs the pieces point at (never changed while in flight).
    iovs: Vec<IoVec>,
    left: u32,
    /// The first error a piece returned (a negative errno), or 0.
    pub error: i32,
    /// Times it was sent before (a failed request sent again).
    pub tries: u32,
    started: Instant,
}

// SAFETY: the iovecs point into `buf`, which moves with the request; they are only handed to
// queues owned by the same engine, on the thread that owns it.
unsafe impl Send for Request {}

/// A request that never completed within the limit (a hang: a finding, not a wait).
pub const HANG: Duration = Duration::from_secs(30);

/// The queues of one volume and its requests in flight.
pub struct Engine {
    pub layout: VolumeLayout,
    /// `queues[q][d]`: volume queue `q`'s queue on layout device `d`.
    queues: Vec<Vec<Box<dyn DeviceQueue>>>,
    slots: Vec<Option<Request>>,
    depth: u32,
}

impl Engine {
    /// `nqueues` volume queues on `layout`, each `depth` deep.
    pub fn open(layout: VolumeLayout, nqueues: usize, depth: u32) -> std::io::Result<Engine> {
        let mut queues = Vec::new();
        for _ in 0..nqueues {
            let mut qs = Vec::new();
            for d in 0..layout.devices.len() {
                qs.push(layout.open_queue(d, depth * 4)?);
            }
            queues.push(qs);
        }
        Ok(Engine {
            layout,
            queues,
            slots: Vec::new(),
            depth,
        })
    }

    /// Requests in flight on queue `q` (all queues: `None`).
    pub fn in_flight(&self, q: Option<usize>) -> usize {
        (self.slots.iter().flatten())
            .filter(|r| q.is_none_or(|q| r.queue == q))
            .count()
    }

    /// Whether a write, discard or zeroing in flight overlaps `[offset, offset + len)`: what
    /// a new update must not race (reads race anything; the model follows them).
    pub fn overlaps_update(&self, offset: u64, len: u64) -> bool {
        self.slots.iter().flatten().any(|r| {
            !matches!(r.kind, Kind::Read | Kind::Flush)
                && r.offset < offset + len
                && offset < r.offset + r.len
        })
    }

    /// The ranges of the writes, discards and zeroings in flight.
    pub fn updates_in_flight(&self) -> Vec<(u64, u64)> {
        (self.slots.iter().flatten())
            .filter(|r| !matches!(r.kind, Kind::Read | Kind::Flush))
            .map(|r| (r.offset, r.len))
            .collect()
    }

    /// Whether queue `q` has room for another request.
    pub fn has_room(&self, q: usize) -> bool {
        self.in_flight(Some(q)) < self.depth as usize
    }

    /// Submits a request on queue `q` (which has room); `buf` is a write's data or a read's
    /// destination (`len` bytes; empty for the others).
    pub fn submit(
        &mut self,
        q: usize,
        kind: Kind,
        offset: u64,
        len: u64,
        generation: u64,
        buf: Vec<u8>,
    ) {
        self.submit_try(q, kind, offset, len, generation, buf, 0)
    }

    /// Sends failed request `r` again, as it was.
    pub fn resubmit(&mut self, r: Request) {
        let (q, kind, offset, len, g, tries) =
            (r.queue, r.kind, r.offset, r.len, r.generation, r.tries);
        self.submit_try(q, kind, offset, len, g, r.buf, tries + 1)
    }

    #[allow(clippy::too_many_arguments)]
    fn submit_try(
        &mut self,
        q: usize,
        kind: Kind,
        offset: u64,
        len: u64,
        generation: u64,
        buf: Vec<u8>,
        tries: u32,
    ) {
        let tag = match self.slots.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        let mut r = Request {
            kind,
            queue: q,
            offset,
            len,
            generation,
            buf,
            iovs: Vec::new(),
            left: 0,
            error: 0,
            tries,
            started: Instant::now(),
        };
        let mut pieces: Vec<(usize, DeviceIo)> = Vec::new();
        if kind == Kind::Flush {
            pieces.extend((0..self.queues[q].len()).map(|d| (d, DeviceIo::Flush)));
        } else {
            let mut spans = Vec::new();
            self.layout.map(offset, len, |d, doff, plen, at| {
                spans.push((d, doff, plen, at))
            });
            // The iovecs first, all of them: their vector never grows after a pointer is taken.
            let base = r.buf.as_mut_ptr();
            for &(_, _, plen, at) in &spans {
                if matches!(kind, Kind::Read | Kind::Write) {
                    r.iovs.push(IoVec {
                        // SAFETY: `at + plen <= len == buf.len()` (the layout's split).
                        iov_base: unsafe { base.add(at as usize) }.cast(),
                        iov_len: plen as usize,
                    });
                }
            }
            for (i, &(d, doff, plen, _)) in spans.iter().enumerate() {
                let io = match kind {
                    Kind::Read | Kind::Write => {
                        DeviceIo::data(kind == Kind::Write, doff, plen, &r.iovs[i], 1)
                    }
                    Kind::Discard => DeviceIo::Discard {
                        offset: doff,
                        len: plen,
                    },
                    _ => DeviceIo::WriteZeroes {
                        offset: doff,
                        len: plen,
                    },
                };
                pieces.push((d, io));
            }
        }
        r.left = pieces.len() as u32;
        self.slots[tag] = Some(r);
        for (d, io) in pieces {
            // SAFETY: the buffer and the iovecs live in the slot's request, untouched and
            // not freed until its last piece is reaped (`reap`, `give_up`).
            unsafe { self.queues[q][d].submit(io, tag as u64) };
        }
        for d in &mut self.queues[q] {
            let _ = d.kick();
        }
    }

    /// Reaps every queue once; returns the requests that finished.
    pub fn reap(&mut self) -> Vec<Request> {
        let mut done = Vec::new();
        let slots = &mut self.slots;
        for qs in &mut self.queues {
            for dq in qs.iter_mut() {
                dq.reap(&mut |tag, res| {
                    let Some(Some(r)) = slots.get_mut(tag as usize) else {
                        panic!("a device completed tag {tag}, which is not in flight");
                    };
                    if res < 0 && r.error == 0 {
                        r.error = res;
                    }
                    r.left -= 1;
                    if r.left == 0 {
                        done.push(tag as usize);
                    }
                });
            }
        }
        done.into_iter()
            .filter_map(|t| self.slots[t].take())
            .collect()
    }

    /// Reaps until `until` holds over what finished so far, or a request hangs. Returns the
    /// finished requests, or the hung one's description.
    pub fn reap_until(
        &mut self,
        mut until: impl FnMut(&Engine) -> bool,
    ) -> Result<Vec<Request>, Wrong> {
        let mut out = Vec::new();
        let mut spins = 0u32;
        while !until(self) {
            let got = self.reap();
            if got.is_empty() {
                spins += 1;
                if spins > 64 {
                    std::thread::sleep(Duration::from_micros(200));
                }
                if let Some(r) = self
                    .slots
                    .iter()
                    .flatten()
                    .find(|r| r.started.elapsed() > HANG)
                {
                    return Err(Wrong(format!(
                        "a {:?} of {} bytes at {} on queue {} never completed ({} s)",
                        r.kind,
                        r.len,
                        r.offset,
                        r.queue,
                        HANG.as_secs()
                    )));
                }
            } else {
                spins = 0;
                out.extend(got);
            }
        }
        Ok(out)
    }
}
