//! I/O queue pairs for workers: creating one (a free queue identifier, Create I/O CQ then SQ)
//! and deleting one, under the read side of the reset gate.
//!
//! Owns: the queue identifier table and its mirror in the arena header (so the next worker
//! deletes what this one left).
//!
//! Must not know: what a worker submits on its queue pair.

use super::Controller;
use crate::spec::{admin, Sqe};
use crate::{Error, QueuePair, Result};

impl Controller {
    /// Creates an I/O queue pair of up to `depth` entries for one worker.
    pub fn create_queue_pair(&self, depth: u16) -> Result<QueuePair> {
        let _gate = self.reset_gate.read().unwrap_or_else(|p| p.into_inner());
        self.create_queue_pair_gated(depth)
    }

    /// [`Controller::create_queue_pair`] with the reset gate held by the caller.
    pub(super) fn create_queue_pair_gated(&self, depth: u16) -> Result<QueuePair> {
        self.check_present()?;
        let depth = (depth as u32).clamp(2, self.cap.mqes.min(1024)) as u16;
        let qid = {
            let mut q = self.qids.lock().unwrap_or_else(|p| p.into_inner());
            let Some(i) = q.iter().position(|b| !b) else {
                return Err(Error::Invalid(format!(
                    "{}: all {} I/O queues are in use (fewer workers or more controllers)",
                    self.bdf,
                    q.len() - 1
                )));
            };
            q[i] = true;
            // Recorded before the queue exists, so a successor deletes it whatever happens.
            self.arena.header().set_qid(i as u16, true);
            i as u16
        };
        let release = |e| {
            self.qids.lock().unwrap_or_else(|p| p.into_inner())[qid as usize] = false;
            self.arena.header().set_qid(qid, false);
            e
        };
        let mut qp =
            QueuePair::new(qid, depth, self.bar.ptr, self.cap.doorbell_stride).map_err(release)?;
        qp.generation = self.generation();
        let size_qid = ((depth as u32 - 1) << 16) | qid as u32;
        self.admin_cmd(
            Sqe {
                prp1: qp.cq_iova(),
                cdw10: size_qid,
                cdw11: 1,
                ..Sqe::new(admin::CREATE_CQ, 0)
            },
            "create I/O completion queue",
        )
        .map_err(release)?;
        if let Err(e) = self.admin_cmd(
            Sqe {
                prp1: qp.sq_iova(),
                cdw10: size_qid,
                cdw11: ((qid as u32) << 16) | 1,
                ..Sqe::new(admin::CREATE_SQ, 0)
            },
            "create I/O submission queue",
        ) {
            let _ = self.admin_cmd(
                Sqe {
                    cdw10: qid as u32,
                    ..Sqe::new(admin::DELETE_CQ, 0)
                },
                "delete I/O completion queue",
            );
            return Err(release(e));
        }
        Ok(qp)
    }

    /// Deletes a queue pair made by [`Controller::create_queue_pair`]; outstanding commands
    /// are aborted by the controller.
    pub fn delete_queue_pair(&self, qp: QueuePair) {
        let _gate = self.reset_gate.read().unwrap_or_else(|p| p.into_inner());
        let qid = qp.qid as u32;
        if qp.generation != self.generation() {
            // A reset already destroyed it (and freed its identifier, which may be reused by
            // now): nothing to tell the controller.
            drop(qp);
            return;
        }
        if self.is_gone() {
            // Nothing to tell a controller that is gone; its rings can simply be freed.
            drop(qp);
            return;
        }
        let r1 = self.admin_cmd(
            Sqe {
                cdw10: qid,
                ..Sqe::new(admin::DELETE_SQ, 0)
            },
            "delete I/O submission queue",
        );
        let r2 = self.admin_cmd(
            Sqe {
                cdw10: qid,
                ..Sqe::new(admin::DELETE_CQ, 0)
            },
            "delete I/O completion queue",
        );
        if let Err(e) = r1.and(r2) {
            tracing::warn!(controller = %self.bdf, qid, error = %e, "cannot delete I/O queue pair");
        }
        // The rings stay allocated until here, after the controller let go of them.
        drop(qp);
        self.arena.header().set_qid(qid as u16, false);
        if let Some(b) = self
            .qids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(qid as usize)
        {
            *b = false;
        }
    }
}
