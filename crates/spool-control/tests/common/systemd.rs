//! A real systemd service manager private to one test: `systemd --user` (Debian's systemd
//! 252), run in its own mount namespace where `/run/systemd/system` exists (so it agrees to
//! run although this machine's init is not systemd), with its own runtime and unit
//! directories. Nothing of sd_notify or the descriptor store is simulated: spoold talks to
//! systemd itself, and systemd starts, watches, restarts and hands back descriptors.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct UserManager {
    pub dir: tempfile::TempDir,
    child: Child,
    units: Vec<String>,
}

/// The systemd binary the manager runs.
pub const SYSTEMD: &str = "/lib/systemd/systemd";

impl UserManager {
    /// Starts the manager and waits until `systemctl --user` reaches it.
    pub fn start() -> UserManager {
        assert!(
            Path::new(SYSTEMD).exists(),
            "{SYSTEMD} missing: apt-get install systemd (scripts/install-deps.sh does)"
        );
        let dir = tempfile::tempdir().unwrap();
        for d in ["run/system", "xdg", "config/systemd/user"] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        std::fs::create_dir_all("/run/systemd").unwrap();
        let script = format!(
            "mount --bind {run} /run/systemd && exec {SYSTEMD} --user --log-target=console",
            run = dir.path().join("run").display()
        );
        let log = std::fs::File::create(dir.path().join("manager.log")).unwrap();
        let child = Command::new("unshare")
            .args(["-m", "sh", "-c", &script])
            .env("XDG_RUNTIME_DIR", dir.path().join("xdg"))
            .env("XDG_CONFIG_HOME", dir.path().join("config"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare (util-linux) must be installed");
        let m = UserManager {
            dir,
            child,
            units: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !m.systemctl(&["show-environment"]).0 {
            assert!(
                Instant::now() < deadline,
                "systemd --user did not come up: {}",
                m.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        m
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("manager.log")).unwrap_or_default()
    }

    /// `systemctl --user ARGS`: (succeeded, stdout + stderr).
    pub fn systemctl(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new("systemctl")
            .arg("--user")
            .args(args)
            .env("XDG_RUNTIME_DIR", self.dir.path().join("xdg"))
            .output()
            .unwrap();
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    }

    /// Installs unit `name` with `text` and reloads the manager.
    pub fn install(&mut self, name: &str, text: &str) {
        let p: PathBuf = self.dir.path().join("config/systemd/user").join(name);
        std::fs::write(p, text).unwrap();
        let (ok, out) = self.systemctl(&["daemon-reload"]);
        assert!(ok, "daemon-reload: {out}");
        self.units.push(name.to_string());
    }

    /// One property of a unit (`systemctl show -p PROP --value`).
    pub fn show(&self, unit: &str, prop: &str) -> String {
        self.systemctl(&["show", "-p", prop, "--value", unit])
            .1
            .trim()
            .to_string()
    }

    pub fn main_pid(&self, unit: &str) -> u32 {
        self.show(unit, "MainPID").parse().unwrap_or(0)
    }
}

impl Drop for UserManager {
    fn drop(&mut self) {
        for u in &self.units {
            let _ = self.systemctl(&["stop", u]);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
