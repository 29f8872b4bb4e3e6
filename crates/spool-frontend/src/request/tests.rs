//! Parser tests: framings, hostile chains, the short path against the general one.

use super::*;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueOwnedT};
use vm_memory::Bytes;

const W: u16 = VRING_DESC_F_WRITE as u16;

fn mem() -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
}

fn limits() -> Limits {
    Limits {
        capacity_sectors: 2048,
        read_only: false,
        max_data: 1 << 20,
        max_discard_segs: 4,
        max_discard_sectors: 1024,
    }
}

fn header(mem: &GuestMemory, at: u64, ty: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&ty.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(at)).unwrap();
}

fn run(mem: &GuestMemory, descs: &[RawDescriptor], limits: &Limits) -> Result<Request, Rejected> {
    let q = MockSplitQueue::new(mem.map(), 16);
    let n = descs.len();
    let chained: Vec<RawDescriptor> = descs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let x = Descriptor::from(*r);
            let (flags, next) = if i + 1 < n {
                (x.flags() | VRING_DESC_F_NEXT as u16, i as u16 + 1)
            } else {
                (x.flags(), 0)
            };
            RawDescriptor::from(Descriptor::new(x.addr().0, x.len(), flags, next))
        })
        .collect();
    q.add_desc_chains(&chained, 0).unwrap();
    let mut queue: Queue = q.create_queue().unwrap();
    let chain = queue.iter(mem.map()).unwrap().next().unwrap();
    let head = chain.head_index();
    parse(head, chain, &HostMap::new(mem), limits)
}

/// `descs` linked in order, as a walker yields them.
fn chain_of(descs: &[RawDescriptor]) -> Vec<Descriptor> {
    let n = descs.len();
    descs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let x = Descriptor::from(*r);
            let flags = if i + 1 < n {
                x.flags() | VRING_DESC_F_NEXT as u16
            } else {
                x.flags()
            };
            Descriptor::new(x.addr().0, x.len(), flags, i as u16 + 1)
        })
        .collect()
}

fn d(addr: u64, len: u32, flags: u16) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, flags, 0))
}

#[test]
fn read_with_libblkio_framing() {
    let m = mem();
    header(&m, 0x1000, VIRTIO_BLK_T_IN, 8);
    let r = run(
        &m,
        &[d(0x1000, 16, 0), d(0x2000, 4096, W), d(0x3000, 1, W)],
        &limits(),
    )
    .unwrap();
    assert_eq!(r.op, Op::Read);
    assert_eq!((r.sector, r.len, r.status), (8, 4096, GuestAddress(0x3000)));
    assert_eq!(r.iov.len(), 1);
}

#[test]
fn header_and_status_may_share_descriptors_with_data() {
    let m = mem();
    header(&m, 0x1000, VIRTIO_BLK_T_OUT, 0);
    // header + data in one readable descriptor, status at the end of a writable one
    let r = run(&m, &[d(0x1000, 16 + 512, 0), d(0x3000, 1, W)], &limits()).unwrap();
    assert_eq!((r.op, r.len), (Op::Write, 512));
    let r = run(
        &m,
        &[d(0x1000, 8, 0), d(0x1008, 8, 0), d(0x4000, 512 + 1, W)],
        &limits(),
    );
    assert_eq!(
        r.unwrap_err().reason(),
        "data buffer has the wrong direction"
    );
}

#[test]
fn hostile_chains_are_rejected_with_a_status() {
    let m = mem();
    let l = limits();
    let cases: Vec<(Vec<RawDescriptor>, u32, &str)> = vec![
        (
            vec![d(0x1000, 16, 0), d(0x2000, 512, 0), d(0x3000, 1, W)],
            VIRTIO_BLK_T_IN,
            "wrong direction",
        ),
        (
            vec![d(0x1000, 16, 0), d(0x2000, 100, W), d(0x3000, 1, W)],
            VIRTIO_BLK_T_IN,
            "multiple of 512",
        ),
        (
            vec![d(0x1000, 16, 0), d(0xff000, 0x2000, W), d(0x3000, 1, W)],
            VIRTIO_BLK_T_IN,
            "outside guest memory",
        ),
        (
            vec![d(0x1000, 16, 0), d(u64::MAX - 10, 512, W), d(0x3000, 1, W)],
            VIRTIO_BLK_T_IN,
            "outside guest memory",
        ),
        (
            vec![d(0x1000, 8, 0), d(0x3000, 1, W)],
            VIRTIO_BLK_T_IN,
            "header too short",
        ),
        (
            vec![d(0x1000, 16, W), d(0x3000, 1, W)],
            VIRTIO_BLK_T_IN,
            "header is device-writable",
        ),
        (
            vec![d(0x1000, 16, 0), d(0x3000, 1, W)],
            99,
            "unsupported request type",
        ),
    ];
    for (descs, ty, why) in cases {
        header(&m, 0x1000, ty, 0);
        let e = run(&m, &descs, &l).unwrap_err();
        assert!(e.reason().contains(why), "{why}: got {e:?}");
        assert_eq!(e.status_addr, Some(GuestAddress(0x3000)), "{why}");
    }
    // No writable status byte at all: nothing can be written, but no panic either.
    header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
    let e = run(&m, &[d(0x1000, 16, 0), d(0x2000, 512, 0)], &l).unwrap_err();
    assert_eq!(e.status_addr, None);
    // Status outside memory.
    let e = run(&m, &[d(0x1000, 16, 0), d(0x20_0000, 1, W)], &l).unwrap_err();
    assert_eq!(e.status_addr, None);
}

