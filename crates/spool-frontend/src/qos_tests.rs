use super::*;

const MS: u64 = 1_000_000;
const SEC: u64 = 1_000 * MS;

fn limits(f: impl FnOnce(&mut QosLimits)) -> QosLimits {
    let mut l = QosLimits::default();
    f(&mut l);
    l
}

/// Runs a greedy taker from `from` to `to` in `step` increments (one refill per step, as a
/// worker's poll round), taking requests of `cost` while allowed. Returns how many.
fn run(q: &VolumeQos, from: u64, to: u64, step: u64, cost: Cost) -> u64 {
    let mut n = 0;
    let mut t = from;
    while t < to {
        q.refill(t);
        while q.may_take() {
            q.charge(cost);
            n += 1;
        }
        t += step;
    }
    n
}

#[test]
fn iops_rate_is_accurate_over_ten_seconds() {
    let q = VolumeQos::new(Some(&limits(|l| {
        l.iops = 1000;
        l.burst_ms = 100;
    })));
    // The first burst (100 ms worth = 100 ops) is taken at once; then the rate holds.
    let n = run(&q, 1, 10 * SEC, 37_000, Cost::Read(4096));
    let expect = 10_000 + 100;
    assert!(
        n.abs_diff(expect) * 100 <= expect,
        "took {n}, expected ~{expect}"
    );
}

#[test]
fn bandwidth_rate_is_accurate_over_ten_seconds() {
    let q = VolumeQos::new(Some(&limits(|l| {
        l.bps = 100 << 20;
        l.burst_ms = 10;
    })));
    let n = run(&q, 1, 10 * SEC, 13_000, Cost::Write(128 << 10));
    let bytes = n * (128 << 10);
    let expect = 10 * (100u64 << 20);
    assert!(
        bytes.abs_diff(expect) * 100 <= expect,
        "moved {bytes}, expected ~{expect}"
    );
}

#[test]
fn burst_after_idleness_is_bounded_by_burst_ms() {
    let q = VolumeQos::new(Some(&limits(|l| {
        l.iops = 10_000;
        l.burst_ms = 50;
    })));
    // Drain the initial burst, then stay idle for a minute.
    run(&q, 1, 2, 1, Cost::Read(512));
    q.refill(60 * SEC);
    let mut n = 0;
    while q.may_take() {
        q.charge(Cost::Read(512));
        n += 1;
    }
    // 50 ms of 10k IOPS, plus the one that went into debt.
    assert!((500..=501).contains(&n), "burst of {n}");
}

#[test]
fn debt_blocks_then_clears() {
    let q = VolumeQos::new(Some(&limits(|l| {
        l.bps = 1 << 20;
        l.burst_ms = 1;
    })));
    q.refill(1);
    assert!(q.may_take());
    // 1 ms of 1 MiB/s is ~1 KiB: a 64 KiB write puts the bucket ~62 ms into debt.
    q.charge(Cost::Write(64 << 10));
    assert!(!q.may_take());
    let wait = q.wait_ns();
    assert!((60 * MS..64 * MS).contains(&wait), "wait {wait}");
    q.refill(1 + wait - MS);
    assert!(!q.may_take());
    q.refill(1 + wait);
    assert!(q.may_take());
    assert_eq!(q.wait_ns(), 0);
}

