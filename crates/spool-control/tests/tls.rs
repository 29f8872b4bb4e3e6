//! Snapshot exports over TCP with TLS (`[tls] dir`, credentials made by
//! `scripts/tls-certs.sh`): the URI is `nbds://`, `nbdinfo` and `nbdcopy` read it with a
//! client certificate, a client without TLS gets nothing; without `[tls]` a TCP export is
//! refused unless `--plaintext` asks for the clear.

mod common;

use std::process::Command;

use common::{connect, ctl, pattern, spoolctl, Spoold};

const VOLUME: &str = r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[volumes]]
name = "t"
size = "8M"
num_queues = 1
thin = true
"#;

fn output(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// A snapshot `t@s` of 1 MiB written with pattern 5.
fn snapshot(d: &Spoold) -> Vec<u8> {
    let data = pattern(5, 0, 1 << 20);
    let mut c = connect(&d.socket("t"), 1, false).unwrap();
    assert_eq!(c.write_sync(0, 0, &data), 0);
    drop(c);
    ctl(d, &["volume", "snapshot", "t", "s"]);
    data
}

#[test]
#[ignore = "needs openssl, nbdinfo and nbdcopy (scripts/install-deps.sh installs them)"]
fn a_snapshot_is_exported_over_tcp_with_tls_and_only_in_the_clear_when_asked() {
    let certs = tempfile::tempdir().unwrap();
    common::tls_credentials(certs.path());
    let d = Spoold::start(&format!(
        "{VOLUME}[tls]\ndir = \"{}\"\n",
        certs.path().display()
    ));
    let data = snapshot(&d);
    let out = ctl(&d, &["volume", "export", "t@s", "--nbd", "127.0.0.1:0"]);
    let uri = out
        .split_whitespace()
        .find(|w| w.starts_with("nbds://"))
        .unwrap_or_else(|| panic!("no nbds:// URI: {out}"));
    let with_certs = format!("{uri}?tls-certificates={}", certs.path().display());
    let (ok, info) = output(Command::new("nbdinfo").arg(&with_certs));
    assert!(ok && info.contains("8388608"), "{info}");
    let copy = certs.path().join("copy.img");
    let (ok, o) = output(Command::new("nbdcopy").arg(&with_certs).arg(&copy));
    assert!(ok, "{o}");
    assert!(std::fs::read(&copy).unwrap()[..1 << 20] == data[..]);
    let plain = uri.replacen("nbds://", "nbd://", 1);
    let (ok, o) = output(Command::new("nbdinfo").arg(&plain));
    assert!(!ok, "read without TLS: {o}");
    drop(d);

    // No [tls]: over TCP only with --plaintext; a Unix socket as before.
    let d = Spoold::start(VOLUME);
    snapshot(&d);
    let (ok, _, err) = spoolctl(&d, &["volume", "export", "t@s", "--nbd", "127.0.0.1:0"]);
    assert!(!ok && err.contains("--plaintext"), "{err}");
    let out = ctl(
        &d,
        &[
            "volume",
            "export",
            "t@s",
            "--nbd",
            "127.0.0.1:0",
            "--plaintext",
        ],
    );
    let uri = out
        .split_whitespace()
        .find(|w| w.starts_with("nbd://"))
        .unwrap();
    let (ok, info) = output(Command::new("nbdinfo").arg(uri));
    assert!(ok && info.contains("8388608"), "{info}");
}

/// Both hosts with `[tls]`: the hello and the copy go over TLS (the export a hello opens is
/// `nbds://`), the copy becomes current and the destination reads what the source's client
/// wrote; on the sender's address, a client without TLS or without a certificate gets
/// nothing from the export.
#[test]
#[ignore = "needs openssl and nbdinfo (scripts/install-deps.sh installs them)"]
fn a_volume_is_sent_between_two_spoolds_over_tls() {
    let certs = tempfile::tempdir().unwrap();
    common::tls_credentials(certs.path());
    let tls = format!("[tls]\ndir = \"{}\"\n", certs.path().display());
    let a = Spoold::start(&format!("{}{tls}", common::CONFIG));
    let b = Spoold::start(&format!("{}{tls}", common::LISTENING));
    let to = format!("127.0.0.1:{}", common::transfer_port(&b));
    let token = "0123456789abcdef0123";
    let data = pattern(4, 0, 16 << 20);
    let mut c = connect(&a.socket("v"), 1, false).unwrap();
    for (i, m) in data.chunks(1 << 20).enumerate() {
        assert_eq!(c.write_sync(0, (i << 20) as u64, m), 0);
    }
    ctl(&b, &["volume", "receive", "v", "--token", token]);
    let out = ctl(&a, &["volume", "send", "v", "--to", &to, "--token", token]);
    assert!(out.contains("sending v to nbds://127.0.0.1:"), "{out}");
    common::wait_current(&a, &b);
    let show = ctl(&b, &["volume", "show", "v"]);
    let uri = show
        .split_whitespace()
        .find(|w| w.starts_with("nbds://"))
        .unwrap_or_else(|| panic!("{show}"));
    let (ok, o) = output(Command::new("nbdinfo").arg(uri.replacen("nbds://", "nbd://", 1)));
    assert!(!ok, "read without TLS: {o}");
    let anonymous = certs.path().join("anonymous");
    std::fs::create_dir_all(&anonymous).unwrap();
    std::fs::copy(
        certs.path().join("ca-cert.pem"),
        anonymous.join("ca-cert.pem"),
    )
    .unwrap();
    let (ok, o) = output(
        Command::new("nbdinfo").arg(format!("{uri}?tls-certificates={}", anonymous.display())),
    );
    assert!(!ok, "read without a client certificate: {o}");
    drop(c);
    common::reads_back(&b, &data);
}
