//! A real single-node Ceph cluster for a test (scripts/ceph-cluster.sh: one monitor, one
//! BlueStore OSD on a sparse file, pool `rbd` with one copy), in its own directory on a free
//! port, stopped when dropped. Also used by spool-devices' tests (included by path), so it
//! depends on std only.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct CephCluster {
    pub dir: PathBuf,
    pub conf: PathBuf,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh")
}

/// Runs `cmd`: its stdout, or what it said when it failed.
fn output(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn run(args: &[&str]) -> Result<String, String> {
    output(Command::new("bash").arg(script()).args(args))
}

impl CephCluster {
    /// Starts a cluster. The tests that need one are `#[ignore]`d by default; run explicitly,
    /// a missing Ceph fails them with what to install.
    pub fn start(name: &str) -> CephCluster {
        assert!(
            Path::new("/usr/bin/ceph-osd").exists(),
            "this test needs Ceph: scripts/install-deps.sh installs it"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let dir = std::env::temp_dir().join(format!("spool-ceph-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.display().to_string();
        let conf = run(&["start", &d, &port.to_string()]).unwrap();
        CephCluster {
            dir,
            conf: PathBuf::from(conf.trim()),
        }
    }

    /// Stops the OSD: clients' I/O waits for it.
    pub fn stop_osd(&self) {
        run(&["stop-osd", &self.dir.display().to_string()]).unwrap();
    }

    pub fn start_osd(&self) {
        run(&["start-osd", &self.dir.display().to_string()]).unwrap();
    }

    /// Runs the `ceph` tool on this cluster.
    pub fn ceph(&self, args: &[&str]) -> Result<String, String> {
        output(Command::new("ceph").arg("-c").arg(&self.conf).args(args))
    }

    /// Runs the `rados` tool on this cluster.
    pub fn rados(&self, args: &[&str]) -> Result<String, String> {
        output(Command::new("rados").arg("-c").arg(&self.conf).args(args))
    }

    /// Runs the `rbd` tool on this cluster.
    pub fn rbd(&self, args: &[&str]) -> Result<String, String> {
        output(Command::new("rbd").arg("-c").arg(&self.conf).args(args))
    }
}

impl Drop for CephCluster {
    fn drop(&mut self) {
        let _ = run(&["stop", &self.dir.display().to_string()]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
