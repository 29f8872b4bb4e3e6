//! Cost of the journal on the request path, for `valgrind --tool=callgrind` (instruction
//! counts are repeatable where wall-clock time on a shared machine is not).
//!
//! Runs N requests through the production path minus the device, in rounds of BATCH requests
//! (one by default) as a worker's poll round does: the guest offers BATCH requests, they are taken from a
//! real virtqueue in guest memory (Algorithm 1 steps 1-6, then step 7 once for the round),
//! parsed, their status written, and completed as one batch (steps 10-14). BATCH 1 is a QD1
//! workload; at QD32 a poll round takes and completes several requests at once.
//!     cargo build --release --example journal_cost
//!     valgrind --tool=callgrind target/release/examples/journal_cost journal 200000 [BATCH]
//!     valgrind --tool=callgrind target/release/examples/journal_cost nojournal 200000 [BATCH]

use spool_frontend::hostmem::HostMap;
use spool_frontend::request::{parse, GuestMemory, Limits};
use spool_frontend::vring::JournaledQueue;
use spool_journal::{Journal, RingAddrs};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

const QSIZE: u16 = 256;
const DESC: u64 = 0;
const AVAIL: u64 = 0x10000;
const USED: u64 = 0x20000;

fn main() {
    let mut args = std::env::args().skip(1);
    let journal = args.next().as_deref() != Some("nojournal");
    let n: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let batch: u64 = args
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .clamp(1, QSIZE as u64 / 3);
    let mem = guest_memory();
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let j = journal.then(|| new_journal(dir.path()));
    let mut vq = JournaledQueue::new(queue(), j);
    let host = HostMap::new(&mem);
    let start = std::time::Instant::now();
    run_rounds(&mem, &host, &mut vq, n, batch);
    let el = start.elapsed();
    println!(
        "{} requests in rounds of {batch}, journal {}: {:.1} ns per request",
        n / batch * batch,
        if journal { "on" } else { "off" },
        el.as_nanos() as f64 / n as f64
    );
}

/// Guest memory holding QSIZE / 3 prepared 3-descriptor requests (header, 4 KiB data,
/// status), as libblkio builds them.
fn guest_memory() -> GuestMemory {
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap();
    for h in 0..QSIZE / 3 {
        let base = 0x40000 + h as u64 * 0x2000;
        let d = 3 * h;
        let hdr = [0u8; 16]; // VIRTIO_BLK_T_IN, sector 0
        mem.write_slice(&hdr, GuestAddress(base)).unwrap();
        let descs = [
            Descriptor::new(base, 16, VRING_DESC_F_NEXT as u16, d + 1),
            Descriptor::new(
                base + 0x1000,
                4096,
                (VRING_DESC_F_NEXT | VRING_DESC_F_WRITE) as u16,
                d + 2,
            ),
            Descriptor::new(base + 0x20, 1, VRING_DESC_F_WRITE as u16, 0),
        ];
        for (i, x) in descs.iter().enumerate() {
            mem.write_obj(*x, GuestAddress(DESC + 16 * (d as u64 + i as u64)))
                .unwrap();
        }
    }
    mem
}

/// A ready queue of QSIZE entries on the rings at DESC, AVAIL and USED.
fn queue() -> Queue {
    let mut q = Queue::new(QSIZE).unwrap();
    q.set_size(QSIZE);
    q.set_desc_table_address(Some(DESC as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    q.set_used_ring_address(Some(USED as u32), Some(0));
    q.set_ready(true);
    q
}

/// A fresh journal in `dir` for those rings.
fn new_journal(dir: &std::path::Path) -> Journal {
    let (mut j, _) = Journal::open_or_create(dir, uuid::Uuid::new_v4(), 0, QSIZE).unwrap();
    j.new_generation(
        QSIZE,
        RingAddrs {
            desc: DESC,
            avail: AVAIL,
            used: USED,
        },
        0,
        0,
    )
    .unwrap();
    j
}

/// Runs `n / batch` rounds: the guest offers `batch` requests, the queue takes and parses
/// them, writes their status and completes them as one batch.
fn run_rounds(mem: &GuestMemory, host: &HostMap, vq: &mut JournaledQueue, n: u64, batch: u64) {
    let limits = Limits {
        capacity_sectors: 1 << 20,
        read_only: false,
        max_data: 1 << 20,
        max_discard_segs: 1,
        max_discard_sectors: 1,
    };
    let mut avail: u16 = 0;
    let mut done = Vec::with_capacity(batch as usize);
    for round in 0..n / batch {
        // The guest offers a round of requests (heads cycle through the prepared chains).
        for k in 0..batch {
            let i = round * batch + k;
            let head = 3 * (i % (QSIZE as u64 / 3)) as u16;
            mem.write_obj(head, GuestAddress(AVAIL + 4 + 2 * (avail % QSIZE) as u64))
                .unwrap();
            avail = avail.wrapping_add(1);
        }
        mem.write_obj(avail, GuestAddress(AVAIL + 2)).unwrap();
        while let Some(h) = vq.pop(host, &mut |_| {}).unwrap() {
            let req = parse(h, vq.chain(host, h), host, &limits).unwrap();
            host.write(req.status.0, &[0u8]);
            done.push((h, 4097));
        }
        vq.finish_takes(&mut |_| {});
        assert_eq!(
            done.len() as u64,
            batch,
            "a round takes what the guest offered"
        );
        vq.complete_batch(host, &done, &mut |_| {}).unwrap();
        done.clear();
    }
}
