//! Fuzzes the NBD client's side (`spool_nbd::client`) with whatever a server may send: the
//! input is the server's whole byte stream, answering the handshake a remote mirror leg
//! opens (`NBD_OPT_GO` for an export) and then simple reply headers. It must never panic
//! or hand the data path a request size it cannot use (whole sectors, at most 32 MiB). The
//! queues' reply reader (spool-devices `nbd/queue.rs`) is not driven here.
#![no_main]

use std::io::{Cursor, Read, Write};

use libfuzzer_sys::fuzz_target;
use spool_nbd::client::{handshake_io, read_reply};

/// A connection whose reads are the server's bytes and whose writes (the client's) go
/// nowhere but are counted.
struct Duplex<'a> {
    from_server: Cursor<&'a [u8]>,
    sent: usize,
}

impl Read for Duplex<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.from_server.read(buf)
    }
}

impl Write for Duplex<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.sent += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let mut s = Duplex {
        from_server: Cursor::new(data),
        sent: 0,
    };
    let Ok((_size, _flags, max_io)) = handshake_io(&mut s, "v") else {
        return;
    };
    // The data path splits requests by this: whole sectors, never more than 32 MiB.
    assert!(
        (512..=32 << 20).contains(&max_io) && max_io % 512 == 0,
        "max_io {max_io}"
    );
    // The client's half is bounded: its flags and one option.
    assert!(s.sent <= 4 + 16 + 4 + 1 + 2 + 2, "sent {}", s.sent);
    // Then reply headers (the queues' reader takes a read's data after its header).
    while let Ok((_cookie, _err)) = read_reply(&mut s.from_server) {}
});
