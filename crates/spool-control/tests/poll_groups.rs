//! Poll groups (`[io] volume_threads`, docs/qos.md "Scaling"): several queues of a volume
//! served by one thread, through the real spoold and the real libblkio client. Each queue
//! keeps its own ring, journal and device queues, so every request of every queue must
//! complete, with its data, through a worker kill and across reconnects; and the thread count
//! must be what the setting says.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    connect, kill_workers_holding_a_write, pattern, write_rounds_until, Spoold, RECOVERED,
};

fn config(threads: u32) -> String {
    format!(
        r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "128M"
[[volumes]]
name = "b"
size = "32M"
num_queues = 4
[io]
volume_threads = {threads}
"#
    )
}

/// The names of the worker's threads that serve volume b's queues ("q<N>-b").
fn queue_threads(d: &Spoold) -> Vec<String> {
    let pid = d.worker_pid();
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| c.starts_with('q') && c.ends_with("-b"))
        .collect();
    names.sort();
    names
}

/// Waits until the queue threads are `want` (threads start and end asynchronously).
fn wait_threads(d: &Spoold, want: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let have = queue_threads(d);
        if have == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "queue threads {have:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes a block through each of the 4 queues at once, then reads every block back through
/// another queue: each queue of the group served its own requests.
fn io_on_every_queue(c: &mut common::Client_, salt: u64) {
    const BLK: usize = 64 * 1024;
    for q in 0..4 {
        let off = (q * BLK) as u64;
        c.buf(q * BLK, BLK)
            .copy_from_slice(&pattern(salt, off, BLK));
        c.write(q, off, q * BLK, BLK, q);
    }
    for q in 0..4 {
        let done = c.wait(q, 1);
        assert_eq!(done, vec![(q, 0)], "queue {q}");
    }
    for q in 0..4 {
        let off = (q * BLK) as u64;
        let (r, data) = c.read_sync((q + 1) % 4, off, BLK);
        assert_eq!(r, 0);
        assert!(data == pattern(salt, off, BLK), "block of queue {q}");
    }
}

/// One thread serves all four queues with `volume_threads = 1`, two threads two queues each
/// with 2, and a thread per queue with 0 (the old model); I/O on every queue completes in each.
#[test]
fn volume_threads_sets_how_many_threads_serve_a_volume() {
    for (threads, want) in [
        (1, vec!["q0-b"]),
        (2, vec!["q0-b", "q1-b"]),
        (0, vec!["q0-b", "q1-b", "q2-b", "q3-b"]),
    ] {
        let d = Spoold::start(&config(threads));
        let mut c = connect(&d.socket("b"), 4, false).unwrap();
        io_on_every_queue(&mut c, threads as u64);
        wait_threads(&d, &want);
    }
}

/// A group's thread ends with its last queue (the client left) and a new one starts when the
/// client comes back; the data written before is there.
#[test]
fn a_group_thread_ends_with_its_queues_and_starts_again_with_new_ones() {
    let d = Spoold::start(&config(1));
    let mut c = connect(&d.socket("b"), 4, false).unwrap();
    io_on_every_queue(&mut c, 7);
    wait_threads(&d, &["q0-b"]);
    drop(c);
    wait_threads(&d, &[]);
    let mut c = connect(&d.socket("b"), 4, false).unwrap();
    const BLK: usize = 64 * 1024;
    for q in 0..4 {
        let off = (q * BLK) as u64;
        let (r, data) = c.read_sync(q, off, BLK);
        assert_eq!(r, 0);
        assert!(
            data == pattern(7, off, BLK),
            "block of queue {q} after reconnect"
        );
    }
    io_on_every_queue(&mut c, 8);
    wait_threads(&d, &["q0-b"]);
}

/// Worker SIGKILLs under load with two queues in one thread: the next worker continues both
/// queues from their journals and the client sees every write complete, with its data.
#[test]
fn worker_kills_under_load_with_grouped_queues_lose_nothing() {
    let d = Arc::new(Spoold::start(&config(1)));
    let mut c = connect(&d.socket("b"), 4, false).unwrap();
    let dev = d
        .rpc("volume_show", serde_json::json!({"id": "b"}))
        .unwrap()["devices"][0]
        .as_str()
        .unwrap()
        .to_string();
    let killer = kill_workers_holding_a_write(d.clone(), &dev, 5, 40);
    let rounds = write_rounds_until(&mut c, &|| killer.is_finished(), 5);
    killer.join().unwrap();
    assert!(rounds >= 5);
    assert!(
        d.log().contains(RECOVERED),
        "no kill caught a request in flight"
    );
    wait_threads(&d, &["q0-b"]);
}
