//! The torture tester's kept cases, each a bug it found, shrunk to its few steps (they run
//! first), and a fixed range of seeds: the same cases on every run, so a red run is a bug,
//! never the draw. New seeds are explored by hand (`spool-torture --runs 200`, see
//! docs/torture.md); each failure found becomes a case here.

use spool_torture::{check, Case, IoKind, Step::*, WorldKind::*, WorldSpec, STEPS};

/// The crypt queue kept its in-flight records by the caller's tag: a read across the end of
/// a grown encrypted volume, two pieces on one device under one tag, decrypted the other
/// piece's buffer (issue 53; fixed in spool-crypt's queue).
#[test]
fn kept_encrypted_read_across_a_grown_end() {
    let case = Case {
        seed: 10,
        world: WorldSpec {
            devices: vec![62, 69, 64],
            pads: vec![(2, false), (1, false)],
            kind: Encrypted,
            size: 22020096,
            queues: 2,
        },
        steps: vec![
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 20709376,
                len: 1310720,
            },
            Grow { by: 1109504 },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 21971968,
                len: 65536,
            },
        ],
    };
    check(&case);
}

/// A thin write whose map block write failed twice, retried: each try's new chunks stayed
/// taken for good, and `pool check` found them leaked (issue 53's "a failed allocation map
/// write leaks one chunk per automatic retry"; fixed in spool-thin's allocator).
#[test]
fn kept_thin_write_retried_after_map_write_failures() {
    let case = Case {
        seed: 103,
        world: WorldSpec {
            devices: vec![67],
            pads: vec![(3, true), (2, true), (1, true)],
            kind: Thin,
            size: 15697920,
            queues: 2,
        },
        steps: vec![
            Fault {
                dev: 0,
                meta: true,
                write: true,
                count: 2,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 8663552,
                len: 1314816,
            },
        ],
    };
    check(&case);
}

/// A flush that failed on one leg's device was acknowledged (the other leg took it), and the
/// leg was still read from: after a power cut it had lost what the flush was said to cover,
/// and an encrypted mirror returned noise for acknowledged, flushed data (fixed in
/// spool-mirror: a leg that misses a flush is stale wherever another leg is current).
#[test]
fn kept_mirror_leg_that_missed_a_flush_then_a_power_cut() {
    let case = Case {
        seed: 2112,
        world: WorldSpec {
            devices: vec![26, 70],
            pads: vec![],
            kind: EncryptedMirror(2),
            size: 10421248,
            queues: 3,
        },
        steps: vec![
            Io {
                q: 2,
                kind: IoKind::Write,
                offset: 1583616,
                len: 1048576,
            },
            Verify,
            Fault {
                dev: 1,
                meta: false,
                write: true,
                count: 1,
            },
            Io {
                q: 2,
                kind: IoKind::Flush,
                offset: 0,
                len: 0,
            },
            Io {
                q: 2,
                kind: IoKind::Write,
                offset: 5322752,
                len: 1048064,
            },
            Drain,
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 7331328,
                len: 8704,
            },
            Io {
                q: 1,
                kind: IoKind::Read,
                offset: 8973312,
                len: 1048064,
            },
            PowerCut {
                seed: 13216755970267035150,
            },
        ],
    };
    check(&case);
}

fn seeds(range: std::ops::RangeInclusive<u64>) {
    for seed in range {
        let s = check(&Case::generate(seed, STEPS));
        assert!(s.requests > 0, "seed {seed} did nothing");
    }
}

#[test]
fn seeds_1_to_6() {
    seeds(1..=6);
}

#[test]
fn seeds_7_to_12() {
    seeds(7..=12);
}

