//! The reference model: what every 512-byte sector of a volume (or of a snapshot) may hold,
//! and the stamp that says who wrote a sector.
//!
//! Every write stamps each sector with the volume offset it is meant for and the write's
//! generation (unique in a run), the rest of the sector derived from both. A read checks each
//! sector against the set of values the model allows there: the last acknowledged write, a
//! write still in flight, zeroes where nothing was written or zeroes were written, anything
//! at all where the volume may legitimately hold noise (an encrypted volume's discarded
//! range). A sector stamped for another offset is always a failure: another block's data.
//!
//! Owns: the stamp format and the per-sector sets. Must not know: devices, queues, pools.

/// What is wrong: a finding of the tester (or a world it could not build), in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wrong(pub String);

impl std::fmt::Display for Wrong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for Wrong {
    fn from(s: String) -> Wrong {
        Wrong(s)
    }
}

/// Bytes per sector: the unit the model follows.
pub const SECTOR: u64 = 512;
/// Generation 0: zeroes.
pub const ZERO: u64 = 0;
/// Any content (what a discarded sector of an encrypted volume may decrypt to).
pub const ANY: u64 = u64::MAX;

const MAGIC: u64 = 0x5350_4f4f_4c54_5254; // "SPOOLTRT"

/// Word `i` (from 3) of the stamp of `(offset, generation)`.
fn filler(offset: u64, generation: u64, i: u64) -> u64 {
    let mut x = offset ^ generation.rotate_left(32) ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^ (x >> 29)
}

