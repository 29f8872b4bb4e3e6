//! Taking over the controllers the previous worker left running (docs/nvme.md, "handoff"):
//! re-attaching to each live admin queue and deleting the old I/O queues, or preparing a reset
//! when that is not possible, then clearing the previous worker's DMA mappings.
//!
//! Owns: the set of controllers prepared from what the keeper handed over, built once per
//! process before the first controller is opened and drained by [`Controller::open`].
//!
//! Must not know: the keeper (descriptors come from the daemon's [`Handoff`]), the data path.
//!
//! Why a process-wide registry and not a handle: what is taken over is process-wide by nature.
//! The handoff gives this process one VFIO container (the IOMMU domain every controller and
//! the DMA registry share) and the previous worker's controllers all at once; every kept
//! controller must be re-attached, and its old I/O queues deleted, *before* the container's
//! old mappings are cleared and registered memory is mapped again, which must happen before
//! any controller of this process issues a command. The descriptors come from the daemon's
//! [`Handoff`], which every open is given; what was made of them, the prepared set, belongs
//! to the process's one container as the container does. So it lives in one static, built
//! from the first open's handoff and emptied as each controller is opened. (A process has one
//! daemon, which opens every device with its one handoff: a first open with another handoff,
//! one with nothing offered, would skip the takeover for good.)

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use super::{admin_qp, Controller, RESUME_TIMEOUT};
use crate::arena::Arena;
use crate::handoff::Handoff;
use crate::spec::{self, admin, Cap, Sqe};
use crate::vfio::{Bar, Container, Device};
use crate::{Error, QueuePair};

/// A controller the previous worker left, prepared by [`take_over_all`].
pub(super) enum Prepared {
    /// Re-attached to the live admin queue; the old I/O queues are deleted.
    Attached {
        dev: Device,
        bar: Bar,
        arena: Arena,
        admin: QueuePair,
    },
    /// Could not re-attach (why): reset it, reusing the kept descriptor and arena.
    Reset {
        dev: Device,
        arena: Option<Arena>,
        why: String,
    },
}

/// The controllers taken over from the previous worker, by address; built by the first
/// [`Controller::open`] of the process (see the module doc).
static PREPARED: OnceLock<Mutex<HashMap<String, Prepared>>> = OnceLock::new();

/// Runs the takeover of what `handoff` was offered if this is the process's first open
/// (before anything else of it).
pub(super) fn take_over_once(handoff: &Arc<Handoff>) {
    PREPARED.get_or_init(|| Mutex::new(take_over_all(handoff)));
}

/// What the previous worker left of the controller at `bdf`, if anything (once: taken out).
pub(super) fn take_prepared(bdf: &str) -> Option<Prepared> {
    PREPARED
        .get()?
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(bdf)
}

/// Takes over every controller the previous worker deposited: re-attaches to each live admin
/// queue, deletes the previous worker's I/O queues (the controller aborts what they held),
/// then clears the previous worker's DMA mappings of guest and bounce memory. Runs once
/// (building [`PREPARED`]), before any controller is opened.
fn take_over_all(handoff: &Arc<Handoff>) -> HashMap<String, Prepared> {
    let mut out = HashMap::new();
    let bdfs = handoff.offered_controllers();
    if bdfs.is_empty() {
        return out;
    }
    let container = match Container::get(handoff) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot take the kept VFIO container over; controllers will be reopened and reset");
            return out;
        }
    };
    for bdf in bdfs {
        let Some((value, mut files)) = handoff.take(&crate::handoff::ctrl_key(&bdf)) else {
            continue;
        };
        let t = Instant::now();
        let iova = serde_iova(&value);
        let arena_file = if files.len() == 2 { files.pop() } else { None };
        let Some(dev_file) = files.pop() else {
            continue;
        };
        let dev = match Device::open(&bdf, Some(dev_file), crate::dma::map_all, handoff) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(controller = %bdf, error = %e, "cannot reuse the kept device descriptor");
                continue;
            }
        };
        let arena = match (arena_file, iova) {
            (Some(f), Some(iova)) => match Arena::restore(f, iova) {
                Ok(a) => Some(a),
                Err(e) => {
                    tracing::warn!(controller = %bdf, error = %e, "kept arena unusable");
                    None
                }
            },
            _ => None,
        };
        let p = match arena {
            None => Prepared::Reset {
                dev,
                arena: None,
                why: "no usable arena was kept".into(),
            },
            Some(arena) => match attach(&bdf, &dev, &arena) {
                Ok((bar, admin)) => {
                    tracing::info!(controller = %bdf, ms = format!("{:.2}", t.elapsed().as_secs_f64() * 1e3),
                        "re-attached to the live controller (no reset); the previous worker's I/O queues are deleted");
                    Prepared::Attached {
                        dev,
                        bar,
                        arena,
                        admin,
                    }
                }
                Err(why) => Prepared::Reset {
                    dev,
                    arena: Some(arena),
                    why: why.to_string(),
                },
            },
        };
        out.insert(bdf, p);
    }
    if container.restored {
        if let Err(e) = crate::dma::remap_all_after_takeover(&container) {
            tracing::error!(error = %e, "cannot map registered memory after the takeover");
        }
    }
    out
}