/// A write completed on a leg whose device then failed before any flush covered it; the next
/// flush skipped that device (not healthy) and reported success with nothing marked, so after
/// a power cut the leg, current by the bitmap, read zeroes for the write the model had seen
/// flushed (seed 9045, shrunk from 112 steps; it failed about one run in ten; fixed in
/// spool-mirror: a flush that skips a leg's device marks it as a failed flush does).
#[test]
fn kept_flush_that_skipped_an_unhealthy_leg_then_a_power_cut() {
    let case = Case {
        seed: 9045,
        world: WorldSpec {
            devices: vec![53, 63, 52, 69],
            pads: vec![(1, true), (3, true)],
            kind: Mirror(2),
            size: 28304896,
            queues: 3,
        },
        steps: vec![
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 8368640,
                len: 131072,
            },
            Io {
                q: 2,
                kind: IoKind::Read,
                offset: 2096640,
                len: 512,
            },
            Io {
                q: 1,
                kind: IoKind::Read,
                offset: 26946048,
                len: 2097152,
            },
            Restart,
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 3110912,
                len: 65536,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 30883840,
                len: 131072,
            },
            Fault {
                dev: 2,
                meta: true,
                write: true,
                count: 1,
            },
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 24117248,
                len: 512,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 9400832,
                len: 72704,
            },
            Grow { by: 511488 },
            Io {
                q: 2,
                kind: IoKind::Write,
                offset: 23002112,
                len: 133632,
            },
            Io {
                q: 1,
                kind: IoKind::Read,
                offset: 26564608,
                len: 2097152,
            },
            Io {
                q: 1,
                kind: IoKind::Read,
                offset: 29269504,
                len: 136192,
            },
            Grow { by: 1473536 },
            Io {
                q: 2,
                kind: IoKind::Write,
                offset: 6387200,
                len: 2097152,
            },
            Io {
                q: 1,
                kind: IoKind::Read,
                offset: 32632320,
                len: 65536,
            },
            Io {
                q: 2,
                kind: IoKind::Write,
                offset: 17393664,
                len: 512,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 24149504,
                len: 2097152,
            },
            Io {
                q: 2,
                kind: IoKind::Read,
                offset: 276992,
                len: 8704,
            },
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 2394624,
                len: 512,
            },
            Io {
                q: 2,
                kind: IoKind::Write,
                offset: 16919552,
                len: 8704,
            },
            Io {
                q: 2,
                kind: IoKind::Read,
                offset: 23488512,
                len: 2097152,
            },
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 12030976,
                len: 131072,
            },
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 9383424,
                len: 65536,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 18869248,
                len: 8704,
            },
            Io {
                q: 2,
                kind: IoKind::Flush,
                offset: 0,
                len: 0,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 30015488,
                len: 137216,
            },
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 30991360,
                len: 1055744,
            },
            Io {
                q: 2,
                kind: IoKind::Flush,
                offset: 0,
                len: 0,
            },
            Io {
                q: 1,
                kind: IoKind::Read,
                offset: 6078976,
                len: 1310720,
            },
            Io {
                q: 1,
                kind: IoKind::Zero,
                offset: 8729088,
                len: 2097152,
            },
            Io {
                q: 1,
                kind: IoKind::Zero,
                offset: 21748736,
                len: 2097152,
            },
            Io {
                q: 2,
                kind: IoKind::Write,
                offset: 22236160,
                len: 512,
            },
            Fault {
                dev: 1,
                meta: false,
                write: true,
                count: 2,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 11836416,
                len: 1053184,
            },
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 12576256,
                len: 65536,
            },
            Io {
                q: 1,
                kind: IoKind::Read,
                offset: 27256832,
                len: 7680,
            },
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 27771904,
                len: 2097152,
            },
            Io {
                q: 2,
                kind: IoKind::Flush,
                offset: 0,
                len: 0,
            },
            Io {
                q: 1,
                kind: IoKind::Read,
                offset: 2721280,
                len: 2097152,
            },
            Io {
                q: 2,
                kind: IoKind::Write,
                offset: 6141440,
                len: 1048576,
            },
            Io {
                q: 2,
                kind: IoKind::Write,
                offset: 27570688,
                len: 2097152,
            },
            PowerCut {
                seed: 8849500526177547847,
            },
        ],
    };
    check(&case);
}

