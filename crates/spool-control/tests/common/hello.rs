//! A sender's side of the transfer hello done by hand (docs/transfer.md): the listener's
//! challenge read, a hello proved with a token (or not) sent, the answer returned, so tests
//! can say what a real spoold never would.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use spool_control::api::TransferHello;

/// Connects to the transfer listener at `to`, reads its challenge and sends `line(nonce)`;
/// returns all the listener answered.
pub fn say_raw(to: &str, line: impl FnOnce(&str) -> String) -> String {
    let s = TcpStream::connect(to).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut challenge = String::new();
    r.read_line(&mut challenge).unwrap();
    let c: serde_json::Value = serde_json::from_str(&challenge).unwrap();
    assert_eq!(c["version"], 2, "{challenge}");
    let nonce = c["nonce"].as_str().unwrap().to_string();
    (&s).write_all(line(&nonce).as_bytes()).unwrap();
    let mut answer = String::new();
    r.read_to_string(&mut answer).unwrap();
    answer
}

/// Hello `h` for challenge `nonce` as one line, proved with `token`.
pub fn proved(token: &str, nonce: &str, mut h: TransferHello) -> String {
    h.nonce = nonce.into();
    h.proof = spool_control::daemon::hello_proof(token, &h);
    format!("{}\n", serde_json::to_string(&h).unwrap())
}

/// A hello for a plain volume `name` of `size` bytes, one queue and one copy (nonce and
/// proof still empty).
pub fn plain(name: &str, size: u64) -> TransferHello {
    TransferHello {
        version: spool_control::api::TRANSFER_VERSION,
        nonce: String::new(),
        sender_nonce: "5e".repeat(32),
        proof: String::new(),
        volume: name.into(),
        size,
        num_queues: 1,
        copies: 1,
        qos: None,
        key: None,
        thin: false,
        replica: false,
        epoch: 0,
        current: false,
        ask: false,
    }
}

/// Says hello `h` proved with `token`, as a spoold would; the answer.
pub fn say(to: &str, token: &str, h: TransferHello) -> String {
    say_raw(to, |nonce| proved(token, nonce, h))
}
