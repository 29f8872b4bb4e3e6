//! Helpers for tests of this crate and of the crates above it that compose devices (built
//! with the `testing` feature, or in this crate's own tests; never in spoold): a real
//! qemu-nbd serving a file, and a writable NBD export in memory for spool-nbd's server.
//!
//! Owns: nothing the data path uses. Must not know: mirrors, pools.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{Device, OpenOptions};

/// qemu-nbd serving a file of its own as export `exp` on a Unix socket, killed when dropped.
pub struct QemuNbd {
    pid: i32,
    /// The file it serves.
    pub file: PathBuf,
    /// The export's `nbd+unix://` URI.
    pub uri: String,
}

impl QemuNbd {
    /// Starts qemu-nbd on `dir/remote.img` of `size` bytes and returns once it serves.
    pub fn start(dir: &Path, size: u64) -> QemuNbd {
        Self::start_as(dir, "remote", size)
    }

    /// As [`QemuNbd::start`], its files named after `name` (several servers in one `dir`).
    pub fn start_as(dir: &Path, name: &str, size: u64) -> QemuNbd {
        let file = dir.join(format!("{name}.img"));
        std::fs::File::create(&file).unwrap().set_len(size).unwrap();
        let (sock, pid_file) = (
            dir.join(format!("{name}.sock")),
            dir.join(format!("{name}.pid")),
        );
        let st = Command::new("qemu-nbd")
            .args([
                "-f",
                "raw",
                "-x",
                "exp",
                "-t",
                "-e",
                "16",
                "--fork",
                "--pid-file",
            ])
            .arg(&pid_file)
            .arg("-k")
            .arg(&sock)
            .arg(&file)
            .status()
            .expect("qemu-nbd (Debian's qemu-utils) runs");
        assert!(st.success(), "qemu-nbd: {st}");
        // `--fork`: the parent exits once the server serves.
        let pid = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let uri = format!("nbd+unix:///exp?socket={}", sock.display());
        QemuNbd { pid, file, uri }
    }

    pub fn device(&self) -> Arc<Device> {
        Arc::new(Device::open(Path::new(&self.uri), &OpenOptions::default()).unwrap())
    }

    pub fn contents(&self, offset: u64, len: u64) -> Vec<u8> {
        let all = std::fs::read(&self.file).unwrap();
        all[offset as usize..(offset + len) as usize].to_vec()
    }

    /// SIGKILLs the server and waits until it is gone.
    pub fn kill(&mut self) {
        if self.pid == 0 {
            return;
        }
        // SAFETY: a plain signal to the server's pid.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        let proc_dir = PathBuf::from(format!("/proc/{}", self.pid));
        let t0 = Instant::now();
        while std::fs::read_to_string(proc_dir.join("stat")).is_ok_and(|s| !s.contains(") Z "))
            && t0.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.pid = 0;
    }
}

impl Drop for QemuNbd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A writable export in memory, for the client against spool-nbd's own server; with
/// `false`, it does not offer write-zeroes (the client then writes zeroes as data). Its
/// reads and writes pass its [`Gate`] first.
pub struct MemExport(pub std::sync::Mutex<Vec<u8>>, pub bool, pub Gate);

impl MemExport {
    /// Serves the export over TCP on a free port of 127.0.0.1: the server (serving while it
    /// lives) and the URI to open.
    pub fn serve(self: &std::sync::Arc<Self>) -> (spool_nbd::Server, String) {
        let listen = spool_nbd::Listen::parse("127.0.0.1:0").expect("an address");
        let srv = spool_nbd::Server::start(listen, self.clone()).expect("a server");
        let uri = format!("nbd://{}/m", srv.listen);
        (srv, uri)
    }
}

/// Open unless closed: closed, what passes it waits until it opens again (a server that
/// took a request and does not answer).
#[derive(Default)]
pub struct Gate {
    closed: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
    waiting: std::sync::atomic::AtomicUsize,
}

impl Gate {
    pub fn close(&self) {
        *self.closed.lock().unwrap() = true;
    }
    pub fn open(&self) {
        *self.closed.lock().unwrap() = false;
        self.cv.notify_all();
    }
    /// How many wait at it now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn pass(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let closed = self.closed.lock().unwrap();
        self.waiting.fetch_add(1, SeqCst);
        drop(self.cv.wait_while(closed, |c| *c).unwrap());
        self.waiting.fetch_sub(1, SeqCst);
    }
}

impl spool_nbd::Export for MemExport {
    fn name(&self) -> &str {
        "m"
    }
    fn size(&self) -> u64 {
        self.0.lock().unwrap().len() as u64
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.2.pass();
        let d = self.0.lock().unwrap();
        buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn extent(&self) -> u64 {
        1 << 16
    }
    fn allocated(&self, _i: u64) -> bool {
        true
    }
    fn base(&self) -> Option<&str> {
        None
    }
    fn changed(&self, _i: u64) -> bool {
        false
    }
    fn writable(&self) -> bool {
        true
    }
    fn offers_write_zeroes(&self) -> bool {
        self.1
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.2.pass();
        let mut d = self.0.lock().unwrap();
        d[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }
}
