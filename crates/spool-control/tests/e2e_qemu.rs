//! End-to-end: a real Linux VM (QEMU under TCG, Debian cloud kernel, busybox + fio initramfs
//! built by scripts/build-guest.sh) boots with a spoold volume as its vhost-user-blk disk and
//! runs fio with crc32c verification. Runs when SPOOL_E2E=1 (scripts/test.sh sets it after
//! building the guest); then a missing QEMU or guest image is a failure, not a skip.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use common::Spoold;

fn enabled() -> bool {
    if std::env::var("SPOOL_E2E").as_deref() == Ok("1") {
        return true;
    }
    eprintln!("e2e_qemu: skipped (set SPOOL_E2E=1; scripts/test.sh does)");
    false
}

fn guest_dir() -> PathBuf {
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

/// Boots the guest on `sock` and runs `job`; returns the console output.
fn run_guest(sock: &std::path::Path, job: &str, queues: u16, log: &std::path::Path) -> String {
    let g = guest_dir();
    let start = Instant::now();
    let out = Command::new("timeout")
        .arg("600")
        .arg("qemu-system-x86_64")
        .args([
            "-machine",
            "q35",
            "-accel",
            "tcg,thread=multi",
            "-smp",
            "2",
            "-m",
            "512M",
        ])
        .args(["-nographic", "-no-reboot", "-nic", "none"])
        .args([
            "-object",
            "memory-backend-memfd,id=mem,size=512M,share=on",
            "-numa",
            "node,memdev=mem",
        ])
        .arg("-kernel")
        .arg(g.join("vmlinuz"))
        .arg("-initrd")
        .arg(g.join("initramfs.cpio.gz"))
        .args([
            "-append",
            &format!("console=ttyS0 quiet panic=-1 spool.job={job}"),
        ])
        .args([
            "-chardev",
            &format!("socket,id=c0,path={},reconnect=1", sock.display()),
        ])
        .args([
            "-device",
            &format!("vhost-user-blk-pci,chardev=c0,num-queues={queues}"),
        ])
        .output()
        .expect("qemu-system-x86_64 must be installed (apt-get install qemu-system-x86)");
    let console =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    std::fs::write(log, &console).unwrap();
    eprintln!("guest job {job}: {:.1}s", start.elapsed().as_secs_f64());
    console
}

fn assert_pass(console: &str, d: &Spoold, job: &str) {
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

#[test]
fn vm_runs_fio_verify_on_a_spool_volume() {
    if !enabled() {
        return;
    }
    let d = Spoold::start(
        r#"
[io]
poll_idle_us = 20
[[devices]]
path = "@DIR@/d0.img"
create_size = "160M"
[[devices]]
path = "@DIR@/d1.img"
create_size = "160M"
[[volumes]]
name = "vm"
size = "192M"
num_queues = 2
[[volumes]]
name = "ro"
size = "16M"
read_only = true
num_queues = 1
"#,
    );
    let v = d
        .rpc("volume_show", serde_json::json!({"id": "vm"}))
        .unwrap();
    assert_eq!(
        v["devices"].as_array().unwrap().len(),
        2,
        "the VM's volume spans both devices"
    );
    let logs = d.dir.path().to_path_buf();
    // randwrite + verify, then a mixed out-of-order job; the second boot is also a VM
    // reboot against the same socket (reconnect).
    for job in ["verify", "mixed"] {
        let c = run_guest(
            &d.socket("vm"),
            job,
            2,
            &logs.join(format!("{job}.console")),
        );
        assert!(c.contains("queues 2"), "guest must see 2 queues: {c}");
        assert_pass(&c, &d, job);
    }
    let c = run_guest(&d.socket("ro"), "readonly", 1, &logs.join("ro.console"));
    assert!(c.contains("ro 1"), "guest must see a read-only disk");
    assert_pass(&c, &d, "readonly");
}
