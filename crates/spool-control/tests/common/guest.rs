//! Booting the test guest (QEMU under TCG, Debian cloud kernel, busybox + fio initramfs built
//! by scripts/build-guest.sh) on a vhost-user-blk socket, and reading its verdict.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use super::Spoold;

pub fn guest_dir() -> PathBuf {
    let cache = std::env::var("SPOOL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache"));
    let g = cache.join("guest");
    assert!(
        g.join("vmlinuz").exists() && g.join("initramfs.cpio.gz").exists(),
        "guest image missing in {}: run scripts/build-guest.sh",
        g.display()
    );
    g
}

/// The QEMU binary: `SPOOL_QEMU` (e.g. QEMU 10 from scripts/install-qemu10.sh), else the
/// system's.
pub fn qemu_binary() -> String {
    std::env::var("SPOOL_QEMU").unwrap_or_else(|_| "qemu-system-x86_64".into())
}

/// QEMU's major version (`--version`), asked once.
pub fn qemu_major() -> u32 {
    static V: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        let out = Command::new(qemu_binary())
            .arg("--version")
            .output()
            .expect("qemu-system-x86_64 must be installed");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.split_whitespace()
            .skip_while(|w| *w != "version")
            .nth(1)
            .and_then(|v| v.split('.').next()?.parse().ok())
            .unwrap_or_else(|| panic!("cannot read QEMU's version from {text:?}"))
    })
}

/// The vhost-user chardev's reconnect option: `reconnect=1` (seconds) before QEMU 10, which
/// takes `reconnect-ms` (9.2 deprecated `reconnect`).
pub fn reconnect_option() -> &'static str {
    if qemu_major() >= 10 {
        "reconnect-ms=1000"
    } else {
        "reconnect=1"
    }
}

pub fn qemu(
    sock: &std::path::Path,
    job: &str,
    queues: u16,
    extra: &str,
    timeout_s: u64,
) -> Command {
    qemu_tcg(sock, job, queues, extra, timeout_s, "multi")
}

/// [`qemu`] with TCG's threading chosen: `multi` (a host thread per vCPU) or `single` (one
/// thread runs both vCPUs in turn).
pub fn qemu_tcg(
    sock: &std::path::Path,
    job: &str,
    queues: u16,
    extra: &str,
    timeout_s: u64,
    thread: &str,
) -> Command {
    qemu_tcg_on(sock, job, queues, extra, timeout_s, thread, MEMFD_RAM)
}

/// The guest's RAM as QEMU's usual shared memfd.
pub const MEMFD_RAM: &str = "memory-backend-memfd,id=mem,size=512M,share=on";

/// [`qemu_tcg`] with the guest's RAM given by `memory` (a `-object` memory backend with
/// id `mem`, shared: vhost-user needs it).
pub fn qemu_tcg_on(
    sock: &std::path::Path,
    job: &str,
    queues: u16,
    extra: &str,
    timeout_s: u64,
    thread: &str,
    memory: &str,
) -> Command {
    let g = guest_dir();
    let mut c = Command::new("timeout");
    c.arg(timeout_s.to_string())
        .arg(qemu_binary())
        .args([
            "-machine",
            "q35",
            "-accel",
            &format!("tcg,thread={thread}"),
            "-smp",
            "2",
            "-m",
            "512M",
        ])
        .args(["-nographic", "-no-reboot", "-nic", "none"])
        // QEMU 10 unpacked beside the system's 7.2 brings its own option ROMs.
        .args(
            std::env::var("SPOOL_QEMU_DATA")
                .map(|d| vec!["-L".to_string(), d])
                .unwrap_or_default(),
        )
        .args(["-object", memory, "-numa", "node,memdev=mem"])
        .arg("-kernel")
        .arg(g.join("vmlinuz"))
        .arg("-initrd")
        .arg(g.join("initramfs.cpio.gz"))
        .args([
            "-append",
            &format!("console=ttyS0 quiet panic=-1 spool.job={job} {extra}"),
        ])
        .args([
            "-chardev",
            &format!(
                "socket,id=c0,path={},{}",
                sock.display(),
                reconnect_option()
            ),
        ])
        .args([
            "-device",
            &format!("vhost-user-blk-pci,chardev=c0,num-queues={queues}"),
        ]);
    c
}

/// Boots the guest on `sock` and runs `job`; returns the console output.
/// Seconds a guest may take to reach its init script (it prints "SPOOL-E2E: disk ...").
/// It takes 5–10 s here; once in CI a TCG guest hung silently in early kernel boot, before it
/// ever probed its disk (the daemon saw no device reset), and used up the whole 600 s timeout.
pub const BOOT_WATCHDOG_S: u64 = 240;

pub fn run_guest(sock: &std::path::Path, job: &str, queues: u16, log: &std::path::Path) -> String {
    run_guest_disks(&[sock], job, queues, log)
}

/// [`run_guest`] with a disk on each of `socks` (`/dev/vda`, `/dev/vdb`, … in that order).
pub fn run_guest_disks(
    socks: &[&std::path::Path],
    job: &str,
    queues: u16,
    log: &std::path::Path,
) -> String {
    for attempt in 1..=2 {
        match run_guest_once(socks, job, queues, log) {
            Ok(console) => return console,
            Err(console) if attempt == 1 => {
                // Only a guest that never reached user space is retried: the daemon has not
                // seen a single request of the job by then, so nothing it did is hidden.
                eprintln!(
                    "guest job {job}: no output from the guest's init in {BOOT_WATCHDOG_S} s \
                     (a TCG boot hang, before the kernel probed its disk); booting it again. \
                     Console so far:\n{console}"
                );
            }
            Err(console) => return console,
        }
    }
    unreachable!()
}

