//! Malformed vhost-user messages close that connection only: the daemon keeps running, a
//! client of another volume keeps its I/O, and the same socket accepts a well-behaved client.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::{connect, pattern, Spoold};

const CFG: &str = r#"
[[devices]]
path = "@DIR@/d0.img"
create_size = "40M"
[[volumes]]
name = "victim"
size = "8M"
num_queues = 1
[[volumes]]
name = "target"
size = "8M"
num_queues = 1
"#;

fn msg(code: u32, payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&code.to_le_bytes());
    m.extend_from_slice(&1u32.to_le_bytes()); // version 1
    m.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    m.extend_from_slice(payload);
    m
}

/// Sends `bytes` and reports whether the server closed the connection within a few seconds.
fn closed_after(sock: &std::path::Path, bytes: &[u8]) -> bool {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue, // replies to valid messages
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn malformed_messages_close_only_that_connection() {
    let mut d = Spoold::start(CFG);
    let mut victim = connect(&d.socket("victim"), 1, false).unwrap();
    assert_eq!(victim.write_sync(0, 0, &pattern(1, 0, 4096)), 0);

    let get_features = msg(1, &[]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", (0..64u8).map(|i| i.wrapping_mul(37)).collect()),
        ("unknown request code", msg(9999, &[])),
        ("oversized length", {
            let mut m = msg(5, &[]);
            m[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
            m
        }),
        ("bad version", {
            let mut m = msg(1, &[]);
            m[4..8].copy_from_slice(&7u32.to_le_bytes());
            m
        }),
        ("queue index out of range", {
            let mut m = get_features.clone();
            let mut p = Vec::new();
            p.extend_from_slice(&99u32.to_le_bytes());
            p.extend_from_slice(&256u32.to_le_bytes());
            m.extend(msg(8, &p)); // SET_VRING_NUM
            m
        }),
        ("queue size not a power of two", {
            let mut p = Vec::new();
            p.extend_from_slice(&0u32.to_le_bytes());
            p.extend_from_slice(&100u32.to_le_bytes());
            msg(8, &p)
        }),
        ("memory table without fds", {
            let mut p = vec![0u8; 8 + 32];
            p[0] = 1; // one region, but no file descriptor attached
            msg(5, &p)
        }),
        ("truncated payload", msg(2, &[1, 2, 3])), // SET_FEATURES needs 8 bytes
    ];
    for (name, bytes) in cases {
        assert!(
            closed_after(&d.socket("target"), &bytes),
            "{name}: connection not closed"
        );
        assert!(d.running(), "{name}: spoold died\n{}", d.log());
        // The victim on another volume is unaffected.
        let (r, data) = victim.read_sync(0, 0, 4096);
        assert_eq!(r, 0, "{name}");
        assert!(data == pattern(1, 0, 4096), "{name}");
    }
    // The attacked socket still serves a well-behaved client.
    let mut c = connect(&d.socket("target"), 1, false).unwrap();
    assert_eq!(c.write_sync(0, 4096, &pattern(2, 4096, 4096)), 0);
    let (r, data) = c.read_sync(0, 4096, 4096);
    assert_eq!(r, 0);
    assert!(data == pattern(2, 4096, 4096));
}
