//! Fuzzes the NBD server (`spool_nbd::serve_io`) with whatever a client may send: the input
//! is the client's whole byte stream (flags, options, requests), served against a small
//! in-memory export with holes and a dirty bitmap. It must never panic, never read outside
//! the export, and never answer with more than the requests asked for.
#![no_main]

use std::io::Cursor;
use std::sync::atomic::AtomicBool;

use libfuzzer_sys::fuzz_target;
use spool_nbd::{serve_io, Export};

const EXTENT: u64 = 4096;

struct Mem(Vec<u8>);

impl Export for Mem {
    fn name(&self) -> &str {
        "v@s"
    }
    fn size(&self) -> u64 {
        self.0.len() as u64
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let end = offset as usize + buf.len();
        assert!(end <= self.0.len(), "a read past the export: {offset} + {}", buf.len());
        buf.copy_from_slice(&self.0[offset as usize..end]);
        Ok(())
    }
    fn extent(&self) -> u64 {
        EXTENT
    }
    fn allocated(&self, i: u64) -> bool {
        assert!(i < self.size().div_ceil(EXTENT), "extent {i} is past the export");
        i % 3 != 1
    }
    fn base(&self) -> Option<&str> {
        Some("b")
    }
    fn changed(&self, i: u64) -> bool {
        assert!(i < self.size().div_ceil(EXTENT), "extent {i} is past the export");
        i % 5 == 2
    }
}

fuzz_target!(|data: &[u8]| {
    // The export's size is not a multiple of the extent: the last one is partial.
    let e = Mem(vec![0x5a; 10 * 4096 + 512]);
    let mut out = Vec::new();
    let stop = AtomicBool::new(false);
    let _ = serve_io(&mut Cursor::new(data), &mut out, &e, &stop);
    // Replies are bounded by what was asked: at most one read's worth (32 MiB) per request
    // header in the input, and far less in practice.
    assert!(out.len() <= 64 + data.len() * 1024 + (data.len() / 28 + 1) * (32 << 20));
});
