//! Buddy allocator over one device's data area (Spool §3).
//!
//! Blocks are `min << order` bytes, aligned to their size relative to the area's base. An
//! area whose length is not a power of two is tiled greedily by descending power-of-two top
//! blocks; buddies merge only inside their top block. The allocator holds no persistent state
//! of its own: the pool rebuilds it from the volume table with [`Buddy::alloc_at`].

use std::collections::BTreeSet;

/// Why an allocator cannot manage an area, or a block cannot be marked allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("minimum extent {0} is not a power of two")]
    MinExtent(u64),
    #[error("area of {len} bytes at {base} ends beyond 2^64 bytes")]
    AreaOverflow { base: u64, len: u64 },
    #[error("extent at {offset} (order {order}) is larger than any block of the device")]
    TooLarge { offset: u64, order: u32 },
    #[error("extent at {offset} (order {order}) is misaligned or before the data area")]
    Misaligned { offset: u64, order: u32 },
    #[error(
        "extent at {offset} (order {order}) overlaps another extent or lies outside the device"
    )]
    Taken { offset: u64, order: u32 },
}

/// Free-list buddy allocator.
#[derive(Debug, Clone)]
pub struct Buddy {
    base: u64,
    min: u64,
    /// Top-level blocks (relative offset, order), ascending by offset.
    top: Vec<(u64, u32)>,
    /// Free blocks per order, relative offsets.
    free: Vec<BTreeSet<u64>>,
}

impl Buddy {
    /// Manages `[base, base + len)` in blocks of at least `min` bytes (a power of two).
    /// Fails when `min` is not a power of two or the area does not fit in 64 bits.
    pub fn new(base: u64, len: u64, min: u64) -> Result<Self, AllocError> {
        if !min.is_power_of_two() {
            return Err(AllocError::MinExtent(min));
        }
        if base.checked_add(len).is_none() {
            return Err(AllocError::AreaOverflow { base, len });
        }
        let mut top = Vec::new();
        let mut off = 0u64;
        let mut remaining = len - len % min;
        while remaining >= min {
            let order = 63 - (remaining / min).leading_zeros();
            top.push((off, order));
            off += min << order;
            remaining -= min << order;
        }
        let max_order = top.iter().map(|t| t.1).max().unwrap_or(0);
        let mut free = vec![BTreeSet::new(); max_order as usize + 1];
        for &(off, order) in &top {
            free[order as usize].insert(off);
        }
        Ok(Buddy {
            base,
            min,
            top,
            free,
        })
    }

    /// Absolute offset of the area's first byte.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Minimum block size in bytes.
    pub fn min(&self) -> u64 {
        self.min
    }

    /// Highest order any block can have.
    pub fn max_order(&self) -> u32 {
        self.free.len() as u32 - 1
    }

    /// Bytes of one block of `order`.
    pub fn block_size(&self, order: u32) -> u64 {
        self.min << order
    }

    /// Total bytes managed.
    pub fn total(&self) -> u64 {
        self.top.iter().map(|&(_, o)| self.min << o).sum()
    }

    /// Free bytes.
    pub fn free_bytes(&self) -> u64 {
        self.free
            .iter()
            .enumerate()
            .map(|(o, s)| s.len() as u64 * (self.min << o))
            .sum()
    }

    /// Largest order with a free block.
    pub fn largest_free_order(&self) -> Option<u32> {
        (0..self.free.len())
            .rev()
            .find(|&o| !self.free[o].is_empty())
            .map(|o| o as u32)
    }

    /// Allocates a block of `order`; returns its absolute offset.
    pub fn alloc(&mut self, order: u32) -> Option<u64> {
        let from = (order as usize..self.free.len()).find(|&o| !self.free[o].is_empty())?;
        let off = self.free[from].pop_first()?;
        let mut o = from;
        while o > order as usize {
            o -= 1;
            self.free[o].insert(off + (self.min << o));
        }
        Some(self.base + off)
    }

    /// Marks the block at absolute `offset` of `order` allocated (rebuilding from metadata).
    /// Fails if any part of it is not free (overlapping or out-of-range metadata).
    pub fn alloc_at(&mut self, offset: u64, order: u32) -> Result<(), AllocError> {
        // Orders above the largest top block cannot fit; this also keeps `min << order`
        // from shifting bits out (to zero, for a division below).
        if order > self.max_order() {
            return Err(AllocError::TooLarge { offset, order });
        }
        let size = self.min << order;
        let rel = offset
            .checked_sub(self.base)
            .filter(|r| r % size == 0)
            .ok_or(AllocError::Misaligned { offset, order })?;
        for o in order as usize..self.free.len() {
            let cand = rel & !((self.min << o) - 1);
            if self.free[o].remove(&cand) {
                let mut c = cand;
                let mut j = o;
                while j > order as usize {
                    j -= 1;
                    let half = self.min << j;
                    if rel >= c + half {
                        self.free[j].insert(c);
                        c += half;
                    } else {
                        self.free[j].insert(c + half);
                    }
                }
                return Ok(());
            }
        }
        Err(AllocError::Taken { offset, order })
    }

