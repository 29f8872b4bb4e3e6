//! Mirrored volumes in the pool table: the rules a volume's legs obey, and allocating a leg
//! whose every extent lies on a different device from the other legs at the same logical
//! range (so one device's loss costs at most one copy).
//!
//! Owns: [`MAX_COPIES`], leg validation, leg allocation and leg bookkeeping (synced flags).
//! Must not know: how legs are read, written or resynced (spool-devices' mirror backend does
//! that), the write-intent bitmap.

use uuid::Uuid;

use crate::metadata::{spans, ExtentEntry, VolumeEntry};
use crate::{Error, Pool, Result};

pub use crate::metadata::MAX_COPIES;

/// Whether every logical byte of mirrored `v` has a synced leg on a device `ok` accepts. A
/// thin volume being sent keeps its data in its map, which its synced local leg stands for.
pub(crate) fn covered(v: &VolumeEntry, min: u64, ok: impl Fn(Uuid) -> bool) -> bool {
    if v.thin.is_some() {
        return v.legs.iter().any(|l| l.synced && l.remote.is_none());
    }
    let legs: Vec<_> = v
        .legs
        .iter()
        .filter(|l| l.synced)
        .map(|l| spans(&l.extents, min))
        .collect();
    let mut cuts: Vec<u64> = legs.iter().flatten().map(|s| s.0).collect();
    cuts.sort_unstable();
    cuts.dedup();
    !cuts.is_empty()
        && cuts.iter().all(|&at| {
            legs.iter()
                .any(|l| l.iter().any(|s| s.0 <= at && at < s.1 && ok(s.2)))
        })
}

/// Devices the `others` legs use anywhere in the logical range `[start, end)`.
fn devices_in(others: &[Vec<(u64, u64, Uuid)>], start: u64, end: u64) -> Vec<Uuid> {
    others
        .iter()
        .flat_map(|s| s.iter())
        .filter(|s| s.0 < end && start < s.1)
        .map(|s| s.2)
        .collect()
}

/// `n` bytes in MiB, for messages ("1020 MiB").
fn mib(n: u64) -> String {
    match n % (1 << 20) {
        0 => format!("{} MiB", n >> 20),
        _ => format!("{n} bytes"),
    }
}

/// The largest size (a multiple of `unit`) of which `copies` copies fit on devices with
/// `free` bytes each, no two copies of a range on one device: every device holds at most one
/// copy of each range, so `s` fits when the devices' `min(free, s)` add up to `copies * s`.
pub(crate) fn largest_mirror(free: &[u64], copies: u8, unit: u64) -> u64 {
    let fits = |s: u64| {
        let room: u64 = free.iter().map(|&f| f.min(s)).sum();
        room >= s.saturating_mul(copies as u64)
    };
    let (mut lo, mut hi) = (0u64, free.iter().sum::<u64>() / unit.max(1));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        match fits(mid * unit) {
            true => lo = mid,
            false => hi = mid - 1,
        }
    }
    lo * unit
}

impl Pool {
    /// Why a `copies`-way mirror of `bytes` does not fit: what each copy needs, what each
    /// device has, and the largest that would fit now.
    pub(crate) fn mirror_room(&self, bytes: u64, copies: u8) -> Error {
        let usable: Vec<&crate::members::Member> =
            self.members.iter().filter(|m| !m.isolated()).collect();
        let free: Vec<u64> = usable.iter().map(|m| m.free_bytes()).collect();
        let each: Vec<String> = usable
            .iter()
            .zip(&free)
            .map(|(m, f)| format!("{} has {}", m.dev.path().display(), mib(*f)))
            .collect();
        let most = largest_mirror(&free, copies, self.table.min_extent);
        Error::InvalidArgument(format!(
            "not enough room for a {copies}-way mirror of {}: each copy needs {} on a device that holds no other copy of the same range; {}; the largest {copies}-way mirror that fits now is about {} (add a device, delete volumes, or ask for fewer copies)",
            mib(bytes),
            mib(bytes),
            each.join(", "),
            mib(most)
        ))
    }

    /// Refuses a mirror the pool cannot hold: fewer usable devices than copies.
    pub(crate) fn check_copies(&self, copies: u8) -> Result<()> {
        if !(1..=MAX_COPIES).contains(&copies) {
            return Err(Error::InvalidArgument(format!(
                "mirror {copies}: a volume keeps 1 to {MAX_COPIES} copies"
            )));
        }
        let usable = self.members.iter().filter(|m| !m.isolated()).count();
        if (copies as usize) > usable {
            return Err(Error::InvalidArgument(format!(
                "a {copies}-way mirror needs {copies} devices with free space; the pool has {usable} usable device{}",
                if usable == 1 { "" } else { "s" }
            )));
        }
        Ok(())
    }

