//! Comparing a mirror's legs region by region while it serves (a scrub, `volume verify`):
//! regions with writes in flight are compared again once quiet; regions where a usable leg
//! is still being copied to, or that are out of sync, are counted as skipped.
//!
//! Owns: [`Verify`]. Must not know: the data path's queues, the pool.

use std::sync::atomic::Ordering;

use super::bitmap::{stale, sync_source};
use super::copy::quiet_gen;
use super::legio::{leg_read, AlignedBuf, LegIo};
use super::resync::region_range;
use super::{Shared, MAX_LEGS};
use spool_devices::Result;

/// What [`super::Mirror::verify`] found.
#[derive(Debug, Clone, Default)]
pub struct Verify {
    pub regions: u64,
    pub bytes_compared: u64,
    /// Regions where some legs were stale (known to differ until copied): not compared.
    pub regions_skipped: u64,
    /// Regions where current legs differ, and the volume offsets of the first few.
    pub regions_differing: u64,
    pub first_differences: Vec<u64>,
}

/// Compares the current legs region by region.
pub(crate) fn verify(shared: &Shared) -> Result<Verify> {
    let mut v = Verify::default();
    let n = shared.regions.bitmap.regions();
    let (mut a, mut b) = (AlignedBuf::default(), AlignedBuf::default());
    let mut io = LegIo::default();
    for r in 0..n {
        v.regions += 1;
        for _attempt in 0..50 {
            let byte = shared.regions.bitmap.byte(r).load(Ordering::Acquire);
            let (off, len) = region_range(shared, r);
            let usable = shared.usable(shared.healthy(), off, len);
            let legs: Vec<u8> = (0..MAX_LEGS as u8)
                .filter(|s| usable & !byte & stale(*s) != 0)
                .collect();
            // A usable leg still being copied to, or the region out of sync: not compared.
            if byte & usable & 0b111 != 0 || sync_source(byte).is_some() || legs.len() < 2 {
                v.regions_skipped += 1;
                break;
            }
            let Some(g) = quiet_gen(shared, r) else {
                continue;
            };
            let (a, b) = (a.get(len as usize), b.get(len as usize));
            leg_read(shared, &mut io, legs[0], off, a)?;
            let mut differ = false;
            for &l in &legs[1..] {
                leg_read(shared, &mut io, l, off, b)?;
                differ |= a != b;
            }
            if shared.regions.gens[r].load(Ordering::SeqCst) != g {
                continue;
            }
            v.bytes_compared += len * legs.len() as u64;
            if differ {
                v.regions_differing += 1;
                if v.first_differences.len() < 16 {
                    v.first_differences.push(off);
                }
            }
            break;
        }
    }
    Ok(v)
}
