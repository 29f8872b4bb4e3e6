//! The JSON-RPC API and spoolctl against a running spoold: tables for people, --json for
//! scripts, and errors that say what was wrong.

mod common;

use std::process::Command;

use common::{spoolctl, Spoold};
use serde_json::{json, Value};

const CFG: &str = r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[volumes]]
name = "cfgvol"
size = "8M"
"#;

#[test]
fn spoolctl_manages_volumes() {
    let d = Spoold::start(CFG);
    let (ok, out, err) = spoolctl(&d, &["volume", "create", "web", "16M", "--queues", "4"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("web") && out.contains("16M") && out.contains("NAME"),
        "{out}"
    );
    let (ok, out, _) = spoolctl(&d, &["volume", "list"]);
    assert!(ok);
    assert!(out.contains("cfgvol") && out.contains("web"), "{out}");
    let (ok, out, _) = spoolctl(&d, &["volume", "show", "web"]);
    assert!(
        ok && out.contains("extents:") && out.contains("DEVICE"),
        "{out}"
    );
    let (ok, out, _) = spoolctl(&d, &["--json", "volume", "show", "web"]);
    assert!(ok);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["num_queues"], json!(4));
    assert_eq!(v["extent_map"][0]["volume_offset"], json!(0), "{v}");
    assert!(d.socket("web").exists());
    let uuid = v["uuid"].as_str().unwrap().to_string();
    let (ok, out, err) = spoolctl(&d, &["volume", "resize", &uuid, "32M"]);
    assert!(ok, "{err}");
    assert!(out.contains("32M"), "{out}");
    let (ok, out, _) = spoolctl(&d, &["pool", "show"]);
    assert!(ok);
    assert!(
        out.contains("pool0") && out.contains("d0.img") && out.contains("present"),
        "{out}"
    );
    let (ok, _, err) = spoolctl(&d, &["volume", "delete", "web"]);
    assert!(ok, "{err}");
    assert!(
        !d.socket("web").exists(),
        "socket of a deleted volume must go away"
    );
    let (ok, out, _) = spoolctl(&d, &["--json", "device", "list"]);
    assert!(ok);
    let devs: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(devs.as_array().unwrap().len(), 1);
}

#[test]
fn device_add_grows_the_pool() {
    let d = Spoold::start(CFG);
    let before = d.rpc("pool_show", json!({})).unwrap()["size"]
        .as_u64()
        .unwrap();
    let path = d.dir.path().join("extra.img");
    let (ok, _, err) = spoolctl(
        &d,
        &[
            "device",
            "add",
            path.to_str().unwrap(),
            "--create-size",
            "32M",
        ],
    );
    assert!(ok, "{err}");
    let after = d.rpc("pool_show", json!({})).unwrap()["size"]
        .as_u64()
        .unwrap();
    assert!(after > before);
    // The same device again is refused.
    let (ok, _, err) = spoolctl(&d, &["device", "add", path.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("locked") || err.contains("twice"), "{err}");
}

#[test]
fn errors_say_what_was_wrong() {
    let d = Spoold::start(CFG);
    for (args, needle) in [
        (vec!["volume", "create", "x", "lots"], "not a size"),
        (vec!["volume", "create", "bad/name", "1M"], "volume name"),
        (vec!["volume", "create", "cfgvol", "1M"], "already exists"),
        (
            vec!["volume", "create", "huge", "100G"],
            "not enough free space",
        ),
        (vec!["volume", "show", "nope"], "no volume"),
        (vec!["volume", "resize", "cfgvol", "1M"], "shrinking"),
        (
            vec!["device", "add", "/nonexistent/dev"],
            "/nonexistent/dev",
        ),
        (vec!["rpc", "frobnicate"], "unknown method"),
        (
            vec!["rpc", "volume_create", "{\"name\": 3}"],
            "invalid params",
        ),
    ] {
        let (ok, _, err) = spoolctl(&d, &args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let bogus = Command::new(env!("CARGO_BIN_EXE_spoolctl"))
        .args(["--socket", "/nonexistent.sock", "volume", "list"])
        .output()
        .unwrap();
    assert!(!bogus.status.success());
    assert!(String::from_utf8_lossy(&bogus.stderr).contains("is spoold running"));
}

#[test]
fn raw_json_rpc_errors() {
    use std::io::{BufRead, BufReader, Write};
    let d = Spoold::start(CFG);
    let s = std::os::unix::net::UnixStream::connect(d.rpc_path()).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    let mut ask = |line: &str| -> Value {
        writeln!(w, "{line}").unwrap();
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        serde_json::from_str(&l).unwrap()
    };
    assert_eq!(ask("{not json")["error"]["code"], json!(-32700));
    assert_eq!(
        ask(r#"{"id":1,"method":"pool_show"}"#)["error"]["code"],
        json!(-32600)
    );
    assert_eq!(
        ask(r#"{"jsonrpc":"2.0","id":2,"method":"nope"}"#)["error"]["code"],
        json!(-32601)
    );
    assert_eq!(
        ask(r#"{"jsonrpc":"2.0","id":3,"method":"volume_show","params":{"idd":"x"}}"#)["error"]
            ["code"],
        json!(-32602)
    );
    let ok = ask(r#"{"jsonrpc":"2.0","id":4,"method":"volume_list"}"#);
    assert_eq!(ok["id"], json!(4));
    assert_eq!(ok["result"][0]["name"], json!("cfgvol"));
    let mode = std::fs::metadata(d.rpc_path()).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o600
    );
}

#[test]
fn bad_config_and_foreign_devices_are_refused_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, "state_dir = \"s\"\n[pool]\nmin_extent = \"3M\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_spoold"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("power of two"));
    // A file full of someone else's data is not a Spool device: refused, untouched.
    let junk = dir.path().join("junk.img");
    std::fs::write(&junk, vec![0x5au8; 8 << 20]).unwrap();
    std::fs::write(
        &cfg,
        format!(
            "state_dir = \"s\"\n[[devices]]\npath = \"{}\"\n",
            junk.display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_spoold"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("junk.img") && err.contains("--force"), "{err}");
    assert!(std::fs::read(&junk).unwrap().iter().all(|&b| b == 0x5a));
    let help = Command::new(env!("CARGO_BIN_EXE_spoold"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("--config"));
}
