//! The transfer hello against someone on the path or at the sender's address, without TLS
//! (docs/transfer.md, "What the hello proves"): the token never crosses the network, a
//! captured hello neither replays nor survives a change (a size raised, a data key
//! stripped), a listener that does not hold the token gets nothing sent to it, and
//! `volume receive --max-size` bounds what a token's holder may create.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use common::{ctl, ctl_err, hello, transfer_port, wait_current, Spoold, CONFIG, LISTENING};
use spool_control::api;

const TOKEN: &str = "0123456789abcdef0123";

/// A relay on a port of its own to `to`, for one connection: what the sender said
/// (everything it wrote, until the connection closed) lands in the returned buffer.
fn relay(to: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap().to_string();
    let said = Arc::new(Mutex::new(Vec::new()));
    let keep = said.clone();
    std::thread::spawn(move || {
        let (from, _) = l.accept().unwrap();
        let up = TcpStream::connect(&to).unwrap();
        let (mut from2, mut up2) = (from.try_clone().unwrap(), up.try_clone().unwrap());
        let back = std::thread::spawn(move || std::io::copy(&mut up2, &mut from2));
        let mut buf = [0u8; 4096];
        let mut from = from;
        let mut up = up;
        while let Ok(n @ 1..) = from.read(&mut buf) {
            keep.lock().unwrap().extend_from_slice(&buf[..n]);
            if up.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = up.shutdown(std::net::Shutdown::Write);
        let _ = back.join();
    });
    (at, said)
}

/// A transfer listener played by `f` for one connection; its address.
fn listener_by_hand(f: impl FnOnce(TcpStream) + Send + 'static) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || f(l.accept().unwrap().0));
    at
}

#[test]
fn a_captured_hello_opens_nothing_and_cannot_be_altered() {
    let a = Spoold::start(CONFIG);
    let b = Spoold::start(LISTENING);
    let to = format!("127.0.0.1:{}", transfer_port(&b));
    ctl(&b, &["volume", "receive", "v", "--token", TOKEN]);
    let (via, said) = relay(to.clone());
    ctl(&a, &["volume", "send", "v", "--to", &via, "--token", TOKEN]);
    wait_current(&a, &b);
    let said = String::from_utf8(said.lock().unwrap().clone()).unwrap();
    assert!(
        !said.contains(TOKEN),
        "the token crossed the network: {said}"
    );
    let captured: api::TransferHello = serde_json::from_str(said.trim()).unwrap();

    // Replayed as it was, while the expectation stands: not this challenge's.
    let line = format!("{}\n", serde_json::to_string(&captured).unwrap());
    let answer = hello::say_raw(&to, |_| line.clone());
    assert!(
        answer.contains("does not answer this listener's challenge"),
        "{answer}"
    );
    // With the new challenge's nonce put in, the proof no longer holds; nor with the size
    // raised (the token's holder asked for 16M).
    let answer = hello::say_raw(&to, |n| {
        let mut h = captured.clone();
        h.nonce = n.into();
        format!("{}\n", serde_json::to_string(&h).unwrap())
    });
    assert!(
        answer.contains("no transfer of volume 'v' with that token"),
        "{answer}"
    );
    let raised = hello::say_raw(&to, |n| {
        let mut line = hello::proved(TOKEN, n, hello::plain("v", 16 << 20));
        line = line.replace("16777216", "1073741824");
        line
    });
    assert!(
        raised.contains("no transfer of volume 'v' with that token"),
        "{raised}"
    );
    // A sender nonce that is not 32 bytes in hex is refused, proved or not.
    for bad in ["", "zz", &"ab".repeat(31), &"ab".repeat(33)] {
        let mut h = hello::plain("v", 16 << 20);
        h.sender_nonce = bad.to_string();
        let answer = hello::say(&to, TOKEN, h);
        assert!(
            answer.contains("no nonce of the sender's own"),
            "{bad:?}: {answer}"
        );
    }
    // The real sender's hello again (a send resumed) gets the same export.
    let again = hello::say(&to, TOKEN, hello::plain("v", 16 << 20));
    assert!(again.contains("\"nbd\":\"nbd://127.0.0.1:"), "{again}");
}

/// An encrypted volume's hello with its data key taken out on the way: refused, and B
/// creates no plain volume in its place.
#[test]
fn a_hello_whose_data_key_was_stripped_is_refused() {
    let b = Spoold::start(LISTENING);
    let to = format!("127.0.0.1:{}", transfer_port(&b));
    ctl(&b, &["volume", "receive", "v", "--token", TOKEN]);
    let answer = hello::say_raw(&to, |n| {
        let mut h = hello::plain("v", 16 << 20);
        h.key = Some(api::TransferKey {
            cipher: "aes-xts-plain64".into(),
            kek_id: "00".repeat(8),
            wrapped: "ab".repeat(72),
            tag: "cd".repeat(32),
        });
        let mut stripped: api::TransferHello =
            serde_json::from_str(&hello::proved(TOKEN, n, h)).unwrap();
        stripped.key = None;
        format!("{}\n", serde_json::to_string(&stripped).unwrap())
    });
    assert!(
        answer.contains("no transfer of volume 'v' with that token"),
        "{answer}"
    );
    ctl_err(&b, &["volume", "show", "v"]);
}

/// A listener that does not hold the token (an on-path party answering in B's place, or a
/// host given another token) answers with an export of its own, and one that replays an
/// answer B gave to an earlier hello (its proof made for another sender nonce): A sends
/// nothing there either way.
#[test]
fn a_sender_sends_only_where_the_token_holder_answered() {
    let a = Spoold::start(CONFIG);
    let forge = |token: &'static str, replayed: bool| {
        listener_by_hand(move |s| {
            let mut r = BufReader::new(s.try_clone().unwrap());
            let nonce = "11".repeat(32);
            (&s).write_all(format!("{{\"version\":2,\"nonce\":\"{nonce}\"}}\n").as_bytes())
                .unwrap();
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            let mut h: api::TransferHello = serde_json::from_str(&line).unwrap();
            if replayed {
                h.sender_nonce = "22".repeat(32); // the hello the recorded answer was for
            }
            let uri = "nbd://127.0.0.1:9/x";
            let proof = spool_control::daemon::answer_proof(token, &h, uri);
            let reply = format!("{{\"nbd\":\"{uri}\",\"proof\":\"{proof}\"}}\n");
            (&s).write_all(reply.as_bytes()).unwrap();
        })
    };
    for at in [forge("another-token-0123", false), forge(TOKEN, true)] {
        let e = ctl_err(&a, &["volume", "send", "v", "--to", &at, "--token", TOKEN]);
        assert!(e.contains("does not prove it holds the token"), "{e}");
        assert!(!ctl(&a, &["volume", "show", "v"]).contains("nbd://127.0.0.1:9"));
    }
    // The same listener answering this hello with the token's proof is believed.
    let at = forge(TOKEN, false);
    let e = ctl_err(&a, &["volume", "send", "v", "--to", &at, "--token", TOKEN]);
    assert!(!e.contains("does not prove"), "{e}");
}

