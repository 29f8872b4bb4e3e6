//! Shared helpers: run the real spoold binary and drive it with the real libblkio client.
#![allow(dead_code)]

use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};
use serde_json::Value;
use spool_control::rpc::{Client, RpcError};

/// A spoold process on a private state directory.
pub struct Spoold {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    child: Option<Child>,
}

impl Spoold {
    /// Writes `extra` (devices, volumes) after a standard header and starts spoold.
    pub fn start(extra: &str) -> Spoold {
        Self::start_with(extra, true)
    }

    /// Like `start`, optionally with the journal switched off (Spool-NoJ).
    pub fn start_with(extra: &str, journal: bool) -> Spoold {
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
        let mut s = Spoold {
            dir,
            config,
            child: None,
        };
        s.spawn();
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

    pub fn rpc(&self, method: &str, params: Value) -> Result<Value, RpcError> {
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

    /// SIGKILL and wait.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
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

/// A libblkio virtio-blk-vhost-user connection with one mapped buffer region.
pub struct Client_ {
    pub b: Blkio,
    pub queues: Vec<Blkioq>,
    pub region: MemoryRegion,
    pub capacity: u64,
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
            let mut t = Duration::from_secs(10);
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
