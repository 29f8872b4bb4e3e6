//! A case: a world and the steps driven against it, all from one seed; and the steps'
//! generation, which aims at the places bugs live (extent, chunk and mirror region
//! boundaries, requests up to 2 MiB, sizes that are not powers of two, requests from several
//! queues in flight together).
//!
//! Owns: [`Case`], [`Step`] and how they are drawn from a seed, and a case's text as a
//! ready test. Must not know: how steps run.

use crate::engine::Kind as Io;
use crate::rng::Rng;
use crate::world::{Kind, WorldSpec, EXTENT};

/// One thing the tester does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A request on queue `q` (once it has room and nothing it must not race is in flight).
    Io {
        q: usize,
        kind: Io,
        offset: u64,
        len: u64,
    },
    /// Waits for every request in flight.
    Drain,
    /// Reads the whole volume and every snapshot, and checks them against the model.
    Verify,
    /// Grows the volume by `by` bytes.
    Grow { by: u64 },
    /// Takes a snapshot (thin kinds).
    Snapshot,
    /// Reverts the volume to its snapshot `of` (modulo how many there are), with no queue
    /// open (a VM stopped), as the daemon requires.
    Revert { of: usize },
    /// Clones snapshot `of` into a new volume, checked against the snapshot from then on.
    Clone { of: usize },
    /// Deletes snapshot `of`.
    DeleteSnapshot { of: usize },
    /// Copies every chunk the volume shares (`volume inflate`).
    Inflate,
    /// Device `dev`'s next `count` operations of one kind fail with EIO: metadata (`meta`)
    /// or queue I/O, writes (`write`) or reads.
    Fault {
        dev: usize,
        meta: bool,
        write: bool,
        count: u64,
    },
    /// Gives up every request in flight and opens the pool again from its devices.
    Restart,
    /// As `Restart`, but the power goes: each device keeps what its flushes covered and a
    /// random subset (from `seed`) of the writes since.
    PowerCut { seed: u64 },
}

/// A world and what is done to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    pub seed: u64,
    pub world: WorldSpec,
    pub steps: Vec<Step>,
}

/// Request lengths worth trying: sectors, pages, what guests send, an extent and more.
const LENS: [u64; 9] = [
    512,
    4096,
    8192 + 512,
    64 << 10,
    128 << 10,
    (1 << 20) - 512,
    1 << 20,
    1280 << 10,
    2 << 20,
];

/// An offset and length within `size` bytes: often across an extent (chunk) boundary.
fn place(rng: &mut Rng, size: u64) -> (u64, u64) {
    let mut len = LENS[rng.below(LENS.len() as u64) as usize];
    if rng.chance(30) {
        len += 512 * rng.below(16);
    }
    let len = len.min(size);
    let max = (size - len) / 512;
    let offset = if rng.chance(60) && size > EXTENT {
        // Across the boundary at some k * EXTENT, starting up to `len` before it.
        let k = 1 + rng.below((size / EXTENT).max(1));
        let before = 512 * rng.below(len / 512 + 1);
        ((k * EXTENT).saturating_sub(before) / 512).min(max)
    } else {
        rng.below(max + 1)
    };
    (offset * 512, len)
}

/// A revert, clone, snapshot deletion or inflate.
fn snapshot_control(rng: &mut Rng) -> Step {
    let of = rng.below(8) as usize;
    match rng.below(4) {
        0 => Step::Revert { of },
        1 => Step::Clone { of },
        2 => Step::DeleteSnapshot { of },
        _ => Step::Inflate,
    }
}

impl Case {
    /// The case of `seed`: a world and `steps` steps.
    pub fn generate(seed: u64, steps: usize) -> Case {
        let mut rng = Rng::new(seed);
        let world = WorldSpec::generate(&mut rng);
        let mut size = world.size;
        let mut out = Vec::with_capacity(steps);
        let thin = world.kind.thin();
        while out.len() < steps {
            let roll = rng.below(100);
            let q = rng.below(world.queues as u64) as usize;
            let step = match roll {
                0..=39 => {
                    let (offset, len) = place(&mut rng, size);
                    Step::Io {
                        q,
                        kind: Io::Write,
                        offset,
                        len,
                    }
                }
                40..=69 => {
                    let (offset, len) = place(&mut rng, size);
                    Step::Io {
                        q,
                        kind: Io::Read,
                        offset,
                        len,
                    }
                }
                70..=75 => {
                    let (offset, len) = place(&mut rng, size);
                    let kind = match rng.chance(50) {
                        true => Io::Discard,
                        false => Io::Zero,
                    };
                    Step::Io {
                        q,
                        kind,
                        offset,
                        len,
                    }
                }
                76..=80 => Step::Io {
                    q,
                    kind: Io::Flush,
                    offset: 0,
                    len: 0,
                },
                81..=84 => Step::Drain,
                85..=86 => {
                    let by = 512 * (1 + rng.below(2 * EXTENT / 512));
                    size += by;
                    Step::Grow { by }
                }
                87..=88 if thin => Step::Snapshot,
                89..=90 if thin => snapshot_control(&mut rng),
                91..=94 => Step::Fault {
                    dev: rng.below(world.devices.len() as u64) as usize,
                    meta: rng.chance(50),
                    write: rng.chance(70),
                    count: 1 + rng.below(2),
                },
                95 => Step::Restart,
                96..=97 => Step::PowerCut {
                    seed: rng.next_u64(),
                },
                98..=99 => Step::Verify,
                _ => continue,
            };
            out.push(step);
        }
        Case {
            seed,
            world,
            steps: out,
        }
    }

    /// The case as Rust source: a test that replays it.
    pub fn as_test(&self) -> String {
        let w = &self.world;
        let kind = match w.kind {
            Kind::Mirror(n) => format!("Mirror({n})"),
            Kind::EncryptedMirror(n) => format!("EncryptedMirror({n})"),
            Kind::MirroredThin(n) => format!("MirroredThin({n})"),
            k => format!("{k:?}"),
        };
        let mut s = format!(
            "#[test]\nfn torture_case_{seed}() {{\n    use spool_torture::{{Case, IoKind, Step::*, WorldSpec, WorldKind::*}};\n    let case = Case {{\n        seed: {seed},\n        world: WorldSpec {{\n            devices: vec!{devices:?},\n            pads: vec!{pads:?},\n            kind: {kind},\n            size: {size},\n            queues: {queues},\n        }},\n        steps: vec![\n",
            seed = self.seed,
            devices = w.devices,
            pads = w.pads,
            size = w.size,
            queues = w.queues,
        );
        for st in &self.steps {
            let line = match st {
                Step::Io {
                    q,
                    kind,
                    offset,
                    len,
                } => {
                    format!("Io {{ q: {q}, kind: IoKind::{kind:?}, offset: {offset}, len: {len} }}")
                }
                other => format!("{other:?}"),
            };
            s.push_str(&format!("            {line},\n"));
        }
        s.push_str("        ],\n    };\n    spool_torture::check(&case);\n}\n");
        s
    }
}