/// A spoold of transfer version 1 (it waits for the hello, then says it got none) is
/// named as such, not answered with a bad hello.
#[test]
fn a_listener_of_the_old_version_is_named() {
    let a = Spoold::start(CONFIG);
    let at = listener_by_hand(|s| {
        std::thread::sleep(std::time::Duration::from_millis(200));
        let _ = (&s).write_all(b"{\"error\":\"no hello (no complete line in time)\"}\n");
    });
    let e = ctl_err(&a, &["volume", "send", "v", "--to", &at, "--token", TOKEN]);
    assert!(
        e.contains("may be a spoold older than transfer version 2"),
        "{e}"
    );
}

/// `volume receive --max-size`: a sender whose volume is larger is refused before anything
/// is created; one within the bound is received.
#[test]
fn max_size_bounds_what_a_sender_creates() {
    let b = Spoold::start(LISTENING);
    let to = format!("127.0.0.1:{}", transfer_port(&b));
    let e = ctl_err(
        &b,
        &[
            "volume",
            "receive",
            "v",
            "--nbd",
            "unix:/tmp/x.nbd",
            "--max-size",
            "8M",
        ],
    );
    assert!(e.contains("cannot be used with"), "{e}");
    ctl(
        &b,
        &[
            "volume",
            "receive",
            "v",
            "--token",
            TOKEN,
            "--max-size",
            "8M",
        ],
    );
    let answer = hello::say(&to, TOKEN, hello::plain("v", 16 << 20));
    assert!(
        answer.contains("more than the 8388608 this host allows"),
        "{answer}"
    );
    ctl_err(&b, &["volume", "show", "v"]);
    let answer = hello::say(&to, TOKEN, hello::plain("v", 8 << 20));
    assert!(answer.contains("\"nbd\":\"nbd://127.0.0.1:"), "{answer}");
    assert!(ctl(&b, &["volume", "show", "v"]).contains(" 8M "));
}
