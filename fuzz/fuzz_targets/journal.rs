//! Fuzzes the journal as found on start-up (`Journal::open_or_create` on a file another
//! process left behind, then Algorithm 2's `recover` with any used index), and the journal's
//! own operations afterwards. The file lives in a private (0700) directory, mode 0600, as
//! spoold keeps it. It must never panic or crash, and whatever it accepts must recover
//! sanely:
//! - every head to resubmit is inside the queue, listed once and INFLIGHT afterwards; no head
//!   is left DONE; the journal's used index is the ring's;
//! - recovery is idempotent: a second run changes nothing and lists the same heads;
//! - an interrupted recovery (the file as it was after any of its repairing stores) recovers
//!   to the same result when run again (the crash-point property);
//! - after any sequence of Algorithm 1 steps and new generations the file reopens.
//!
//! The first input byte selects the mode: bit 0 set = the static header is fixed up (magic,
//! version, checksum, volume and queue index, and with bit 1 clear the file length matching
//! the queue size of byte 1), so the input's ring words and slots reach recovery; bit 0 clear
//! = the rest is the file, raw. Bits 2.. of byte 0 pick the crash point; bytes 2..4 are the
//! ring's used index, bytes 4..6 the queue size asked for when the file is empty; after the
//! file image (its length is that of the fixed-up layout, or byte 6 × 16 in raw mode), the
//! remaining bytes drive journal operations.
#![no_main]

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use spool_journal::{journal_path, Journal, RecoveryStep, ReqState, RingAddrs, MAGIC};
use uuid::Uuid;

const VOLUME: Uuid = Uuid::from_u128(0x5eed_0000_0000_0000_0000_0000_0000_0001);
const QUEUE: u16 = 1;
const SLOTS_OFF: usize = 144;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let t = tempfile::Builder::new()
            .prefix("spool-fuzz-journal")
            .tempdir_in(if std::path::Path::new("/dev/shm").is_dir() {
                "/dev/shm"
            } else {
                "/tmp"
            })
            .expect("tempdir");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let p = t.path().join("j");
        (t, p)
    })
    .1
}

/// CRC32C (Castagnoli), bitwise: the fuzz crate does not depend on the crc32c crate.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn write_file(path: &std::path::Path, img: &[u8]) {
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .expect("journal file");
    f.write_all(img).expect("write journal file");
}

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
}

