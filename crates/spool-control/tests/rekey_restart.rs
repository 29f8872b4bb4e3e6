//! A rekey never depends on the operator's order of steps or on no restart happening
//! (docs/encryption.md): through the real spoold and the real libblkio client, a worker
//! SIGKILL between `volume rekey --key-file NEW` and the config change, and one between the
//! new key put where the config points and the rekey, leave the encrypted volume served
//! and its data read back; the previous worker's keys come through the keeper.

mod common;

use common::{connect, pattern, spoolctl, write_key, Spoold, BS};
use serde_json::json;

const CONFIG: &str = r#"
[encryption]
key_file = "@DIR@/kek"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[volumes]]
name = "sec"
size = "16M"
num_queues = 1
encrypt = true
"#;

/// The id `spoolctl volume rekey` reports for the key of `byte` (the key in use after it).
fn kek_of(d: &Spoold) -> String {
    let v = d.rpc("volume_show", json!({"id": "sec"})).unwrap();
    assert!(
        !v["socket"].is_null(),
        "sec is not served: {v}\n{}",
        d.log()
    );
    v["kek_id"].as_str().unwrap().to_string()
}

fn reads_back(d: &Spoold, salt: u64) {
    let mut c = connect(&d.socket("sec"), 1, false).unwrap();
    let (r, back) = c.read_sync(0, 0, BS);
    assert_eq!(r, 0);
    assert!(back == pattern(salt, 0, BS), "sec reads back other data");
}

#[test]
fn worker_restarts_in_either_rekey_window_keep_the_volume_served() {
    let mut d = Spoold::prepared(CONFIG);
    let dir = d.dir.path().to_path_buf();
    let kek = dir.join("kek");
    write_key(&kek, 0x11);
    d.spawn();
    let first = kek_of(&d);
    let mut c = connect(&d.socket("sec"), 1, false).unwrap();
    assert_eq!(c.write_sync(0, 0, &pattern(7, 0, BS)), 0);
    drop(c);

    // `rekey --key-file NEW`, then a worker restart before the config gives NEW.
    let new = dir.join("kek.new");
    write_key(&new, 0x33);
    let (ok, out, err) = spoolctl(
        &d,
        &["volume", "rekey", "--key-file", new.to_str().unwrap()],
    );
    assert!(ok, "{out}{err}");
    d.kill_worker();
    let second = kek_of(&d);
    assert_ne!(second, first, "the rekey's key is in use after the restart");
    reads_back(&d, 7);
    // The config catches up; another restart changes nothing.
    std::fs::copy(&new, &kek).unwrap();
    d.kill_worker();
    assert_eq!(kek_of(&d), second);
    reads_back(&d, 7);

    // The documented order: the next key where the config points, a restart, the rekey.
    write_key(&kek, 0x55);
    d.kill_worker();
    assert_eq!(kek_of(&d), second, "still wrapped under the key before");
    reads_back(&d, 7);
    let (ok, out, err) = spoolctl(&d, &["volume", "rekey"]);
    assert!(ok, "{out}{err}");
    d.kill_worker();
    let third = kek_of(&d);
    assert!(third != second && third != first);
    reads_back(&d, 7);
    assert!(!d.log().contains("volume not served"), "{}", d.log());

    // The whole daemon restarted: the configured key alone serves it now.
    d.stop();
    d.spawn();
    assert_eq!(kek_of(&d), third);
    reads_back(&d, 7);
}
