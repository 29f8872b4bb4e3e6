//! Log rate limiting for messages a guest or frontend can trigger at will (a re-posted
//! descriptor head, a failed I/O per request): at most `burst` lines per `period` for each
//! limiter, then one summary line saying how many were suppressed. Each worker and session
//! owns its limiters, so one noisy tenant cannot flood the log or drown another's messages.
//!
//! Must not know: what is being logged; callers decide the message and its level.

use std::time::{Duration, Instant};

/// One rate-limited message kind.
#[derive(Debug)]
pub struct LogLimit {
    burst: u32,
    period: Duration,
    window_start: Option<Instant>,
    in_window: u32,
    suppressed: u64,
}

/// What the caller should do with one occurrence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; `suppressed` earlier occurrences were dropped since the last logged one.
    Log { suppressed: u64 },
    /// Drop it.
    Suppress,
}

impl LogLimit {
    /// At most `burst` lines per `period`.
    pub const fn new(burst: u32, period: Duration) -> Self {
        LogLimit {
            burst,
            period,
            window_start: None,
            in_window: 0,
            suppressed: 0,
        }
    }

    /// Counts one occurrence at `now`.
    pub fn check_at(&mut self, now: Instant) -> Verdict {
        let fresh = match self.window_start {
            None => true,
            Some(s) => now.saturating_duration_since(s) >= self.period,
        };
        if fresh {
            self.window_start = Some(now);
            self.in_window = 0;
        }
        if self.in_window < self.burst {
            self.in_window += 1;
            let suppressed = std::mem::take(&mut self.suppressed);
            Verdict::Log { suppressed }
        } else {
            self.suppressed += 1;
            Verdict::Suppress
        }
    }

    /// Counts one occurrence now.
    pub fn check(&mut self) -> Verdict {
        self.check_at(Instant::now())
    }

    /// Occurrences dropped since the last logged one.
    pub fn suppressed(&self) -> u64 {
        self.suppressed
    }
}

/// The limit used for guest-triggered warnings: 10 lines per 10 s per worker and kind.
pub const fn guest_warning() -> LogLimit {
    LogLimit::new(10, Duration::from_secs(10))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_then_suppresses_then_reports_the_count() {
        let mut l = LogLimit::new(3, Duration::from_secs(10));
        let t = Instant::now();
        for _ in 0..3 {
            assert_eq!(l.check_at(t), Verdict::Log { suppressed: 0 });
        }
        for _ in 0..1000 {
            assert_eq!(l.check_at(t + Duration::from_secs(1)), Verdict::Suppress);
        }
        assert_eq!(l.suppressed(), 1000);
        assert_eq!(
            l.check_at(t + Duration::from_secs(11)),
            Verdict::Log { suppressed: 1000 }
        );
        assert_eq!(l.suppressed(), 0);
    }
}