/// A mirrored thin volume's only current copy missed a flush (its device failing a write), and
/// the retried flush too; the retry looked only at the regions written since the first was
/// submitted, found none and reported success, and the next power cut lost a write the model
/// had seen flushed (seed 9748; fixed in spool-mirror: a leg that missed flushes in a row is
/// behind since the first of them). About one run in eight under load before the fix.
#[test]
fn kept_flush_retried_after_the_only_current_copy_missed_one() {
    let case = Case {
        seed: 9748,
        world: WorldSpec {
            devices: vec![44, 30, 65],
            pads: vec![(4, true), (4, true), (1, true)],
            kind: MirroredThin(2),
            size: 11452928,
            queues: 1,
        },
        steps: vec![
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 706048,
                len: 512,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 8567296,
                len: 512,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 3552256,
                len: 1048064,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 9309184,
                len: 65536,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 3145216,
                len: 7168,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 7337984,
                len: 5120,
            },
            DeleteSnapshot { of: 1 },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 1304064,
                len: 2097152,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 7491584,
                len: 138240,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 7467008,
                len: 1317888,
            },
            Io {
                q: 0,
                kind: IoKind::Discard,
                offset: 2276864,
                len: 1050112,
            },
            Drain,
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 1474560,
                len: 512,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 4194304,
                len: 512,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 6241280,
                len: 1310720,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 10184704,
                len: 70144,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 6110208,
                len: 512,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 2477568,
                len: 1315840,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 5242368,
                len: 512,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 2089984,
                len: 1051648,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 11064320,
                len: 65536,
            },
            Inflate,
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 6289408,
                len: 4096,
            },
            Io {
                q: 0,
                kind: IoKind::Flush,
                offset: 0,
                len: 0,
            },
            Io {
                q: 0,
                kind: IoKind::Zero,
                offset: 7326208,
                len: 69120,
            },
            Io {
                q: 0,
                kind: IoKind::Flush,
                offset: 0,
                len: 0,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 3140096,
                len: 8704,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 9846272,
                len: 131072,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 6221312,
                len: 131072,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 2094592,
                len: 8704,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 4864000,
                len: 2097152,
            },
            Io {
                q: 0,
                kind: IoKind::Flush,
                offset: 0,
                len: 0,
            },
            Drain,
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 1480192,
                len: 1048576,
            },
            Io {
                q: 0,
                kind: IoKind::Discard,
                offset: 10096128,
                len: 1048064,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 4193792,
                len: 512,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 2612736,
                len: 4096,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 7491072,
                len: 66560,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 9330688,
                len: 131072,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 8379904,
                len: 9728,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 9465344,
                len: 1048576,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 7017472,
                len: 1054720,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 4595200,
                len: 65536,
            },
            Fault {
                dev: 0,
                meta: true,
                write: true,
                count: 1,
            },
            Drain,
            Verify,
            Drain,
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 7336448,
                len: 8704,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 3956736,
                len: 69632,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 3096064,
                len: 65536,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 10142208,
                len: 1310720,
            },
            Io {
                q: 0,
                kind: IoKind::Zero,
                offset: 3856896,
                len: 1055744,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 4684288,
                len: 4096,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 1151488,
                len: 8704,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 6119424,
                len: 2097152,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 8572928,
                len: 2097152,
            },
            Io {
                q: 0,
                kind: IoKind::Discard,
                offset: 8372736,
                len: 1310720,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 9925632,
                len: 7168,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 9430528,
                len: 14336,
            },
            Fault {
                dev: 1,
                meta: true,
                write: false,
                count: 1,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 718336,
                len: 2097152,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 9167872,
                len: 1316864,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 6258176,
                len: 68608,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 6075904,
                len: 1050112,
            },
            Io {
                q: 0,
                kind: IoKind::Flush,
                offset: 0,
                len: 0,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 9353216,
                len: 131072,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 2991616,
                len: 131072,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 1546240,
                len: 1312768,
            },
            Io {
                q: 0,
                kind: IoKind::Zero,
                offset: 10473984,
                len: 15872,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 5017088,
                len: 1310720,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 7844352,
                len: 2097152,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 1908224,
                len: 65536,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 4919296,
                len: 2104832,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 775168,
                len: 2100736,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 608256,
                len: 1048576,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 6246912,
                len: 137216,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 6286848,
                len: 9216,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 10185216,
                len: 12288,
            },
            Io {
                q: 0,
                kind: IoKind::Zero,
                offset: 3132928,
                len: 131072,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 10453504,
                len: 131072,
            },
            Inflate,
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 6242816,
                len: 131072,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 9199616,
                len: 512,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 5168640,
                len: 131072,
            },
            PowerCut {
                seed: 18207895320745881104,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 7438848,
                len: 1054208,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 9354240,
                len: 1054720,
            },
            Io {
                q: 0,
                kind: IoKind::Zero,
                offset: 10483712,
                len: 8704,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 3326976,
                len: 2097152,
            },
            Io {
                q: 0,
                kind: IoKind::Discard,
                offset: 8956416,
                len: 8704,
            },
            Fault {
                dev: 2,
                meta: false,
                write: true,
                count: 1,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 8625152,
                len: 8704,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 6729728,
                len: 1048064,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 6248448,
                len: 131072,
            },
            Io {
                q: 0,
                kind: IoKind::Flush,
                offset: 0,
                len: 0,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 9798656,
                len: 1048576,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 2289152,
                len: 1048064,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 8317952,
                len: 131072,
            },
            Io {
                q: 0,
                kind: IoKind::Zero,
                offset: 3170304,
                len: 131584,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 2344960,
                len: 1048064,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 10015744,
                len: 65536,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 9435648,
                len: 4096,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 3429376,
                len: 65536,
            },
            Drain,
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 1039872,
                len: 8704,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 922112,
                len: 65536,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 2095616,
                len: 4096,
            },
            Drain,
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 3510784,
                len: 1310720,
            },
            PowerCut {
                seed: 8852376228264011291,
            },
        ],
    };
    check(&case);
}

