//! Per-volume I/O limits as people and the control API write them: IOPS ("20k"), bytes per
//! second ("200M"), bursts ("250ms"), scheduling classes, and the limits in one line.
//!
//! Owns: parsing and formatting of rates and bursts, [`Priority`] as the wire names it.
//! Must not know: how the pool keeps limits or how the frontend enforces them.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::size::{format_size, parse_size};
use crate::QosLimits;

/// The largest rate a limit may name (the pool keeps the same bound).
pub const MAX_RATE: u64 = 1 << 40;
/// The longest burst allowance, in milliseconds.
pub const MAX_BURST_MS: u32 = 60_000;

/// Which volumes go first for the CPU when volumes compete for it: `normal`, `latency`
/// (never held back by the fair share) or `batch` (behind the others).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    #[default]
    Normal,
    Latency,
    Batch,
}

impl Priority {
    pub fn is_normal(&self) -> bool {
        *self == Priority::Normal
    }

    pub fn name(&self) -> &'static str {
        match self {
            Priority::Normal => "normal",
            Priority::Latency => "latency",
            Priority::Batch => "batch",
        }
    }

    /// "normal", "latency" or "batch".
    pub fn parse(s: &str) -> Option<Priority> {
        [Priority::Normal, Priority::Latency, Priority::Batch]
            .into_iter()
            .find(|p| p.name() == s)
    }
}

/// A limit or burst that could not be read; the message names it and shows examples.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QosError {
    #[error(
        "{what} {value} is not an IOPS rate (examples: 1000, 20k, 1M; k = 1000, 0 = no limit)"
    )]
    NotIops { what: String, value: String },
    #[error("{what} {value} is not a bandwidth (examples: 1048576, 200M, 1G bytes per second; K/M/G = powers of 1024, 0 = no limit)")]
    NotBandwidth { what: String, value: String },
    #[error("{what} {value} is above the largest limit {MAX_RATE}")]
    TooLarge { what: String, value: String },
    #[error("burst {0} is not a duration (examples: 250ms, 1s)")]
    NotBurst(String),
    #[error("burst {0} must be between 1ms and {MAX_BURST_MS}ms")]
    BurstRange(String),
}

/// A rate or a burst as given: a number, a string with a suffix, or anything else (refused
/// with a message that shows it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RateValue {
    Number(u64),
    Text(String),
    Other(Value),
}

impl RateValue {
    /// As shown in error messages: strings in quotes.
    fn shown(&self) -> String {
        match self {
            RateValue::Number(n) => n.to_string(),
            RateValue::Text(s) => format!("{s:?}"),
            RateValue::Other(v) => v.to_string(),
        }
    }

    /// Operations per second.
    pub fn iops(&self, what: &str) -> Result<u64, QosError> {
        let err = || QosError::NotIops {
            what: what.into(),
            value: self.shown(),
        };
        let n = match self {
            RateValue::Number(n) => *n,
            RateValue::Text(s) => parse_iops(s).ok_or_else(err)?,
            RateValue::Other(_) => return Err(err()),
        };
        self.at_most_max(what, n)
    }

    /// Bytes per second.
    pub fn bps(&self, what: &str) -> Result<u64, QosError> {
        let err = || QosError::NotBandwidth {
            what: what.into(),
            value: self.shown(),
        };
        let n = match self {
            RateValue::Number(n) => *n,
            RateValue::Text(s) => parse_size(strip_per_second(s)).map_err(|_| err())?,
            RateValue::Other(_) => return Err(err()),
        };
        self.at_most_max(what, n)
    }

    /// A burst allowance in milliseconds; a string needs its unit ("250ms", "1s").
    pub fn burst_ms(&self) -> Result<u32, QosError> {
        match self {
            RateValue::Text(s) => parse_burst_ms(s),
            _ => Err(QosError::NotBurst(self.shown())),
        }
    }

    fn at_most_max(&self, what: &str, n: u64) -> Result<u64, QosError> {
        if n > MAX_RATE {
            return Err(QosError::TooLarge {
                what: what.into(),
                value: self.shown(),
            });
        }
        Ok(n)
    }
}

/// "200M/s" is "200M".
fn strip_per_second(s: &str) -> &str {
    let t = s.trim();
    t.strip_suffix("/s").unwrap_or(t)
}

