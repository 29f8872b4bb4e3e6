//! When the mirror must call itself resetting though every region has a usable current leg
//! on its own: a request may span several regions and stripes, and the write path sends a
//! write only to legs usable over all of it. While a device resets, a span may have no
//! such leg current in each of its regions, though it would once the device is back: the
//! worker must then hold the request (the mirror resetting) rather than spend its retries
//! on every other health change and fail it.
//!
//! Owns: those rules. Must not know: the worker, how the legs came to be so.

use std::sync::atomic::Ordering;

use super::{Shared, MAX_LEGS, MISSING};

/// Stripes a request may span: a guest's largest (a few MiB) over extents of 1 MiB or more.
const SPAN_STRIPES: usize = 4;
/// Bytes a request may span: a guest's largest (a few MiB; tier 2 sends up to 1280 KiB,
/// guests with raised `max_sectors_kb` 4 MiB).
const SPAN_BYTES: u64 = 4 << 20;

/// Whether requests over regions `first..=last` could go on with the devices in `devices`:
/// some leg usable over all of them is current in all, or (a range whose regions are
/// current on different legs) in each a leg usable over all is current.
fn servable(shared: &Shared, devices: u64, first: usize, last: usize) -> bool {
    let (off, _) = shared.region_range(first);
    let (l_off, l_len) = shared.region_range(last);
    let len = l_off + l_len - off;
    shared.current(devices, off, len, (first, last)) != 0
        || shared.current_sets(devices, off, len, (first, last)) & 1 == 0
}

/// Whether some run of regions a request may span cannot be served now but could be once
/// the resetting devices are back. (Scanned only while a device resets and some leg is
/// stale somewhere: otherwise a usable leg is current wherever one is.) A single region
/// with no usable current leg is such a run; so is one whose regions each have a usable
/// current leg, but where the leg current in one region is not usable in the next (it lies
/// on the resetting device there: tier-2 torture, a write of 1280 KiB failed during a
/// link-down of 126 ms, the mirror calling itself healthy throughout).
pub(crate) fn spans(shared: &Shared, healthy: u64) -> bool {
    let (r, alive) = (&shared.regions, shared.alive());
    if alive == healthy || r.stale.iter().all(|s| s.load(Ordering::Relaxed) == 0) {
        return false;
    }
    let n = r.bitmap.regions();
    let (_, region) = shared.region_range(0);
    let span = (SPAN_BYTES / region.max(1)) as usize + 1;
    (0..n).any(|i| {
        (i..(i + span).min(n))
            .any(|j| !servable(shared, healthy, i, j) && servable(shared, alive, i, j))
    })
}

/// Whether some run of up to [`SPAN_STRIPES`] stripes has no leg on healthy devices across
/// all of it, though it would have one once the resetting devices are back: legs that swap
/// devices between stripes (a grown mirror's new extents land where there is space), one
/// of the devices resetting. A request across such a run has no leg to go to until the
/// device is back (tier-2 torture: a write failed after three retries, a link-down of
/// 104 ms).
pub(crate) fn stripes(shared: &Shared, healthy: u64) -> bool {
    let alive = shared.alive();
    if alive == healthy {
        return false;
    }
    let on = |s: &crate::Stripe, devices: u64| {
        (0..MAX_LEGS).fold(0u8, |m, slot| {
            let d = s.dev[slot];
            m | (((d != MISSING && devices & (1 << d) != 0) as u8) << slot)
        })
    };
    let st = &shared.stripes;
    (0..st.len()).any(|i| {
        let (mut now, mut later) = (0b111u8, 0b111u8);
        st[i..(i + SPAN_STRIPES).min(st.len())].iter().any(|s| {
            now &= on(s, healthy);
            later &= on(s, alive);
            now == 0 && later != 0
        })
    })
}
