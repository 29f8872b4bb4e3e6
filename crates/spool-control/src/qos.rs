//! A change to a volume's I/O limits (`QosChange`: the given limits replace the current
//! ones, the others stay, `clear` starts from none), merged into the limits the pool keeps.
//! Parsing and formatting rates is the wire's (`spool_api::qos`).
//!
//! Owns: merging a change. Must not know: the config file, RPC framing, or how limits are
//! enforced (the frontend's token buckets); the limits themselves are
//! `spool_pool::QosLimits`.

use spool_pool::QosLimits;

pub use spool_api::qos::*;

/// The limits after change `c` to `current` (all rates 0 = no limits).
pub fn apply(c: &QosChange, current: Option<QosLimits>) -> QosLimits {
    let mut q = match current {
        Some(q) if !c.clear => q,
        _ => QosLimits::default(),
    };
    let set = |field: &mut u64, v: Option<u64>| {
        if let Some(v) = v {
            *field = v;
        }
    };
    set(&mut q.iops, c.iops);
    set(&mut q.read_iops, c.read_iops);
    set(&mut q.write_iops, c.write_iops);
    set(&mut q.bps, c.bps);
    set(&mut q.read_bps, c.read_bps);
    set(&mut q.write_bps, c.write_bps);
    if let Some(b) = c.burst_ms {
        q.burst_ms = b;
    }
    if let Some(w) = c.weight {
        q.weight = w;
    }
    if let Some(p) = c.priority {
        q.priority = crate::wire::priority_from_wire(p);
    }
    q
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ToWire;

    #[test]
    fn the_wire_bounds_are_the_pools() {
        assert_eq!(MAX_RATE, spool_pool::qos::MAX_RATE);
        assert_eq!(MAX_BURST_MS, spool_pool::qos::MAX_BURST_MS);
        for p in [Priority::Normal, Priority::Latency, Priority::Batch] {
            let pool = spool_pool::Priority::parse(p.name()).expect("the same names");
            assert_eq!(pool.wire(), p);
        }
    }

    #[test]
    fn a_change_keeps_what_it_does_not_name() {
        let cur = QosLimits {
            iops: 1000,
            bps: 1 << 20,
            burst_ms: 100,
            ..QosLimits::default()
        };
        let c = QosChange {
            read_iops: Some(500),
            bps: Some(0),
            ..QosChange::default()
        };
        let q = apply(&c, Some(cur));
        assert_eq!(
            (q.iops, q.read_iops, q.bps, q.burst_ms),
            (1000, 500, 0, 100)
        );
        let change = QosChange {
            clear: true,
            write_iops: Some(9),
            ..QosChange::default()
        };
        let q = apply(&change, Some(cur));
        assert_eq!(
            q,
            QosLimits {
                write_iops: 9,
                ..QosLimits::default()
            }
        );
        assert_eq!(describe(None), "none");
        assert_eq!(describe(Some(&cur.wire())), "iops 1k, bw 1M/s, burst 100ms");
    }
}