/// Metadata read faults armed for earlier steps (five in all) outlasted the check's four tries
/// at reading an encrypted thin volume's snapshot, whose image reads through the devices'
/// synchronous path: the tester's own defect; it now clears the rules after the tries and
/// only a failure after is wrong (seed 9554).
#[test]
fn kept_snapshot_read_while_metadata_faults_are_armed() {
    let case = Case {
        seed: 9554,
        world: WorldSpec {
            devices: vec![25],
            pads: vec![(3, true)],
            kind: EncryptedThin,
            size: 10465280,
            queues: 1,
        },
        steps: vec![
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 2216960,
                len: 1048064,
            },
            Drain,
            Snapshot,
            Fault {
                dev: 0,
                meta: true,
                write: false,
                count: 2,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 5134848,
                len: 1310720,
            },
            Fault {
                dev: 0,
                meta: true,
                write: false,
                count: 1,
            },
            Fault {
                dev: 0,
                meta: false,
                write: false,
                count: 2,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 6225408,
                len: 131072,
            },
            Fault {
                dev: 0,
                meta: true,
                write: false,
                count: 2,
            },
        ],
    };
    check(&case);
}

/// A fault armed to fail a clone's metadata read outlived the clone (which read nothing) and
/// failed the check's own open of the clone: a clean refusal for an injected read error, which
/// the tester now tries again as it does reads (seed 9234; the tester's own defect).
#[test]
fn kept_clone_opened_while_a_metadata_fault_is_armed() {
    let case = Case {
        seed: 9234,
        world: WorldSpec {
            devices: vec![31, 32],
            pads: vec![(3, false), (3, false), (4, false)],
            kind: Thin,
            size: 4175872,
            queues: 3,
        },
        steps: vec![
            Snapshot,
            Fault {
                dev: 1,
                meta: true,
                write: false,
                count: 1,
            },
            Clone { of: 6 },
        ],
    };
    check(&case);
}

/// A mirrored volume grown after a write failed on one leg: the new mirror took the grown
/// leg for a new one in its slot and wiped its stale bits, so reads went to the leg that
/// missed the write and returned zeroes for acknowledged data (fixed in spool-mirror: a leg
/// that only grew keeps its stale bits).
#[test]
fn kept_mirror_grown_after_a_leg_missed_a_write() {
    let case = Case {
        seed: 106,
        world: WorldSpec {
            devices: vec![58, 26, 70],
            pads: vec![(3, false), (1, false), (2, false)],
            kind: Mirror(2),
            size: 14674944,
            queues: 3,
        },
        steps: vec![
            Fault {
                dev: 2,
                meta: false,
                write: true,
                count: 2,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 10483200,
                len: 1314304,
            },
            Grow { by: 991232 },
        ],
    };
    check(&case);
}

