//! Human sizes ("512M", "4G", "4096") for config files, the CLI and the wire.

use serde::{Deserialize, Serialize};

/// A size written as a number of bytes or a string with a suffix.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    /// The size in bytes.
    pub fn bytes(&self) -> Result<u64, SizeError> {
        match self {
            SizeValue::Bytes(n) => Ok(*n),
            SizeValue::Text(s) => parse_size(s),
        }
    }
}

/// A size that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("'{0}' is not a size (examples: 4096, 512M, 4G)")]
    NotASize(String),
    #[error("size '{0}' is too large")]
    TooLarge(String),
}

/// Parses a byte size: a number with an optional K/M/G/T suffix (powers of 1024; a trailing
/// "iB" or "B" is accepted).
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| SizeError::NotASize(s.to_string()))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| SizeError::TooLarge(s.to_string()))
}

/// Formats bytes for people (exact when possible: "512M", otherwise bytes).
pub fn format_size(n: u64) -> String {
    for (shift, suffix) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if n >= 1 << shift && n.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", n >> shift);
        }
    }
    if n >= 1 << 20 {
        return format!("{:.1}M", n as f64 / (1 << 20) as f64);
    }
    n.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size(" 1 k").unwrap(), 1024);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(format_size(512 << 20), "512M");
        assert_eq!(format_size(1000), "1000");
    }
}
