//! [`NvmeQueue`]: one worker's I/O queue pair on an NVMe namespace.
//!
//! Owns: the queue pair's lifetime (created lazily, recreated after a controller reset,
//! deleted to abort what it holds), the request table, completions and bounce-buffer copy
//! back. Building commands from a request is `commands.rs`.
//!
//! Reads and writes point the controller straight at the caller's buffers when they lie in
//! memory registered for DMA (guest memory, see [`crate::register_dma_memory`]) and the
//! buffer list can be described by PRPs (or an SGL); otherwise (unregistered or oddly split
//! memory) the data goes through a bounce buffer. A request larger than the controller's
//! transfer limit becomes several commands that complete as one. Completions are polled: the
//! queue reports itself as [`DeviceQueue::polled`], so the worker never sleeps while
//! commands are outstanding.
//!
//! Must not know: health cells and fault injection (the [`crate::Device`] wrapper).

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use spool_nvme::spec::Sqe;
use spool_nvme::{Controller, DmaBuf, QueuePair, PAGE};

use crate::queue::{DeviceIo, DeviceQueue, IoVec};

/// The bounce buffer of a request whose memory the controller cannot reach directly.
pub(super) struct Bounce {
    pub(super) buf: DmaBuf,
    pub(super) iov: *const IoVec,
    pub(super) iovcnt: u32,
    pub(super) read: bool,
}

struct Request {
    tag: u64,
    remaining: u32,
    result: i32,
    len: u64,
    bounce: Option<Bounce>,
}

/// One worker's queue pair on a controller's namespace 1.
pub struct NvmeQueue {
    pub(super) ctrl: Arc<Controller>,
    pub(super) qp: Option<QueuePair>,
    pub(super) depth: u16,
    pub(super) lba: u64,
    pub(super) nsid: u32,
    pub(super) max_xfer: u64,
    /// SGL support used by this queue (0 = none: PRPs and bounce buffers only).
    pub(super) sgl: u8,
    /// Volatile write cache present (Flush means something).
    pub(super) write_cache: bool,
    /// Optional NVM commands (ONCS).
    pub(super) oncs: u16,
    /// Requests whose last command completed in the current reap (reused buffer).
    finished: Vec<u32>,
    /// PRP list (or DSM range) page of each command identifier.
    lists: DmaBuf,
    /// Request index of each outstanding command identifier.
    cids: Vec<u32>,
    reqs: Vec<Request>,
    free_reqs: Vec<u32>,
    backlog: VecDeque<(DeviceIo, u64)>,
    pub(super) done: VecDeque<(u64, i32)>,
    outstanding: usize,
    pub(super) segs: Vec<(u64, u64)>,
    pub(super) chunk: Vec<(u64, u64)>,
    pub(super) entries: Vec<u64>,
    event: File,
    /// When to try again to create a queue pair the controller refused.
    retry_at: Option<std::time::Instant>,
}

/// How long a queue without a queue pair waits before asking the controller again.
const QP_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

// SAFETY: raw pointers held in `Bounce` and `backlog` are the caller's iovecs, which the
// `submit` contract keeps valid until completion; the queue is used by one worker thread at a
// time (the worker owning it moves to its thread as a whole).
unsafe impl Send for NvmeQueue {}

impl NvmeQueue {
    /// Creates an I/O queue pair of `depth` entries on `ctrl`; `sgl` allows SGLs where the
    /// controller has them (config `[io] nvme_sgl`).
    pub fn new(ctrl: Arc<Controller>, depth: u32, sgl: bool) -> std::io::Result<NvmeQueue> {
        let err = |e: spool_nvme::Error| std::io::Error::from_raw_os_error(e.errno());
        // A controller that is gone still gets a queue (every request fails with ENODEV), so
        // volumes on other devices of the pool keep starting; one that refuses a queue pair
        // now (being reset by the monitor) gets one on a later kick.
        let qp = match ctrl.create_queue_pair(depth.clamp(2, 1024) as u16) {
            Ok(qp) => Some(qp),
            Err(spool_nvme::Error::Gone(_)) => None,
            Err(e) => {
                tracing::warn!(controller = ctrl.bdf(), error = %e, "cannot create an I/O queue pair yet; retrying");
                None
            }
        };
        let depth = qp
            .as_ref()
            .map_or(depth.clamp(2, 1024) as u16, QueuePair::depth);
        let ns = ctrl.namespace();
        let lists = DmaBuf::new(depth as usize * PAGE as usize).map_err(err)?;
        Ok(NvmeQueue {
            max_xfer: ctrl.info().max_transfer,
            write_cache: ctrl.info().write_cache,
            oncs: ctrl.info().oncs,
            finished: Vec::new(),
            sgl: if sgl { ctrl.info().sgl } else { 0 },
            lba: ns.lba_size,
            nsid: ns.nsid,
            ctrl,
            qp,
            depth,
            lists,
            cids: vec![u32::MAX; depth as usize],
            reqs: Vec::new(),
            free_reqs: Vec::new(),
            backlog: VecDeque::new(),
            done: VecDeque::new(),
            outstanding: 0,
            segs: Vec::new(),
            chunk: Vec::new(),
            entries: Vec::new(),
            event: crate::queue::completion_eventfd()?,
            retry_at: None,
        })
    }

