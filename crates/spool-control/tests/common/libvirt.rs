//! A real libvirt daemon (Debian's libvirtd 9.0, QEMU driver) private to one test: run in its
//! own mount namespace with its own /etc/libvirt, /run/libvirt, /var/lib/libvirt,
//! /var/log/libvirt and /var/cache/libvirt, so it neither sees nor touches a libvirt of the
//! machine. Its qemu.conf runs QEMU as root without a security driver (spoold's socket
//! directory is root's, mode 0700) and writes QEMU's output to files (no virtlogd).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Libvirtd {
    pub dir: tempfile::TempDir,
    child: Child,
}

const DIRS: [(&str, &str); 5] = [
    ("etc", "/etc/libvirt"),
    ("run", "/run/libvirt"),
    ("lib", "/var/lib/libvirt"),
    ("log", "/var/log/libvirt"),
    ("cache", "/var/cache/libvirt"),
];

impl Libvirtd {
    pub fn start() -> Libvirtd {
        assert!(
            Path::new("/usr/sbin/libvirtd").exists(),
            "libvirtd missing: scripts/install-deps.sh installs libvirt-daemon-driver-qemu"
        );
        let dir = tempfile::tempdir().unwrap();
        let mut script = String::from("set -e\n");
        for (mine, theirs) in DIRS {
            std::fs::create_dir_all(dir.path().join(mine)).unwrap();
            std::fs::create_dir_all(theirs).unwrap();
            script += &format!(
                "mount --bind {} {theirs}\n",
                dir.path().join(mine).display()
            );
        }
        script += "exec /usr/sbin/libvirtd\n";
        std::fs::write(
            dir.path().join("etc/qemu.conf"),
            "user = \"root\"\ngroup = \"root\"\ndynamic_ownership = 0\nremember_owner = 0\n\
             security_driver = \"none\"\nstdio_handler = \"file\"\n",
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("libvirtd.log")).unwrap();
        let child = Command::new("unshare")
            .args(["-m", "sh", "-c", &script])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare (util-linux) must be installed");
        let l = Libvirtd { dir, child };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !l.virsh(&["version"]).0 {
            assert!(
                Instant::now() < deadline,
                "libvirtd did not come up: {}",
                l.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        l
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("libvirtd.log")).unwrap_or_default()
    }

    /// `virsh ARGS` against this daemon: (succeeded, stdout + stderr).
    pub fn virsh(&self, args: &[&str]) -> (bool, String) {
        let uri = format!(
            "qemu:///system?socket={}",
            self.dir.path().join("run/libvirt-sock").display()
        );
        let out = Command::new("virsh")
            .args(["-c", &uri])
            .args(args)
            .output()
            .expect("virsh (libvirt-clients) must be installed");
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    }
}

impl Drop for Libvirtd {
    fn drop(&mut self) {
        let (_, list) = self.virsh(&["list", "--name"]);
        for name in list.lines().filter(|l| !l.trim().is_empty()) {
            let _ = self.virsh(&["destroy", name.trim()]);
        }
        // SAFETY: kill(2) takes no pointers; the pid is our own unreaped child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}