#[test]
fn sector_ranges_are_overflow_checked() {
    let m = mem();
    for (sector, ok) in [
        (2040u64, true),
        (2041, false),
        (u64::MAX - 2, false),
        (u64::MAX / 512 + 1, false),
    ] {
        header(&m, 0x1000, VIRTIO_BLK_T_IN, sector);
        let r = run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 4096, W), d(0x3000, 1, W)],
            &limits(),
        );
        assert_eq!(r.is_ok(), ok, "sector {sector}: {r:?}");
    }
    let mut l = limits();
    l.max_data = 2048;
    header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
    let e = run(
        &m,
        &[d(0x1000, 16, 0), d(0x2000, 4096, W), d(0x3000, 1, W)],
        &l,
    )
    .unwrap_err();
    assert!(e.reason().contains("larger"));
}

#[test]
fn read_only_refuses_writes_discards_and_zeroes() {
    let m = mem();
    let mut l = limits();
    l.read_only = true;
    for ty in [
        VIRTIO_BLK_T_OUT,
        VIRTIO_BLK_T_DISCARD,
        VIRTIO_BLK_T_WRITE_ZEROES,
    ] {
        header(&m, 0x1000, ty, 0);
        let e = run(
            &m,
            &[d(0x1000, 16, 0), d(0x2000, 512, 0), d(0x3000, 1, W)],
            &l,
        )
        .unwrap_err();
        assert_eq!(e.status(), VIRTIO_BLK_S_IOERR as u8);
    }
    header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
    assert!(run(
        &m,
        &[d(0x1000, 16, 0), d(0x2000, 512, W), d(0x3000, 1, W)],
        &l
    )
    .is_ok());
}

#[test]
fn discard_and_write_zeroes_segments() {
    let m = mem();
    let seg = |sector: u64, n: u32, flags: u32| {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&sector.to_le_bytes());
        b[8..12].copy_from_slice(&n.to_le_bytes());
        b[12..16].copy_from_slice(&flags.to_le_bytes());
        b
    };
    m.write_slice(&seg(8, 16, 0), GuestAddress(0x2000)).unwrap();
    m.write_slice(&seg(100, 8, 0), GuestAddress(0x2010))
        .unwrap();
    header(&m, 0x1000, VIRTIO_BLK_T_DISCARD, 0);
    let r = run(
        &m,
        &[d(0x1000, 16, 0), d(0x2000, 32, 0), d(0x3000, 1, W)],
        &limits(),
    )
    .unwrap();
    assert_eq!(
        r.op,
        Op::Discard(vec![
            Range {
                sector: 8,
                sectors: 16
            },
            Range {
                sector: 100,
                sectors: 8
            }
        ])
    );
    m.write_slice(
        &seg(0, 8, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP),
        GuestAddress(0x2000),
    )
    .unwrap();
    let r = run(
        &m,
        &[d(0x1000, 16, 0), d(0x2000, 32, 0), d(0x3000, 1, W)],
        &limits(),
    )
    .unwrap_err();
    assert_eq!(
        r.status(),
        VIRTIO_BLK_S_UNSUPP as u8,
        "unmap flag is not valid on discard"
    );
    header(&m, 0x1000, VIRTIO_BLK_T_WRITE_ZEROES, 0);
    let r = run(
        &m,
        &[d(0x1000, 16, 0), d(0x2000, 16, 0), d(0x3000, 1, W)],
        &limits(),
    )
    .unwrap();
    assert!(matches!(r.op, Op::WriteZeroes { unmap: true, .. }));
    m.write_slice(&seg(2047, 2, 0), GuestAddress(0x2000))
        .unwrap();
    assert!(run(
        &m,
        &[d(0x1000, 16, 0), d(0x2000, 16, 0), d(0x3000, 1, W)],
        &limits()
    )
    .is_err());
    m.write_slice(&seg(0, 2000, 0), GuestAddress(0x2000))
        .unwrap();
    assert!(run(
        &m,
        &[d(0x1000, 16, 0), d(0x2000, 16, 0), d(0x3000, 1, W)],
        &limits()
    )
    .is_err());
    assert!(run(
        &m,
        &[d(0x1000, 16, 0), d(0x2000, 80, 0), d(0x3000, 1, W)],
        &limits()
    )
    .is_err());
    assert!(run(
        &m,
        &[d(0x1000, 16, 0), d(0x2000, 15, 0), d(0x3000, 1, W)],
        &limits()
    )
    .is_err());
}