#[test]
fn reads_and_writes_have_their_own_buckets_and_share_the_total() {
    let q = VolumeQos::new(Some(&limits(|l| {
        l.read_iops = 100;
        l.write_iops = 1000;
        l.burst_ms = 1000;
    })));
    q.refill(1);
    let mut reads = 0;
    while q.may_take() {
        q.charge(Cost::Read(0));
        reads += 1;
    }
    assert_eq!(reads, 101);
    // Reads in debt block the worker's takes altogether (it cannot tell what comes next),
    // but the write bucket is untouched: after the read debt is paid, writes get their own.
    q.refill(1 + 20 * MS);
    assert!(q.may_take());
    let mut writes = 0;
    while q.may_take() {
        q.charge(Cost::Write(0));
        writes += 1;
    }
    assert_eq!(writes, 1001);

    // A total limit caps both classes together; a flush counts as a write of 0 bytes.
    let q = VolumeQos::new(Some(&limits(|l| {
        l.iops = 10;
        l.write_bps = 1000;
        l.burst_ms = 1000;
    })));
    q.refill(1);
    for _ in 0..5 {
        q.charge(Cost::Read(4096));
        q.charge(Cost::Write(0));
    }
    assert!(q.may_take());
    q.charge(Cost::Read(1));
    assert!(!q.may_take());
}

#[test]
fn reconfiguring_keeps_the_accounting() {
    let q = VolumeQos::new(Some(&limits(|l| {
        l.iops = 1000;
        l.burst_ms = 1000;
    })));
    q.refill(1);
    // Spend 400 of the 1000 tokens, then put the bucket 100 ops into debt.
    for _ in 0..1100 {
        q.charge(Cost::Read(0));
    }
    assert!(!q.may_take());
    // Halving the rate keeps the 100-op debt: it now takes 200 ms to pay back.
    assert!(q.configure(
        Some(&limits(|l| {
            l.iops = 500;
            l.burst_ms = 1000;
        })),
        1
    ));
    let wait = q.wait_ns();
    assert!(wait.abs_diff(200 * MS) < MS, "wait {wait}");
    // The same limits again change nothing.
    assert!(!q.configure(
        Some(&limits(|l| {
            l.iops = 500;
            l.burst_ms = 1000;
        })),
        1
    ));
    assert_eq!(q.wait_ns(), wait);
    // Time before the change is accounted at the old rate: 100 ms at 1000 IOPS pays the
    // debt even though the new rate is lower.
    let q2 = VolumeQos::new(Some(&limits(|l| l.iops = 1000)));
    q2.refill(1);
    for _ in 0..1100 {
        q2.charge(Cost::Read(0));
    }
    q2.configure(Some(&limits(|l| l.iops = 10)), 1 + 101 * MS);
    assert!(q2.may_take());
    // A smaller burst clamps what the bucket holds.
    let q3 = VolumeQos::new(Some(&limits(|l| l.iops = 1000)));
    q3.configure(
        Some(&limits(|l| {
            l.iops = 1000;
            l.burst_ms = 10;
        })),
        1,
    );
    let n = run(&q3, 1, 2, 1, Cost::Read(0));
    assert_eq!(n, 11);
}

#[test]
fn unlimited_has_no_buckets() {
    for l in [None, Some(QosLimits::default())] {
        let q = VolumeQos::new(l.as_ref());
        assert!(!q.is_active());
        assert!(!is_limited(l.as_ref()));
        q.refill(SEC);
        for _ in 0..10_000 {
            q.charge(Cost::Write(1 << 20));
        }
        assert!(q.may_take());
        assert_eq!(q.wait_ns(), 0);
    }
    // Switching limits off frees a volume in debt at once.
    let q = VolumeQos::new(Some(&limits(|l| l.iops = 1)));
    q.charge(Cost::Read(0));
    q.charge(Cost::Read(0));
    assert!(!q.may_take());
    assert!(q.configure(None, 1));
    assert!(q.may_take() && !q.is_active());
}

#[test]
fn a_charge_racing_with_a_limit_switched_off_leaves_no_debt() {
    let q = VolumeQos::new(Some(&limits(|l| {
        l.iops = 100;
        l.bps = 100;
    })));
    q.configure(Some(&limits(|l| l.iops = 100)), 1);
    // As if a charge had loaded the bandwidth bucket's cost before it was switched off.
    q.buckets[BPS].tokens.store(-1, Ordering::Relaxed);
    assert!(!q.may_take());
    q.refill(2);
    assert!(q.may_take());
}