    /// Frees the block at absolute `offset` of `order`, merging with free buddies.
    pub fn free(&mut self, offset: u64, order: u32) {
        // Only blocks this allocator handed out (or `alloc_at` accepted) come back here; an
        // impossible one is a bug, ignored in release builds rather than corrupting the lists.
        let top_order = offset
            .checked_sub(self.base)
            .and_then(|rel| Some((rel, self.top_order(rel)?)));
        let Some((mut rel, top_order)) = top_order.filter(|&(_, t)| order <= t) else {
            debug_assert!(
                false,
                "free of a block never allocated: {offset} order {order}"
            );
            return;
        };
        let mut o = order;
        while o < top_order {
            let buddy = rel ^ (self.min << o);
            if !self.free[o as usize].remove(&buddy) {
                break;
            }
            rel = rel.min(buddy);
            o += 1;
        }
        let fresh = self.free[o as usize].insert(rel);
        debug_assert!(fresh, "double free at {offset}");
    }

    fn top_order(&self, rel: u64) -> Option<u32> {
        let i = self.top.partition_point(|&(off, _)| off <= rel);
        Some(self.top.get(i.checked_sub(1)?)?.1)
    }

    /// Free blocks as (absolute offset, order), for tests and diagnostics.
    pub fn free_blocks(&self) -> Vec<(u64, u32)> {
        let mut v: Vec<_> = self
            .free
            .iter()
            .enumerate()
            .flat_map(|(o, s)| s.iter().map(move |&r| (r, o as u32)))
            .map(|(r, o)| (self.base + r, o))
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tiles_non_power_of_two_areas() {
        let b = Buddy::new(1 << 20, 7 << 20, 1 << 20).unwrap();
        assert_eq!(
            b.free_blocks(),
            vec![(1 << 20, 2), (5 << 20, 1), (7 << 20, 0)]
        );
        assert_eq!(b.total(), 7 << 20);
    }

    #[test]
    fn split_and_merge() {
        let mut b = Buddy::new(0, 8, 1).unwrap();
        let a = b.alloc(0).unwrap();
        let c = b.alloc(1).unwrap();
        assert_eq!((a, c), (0, 2));
        assert_eq!(b.free_bytes(), 5);
        b.free(a, 0);
        b.free(c, 1);
        assert_eq!(b.free_blocks(), vec![(0, 3)]);
    }

    #[test]
    fn alloc_at_rejects_overlap_and_misalignment() {
        let mut b = Buddy::new(0, 16, 1).unwrap();
        b.alloc_at(4, 2).unwrap();
        assert!(b.alloc_at(5, 0).is_err());
        assert!(b.alloc_at(6, 2).is_err());
        assert!(b.alloc_at(32, 0).is_err());
        b.alloc_at(8, 3).unwrap();
        b.alloc_at(8, 2).unwrap_err();
        assert_eq!(b.free_blocks(), vec![(0, 2)]);
    }

    #[test]
    fn impossible_geometry_is_an_error_not_a_panic() {
        for min in [0, 3, 3 << 19] {
            assert!(Buddy::new(1 << 20, 8 << 20, min).is_err(), "min {min}");
        }
        assert!(Buddy::new(u64::MAX - 10, 1 << 20, 1 << 20).is_err());
        let mut b = Buddy::new(1 << 20, 8 << 20, 1 << 20).unwrap();
        // 1 MiB << 44 wraps to 0: this divided by zero.
        for order in [4, 44, 63, 64, u32::MAX] {
            assert!(b.alloc_at(1 << 20, order).is_err(), "order {order}");
        }
        assert_eq!(b.free_bytes(), 8 << 20);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u32),
        Free(usize),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        prop::collection::vec(
            prop_oneof![
                (0u32..5).prop_map(Op::Alloc),
                any::<usize>().prop_map(Op::Free)
            ],
            1..200,
        )
    }

    proptest! {
        /// No two live blocks overlap, every block is inside the area and aligned, free + used
        /// always equals the total (no leak), and freeing everything coalesces back to the
        /// initial top blocks.
        #[test]
        fn no_overlap_no_leak_full_coalescing(len_units in 1u64..100, ops in ops()) {
            let min = 4096u64;
            let base = 1 << 20;
            let mut b = Buddy::new(base, len_units * min, min).unwrap();
            let initial = b.free_blocks();
            let total = b.total();
            let mut live: Vec<(u64, u32)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(o) => {
                        if let Some(off) = b.alloc(o) {
                            let size = min << o;
                            prop_assert!(off >= base && off + size <= base + total);
                            prop_assert_eq!((off - base) % size, 0);
                            for &(lo, lord) in &live {
                                let lsize = min << lord;
                                prop_assert!(off + size <= lo || lo + lsize <= off, "overlap");
                            }
                            live.push((off, o));
                        } else {
                            prop_assert!(b.largest_free_order().is_none_or(|m| m < o));
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let (off, o) = live.swap_remove(i % live.len());
                        b.free(off, o);
                    }
                    Op::Free(_) => {}
                }
                let used: u64 = live.iter().map(|&(_, o)| min << o).sum();
                prop_assert_eq!(used + b.free_bytes(), total);
            }
            // Rebuilding from the live set gives the same free space (what the pool does at start).
            let mut rebuilt = Buddy::new(base, len_units * min, min).unwrap();
            for &(off, o) in &live {
                rebuilt.alloc_at(off, o).unwrap();
            }
            prop_assert_eq!(rebuilt.free_bytes(), b.free_bytes());
            for (off, o) in live.drain(..) {
                b.free(off, o);
            }
            prop_assert_eq!(b.free_blocks(), initial);
        }
    }
}
