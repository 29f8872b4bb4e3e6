//! A real QEMU guest (TCG) on an RBD volume, served by spoold on a real single-node Ceph
//! cluster (scripts/ceph-cluster.sh), runs fio with crc32c verification through worker
//! SIGKILLs, upgrades and an OSD restart on spoold A, then live-migrates between two spoolds
//! (A and B: separate state directories and pools standing in for two hosts, the same
//! cluster) A → B → A → B. Passes only with zero fio errors and verify failures: the blocks
//! fio wrote through one host read back through the other, and the guest memory the
//! migration carried (data read from the disk, used rings) is what spoold wrote there,
//! which holds only if spoold's dirty log marked it. Runs when SPOOL_E2E=1.
//!
//! The guests run TCG single-threaded (`SPOOL_MIGRATION_TCG=multi` for a thread per vCPU).
//! With a thread per vCPU (QEMU 7.2), destinations came up with kernel memory only their
//! vCPUs write (the per-CPU timer wheel) in states no running kernel leaves it in: once in
//! CI a destination's kernel died 50 ms after it resumed (an RCU callback at 0x246,
//! poisoned timer lists); once here, in the third of three runs, both vCPUs of a
//! destination spun for ever, interrupts off, on a timer-base lock that read as held by
//! nobody (QMP `info registers` and `x`). Pages written by a vCPU and never sent again
//! would do both. spoold writes only fio's O_DIRECT buffers, status bytes and used rings.
//! Single-threaded TCG loses a guest too, more rarely, and so does QEMU's own virtio-blk
//! with no spoold at all (`migration_soak`, by hand; docs/ceph.md has the counts). After
//! every migration the guest must complete 200 more writes within 30 s: a lost guest fails
//! the test at once, with every console it had and where its vCPUs are.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::ceph::CephCluster;
use common::guest::{assert_pass, enabled, qemu_tcg};
use common::qmp::Qmp;
use common::Spoold;
use serde_json::json;

/// One guest process: QEMU, its QMP connection and where its console goes.
struct Vm {
    child: Child,
    qmp: Qmp,
    console: PathBuf,
    stderr: PathBuf,
}

impl Vm {
    /// Starts QEMU on `sock` running the verifying `killtest` job for `runtime` s; with
    /// `incoming`, as a migration's destination listening there.
    fn start(sock: &Path, dir: &Path, tag: &str, runtime: u64, incoming: Option<&Path>) -> Vm {
        let console = dir.join(format!("{tag}.console"));
        let stderr = dir.join(format!("{tag}.stderr"));
        let qmp = dir.join(format!("{tag}.qmp"));
        let tcg = std::env::var("SPOOL_MIGRATION_TCG").unwrap_or_else(|_| "single".into());
        let mut c = match std::env::var("SPOOL_SOAK_FILE") {
            Ok(f) => soak_file_guest(&f, runtime, &tcg),
            Err(_) => qemu_tcg(
                sock,
                "killtest",
                2,
                &format!("spool.runtime={runtime}"),
                runtime + 400,
                &tcg,
            ),
        };
        c.args([
            "-qmp",
            &format!("unix:{},server=on,wait=off", qmp.display()),
        ]);
        if let Some(i) = incoming {
            c.args(["-incoming", &format!("unix:{}", i.display())]);
        }
        let child = c
            .stdout(std::fs::File::create(&console).unwrap())
            .stderr(Stdio::from(std::fs::File::create(&stderr).unwrap()))
            .spawn()
            .expect("qemu-system-x86_64 must be installed");
        let qmp = Qmp::connect(&qmp);
        Vm {
            child,
            qmp,
            console,
            stderr,
        }
    }

    fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    fn assert_running(&mut self, what: &str, a: &Spoold, b: &Spoold) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "{what}: the guest exited early: {}\n--- QEMU ---\n{}\n--- A ---\n{}\n--- B ---\n{}",
            self.console(),
            std::fs::read_to_string(&self.stderr).unwrap_or_default(),
            a.log(),
            b.log()
        );
    }
}