/// Runs one guest to the end. Err(console) if its init printed nothing within
/// [`BOOT_WATCHDOG_S`] (the guest is then stopped).
fn run_guest_once(
    socks: &[&std::path::Path],
    job: &str,
    queues: u16,
    log: &std::path::Path,
) -> Result<String, String> {
    use std::io::Read;
    use std::process::Stdio;
    use std::sync::{Arc, Mutex};
    let start = Instant::now();
    let mut cmd = qemu(
        socks[0],
        job,
        queues,
        &format!("spool.disks={}", socks.len()),
        600,
    );
    for (i, sock) in socks.iter().enumerate().skip(1) {
        cmd.args([
            "-chardev",
            &format!(
                "socket,id=c{i},path={},{}",
                sock.display(),
                reconnect_option()
            ),
            "-device",
            &format!("vhost-user-blk-pci,chardev=c{i},num-queues={queues}"),
        ]);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("qemu-system-x86_64 must be installed (apt-get install qemu-system-x86)");
    let console = Arc::new(Mutex::new(String::new()));
    let readers: Vec<_> = [
        Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ]
    .into_iter()
    .map(|mut r| {
        let console = console.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = r.read(&mut buf) {
                if n == 0 {
                    break;
                }
                console
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    })
    .collect();
    let mut booted = true;
    while child.try_wait().unwrap().is_none() {
        if start.elapsed().as_secs() >= BOOT_WATCHDOG_S
            && !console.lock().unwrap().contains("SPOOL-E2E")
        {
            booted = false;
            // `timeout` passes SIGTERM on to QEMU.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let _ = child.wait();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    for r in readers {
        let _ = r.join();
    }
    let console = console.lock().unwrap().clone();
    std::fs::write(log, &console).unwrap();
    eprintln!("guest job {job}: {:.1}s", start.elapsed().as_secs_f64());
    if booted {
        Ok(console)
    } else {
        Err(console)
    }
}

pub fn assert_pass(console: &str, d: &Spoold, job: &str) {
    let lines: Vec<&str> = console
        .lines()
        .filter(|l| l.contains("SPOOL-E2E"))
        .collect();
    assert!(
        console.contains("SPOOL-E2E: PASS"),
        "guest job {job} failed:\n{}\n--- console ---\n{}\n--- spoold ---\n{}",
        lines.join("\n"),
        console
            .chars()
            .rev()
            .take(3000)
            .collect::<String>()
            .chars()
            .rev()
            .collect::<String>(),
        d.log()
    );
}

/// Boots the guest running the `killtest` job (verifying writers, `runtime` s) on `sock` in
/// the background, its console to `console`, and waits until its disk is up.
pub fn start_killtest(
    sock: &std::path::Path,
    runtime: u64,
    console: &std::path::Path,
) -> std::process::Child {
    start_killtest_with(sock, runtime, console, &[])
}

/// [`start_killtest`] with more QEMU arguments (a QMP socket, say). A guest whose init
/// printed nothing within 120 s (the TCG boot hang of [`BOOT_WATCHDOG_S`]: RCU stalls in
/// early boot, before its disk is probed, so the daemon has seen no request) is stopped and
/// booted once more, as [`run_guest`] does; any other failure to start fails the test.
pub fn start_killtest_with(
    sock: &std::path::Path,
    runtime: u64,
    console: &std::path::Path,
    args: &[&str],
) -> std::process::Child {
    let read_console = || std::fs::read_to_string(console).unwrap_or_default();
    'boot: for attempt in 1..=2 {
        let mut vm = qemu(
            sock,
            "killtest",
            2,
            &format!("spool.runtime={runtime}"),
            runtime + 300,
        )
        .args(args)
        .stdout(std::fs::File::create(console).unwrap())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("qemu-system-x86_64 must be installed");
        let deadline = Instant::now() + std::time::Duration::from_secs(120);
        while !read_console().contains("SPOOL-E2E: disk") {
            assert!(
                vm.try_wait().unwrap().is_none(),
                "guest exited early: {}",
                read_console()
            );
            if Instant::now() >= deadline {
                let c = read_console();
                assert!(
                    attempt == 1 && !c.contains("SPOOL-E2E"),
                    "guest did not start: {c}"
                );
                eprintln!(
                    "killtest guest: no output from its init in 120 s (a TCG boot hang, before \
                     the kernel probed its disk); booting it again. Console so far:\n{c}"
                );
                // `timeout` passes SIGTERM on to QEMU.
                let _ = Command::new("kill")
                    .args(["-TERM", &vm.id().to_string()])
                    .status();
                let _ = vm.wait();
                continue 'boot;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        return vm;
    }
    unreachable!("the second boot either started or failed the test")
}

/// One 96 MiB volume "vm" with two queues on one device: what the killtest guest runs on.
pub const KILLTEST_CONFIG: &str = r#"
[io]
poll_idle_us = 20
[[devices]]
path = "@DIR@/d0.img"
create_size = "128M"
[[volumes]]
name = "vm"
size = "96M"
num_queues = 2
"#;
