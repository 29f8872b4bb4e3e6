//! Fuzzes the NBD server (`spool_nbd::serve_io`) with whatever a client may send: the input
//! is the client's whole byte stream (flags, options, requests), served against a small
//! in-memory export with holes and a dirty bitmap, read-only or (when the input's first byte
//! is odd) writable. It must never panic, never read or write outside the export, and never
//! answer with more than the requests asked for.
#![no_main]

use std::io::Cursor;
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

use libfuzzer_sys::fuzz_target;
use spool_nbd::{serve_io, Export};

const EXTENT: u64 = 4096;

struct Mem(Mutex<Vec<u8>>, bool);

impl Export for Mem {
    fn name(&self) -> &str {
        "v@s"
    }
    fn size(&self) -> u64 {
        self.0.lock().unwrap().len() as u64
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let d = self.0.lock().unwrap();
        let end = offset as usize + buf.len();
        assert!(end <= d.len(), "a read past the export: {offset} + {}", buf.len());
        buf.copy_from_slice(&d[offset as usize..end]);
        Ok(())
    }
    fn writable(&self) -> bool {
        self.1
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        assert!(self.1, "a write to a read-only export");
        let mut d = self.0.lock().unwrap();
        let end = offset as usize + buf.len();
        assert!(end <= d.len(), "a write past the export: {offset} + {}", buf.len());
        d[offset as usize..end].copy_from_slice(buf);
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
    let writable = data.first().is_some_and(|b| b & 1 == 1);
    let e = Mem(Mutex::new(vec![0x5a; 10 * 4096 + 512]), writable);
    let mut out = Vec::new();
    let stop = AtomicBool::new(false);
    let _ = serve_io(&mut Cursor::new(data), &mut out, &e, &stop);
    // Replies are bounded by what was asked: at most one read's worth (32 MiB) per request
    // header in the input, and far less in practice.
    assert!(out.len() <= 64 + data.len() * 1024 + (data.len() / 28 + 1) * (32 << 20));
});