    pub(super) fn new_request(
        &mut self,
        tag: u64,
        remaining: u32,
        len: u64,
        bounce: Option<Bounce>,
    ) -> u32 {
        let r = Request {
            tag,
            remaining,
            result: 0,
            len,
            bounce,
        };
        match self.free_reqs.pop() {
            Some(i) => {
                self.reqs[i as usize] = r;
                i
            }
            None => {
                self.reqs.push(r);
                self.reqs.len() as u32 - 1
            }
        }
    }

    /// Pushes one command for request `req`; `prps` are its data entries (empty for none).
    pub(super) fn push(&mut self, mut sqe: Sqe, req: u32, with_list: impl FnOnce(&mut [u8])) {
        let qp = self.qp.as_mut().expect("checked by the caller");
        let cid = qp.peek_cid().expect("capacity checked by the caller");
        let list = &mut self.lists.bytes_mut()
            [cid as usize * PAGE as usize..(cid as usize + 1) * PAGE as usize];
        with_list(list);
        if sqe.prp1 == u64::MAX {
            sqe.prp1 = self.lists.iova() + cid as u64 * PAGE;
        }
        if sqe.prp2 == u64::MAX {
            sqe.prp2 = self.lists.iova() + cid as u64 * PAGE;
        }
        let got = qp.push(sqe).expect("capacity checked by the caller");
        debug_assert_eq!(got, cid);
        self.cids[cid as usize] = req;
        self.outstanding += 1;
    }

    fn finish(&mut self, req: u32) {
        let r = &mut self.reqs[req as usize];
        let tag = r.tag;
        let result = if r.result < 0 {
            r.result
        } else {
            r.len.min(i32::MAX as u64) as i32
        };
        if let Some(b) = r.bounce.take() {
            if b.read && result >= 0 {
                // SAFETY: `tag`'s completion is not handed to the caller yet (queued on `done`
                // below), so the `submit` contract still keeps the array and buffers valid
                // (queues forgotten by `quarantine_stuck` never get here); bounce >= `r.len`.
                let iovs = unsafe { std::slice::from_raw_parts(b.iov, b.iovcnt as usize) };
                let mut at = 0usize;
                for v in iovs {
                    let n = v.iov_len.min(r.len as usize - at);
                    // SAFETY: as above; `n <= r.len - at` stays inside the bounce buffer and
                    // `n <= v.iov_len` inside the iovec's buffer.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            b.buf.as_ptr().add(at),
                            v.iov_base.cast::<u8>(),
                            n,
                        )
                    };
                    at += n;
                    if at == r.len as usize {
                        break;
                    }
                }
            }
        }
        self.free_reqs.push(req);
        self.done.push_back((tag, result));
    }
}

