//! A verifying workload through the real libblkio client: rounds of writes of a fresh
//! pattern, then reads checking every block that was written.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{connect, pattern};

/// Bytes per request.
pub const BLK: usize = 16 * 1024;
/// Requests per round.
pub const DEPTH: usize = 8;

/// A verifying workload on one volume: rounds of DEPTH writes of a fresh pattern, then
/// reads checking each block that was written successfully.
#[derive(Default)]
pub struct Load {
    pub ok: AtomicU64,
    pub errors: AtomicU64,
    pub corrupt: AtomicU64,
    /// Longest single round (write + verify), µs.
    pub max_round_us: AtomicU64,
    pub stop: AtomicBool,
    /// The first failures seen (what, volume offset, result, when): what a failed
    /// assertion prints, so a rare failure says what it was.
    pub first: std::sync::Mutex<Vec<String>>,
    started: std::sync::OnceLock<Instant>,
}

impl Load {
    /// Starts the workload over the first `vol` bytes of the volume at `sock`.
    pub fn start(sock: std::path::PathBuf, vol: u64) -> (Arc<Load>, std::thread::JoinHandle<()>) {
        Self::start_patient(sock, vol, Duration::from_secs(10))
    }

    /// Like `start`, calling a request hung only after `hang_after` (a storage outage that
    /// holds I/O for longer is expected).
    pub fn start_patient(
        sock: std::path::PathBuf,
        vol: u64,
        hang_after: Duration,
    ) -> (Arc<Load>, std::thread::JoinHandle<()>) {
        let l = Arc::new(Load::default());
        let _ = l.started.set(Instant::now());
        let l2 = l.clone();
        let t = std::thread::spawn(move || {
            let mut c = connect(&sock, 1, false).expect("connect");
            c.hang_after = hang_after;
            let blocks = (vol as usize / BLK) as u64;
            let mut round = 0u64;
            while !l2.stop.load(Ordering::Acquire) {
                let t0 = Instant::now();
                let offs: Vec<u64> = (0..DEPTH as u64)
                    .map(|i| ((round * 7919 + i * 131) % blocks) * BLK as u64)
                    .collect();
                for (i, &off) in offs.iter().enumerate() {
                    c.buf(i * BLK, BLK)
                        .copy_from_slice(&pattern(round, off, BLK));
                    c.write(0, off, i * BLK, BLK, i);
                }
                let mut written = [false; DEPTH];
                for (tag, r) in c.wait(0, DEPTH) {
                    if r == 0 {
                        written[tag] = true;
                        l2.ok.fetch_add(1, Ordering::Relaxed);
                    } else {
                        l2.errors.fetch_add(1, Ordering::Relaxed);
                        l2.note(format!("write at {} failed: {r}", offs[tag]));
                    }
                }
                for (i, &off) in offs.iter().enumerate() {
                    c.read(0, off, (DEPTH + i) * BLK, BLK, i);
                }
                for (tag, r) in c.wait(0, DEPTH) {
                    if r != 0 {
                        l2.errors.fetch_add(1, Ordering::Relaxed);
                        l2.note(format!("read at {} failed: {r}", offs[tag]));
                        continue;
                    }
                    l2.ok.fetch_add(1, Ordering::Relaxed);
                    // Two offsets of one round can collide; the later write wins.
                    let last = offs.iter().rposition(|&o| o == offs[tag]).unwrap();
                    if written[last]
                        && c.buf((DEPTH + tag) * BLK, BLK) != pattern(round, offs[tag], BLK)
                    {
                        l2.corrupt.fetch_add(1, Ordering::Relaxed);
                        l2.note(format!("read at {} returned other data", offs[tag]));
                    }
                }
                l2.max_round_us
                    .fetch_max(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                round += 1;
            }
        });
        (l, t)
    }

    /// Keeps one of the first failures, with when it happened.
    fn note(&self, what: String) {
        let mut f = self.first.lock().unwrap_or_else(|p| p.into_inner());
        if f.len() < 8 {
            let ms = self.started.get().map_or(0, |t| t.elapsed().as_millis());
            f.push(format!("{what} ({ms} ms in)"));
        }
    }

    /// The first failures, for an assertion's message.
    pub fn failures(&self) -> Vec<String> {
        self.first.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn ok(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }
    pub fn corrupt(&self) -> u64 {
        self.corrupt.load(Ordering::Relaxed)
    }
    /// Waits until `counter` grew by `n`.
    pub fn wait_more(counter: &AtomicU64, n: u64, what: &str) {
        Self::wait_more_for(counter, n, what, Duration::from_secs(20))
    }
    /// `wait_more` with its own deadline.
    pub fn wait_more_for(counter: &AtomicU64, n: u64, what: &str, limit: Duration) {
        let start = counter.load(Ordering::Relaxed);
        let deadline = Instant::now() + limit;
        while counter.load(Ordering::Relaxed) < start + n {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    pub fn wait_errors(&self, n: u64) {
        Self::wait_more(&self.errors, n, "the volume did not get errors");
    }
    pub fn wait_progress(&self, n: u64) {
        Self::wait_more(&self.ok, n, "the workload made no progress");
    }
}