/// Fills `buf` (whole sectors) with the stamp of a write of generation `generation` at
/// volume offset `offset`.
pub fn stamp(buf: &mut [u8], offset: u64, generation: u64) {
    for (k, s) in buf.chunks_exact_mut(SECTOR as usize).enumerate() {
        let at = offset + k as u64 * SECTOR;
        for (i, w) in s.chunks_exact_mut(8).enumerate() {
            let v = match i {
                0 => MAGIC,
                1 => at,
                2 => generation,
                _ => filler(at, generation, i as u64),
            };
            w.copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// What one sector read back holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// All zeroes.
    Zeroes,
    /// A whole stamp: the offset it was written for and its generation.
    Stamp { offset: u64, generation: u64 },
    /// Neither: noise, or a stamp torn or corrupted.
    Garbage,
}

/// Decodes one sector.
pub fn decode(sector: &[u8]) -> Seen {
    let word = |i: usize| u64::from_le_bytes(sector[i * 8..i * 8 + 8].try_into().unwrap());
    if sector.iter().all(|&b| b == 0) {
        return Seen::Zeroes;
    }
    if word(0) != MAGIC {
        return Seen::Garbage;
    }
    let (offset, generation) = (word(1), word(2));
    let whole = (3..SECTOR as usize / 8).all(|i| word(i) == filler(offset, generation, i as u64));
    if whole {
        Seen::Stamp { offset, generation }
    } else {
        Seen::Garbage
    }
}

/// What a sector that is no whole stamp looks like, for a failure's message: the stamp its
/// first words name and where the bytes stop matching it, or how many bytes are zero.
pub fn describe(sector: &[u8]) -> String {
    let word = |i: usize| u64::from_le_bytes(sector[i * 8..i * 8 + 8].try_into().unwrap());
    let zeroes = sector.iter().filter(|&&b| b == 0).count();
    if word(0) != MAGIC {
        return format!(
            "no stamp header ({zeroes} of 512 bytes zero, first word {:#x})",
            word(0)
        );
    }
    let (offset, generation) = (word(1), word(2));
    let bad = (3..SECTOR as usize / 8).find(|&i| word(i) != filler(offset, generation, i as u64));
    let runs = (3..SECTOR as usize / 8)
        .filter(|&i| word(i) != filler(offset, generation, i as u64))
        .count();
    format!(
        "a stamp for offset {offset} generation {generation} that stops matching at byte {} ({runs} of 61 words differ; {zeroes} bytes zero)",
        bad.map_or(0, |i| i * 8)
    )
}

/// The values each sector of one volume may hold: a set per sector, kept as runs of
/// sectors with the same set.
#[derive(Debug, Clone)]
pub struct Model {
    /// `sets[i]`: what sector `i` may hold; most are a single value.
    sets: Vec<Vec<u64>>,
    /// What a sector never written may hold: zeroes, or on an encrypted volume also noise
    /// (zeroed space decrypts to it, as on dm-crypt: docs/encryption.md).
    fresh: Vec<u64>,
}

impl Model {
    /// A volume of `bytes` bytes never written; `encrypted`: its fresh space reads noise.
    pub fn new(bytes: u64, encrypted: bool) -> Model {
        let fresh = match encrypted {
            true => vec![ZERO, ANY],
            false => vec![ZERO],
        };
        Model {
            sets: vec![fresh.clone(); (bytes / SECTOR) as usize],
            fresh,
        }
    }

    /// Sectors the model covers.
    pub fn sectors(&self) -> u64 {
        self.sets.len() as u64
    }

    /// The volume grew to `bytes`: the new sectors are fresh.
    pub fn grow(&mut self, bytes: u64) {
        self.sets
            .resize((bytes / SECTOR) as usize, self.fresh.clone());
    }

    fn range(&mut self, offset: u64, len: u64) -> &mut [Vec<u64>] {
        let (a, b) = (
            (offset / SECTOR) as usize,
            ((offset + len) / SECTOR) as usize,
        );
        &mut self.sets[a..b]
    }

    /// `[offset, offset + len)` holds `value` now, and nothing else (an acknowledged write).
    pub fn set(&mut self, offset: u64, len: u64, value: u64) {
        for s in self.range(offset, len) {
            s.clear();
            s.push(value);
        }
    }

    /// `[offset, offset + len)` may also hold `value` (a write in flight, failed or given up).
    pub fn allow(&mut self, offset: u64, len: u64, value: u64) {
        for s in self.range(offset, len) {
            if !s.contains(&value) {
                s.push(value);
            }
        }
    }

    /// The volume holds what `other` says (a revert to the snapshot `other` models), over
    /// the sectors both have.
    pub fn take(&mut self, other: &Model) {
        for (s, o) in self.sets.iter_mut().zip(&other.sets) {
            s.clone_from(o);
        }
        // Sectors past the snapshot's size (a grow since): what a revert leaves there is
        // the snapshot's (holes: fresh).
        for s in self.sets.iter_mut().skip(other.sets.len()) {
            s.clone_from(&self.fresh);
        }
    }

    /// The volume may hold what it holds or what `other` says (a revert that failed part
    /// way).
    pub fn widen(&mut self, other: &Model) {
        for (i, s) in self.sets.iter_mut().enumerate() {
            let more = other.sets.get(i).unwrap_or(&self.fresh);
            for &v in more {
                if !s.contains(&v) {
                    s.push(v);
                }
            }
        }
    }

    /// The sets become `sets` (a flush's accumulated view of the whole volume), over the
    /// sectors both have.
    pub fn replace(&mut self, sets: Vec<Vec<u64>>) {
        for (s, n) in self.sets.iter_mut().zip(sets) {
            *s = n;
        }
    }

    /// What sector `i` may hold.
    pub fn allowed(&self, i: u64) -> &[u64] {
        &self.sets[i as usize]
    }

    /// The sets of `[offset, offset + len)`, as they are now (what a read racing updates
    /// starts from: `widen_sets` adds what the updates allow).
    pub fn sets_of(&self, offset: u64, len: u64) -> Vec<Vec<u64>> {
        let (a, b) = (
            (offset / SECTOR) as usize,
            ((offset + len) / SECTOR) as usize,
        );
        self.sets[a..b].to_vec()
    }

    /// Whether `seen` at volume offset `at` (sector `at / SECTOR`) is allowed; `Err` says
    /// what is wrong.
    pub fn check(&self, at: u64, seen: Seen) -> Result<(), Wrong> {
        check_allowed(self.allowed(at / SECTOR), at, seen)
    }
}

/// Adds `value` to the sets of `sets` (covering volume bytes from `start`) over
/// `[offset, offset + len)`.
pub fn widen_sets(sets: &mut [Vec<u64>], start: u64, offset: u64, len: u64, value: u64) {
    let end = start + sets.len() as u64 * SECTOR;
    let (a, b) = (offset.max(start), (offset + len).min(end));
    if a >= b {
        return;
    }
    for s in &mut sets[((a - start) / SECTOR) as usize..((b - start) / SECTOR) as usize] {
        if !s.contains(&value) {
            s.push(value);
        }
    }
}

/// Whether `seen` at volume offset `at` is one of `allowed`; `Err` says what is wrong.
pub fn check_allowed(allowed: &[u64], at: u64, seen: Seen) -> Result<(), Wrong> {
    {
        if allowed.contains(&ANY) {
            return match seen {
                Seen::Stamp { offset, generation } if offset != at => Err(Wrong(format!(
                    "another block's data: stamped for offset {offset} (generation {generation})"
                ))),
                _ => Ok(()),
            };
        }
        let ok = match seen {
            Seen::Zeroes => allowed.contains(&ZERO),
            Seen::Stamp { offset, generation } => {
                if offset != at {
                    return Err(Wrong(format!(
                        "another block's data: stamped for offset {offset} (generation {generation}); allowed {allowed:?}"
                    )));
                }
                allowed.contains(&generation)
            }
            Seen::Garbage => false,
        };
        match ok {
            true => Ok(()),
            false => Err(Wrong(format!("holds {seen:?}, allowed {allowed:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_decode_and_the_model_tells_right_from_wrong() {
        let mut buf = vec![0u8; 2048];
        stamp(&mut buf, 4096, 7);
        assert_eq!(
            decode(&buf[512..1024]),
            Seen::Stamp {
                offset: 4608,
                generation: 7
            }
        );
        buf[600] ^= 1;
        assert_eq!(decode(&buf[512..1024]), Seen::Garbage);
        assert_eq!(decode(&[0u8; 512]), Seen::Zeroes);
        let mut m = Model::new(8192, false);
        m.set(4096, 1024, 7);
        m.allow(4096, 512, 9);
        assert!(m
            .check(
                4096,
                Seen::Stamp {
                    offset: 4096,
                    generation: 9
                }
            )
            .is_ok());
        assert!(m
            .check(
                4608,
                Seen::Stamp {
                    offset: 4608,
                    generation: 9
                }
            )
            .is_err());
        let e = m
            .check(
                4096,
                Seen::Stamp {
                    offset: 0,
                    generation: 7,
                },
            )
            .unwrap_err();
        assert!(e.0.contains("another block's data"), "{e}");
        assert!(m.check(0, Seen::Zeroes).is_ok());
        m.allow(0, 512, ANY);
        assert!(m.check(0, Seen::Garbage).is_ok());
        assert!(m
            .check(
                0,
                Seen::Stamp {
                    offset: 8,
                    generation: 1
                }
            )
            .is_err());
    }
}