fn serde_iova(value: &str) -> Option<u64> {
    // The kept value is `{"arena_iova":N}`.
    let v = value.split("\"arena_iova\":").nth(1)?;
    v.trim_end_matches('}').trim().parse().ok()
}

/// Re-attaches to a live controller's admin queue and deletes its I/O queues.
fn attach(bdf: &str, dev: &Device, arena: &Arena) -> crate::Result<(Bar, QueuePair)> {
    let bar = dev.map_bar(0)?;
    // SAFETY: register offsets inside the BAR (NVMe BAR0 is at least 8 KiB; checked below).
    let rd32 = |at: usize| unsafe { bar.ptr.add(at).cast::<u32>().read_volatile() };
    if bar.len < 0x2000 {
        return Err(Error::Invalid("BAR0 too small".into()));
    }
    let (cc, csts) = (rd32(spec::REG_CC), rd32(spec::REG_CSTS));
    if csts == u32::MAX {
        return Err(Error::Invalid("registers read all ones".into()));
    }
    if cc & spec::CC_EN == 0 || csts & spec::CSTS_RDY == 0 || csts & spec::CSTS_CFS != 0 {
        return Err(Error::Invalid(format!(
            "controller not running (CC {cc:#x}, CSTS {csts:#x})"
        )));
    }
    let cap = Cap::decode(rd32(spec::REG_CAP) as u64 | (rd32(spec::REG_CAP + 4) as u64) << 32);
    let mut admin = admin_qp(arena, true, bar.ptr, cap.doorbell_stride);
    let left = arena
        .header()
        .admin
        .outstanding
        .load(std::sync::atomic::Ordering::Acquire);
    if admin.resume(RESUME_TIMEOUT).is_none() {
        return Err(Error::Invalid(format!(
            "{left} admin commands of the previous worker did not complete"
        )));
    }
    let csts_fn = || rd32(spec::REG_CSTS);
    for qid in arena.header().live_qids() {
        for (op, what) in [
            (admin::DELETE_SQ, "delete old I/O submission queue"),
            (admin::DELETE_CQ, "delete old I/O completion queue"),
        ] {
            match Controller::run_sync(
                bdf,
                &mut admin,
                Sqe {
                    cdw10: qid as u32,
                    ..Sqe::new(op, 0)
                },
                what,
                &csts_fn,
            ) {
                Ok(_) | Err(Error::Command { .. }) => {}
                Err(e) => return Err(Error::Invalid(format!("{what} {qid}: {e}"))),
            }
        }
        arena.header().set_qid(qid, false);
    }
    Ok((bar, admin))
}

#[cfg(test)]
mod tests {
    use super::serde_iova;

    #[test]
    fn the_kept_arena_address_is_read_back_as_open_writes_it() {
        // `Controller::open` deposits `{"arena_iova":N}` with the keeper.
        let iova = 0x1234_5000u64;
        assert_eq!(
            serde_iova(&format!("{{\"arena_iova\":{iova}}}")),
            Some(iova)
        );
        assert_eq!(serde_iova("{}"), None);
        assert_eq!(serde_iova("{\"arena_iova\":x}"), None);
    }
}
