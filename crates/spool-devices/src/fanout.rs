//! Fan-out of one request over device commands: where its bytes lie ([`Span`], [`split`],
//! [`within_one`]) and what its pieces add up to ([`Fanout`]: how many are still out, which
//! targets failed and how, each failure reported to its device's health cell with where it
//! happened). The worker's split of a request over a volume's layout and the mirror's
//! copies of a request on its legs are both this one engine.
//!
//! Owns: the span walk, the piece count, the merge of piece failures into a request's
//! outcome. Must not know: what a target is (a layout's device, a mirror's leg), or what a
//! failure makes of the request (hold it, try another leg, fail it): its owner decides from
//! the merged outcome.

use crate::health::{DeviceHealth, ErrorClass, ErrorReport, Signal};

/// A stretch of a volume's (or a leg's) address space that lies on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Byte offset in the address space where it starts.
    pub logical: u64,
    pub len: u64,
    /// The device, as an index its owner gives (into a layout's or a mirror's devices).
    pub device: usize,
    /// Device byte offset.
    pub offset: u64,
}

/// Index of the first span of `spans` (in logical order, without gaps) that ends past
/// `offset`.
#[inline]
fn span_at(spans: &[Span], offset: u64) -> usize {
    spans.partition_point(|s| s.logical + s.len <= offset)
}

/// Calls `f(device, device offset, length, offset within the range)` for each piece of
/// `[offset, offset + len)` over `spans`, in order; a range past the last span stops there.
#[inline]
pub fn split(spans: &[Span], offset: u64, len: u64, mut f: impl FnMut(usize, u64, u64, u64)) {
    let mut done = 0;
    for s in &spans[span_at(spans, offset)..] {
        if done >= len {
            break;
        }
        let within = offset + done - s.logical;
        let n = (s.len - within).min(len - done);
        f(s.device, s.offset + within, n, done);
        done += n;
    }
}

/// The device and device offset of `[offset, offset + len)` when it lies within one span
/// (the common case); `None` when it crosses spans or lies past them.
#[inline]
pub fn within_one(spans: &[Span], offset: u64, len: u64) -> Option<(usize, u64)> {
    let s = spans.get(span_at(spans, offset))?;
    let within = offset.checked_sub(s.logical)?;
    (s.len - within >= len).then_some((s.device, s.offset + within))
}

/// Where a failed piece went: its target (the owner's index; targets below 8 are told
/// apart in [`Fanout::failed_targets`], as a mirror's legs are), and the device range and
/// direction the health report names (0, 0 when it has none, as a flush).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PieceAt {
    pub target: u8,
    pub offset: u64,
    pub len: u64,
    pub write: bool,
}

/// A piece failed with a path error, or its device is gone: the request may succeed after
/// a health change.
const PATH: u8 = 1;
/// A piece was cancelled by us (an abort, a queue lost to a reset).
const CANCELLED: u8 = 2;
/// A piece failed with a media or request error: the request failed.
const FATAL: u8 = 4;
/// A piece succeeded.
const SUCCEEDED: u8 = 8;

/// One request's pieces on their devices: how many are still out, and what their failures
/// add up to. Twelve bytes: it lives in every request's record on the hot path. Not `Copy`:
/// a count worked on in a copy would be lost, and its request never finish.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Fanout {
    pending: u32,
    /// The first failure's negated errno (0: none).
    err: i32,
    /// Targets (below 8) with a failed piece, and those whose piece failed with a media
    /// error.
    failed: u8,
    media: u8,
    /// `PATH`, `CANCELLED`, `FATAL`, `SUCCEEDED`.
    flags: u8,
}

impl Fanout {
    /// A request with `pieces` pieces out and no failure.
    #[inline]
    pub fn new(pieces: u32) -> Fanout {
        Fanout {
            pending: pieces,
            ..Fanout::default()
        }
    }

    /// One more piece sent.
    #[inline]
    pub fn issue(&mut self) {
        self.pending += 1;
    }

    /// A piece came back, `ok` or not (a failed one goes through [`Fanout::piece_failed`]
    /// first); returns whether it was the last one out.
    #[inline]
    pub fn piece_back(&mut self, ok: bool) -> bool {
        self.flags |= (ok as u8) * SUCCEEDED;
        self.pending -= 1;
        self.pending == 0
    }

    /// A piece failed with `errno` (positive): reported to `health` with where it went,
    /// unless we cancelled it ourselves, and merged into the outcome. Returns its class.
    #[cold]
    pub fn piece_failed(&mut self, errno: i32, at: PieceAt, health: &DeviceHealth) -> ErrorClass {
        let class = ErrorClass::of_errno(errno);
        if errno == libc::ECANCELED {
            self.flags |= CANCELLED;
        } else {
            health.report(ErrorReport {
                signal: Signal::Errno(errno),
                offset: at.offset,
                len: at.len,
                write: at.write,
            });
            self.flags |= match class {
                ErrorClass::Path | ErrorClass::Gone => PATH,
                ErrorClass::Media | ErrorClass::Request => FATAL,
            };
        }
        let bit = 1u8.checked_shl(at.target as u32).unwrap_or(0);
        self.failed |= bit;
        if class == ErrorClass::Media {
            self.media |= bit;
        }
        if self.err == 0 {
            self.err = -errno;
        }
        class
    }

