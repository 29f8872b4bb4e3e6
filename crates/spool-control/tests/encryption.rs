//! Encrypted volumes (docs/encryption.md) through the real spoold and the real libblkio
//! client: writes through worker SIGKILLs (the journal resubmits them, encrypted again) leave
//! only ciphertext on the device while a plain volume beside it holds its plaintext; the
//! ciphertext is dm-crypt's `aes-xts-plain64` for the volume's sectors, checked with OpenSSL's
//! AES-XTS (Python's `cryptography`: this kernel has no device-mapper, so `cryptsetup open`
//! itself cannot run here) and the key `spoold --export-key` writes; a wrong key-encryption
//! key refuses the volume, touches nothing and leaves the other volume served; a rekey
//! rewraps the key under a new one and erases the old wrapping from both metadata slots;
//! deleting the volume erases its wrapped key (crypto-erase).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use common::{
    connect, kill_workers_holding_a_write, pattern, spoolctl, write_key, write_rounds_until,
    Spoold, BS, RECOVERED,
};
use serde_json::json;

fn config() -> String {
    r#"
[encryption]
key_file = "@DIR@/kek"
[[devices]]
path = "@DIR@/d0.img"
create_size = "64M"
[[volumes]]
name = "sec"
size = "16M"
num_queues = 2
encrypt = true
[[volumes]]
name = "plain"
size = "16M"
num_queues = 2
"#
    .into()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Whether any 512-byte sector of `img` starts like a sector of `data` (where plaintext would
/// land: volumes and their writes are sector aligned on the device).
fn leaks(img: &[u8], data: &[Vec<u8>]) -> bool {
    let sectors: std::collections::HashSet<&[u8]> = data
        .iter()
        .flat_map(|d| d.chunks_exact(512).map(|s| &s[..64]))
        .collect();
    img.chunks_exact(512).any(|s| sectors.contains(&s[..64]))
}

/// OpenSSL's AES-XTS (Python `cryptography`), sector by sector with the sector number as a
/// 16-byte little-endian IV: dm-crypt's aes-xts-plain64. Decrypts `sectors` sectors of
/// `device` from byte `at` with the 64-byte key in `key`.
fn openssl_decrypt(key: &Path, device: &Path, at: u64, sectors: u64) -> Vec<u8> {
    let script = r#"
import sys
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
key = open(sys.argv[1], 'rb').read()
at, n = int(sys.argv[3]), int(sys.argv[4])
out = bytearray()
with open(sys.argv[2], 'rb') as f:
    f.seek(at)
    data = f.read(n * 512)
for s in range(n):
    d = Cipher(algorithms.AES(key), modes.XTS(s.to_bytes(16, 'little'))).decryptor()
    out += d.update(data[s * 512:(s + 1) * 512]) + d.finalize()
sys.stdout.buffer.write(out)
"#;
    let out = Command::new("/usr/bin/python3")
        .args(["-c", script])
        .arg(key)
        .arg(device)
        .arg(at.to_string())
        .arg(sectors.to_string())
        .output()
        .expect("python3 (install-deps installs python3-cryptography)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// `spoold --export-key`: writes the key to `out`, returns the volume's byte offset from the
/// `cryptsetup` line it prints.
fn export_key(d: &Spoold, out: &Path) -> u64 {
    export_key_of(d, "sec", out, None)
}

/// `spoold --export-key VOLUME`, reading `device` (default: the config's first).
fn export_key_of(d: &Spoold, volume: &str, out: &Path, device: Option<&Path>) -> u64 {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spoold"));
    cmd.arg("--config").arg(&d.config);
    cmd.envs(d.envs.iter().map(|(k, v)| (k, v)));
    cmd.args(["--export-key", volume, "--key-out"]).arg(out);
    if let Some(dev) = device {
        cmd.arg("--device").arg(dev);
    }
    let o = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("cryptsetup open --type plain"))
        .unwrap();
    assert!(
        line.contains("--cipher aes-xts-plain64 --key-size 512"),
        "{line}"
    );
    let offset: u64 = line
        .split("--offset ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        std::fs::metadata(out).unwrap().permissions().mode() & 0o777,
        0o600
    );
    offset * 512
}

fn wrapped_key(d: &Spoold) -> String {
    // Only the wrapping is ever on the device: read it back from the metadata as written.
    let img = std::fs::read(d.dir.path().join("d0.img")).unwrap();
    let meta = String::from_utf8_lossy(&img[..1 << 20]).to_string();
    let at = meta
        .find("\"wrapped\":\"")
        .expect("a wrapped key in the metadata")
        + 11;
    meta[at..at + 144].to_string()
}

#[test]
fn an_encrypted_volume_stores_only_ciphertext_and_its_keys_rotate_and_erase() {
    let mut d = Spoold::prepared(&config());
    let dir = d.dir.path().to_path_buf();
    let (kek, dev) = (dir.join("kek"), dir.join("d0.img"));
    write_key(&kek, 0x11);
    d.spawn();
    let d = Arc::new(d);

    // Writes through worker kills: the journal resubmits them through the cipher again.
    let mut c = connect(&d.socket("sec"), 2, false).unwrap();
    let killer = kill_workers_holding_a_write(d.clone(), dev.to_str().unwrap(), 2, 8);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let rounds = std::thread::scope(|s| {
        let h = s.spawn(|| {
            write_rounds_until(
                &mut c,
                &|| stop.load(std::sync::atomic::Ordering::Relaxed),
                4,
            )
        });
        killer.join().unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        h.join().unwrap()
    });
    assert!(
        d.log().contains(RECOVERED),
        "no kill caught a write in flight"
    );
    drop(c);
    let last = rounds - 1;
    // The plain volume beside it: its plaintext is on the device, so the scan can see one.
    let mut p = connect(&d.socket("plain"), 2, false).unwrap();
    assert_eq!(p.write_sync(0, 0, &pattern(999, 0, BS)), 0);
    drop(p);
    let img = std::fs::read(&dev).unwrap();
    assert!(
        leaks(&img, &[pattern(999, 0, BS)]),
        "the scan finds the plain volume's data"
    );
    let written: Vec<Vec<u8>> = (0..64u64)
        .map(|blk| pattern(last, blk * BS as u64, BS))
        .collect();
    assert!(
        !leaks(&img, &written),
        "plaintext of the encrypted volume reached the device"
    );

    // The layout is dm-crypt's aes-xts-plain64, read with OpenSSL and the exported key.
    let key_out = dir.join("sec.key");
    let at = export_key(&d, &key_out);
    let plain = openssl_decrypt(&key_out, &dev, at, (64 * BS / 512) as u64);
    for blk in 0..64usize {
        assert!(
            plain[blk * BS..(blk + 1) * BS] == pattern(last, (blk * BS) as u64, BS)[..],
            "block {blk}: not aes-xts-plain64 of the volume's sectors"
        );
    }

    // A wrong key-encryption key: the volume is refused, its bytes untouched, the other served.
    let mut d = Arc::into_inner(d).unwrap();
    d.stop();
    let before = std::fs::read(&dev).unwrap()[at as usize..at as usize + (16 << 20)].to_vec();
    write_key(&kek, 0x22);
    d.spawn();
    let v = d.rpc("volume_show", json!({"id": "sec"})).unwrap();
    assert_eq!(v["socket"], serde_json::Value::Null, "{v}");
    let why = v["not_served"].as_str().unwrap_or_default();
    assert!(why.contains("key-encryption key"), "{v}");
    assert!(d.log().contains("volume not served"), "{}", d.log());
    let mut p = connect(&d.socket("plain"), 2, false).unwrap();
    assert!(p.read_sync(0, 0, BS).1 == pattern(999, 0, BS));
    drop(p);
    let (_, out, _) = spoolctl(&d, &["volume", "show", "sec"]);
    assert!(
        out.contains("not-served") && out.contains("not served:"),
        "{out}"
    );
    d.stop();
    let after = std::fs::read(&dev).unwrap()[at as usize..at as usize + (16 << 20)].to_vec();
    assert!(before == after, "a refused volume's data changed");

    // The right key again; then a rekey to a new one, with no data touched.
    write_key(&kek, 0x11);
    d.spawn();
    let old_wrapping = wrapped_key(&d);
    let new_kek = dir.join("kek.new");
    write_key(&new_kek, 0x33);
    let (ok, out, err) = spoolctl(
        &d,
        &["volume", "rekey", "--key-file", new_kek.to_str().unwrap()],
    );
    assert!(ok, "{out}{err}");
    assert!(out.contains("1 data keys rewrapped"), "{out}");
    // The volume names the key-encryption key it is wrapped under now (an id, never a key).
    let kek_of = |d: &Spoold| d.rpc("volume_show", json!({"id": "sec"})).unwrap()["kek_id"].clone();
    let now = kek_of(&d);
    assert!(out.contains(now.as_str().unwrap()), "{out} {now}");
    let (_, shown, _) = spoolctl(&d, &["volume", "show", "sec"]);
    assert!(
        shown.contains(&format!("key-encryption key {}", now.as_str().unwrap())),
        "{shown}"
    );
    let img = std::fs::read(&dev).unwrap();
    assert!(
        !contains(&img[..1 << 20], old_wrapping.as_bytes()),
        "the old wrapping survived in a metadata slot"
    );
    assert!(
        img[at as usize..at as usize + (16 << 20)] == before[..],
        "a rekey touched data"
    );
    d.stop();
    std::fs::copy(&new_kek, &kek).unwrap();
    d.spawn();
    let mut c = connect(&d.socket("sec"), 2, false).unwrap();
    let (r, back) = c.read_sync(0, 0, BS);
    assert_eq!(r, 0);
    assert!(
        back == pattern(last, 0, BS),
        "data unreadable after the rekey"
    );
    drop(c);

    // Crypto-erase: the wrapped key leaves both slots; the key can no longer be exported.
    let wrapping = wrapped_key(&d);
    let (ok, out, err) = spoolctl(&d, &["volume", "delete", "sec", "--force"]);
    assert!(ok, "{out}{err}");
    let img = std::fs::read(&dev).unwrap();
    assert!(
        !contains(&img[..1 << 20], wrapping.as_bytes()),
        "the wrapped key survived the delete"
    );
    let o = Command::new(env!("CARGO_BIN_EXE_spoold"))
        .arg("--config")
        .arg(&d.config)
        .args(["--export-key", "sec", "--key-out"])
        .arg(dir.join("gone.key"))
        .output()
        .unwrap();
    assert!(!o.status.success());
}

/// Bad input loses nothing: a key file others can read, two key sources, encryption without
/// any key, an RBD volume asked to be encrypted.
#[test]
fn bad_keys_and_settings_get_clear_errors() {
    let mut d = Spoold::prepared(&config());
    let kek = d.dir.path().join("kek");
    write_key(&kek, 0x44);
    std::fs::set_permissions(&kek, std::fs::Permissions::from_mode(0o644)).unwrap();
    // The configured volume cannot be created without a key: spoold says why and stops.
    let o = Command::new(env!("CARGO_BIN_EXE_spoold"))
        .arg("--config")
        .arg(&d.config)
        .arg("--no-keeper")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("chmod 600"), "{err}");
    assert!(err.contains("no key-encryption key"), "{err}");
    std::fs::set_permissions(&kek, std::fs::Permissions::from_mode(0o600)).unwrap();
    d.spawn();
    let e = d
        .rpc(
            "volume_create",
            json!({"name": "r", "size": "1M", "rbd": "rbd", "encrypt": true}),
        )
        .unwrap_err();
    assert!(e.message.contains("cannot be encrypted"), "{e:?}");
    let (ok, out, err) = spoolctl(&d, &["volume", "create", "more", "4M", "--encrypt"]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("encryption: aes-xts-plain64"), "{out}");
    let (ok, _, err) = spoolctl(&d, &["volume", "rekey"]);
    assert!(
        !ok && err.contains("the new key is the key in use"),
        "{err}"
    );
    let bad = d.dir.path().join("bad.toml");
    let text = std::fs::read_to_string(&d.config).unwrap();
    std::fs::write(
        &bad,
        text.replace("[encryption]\n", "[encryption]\nkey_command = \"cat x\"\n"),
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_spoold"))
        .arg("--config")
        .arg(&bad)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("give one of key_file, credential and key_command"),
        "{err}"
    );
}

/// The key from a systemd credential; an encrypted volume becomes a mirror (its new copy is
/// rebuilt from ciphertext, without the key) and grows (its queues reopen with the new
/// segments' tweaks): the data reads back, the copies agree, and neither device holds any of
/// the plaintext.
#[test]
fn an_encrypted_volume_is_mirrored_and_grown_with_ciphertext_only() {
    let mut d = Spoold::prepared(
        r#"
[encryption]
credential = "spool-kek"
[[devices]]
path = "@DIR@/d0.img"
create_size = "48M"
[[devices]]
path = "@DIR@/d1.img"
create_size = "48M"
[[volumes]]
name = "e"
size = "8M"
num_queues = 2
encrypt = true
"#,
    );
    let dir = d.dir.path().to_path_buf();
    let creds = dir.join("creds");
    std::fs::create_dir(&creds).unwrap();
    write_key(&creds.join("spool-kek"), 0x55);
    d.envs
        .push(("CREDENTIALS_DIRECTORY".into(), creds.display().to_string()));
    d.spawn();
    assert!(d
        .log()
        .contains("key-encryption key loaded from the credential spool-kek"));
    let mut c = connect(&d.socket("e"), 2, false).unwrap();
    let rounds = write_rounds_until(&mut c, &|| true, 2);
    drop(c);
    let (ok, out, err) = spoolctl(&d, &["volume", "mirror", "add", "e"]);
    assert!(ok, "{out}{err}");
    let healthy_now = |d: &Spoold| {
        let m = d.rpc("volume_show", json!({"id": "e"})).unwrap()["mirror"].clone();
        m["state"] == json!("healthy")
            && m["legs"]
                .as_array()
                .unwrap()
                .iter()
                .all(|l| l["state"] == json!("current"))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !healthy_now(&d) {
        assert!(
            std::time::Instant::now() < deadline,
            "never rebuilt: {}",
            d.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Either copy alone recovers the volume with cryptsetup's layout and the exported key.
    for (i, dev) in ["d0.img", "d1.img"].iter().enumerate() {
        let key = dir.join(format!("e{i}.key"));
        let at = export_key_of(&d, "e", &key, Some(&dir.join(dev)));
        let plain = openssl_decrypt(&key, &dir.join(dev), at, (64 * BS / 512) as u64);
        for blk in 0..64usize {
            let want = pattern(rounds - 1, (blk * BS) as u64, BS);
            assert!(
                plain[blk * BS..(blk + 1) * BS] == want[..],
                "{dev}: block {blk}"
            );
        }
    }
    let (ok, out, err) = spoolctl(&d, &["volume", "resize", "e", "16M"]);
    assert!(ok, "{out}{err}");
    let mut c = connect(&d.socket("e"), 2, false).unwrap();
    let tail = pattern(7, 12 << 20, BS);
    assert_eq!(c.write_sync(0, 12 << 20, &tail), 0);
    assert!(c.read_sync(1, 12 << 20, BS).1 == tail);
    for blk in 0..64u64 {
        let off = blk * BS as u64;
        let (r, data) = c.read_sync((blk % 2) as usize, off, BS);
        assert_eq!(r, 0);
        assert!(
            data == pattern(rounds - 1, off, BS),
            "block {blk} after rebuild and resize"
        );
    }
    drop(c);
    let v = d.rpc("volume_verify", json!({"id": "e"})).unwrap();
    assert_eq!(v["regions_differing"], json!(0), "{v}");
    for dev in ["d0.img", "d1.img"] {
        let img = std::fs::read(dir.join(dev)).unwrap();
        let mut written: Vec<Vec<u8>> = (0..64u64)
            .map(|blk| pattern(rounds - 1, blk * BS as u64, BS))
            .collect();
        written.push(tail.clone());
        assert!(!leaks(&img, &written), "{dev} holds plaintext");
    }
}