/// Operations per second: a number with an optional k (×1000) or M (×1 000 000) suffix.
pub fn parse_iops(s: &str) -> Option<u64> {
    let t = strip_per_second(s);
    let (num, mul) = match t.chars().last()? {
        'k' | 'K' => (&t[..t.len() - 1], 1_000),
        'm' | 'M' => (&t[..t.len() - 1], 1_000_000),
        _ => (t, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mul)
}

/// A burst allowance: whole milliseconds ("250ms") or seconds ("1s"), 1ms to 60s.
pub fn parse_burst_ms(s: &str) -> Result<u32, QosError> {
    let t = s.trim();
    let bad = || QosError::NotBurst(format!("{s:?}"));
    let ms = if let Some(n) = t.strip_suffix("ms") {
        n.trim().parse::<u64>().map_err(|_| bad())?
    } else if let Some(n) = t.strip_suffix('s') {
        n.trim()
            .parse::<u64>()
            .map_err(|_| bad())?
            .saturating_mul(1000)
    } else {
        return Err(bad());
    };
    if !(1..=MAX_BURST_MS as u64).contains(&ms) {
        return Err(QosError::BurstRange(format!("{s:?}")));
    }
    Ok(ms as u32)
}

/// IOPS for people: "20k" when exact.
pub fn format_iops(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n.is_multiple_of(1_000_000) => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n.is_multiple_of(1_000) => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

/// Bytes per second for people: "200M/s".
pub fn format_bps(n: u64) -> String {
    format!("{}/s", format_size(n))
}

/// A burst for people: "1s" or "250ms".
pub fn format_burst(ms: u32) -> String {
    if ms >= 1000 && ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// Limits for people: "iops 20k, bw 200M/s, burst 1s", or "none".
pub fn describe(q: Option<&QosLimits>) -> String {
    let Some(q) = q.filter(|q| !q.is_default()) else {
        return "none".into();
    };
    let mut parts: Vec<String> = q
        .rates()
        .iter()
        .filter(|(_, r)| *r != 0)
        .map(|(name, r)| match name.strip_suffix("bps") {
            Some(dir) => format!("{}bw {}", dir.replace('_', " "), format_bps(*r)),
            None => format!("{} {}", name.replace('_', " "), format_iops(*r)),
        })
        .collect();
    if !q.is_unlimited() {
        parts.push(format!("burst {}", format_burst(q.burst_ms)));
    }
    if q.weight != 0 {
        parts.push(format!("weight {}", q.weight));
    }
    if !q.priority.is_normal() {
        parts.push(format!("priority {}", q.priority.name()));
    }
    parts.join(", ")
}

/// A change to a volume's limits: each given limit replaces the current one (0 removes
/// it), the others stay; with `clear`, the change starts from no limits at all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QosChange {
    pub clear: bool,
    pub iops: Option<u64>,
    pub read_iops: Option<u64>,
    pub write_iops: Option<u64>,
    pub bps: Option<u64>,
    pub read_bps: Option<u64>,
    pub write_bps: Option<u64>,
    pub burst_ms: Option<u32>,
    /// Fair-share weight (0: back to the default).
    pub weight: Option<u32>,
    pub priority: Option<Priority>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_bursts_as_people_write_them() {
        assert_eq!(parse_iops("20k"), Some(20_000));
        assert_eq!(parse_iops("1M"), Some(1_000_000));
        assert_eq!(parse_iops("1500/s"), Some(1500));
        assert_eq!(parse_iops("lots"), None);
        assert_eq!(parse_iops("-1"), None);
        let t = |s: &str| RateValue::Text(s.into());
        assert_eq!(t("200M").bps("bps"), Ok(200 << 20));
        assert_eq!(t("1G/s").bps("bps"), Ok(1 << 30));
        assert_eq!(RateValue::Number(7).iops("iops"), Ok(7));
        let e = t("fast").bps("read_bps").unwrap_err().to_string();
        assert!(e.starts_with("read_bps \"fast\" is not a bandwidth"), "{e}");
        let e = RateValue::Other(serde_json::json!(-5))
            .iops("iops")
            .unwrap_err();
        assert!(
            e.to_string().starts_with("iops -5 is not an IOPS rate"),
            "{e}"
        );
        assert!(matches!(t("2T").bps("bps"), Err(QosError::TooLarge { .. })));
        assert_eq!(parse_burst_ms("250ms"), Ok(250));
        assert_eq!(parse_burst_ms("2s"), Ok(2000));
        assert!(matches!(
            parse_burst_ms("0ms"),
            Err(QosError::BurstRange(_))
        ));
        assert!(matches!(
            parse_burst_ms("61s"),
            Err(QosError::BurstRange(_))
        ));
        assert!(matches!(parse_burst_ms("250"), Err(QosError::NotBurst(_))));
        assert!(RateValue::Number(250).burst_ms().is_err());
        assert_eq!(format_iops(20_000), "20k");
        assert_eq!(format_iops(1500), "1500");
        assert_eq!(format_bps(200 << 20), "200M/s");
        assert_eq!(format_burst(1000), "1s");
        assert_eq!(format_burst(250), "250ms");
    }
}
