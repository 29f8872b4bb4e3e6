//! Device files on tmpfs: the worker reads and writes by copying out of and into a shared
//! mapping of the file (spool-devices `file_map.rs`: no inode lock, no per-page lookups), and
//! reads holes through the descriptor. Through the real spoold and the real libblkio client:
//! the mapping is in use, what was copied into it is in the file, while another volume of the
//! same file is written at the same time, through worker SIGKILLs (the journal resubmits what
//! a killed worker had in flight) and after the whole daemon restarted, whose reads come out
//! of its mapping; reading space never written allocates nothing.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::{
    connect, kill_workers_holding_a_write, pattern, write_rounds_until, Spoold, BS, RECOVERED,
};

fn config(dev: &Path) -> String {
    format!(
        r#"
[[devices]]
path = "{}"
create_size = "96M"
[[volumes]]
name = "a"
size = "16M"
num_queues = 2
[[volumes]]
name = "b"
size = "16M"
num_queues = 2
"#,
        dev.display()
    )
}

/// Resident KiB of `pid`'s mapping of `file` (from /proc/PID/smaps).
fn mapped_kib(pid: u32, file: &Path) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut lines = smaps
        .lines()
        .skip_while(|l| !l.ends_with(file.to_str().unwrap()));
    assert!(lines.next().is_some(), "{} not mapped", file.display());
    lines
        .find_map(|l| l.strip_prefix("Rss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn writes_through_the_mapping_survive_worker_kills_and_a_restart() {
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let dev = shm.path().join("d0.img");
    let d = Arc::new(Spoold::start(&config(&dev)));
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", d.worker_pid())).unwrap();
    assert!(
        maps.contains(dev.to_str().unwrap()),
        "the worker does not map its tmpfs device file:\n{maps}"
    );

    // Volume b is written at the same time as a, from its own thread, into the same file.
    // Both connect before the first kill.
    let mut c = connect(&d.socket("a"), 2, false).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (connected, wait_connected) = std::sync::mpsc::channel();
    let neighbour = {
        let (d, stop) = (d.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut c = connect(&d.socket("b"), 2, false).unwrap();
            connected.send(()).unwrap();
            write_rounds_until(&mut c, &|| stop.load(Ordering::Relaxed), 3)
        })
    };
    wait_connected.recv().unwrap();
    // One write hangs in the device until the first kill: that kill catches it in flight
    // (with inline I/O on tmpfs a request is in flight only for microseconds, so on a
    // loaded machine kills at random moments could all miss one), and the successor, which
    // has no such rule, resubmits it from the journal.
    d.rpc(
        "device_inject",
        serde_json::json!({"id": dev, "kind": "timeout", "op": "write", "count": 1}),
    )
    .unwrap();
    let killer = kill_workers_holding_a_write(d.clone(), dev.to_str().unwrap(), 5, 40);
    // Every write completes and every block then reads back its last write (checked inside).
    let rounds = write_rounds_until(&mut c, &|| killer.is_finished(), 5);
    killer.join().unwrap();
    assert!(
        d.log().contains(RECOVERED),
        "no kill caught a request in flight:\n{}",
        d.log()
    );
    stop.store(true, Ordering::Relaxed);
    let neighbour_rounds = neighbour.join().unwrap();
    // The writes went into the mapping: the serving worker's mapping of the file has pages
    // (a write through the descriptor would leave it untouched).
    let last = pattern(rounds - 1, 0, BS);
    assert_eq!(c.write_sync(0, 0, &last), 0);
    let resident = mapped_kib(d.worker_pid(), &dev);
    assert!(
        resident > 0,
        "the worker's mapping of the file is untouched"
    );
    drop(c);

    // A new daemon reads the file through its descriptor: the copies were in the file.
    let mut d = Arc::try_unwrap(d).unwrap_or_else(|_| panic!("spoold still shared"));
    d.stop();
    d.spawn();
    for (vol, last) in [("a", rounds - 1), ("b", neighbour_rounds - 1)] {
        let mut c = connect(&d.socket(vol), 2, false).unwrap();
        for blk in 0..64usize {
            let off = (blk * BS) as u64;
            let (r, data) = c.read_sync(blk % 2, off, BS);
            assert_eq!(r, 0);
            assert!(
                data == pattern(last, off, BS),
                "volume {vol}, block {blk}: not its last write (round {last}) after a restart"
            );
        }
    }
    // Those reads came out of the mapping: the new worker wrote nothing, yet its mapping of
    // the file has pages now (`preadv` would leave it untouched).
    assert!(
        mapped_kib(d.worker_pid(), &dev) > 0,
        "the new worker's reads did not go through its mapping"
    );
    // Space never written reads as zeroes and stays a hole: a read fault through the mapping
    // would have given the file a page for each (a thin device filled by a guest's reads).
    let held = allocated(&dev);
    let mut c = connect(&d.socket("b"), 2, false).unwrap();
    for blk in 192..256usize {
        let (r, data) = c.read_sync(blk % 2, (blk * BS) as u64, BS);
        assert_eq!(r, 0);
        assert!(data.iter().all(|&x| x == 0), "block {blk} never written");
    }
    assert_eq!(allocated(&dev), held, "reading holes allocated tmpfs pages");
}

/// Bytes of tmpfs memory `file` holds.
fn allocated(file: &Path) -> u64 {
    std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(file).unwrap()) * 512
}
