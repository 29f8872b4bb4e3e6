//! Shared helpers: run the real spoold binary and drive it with the real libblkio client.
#![allow(dead_code)]

pub mod ceph;
pub mod guest;
pub mod hello;
pub mod libvirt;
pub mod link;
pub mod load;
pub mod mirror_events;
pub mod qmp;
pub mod systemd;

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use serde_json::Value;
use spool_control::rpc::{Client, ErrorObject};

/// A spoold process on a private state directory.
pub struct Spoold {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    child: Option<Child>,
    args: Vec<String>,
    /// Extra environment of the spoold process (and so of every worker it starts).
    pub envs: Vec<(String, String)>,
}

impl Spoold {
    /// Writes `extra` (devices, volumes) after a standard header and starts spoold.
    pub fn start(extra: &str) -> Spoold {
        Self::start_with(extra, true)
    }

    /// Like `start`, optionally with the journal switched off (Spool-NoJ).
    pub fn start_with(extra: &str, journal: bool) -> Spoold {
        Self::start_full(extra, journal, &[])
    }

    /// With extra spoold arguments.
    pub fn start_args(extra: &str, args: &[&str]) -> Spoold {
        Self::start_full(extra, true, args)
    }

    fn start_full(extra: &str, journal: bool, args: &[&str]) -> Spoold {
        let mut s = Self::prepare(extra, journal, args);
        s.spawn();
        s
    }

    /// The state directory and config, without starting spoold (the caller runs it, e.g.
    /// under systemd, logging to `log_path()`).
    pub fn prepared(extra: &str) -> Spoold {
        Self::prepare(extra, true, &[])
    }

