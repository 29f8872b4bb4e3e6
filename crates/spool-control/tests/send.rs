//! Sending a running volume to another spoold (`spoolctl volume send`, docs/transfer.md):
//! spoold A keeps a remote copy on spoold B's `volume receive` export in step while the real
//! libblkio client writes through vhost-user, across a worker kill on each side; once the
//! copy is current, B's frontend starts the volume (the switchover) and reads every byte A's
//! client wrote, and A's copy is deleted by `--finish`.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::{
    connect, ctl, ctl_err, hello, pattern, reads_back, transfer_port, wait_current, Spoold, CONFIG,
    LISTENING,
};
use serde_json::json;
use spool_control::api;

const MIB: usize = 1 << 20;

#[test]
fn a_running_volume_is_sent_to_another_spoold_across_worker_kills_on_both_sides() {
    let a = Spoold::start(CONFIG);
    let b = Spoold::start(CONFIG);
    let sock = b.dir.path().join("in.sock");
    let uri = format!("nbd+unix:///v?socket={}", sock.display());
    ctl(
        &b,
        &[
            "volume",
            "receive",
            "v",
            "--nbd",
            &format!("unix:{}", sock.display()),
        ],
    );

    let mut c = connect(&a.socket("v"), 1, false).unwrap();
    let mut model = vec![0u8; 16 * MIB];
    let mut write = |c: &mut common::Client_, salt: u64, at: usize, len: usize| {
        let data = pattern(salt, at as u64, len);
        assert_eq!(c.write_sync(0, at as u64, &data), 0, "write at {at}");
        model[at..at + len].copy_from_slice(&data);
    };
    for i in 0..16 {
        write(&mut c, 1, i * MIB, MIB);
    }
    assert!(ctl_err(&a, &["volume", "send", "v"]).contains("not being sent"));
    let out = ctl(&a, &["volume", "send", "v", "--to", &uri]);
    assert!(out.contains(&format!("sending v to {uri}")), "{out}");
    // Cancelled, the volume is plain again; sent again, the copy starts over.
    let out = ctl(&a, &["volume", "send", "v", "--cancel"]);
    assert!(out.contains("cancelled"), "{out}");
    assert!(!ctl(&a, &["volume", "show", "v"]).contains("sending"));
    ctl(&a, &["volume", "send", "v", "--to", &uri]);
    assert!(
        ctl_err(&a, &["volume", "send", "v", "--to", "nbd://127.0.0.1:1/v"])
            .contains("being sent to")
    );

    // Writes go on during the copy, with a worker kill on each side, each while the leg is
    // connected: the source's new worker connects the leg again, and so does the source
    // after the destination's restart broke the link (the destination serves its kept
    // socket again); what the leg missed meanwhile is copied from the bitmap.
    for round in 0..3u64 {
        for i in 0..16 {
            write(
                &mut c,
                2 + round,
                i * MIB + (round as usize) * 4096,
                256 << 10,
            );
            if i == 5 && round == 0 {
                a.kill_worker();
            }
            if i == 10 && round == 1 {
                b.kill_worker();
            }
        }
        wait_current(&a, &b);
        let connected = a.log().matches("remote leg connected").count();
        assert!(
            connected >= [1, 2, 2][round as usize],
            "round {round}: the leg was connected again {connected} times\n{}",
            a.log()
        );
    }
    let show = ctl(&a, &["volume", "show", "v"]);
    assert!(
        show.contains(&format!("sending v to {uri}: current")),
        "{show}"
    );
    let out = ctl(&a, &["volume", "send", "v", "--wait"]);
    assert!(out.contains("current"), "{out}");
    // The health events say it too (kind send), once the settler has looked.
    let t = Instant::now();
    while !ctl(&a, &["events"]).contains("v: current on") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{}",
            ctl(&a, &["events"])
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(ctl_err(&a, &["volume", "resize", "v", "32M"]).contains("being sent"));

    // The destination goes away (its transfer stopped). The copy there was current, so a
    // write must not complete here alone (a VM moving there would not find it): it waits,
    // and the send says why; once the destination receives again, the leg connects again
    // and the write completes on both.
    let receive = ["volume", "receive", "v", "--nbd"];
    let listen = format!("unix:{}", sock.display());
    ctl(&b, &["volume", "receive", "v", "--stop"]);
    let (at, data) = (3 * MIB, pattern(9, (3 * MIB) as u64, 64 << 10));
    std::thread::scope(|s| {
        let w = s.spawn(|| c.write_sync(0, at as u64, &data));
        let t = Instant::now();
        loop {
            let out = ctl(&a, &["volume", "send", "v"]);
            if out.contains(": waiting") {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "{out}\n{}", a.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        // The event comes from the settler's next look.
        while !ctl(&a, &["events"]).contains("the copy there was current") {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{}",
                ctl(&a, &["events"])
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(
            !w.is_finished(),
            "a write completed here alone while the current copy there could not take it"
        );
        ctl(&b, &[&receive[..], &[listen.as_str()]].concat());
        assert_eq!(w.join().unwrap(), 0, "the held write failed\n{}", a.log());
    });
    model[at..at + data.len()].copy_from_slice(&data);
    wait_current(&a, &b);
    // The operator can always let the volume go on without that copy: `--cancel` drops it
    // and the waiting write completes here; sent again, the copy starts over.
    ctl(&b, &["volume", "receive", "v", "--stop"]);
    let (at, data) = (5 * MIB, pattern(10, (5 * MIB) as u64, 64 << 10));
    std::thread::scope(|s| {
        let w = s.spawn(|| c.write_sync(0, at as u64, &data));
        std::thread::sleep(Duration::from_millis(500));
        assert!(!w.is_finished(), "a write completed here alone");
        ctl(&a, &["volume", "send", "v", "--cancel"]);
        assert_eq!(w.join().unwrap(), 0, "the held write failed\n{}", a.log());
    });
    model[at..at + data.len()].copy_from_slice(&data);
    ctl(&b, &[&receive[..], &[listen.as_str()]].concat());
    ctl(&a, &["volume", "send", "v", "--to", &uri]);
    wait_current(&a, &b);

    // The switchover: the VM leaves A, B's frontend starts the volume (the transfer ends
    // there) and reads what A's client wrote; then A's copy goes.
    drop(c);
    reads_back(&b, &model);
    a.wait_disconnected("v");
    let out = ctl(&a, &["volume", "send", "v", "--finish"]);
    assert!(out.contains("finished"), "{out}");
    assert!(ctl_err(&a, &["volume", "show", "v"]).contains("v"));
}

/// Kills `b`'s worker and waits until the next one serves its transfer again.
fn kill_receiving_worker(b: &Spoold) {
    b.kill_worker();
    let t = Instant::now();
    while !b
        .log()
        .contains("receiving the volume again after the worker's restart")
    {
        assert!(t.elapsed() < Duration::from_secs(30), "{}", b.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `volume send --to HOST:PORT --token`: the destination creates the volume as the source
/// has it (size, queues, I/O limits) once the hello carries the token its operator gave
/// `volume receive --token`; a wrong token or no expectation is refused and creates
/// nothing; the copy then runs as with an export given by hand.
#[test]
fn a_volume_is_sent_through_the_transfer_listener_with_a_token() {
    let a = Spoold::start(CONFIG);
    let b = Spoold::start(LISTENING);
    let to = format!("127.0.0.1:{}", transfer_port(&b));
    let token = "0123456789abcdef0123";
    ctl(&a, &["volume", "qos", "v", "--iops", "40k"]);
    let mut c = connect(&a.socket("v"), 1, false).unwrap();
    let data = pattern(3, 0, 16 * MIB);
    for (i, m) in data.chunks(MIB).enumerate() {
        assert_eq!(c.write_sync(0, (i * MIB) as u64, m), 0);
    }

    let send = |token: &str| ctl_err(&a, &["volume", "send", "v", "--to", &to, "--token", token]);
    let e = send(token);
    assert!(
        e.contains("no transfer of volume 'v' with that token"),
        "{e}"
    );
    // The token from a file here, from standard input there: out of the process list.
    let file = b.dir.path().join("token");
    std::fs::write(&file, format!("{token}\n")).unwrap();
    let file = file.to_str().unwrap();
    let out = ctl(&b, &["volume", "receive", "v", "--token-file", file]);
    assert!(out.contains("expecting volume v"), "{out}");
    let e = send("0123456789abcdef0124");
    assert!(
        e.contains("no transfer of volume 'v' with that token"),
        "{e}"
    );
    assert!(send("short").contains("16 to 256"));
    assert!(
        ctl_err(&b, &["volume", "show", "v"]).contains("v"),
        "created on a refusal"
    );

    let mut sender = std::process::Command::new(env!("CARGO_BIN_EXE_spoolctl"))
        .arg("--socket")
        .arg(a.rpc_path())
        .args(["volume", "send", "v", "--to", &to, "--token-file", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = sender.stdin.take().unwrap();
    stdin.write_all(format!("{token}\n").as_bytes()).unwrap();
    drop(stdin);
    let out = sender.wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(out.contains("sending v to nbd://127.0.0.1:"), "{out}");
    let show = ctl(&b, &["volume", "show", "v"]);
    assert!(
        show.contains(" 16M ") && show.contains("iops 40k"),
        "{show}"
    );
    assert!(
        show.contains("receiving over NBD: nbd://127.0.0.1:"),
        "{show}"
    );
    wait_current(&a, &b);
    drop(c);
    reads_back(&b, &data);

    // The transfer ended when B's frontend started: the token opens nothing again.
    let say = |h: api::TransferHello| hello::say(&to, token, h);
    let again = || hello::plain("v", 16 << 20);
    let answer = say(again());
    assert!(answer.contains("has ended"), "{answer}");
    assert!(hello::say_raw(&to, |_| "not json\n".into()).contains("a bad hello"));
    // A name with a line break cannot forge a line of B's log.
    assert!(!say(hello::plain("v\nERROR forged line", 1 << 20)).is_empty());
    assert!(!b.log().contains("\nERROR forged line"), "{}", b.log());
    assert!(b.log().contains("v\\nERROR forged line"), "{}", b.log());
    let v9 = hello::say_raw(&to, |n| {
        hello::proved(token, n, again()).replace("\"version\":2", "\"version\":9")
    });
    assert!(v9.contains("version 9"), "{v9}");
    // An existing volume may be expected too; --stop forgets it.
    let out = ctl(
        &b,
        &["volume", "receive", "v", "--token", "another-token-0123"],
    );
    assert!(
        out.contains("expecting volume v on the transfer listener 127.0.0.1:"),
        "{out}"
    );
    ctl(&b, &["volume", "receive", "v", "--stop"]);
    assert!(say(again()).contains("no transfer of volume 'v'"));

    // A volume received by hand is not exported a second time for a hello: the second
    // export would write on after `--stop` (or a delete) ended the first.
    ctl(&b, &["volume", "create", "w", "4M", "--queues", "1"]);
    let by_hand = format!("unix:{}", b.dir.path().join("w.nbd").display());
    ctl(&b, &["volume", "receive", "w", "--nbd", &by_hand]);
    ctl(&b, &["volume", "receive", "w", "--token", token]);
    let answer = say(hello::plain("w", 4 << 20));
    assert!(answer.contains("being received already"), "{answer}");
    let show = ctl(&b, &["volume", "show", "w"]);
    assert_eq!(show.matches("receiving over NBD").count(), 1, "{show}");
    ctl(&b, &["volume", "receive", "w", "--stop"]);
    assert!(!ctl(&b, &["volume", "show", "w"]).contains("receiving over NBD"));
}

/// A key file of `byte` repeated, in hex, mode 0600.
fn write_key(path: &std::path::Path, byte: u8) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("{byte:02x}").repeat(32)).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// A spoold of `config` (plus a key-encryption key of `byte`s in `@DIR@/kek`).
fn keyed(config: &str, byte: u8) -> Spoold {
    let mut d = Spoold::prepared(&format!("[encryption]\nkey_file = \"@DIR@/kek\"\n{config}"));
    write_key(&d.dir.path().join("kek"), byte);
    d.spawn();
    d
}

/// An encrypted volume crosses as its ciphertext, with its data key wrapped under the
/// key-encryption key both hosts have: the destination stores no plaintext, and its guest
/// reads what the source's wrote. A destination with another key refuses and creates
/// nothing; an export given by hand (no key can go there) is refused at the source.
#[test]
fn an_encrypted_volume_is_sent_as_ciphertext_to_a_host_with_the_same_key() {
    let a = keyed(
        &CONFIG.replace("num_queues = 1", "num_queues = 1\nencrypt = true"),
        0x11,
    );
    let (b, other) = (keyed(LISTENING, 0x11), keyed(LISTENING, 0x22));
    let token = "0123456789abcdef0123";
    let data = pattern(5, 0, 16 * MIB);
    let mut c = connect(&a.socket("v"), 1, false).unwrap();
    for (i, m) in data.chunks(MIB).enumerate() {
        assert_eq!(c.write_sync(0, (i * MIB) as u64, m), 0);
    }
    let e = ctl_err(&a, &["volume", "send", "v", "--to", "nbd://127.0.0.1:9/v"]);
    assert!(
        e.contains("through the destination's transfer listener"),
        "{e}"
    );

    ctl(&other, &["volume", "receive", "v", "--token", token]);
    let to = format!("127.0.0.1:{}", transfer_port(&other));
    let e = ctl_err(&a, &["volume", "send", "v", "--to", &to, "--token", token]);
    assert!(
        e.contains("give both hosts the same key-encryption key"),
        "{e}"
    );
    ctl_err(&other, &["volume", "show", "v"]);

    ctl(&b, &["volume", "receive", "v", "--token", token]);
    let to = format!("127.0.0.1:{}", transfer_port(&b));
    // A hello carrying a data key without the tag only a holder of the KEK makes.
    let kek_id = a
        .rpc("volume_show", serde_json::json!({"id": "v"}))
        .unwrap()["kek_id"]
        .clone();
    let mut forged = hello::plain("v", 16 << 20);
    forged.key = Some(api::TransferKey {
        cipher: "aes-xts-plain64".into(),
        kek_id: kek_id.as_str().unwrap().into(),
        wrapped: "ab".repeat(72),
        tag: "cd".repeat(32),
    });
    let answer = hello::say(&to, token, forged);
    assert!(
        answer.contains("does not prove the sender holds"),
        "{answer}"
    );
    ctl_err(&b, &["volume", "show", "v"]);
    ctl(&a, &["volume", "send", "v", "--to", &to, "--token", token]);
    // The transfer, served again by B's next worker, still takes the ciphertext.
    kill_receiving_worker(&b);
    wait_current(&a, &b);
    let show = ctl(&b, &["volume", "show", "v"]);
    let kek = |d: &Spoold| {
        d.rpc("volume_show", serde_json::json!({"id": "v"}))
            .unwrap()["kek_id"]
            .clone()
    };
    assert!(show.contains("aes-xts-plain64"), "{show}");
    assert!(kek(&a).is_string());
    assert_eq!(kek(&b), kek(&a));
    let img = std::fs::read(b.dir.path().join("d0.img")).unwrap();
    let plain: std::collections::HashSet<&[u8]> =
        data.chunks_exact(512).map(|s| &s[..64]).collect();
    assert!(
        !img.chunks_exact(512).any(|s| plain.contains(&s[..64])),
        "plaintext on the destination's device"
    );
    drop(c);
    reads_back(&b, &data);
    a.wait_disconnected("v");
    ctl(&a, &["volume", "send", "v", "--finish"]);
}

/// A thin volume sent through the transfer listener: its holes cross without being
/// allocated here or there (B creates it thin), B reads back what A's client wrote; `--finish` is refused while it has
/// snapshots (the copy there has none), then deletes it here once they are gone. (A revert
/// refused while it is sent: the pool's `a_thin_volume_is_sent_with_its_holes_as_write_zeroes`.)
#[test]
fn a_thin_volume_is_sent_through_the_transfer_listener() {
    let a = Spoold::start(&CONFIG.replace("num_queues = 1", "num_queues = 1\nthin = true"));
    let b = Spoold::start(LISTENING);
    let to = format!("127.0.0.1:{}", transfer_port(&b));
    let token = "thin-token-0123456789";
    let mut want = vec![0u8; 16 * MIB];
    want[4 * MIB..6 * MIB].copy_from_slice(&pattern(5, 4 * MIB as u64, 2 * MIB));
    let mut c = connect(&a.socket("v"), 1, false).unwrap();
    for (i, m) in want.chunks(MIB).enumerate().skip(4).take(2) {
        assert_eq!(c.write_sync(0, (i * MIB) as u64, m), 0);
    }
    ctl(&a, &["volume", "snapshot", "v", "s"]);
    let mapped =
        |d: &Spoold| d.rpc("volume_show", json!({"id": "v"})).unwrap()["thin"]["mapped"].clone();
    let before = mapped(&a);
    assert_eq!(before, json!(2 * MIB));
    ctl(&b, &["volume", "receive", "v", "--token", token]);
    ctl(&a, &["volume", "send", "v", "--to", &to, "--token", token]);
    wait_current(&a, &b);
    assert_eq!(
        mapped(&a),
        before,
        "the copy allocated the volume's holes here"
    );
    assert_eq!(
        mapped(&b),
        before,
        "B's copy is thin, its holes not allocated there"
    );
    drop(c);
    reads_back(&b, &want);
    a.wait_disconnected("v");
    let e = ctl_err(&a, &["volume", "send", "v", "--finish"]);
    assert!(e.contains("1 snapshot(s) here"), "{e}");
    ctl(&a, &["snapshot", "delete", "v@s"]);
    let out = ctl(&a, &["volume", "send", "v", "--finish"]);
    assert!(out.contains("finished"), "{out}");
    assert!(ctl_err(&a, &["volume", "show", "v"]).contains("no volume"));
}

/// Clients that are no peers of the transfer listener are turned away, and their refusals
/// are logged a few a minute, not one line each (anyone who reaches the port can knock).
#[test]
fn refusals_of_non_peers_do_not_flood_the_log() {
    let b =
        Spoold::start(&LISTENING.replace(r#"peers = ["127.0.0.1"]"#, r#"peers = ["127.0.0.2"]"#));
    let port = transfer_port(&b);
    for _ in 0..60 {
        if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let mut buf = [0u8; 1];
            // Turned away: closed without an answer.
            let _ = std::io::Read::read(&mut &s, &mut buf);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let lines = loop {
        let n = b.log().matches("was turned away").count();
        if n >= 5 || Instant::now() > deadline {
            break n;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    std::thread::sleep(Duration::from_millis(300));
    let after = b.log().matches("was turned away").count();
    assert_eq!((lines, after), (5, 5), "{}", b.log());
}

/// The export a hello opens answers only to the name its answer told the sender: a process
/// sharing the sender's address (here: every test process is on 127.0.0.1) that knows the
/// volume's name but was not told the answer gets nothing from it, reads or writes.
#[test]
fn the_export_a_hello_opens_needs_the_name_its_answer_gave() {
    let b = Spoold::start(LISTENING);
    let to = format!("127.0.0.1:{}", transfer_port(&b));
    let token = "0123456789abcdef0123";
    ctl(&b, &["volume", "receive", "v", "--token", token]);
    let answer = hello::say(&to, token, hello::plain("v", 4 << 20));
    let reply: serde_json::Value = serde_json::from_str(answer.trim()).unwrap();
    let uri = reply["nbd"].as_str().unwrap_or_else(|| panic!("{answer}"));
    let (at, name) = uri.rsplit_once('/').unwrap();
    assert!(name.len() >= 32 && name != "v", "{uri}");
    let deadline = Duration::from_secs(10);
    for guess in ["v", ""] {
        let t = spool_nbd::client::Target::parse(&format!("{at}/{guess}")).unwrap();
        let e = spool_nbd::client::connect(&t, deadline).err();
        assert!(e.is_some(), "export name {guess:?} was served");
    }
    let t = spool_nbd::client::Target::parse(uri).unwrap();
    let read = || {
        let mut c = spool_nbd::client::connect(&t, deadline).expect("the sender's name");
        c.stream
            .write_all(&spool_nbd::client::request(0, 1, 0, 4096))
            .unwrap();
        let (cookie, err) = spool_nbd::client::read_reply(&mut c.stream).unwrap();
        assert_eq!((cookie, err), (1, 0));
    };
    read();
    // B's next worker serves it under the same name, and only under it.
    kill_receiving_worker(&b);
    read();
    let guess = spool_nbd::client::Target::parse(&format!("{at}/v")).unwrap();
    assert!(spool_nbd::client::connect(&guess, deadline).is_err());
}
