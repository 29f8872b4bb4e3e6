//! A real QEMU guest (TCG) on an RBD volume, served by spoold on a real single-node Ceph
//! cluster (scripts/ceph-cluster.sh), runs fio with crc32c verification through worker
//! SIGKILLs, upgrades and an OSD restart on spoold A, then live-migrates between two spoolds
//! (A and B: separate state directories and pools standing in for two hosts, the same
//! cluster) A → B → A → B, the second migration with a worker kill on its source while RAM is
//! copied, the third with an upgrade. Passes only with zero fio errors and verify failures.
//! `#[ignore]`d by default (it needs QEMU, the test guest and Ceph): scripts/test.sh runs it.
//!
//! A second test moves a VM with its *local* volume (no Ceph): spoold A sends the volume to
//! spoold B (`volume send`, a remote mirror leg on B's `volume receive` export) through a
//! worker kill on each side, then the same page-checked live migration moves the guest.
//!
//! **Every migration is checked page by page.** Both QEMUs keep guest RAM in files under
//! /dev/shm, the destination starts paused (`-S`), and when the migration completes the test
//! compares the two RAM files before the destination runs: a differing page is a write the
//! migration did not carry. Each spoold records every guest page it writes, with a CRC32C of
//! the page as it left it (the `[debug] write_witness` file), so the test tells a page that
//! still holds what spoold wrote (its write was not carried, its dirty log missed it: the test
//! fails at once) from one holding a write of the guest's own (QEMU's TCG dirty tracking lost
//! it: the migration is rolled back, the destination quit unrun and the source continued, and
//! done again, as an operator would; counted and printed, never
//! silent). docs/ceph.md has the counts, and the control: the same check with QEMU's own
//! virtio-blk and no spoold (`migration_soak` with `SPOOL_SOAK_FILE`).
//!
//! The guests run TCG single-threaded (`SPOOL_MIGRATION_TCG=multi` for a thread per vCPU):
//! with a thread per vCPU (QEMU 7.2) destinations came up with kernel memory only their
//! vCPUs write in states no running kernel leaves it in. After every migration the guest
//! must complete 200 more writes within 30 s: a lost guest fails the test at once, with
//! every console it had and where its vCPUs are.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::ceph::CephCluster;
use common::guest::{assert_pass, qemu_tcg_on};
use common::link::Link;
use common::qmp::Qmp;
use common::Spoold;
use serde_json::json;

/// One guest process: QEMU, its QMP connection, where its console goes and the file its
/// RAM lives in.
struct Vm {
    child: Child,
    qmp: Qmp,
    console: PathBuf,
    stderr: PathBuf,
    ram: PathBuf,
}

impl Vm {
    /// Starts QEMU on `sock` running the verifying `killtest` job for `runtime` s, its RAM in
    /// a shared file under /dev/shm; with `incoming`, as a migration's destination listening
    /// there, paused once the migration is in (`-S`) so that its RAM can be checked first.
    fn start(sock: &Path, dir: &Path, tag: &str, runtime: u64, incoming: Option<&Path>) -> Vm {
        let console = dir.join(format!("{tag}.console"));
        let stderr = dir.join(format!("{tag}.stderr"));
        let qmp = dir.join(format!("{tag}.qmp"));
        let ram = ram_file(tag);
        let memory = format!(
            "memory-backend-file,id=mem,size=512M,mem-path={},share=on",
            ram.display()
        );
        let tcg = std::env::var("SPOOL_MIGRATION_TCG").unwrap_or_else(|_| "single".into());
        let mut c = match std::env::var("SPOOL_SOAK_FILE") {
            Ok(f) => soak_file_guest(&f, runtime, &tcg, &memory),
            Err(_) => qemu_tcg_on(
                sock,
                "killtest",
                2,
                &format!("spool.runtime={runtime}"),
                runtime + 400,
                &tcg,
                &memory,
            ),
        };
        c.args([
            "-qmp",
            &format!("unix:{},server=on,wait=off", qmp.display()),
        ]);
        if let Some(i) = incoming {
            c.args(["-S", "-incoming", &format!("unix:{}", i.display())]);
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
            ram,
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

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.ram);
    }
}