    /// Where spoold's log goes.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("spoold.log")
    }

    fn prepare(extra: &str, journal: bool, args: &[&str]) -> Spoold {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("spoold.toml");
        std::fs::write(
            &config,
            format!(
                "state_dir = \"{}\"\n[journal]\nenabled = {journal}\ndir = \"{}\"\n[pool]\nmin_extent = \"1M\"\n{}",
                dir.path().join("state").display(),
                dir.path().join("journal").display(),
                extra.replace("@DIR@", &dir.path().display().to_string())
            ),
        )
        .unwrap();
        let s = Spoold {
            dir,
            config,
            child: None,
            args: args.iter().map(|a| a.to_string()).collect(),
            envs: Vec::new(),
        };
        s
    }

    pub fn rpc_path(&self) -> PathBuf {
        self.dir.path().join("state/spoold.sock")
    }

    pub fn socket(&self, volume: &str) -> PathBuf {
        self.dir.path().join(format!("state/vhost/{volume}.sock"))
    }

    /// Starts the daemon and waits until its RPC socket answers.
    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("spoold.log"))
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_spoold"))
            .arg("--config")
            .arg(&self.config)
            .arg("--log-level")
            .arg("info")
            .args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) = Client::connect(&self.rpc_path()) {
                if c.call("pool_show", Value::Null).is_ok() {
                    return;
                }
            }
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("spoold exited with {st}: {}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "spoold did not come up: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("spoold.log")).unwrap_or_default()
    }

    pub fn rpc(&self, method: &str, params: Value) -> Result<Value, ErrorObject> {
        Client::connect(&self.rpc_path())
            .unwrap()
            .call(method, params)
    }

    /// SIGTERM and wait (graceful).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) takes no pointers; the pid is our own unreaped child.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let st = c.wait().unwrap();
            assert!(st.success(), "spoold exited with {st}: {}", self.log());
        }
    }

    /// SIGKILL the keeper (the worker dies with it) and wait until both are gone.
    pub fn kill(&mut self) {
        let worker = self
            .child
            .is_some()
            .then(|| {
                Client::connect(&self.rpc_path())
                    .ok()?
                    .call("daemon_status", Value::Null)
                    .ok()
            })
            .flatten()
            .and_then(|s| s["pid"].as_u64());
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
        if let Some(pid) = worker {
            wait_gone(pid as u32);
        }
    }

    /// SIGKILLs the keeper and every process it started (the serving worker, a standby,
    /// an upgrade's candidate), as a host's crash or a cgroup kill does, and waits until all
    /// are gone: a worker left exiting on its own after its keeper still holds the devices'
    /// locks, and a spoold started at once finds them in use.
    pub fn kill_all(&mut self) {
        let Some(keeper) = self.child.as_ref().map(|c| c.id()) else {
            return;
        };
        // Each process is stopped before its children are listed: a stopped process starts
        // no other, so none is missed. (Listing the tree first and stopping it after left a
        // window: a worker the keeper started in between outlived the kill, orphaned, and
        // answered the next spawn's RPC check before the new daemon served its volumes;
        // tier 2 then found the vhost socket refusing, once in some 150 whole-daemon kills.)
        let mut all = Vec::new();
        let mut next = vec![keeper];
        while let Some(pid) = next.pop() {
            stop_process(pid);
            if pid != keeper {
                all.push(pid);
            }
            next.extend(children(pid));
        }
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
        for &pid in &all {
            // SAFETY: kill(2) takes no pointers.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        for pid in all {
            wait_gone(pid);
        }
    }

    /// `daemon_status`, retried while a worker restarts (an RPC accepted by a dying worker
    /// fails; the next one reaches the new worker).
    pub fn status(&self) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) = Client::connect(&self.rpc_path()) {
                if let Ok(v) = c.call("daemon_status", Value::Null) {
                    return v;
                }
            }
            assert!(
                Instant::now() < deadline,
                "daemon_status never answered: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits (up to 10 s) until spoold has seen the client of `volume` go (a client's
    /// disconnection reaches it asynchronously).
    pub fn wait_disconnected(&self, volume: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let v = self
                .rpc("volume_show", serde_json::json!({ "id": volume }))
                .unwrap();
            if v["connected"] == serde_json::json!(false) {
                return;
            }
            assert!(Instant::now() < deadline, "{v}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The serving worker's pid.
    pub fn worker_pid(&self) -> u32 {
        self.status()["pid"].as_u64().unwrap() as u32
    }

    /// SIGKILLs the worker (not the keeper) and waits until a new worker serves.
    pub fn kill_worker(&self) -> u32 {
        let old = self.worker_pid();
        // SAFETY: kill(2) takes no pointers.
        unsafe { libc::kill(old as i32, libc::SIGKILL) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = self.status();
            let pid = s["pid"].as_u64().unwrap() as u32;
            if pid != old {
                return pid;
            }
            assert!(Instant::now() < deadline, "no new worker: {}", self.log());
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// `daemon_upgrade` (answered once the new worker serves, or with the rollback reason).
    pub fn upgrade(&self, binary: Option<&Path>) -> Result<Value, ErrorObject> {
        let params = match binary {
            Some(b) => serde_json::json!({"binary": b}),
            None => Value::Null,
        };
        self.rpc("daemon_upgrade", params)
    }

    /// The keeper's pid.
    pub fn keeper_pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }
}

impl Drop for Spoold {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("--- spoold log (last 40 lines) ---");
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
        self.kill();
    }
}

/// Waits until process `pid` no longer exists.
/// Runs spoolctl against `d`'s RPC socket: (succeeded, stdout, stderr).
pub fn spoolctl(d: &Spoold, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_spoolctl"))
        .arg("--socket")
        .arg(d.rpc_path())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// `spoolctl ARGS` against `d`, which must succeed: its output.
pub fn ctl(d: &Spoold, args: &[&str]) -> String {
    let (ok, out, err) = spoolctl(d, args);
    assert!(ok, "spoolctl {args:?}: {out}{err}\n{}", d.log());
    out
}

/// `spoolctl ARGS` against `d`, which must fail: its error output.
pub fn ctl_err(d: &Spoold, args: &[&str]) -> String {
    let (ok, out, err) = spoolctl(d, args);
    assert!(!ok, "spoolctl {args:?} succeeded: {out}");
    err
}

/// `spoolctl pool check` finds nothing wrong (docs/pool-check.md).
#[allow(dead_code)]
pub fn assert_pool_checks_clean(d: &Spoold) {
    let (ok, out, err) = spoolctl(d, &["pool", "check"]);
    assert!(
        ok && out.contains("no problems found"),
        "pool check:\n{out}{err}"
    );
}

/// The children of process `pid` (every thread's), from /proc.
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// The state letter of process `pid` (`R`, `S`, `T`, `Z`, ...), `None` once it is gone.
fn process_state(pid: u32) -> Option<char> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "PID (COMM) STATE ...": COMM may hold spaces and parentheses; the state follows the last.
    st.rsplit_once(')')?.1.trim_start().chars().next()
}

/// SIGSTOPs `pid` and waits until it is stopped (or gone): from then on it starts no child.
fn stop_process(pid: u32) {
    // SAFETY: kill(2) takes no pointers.
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !matches!(process_state(pid), None | Some('T' | 't' | 'Z' | 'X')) {
        if Instant::now() > deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub fn wait_gone(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() {
        // A zombie still has /proc/PID; its state is Z.
        let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if st.split(' ').nth(2) == Some("Z") || Instant::now() > deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A libblkio virtio-blk-vhost-user connection with one mapped buffer region.
pub struct Client_ {
    pub b: Blkio,
    pub queues: Vec<Blkioq>,
    pub region: MemoryRegion,
    pub capacity: u64,
    /// How long `wait` waits for a completion before calling the request hung.
    pub hang_after: Duration,
}

pub const REGION: usize = 8 << 20;

pub fn connect(sock: &Path, num_queues: i32, read_only: bool) -> Result<Client_, blkio::Error> {
    let mut b = Blkio::new("virtio-blk-vhost-user")?;
    b.set_str("path", sock.to_str().unwrap())?;
    if read_only {
        b.set_bool("read-only", true)?;
    }
    b.connect()?;
    b.set_i32("num-queues", num_queues)?;
    let out = b.start()?;
    let region = b.alloc_mem_region(REGION)?;
    b.map_mem_region(&region)?;
    let capacity = b.get_u64("capacity")?;
    Ok(Client_ {
        b,
        queues: out.queues,
        region,
        capacity,
        hang_after: Duration::from_secs(10),
    })
}

impl Client_ {
    pub fn buf(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= REGION);
        // SAFETY: the region is REGION bytes of memory libblkio allocated for us and keeps
        // mapped until free; tests never hold two overlapping slices across a request.
        unsafe { std::slice::from_raw_parts_mut((self.region.addr + off) as *mut u8, len) }
    }

    fn ptr(&self, off: usize) -> *mut u8 {
        (self.region.addr + off) as *mut u8
    }

    /// Waits for `n` completions on queue `q`; returns their (user_data, ret).
    pub fn wait(&mut self, q: usize, n: usize) -> Vec<(usize, i32)> {
        let mut out = Vec::new();
        let mut comps: Vec<MaybeUninit<Completion>> =
            (0..n.max(1)).map(|_| MaybeUninit::uninit()).collect();
        while out.len() < n {
            let mut t = self.hang_after;
            let got = self.queues[q]
                .do_io(&mut comps[..n - out.len()], 1, Some(&mut t), None)
                .expect("do_io");
            assert!(got > 0, "request timed out (hung)");
            for c in &comps[..got] {
                // SAFETY: do_io initialised the first `got` completions.
                let c = unsafe { c.assume_init_ref() };
                out.push((c.user_data, c.ret));
            }
        }
        out
    }

    pub fn write(&mut self, q: usize, offset: u64, buf_off: usize, len: usize, tag: usize) {
        let p = self.ptr(buf_off);
        self.queues[q].write(offset, p, len, tag, ReqFlags::empty());
    }

    pub fn read(&mut self, q: usize, offset: u64, buf_off: usize, len: usize, tag: usize) {
        let p = self.ptr(buf_off);
        self.queues[q].read(offset, p, len, tag, ReqFlags::empty());
    }

    /// Synchronous helpers returning the request's result.
    pub fn write_sync(&mut self, q: usize, offset: u64, data: &[u8]) -> i32 {
        self.buf(0, data.len()).copy_from_slice(data);
        self.write(q, offset, 0, data.len(), 1);
        self.wait(q, 1)[0].1
    }

    pub fn read_sync(&mut self, q: usize, offset: u64, len: usize) -> (i32, Vec<u8>) {
        self.read(q, offset, 0, len, 1);
        let r = self.wait(q, 1)[0].1;
        (r, self.buf(0, len).to_vec())
    }
}

/// A block whose content says who wrote it: (salt, offset) repeated.
pub fn pattern(salt: u64, offset: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut i = 0u64;
    while v.len() < len {
        let word = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (offset + i * 8);
        v.extend_from_slice(&word.to_le_bytes());
        i += 1;
    }
    v.truncate(len);
    v
}

pub const BS: usize = 64 * 1024;

/// What a worker logs when it resubmits requests a killed worker had in flight.
pub const RECOVERED: &str = "resubmitting requests recovered from the journal";

/// A thread that SIGKILLs `d`'s worker `min` times, then more (up to `max` in all) until one
/// kill caught a request in flight (on a loaded machine the client may be between requests
/// at every kill); it returns the pids of the first worker and of each one after a kill.
pub fn kill_workers_until_recovered(
    d: std::sync::Arc<Spoold>,
    min: usize,
    max: usize,
) -> std::thread::JoinHandle<Vec<u32>> {
    std::thread::spawn(move || {
        let mut pids = vec![d.worker_pid()];
        for i in 0..max {
            if i >= min && d.log().contains(RECOVERED) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20 + (i as u64 * 37) % 60));
            pids.push(d.kill_worker());
        }
        pids
    })
}

/// Like [`kill_workers_until_recovered`], but certain to exercise recovery: one write to
/// device `dev` first hangs there (an injected `timeout` fault, once), and the first kill
/// comes once it does, so that kill finds the write in flight. The successor, which has no
/// such rule, resubmits it from the journal. (Kills at random moments can all miss a
/// request in flight, most of all on a loaded machine or with inline I/O on tmpfs.)
#[allow(dead_code)]
pub fn kill_workers_holding_a_write(
    d: std::sync::Arc<Spoold>,
    dev: &str,
    min: usize,
    max: usize,
) -> std::thread::JoinHandle<Vec<u32>> {
    d.rpc(
        "device_inject",
        serde_json::json!({"id": dev, "kind": "timeout", "op": "write", "count": 1}),
    )
    .unwrap();
    let dev = dev.to_string();
    std::thread::spawn(move || {
        wait_fault_hit(&d, &dev);
        kill_workers_until_recovered(d, min, max).join().unwrap()
    })
}

/// Waits (60 s at most) until the fault injected on device `dev` was hit: its hit count is
/// up, or it is spent and gone. The request it holds is in the device now. Returns when.
#[allow(dead_code)]
pub fn wait_fault_hit(d: &Spoold, dev: &str) -> std::time::Instant {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let f = d
            .rpc("device_faults", serde_json::json!({"id": dev}))
            .unwrap();
        let rules = f["rules"].as_array().cloned().unwrap_or_default();
        if rules.is_empty() || rules[0]["hits"].as_u64().unwrap_or(0) > 0 {
            return std::time::Instant::now();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no request reached the device's fault: {f}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Block `off` (BS bytes), read on queue 0.
#[allow(dead_code)]
pub fn block(c: &mut Client_, off: u64) -> Vec<u8> {
    let (r, data) = c.read_sync(0, off, BS);
    assert_eq!(r, 0);
    data
}

/// The round of [`write_rounds_until`] whose whole write each of its 64 blocks holds (a
/// snapshot taken during the load: no block is half of one round and half of another).
#[allow(dead_code)]
pub fn whole_rounds(c: &mut Client_, rounds: u64) -> Vec<u64> {
    (0..64u64)
        .map(|b| {
            let data = block(c, b * BS as u64);
            (0..rounds)
                .find(|&r| data == pattern(r, b * BS as u64, BS))
                .unwrap_or_else(|| panic!("block {b} holds no whole write of any round"))
        })
        .collect()
}

/// Writes rounds of 2 queues × 32 requests (64 KiB each) until `done()` says so (at least `min_rounds`), checking every
/// completion; returns the number of rounds. Then every block must hold its last write.
pub fn write_rounds_until(c: &mut Client_, done: &dyn Fn() -> bool, min_rounds: u64) -> u64 {
    let mut round = 0u64;
    while round < min_rounds || !done() {
        for q in 0..2 {
            for i in 0..32 {
                let blk = q * 32 + i;
                let off = (blk * BS) as u64;
                c.buf(blk * BS, BS)
                    .copy_from_slice(&pattern(round, off, BS));
                c.write(q, off, blk * BS, BS, blk);
            }
        }
        for q in 0..2 {
            let done = c.wait(q, 32);
            assert!(done.iter().all(|&(_, r)| r == 0), "round {round}: {done:?}");
        }
        round += 1;
    }
    for blk in 0..64usize {
        let off = (blk * BS) as u64;
        let (r, data) = c.read_sync(blk % 2, off, BS);
        assert_eq!(r, 0);
        assert!(
            data == pattern(round - 1, off, BS),
            "block {blk} does not hold its last write (round {})",
            round - 1
        );
    }
    round
}
pub mod raw;

// Sending volumes between two spoolds (tests/send.rs, tests/tls.rs).

/// Each spoold's config: the same volume on both hosts (the destination's is created by
/// hand, as docs/transfer.md says).
#[allow(dead_code)]
pub const CONFIG: &str = r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[volumes]]
name = "v"
size = "16M"
num_queues = 1
"#;

/// The destination's config for a send through its transfer listener: no volume (the
/// hello creates it), a listener on a free port of 127.0.0.1, this host the only peer.
#[allow(dead_code)]
pub const LISTENING: &str = r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[transfer]
listen = "127.0.0.1:0"
peers = ["127.0.0.1"]
"#;

/// Waits (up to 120 s) until `volume send v` says the copy is current.
#[allow(dead_code)]
pub fn wait_current(a: &Spoold, b: &Spoold) {
    let t0 = Instant::now();
    loop {
        let out = ctl(a, &["volume", "send", "v"]);
        if out.contains(": current") {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the copy never became current: {out}\nsource:\n{}\ndestination:\n{}",
            a.log(),
            b.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Reads volume v through `d`'s vhost-user socket (its frontend starts it: the switchover)
/// and checks it holds `data`, MiB by MiB.
#[allow(dead_code)]
pub fn reads_back(d: &Spoold, data: &[u8]) {
    let mut c = connect(&d.socket("v"), 1, false).unwrap();
    const MIB: usize = 1 << 20;
    for (i, m) in data.chunks(MIB).enumerate() {
        let (r, got) = c.read_sync(0, (i * MIB) as u64, MIB);
        assert_eq!(r, 0);
        assert!(got == m, "MiB {i} differs on the destination");
    }
}

/// The port B's transfer listener got (from its log).
#[allow(dead_code)]
pub fn transfer_port(b: &Spoold) -> u16 {
    let t = Instant::now();
    loop {
        let log = b.log();
        let port = log
            .lines()
            .find(|l| l.contains("transfer listener"))
            .and_then(|l| l.split("listen=127.0.0.1:").nth(1))
            .and_then(|p| p.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|p| p.parse().ok());
        if let Some(p) = port {
            return p;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no listener:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A new CA and its server (127.0.0.1, localhost) and client certificates in `dir`, made by
/// `scripts/tls-certs.sh` (openssl).
#[allow(dead_code)]
pub fn tls_credentials(dir: &Path) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/tls-certs.sh");
    let out = Command::new(script).arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A key file of `byte` repeated, in hex, mode 0600 (a key-encryption key).
pub fn write_key(path: &Path, byte: u8) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("{byte:02x}").repeat(32)).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}
