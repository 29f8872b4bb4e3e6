//! Receiving a volume's data over NBD (`spoolctl volume receive`, docs/transfer.md): written
//! by the standard tools (`qemu-img convert`, `nbdcopy`), read back through vhost-user by the
//! real libblkio client; the transfer ends when a frontend starts the volume.

mod common;

use common::{connect, ctl, ctl_err, pattern, Spoold};

const CONFIG: &str = r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[devices]]
path = "@DIR@/d1.img"
create_size = "64M"
[[volumes]]
name = "v"
size = "20M"
num_queues = 1
mirror = 2
[[volumes]]
name = "t"
size = "8M"
num_queues = 1
thin = true
"#;

const MIB: usize = 1 << 20;

/// `prog`, stopped after 120 s: a sender that waits on a socket nobody serves fails the
/// test instead of hanging it.
fn tool_cmd(prog: &str) -> std::process::Command {
    let mut c = std::process::Command::new("timeout");
    c.args(["120", prog]);
    c
}

fn tool(cmd: &mut std::process::Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A 20 MiB image is written into a mirrored volume with `qemu-img convert`, compared over
/// the same export, then read back through vhost-user: every byte, on both copies' behalf
/// (the mirror's durable writes). The first queue a frontend starts ends the transfer, and a
/// write sent after it fails instead of landing behind the guest's back.
#[test]
#[ignore = "needs qemu-img and qemu-io (QEMU; scripts/install-deps.sh installs it)"]
fn a_volume_received_with_qemu_img_reads_back_through_vhost_user() {
    let d = Spoold::start(CONFIG);
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let mut data = Vec::with_capacity(20 * MIB);
    for i in 0..20u64 {
        // The fifth MiB stays zero: qemu-img sends it as zeroes (or skips it), not data.
        let fill = if i == 4 {
            vec![0u8; MIB]
        } else {
            pattern(7, i * MIB as u64, MIB)
        };
        data.extend_from_slice(&fill);
    }
    std::fs::write(&src, &data).unwrap();
    let sock = dir.path().join("v.sock");
    let nbd = format!("unix:{}", sock.display());
    let uri = format!("nbd+unix:///v?socket={}", sock.display());

    // Refused: bad addresses, stopping what does not run.
    assert!(
        ctl_err(&d, &["volume", "receive", "v", "--nbd", "nowhere"]).contains("not an NBD address")
    );
    assert!(ctl_err(&d, &["volume", "receive", "v", "--stop"]).contains("not being received"));

    let out = ctl(&d, &["volume", "receive", "v", "--nbd", &nbd]);
    assert!(out.contains(&uri), "{out}");
    assert!(
        ctl_err(&d, &["volume", "receive", "v", "--nbd", &nbd]).contains("being received already")
    );
    convert_into(&d, &src, &uri);
    let (ok, text) = tool(
        tool_cmd("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&src)
            .arg(&uri),
    );
    assert!(ok && text.contains("identical"), "qemu-img compare: {text}");
    let show = ctl(&d, &["volume", "show", "v"]);
    assert!(
        show.contains(&format!("receiving over NBD: {uri}")),
        "{show}"
    );

    // A frontend starts the volume: the transfer ends, and a late write is refused.
    let mut c = connect(&d.socket("v"), 1, false).unwrap();
    for i in 0..20usize {
        let (r, got) = c.read_sync(0, (i * MIB) as u64, MIB);
        assert_eq!(r, 0);
        assert!(got == data[i * MIB..(i + 1) * MIB], "MiB {i} differs");
    }
    let (_, text) = tool(
        tool_cmd("qemu-io")
            .args(["-f", "raw", "-c", "write -P 0x55 0 4k"])
            .arg(&uri),
    );
    assert!(
        text.contains("failed"),
        "a write after the volume started: {text}"
    );
    let (r, got) = c.read_sync(0, 0, 4096);
    assert_eq!((r, &got[..]), (0, &data[..4096]), "the late write landed");
    let show = ctl(&d, &["volume", "show", "v"]);
    assert!(
        show.contains("until a frontend started the volume"),
        "{show}"
    );
    let out = ctl(&d, &["volume", "receive", "v", "--stop"]);
    assert!(out.contains("no longer received"), "{out}");
    // While the frontend runs the volume, a new transfer is refused.
    assert!(ctl_err(&d, &["volume", "receive", "v", "--nbd", &nbd]).contains("in use"));
}

/// A thin volume received with `qemu-img convert` takes space only for the image's data:
/// its zeroes come as write-zeroes and stay holes. A write that covers pages in part
/// (`qemu-io`, 3000 bytes at 1000) lands exactly. Both read back through vhost-user.
#[test]
#[ignore = "needs qemu-img and qemu-io (QEMU; scripts/install-deps.sh installs it)"]
fn a_thin_volume_received_with_qemu_img_takes_space_only_for_data() {
    let d = Spoold::start(CONFIG);
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let mut data = vec![0u8; 8 * MIB];
    data[2 * MIB..3 * MIB].copy_from_slice(&pattern(3, 2 * MIB as u64, MIB));
    data[6 * MIB..7 * MIB].copy_from_slice(&pattern(3, 6 * MIB as u64, MIB));
    std::fs::write(&src, &data).unwrap();
    let uri = receive_on_unix(&d, dir.path(), "t");
    convert_into(&d, &src, &uri);
    let thin = |d: &Spoold| {
        d.rpc("volume_show", serde_json::json!({"id": "t"}))
            .unwrap()["thin"]
            .clone()
    };
    let chunk = thin(&d)["chunk"].as_u64().unwrap() as usize;
    let span = |from: usize, to: usize| (to.div_ceil(chunk) - from / chunk) * chunk;
    assert_eq!(
        thin(&d)["mapped"].as_u64().unwrap() as usize,
        span(2 * MIB, 3 * MIB) + span(6 * MIB, 7 * MIB),
        "only the data's chunks are mapped"
    );
    let out = qemu_io(&uri, "write -P 0x33 1000 3000");
    assert!(out.contains("wrote 3000/3000"), "{out}");
    data[1000..4000].fill(0x33);
    ctl(&d, &["volume", "receive", "t", "--stop"]);
    let mut c = connect(&d.socket("t"), 1, false).unwrap();
    for i in 0..8usize {
        let (r, got) = c.read_sync(0, (i * MIB) as u64, MIB);
        assert_eq!(r, 0);
        assert!(got == data[i * MIB..(i + 1) * MIB], "MiB {i} differs");
    }
}

/// `qemu-img convert -n` of raw image `src` into the export at `uri`.
fn convert_into(d: &Spoold, src: &std::path::Path, uri: &str) {
    let (ok, text) = tool(
        tool_cmd("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(src)
            .arg(uri),
    );
    assert!(ok, "qemu-img convert: {text}\n{}", d.log());
}

/// Starts receiving volume `name` on a Unix socket in `dir`; returns the export's URI.
fn receive_on_unix(d: &Spoold, dir: &std::path::Path, name: &str) -> String {
    let sock = dir.join(format!("{name}.sock"));
    let nbd = format!("unix:{}", sock.display());
    ctl(d, &["volume", "receive", name, "--nbd", &nbd]);
    format!("nbd+unix:///{name}?socket={}", sock.display())
}

/// `qemu-io -c CMD URI`: its output (it reports a failed command in its output).
fn qemu_io(uri: &str, cmd: &str) -> String {
    let (ok, text) = tool(tool_cmd("qemu-io").args(["-f", "raw", "-c", cmd]).arg(uri));
    assert!(ok && !text.contains("failed"), "qemu-io {cmd}: {text}");
    text
}

/// A transfer outlives a worker kill and an upgrade: the listening socket stays with the
/// keeper, the new worker serves it again there, and a sender reconnecting to the same
/// address goes on; what every worker wrote reads back.
#[test]
#[ignore = "needs qemu-io (QEMU; scripts/install-deps.sh installs it)"]
fn a_transfer_outlives_a_worker_kill_and_an_upgrade() {
    let d = Spoold::start(CONFIG);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("v.sock");
    let uri = receive_on_unix(&d, dir.path(), "v");
    qemu_io(&uri, "write -P 0x11 0 6M");
    d.kill_worker();
    qemu_io(&uri, "write -P 0x22 6M 6M");
    let r = d.upgrade(None).expect("upgrade");
    assert_eq!(r["outcome"], "ok", "{r}");
    qemu_io(&uri, "write -P 0x33 12M 8M");
    for (p, at, len) in [(0x11, 0, 6), (0x22, 6, 6), (0x33, 12, 8)] {
        qemu_io(&uri, &format!("read -P {p:#x} {at}M {len}M"));
    }
    let show = ctl(&d, &["volume", "show", "v"]);
    assert!(
        show.contains(&format!("receiving over NBD: {uri}")),
        "{show}"
    );
    // Stopped, it stays stopped across the next restart.
    ctl(&d, &["volume", "receive", "v", "--stop"]);
    d.kill_worker();
    let show = ctl(&d, &["volume", "show", "v"]);
    assert!(!show.contains("receiving"), "{show}");
    assert!(
        !sock.exists(),
        "the stopped transfer's socket is still there"
    );
}
