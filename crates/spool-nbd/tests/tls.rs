//! TLS on the server and the client: credentials made by `openssl` in QEMU's
//! `tls-creds-x509` layout; `nbdinfo`, `nbdcopy` and `qemu-img` read an export over
//! `nbds://` with a client certificate; a client without TLS, without a certificate or with
//! one another CA signed gets nothing; our own client reads it over TLS.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use spool_nbd::tls::{ClientTls, ServerTls};
use spool_nbd::{client, Export, Listen, Server};

const SIZE: usize = 1 << 20;

/// 1 MiB, byte `i` holding `i % 251`.
struct Pattern;

impl Export for Pattern {
    fn name(&self) -> &str {
        "vol@snap"
    }
    fn size(&self) -> u64 {
        SIZE as u64
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = ((offset as usize + i) % 251) as u8;
        }
        Ok(())
    }
    fn extent(&self) -> u64 {
        64 << 10
    }
    fn allocated(&self, _: u64) -> bool {
        true
    }
    fn base(&self) -> Option<&str> {
        None
    }
    fn changed(&self, _: u64) -> bool {
        false
    }
}

/// A new CA and its server (127.0.0.1, localhost) and client certificates in `dir`, made by
/// `scripts/tls-certs.sh` (openssl).
fn credentials(dir: &Path) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/tls-certs.sh");
    let out = Command::new(script).arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A directory holding only `files` of `from` (what one side is given).
fn subset(from: &Path, to: &Path, files: &[&str]) {
    std::fs::create_dir_all(to).unwrap();
    for f in files {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
}

fn output(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
#[ignore = "needs openssl, nbdinfo, nbdcopy and qemu-img (scripts/install-deps.sh installs them)"]
fn standard_clients_read_an_export_over_tls_and_others_get_nothing() {
    let d = tempfile::tempdir().unwrap();
    let all = d.path().join("all");
    credentials(&all);
    let (server, good) = (d.path().join("server"), d.path().join("client"));
    subset(
        &all,
        &server,
        &["ca-cert.pem", "server-cert.pem", "server-key.pem"],
    );
    subset(
        &all,
        &good,
        &["ca-cert.pem", "client-cert.pem", "client-key.pem"],
    );
    // Trusts the server, presents no certificate.
    let anonymous = d.path().join("anonymous");
    subset(&all, &anonymous, &["ca-cert.pem"]);
    // A certificate another CA signed.
    let stranger = d.path().join("stranger");
    credentials(&stranger);
    std::fs::copy(all.join("ca-cert.pem"), stranger.join("ca-cert.pem")).unwrap();

    let tls = ServerTls::load(&server).unwrap();
    assert!(
        tls.client_certs,
        "a CA in the directory: client certificates required"
    );
    let listen = Listen::parse("127.0.0.1:0").unwrap();
    let s = Server::start_tls(listen, None, Arc::new(Pattern), None, Some(tls)).unwrap();
    let uri = |dir: &Path| {
        format!(
            "nbds://{}/vol@snap?tls-certificates={}",
            s.listen,
            dir.display()
        )
    };

    let (ok, info) = output(Command::new("nbdinfo").arg(uri(&good)));
    assert!(ok && info.contains("1048576"), "{info}");
    let copy = d.path().join("copy.img");
    let (ok, out) = output(Command::new("nbdcopy").arg(uri(&good)).arg(&copy));
    assert!(ok, "{out}");
    let mut want = vec![0u8; SIZE];
    Pattern.read_at(&mut want, 0).unwrap();
    assert!(
        std::fs::read(&copy).unwrap() == want,
        "nbdcopy read other bytes"
    );
    let (ok, out) = output(Command::new("qemu-img").args([
        "info",
        "--object",
        &format!(
            "tls-creds-x509,id=tls0,endpoint=client,dir={}",
            good.display()
        ),
        "--image-opts",
        &format!(
            "driver=nbd,host=127.0.0.1,port={},export=vol@snap,tls-creds=tls0",
            s.listen.to_string().rsplit_once(':').unwrap().1
        ),
    ]));
    assert!(ok && out.contains("1 MiB"), "{out}");

    // No TLS: refused at the first option. No certificate, or another CA's: the handshake fails.
    let plain = format!("nbd://{}/vol@snap", s.listen);
    let (ok, out) = output(Command::new("nbdinfo").arg(&plain));
    assert!(!ok, "read without TLS: {out}");
    for dir in [&anonymous, &stranger] {
        let (ok, out) = output(Command::new("nbdinfo").arg(uri(dir)));
        assert!(!ok, "read with the credentials of {}: {out}", dir.display());
    }

    // Our client, as a spoold sending to another's export.
    spool_nbd::tls::set_client(ClientTls::load(&good).unwrap());
    let t = client::Target::parse(&format!("nbds://{}/vol@snap", s.listen)).unwrap();
    let mut c = client::connect(&t, std::time::Duration::from_secs(10)).unwrap();
    assert_eq!(c.size, SIZE as u64);
    use std::io::{Read, Write};
    c.stream
        .write_all(&client::request(0, 9, 4096, 8192))
        .unwrap();
    assert_eq!(client::read_reply(&mut c.stream).unwrap(), (9, 0));
    let mut got = vec![0u8; 8192];
    c.stream.read_exact(&mut got).unwrap();
    assert!(got[..] == want[4096..4096 + 8192]);
}
