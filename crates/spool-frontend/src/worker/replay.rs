//! Requests a previous process left unfinished, at worker start: heads that crashed it while
//! it replayed them (poison) are failed without being submitted; the others are resubmitted
//! under a replay record whose crash mark tells the next process which heads were being
//! replayed should this one die of a fault (docs/journal-format.md). The record goes when
//! the last replayed head completed.
//!
//! Knows nothing of device health or how a request is submitted.

use std::sync::Arc;

use spool_journal::ReplayRecord;
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_IOERR;

use super::inflight::write_status;
use super::QueueWorker;
use crate::request::{self, GuestMemory};

/// A replay in progress: the journal's record and its crash mark's registration, withdrawn
/// before the record (and the mark's memory) goes away.
pub(super) struct ReplayGuard {
    slot: Option<usize>,
    _record: ReplayRecord,
}

impl ReplayGuard {
    pub(super) fn new(record: ReplayRecord) -> Self {
        // SAFETY: the mark lives in the record's mapping, which `_record` keeps until this
        // guard is dropped, after `Drop` withdrew the registration.
        let slot = unsafe { spool_sigbus::mark_on_crash(record.crash_mark()) };
        ReplayGuard {
            slot,
            _record: record,
        }
    }
}

impl Drop for ReplayGuard {
    fn drop(&mut self) {
        if let Some(s) = self.slot.take() {
            spool_sigbus::unmark_on_crash(s);
        }
    }
}

impl QueueWorker {
    /// Fails the poisoned heads and resubmits the ones the journal recovered (before the
    /// first poll round).
    pub(super) fn replay_journal(&mut self) {
        if !self.poison.is_empty() {
            let mem = self.guest.mem.load().clone();
            for head in std::mem::take(&mut self.poison) {
                self.fail_poisoned(head, &mem);
            }
        }
        if !self.resubmit.is_empty() {
            let mem = self.guest.mem.load().clone();
            let heads = std::mem::take(&mut self.resubmit);
            tracing::info!(volume = %self.volume, queue = self.index, count = heads.len(), "resubmitting requests recovered from the journal");
            self.tel
                .stats
                .queue(self.index)
                .resubmitted(heads.len() as u64);
            for &h in &heads {
                self.inflight.start_replay(h);
            }
            for head in heads {
                self.resubmit_head(head, &mem);
            }
        }
        if !self.inflight.replay_pending() {
            self.replay = None;
        }
    }

    /// Counts replayed heads completing; the replay record goes when the last one did.
    #[cold]
    pub(super) fn replayed(&mut self, done: &[(u16, u32)]) {
        let mut pending = true;
        for &(h, _) in done {
            pending = self.inflight.end_replay(h);
        }
        if !pending {
            self.replay = None;
        }
    }

    /// Completes a head that crashed the previous process while it replayed it, with IOERR,
    /// without submitting it again (it would crash this process too).
    #[cold]
    fn fail_poisoned(&mut self, head: u16, mem: &Arc<GuestMemory>) {
        tracing::error!(volume = %self.volume, queue = self.index, head, "request crashed the previous worker while it was replayed; failing it (IOERR) instead of replaying it again");
        self.refresh_host(mem);
        let chain = self.ring.vq.chain(&self.guest.host, head);
        match request::parse(head, chain, &self.guest.host, &self.limits) {
            Ok(req) => write_status(req.status_host, VIRTIO_BLK_S_IOERR as u8),
            Err(rej) => {
                if let Some(a) = rej.status_addr {
                    self.guest.host.write(a.0, &[VIRTIO_BLK_S_IOERR as u8]);
                }
            }
        }
        self.complete_used(mem, head, 1);
    }
}