impl DeviceQueue for NvmeQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        // Never onto a queue pair a controller reset has destroyed (one atomic load).
        self.follow_reset();
        // SAFETY: the caller's guarantee is passed on unchanged.
        if !self.backlog.is_empty() || !unsafe { self.try_submit(io, tag) } {
            self.backlog.push_back((io, tag));
        }
    }

    fn kick(&mut self) -> std::io::Result<()> {
        self.follow_reset();
        while let Some(&(io, tag)) = self.backlog.front() {
            // SAFETY: backlogged operations were given to `submit` under its contract.
            if !unsafe { self.try_submit(io, tag) } {
                break;
            }
            self.backlog.pop_front();
        }
        if let Some(qp) = self.qp.as_mut() {
            qp.ring();
        }
        Ok(())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        if let Some(mut qp) = self.qp.take() {
            let mut finished = std::mem::take(&mut self.finished);
            qp.poll(&mut |c| {
                let req = std::mem::replace(&mut self.cids[c.cid as usize], u32::MAX);
                if req == u32::MAX {
                    return;
                }
                self.outstanding -= 1;
                let r = &mut self.reqs[req as usize];
                if !c.status.ok() && r.result >= 0 {
                    tracing::debug!(controller = self.ctrl.bdf(), status = %c.status, "command failed");
                    r.result = c.status.errno();
                }
                r.remaining -= 1;
                if r.remaining == 0 {
                    finished.push(req);
                }
            });
            self.qp = Some(qp);
            for &req in &finished {
                self.finish(req);
            }
            finished.clear();
            self.finished = finished;
        }
        crate::queue::drain_done(&mut self.done, done)
    }

    fn completion_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    fn ack_completion_event(&self) {}

    fn polled(&self) -> bool {
        true
    }

    fn in_flight(&self) -> usize {
        self.reqs.len() - self.free_reqs.len() + self.backlog.len() + self.done.len()
    }

    /// Deletes the queue pair (the controller aborts every outstanding command and stops
    /// touching their buffers), completes those requests with -ECANCELED and creates a new
    /// queue pair.
    fn abort(&mut self) -> usize {
        if self.outstanding == 0 {
            return 0;
        }
        self.restart("aborted outstanding commands by deleting the I/O queue pair; recreating it")
    }
}

impl NvmeQueue {
    /// Deletes the queue pair (the controller aborts what it held and stops touching its
    /// buffers; after a controller reset it is gone already), completes those requests with
    /// ECANCELED and creates a new queue pair.
    fn restart(&mut self, why: &'static str) -> usize {
        if let Some(qp) = self.qp.take() {
            self.ctrl.delete_queue_pair(qp);
        }
        let mut n = 0;
        for cid in 0..self.cids.len() {
            let req = std::mem::replace(&mut self.cids[cid], u32::MAX);
            if req == u32::MAX {
                continue;
            }
            let r = &mut self.reqs[req as usize];
            r.result = -libc::ECANCELED;
            r.remaining -= 1;
            if r.remaining == 0 {
                self.finish(req);
                n += 1;
            }
        }
        self.outstanding = 0;
        tracing::info!(controller = self.ctrl.bdf(), requests = n, "{why}");
        match self.ctrl.create_queue_pair(self.depth) {
            Ok(qp) => self.qp = Some(qp),
            Err(e) => {
                tracing::error!(controller = self.ctrl.bdf(), error = %e, "cannot recreate the I/O queue pair")
            }
        }
        n
    }

    /// After a controller reset the queue pair no longer exists: start over on a new one. A
    /// queue left without a queue pair (the controller refused one while it was being reset)
    /// asks again, at most every [`QP_RETRY`]; until then its requests fail with EIO, a path
    /// error the health layer holds and resubmits.
    fn follow_reset(&mut self) {
        match &self.qp {
            Some(q) if q.generation != self.ctrl.generation() => {
                self.restart("the controller was reset: outstanding commands failed with ECANCELED; new I/O queue pair");
            }
            Some(_) => {}
            None if self.ctrl.is_gone() => {}
            None => {
                let now = std::time::Instant::now();
                if self.retry_at.is_some_and(|t| now < t) {
                    return;
                }
                match self.ctrl.create_queue_pair(self.depth) {
                    Ok(qp) => {
                        tracing::info!(controller = self.ctrl.bdf(), "I/O queue pair created");
                        self.qp = Some(qp);
                        self.retry_at = None;
                    }
                    Err(e) => {
                        if self.retry_at.is_none() {
                            tracing::warn!(controller = self.ctrl.bdf(), error = %e, "cannot create an I/O queue pair; retrying");
                        }
                        self.retry_at = Some(now + QP_RETRY);
                    }
                }
            }
        }
    }
}

impl Drop for NvmeQueue {
    fn drop(&mut self) {
        if let Some(qp) = self.qp.take() {
            self.ctrl.delete_queue_pair(qp);
        }
    }
}
