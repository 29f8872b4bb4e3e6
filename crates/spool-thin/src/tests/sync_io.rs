//! A thin volume written and read through its synchronous calls (what a transfer from
//! another host writes with): unaligned writes land exactly, allocating chunks as a guest's
//! do; write-zeroes of whole chunks leave holes and give the chunks back; reads of holes
//! are zeroes; a range past the size is refused.

use super::{fixture, rw, CHUNK};
use crate::ThinBackend;

#[test]
fn synchronous_calls_allocate_write_exactly_and_zero_into_holes() {
    let f = fixture(8);
    let (thin, _) = f.open(4 * CHUNK);
    let t = ThinBackend::of(&thin).unwrap();
    // A hole reads zeroes and takes nothing.
    let mut buf = vec![0xffu8; 3000];
    thin.read_at(&mut buf, CHUNK + 100).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    assert_eq!(t.allocated(), 0);
    // Unaligned, across a chunk boundary: two chunks, the bytes around it untouched.
    let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8 + 1).collect();
    thin.write_at_durable(&data, CHUNK - 5000).unwrap();
    assert_eq!((t.allocated(), f.free()), (2 * CHUNK, 6));
    let mut q = thin.open_queue(4).unwrap();
    let mut around = vec![0u8; 16384];
    assert_eq!(rw(&mut *q, false, CHUNK - 8192, &mut around), 0);
    assert!(around[..3192].iter().all(|&b| b == 0), "before the write");
    assert!(around[3192..13192] == data[..], "the write");
    assert!(around[13192..].iter().all(|&b| b == 0), "after the write");
    // A second small write within one page keeps the first's bytes beside it.
    thin.write_at_durable(&[9u8; 10], CHUNK - 4000).unwrap();
    let mut back = vec![0u8; 10_000];
    thin.read_at(&mut back, CHUNK - 5000).unwrap();
    let mut want = data.clone();
    want[1000..1010].fill(9);
    assert!(back == want);
    // Zeroes over the first chunk and part of the second: the first becomes a hole.
    thin.zero_range(0, CHUNK + 100).unwrap();
    assert_eq!(t.allocated(), CHUNK);
    f.wait_free(7);
    thin.read_at(&mut back, CHUNK - 5000).unwrap();
    assert!(back[..5100].iter().all(|&b| b == 0));
    assert!(back[5100..] == want[5100..]);
    // Past the size: refused, nothing written.
    assert!(thin.write_at_durable(&[1u8; 512], 4 * CHUNK - 256).is_err());
    assert!(thin.zero_range(4 * CHUNK, 1).is_err());
    assert_eq!(t.allocated(), CHUNK);
}

#[test]
fn zeroes_of_a_few_bytes_take_no_chunk_in_a_hole_and_zero_exactly_elsewhere() {
    let f = fixture(8);
    let (thin, _) = f.open(4 * CHUNK);
    let t = ThinBackend::of(&thin).unwrap();
    // Unaligned edges in holes (one range within a page, one across a chunk boundary with
    // whole pages inside): nothing to write, nothing taken.
    thin.zero_range(100, 1000).unwrap();
    thin.zero_range(2 * CHUNK - 5000, 10_000).unwrap();
    assert_eq!((t.allocated(), f.free()), (0, 8));
    // In a mapped chunk the same edges are zeroed, and only they.
    thin.write_at_durable(&vec![7u8; 8192], 0).unwrap();
    assert_eq!(t.allocated(), CHUNK);
    thin.zero_range(100, 1000).unwrap();
    let mut back = vec![0u8; 8192];
    thin.read_at(&mut back, 0).unwrap();
    assert!(back[..100].iter().all(|&b| b == 7));
    assert!(back[100..1100].iter().all(|&b| b == 0));
    assert!(back[1100..].iter().all(|&b| b == 7));
    assert_eq!(t.allocated(), CHUNK);
    // Once the device shut down, a call fails: it opens no queue on a stopped device.
    t.shut_down();
    let e = thin.read_at(&mut back, 0).unwrap_err();
    assert!(e.to_string().contains("open a queue"), "{e}");
}
