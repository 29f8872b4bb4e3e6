//! A stopped queue answers for every request it took (docs/failures.md, "Stopping a queue").
//! QEMU stops a ring with SET_VRING_ENABLE 0 and GET_VRING_BASE at the end of every
//! migration, at `stop`, at savevm and before a vhost restart, and carries the base it gets
//! to the destination (or to `cont`): a request below that base that is not in the used ring
//! is one the guest waits for for ever. Driven through the real socket with a hand-built
//! frontend (`common::raw`) on a file device whose faults spoold's own injection layer
//! makes: a stop while the device resets waits for the held request and completes it; a stop
//! past the drain window fails it with an I/O error; either way the base equals the used
//! index, and a fresh connection after it replays nothing from the journal.

mod common;

use std::time::{Duration, Instant};

use common::raw::{GuestMem, RawFrontend, Ring, GET_VRING_BASE, SET_VRING_ENABLE, T_IN, T_OUT};
use common::Spoold;
use serde_json::{json, Value};

const CFG: &str = r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[volumes]]
name = "vm"
size = "8M"
num_queues = 1
[health]
io_timeout_ms = 400
poll_interval_ms = 50
reset_timeout_ms = 30000
"#;

const OK: u8 = 0;
const IOERR: u8 = 1;

fn device(s: &Spoold) -> String {
    let v = s.rpc("volume_show", json!({"id": "vm"})).unwrap();
    v["devices"][0].as_str().unwrap().to_string()
}

fn inject(s: &Spoold, rule: Value) {
    let mut p = rule;
    p["id"] = json!(device(s));
    s.rpc("device_inject", p).unwrap();
}

/// Waits until the injected rule was hit (its hit count is up, or it is spent and gone):
/// the request it holds is in the device now.
fn wait_hit(s: &Spoold) {
    common::wait_fault_hit(s, &device(s));
}

fn state(s: &Spoold) -> String {
    let h = s.rpc("device_health", json!({"id": device(s)})).unwrap();
    let h = if h.is_array() { h[0].clone() } else { h };
    h["state"].as_str().unwrap().to_string()
}

/// Stops ring 0 as QEMU does; returns the base and how long spoold took to answer.
fn stop_ring(fe: &mut RawFrontend) -> (u16, Duration) {
    let t = Instant::now();
    let mut p = 0u32.to_le_bytes().to_vec();
    p.extend_from_slice(&0u32.to_le_bytes());
    fe.send(SET_VRING_ENABLE, &p, &[]).unwrap();
    let v = fe.ask(GET_VRING_BASE, &p).unwrap();
    ((v >> 32) as u16, t.elapsed())
}

/// One running session on a fresh spoold, ring 0 enabled.
fn start() -> (Spoold, GuestMem, Ring, RawFrontend) {
    let s = Spoold::start(CFG);
    let mem = GuestMem::new(1 << 20);
    let ring = Ring::new(16);
    let mut fe = RawFrontend::connect(&s.socket("vm"));
    fe.sync().unwrap();
    ring.start_enabled(&mut fe, &mem, 0, 0, 0);
    (s, mem, ring, fe)
}

/// Posts a 4 KiB request of `ty` in `slot` (descriptors 3*slot..).
fn post(ring: &mut Ring, mem: &GuestMem, slot: u16, ty: u32) {
    ring.prepare(mem, slot * 3, slot as u64, ty, slot as u64 * 8, 4096);
    ring.post(mem, slot * 3);
}

