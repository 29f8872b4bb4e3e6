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

/// Before TLS a server answers nothing but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT`: any
/// other option is refused with `NBD_REP_ERR_TLS_REQD` (nothing of the export said), one
/// longer than any option before TLS ends the connection, and so does
/// `NBD_OPT_EXPORT_NAME` (it cannot be refused otherwise).
#[test]
#[ignore = "needs openssl (scripts/install-deps.sh installs it)"]
fn before_tls_only_starttls_is_answered() {
    use std::io::{Read, Write};
    let d = tempfile::tempdir().unwrap();
    credentials(d.path());
    let tls = ServerTls::load(d.path()).unwrap();
    let listen = Listen::parse("127.0.0.1:0").unwrap();
    let s = Server::start_tls(listen, None, Arc::new(Pattern), None, Some(tls)).unwrap();
    let opt = |n: u32, data: &[u8]| {
        let mut o = 0x4948_4156_454f_5054u64.to_be_bytes().to_vec();
        o.extend_from_slice(&n.to_be_bytes());
        o.extend_from_slice(&(data.len() as u32).to_be_bytes());
        o.extend_from_slice(data);
        o
    };
    let open = || {
        let mut c = std::net::TcpStream::connect(s.listen.to_string()).unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(15)))
            .unwrap();
        let mut g = [0u8; 18];
        c.read_exact(&mut g).unwrap();
        c.write_all(&[0, 0, 0, 3]).unwrap();
        c
    };
    let closed = |c: &mut std::net::TcpStream| {
        let mut b = [0u8; 64];
        match c.read(&mut b) {
            Ok(0) => true,
            // A reset (unread bytes were pending) ends it too; a timeout does not.
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            Ok(_) => false,
        }
    };
    // NBD_OPT_GO for the export, NBD_OPT_LIST: refused, and the connection goes on.
    let mut c = open();
    let mut go = (8u32.to_be_bytes()).to_vec();
    go.extend_from_slice(b"vol@snap\0\0");
    for (n, data) in [(7u32, go.as_slice()), (3, &[][..])] {
        c.write_all(&opt(n, data)).unwrap();
        let mut r = [0u8; 20];
        c.read_exact(&mut r).unwrap();
        let kind = u32::from_be_bytes(r[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(r[16..20].try_into().unwrap());
        assert_eq!(kind, (1 << 31) + 5, "option {n}: NBD_REP_ERR_TLS_REQD");
        let mut msg = vec![0u8; len as usize];
        c.read_exact(&mut msg).unwrap();
    }
    // An option of 5000 bytes before TLS: the connection ends.
    c.write_all(&opt(3, &[0u8; 5000])).unwrap();
    assert!(closed(&mut c), "an oversized option was read");
    // NBD_OPT_EXPORT_NAME: closed, nothing of the export sent.
    let mut c = open();
    c.write_all(&opt(1, b"vol@snap")).unwrap();
    assert!(closed(&mut c), "NBD_OPT_EXPORT_NAME was answered");
}
