//! Fuzzes the whole guest-facing request path: the input becomes guest memory (descriptor
//! table, avail ring, buffers) and the queue geometry; every head the ring yields is walked
//! and parsed, and completed into the used ring in batches, exactly as a worker does (with
//! the prefetching, which reads the same hostile memory). It must never
//! panic, and whatever it accepts must lie inside guest memory and inside the volume.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spool_frontend::hostmem::HostMap;
use spool_frontend::request::{parse, parse_general, GuestMemory, Limits, Op};
use spool_frontend::vring::JournaledQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

const MEM: usize = 64 * 1024;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
    let body = &data[8..];
    mem.write_slice(&body[..body.len().min(MEM)], GuestAddress(0))
        .unwrap();
    let size = 1u16 << (data[0] % 9); // 1..256
    let mut q = Queue::new(256).unwrap();
    q.set_size(size);
    let desc = u16::from_le_bytes([data[1], data[2]]) as u64 * 16;
    let avail = u16::from_le_bytes([data[3], data[4]]) as u64 * 2;
    let used = u16::from_le_bytes([data[5], data[6]]) as u64 * 4;
    q.set_desc_table_address(Some(desc as u32), Some(0));
    q.set_avail_ring_address(Some(avail as u32), Some(0));
    q.set_used_ring_address(Some(used as u32), Some(0));
    q.set_event_idx(data[7] & 1 != 0);
    q.set_ready(true);
    if !q.is_valid(mem.map()) {
        return;
    }
    let limits = Limits {
        capacity_sectors: 1024,
        read_only: data[7] & 2 != 0,
        max_data: 32 * 1024,
        max_discard_segs: 4,
        max_discard_sectors: 512,
    };
    let host = HostMap::new(&mem);
    let mut vq = JournaledQueue::new(q, None);
    // As a worker's poll round: read the avail index and prefetch, take every request
    // (prefetching ahead), complete what is done in batches.
    vq.prefetch(&host);
    let mut done: Vec<(u16, u32)> = Vec::new();
    for _ in 0..size {
        vq.prefetch_ahead(&host);
        let head = match vq.pop(&host, &mut |_| {}) {
            Ok(Some(h)) => h,
            _ => break,
        };
        let parsed = parse(head, vq.chain(&host, head), &host, &limits);
        // The short path must say exactly what the general parser says.
        let general = parse_general(head, vq.chain(&host, head), &host, &limits);
        assert_eq!(
            format!("{parsed:?}"),
            format!("{general:?}"),
            "short and general paths differ"
        );
        done.push((head, 1));
        if done.len() == 3 {
            let _ = vq.complete_batch(&host, &done, &mut |_| {});
            let _ = vq.needs_notification(&host);
            done.clear();
        }
        if let Ok(r) = parsed {
            if matches!(r.op, Op::Read | Op::Write) {
                assert!(r.len <= limits.max_data);
                assert!(r.sector + r.len / 512 <= limits.capacity_sectors);
                assert!(!(limits.read_only && r.op == Op::Write));
            }
            let host = mem.get_host_address(GuestAddress(0)).unwrap() as usize;
            for v in &r.iov {
                let b = v.iov_base as usize;
                assert!(
                    b >= host && b + v.iov_len <= host + MEM,
                    "iovec outside guest memory"
                );
            }
        }
    }
    vq.finish_takes(&mut |_| {});
    let _ = vq.complete_batch(&host, &done, &mut |_| {});
    let _ = vq.needs_notification(&host);
});