    /// A failure outside any piece (no queue for a device, an allocator's answer), as a
    /// negated errno: the request's first error unless one came before (0 changes nothing).
    #[inline]
    pub fn note_failure(&mut self, err: i32) {
        if self.err == 0 {
            self.err = err;
        }
    }

    /// A failure outside any piece that decides the request's error from now on, whatever
    /// came before (a thin volume's queue that cannot be had, a chunk that could not be
    /// allocated), as a negated errno.
    #[inline]
    pub fn set_failure(&mut self, err: i32) {
        self.err = err;
    }

    /// The request failed before any piece went out (an isolated device, no queue):
    /// nothing is pending, and it failed.
    #[inline]
    pub fn fail_unsent(&mut self) {
        self.pending = 0;
        self.flags |= FATAL;
    }

    /// Starts over for pieces sent again elsewhere (a read on another leg): the failures
    /// so far are forgotten; returns the first one's negated errno.
    pub fn retry(&mut self) -> i32 {
        let err = self.err;
        *self = Fanout::default();
        err
    }

    /// Pieces still out.
    #[inline]
    pub fn pending(&self) -> u32 {
        self.pending
    }

    /// Whether no piece failed in a way that decides the request (media, request error).
    #[inline]
    pub fn ok(&self) -> bool {
        self.flags & FATAL == 0
    }

    /// Whether a piece failed with a path error or on a device that is gone.
    #[inline]
    pub fn path_failed(&self) -> bool {
        self.flags & PATH != 0
    }

    /// Whether a piece was cancelled by us.
    #[inline]
    pub fn cancelled(&self) -> bool {
        self.flags & CANCELLED != 0
    }

    /// The targets (below 8) whose piece failed, a bit per target.
    #[inline]
    pub fn failed_targets(&self) -> u8 {
        self.failed
    }

    /// The targets (below 8) whose piece failed with a media error.
    #[inline]
    pub fn media_targets(&self) -> u8 {
        self.media
    }

    /// Whether some piece succeeded.
    #[inline]
    pub fn any_succeeded(&self) -> bool {
        self.flags & SUCCEEDED != 0
    }

    /// The first failure's negated errno, 0 when none failed.
    #[inline]
    pub fn first_error(&self) -> i32 {
        self.err
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::HealthState;

    fn spans() -> Vec<Span> {
        vec![
            Span {
                logical: 0,
                len: 4096,
                device: 1,
                offset: 8192,
            },
            Span {
                logical: 4096,
                len: 8192,
                device: 0,
                offset: 0,
            },
        ]
    }

    #[test]
    fn a_range_splits_along_its_spans_and_stops_at_their_end() {
        let mut got = Vec::new();
        split(&spans(), 2048, 4096, |d, off, n, at| {
            got.push((d, off, n, at))
        });
        assert_eq!(got, vec![(1, 10240, 2048, 0), (0, 0, 2048, 2048)]);
        got.clear();
        split(&spans(), 8192, 1 << 20, |d, off, n, at| {
            got.push((d, off, n, at))
        });
        assert_eq!(got, vec![(0, 4096, 4096, 0)]);
        assert_eq!(within_one(&spans(), 4096, 8192), Some((0, 0)));
        assert_eq!(within_one(&spans(), 2048, 4096), None);
        assert_eq!(within_one(&spans(), 12288, 512), None);
    }

    #[test]
    fn failures_merge_by_class_and_are_reported_with_their_range() {
        let health = DeviceHealth::default();
        let mut f = Fanout::new(3);
        let at = |target| PieceAt {
            target,
            offset: 4096,
            len: 512,
            write: true,
        };
        assert_eq!(
            f.piece_failed(libc::ECANCELED, at(0), &health),
            ErrorClass::Path
        );
        assert!(!f.piece_back(false));
        assert!(f.cancelled() && !f.path_failed() && f.ok());
        assert!(
            health.take_reports().0.is_empty(),
            "our own cancel is not reported"
        );
        f.piece_failed(libc::ENODATA, at(2), &health);
        assert!(!f.piece_back(false));
        assert!(!f.any_succeeded());
        assert!(f.piece_back(true));
        assert!(!f.ok() && f.any_succeeded());
        assert_eq!(std::mem::size_of::<Fanout>(), 12);
        assert_eq!((f.failed_targets(), f.media_targets()), (0b101, 0b100));
        assert_eq!(f.first_error(), -libc::ECANCELED);
        let (reports, _) = health.take_reports();
        assert_eq!(reports.len(), 1);
        assert_eq!((reports[0].offset, reports[0].len), (4096, 512));
        assert_eq!(f.retry(), -libc::ECANCELED);
        assert_eq!(f, Fanout::default());
        assert_eq!(health.state(), HealthState::Healthy);
    }
}