/// One test of this file at a time (cargo runs a file's tests on parallel threads): two TCG
/// guests on a 2-core machine would each run at half speed, and their tags (so their RAM
/// files, consoles and write maps) are the same.
static ONE_GUEST: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds [`ONE_GUEST`] (a test that failed holding it does not fail the next one).
fn one_guest_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_GUEST.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where guest `tag`'s RAM lives (tmpfs: the page check reads 2 × 512 MiB per migration).
fn ram_file(tag: &str) -> PathBuf {
    PathBuf::from(format!(
        "/dev/shm/spool-migration-{}-{tag}.ram",
        std::process::id()
    ))
}

/// The file a spoold marks every guest page it writes in (`[debug] write_witness`), zeroed;
/// removed when dropped.
struct WriteMap(PathBuf);

impl std::ops::Deref for WriteMap {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for WriteMap {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A spoold on config `cfg` (ending in a newline) that records the pages it writes in `map`.
fn witnessed(cfg: &str, map: &WriteMap) -> Spoold {
    Spoold::start(&format!(
        "{cfg}[debug]\nwrite_witness = \"{}\"\n",
        map.display()
    ))
}

fn write_map(name: &str) -> WriteMap {
    let p = PathBuf::from(format!(
        "/dev/shm/spool-migration-{}-{name}.map",
        std::process::id()
    ));
    std::fs::write(&p, vec![0u8; WRITE_MAP_SIZE]).unwrap();
    WriteMap(p)
}

/// Bytes of a write map (spool_frontend::witness::SIZE: a u64 per page of 4 GiB).
const WRITE_MAP_SIZE: usize = 8 << 20;

/// Clears a write map in place (spoold has it mapped: the file must keep its size).
fn clear_write_map(p: &Path) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    f.write_all_at(&vec![0u8; WRITE_MAP_SIZE], 0).unwrap();
}

/// What the page check found: guest-physical addresses of the pages whose contents differ
/// between the source's RAM and the destination's before the destination ran (with the
/// number of differing bytes); of those, the pages whose source content is still what the
/// source's spoold last wrote there (its write was not carried: `spoold_wrote`), and the
/// pages spoold wrote during the migration that the guest wrote again since (`rewritten`).
struct PageCheck {
    differing: Vec<(u64, usize)>,
    spoold_wrote: Vec<u64>,
    rewritten: Vec<u64>,
    /// Pages the witness recorded at all (0 without one).
    witnessed: usize,
}

/// Compares two RAM files page by page (the memdev holds guest-physical 0..512M: with
/// `-m 512M` on q35 all of it is low memory, file offset = guest address).
fn page_check(src: &Path, dst: &Path, map: Option<&Path>) -> PageCheck {
    use std::io::Read;
    const PAGE: usize = 4096;
    let written = map.map(|m| std::fs::read(m).unwrap()).unwrap_or_default();
    // The witness: per page, 0 or `1 << 32 | crc32c` of what spoold last wrote there.
    let witness = |page: usize| {
        written
            .get(page * 8..page * 8 + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
            .unwrap_or(0)
    };
    let (mut a, mut b) = (
        std::fs::File::open(src).unwrap(),
        std::fs::File::open(dst).unwrap(),
    );
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut check = PageCheck {
        differing: Vec::new(),
        spoold_wrote: Vec::new(),
        rewritten: Vec::new(),
        witnessed: written
            .chunks(8)
            .filter(|c| c.iter().any(|&b| b != 0))
            .count(),
    };
    let mut at = 0usize;
    loop {
        let n = a.read(&mut ba).unwrap();
        if n == 0 {
            break;
        }
        b.read_exact(&mut bb[..n]).unwrap();
        for (i, (pa, pb)) in ba[..n].chunks(PAGE).zip(bb[..n].chunks(PAGE)).enumerate() {
            if pa != pb {
                let page = at / PAGE + i;
                let bytes = pa.iter().zip(pb).filter(|(x, y)| x != y).count();
                let gpa = (page * PAGE) as u64;
                check.differing.push((gpa, bytes));
                match witness(page) {
                    0 => {}
                    w if w == 1 << 32 | crc32c::crc32c(pa) as u64 => check.spoold_wrote.push(gpa),
                    _ => check.rewritten.push(gpa),
                }
            }
        }
        at += n;
    }
    check
}

/// A QMP query to the destination QEMU; one that is gone fails the test with its console and
/// stderr.
fn ask_destination(dst: &mut Vm, tag: &str, query: &str) -> serde_json::Value {
    dst.qmp.execute(query, json!({})).unwrap_or_else(|e| {
        panic!(
            "{tag}: the destination QEMU is gone ({e}; {:?}): {}\n--- its stderr ---\n{}",
            dst.child.try_wait(),
            dst.console(),
            std::fs::read_to_string(&dst.stderr).unwrap_or_default()
        )
    })
}

/// Waits until the paused destination has taken the whole migration in.
fn wait_incoming(dst: &mut Vm, tag: &str) {
    let t = Instant::now();
    loop {
        let info = ask_destination(dst, tag, "query-migrate");
        match info["status"].as_str() {
            Some("completed") => return,
            Some("failed") => panic!("{tag}: incoming migration {info}"),
            _ => {}
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{tag}: the destination did not take the migration in: {info}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What the test knows of the migration's source spoold, and does to it.
#[derive(Clone, Copy, Default)]
struct Source<'a> {
    /// Its write map (`[debug] write_witness`): the pages it wrote during the migration.
    map: Option<&'a Path>,
    /// Done to it once while the migration copies RAM (the dirty log on, the rings running):
    /// a worker kill or an upgrade.
    disturb: Option<&'a dyn Fn()>,
    /// Its log, for a failure's report.
    spoold: Option<&'a Spoold>,
}

/// Migrations rolled back because the destination's RAM differed from the source's in pages
/// the source's spoold did not write (QEMU's own dirty tracking lost them; see `migrate`).
static ROLLED_BACK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Most attempts at one migration before the test gives up on QEMU's dirty tracking (three
/// lossy attempts in a row were seen right after a worker kill during the copy; docs/ceph.md).
const MIGRATION_ATTEMPTS: usize = 8;
/// How long the source runs again after a rollback before the next attempt.
const RETRY_PAUSE: Duration = Duration::from_secs(2);

/// Migrates `src` to a new QEMU on `dst_sock`; returns the destination and the downtime
/// QEMU reports (ms). With `source.disturb`, the copy runs at 64 MiB/s until it is done,
/// then at full speed. Before the destination runs, its RAM is compared with the source's
/// page by page: a differing page is a write that the migration did not carry. One that the
/// source's spoold wrote fails the test at once: spoold's dirty log missed it. Differing
/// pages that spoold did not write are the guest's own writes that QEMU's TCG dirty
/// tracking lost (seen only after spoold's worker restarted during or just before the copy,
/// never in the control without spoold; why is open: docs/ceph.md); the destination
/// would run a corrupt kernel, so the migration is rolled back as an operator would (the
/// destination quit unrun, the source continued) and tried again, and the test says so.
fn migrate(
    src: &mut Vm,
    dst_sock: &Path,
    dir: &Path,
    tag: &str,
    runtime: u64,
    source: Source<'_>,
) -> (Vm, f64) {
    let mut source = source;
    for attempt in 0..MIGRATION_ATTEMPTS {
        let name = if attempt == 0 {
            tag.to_string()
        } else {
            format!("{tag}-again{attempt}")
        };
        match migrate_once(src, dst_sock, dir, &name, runtime, source) {
            Ok(done) => return done,
            Err(pages) => {
                ROLLED_BACK.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                eprintln!(
                    "{name}: rolled back ({pages} page(s) QEMU did not carry); migrating again"
                );
                source.disturb = None;
                std::thread::sleep(RETRY_PAUSE);
            }
        }
    }
    panic!("{tag}: {MIGRATION_ATTEMPTS} attempts, each lost pages the guest wrote");
}

/// One attempt of [`migrate`]: the migrated destination, or (rolled back) how many pages
/// differed.
fn migrate_once(
    src: &mut Vm,
    dst_sock: &Path,
    dir: &Path,
    tag: &str,
    runtime: u64,
    source: Source<'_>,
) -> Result<(Vm, f64), usize> {
    let src_map = source.map;
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
    let bandwidth = |vm: &mut Vm, bytes: u64| {
        vm.qmp
            .execute(
                "migrate-set-parameters",
                json!({ "max-bandwidth": bytes, "downtime-limit": 500 }),
            )
            .unwrap();
    };
    let slow = source.disturb.is_some();
    bandwidth(src, if slow { 64 << 20 } else { 4 << 30 });
    if let Some(m) = src_map {
        clear_write_map(m);
    }
    src.qmp
        .execute(
            "migrate",
            json!({ "uri": format!("unix:{}", incoming.display()) }),
        )
        .unwrap_or_else(|e| panic!("{tag}: migrate refused: {e}"));
    let t = Instant::now();
    let mut disturb = source.disturb;
    let info = loop {
        let info = src.qmp.execute("query-migrate", json!({})).unwrap();
        if info["status"] == json!("active") && t.elapsed() > Duration::from_millis(500) {
            if let Some(d) = disturb.take() {
                let sent = info["ram"]["transferred"].as_u64().unwrap_or(0) >> 20;
                d();
                eprintln!("{tag}: disturbed the source's spoold after {sent} MiB of RAM sent");
                bandwidth(src, 4 << 30);
            }
        }
        match info["status"].as_str() {
            // A source that was itself a destination reports its incoming migration's
            // "completed" (without RAM statistics) until this one has connected.
            Some("completed") if info.get("ram").is_some() => {
                assert!(
                    disturb.is_none(),
                    "{tag}: the migration completed before the source could be disturbed"
                );
                break info;
            }
            Some("failed") | Some("cancelled") => panic!("{tag}: migration {info}"),
            _ => {}
        }
        assert!(
            t.elapsed() < Duration::from_secs(240),
            "{tag}: migration did not complete: {info}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    wait_incoming(&mut dst, tag);
    let check = page_check(&src.ram, &dst.ram, src_map);
    eprintln!(
        "{tag}: page check: {} page(s) differ; {} hold what the source's spoold wrote, {} spoold wrote and the guest since; the witness recorded {} page(s) spoold wrote",
        check.differing.len(),
        check.spoold_wrote.len(),
        check.rewritten.len(),
        check.witnessed
    );
    // The guest's fio runs through every migration: a witness that recorded nothing could not
    // tell spoold's lost writes from QEMU's.
    assert!(
        src_map.is_none() || check.witnessed > 0,
        "{tag}: the source's write witness recorded no page"
    );
    if !check.differing.is_empty() {
        let report = page_report(&src.ram, &dst.ram, &check);
        if !check.spoold_wrote.is_empty() {
            panic!(
                "{tag}: the destination's RAM differs from the source's before it ran: {} page(s), {} of them still holding what the source's spoold wrote (its write was not carried)\n{report}\n--- the source's spoold ---\n{}",
                check.differing.len(),
                check.spoold_wrote.len(),
                source.spoold.map(|d| d.log()).unwrap_or_default()
            );
        }
        eprintln!("{tag}: the destination's RAM differs from the source's in pages spoold did not write:\n{report}");
        roll_back(src, dst, tag);
        return Err(check.differing.len());
    }
    dst.qmp.execute("cont", json!({})).unwrap();
    let t = Instant::now();
    loop {
        let st = ask_destination(&mut dst, tag, "query-status");
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
    Ok((dst, downtime))
}

/// Lists the differing pages (at most 16), with the first differing bytes of each.
fn page_report(src: &Path, dst: &Path, check: &PageCheck) -> String {
    use std::os::unix::fs::FileExt;
    let (a, b) = (
        std::fs::File::open(src).unwrap(),
        std::fs::File::open(dst).unwrap(),
    );
    let mut out = Vec::new();
    for &(gpa, n) in check.differing.iter().take(16) {
        let (mut pa, mut pb) = ([0u8; 4096], [0u8; 4096]);
        a.read_exact_at(&mut pa, gpa).unwrap();
        b.read_exact_at(&mut pb, gpa).unwrap();
        let bytes: Vec<String> = (0..4096)
            .filter(|&i| pa[i] != pb[i])
            .take(6)
            .map(|i| format!("+{i:#x} {:02x}->{:02x}", pb[i], pa[i]))
            .collect();
        let who = if check.spoold_wrote.contains(&gpa) {
            "holds what spoold wrote"
        } else if check.rewritten.contains(&gpa) {
            "spoold wrote it, the guest since"
        } else {
            "only the guest wrote it"
        };
        out.push(format!(
            "  gpa {gpa:#x}: {n} byte(s) differ ({who}; destination->source: {})",
            bytes.join(", ")
        ));
    }
    out.join("\n")
}

/// Rolls a completed migration back before its destination ran: the destination quits, the
/// source continues (its rings restart at the bases it got).
fn roll_back(src: &mut Vm, mut dst: Vm, tag: &str) {
    let _ = dst.qmp.execute("quit", json!({}));
    let _ = dst.child.wait();
    src.qmp
        .execute("cont", json!({}))
        .unwrap_or_else(|e| panic!("{tag}: the source cannot continue after a rollback: {e}"));
    let t = Instant::now();
    while src.qmp.execute("query-status", json!({})).unwrap()["status"] != json!("running") {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{tag}: the source does not run again"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
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
            panic!(
                "{tag}: the guest's writes stopped after it resumed ({w0} -> {w})\n{}\n--- vCPUs ---\n{}\n--- spoold ---\n{}",
                all_consoles(vm),
                vcpus(vm),
                d.log()
            );
        }
    }
}

/// A human monitor command's answer (empty when QEMU does not answer).
fn hmp(vm: &mut Vm, cmd: &str) -> String {
    vm.qmp
        .execute("human-monitor-command", json!({ "command-line": cmd }))
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// Where the guest's vCPUs are: each one's instruction pointer and flags.
fn vcpus(vm: &mut Vm) -> String {
    let regs = hmp(vm, "info registers -a");
    let lines: Vec<&str> = regs
        .lines()
        .filter(|l| ["CPU", "RIP", "EFL"].iter().any(|k| l.starts_with(k)))
        .collect();
    lines.join("\n")
}

/// Waits for the guest to end its job and power off: its exit status, and what was seen if
/// its writes stopped for [`HUNG_AFTER`] before its job ended (QEMU is killed then, rather
/// than left to its own time limit, minutes later): the vCPUs, the rings as QEMU sees them
/// and what `d`, serving it, holds in flight.
fn wait_guest_end(vm: &mut Vm, d: &Spoold) -> (String, Option<String>) {
    let (mut last, mut since) = (None, Instant::now());
    loop {
        if let Some(st) = vm.child.try_wait().unwrap() {
            return (st.to_string(), None);
        }
        std::thread::sleep(Duration::from_secs(1));
        if vm.console().contains("SPOOL-E2E: fio errors") {
            continue;
        }
        let w = guest_writes(vm, d, false);
        if w != last {
            (last, since) = (w, Instant::now());
            continue;
        }
        if since.elapsed() < HUNG_AFTER {
            continue;
        }
        let regs = vcpus(vm);
        let mut rings = String::new();
        let devices = hmp(vm, "info virtio");
        for path in devices.lines().filter_map(|l| l.split_whitespace().next()) {
            if path.starts_with('/') {
                for q in 0..2 {
                    rings += &hmp(vm, &format!("info virtio-queue-status {path} {q}"));
                }
            }
        }
        let stats = d
            .rpc("volume_stats", json!({"id": "vm"}))
            .map(|s| s.to_string())
            .unwrap_or_default();
        let _ = vm.child.kill();
        let st = vm.child.wait().unwrap();
        return (
            format!("{st}, killed: no write for {} s", HUNG_AFTER.as_secs()),
            Some(format!(
                "--- vCPUs ---\n{regs}\n--- rings (QEMU) ---\n{rings}\n--- volume_stats ---\n{stats}"
            )),
        );
    }
}

/// A request lost by whoever served a ring before a fresh start leaves the guest waiting
/// for it; the spoold that starts the ring says so (docs/failures.md): fails naming where.
fn assert_no_lost_requests(logs: &[(&str, &String)]) {
    for (name, log) in logs {
        let lost: Vec<&str> = log
            .lines()
            .filter(|l| {
                l.contains("never completed by the backend")
                    || l.contains("base and the used index")
            })
            .collect();
        assert!(
            lost.is_empty(),
            "{name} started a ring whose base counts requests never completed:\n{}",
            lost.join("\n")
        );
    }
}

/// How long a running guest job may go without a write before the test calls it hung.
const HUNG_AFTER: Duration = Duration::from_secs(90);

/// Migration `m` of a run: the guest moves to `to`, then must go on writing. Returns QEMU's
/// downtime (ms) and the writes seen after it resumed.
fn hop(
    vm: &mut Vm,
    to: &Spoold,
    dir: &Path,
    m: usize,
    runtime: u64,
    file: bool,
    source: Source<'_>,
) -> (f64, u64) {
    let tag = format!("vm{}", m + 1);
    let (next, downtime) = migrate(vm, &to.socket("vm"), dir, &tag, runtime, source);
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
#[ignore = "needs QEMU, the test guest and Ceph: scripts/test.sh runs it (cargo test -- --include-ignored)"]
fn a_vm_on_rbd_survives_kills_upgrades_an_osd_restart_and_live_migrations() {
    let _one = one_guest_at_a_time();
    let cluster = CephCluster::start("migrate");
    let rounds = count("SPOOL_RBD_ROUNDS", 10);
    let migrations = count("SPOOL_MIGRATIONS", 3);
    let base = format!(
        "[io]\npoll_idle_us = 20\n[ceph]\nconf = \"{}\"\nclaim_wait_ms = 5000\n\
         [[devices]]\npath = \"@DIR@/d0.img\"\ncreate_size = \"64M\"\n",
        cluster.conf.display()
    );
    let (map_a, map_b) = (write_map("A"), write_map("B"));
    let a = witnessed(
        &format!(
            "{base}[[volumes]]\nname = \"vm\"\nsize = \"96M\"\nnum_queues = 2\nrbd = \"rbd\"\n"
        ),
        &map_a,
    );
    let b = witnessed(
        &format!("{base}[[volumes]]\nname = \"vm\"\nnum_queues = 2\nrbd = \"rbd/vm\"\n"),
        &map_b,
    );
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
        let (to, uuid, from, from_map) = if m % 2 == 0 {
            (&b, &ub, &a, &map_a)
        } else {
            (&a, &ua, &b, &map_b)
        };
        // The second migration kills the source's worker while RAM is copied, the third
        // upgrades it: the restarted worker keeps the dirty log and marks what it writes.
        // SPOOL_MIGRATION_NOOP_DISTURB=1 (the experiment of docs/ceph.md): the same slow copy
        // and bandwidth change, without touching spoold.
        let noop = std::env::var_os("SPOOL_MIGRATION_NOOP_DISTURB").is_some();
        let kill = || {
            if !noop {
                from.kill_worker();
            }
        };
        let upgrade = || {
            if noop {
                return;
            }
            let r = from.upgrade(None).expect("upgrade during a migration");
            assert_eq!(r["outcome"], json!("ok"), "{r}");
        };
        let disturb: Option<&dyn Fn()> = match m % 3 {
            1 => Some(&kill),
            2 => Some(&upgrade),
            _ => None,
        };
        let source = Source {
            map: Some(&**from_map),
            disturb,
            spoold: Some(from),
        };
        let (downtime, _) = hop(&mut vm, to, &dir, m, runtime, false, source);
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

    let serving = if migrations % 2 == 1 { &b } else { &a };
    let (status, hang) = wait_guest_end(&mut vm, serving);
    let console = vm.console();
    eprintln!(
        "rbd guest: qemu {status}; kill stalls {kills:?} ms; upgrade stalls {upgrades:?} ms; \
         migration downtimes {downtimes:?} ms; migrations rolled back for pages QEMU lost: {}",
        ROLLED_BACK.load(std::sync::atomic::Ordering::Relaxed)
    );
    let (la, lb) = (a.log(), b.log());
    if let Ok(d) = std::env::var("SPOOL_MIGRATION_LOGS") {
        let _ = std::fs::write(format!("{d}/A.log"), &la);
        let _ = std::fs::write(format!("{d}/B.log"), &lb);
    }
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
    assert_no_lost_requests(&[("A", &la), ("B", &lb)]);
    if !console.contains("SPOOL-E2E: PASS") {
        // The whole story first, then the spoolds gone (their drop prints nothing when not
        // panicking), so that the report's last lines, all a CI summary keeps, are the
        // guest's own.
        eprintln!(
            "--- A ---\n{la}\n--- B ---\n{lb}\n--- every console ---\n{}",
            all_consoles(&vm)
        );
        drop((a, b));
        let tail: Vec<&str> = console.lines().rev().take(40).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        panic!(
            "guest failed after migrating ({status}); its console's last lines:\n{}\n{}",
            tail.join("\n"),
            hang.unwrap_or_default()
        );
    }
    assert_pass(&console, &a, "killtest");
}

/// The same guest on QEMU's own virtio-blk over a raw file (no spoold): the soak's control.
fn soak_file_guest(file: &str, runtime: u64, tcg: &str, memory: &str) -> std::process::Command {
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
        .args(["-object", memory])
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
#[ignore = "a soak, run by hand: SPOOL_MIGRATION_SOAK=N cargo test --test migration migration_soak -- --ignored"]
fn migration_soak() {
    let _one = one_guest_at_a_time();
    let n = std::env::var("SPOOL_MIGRATION_SOAK")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .expect("set SPOOL_MIGRATION_SOAK=N: how many migrations");
    let file = std::env::var("SPOOL_SOAK_FILE").ok();
    let cluster = if file.is_none() {
        Some(CephCluster::start("soak"))
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
    let (map_a, map_b) = (write_map("A"), write_map("B"));
    let a = witnessed(&vols.0, &map_a);
    let b = witnessed(&vols.1, &map_b);
    if let Some(f) = &file {
        std::fs::File::create(f).unwrap().set_len(96 << 20).unwrap();
    }
    let dir = a.dir.path().to_path_buf();
    let runtime = 60 + 30 * n as u64;
    let mut vm = boot(&a, &b, runtime);
    std::thread::sleep(Duration::from_secs(3));
    for m in 0..n {
        let (to, from, from_map) = if m % 2 == 0 {
            (&b, &a, &map_a)
        } else {
            (&a, &b, &map_b)
        };
        let source = Source {
            map: file.is_none().then_some(&**from_map),
            disturb: None,
            spoold: file.is_none().then_some(from),
        };
        let (downtime, w) = hop(&mut vm, to, &dir, m, runtime, file.is_some(), source);
        eprintln!("soak {m}: downtime {downtime} ms, then {w} writes");
    }
    eprintln!(
        "soak: {n} migrations, the guest kept writing after each; rolled back for pages QEMU lost: {}",
        ROLLED_BACK.load(std::sync::atomic::Ordering::Relaxed)
    );
    let _ = vm.qmp.execute("quit", json!({}));
}

/// `volume_send`'s state on `d` for volume "vm".
fn send_state(d: &Spoold) -> serde_json::Value {
    d.rpc("volume_send", json!({"id": "vm"}))
        .unwrap_or_else(|e| panic!("volume_send: {e:?}\n{}", d.log()))
}

/// A VM on a local volume moves to another spoold with its data (docs/transfer.md): A sends
/// the volume to B's `volume receive` export (TCP) while the guest runs its verifying job,
/// through a worker kill on A, one on B, and a cut of the link between them (B running on),
/// until B's copy is current; then
/// QEMU's live migration, checked page by page, moves the guest to B, whose first queue start
/// ends the transfer; the guest's job goes on and verifies on B what it wrote on A, and
/// `--finish` deletes A's copy.
#[test]
#[ignore = "needs QEMU and the test guest: scripts/test.sh runs it (cargo test -- --include-ignored)"]
fn a_vm_moves_with_its_local_volume_to_another_spoold() {
    let _one = one_guest_at_a_time();
    let config = |rate: &str| {
        format!(
            // The harness's config ends in its [pool] table: the rate goes there.
            "resync_rate = \"{rate}\"\n[io]\npoll_idle_us = 20\n\
             [[devices]]\npath = \"@DIR@/d0.img\"\ncreate_size = \"160M\"\n\
             [[volumes]]\nname = \"vm\"\nsize = \"96M\"\nnum_queues = 2\n"
        )
    };
    let map_a = write_map("local-A");
    // The copy at 16 MiB/s: 6 s for the 96 MiB, long enough for both kills to land in it.
    let a = witnessed(&config("16M"), &map_a);
    let b = Spoold::start(&config("64M"));
    // B receives on TCP; A reaches it through a link the test can cut.
    let receive = b
        .rpc("volume_receive", json!({"id": "vm", "nbd": "127.0.0.1:0"}))
        .unwrap();
    let link = Link::start(receive["nbd"].as_str().unwrap().parse().unwrap());
    let uri = format!("nbd://127.0.0.1:{}/vm", link.port);
    let dir = a.dir.path().to_path_buf();
    // The copy takes about 10 s and the migration 3: the job goes on for 25 s more on B.
    let runtime = 40;
    let mut vm = boot(&a, &b, runtime);

    let t0 = Instant::now();
    a.rpc("volume_send", json!({"id": "vm", "to": uri}))
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    a.kill_worker();
    let t = Instant::now();
    while !a.log().contains("remote leg connected") {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "A's new worker never connected the leg"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let left = send_state(&a)["remaining_bytes"].as_u64().unwrap_or(0);
    b.kill_worker();
    // Once connected again, the link is cut for a second and a half (B keeps running): A's
    // leg drops out and connects again when the link is back.
    let connected = |n| {
        let t = Instant::now();
        while a.log().matches("remote leg connected").count() < n {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the leg never connected again\n{}",
                a.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    connected(2);
    link.cut(Duration::from_millis(1500));
    connected(3);
    let copied = loop {
        let s = send_state(&a);
        if s["state"] == json!("current") {
            break t0.elapsed();
        }
        vm.assert_running("copy", &a, &b);
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the copy never became current: {s}\n--- A ---\n{}\n--- B ---\n{}",
            a.log(),
            b.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let reconnects = a.log().matches("remote leg connected").count();
    assert!(
        reconnects >= 3,
        "the leg was connected {reconnects} times\n{}",
        a.log()
    );

    let source = Source {
        map: Some(&map_a),
        disturb: None,
        spoold: Some(&a),
    };
    let (downtime, writes) = hop(&mut vm, &b, &dir, 0, runtime, false, source);
    let lb = b.log();
    assert!(
        lb.contains("a frontend started the volume"),
        "B's first queue start did not end the transfer:\n{lb}"
    );
    // The VM has left A: A's copy goes (its frontend gone once QEMU quit).
    let t = Instant::now();
    let finished = loop {
        match a.rpc("volume_send", json!({"id": "vm", "finish": true})) {
            Ok(r) => break r,
            Err(e) if t.elapsed() < Duration::from_secs(10) => {
                eprintln!("finish: {e:?}; again");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("volume send --finish: {e:?}\n{}", a.log()),
        }
    };
    assert_eq!(finished["state"], json!("finished"), "{finished}");
    b.rpc("volume_receive_stop", json!({"id": "vm"})).unwrap();

    let (status, hang) = wait_guest_end(&mut vm, &b);
    let console = vm.console();
    eprintln!(
        "local volume moved: copy current after {:.1} s ({} MiB left when B's worker was killed), \
         a kill on each side and a 1.5 s link cut; downtime {downtime} ms, {writes} writes on B right after; qemu {status}; \
         migrations rolled back for pages QEMU lost: {}",
        copied.as_secs_f64(),
        left >> 20,
        ROLLED_BACK.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_no_lost_requests(&[("A", &a.log()), ("B", &b.log())]);
    if !console.contains("SPOOL-E2E: PASS") {
        eprintln!(
            "--- A ---\n{}\n--- B ---\n{}\n--- every console ---\n{}",
            a.log(),
            b.log(),
            all_consoles(&vm)
        );
        panic!(
            "guest failed after moving ({status}):\n{}",
            hang.unwrap_or_default()
        );
    }
    assert_pass(&console, &b, "killtest");
}