/// Waits until the device is in `want`.
fn wait_state(s: &Spoold, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while state(s) != want {
        assert!(Instant::now() < deadline, "device never became {want}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// After the stop, a new connection (a migration's destination, or `cont` after a
/// reconnect) at the stopped base must find nothing to replay: the used index stays.
fn reconnect_replays_nothing(s: &Spoold, mem: &GuestMem, ring: &Ring, base: u16) {
    let mut fe = RawFrontend::connect(&s.socket("vm"));
    fe.sync().unwrap();
    ring.start_enabled(&mut fe, mem, 0, 0, base);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        ring.used_idx(mem),
        base,
        "a fresh connection completed a request again"
    );
    let log = s.log();
    assert!(
        !log.contains("recovered queue from its journal"),
        "the journal was replayed into a fresh connection:\n{log}"
    );
}

#[test]
fn a_stop_while_the_device_resets_waits_for_the_held_read_and_completes_it() {
    let (s, mem, mut ring, mut fe) = start();
    // The link goes down for 3 s on reads: the read fails with a path error and is held
    // while the device resets.
    const DOWN: Duration = Duration::from_millis(3000);
    let t0 = Instant::now();
    inject(
        &s,
        json!({"kind": "link-down", "op": "read", "duration_ms": DOWN.as_millis() as u64}),
    );
    post(&mut ring, &mem, 0, T_IN);
    wait_state(&s, "resetting");
    std::thread::sleep(Duration::from_millis(1000).saturating_sub(t0.elapsed()));
    assert_eq!(
        ring.used_idx(&mem),
        0,
        "the read completed despite the link-down"
    );
    // How long the link stays down once the stop begins (a loaded host may have spent
    // much of it above): the stop must wait for the held read that long.
    let down_left = DOWN.saturating_sub(t0.elapsed());
    let (base, took) = stop_ring(&mut fe);
    assert_eq!(base, 1);
    assert_eq!(
        ring.used_idx(&mem),
        base,
        "GET_VRING_BASE answered past a request it never completed"
    );
    assert_eq!(
        ring.status(&mem, 0),
        OK,
        "within the window the guest sees latency only"
    );
    assert!(
        took >= down_left.min(Duration::from_millis(300)),
        "answered at once ({took:?}, the link was down for {down_left:?} more)"
    );
    drop(fe);
    reconnect_replays_nothing(&s, &mem, &ring, base);
}

#[test]
fn a_stop_fails_a_request_still_held_past_the_drain_window() {
    let (s, mem, mut ring, mut fe) = start();
    // A write that goes through first, then a link that stays down for 30 s.
    post(&mut ring, &mem, 0, T_OUT);
    assert_eq!(ring.wait_used(&mem, 1, Duration::from_secs(10)).len(), 1);
    inject(
        &s,
        json!({"kind": "link-down", "op": "any", "duration_ms": 30000}),
    );
    post(&mut ring, &mem, 1, T_IN);
    wait_state(&s, "resetting");
    let (base, took) = stop_ring(&mut fe);
    assert_eq!(base, 2);
    assert_eq!(
        ring.used_idx(&mem),
        base,
        "the base counts a request never completed"
    );
    assert_eq!(
        ring.status(&mem, 1),
        IOERR,
        "past the window the request fails"
    );
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(20),
        "the stop did not wait for its window ({took:?})"
    );
    assert!(s.log().contains("failed them with an I/O error"));
    drop(fe);
    s.rpc("device_clear_faults", json!({"id": device(&s)}))
        .unwrap();
    reconnect_replays_nothing(&s, &mem, &ring, base);
}

#[test]
fn a_stop_while_a_command_hangs_times_it_out_resubmits_it_and_completes_it() {
    let (s, mem, mut ring, mut fe) = start();
    // The next read hangs in the device (once): the timeout sweep reports it after
    // io_timeout_ms, the device is reset, and the read is submitted again.
    inject(&s, json!({"kind": "timeout", "op": "read", "count": 1}));
    post(&mut ring, &mem, 0, T_IN);
    wait_hit(&s);
    assert_eq!(ring.used_idx(&mem), 0, "the hung read completed");
    let (base, _) = stop_ring(&mut fe);
    assert_eq!(base, 1);
    assert_eq!(ring.used_idx(&mem), base);
    assert_eq!(ring.status(&mem, 0), OK);
    drop(fe);
    reconnect_replays_nothing(&s, &mem, &ring, base);
}

#[test]
fn a_new_frontend_after_a_crash_never_gets_the_old_frontends_requests() {
    let (mut s, mem, mut ring, _fe) = start();
    // A read that never completes, not even on abort: INFLIGHT in the journal when spoold
    // (keeper and worker) dies.
    inject(&s, json!({"kind": "stuck", "op": "read"}));
    post(&mut ring, &mem, 0, T_IN);
    wait_hit(&s);
    assert_eq!(ring.used_idx(&mem), 0);
    s.kill();
    s.spawn();
    // Another guest (a new QEMU process: a restarted VM, a migration's destination) whose
    // rings sit at the same guest addresses, with one write posted at avail index 0, head
    // 6: the journal's indices (head 0 taken at index 0) look consistent with its ring.
    let mem2 = GuestMem::new(1 << 20);
    let mut ring2 = Ring::new(16);
    post(&mut ring2, &mem2, 2, T_OUT);
    let mut fe2 = RawFrontend::connect(&s.socket("vm"));
    fe2.sync().unwrap();
    ring2.start_enabled(&mut fe2, &mem2, 0, 0, 0);
    let used = ring2.wait_used(&mem2, 1, Duration::from_secs(10));
    assert_eq!(
        used,
        vec![(6, 1)],
        "the new guest's request was skipped or another's completed in its ring:\n{}",
        s.log()
    );
    assert_eq!(ring2.status(&mem2, 2), OK);
}

/// A fresh start (a migration's destination, `cont` after a reconnect) whose base counts two
/// writes that the used ring never got: whoever served the ring before took them and lost
/// them, and the guest waits for them for ever. The rings cannot tell which heads are lost
/// (completions come out of order), so spoold cannot serve them; it says so in its log, with
/// the numbers, and goes on from the base.
#[test]
fn a_fresh_start_names_requests_below_its_base_that_were_never_completed() {
    let s = Spoold::start(CFG);
    let mem = GuestMem::new(1 << 20);
    let mut ring = Ring::new(16);
    for slot in 0..2u16 {
        post(&mut ring, &mem, slot, T_OUT);
    }
    let mut fe = RawFrontend::connect(&s.socket("vm"));
    fe.sync().unwrap();
    ring.start_enabled(&mut fe, &mem, 0, 0, 2);
    post(&mut ring, &mem, 2, T_OUT);
    let used = ring.wait_used(&mem, 1, Duration::from_secs(10));
    assert_eq!(used, vec![(6, 1)], "the ring goes on from the base");
    assert_eq!(ring.status(&mem, 2), OK);
    let log = s.log();
    assert!(
        log.contains("never completed by the backend that took them")
            && log.contains("base=2 used_idx=0 lost=2"),
        "{log}"
    );
}