#[test]
fn looping_chain_is_bounded_and_rejected() {
    let m = mem();
    header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
    let q = MockSplitQueue::new(m.map(), 4);
    // 0 -> 1 -> 0 -> ... never ends.
    let descs = [
        RawDescriptor::from(Descriptor::new(0x1000, 16, VRING_DESC_F_NEXT as u16, 1)),
        RawDescriptor::from(Descriptor::new(
            0x3000,
            1,
            (VRING_DESC_F_NEXT | VRING_DESC_F_WRITE) as u16,
            0,
        )),
    ];
    for (i, desc) in descs.iter().enumerate() {
        q.desc_table().store(i as u16, *desc).unwrap();
    }
    q.avail().ring().ref_at(0).unwrap().store(0u16.to_le());
    q.avail().idx().store(1u16.to_le());
    let mut queue: Queue = q.create_queue().unwrap();
    let chain = queue.iter(m.map()).unwrap().next().unwrap();
    let e = parse(chain.head_index(), chain, &HostMap::new(&m), &limits()).unwrap_err();
    assert!(e.reason().contains("loops"), "{e:?}");
}

/// Chains shaped like the common case, with every field varied around the limits: the
/// short path must agree with the general one on every input (and does accept some).
#[test]
fn short_path_agrees_with_the_general_parser() {
    use proptest::prelude::*;
    let m = mem();
    let accepted = std::cell::Cell::new(0u32);
    // Valid values repeated so that valid chains are common; the odd ones probe each check.
    let lens = prop::sample::select(vec![
        0u32, 1, 511, 512, 512, 4096, 4096, 4096, 8192, 8192, 0x10_0000, 0x10_0200,
    ]);
    let addrs = prop::sample::select(vec![
        0x2000u64, 0x2000, 0x3000, 0x8000, 0x8000, 0xf_f000, 0xf_ff00, 0xf_ffff, 0x10_0000,
    ]);
    proptest!(ProptestConfig::with_cases(4000), |(hdr_len in prop::sample::select(vec![15u32, 16, 16, 16, 17]),
                hdr_w in prop::sample::select(vec![false, false, false, true]),
                data in prop::collection::vec((addrs.clone(), lens.clone(), any::<bool>()), 0..4),
                st_len in prop::sample::select(vec![1u32, 1, 1, 2]), st_w in prop::sample::select(vec![true, true, true, false]),
                st_addr in addrs.clone(),
                ty in prop::sample::select(vec![VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_FLUSH, 99]),
                sector in prop::sample::select(vec![0u64, 0, 8, 8, 2040, 2047, 2048, u64::MAX - 3]),
                read_only in any::<bool>())| {
        header(&m, 0x1000, ty, sector);
        let mut raw = vec![d(0x1000, hdr_len, if hdr_w { W } else { 0 })];
        raw.extend(data.iter().map(|&(a, l, w)| d(a, l, if w { W } else { 0 })));
        raw.push(d(st_addr, st_len, if st_w { W } else { 0 }));
        let chained = chain_of(&raw);
        let host = HostMap::new(&m);
        let mut l = limits();
        l.read_only = read_only;
        let fast = parse(0, chained.iter().copied(), &host, &l);
        let general = parse_general(0, chained.iter().copied(), &host, &l);
        prop_assert_eq!(format!("{fast:?}"), format!("{general:?}"));
        if fast.is_ok() {
            accepted.set(accepted.get() + 1);
        }
    });
    assert!(
        accepted.get() > 0,
        "no generated chain was valid: the test checks nothing"
    );
}

#[test]
fn parser_never_panics_on_random_chains() {
    use proptest::prelude::*;
    let m = mem();
    proptest!(|(descs in prop::collection::vec((0u64..0x12_0000, 0u32..0x3000, any::<bool>()), 1..8),
                ty in 0u32..16, sector in any::<u64>())| {
        header(&m, 0x1000, ty, sector);
        let raw: Vec<_> = descs.iter().map(|&(a, l, w)| d(a, l, if w { W } else { 0 })).collect();
        let chained = chain_of(&raw);
        let host = HostMap::new(&m);
        let fast = parse(0, chained.iter().copied(), &host, &limits());
        let general = parse_general(0, chained.iter().copied(), &host, &limits());
        prop_assert_eq!(format!("{fast:?}"), format!("{general:?}"), "short and general paths differ");
        if let Ok(r) = run(&m, &raw, &limits()) {
            // Anything accepted stays inside memory and the volume.
            prop_assert!(r.len <= limits().max_data);
            if matches!(r.op, Op::Read | Op::Write) {
                prop_assert!(r.sector + r.len / 512 <= 2048);
            }
        }
    });
}
