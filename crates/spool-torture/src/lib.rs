//! spool-torture: a seeded tester of Spool's volume stacks against a reference model (issue
//! 54, tier 1). From one seed it builds a world (a pool of real file devices of random
//! sizes, free space fragmented by volumes made and deleted first, one volume of a random
//! kind: plain, mirrored, encrypted, encrypted mirrored, thin, encrypted thin, mirrored
//! thin), drives it through the real device stack as a worker does (requests split over the
//! layout, every piece under the request's tag, several queues with requests in flight
//! together, sizes and offsets across extent and chunk boundaries, discards, write-zeroes,
//! flushes), grows it, snapshots it, makes its devices fail (queue and metadata I/O), and
//! restarts it (every request in flight given up, the pool opened again from its devices)
//! and cuts its power (each device keeps what its flushes covered and a random subset of the
//! writes since), checking every read, every restart and the end against the model of what
//! each sector may hold. A failing case is shrunk to a short one and printed as a ready test.
//!
//! What it does not do yet, and says so: a worker killed mid-request needs the real daemon
//! (tier 2); copies added and removed, replace and rekey are not drawn yet.
//!
//! Tier 2, the same model through the real daemon, lives with the daemon's tests
//! (`crates/spool-control/tests/torture_daemon.rs`): it uses this crate's `model` and `rng`.
//!
//! Owns: the tester. Must not know: virtio, the daemon, the RPC.

mod case;
mod engine;
pub mod model;
pub mod rng;
mod run;
mod shrink;
mod world;

pub use case::{Case, Step};
pub use engine::Kind as IoKind;
pub use run::{run, Failure, Summary};
pub use shrink::shrink;
pub use world::{Kind as WorldKind, WorldSpec};

/// Steps in a case drawn from a seed.
pub const STEPS: usize = 160;

/// Runs `case` in a new temporary directory; panics with the failure (for tests).
pub fn check(case: &Case) -> Summary {
    match run_in_temp(case) {
        Ok(s) => s,
        Err(f) => panic!("torture case of seed {} failed at {f}", case.seed),
    }
}

/// Runs `case` in a new temporary directory.
pub fn run_in_temp(case: &Case) -> Result<Summary, Failure> {
    let dir = tempfile::tempdir().map_err(|e| Failure {
        step: 0,
        what: format!("temporary directory: {e}"),
    })?;
    run(case, dir.path())
}
