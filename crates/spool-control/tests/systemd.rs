//! spoold under a real systemd (a private `systemd --user`, common/systemd.rs), run from the
//! shipped unit contrib/spoold.service: `Type=notify` readiness and status, the keeper's
//! descriptors in systemd's file-descriptor store, and a real guest that keeps its vhost-user
//! connection and its data while the keeper itself is SIGKILLed, wedged (watchdog) and
//! reloaded. `#[ignore]`d like the other guest tests (scripts/test.sh runs them).

mod common;

use std::time::{Duration, Instant};

use common::guest::{assert_pass, start_killtest, KILLTEST_CONFIG};
use common::systemd::UserManager;
use common::Spoold;

const UNIT: &str = "spoold-test.service";

/// The shipped unit, with this test's binary, config and log, a short watchdog, no core
/// dumps of the watchdog's SIGABRT, and room for more restarts a minute than a real keeper
/// should ever need.
fn unit_text(d: &Spoold) -> String {
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../contrib/spoold.service"
    ))
    .unwrap();
    let mut out = String::new();
    for line in shipped.lines() {
        if line.starts_with("ExecStart=") {
            out += &format!(
                "ExecStart={} --config {} --log-level info\n",
                env!("CARGO_BIN_EXE_spoold"),
                d.config.display()
            );
        } else if line.starts_with("WatchdogSec=") {
            out += "WatchdogSec=2\nLimitCORE=0\n";
        } else if line.starts_with("StartLimitBurst=") {
            // This test restarts the keeper a dozen times in under a minute on purpose.
            out += "StartLimitBurst=30\n";
        } else {
            out += line;
            out += "\n";
        }
        if line == "[Service]" {
            out += &format!("StandardError=append:{}\n", d.log_path().display());
        }
    }
    assert!(
        out.contains("Type=notify")
            && out.contains("FileDescriptorStoreMax=")
            && out.contains("StartLimitBurst=30")
    );
    out
}

/// Waits until the unit runs a keeper other than `old` whose worker answers RPCs; returns
/// the new keeper's pid and the daemon's status.
fn wait_new_keeper(m: &UserManager, d: &Spoold, old: u32) -> (u32, serde_json::Value) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pid = m.main_pid(UNIT);
        if pid != 0 && pid != old {
            let s = d.status();
            if s["keeper"]["pid"].as_u64() == Some(pid as u64) && !s["last_restart"].is_null() {
                return (pid, s);
            }
        }
        assert!(
            Instant::now() < deadline,
            "systemd did not restart spoold: {}\n{}",
            m.systemctl(&["status", UNIT]).1,
            d.log()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The keeper is SIGKILLed N times (its worker dies with it), wedged once (SIGSTOP: the
/// watchdog fires) and reloaded once (`systemctl reload`: a graceful upgrade) under a guest's
/// verifying fio load. systemd restarts spoold each time and hands the descriptors back:
/// QEMU never reconnects and fio sees no error.
#[test]
#[ignore = "needs QEMU and the test guest: scripts/test.sh runs it (cargo test -- --include-ignored)"]
fn keeper_death_under_systemd_keeps_every_vm_connection() {
    let kills: usize = std::env::var("SPOOL_SYSTEMD_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let mut m = UserManager::start();
    let d = Spoold::prepared(KILLTEST_CONFIG);
    m.install(UNIT, &unit_text(&d));
    // Type=notify: `start` returns once the keeper said READY=1 (the worker serves).
    let (ok, out) = m.systemctl(&["start", UNIT]);
    assert!(ok, "start: {out}\n{}\n{}", m.log(), d.log());
    assert_eq!(m.show(UNIT, "ActiveState"), "active");
    assert!(
        m.show(UNIT, "StatusText").starts_with("serving"),
        "{}",
        m.show(UNIT, "StatusText")
    );
    let console = d.dir.path().join("systemd.console");
    let runtime = 20 + kills as u64 * 2;
    let mut vm = start_killtest(&d.socket("vm"), runtime as u64, &console);
    let read_console = || std::fs::read_to_string(&console).unwrap_or_default();
    let (mut walls, mut reported) = (Vec::new(), Vec::new());
    let mut keeper = m.main_pid(UNIT);
    for k in 0..kills {
        std::thread::sleep(Duration::from_millis(1500));
        assert!(
            vm.try_wait().unwrap().is_none(),
            "kill {k}: guest exited early: {}",
            read_console()
        );
        let t0 = Instant::now();
        // SAFETY: kill(2) takes no pointers.
        unsafe { libc::kill(keeper as i32, libc::SIGKILL) };
        let (pid, s) = wait_new_keeper(&m, &d, keeper);
        walls.push(t0.elapsed().as_secs_f64() * 1e3);
        assert_eq!(s["last_restart"]["kind"], "keeper-restart", "{s}");
        reported.push(s["last_restart"]["stall_ms"].as_f64().unwrap());
        keeper = pid;
    }
    // A wedged keeper: the watchdog (2 s here) fires, systemd kills and restarts it.
    // SAFETY: kill(2) takes no pointers.
    unsafe { libc::kill(keeper as i32, libc::SIGSTOP) };
    let t0 = Instant::now();
    let (pid, _) = wait_new_keeper(&m, &d, keeper);
    let watchdog_s = t0.elapsed().as_secs_f64();
    keeper = pid;
    // `systemctl reload`: a graceful upgrade, reported through RELOADING=1 / READY=1.
    std::thread::sleep(Duration::from_millis(1500));
    let (ok, out) = m.systemctl(&["reload", UNIT]);
    assert!(ok, "reload: {out}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while d.status()["last_restart"]["kind"] != "upgrade" {
        assert!(
            Instant::now() < deadline,
            "reload did not upgrade: {}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(m.main_pid(UNIT), keeper, "a reload keeps the keeper");
    let status = vm.wait().unwrap();
    let log = d.log();
    eprintln!(
        "systemd test: qemu {status}; {kills} keeper SIGKILLs: kill → new worker answering, median {:.1} ms, p90 {:.1} ms, max {:.1} ms (spoold's own restart report: median {:.1} ms, max {:.1} ms); wedged keeper restarted by the watchdog after {watchdog_s:.1} s; NRestarts {}",
        pct(&mut walls, 0.5),
        pct(&mut walls, 0.9),
        pct(&mut walls, 1.0),
        pct(&mut reported, 0.5),
        pct(&mut reported, 1.0),
        m.show(UNIT, "NRestarts"),
    );
    assert_pass(&read_console(), &d, "killtest");
    assert_eq!(
        log.matches("frontend connected").count(),
        1,
        "QEMU reconnected: a keeper restart dropped the connection\n{log}"
    );
    assert!(
        log.matches("taking the kept connections back from its descriptor store")
            .count()
            > kills,
        "not every keeper restart took the descriptors back:\n{log}"
    );
    // Every kill and the wedge restarted the unit; a keeper that a loaded host kept from
    // pinging the watchdog for 2 s may have added a restart of its own (which the checks
    // above show cost the guest nothing).
    let restarts: usize = m.show(UNIT, "NRestarts").parse().unwrap();
    assert!(
        restarts > kills,
        "NRestarts {restarts} after {kills} kills and a wedge"
    );
    let (ok, out) = m.systemctl(&["stop", UNIT]);
    assert!(ok, "stop: {out}");
    assert_eq!(m.show(UNIT, "Result"), "success", "{}", d.log());
}
