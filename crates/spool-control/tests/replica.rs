//! Standing replicas between two spoolds on this machine (docs/replicas.md): a volume on A
//! replicated to B, A killed whole (keeper and worker, as a host dies) with writes in flight,
//! B's replica promoted: a VM waiting on B's socket goes on and reads every write A's client
//! saw completed. B's worker restarts keep the replica closed to VMs; a hello from A's epoch
//! is refused once B promoted, and A, back, completes no write without B.

mod common;

use std::mem::MaybeUninit;
use std::sync::mpsc;
use std::time::Duration;

use blkio::Completion;
use common::{
    connect, ctl, ctl_err, hello, pattern, transfer_port, Client_, Spoold, BS, CONFIG, LISTENING,
};

const TOKEN: &str = "0123456789abcdef0123";
/// Blocks a round writes (64 KiB each, all in flight together).
const BLOCKS: usize = 32;

/// Submits round `round`: every block stamped with it.
fn submit_round(c: &mut Client_, round: u64) {
    for b in 0..BLOCKS {
        let off = (b * BS) as u64;
        c.buf(b * BS, BS).copy_from_slice(&pattern(round, off, BS));
        c.write(0, off, b * BS, BS, b);
    }
}

/// Replicates volume v from `a` to `b` (expecting it) through listener `to`, and waits until
/// `a` says its copy there is current and `b` records its replica complete.
fn replicate_until_complete(a: &Spoold, b: &Spoold, to: &str) {
    let args = [
        "volume",
        "replicate",
        "v",
        "--to",
        to,
        "--token",
        TOKEN,
        "--wait",
    ];
    let out = ctl(a, &args);
    assert!(out.contains("current"), "{out}");
    let t0 = std::time::Instant::now();
    loop {
        let show = ctl(b, &["volume", "show", "v"]);
        if show.contains("replica of v on 127.0.0.1 (epoch 0, complete)") {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{show}\n{}",
            a.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Completions on queue 0 within `wait` (none: every request still waits).
fn completions_within(c: &mut Client_, wait: Duration) -> usize {
    let mut comps: Vec<MaybeUninit<Completion>> =
        (0..BLOCKS).map(|_| MaybeUninit::uninit()).collect();
    let mut t = wait;
    c.queues[0]
        .do_io(&mut comps, 1, Some(&mut t), None)
        .unwrap_or(0)
}

#[test]
fn a_promoted_replica_holds_every_write_its_dead_primary_acknowledged() {
    let mut a = Spoold::start(CONFIG);
    let b = Spoold::start(LISTENING);
    let to = format!("127.0.0.1:{}", transfer_port(&b));

    // A replica is asked for on both sides, or refused on the destination's word.
    ctl(&b, &["volume", "receive", "v", "--token", TOKEN]);
    let e = ctl_err(
        &a,
        &["volume", "replicate", "v", "--to", &to, "--token", TOKEN],
    );
    assert!(e.contains("for one transfer, not as a replica"), "{e}");
    ctl(
        &b,
        &["volume", "receive", "v", "--token", TOKEN, "--replica"],
    );
    let e = ctl_err(&a, &["volume", "send", "v", "--to", &to, "--token", TOKEN]);
    assert!(e.contains("expected here as a standing replica"), "{e}");
    // The expectation outlives B's worker (kept with the keeper).
    b.kill_worker();
    b.status();
    replicate_until_complete(&a, &b, &to);
    let events = b
        .rpc("events_list", serde_json::json!({"since": 0}))
        .unwrap()
        .to_string();
    assert!(events.contains("the replica here is complete"), "{events}");
    let e = ctl_err(&b, &["volume", "promote", "nope"]);
    assert!(e.contains("nope"), "{e}");

    // Rounds acknowledged on A, then one in flight when A dies whole.
    let mut c = connect(&a.socket("v"), 1, false).unwrap();
    let rounds = 6u64;
    for round in 0..rounds {
        submit_round(&mut c, round);
        let done = c.wait(0, BLOCKS);
        assert!(done.iter().all(|&(_, r)| r == 0), "round {round}: {done:?}");
    }
    submit_round(&mut c, rounds);
    let _ = completions_within(&mut c, Duration::from_millis(2));
    a.kill_all();
    drop(c);

    // B's worker restarts: the replica stays closed to VMs (the table says what it is).
    b.kill_worker();
    b.status();
    let show = ctl(&b, &["volume", "show", "v"]);
    assert!(show.contains("replica of v"), "{show}");
    let (tx, rx) = mpsc::channel();
    let sock = b.socket("v");
    let reader = std::thread::spawn(move || {
        let mut c = connect(&sock, 1, false).unwrap();
        tx.send(()).unwrap();
        (0..BLOCKS)
            .map(|b| c.read_sync(0, (b * BS) as u64, BS))
            .collect::<Vec<_>>()
    });
    // Its connection is taken and waits at the gate (said in the log before it waits).
    let t0 = std::time::Instant::now();
    while !b
        .log()
        .contains("a frontend connected while new ones are held")
    {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", b.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "a VM got into the replica before its promotion"
    );
    let out = ctl(&b, &["volume", "promote", "v"]);
    assert!(out.contains("epoch 1 (promoted here"), "{out}");
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the waiting VM did not go on after the promotion");
    let blocks = reader.join().unwrap();
    for (i, (r, data)) in blocks.into_iter().enumerate() {
        assert_eq!(r, 0, "block {i}");
        let off = (i * BS) as u64;
        assert!(
            data == pattern(rounds - 1, off, BS) || data == pattern(rounds, off, BS),
            "block {i} holds neither the last acknowledged write nor the one in flight"
        );
    }
    assert!(ctl_err(&b, &["volume", "promote", "v"]).contains("not a replica"));
    let events = b
        .rpc("events_list", serde_json::json!({"since": 0}))
        .unwrap()
        .to_string();
    assert!(events.contains("promoted here at epoch 1"), "{events}");

    // A hello from the old primary's epoch is fenced off; a later epoch's is taken.
    ctl(
        &b,
        &["volume", "receive", "v", "--token", TOKEN, "--replica"],
    );
    let old = |epoch| {
        let mut h = hello::plain("v", 16 << 20);
        (h.replica, h.epoch) = (true, epoch);
        hello::say(&to, TOKEN, h)
    };
    let answer = old(0);
    assert!(answer.contains("promoted (epoch 1)"), "{answer}");
    let answer = old(1);
    assert!(answer.contains("\"nbd\""), "{answer}");
    let show = ctl(&b, &["volume", "show", "v"]);
    assert!(
        show.contains("replica of v on 127.0.0.1 (epoch 1, not complete yet"),
        "{show}"
    );
    // Never said complete (this sender never copied): promoted only when forced.
    let e = ctl_err(&b, &["volume", "promote", "v"]);
    assert!(e.contains("never held a complete copy"), "{e}");
    assert!(ctl(&b, &["volume", "show", "v"]).contains("replica of v"));
    let out = ctl(&b, &["volume", "promote", "v", "--force"]);
    assert!(out.contains("epoch 2"), "{out}");

    // A comes back: its copy was current on B, so its writes wait for B, which takes none.
    a.spawn();
    let mut c = connect(&a.socket("v"), 1, false).unwrap();
    c.buf(0, BS).copy_from_slice(&pattern(99, 0, BS));
    c.write(0, 0, 0, BS, 0);
    assert_eq!(
        completions_within(&mut c, Duration::from_secs(2)),
        0,
        "the old primary completed a write its replica, promoted, never took"
    );
    let send = ctl(&a, &["volume", "send", "v"]);
    assert!(send.contains("waiting"), "{send}");
}

/// B promoted while A still runs (an operator's mistake, or a partition that left the
/// listener reachable): A's writes wait for B, A asks B's listener, learns it is fenced off
/// and fails them; its reads go on. A's worker restarted (the token kept with its keeper)
/// learns it again.
#[test]
fn a_running_primary_is_fenced_off_when_its_replica_is_promoted() {
    let a = Spoold::start(CONFIG);
    let b = Spoold::start(LISTENING);
    let to = format!("127.0.0.1:{}", transfer_port(&b));
    ctl(
        &b,
        &["volume", "receive", "v", "--token", TOKEN, "--replica"],
    );
    replicate_until_complete(&a, &b, &to);
    let mut c = connect(&a.socket("v"), 1, false).unwrap();
    c.hang_after = Duration::from_secs(30);
    let data = pattern(1, 0, BS);
    assert_eq!(c.write_sync(0, 0, &data), 0);
    ctl(&b, &["volume", "promote", "v"]);
    let fenced = |c: &mut Client_| {
        let r = c.write_sync(0, BS as u64, &pattern(2, BS as u64, BS));
        assert_ne!(r, 0, "a fenced-off primary completed a write");
        let (r, back) = c.read_sync(0, 0, BS);
        assert_eq!(r, 0, "reads go on");
        assert!(back == data);
    };
    fenced(&mut c);
    let send = ctl(&a, &["volume", "send", "v"]);
    assert!(send.contains("fenced off"), "{send}");
    let e = ctl_err(&a, &["volume", "send", "v", "--cancel"]);
    assert!(e.contains("second primary"), "{e}");
    let events = (a
        .rpc("events_list", serde_json::json!({"since": 0}))
        .unwrap())
    .to_string();
    assert!(events.contains("promoted on 127.0.0.1"), "{events}");
    // A new worker learns it again (writes wait until it does, then fail).
    a.kill_worker();
    a.status();
    fenced(&mut c);
}

/// The features stacked on a replica: an encrypted thin volume replicates as ciphertext to a
/// host with the same key-encryption key, created there thin (its holes stay holes), and
/// B's promotion after A dies serves what A's client wrote.
#[test]
fn an_encrypted_thin_replica_takes_over_with_its_holes() {
    let keyed = |config: &str| {
        let mut d = Spoold::prepared(&format!("[encryption]\nkey_file = \"@DIR@/kek\"\n{config}"));
        common::write_key(&d.dir.path().join("kek"), 0x33);
        d.spawn();
        d
    };
    let mut a = keyed(&CONFIG.replace(
        "num_queues = 1",
        "num_queues = 1\nthin = true\nencrypt = true",
    ));
    let b = keyed(LISTENING);
    let to = format!("127.0.0.1:{}", transfer_port(&b));
    let mut c = connect(&a.socket("v"), 1, false).unwrap();
    let at = 5 * BS as u64 * 16;
    let data = pattern(7, at, 4 * BS);
    assert_eq!(c.write_sync(0, at, &data), 0);
    ctl(
        &b,
        &["volume", "receive", "v", "--token", TOKEN, "--replica"],
    );
    replicate_until_complete(&a, &b, &to);
    let show = ctl(&b, &["volume", "show", "v"]);
    assert!(show.contains("encryption: aes-xts-plain64"), "{show}");
    let mapped = |d: &Spoold| {
        d.rpc("volume_show", serde_json::json!({"id": "v"}))
            .unwrap()["thin"]["mapped"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(mapped(&b), mapped(&a), "B's copy allocated A's holes");
    // A hole reads as zeroes decrypt to (docs/encryption.md): the same noise on both hosts.
    let hole = c.read_sync(0, 8 << 20, BS).1;
    // One more write acknowledged, then A dies.
    let more = pattern(8, 0, BS);
    assert_eq!(c.write_sync(0, 0, &more), 0);
    drop(c);
    a.kill_all();
    ctl(&b, &["volume", "promote", "v"]);
    let mut c = connect(&b.socket("v"), 1, false).unwrap();
    assert!(c.read_sync(0, 0, BS).1 == more);
    assert!(c.read_sync(0, at, 4 * BS).1 == data);
    assert!(
        c.read_sync(0, 8 << 20, BS).1 == hole,
        "a hole reads as on A"
    );
}
