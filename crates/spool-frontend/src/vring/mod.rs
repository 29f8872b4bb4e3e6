//! A virtqueue together with its cross-process journal: Algorithm 1 of Spool, step by step,
//! around the ring operations (where a starting queue resumes is `queue_start`'s decision).
//!
//! Steps (paper numbering): 1 pop a head from the avail ring; 2–5 one 64-bit store of
//! {START, last_avail+1, head}; 6 head INFLIGHT; 7 FINISHED, once for a poll round's batch
//! of takes (each take's START also finishes the one before); 8 submit (the worker); 9 the
//! device completes (the worker); then for a batch of n completions: 10 the journal's used
//! index moves by n; 11 each head DONE; 12–13 the used elements, then one used index store
//! publishing them all; 14 each head NONE. With the journal switched off (Spool-NoJ, for the
//! overhead benchmark) only the ring operations remain.
//!
//! The split ring itself is read and written here, through a [`HostMap`], rather than through
//! virtio-queue's iterators and `add_used`: those go through vm-memory's generic accessors
//! on every index, ring slot and descriptor, which callgrind showed to be the largest cost of
//! a request (docs/benchmarks/request-path.md). virtio-queue's [`Queue`] still holds the
//! queue's configuration and validity check, and does notification suppression (its
//! `next_avail`/`next_used` are kept current here).
//!
//! Layout: `ring` reads the split ring and walks descriptor chains; `queue` is the
//! [`JournaledQueue`]; `crash_tests` drive both, with `queue_start::resume`, through every
//! crash point.

mod queue;
mod ring;

pub use queue::JournaledQueue;
pub use ring::{ChainWalker, PREFETCH_DATA, PREFETCH_DESC};

/// A point between two steps of Algorithm 1 (for crash-point tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// 1: head popped from the avail ring (process state only).
    Popped,
    /// 2–5: aux = {START, last_avail + 1, head}.
    TakeBegun,
    /// 6: head INFLIGHT.
    MarkedInflight,
    /// 7: transaction FINISHED (once per batch of takes: [`JournaledQueue::finish_takes`]).
    TakeFinished,
    /// 10: journal used index incremented.
    CompleteBegun,
    /// 11: head DONE.
    MarkedDone,
    /// 12–13: used element and used index written to the ring.
    UsedAdded,
    /// 14: head NONE.
    MarkedNone,
}

/// Errors of the ring itself (a broken or hostile guest ring).
pub type RingError = virtio_queue::Error;

#[cfg(test)]
mod crash_tests;