/// A revert whose map block write failed: memory kept the volume's old entries while the
/// sharing counts had taken the snapshot's chunks as named again, so `pool check` found
/// chunks one map names counted twice (and a write could land in place in a chunk a restart
/// might find unnamed). Found by seed 5038 (an encrypted thin volume with snapshots, a
/// revert, metadata write faults and grows), kept here as its few steps that matter.
#[test]
fn kept_revert_whose_map_write_failed() {
    let case = Case {
        seed: 5038,
        world: WorldSpec {
            devices: vec![36],
            pads: vec![(2, true)],
            kind: EncryptedThin,
            size: 15706112,
            queues: 2,
        },
        steps: vec![
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 1203712,
                len: 2097152,
            },
            Snapshot,
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 1596928,
                len: 131072,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 12126720,
                len: 2104320,
            },
            Drain,
            Fault {
                dev: 0,
                meta: true,
                write: true,
                count: 1,
            },
            Revert { of: 0 },
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 1597440,
                len: 4096,
            },
        ],
    };
    check(&case);
}

/// A mirrored thin volume, grown while regions had intent bits (the new mirror resyncs them
/// from a read source), then writes that failed on leg 0 there: the copy had chosen leg 0 as
/// the source before those writes drained, and copied its older bytes over leg 1, the only
/// leg holding them (fixed in spool-mirror: the source is checked again once the region is
/// quiet, and before each piece). Failed about two runs in five before the fix.
#[test]
fn kept_copy_from_a_source_that_missed_a_write() {
    let case = Case {
        seed: 7017,
        world: WorldSpec {
            devices: vec![64, 67, 63],
            pads: vec![(3, true)],
            kind: MirroredThin(2),
            size: 11449856,
            queues: 3,
        },
        steps: vec![
            Fault {
                dev: 1,
                meta: false,
                write: true,
                count: 1,
            },
            Io {
                q: 1,
                kind: IoKind::Read,
                offset: 4135424,
                len: 65536,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 1884672,
                len: 131072,
            },
            PowerCut {
                seed: 13040806760650351368,
            },
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 5406720,
                len: 1315840,
            },
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 8853504,
                len: 131072,
            },
            Io {
                q: 2,
                kind: IoKind::Discard,
                offset: 8746496,
                len: 1048576,
            },
            Grow { by: 1818624 },
            Io {
                q: 2,
                kind: IoKind::Read,
                offset: 6562816,
                len: 1048064,
            },
            Io {
                q: 1,
                kind: IoKind::Write,
                offset: 6161920,
                len: 1310720,
            },
            Fault {
                dev: 1,
                meta: false,
                write: true,
                count: 1,
            },
            Io {
                q: 2,
                kind: IoKind::Write,
                offset: 4135936,
                len: 1048576,
            },
            DeleteSnapshot { of: 0 },
        ],
    };
    check(&case);
}

/// Seed 10589: a 3-copy mirror on four devices, grown after write faults on one device had
/// left a leg stale in places, read older data for acknowledged writes: the grow put a leg's
/// new piece on a device the mirror had not used, the devices' indices moved, the grown leg
/// was taken for a new one in its slot and its stale bits were wiped (fixed in spool-mirror's
/// `grown_legs`: devices compared as themselves).
#[test]
fn kept_mirror_grown_onto_a_device_it_did_not_use() {
    let case = Case {
        seed: 10589,
        world: WorldSpec {
            devices: vec![41, 31, 34, 36],
            pads: vec![(1, false)],
            kind: Mirror(3),
            size: 9434112,
            queues: 1,
        },
        steps: vec![
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 7286784,
                len: 1048064,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 8210944,
                len: 1048576,
            },
            Fault {
                dev: 3,
                meta: false,
                write: false,
                count: 1,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 6878208,
                len: 2097152,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 1933312,
                len: 2097152,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 1613824,
                len: 65536,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 6307328,
                len: 1053696,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 2094080,
                len: 9728,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 6105600,
                len: 1310720,
            },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 7664128,
                len: 512,
            },
            Fault {
                dev: 0,
                meta: false,
                write: true,
                count: 2,
            },
            Io {
                q: 0,
                kind: IoKind::Read,
                offset: 861696,
                len: 1048576,
            },
            Grow { by: 988672 },
            Io {
                q: 0,
                kind: IoKind::Write,
                offset: 7515648,
                len: 1048064,
            },
            Io {
                q: 0,
                kind: IoKind::Zero,
                offset: 2940416,
                len: 2100224,
            },
        ],
    };
    check(&case);
}