/// Migrates `src` to a new QEMU on `dst_sock`; returns the destination and the downtime
/// QEMU reports (ms).
fn migrate(src: &mut Vm, dst_sock: &Path, dir: &Path, tag: &str, runtime: u64) -> (Vm, f64) {
    let incoming = dir.join(format!("{tag}.migrate"));
    let mut dst = Vm::start(dst_sock, dir, tag, runtime, Some(&incoming));
    let t = Instant::now();
    while !incoming.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{tag}: no incoming socket"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    src.qmp
        .execute(
            "migrate-set-parameters",
            json!({ "max-bandwidth": 4u64 << 30, "downtime-limit": 500 }),
        )
        .unwrap();
    src.qmp
        .execute(
            "migrate",
            json!({ "uri": format!("unix:{}", incoming.display()) }),
        )
        .unwrap_or_else(|e| panic!("{tag}: migrate refused: {e}"));
    let t = Instant::now();
    let info = loop {
        let info = src.qmp.execute("query-migrate", json!({})).unwrap();
        match info["status"].as_str() {
            // A source that was itself a destination reports its incoming migration's
            // "completed" (without RAM statistics) until this one has connected.
            Some("completed") if info.get("ram").is_some() => break info,
            Some("failed") | Some("cancelled") => panic!("{tag}: migration {info}"),
            _ => {}
        }
        assert!(
            t.elapsed() < Duration::from_secs(240),
            "{tag}: migration did not complete: {info}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let t = Instant::now();
    loop {
        let st = dst
            .qmp
            .execute("query-status", json!({}))
            .unwrap_or_else(|e| {
                panic!(
                    "{tag}: the destination QEMU is gone ({e}; {:?}): {}\n--- its stderr ---\n{}",
                    dst.child.try_wait(),
                    dst.console(),
                    std::fs::read_to_string(&dst.stderr).unwrap_or_default()
                )
            });
        if st["status"] == json!("running") {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{tag}: destination not running: {st}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The source is done once the destination runs. If it exited by itself (QEMU 7.2's
    // source was seen gone 20 ms after it stopped its vhost queues, once in CI), say how,
    // with its stderr: the guest lives on in the destination, which the rest checks.
    let quit = src.qmp.execute("quit", json!({}));
    let status = src.child.wait().unwrap();
    if quit.is_err() || !status.success() {
        eprintln!(
            "{tag}: the source QEMU ended by itself after the migration ({status}, quit: {quit:?}); \
             its stderr:\n{}",
            std::fs::read_to_string(&src.stderr).unwrap_or_default()
        );
    }
    let downtime = info["downtime"].as_f64().unwrap_or(f64::NAN);
    eprintln!(
        "{tag}: migrated in {:.1} s, downtime {downtime} ms ({} MiB sent)",
        info["total-time"].as_f64().unwrap_or(0.0) / 1000.0,
        info["ram"]["transferred"].as_u64().unwrap_or(0) >> 20
    );
    (dst, downtime)
}

/// Writes the guest completed through `d` (spoold's counters), or with `file` through QEMU's
/// own disk (the soak's control); None when QEMU is gone.
fn guest_writes(vm: &mut Vm, d: &Spoold, file: bool) -> Option<u64> {
    if file {
        let s = vm.qmp.execute("query-blockstats", json!({})).ok()?;
        Some(
            s.as_array()
                .into_iter()
                .flatten()
                .map(|d| d["stats"]["wr_operations"].as_u64().unwrap_or(0))
                .sum(),
        )
    } else {
        vm.qmp.execute("query-status", json!({})).ok()?;
        d.rpc("volume_stats", json!({"id": "vm"})).unwrap()[0]["write"]["ops"].as_u64()
    }
}

/// Every console the guest had (one per QEMU process it ran in, oldest first): a warning
/// one of them printed taints the kernel that fails later in another.
fn all_consoles(vm: &Vm) -> String {
    let dir = vm.console.parent().unwrap();
    let mut files: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "console"))
                .filter_map(|p| {
                    let n = p.file_stem()?.to_str()?.strip_prefix("vm")?.parse().ok()?;
                    Some((n, p))
                })
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
        .iter()
        .map(|(_, p)| {
            format!(
                "--- {} ---\n{}",
                p.display(),
                std::fs::read_to_string(p).unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Fails unless the guest completes 200 more writes within 30 s of resuming (a hung or dead
/// guest is reported at once, with where its vCPUs are, not when its fio job times out).
fn assert_writes_go_on(vm: &mut Vm, d: &Spoold, file: bool, tag: &str) -> u64 {
    let gone = |vm: &mut Vm| -> ! {
        panic!(
            "{tag}: QEMU is gone after the guest resumed ({:?})\n{}\n--- its stderr ---\n{}",
            vm.child.wait(),
            all_consoles(vm),
            std::fs::read_to_string(&vm.stderr).unwrap_or_default()
        )
    };
    let Some(w0) = guest_writes(vm, d, file) else {
        gone(vm)
    };
    let t = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let Some(w) = guest_writes(vm, d, file) else {
            gone(vm)
        };
        if w > w0 + 200 {
            return w - w0;
        }
        if t.elapsed() > Duration::from_secs(30) {
            let regs = vm
                .qmp
                .execute(
                    "human-monitor-command",
                    json!({"command-line": "info registers -a"}),
                )
                .unwrap_or_default();
            let regs: Vec<&str> = regs
                .as_str()
                .unwrap_or_default()
                .lines()
                .filter(|l| ["CPU", "RIP", "EFL"].iter().any(|k| l.starts_with(k)))
                .collect();
            panic!(
                "{tag}: the guest's writes stopped after it resumed ({w0} -> {w})\n{}\n--- vCPUs ---\n{}\n--- spoold ---\n{}",
                all_consoles(vm),
                regs.join("\n"),
                d.log()
            );
        }
    }
}

/// Migration `m` of a run: the guest moves to `to`, then must go on writing. Returns QEMU's
/// downtime (ms) and the writes seen after it resumed.
fn hop(vm: &mut Vm, to: &Spoold, dir: &Path, m: usize, runtime: u64, file: bool) -> (f64, u64) {
    let tag = format!("vm{}", m + 1);
    let (next, downtime) = migrate(vm, &to.socket("vm"), dir, &tag, runtime);
    *vm = next;
    let writes = assert_writes_go_on(vm, to, file, &format!("migration {m} ({tag})"));
    (downtime, writes)
}

/// Boots the guest on A (its files in A's directory) and waits until its job found the disk.
fn boot(a: &Spoold, b: &Spoold, runtime: u64) -> Vm {
    let mut vm = Vm::start(&a.socket("vm"), a.dir.path(), "vm0", runtime, None);
    let t = Instant::now();
    while !vm.console().contains("SPOOL-E2E: disk") {
        assert!(
            t.elapsed() < Duration::from_secs(240),
            "guest did not start"
        );
        vm.assert_running("boot", a, b);
        std::thread::sleep(Duration::from_millis(100));
    }
    vm
}

fn count(env: &str, default: usize) -> usize {
    std::env::var(env)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Who holds the image's lock (`rbd lock ls`), as spoold's cookie says: "pool UUID".
fn lock_holder(cluster: &CephCluster) -> String {
    cluster.rbd(&["lock", "ls", "rbd/vm"]).unwrap_or_default()
}

fn pool_uuid(d: &Spoold) -> String {
    d.rpc("pool_show", json!({})).unwrap()["uuid"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn a_vm_on_rbd_survives_kills_upgrades_an_osd_restart_and_live_migrations() {
    if !enabled() {
        return;
    }
    let Some(cluster) = CephCluster::start("migrate") else {
        return;
    };
    let rounds = count("SPOOL_RBD_ROUNDS", 10);
    let migrations = count("SPOOL_MIGRATIONS", 3);
    let base = format!(
        "[io]\npoll_idle_us = 20\n[ceph]\nconf = \"{}\"\nclaim_wait_ms = 5000\n\
         [[devices]]\npath = \"@DIR@/d0.img\"\ncreate_size = \"64M\"\n",
        cluster.conf.display()
    );
    let a = Spoold::start(&format!(
        "{base}[[volumes]]\nname = \"vm\"\nsize = \"96M\"\nnum_queues = 2\nrbd = \"rbd\"\n"
    ));
    let b = Spoold::start(&format!(
        "{base}[[volumes]]\nname = \"vm\"\nnum_queues = 2\nrbd = \"rbd/vm\"\n"
    ));
    let (ua, ub) = (pool_uuid(&a), pool_uuid(&b));
    let dir = a.dir.path().to_path_buf();
    let runtime = 60 + 3 * rounds as u64 + 40 * migrations as u64;
    let mut vm = boot(&a, &b, runtime);
    let held = lock_holder(&cluster);
    assert!(
        held.contains(&ua),
        "A serves the VM but holds no lock: {held}"
    );

    // Worker SIGKILLs and upgrades on A under the guest's load.
    let (mut kills, mut upgrades) = (Vec::new(), Vec::new());
    for k in 0..rounds {
        std::thread::sleep(Duration::from_millis(300 + (k as u64 * 137) % 400));
        vm.assert_running("kill", &a, &b);
        a.kill_worker();
        kills.push(
            a.status()["last_restart"]["stall_ms"]
                .as_f64()
                .unwrap_or(f64::NAN),
        );
        std::thread::sleep(Duration::from_millis(300 + (k as u64 * 71) % 400));
        let r = a
            .upgrade(None)
            .unwrap_or_else(|e| panic!("round {k}: upgrade failed: {e:?}"));
        assert_eq!(r["outcome"], json!("ok"), "{r}");
        upgrades.push(r["stall_ms"].as_f64().unwrap_or(f64::NAN));
    }
    let held = lock_holder(&cluster);
    assert!(
        held.contains(&ua),
        "the lock left A across its restarts: {held}"
    );

    // The OSD stops under load: the guest's I/O is held, then resumes.
    vm.assert_running("osd", &a, &b);
    cluster.stop_osd();
    std::thread::sleep(Duration::from_secs(3));
    cluster.start_osd();

    // Live migrations A → B → A → B.
    let mut downtimes = Vec::new();
    for m in 0..migrations {
        vm.assert_running("migration", &a, &b);
        let (to, uuid) = if m % 2 == 0 { (&b, &ub) } else { (&a, &ua) };
        let (downtime, _) = hop(&mut vm, to, &dir, m, runtime, false);
        downtimes.push(downtime);
        // A destination QEMU that died releases the lock: say so, with its stderr and the
        // guest's console, rather than only that the lock is gone.
        let held = lock_holder(&cluster);
        if !held.contains(uuid.as_str()) {
            vm.assert_running(&format!("migration {m}"), &a, &b);
        }
        assert!(
            held.contains(uuid.as_str()),
            "migration {m}: the destination serves without the lock: {held}"
        );
    }

    let status = vm.child.wait().unwrap();
    let console = vm.console();
    eprintln!(
        "rbd guest: qemu {status}; kill stalls {kills:?} ms; upgrade stalls {upgrades:?} ms; \
         migration downtimes {downtimes:?} ms"
    );
    let (la, lb) = (a.log(), b.log());
    for (name, log) in [("A", &la), ("B", &lb)] {
        for l in log.lines().filter(|l| {
            [
                "claim",
                "queue stopped",
                "dirty log",
                "frontend",
                "did not complete",
            ]
            .iter()
            .any(|k| l.contains(k))
        }) {
            eprintln!("{name}: {l}");
        }
    }
    assert!(
        la.contains("dirty log set") && lb.contains("dirty log set"),
        "a migration ran without spoold's dirty log"
    );
    if !console.contains("SPOOL-E2E: PASS") {
        panic!(
            "guest failed after migrating:\n{}\n--- A ---\n{la}\n--- B ---\n{lb}",
            console
        );
    }
    assert_pass(&console, &a, "killtest");
}

/// The same guest on QEMU's own virtio-blk over a raw file (no spoold): the soak's control.
fn soak_file_guest(file: &str, runtime: u64, tcg: &str) -> std::process::Command {
    let g = common::guest::guest_dir();
    let mut c = std::process::Command::new("timeout");
    c.arg((runtime + 400).to_string())
        .arg(common::guest::qemu_binary())
        .args(["-machine", "q35", "-accel", &format!("tcg,thread={tcg}")])
        .args([
            "-smp",
            "2",
            "-m",
            "512M",
            "-nographic",
            "-no-reboot",
            "-nic",
            "none",
        ])
        .args(["-object", "memory-backend-memfd,id=mem,size=512M,share=on"])
        .args(["-numa", "node,memdev=mem", "-kernel"])
        .arg(g.join("vmlinuz"))
        .arg("-initrd")
        .arg(g.join("initramfs.cpio.gz"))
        .args([
            "-append",
            &format!("console=ttyS0 quiet panic=-1 spool.job=killtest spool.runtime={runtime}"),
        ])
        .args([
            "-drive",
            &format!("file={file},if=none,id=d0,format=raw,cache=none,aio=threads"),
            "-device",
            "virtio-blk-pci,drive=d0,num-queues=2",
        ]);
    c
}

/// By hand (SPOOL_MIGRATION_SOAK=N): N live migrations A <-> B under the verifying fio job,
/// no kills, each followed by a check that the guest's writes go on within 30 s. With
/// SPOOL_SOAK_FILE=PATH the guest's disk is QEMU's own virtio-blk on a raw file instead of
/// spoold (the control).
#[test]
fn migration_soak() {
    let Some(n) = std::env::var("SPOOL_MIGRATION_SOAK")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    else {
        return;
    };
    let file = std::env::var("SPOOL_SOAK_FILE").ok();
    let cluster = if file.is_none() {
        CephCluster::start("soak")
    } else {
        None
    };
    let conf = cluster
        .as_ref()
        .map(|c| c.conf.display().to_string())
        .unwrap_or_default();
    let ceph = if file.is_none() {
        format!("[ceph]\nconf = \"{conf}\"\nclaim_wait_ms = 5000\n")
    } else {
        String::new()
    };
    let base = format!(
        "[io]\npoll_idle_us = 20\n{ceph}[[devices]]\npath = \"@DIR@/d0.img\"\ncreate_size = \"64M\"\n"
    );
    let vols = if file.is_none() {
        (
            format!(
                "{base}[[volumes]]\nname = \"vm\"\nsize = \"96M\"\nnum_queues = 2\nrbd = \"rbd\"\n"
            ),
            format!("{base}[[volumes]]\nname = \"vm\"\nnum_queues = 2\nrbd = \"rbd/vm\"\n"),
        )
    } else {
        (base.clone(), base.clone())
    };
    let a = Spoold::start(&vols.0);
    let b = Spoold::start(&vols.1);
    if let Some(f) = &file {
        std::fs::File::create(f).unwrap().set_len(96 << 20).unwrap();
    }
    let dir = a.dir.path().to_path_buf();
    let runtime = 60 + 30 * n as u64;
    let mut vm = boot(&a, &b, runtime);
    std::thread::sleep(Duration::from_secs(3));
    for m in 0..n {
        let to = if m % 2 == 0 { &b } else { &a };
        let (downtime, w) = hop(&mut vm, to, &dir, m, runtime, file.is_some());
        eprintln!("soak {m}: downtime {downtime} ms, then {w} writes");
    }
    eprintln!("soak: {n} migrations, the guest kept writing after each");
    let _ = vm.qmp.execute("quit", json!({}));
}