fn check_recovery(j: &Journal, ring_used: u16, r: &spool_journal::Recovery) {
    let qs = j.queue_size();
    assert_eq!(r.used_idx, ring_used);
    assert_eq!(j.used_idx(), ring_used, "journal used index not synced");
    let mut seen = std::collections::HashSet::new();
    for &h in &r.inflight {
        assert!(h < qs, "resubmitted head {h} outside queue of {qs}");
        assert!(seen.insert(h), "head {h} resubmitted twice");
        assert_eq!(j.state(h), ReqState::Inflight);
    }
    for h in 0..qs {
        assert_ne!(j.state(h), ReqState::Done, "head {h} left DONE by recovery");
        if j.state(h) == ReqState::Inflight {
            assert!(seen.contains(&h), "INFLIGHT head {h} not resubmitted");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes(data);
    let mode = b.u8();
    let qs_exp = b.u8() % 17; // 16 = "zero"
    let ring_used = b.u16();
    let create_qs = b.u16();
    let raw_len = b.u8() as usize * 16;
    let dir = dir();
    let _ = std::fs::create_dir(dir);
    let path = journal_path(dir, VOLUME, QUEUE);
    let img = if mode & 1 == 1 {
        let qs: u16 = if qs_exp == 16 { 0 } else { 1 << qs_exp };
        let len = if mode & 2 == 0 {
            SLOTS_OFF + 4 * qs as usize
        } else {
            raw_len
        };
        let mut img = b.take(len).to_vec();
        img.resize(len.max(SLOTS_OFF), 0);
        img[0..8].copy_from_slice(&MAGIC);
        img[8..12].copy_from_slice(&1u32.to_le_bytes());
        img[12..16].copy_from_slice(&128u32.to_le_bytes());
        img[16..18].copy_from_slice(&qs.to_le_bytes());
        img[18..20].copy_from_slice(&QUEUE.to_le_bytes());
        img[32..48].copy_from_slice(VOLUME.as_bytes());
        let crc = crc32c(&img[0..72]);
        img[72..76].copy_from_slice(&crc.to_le_bytes());
        img.truncate(len);
        img
    } else {
        b.take(raw_len).to_vec()
    };
    write_file(&path, &img);
    let crash_at = (mode >> 2) as usize;

    let j = match Journal::open_or_create(dir, VOLUME, QUEUE, create_qs) {
        Ok((j, _existed)) => j,
        Err(_) => return,
    };
    let qs = j.queue_size();
    assert!(qs.is_power_of_two(), "accepted queue size {qs}");
    let _ = j.has_work();
    let _ = j.header();

    // Recovery, snapshotting the file after the crash_at-th repairing store.
    let mut step = 0usize;
    let mut snapshot: Option<Vec<u8>> = None;
    let r1 = j.recover(ring_used, &mut |s: RecoveryStep| {
        if let RecoveryStep::DoneRepaired(h) = s {
            assert!(h < qs);
        }
        if step == crash_at {
            snapshot = std::fs::read(&path).ok();
        }
        step += 1;
    });
    check_recovery(&j, ring_used, &r1);
    // Idempotent.
    let r2 = j.recover(ring_used, &mut |_| {});
    check_recovery(&j, ring_used, &r2);
    assert!(!r2.finished_start && r2.rolled_back == 0 && r2.rolled_forward == 0);
    assert_eq!(r2.inflight, r1.inflight, "second recovery differs");
    assert_eq!(r2.last_avail, r1.last_avail);
    drop(j);

    // The interrupted recovery, run again, ends where the uninterrupted one did.
    if let Some(snap) = snapshot {
        write_file(&path, &snap);
        let (j, existed) = Journal::open_or_create(dir, VOLUME, QUEUE, create_qs)
            .expect("a journal interrupted in recovery reopens");
        assert!(existed);
        let r3 = j.recover(ring_used, &mut |_| {});
        check_recovery(&j, ring_used, &r3);
        assert_eq!(r3.inflight, r1.inflight, "recovery after a crash in recovery differs");
        assert_eq!(r3.last_avail, r1.last_avail);
        drop(j);
    }

    // Algorithm 1 steps and new generations on the recovered journal.
    let (mut j, _) = Journal::open_or_create(dir, VOLUME, QUEUE, create_qs)
        .expect("a recovered journal reopens");
    for _ in 0..64 {
        if b.0.is_empty() {
            break;
        }
        let op = b.u8();
        let head = b.u16();
        match op % 9 {
            0 => j.take_begin(head, j.last_avail()),
            1 => j.take_mark_inflight(head, b.u16()),
            2 => j.take_finish(),
            3 => j.complete_begin(),
            4 => j.complete_begin_n(head),
            5 => j.complete_mark_done(head),
            6 => j.complete_mark_none(head),
            7 => {
                let qs = match b.u8() {
                    x @ 0..=15 => 1u16 << x,
                    x => x as u16,
                };
                let rings = RingAddrs {
                    desc: head as u64,
                    avail: 1,
                    used: 2,
                };
                let ok = j.new_generation(qs, rings, b.u16(), b.u16()).is_ok();
                assert_eq!(ok, qs.is_power_of_two() && qs <= 32768);
                if ok {
                    assert_eq!(j.queue_size(), qs);
                    assert!(!j.has_work());
                    assert_eq!(j.header().rings, rings);
                }
            }
            _ => {
                let used = b.u16();
                let r = j.recover(used, &mut |_| {});
                check_recovery(&j, used, &r);
            }
        }
        let _ = j.state(head);
    }
    let qs = j.queue_size();
    drop(j);
    let (j, existed) =
        Journal::open_or_create(dir, VOLUME, QUEUE, qs).expect("a used journal reopens");
    assert!(existed);
    assert_eq!(j.queue_size(), qs);
});