    /// Allocates `bytes` for one leg, starting at logical offset `from`, every extent on a
    /// device that none of the `others` legs uses at the same logical range: the largest
    /// blocks first, each on the allowed device with the most free space, split in halves
    /// when no allowed device has a block that large.
    pub(crate) fn allocate_leg(
        &mut self,
        from: u64,
        bytes: u64,
        others: &[&[ExtentEntry]],
    ) -> Result<Vec<ExtentEntry>> {
        self.check_not_frozen()?;
        let min = self.table.min_extent;
        let others: Vec<_> = others.iter().map(|e| spans(e, min)).collect();
        // (logical start, order), in logical order.
        let mut pending: std::collections::VecDeque<(u64, u32)> = Default::default();
        let (mut units, mut at) = (bytes / min, from);
        while units > 0 {
            let order = 63 - units.leading_zeros();
            pending.push_back((at, order));
            at += min << order;
            units -= 1 << order;
        }
        let mut out: Vec<ExtentEntry> = Vec::new();
        while let Some((start, order)) = pending.pop_front() {
            let taken = devices_in(&others, start, start + (min << order));
            let mine: Vec<Uuid> = out.iter().map(|e| e.device).collect();
            match self.alloc_avoiding(order, &taken, &mine) {
                Some(e) => out.push(e),
                None if order > 0 => {
                    pending.push_front((start + (min << (order - 1)), order - 1));
                    pending.push_front((start, order - 1));
                }
                None => {
                    self.release(&out);
                    return Err(Error::NoSpace {
                        requested: bytes,
                        available: self.members.iter().map(|m| m.free_bytes()).sum(),
                    });
                }
            }
        }
        Ok(out)
    }

    /// One block of `order` at logical offset `at` of a leg, on a device none of `others`
    /// uses there.
    pub(crate) fn allocate_leg_exact(
        &mut self,
        at: u64,
        order: u32,
        others: &[&[ExtentEntry]],
    ) -> Result<ExtentEntry> {
        let min = self.table.min_extent;
        let others: Vec<_> = others.iter().map(|e| spans(e, min)).collect();
        let taken = devices_in(&others, at, at + (min << order));
        self.alloc_avoiding(order, &taken, &[])
            .ok_or_else(|| Error::NoSpace {
                requested: min << order,
                available: self.members.iter().map(|m| m.free_bytes()).sum(),
            })
    }

    /// A block of `order` on a usable device not in `taken`: one in `mine` (the leg already
    /// uses it: a leg on fewer devices has fewer ways to lose a piece) first, then the one
    /// with the most free space.
    fn alloc_avoiding(&mut self, order: u32, taken: &[Uuid], mine: &[Uuid]) -> Option<ExtentEntry> {
        let m = self
            .members
            .iter_mut()
            .filter(|m| !m.isolated() && !taken.contains(&m.uuid) && m.has_order(order))
            .filter(|m| !self.space.blocked(m.uuid))
            .max_by_key(|m| (mine.contains(&m.uuid), m.free_bytes()))?;
        // A thin volume's allocator may have taken the block since the check: no extent
        // then, as when none was free.
        let offset = m.alloc(order)?;
        Some(ExtentEntry {
            device: m.uuid,
            offset,
            order,
        })
    }

    /// Allocates `copies` legs of `bytes` each, on distinct devices at every logical range;
    /// frees everything on failure.
    pub(crate) fn allocate_legs(
        &mut self,
        bytes: u64,
        copies: u8,
    ) -> Result<Vec<Vec<ExtentEntry>>> {
        let mut legs: Vec<Vec<ExtentEntry>> = Vec::new();
        for _ in 0..copies {
            let others: Vec<&[ExtentEntry]> = legs.iter().map(|l| l.as_slice()).collect();
            match self.allocate_leg(0, bytes, &others) {
                Ok(l) => legs.push(l),
                Err(e) => {
                    for l in &legs {
                        self.release(l);
                    }
                    return Err(match e {
                        Error::NoSpace { available, .. } => Error::NoSpace {
                            requested: bytes * copies as u64,
                            available,
                        },
                        e => e,
                    });
                }
            }
        }
        Ok(legs)
    }
}
