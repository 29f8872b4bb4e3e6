//! AES-XTS-256 over 512-byte sectors, exactly as dm-crypt's `aes-xts-plain64` (and OpenSSL's
//! `aes-256-xts` with the sector number as a 16-byte little-endian IV): the tweak of sector
//! `n` is AES-256 under the second half of the key of `n` as a 128-bit little-endian number,
//! multiplied by α once per 16-byte block.
//!
//! The AES rounds are the `aes` crate's (RustCrypto), which picks at run time the widest
//! backend the CPU has: VAES over 512-bit registers (64 blocks at a time) where AVX-512 is
//! there, VAES over 256-bit ones, AES-NI, or constant-time software. This module feeds it
//! [`BATCH`] sectors at a time so the wide backends run full, and does XTS's own work
//! around it: the tweaks (one AES block per sector, then a doubling per block) and the two
//! XORs, loaded from the caller's memory and stored to the destination in one pass.
//! (The `xts-mode` crate encrypts one block at a time: 0.6 GB/s on AES-NI where this did
//! 3.7; docs/benchmarks/encryption.md has the rates now.) The tests check it against
//! `xts-mode`, IEEE 1619's vectors and NIST's CAVP XTS-AES-256 vectors.
//!
//! Must not know: where keys come from, devices, volumes.

use aes::cipher::{BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use aes::{Aes256, Block};

use crate::xts_wide::WideKeys;

/// Bytes per XTS data unit (dm-crypt's default sector size).
pub const SECTOR: usize = 512;
/// Bytes of an XTS-256 key: two AES-256 keys, data then tweak.
pub const XTS_KEY_LEN: usize = 64;

/// Blocks per sector.
const BLOCKS: usize = SECTOR / 16;
/// Sectors through the cipher at once: 4 KiB, 256 blocks (four runs of the VAES-512
/// backend's 64; a batch of one sector, 32 blocks, would fall to its one-block path).
const BATCH: usize = 8;

/// Stack bytes below the caller's frame that a call of the wide path is scrubbed of: its
/// deepest spill of round keys was found 2.7 KiB down (release; debug builds' frames are
/// several times larger), so a margin of three times that.
const WIDE_SCRUB: usize = if cfg!(debug_assertions) {
    32 << 10
} else {
    8 << 10
};
/// The same for the batched path (its blocks and tweaks take 8 KiB of its frame).
const BATCHED_SCRUB: usize = if cfg!(debug_assertions) {
    64 << 10
} else {
    24 << 10
};

/// One volume's data cipher. Its round keys are zeroed when it is dropped (the `aes` crate's
/// `zeroize` feature).
pub struct XtsCipher {
    data: Aes256,
    tweak: Aes256,
    /// The VAES-512 path's round keys, where the CPU has it (`xts_wide.rs`).
    pub(crate) wide: Option<WideKeys>,
}

impl XtsCipher {
    /// The cipher of a 64-byte key (data key, then tweak key). `None` when the two halves are
    /// equal, which XTS forbids (OpenSSL refuses such keys).
    pub fn new(key: &[u8; XTS_KEY_LEN]) -> Option<XtsCipher> {
        let (d, t) = key.split_at(32);
        if d == t {
            return None;
        }
        let (d, t): (&[u8; 32], &[u8; 32]) = (d.try_into().ok()?, t.try_into().ok()?);
        Some(XtsCipher {
            data: Aes256::new(d.into()),
            tweak: Aes256::new(t.into()),
            wide: WideKeys::new(d, t),
        })
    }

    /// The same cipher without the wide path (tests of the batched one on any CPU).
    #[cfg(test)]
    pub(crate) fn narrow(mut self) -> Self {
        self.wide = None;
        self
    }

    /// Encrypts `data` (whole sectors) in place; its first sector is number `sector`.
    pub fn encrypt(&self, data: &mut [u8], sector: u64) {
        debug_assert!(data.len().is_multiple_of(SECTOR));
        let p = data.as_mut_ptr();
        // SAFETY: source and destination are `data`, valid for its length; each batch is
        // loaded whole before it is stored.
        unsafe { self.run(p, p, data.len() / SECTOR, BLOCKS, sector, true) };
    }

    /// Decrypts `data` (whole sectors) in place; its first sector is number `sector`.
    pub fn decrypt(&self, data: &mut [u8], sector: u64) {
        debug_assert!(data.len().is_multiple_of(SECTOR));
        let p = data.as_mut_ptr();
        // SAFETY: as in `encrypt`.
        unsafe { self.run(p, p, data.len() / SECTOR, BLOCKS, sector, false) };
    }

    /// Encrypts one sector from `src` into `dst` (both `SECTOR` bytes).
    pub fn encrypt_sector_into(&self, src: &[u8; SECTOR], dst: &mut [u8], sector: u64) {
        assert_eq!(dst.len(), SECTOR);
        // SAFETY: both are one sector of ours.
        unsafe { self.encrypt_from(src.as_ptr(), dst.as_mut_ptr(), 1, sector) };
    }

    /// Encrypts `sectors` whole sectors read at `src` into `dst`, the first being number
    /// `sector`: one pass over each (no copy of the plaintext first).
    ///
    /// # Safety
    /// `src` is valid for reads and `dst` for writes of `sectors * SECTOR` bytes. `src` may be
    /// memory another process writes meanwhile (guest memory): it is only ever read with raw
    /// unaligned loads, never referenced, and what was read is what is encrypted.
    pub unsafe fn encrypt_from(&self, src: *const u8, dst: *mut u8, sectors: usize, sector: u64) {
        // SAFETY: the caller's contract.
        unsafe { self.run(src, dst, sectors, BLOCKS, sector, true) }
    }

    /// Decrypts `sectors` whole sectors read at `src` into `dst` (see [`Self::encrypt_from`]).
    ///
    /// # Safety
    /// As [`Self::encrypt_from`]; `dst` may be memory another process reads (guest memory):
    /// it is only written with raw unaligned stores.
    pub unsafe fn decrypt_to(&self, src: *const u8, dst: *mut u8, sectors: usize, sector: u64) {
        // SAFETY: the caller's contract.
        unsafe { self.run(src, dst, sectors, BLOCKS, sector, false) }
    }

    /// The XTS loop over `units` data units of `per` blocks each (a sector's 32; NIST's
    /// vectors use 2 and 3), the first numbered `first`: [`BATCH`] units at a time, each
    /// block loaded from `src` and XORed with its tweak, the batch run through the cipher,
    /// XORed again and stored at `dst`.
    ///
    /// # Safety
    /// `src` readable and `dst` writable for `units * per * 16` bytes; they may be equal
    /// (each batch is loaded whole before it is stored) but must not otherwise overlap.
    /// `per` is at most [`BLOCKS`].
    #[inline]
    unsafe fn run(
        &self,
        src: *const u8,
        dst: *mut u8,
        units: usize,
        per: usize,
        first: u64,
        encrypt: bool,
    ) {
        use crate::locked::scrubbed_fast;
        // The round keys the compiler spills to the stack on the way are overwritten after
        // each call: thread stacks are in core dumps, and keys are kept out of them.
        match &self.wide {
            // SAFETY: the caller's contract, which the wide path's is.
            Some(w) if per == BLOCKS => {
                scrubbed_fast::<WIDE_SCRUB, _>(|| unsafe { w.run(src, dst, units, first, encrypt) })
            }
            // SAFETY: the caller's contract.
            _ => scrubbed_fast::<BATCHED_SCRUB, _>(|| unsafe {
                self.run_batched(src, dst, units, per, first, encrypt)
            }),
        }
    }

    /// [`Self::run`] through the `aes` crate (whichever backend it chose), [`BATCH`] units
    /// at a time.
    ///
    /// # Safety
    /// As [`Self::run`].
    unsafe fn run_batched(
        &self,
        src: *const u8,
        dst: *mut u8,
        units: usize,
        per: usize,
        first: u64,
        encrypt: bool,
    ) {
        debug_assert!(per <= BLOCKS);
        let mut tweaks = [0u128; BATCH * BLOCKS];
        let mut blocks = [Block::default(); BATCH * BLOCKS];
        let mut starts = [Block::default(); BATCH];
        let mut done = 0;
        while done < units {
            let n = BATCH.min(units - done);
            for (k, t) in starts[..n].iter_mut().enumerate() {
                let number = first.wrapping_add((done + k) as u64);
                *t = Block::from((number as u128).to_le_bytes());
            }
            self.tweak.encrypt_blocks(&mut starts[..n]);
            let mut tw = [0u128; BATCH];
            for (t, s) in tw[..n].iter_mut().zip(&starts[..n]) {
                *t = u128::from_le_bytes((*s).into());
            }
            let base = done * per * 16;
            // Block j of every unit in turn: the units' doublings are independent chains,
            // so the CPU runs them side by side.
            for j in 0..per {
                for (k, t) in tw[..n].iter_mut().enumerate() {
                    let b = k * per + j;
                    tweaks[b] = *t;
                    // SAFETY: block b of this batch lies within the caller's `src` range.
                    let raw: [u8; 16] =
                        unsafe { std::ptr::read_unaligned(src.add(base + b * 16).cast()) };
                    blocks[b] = Block::from((u128::from_le_bytes(raw) ^ *t).to_le_bytes());
                    *t = times_alpha(*t);
                }
            }
            let count = n * per;
            match encrypt {
                true => self.data.encrypt_blocks(&mut blocks[..count]),
                false => self.data.decrypt_blocks(&mut blocks[..count]),
            }
            for (b, (block, t)) in blocks[..count].iter().zip(&tweaks).enumerate() {
                let out = (u128::from_le_bytes((*block).into()) ^ t).to_le_bytes();
                // SAFETY: block b of this batch lies within the caller's `dst` range.
                unsafe { std::ptr::write_unaligned(dst.add(base + b * 16).cast(), out) };
            }
            done += n;
        }
        zeroize::Zeroize::zeroize(&mut tweaks);
        for b in blocks.iter_mut().chain(starts.iter_mut()) {
            zeroize::Zeroize::zeroize(b.as_mut_slice());
        }
    }
}

/// Multiplication by α in GF(2^128) as XTS defines it (little-endian, polynomial 0x87).
#[inline]
fn times_alpha(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

#[cfg(test)]
mod tests {
    use super::*;
    use xts_mode::{get_tweak_default, Xts128};

    fn key(seed: u8) -> [u8; XTS_KEY_LEN] {
        std::array::from_fn(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
    }

    /// The same bytes as the `xts-mode` crate for many sectors and sector numbers, and
    /// lengths that end inside a batch.
    #[test]
    fn matches_the_xts_mode_crate() {
        use aes08::cipher::{generic_array::GenericArray, KeyInit as _};
        let k = key(7);
        let ours = XtsCipher::new(&k).unwrap();
        let theirs = Xts128::new(
            aes08::Aes256::new(GenericArray::from_slice(&k[..32])),
            aes08::Aes256::new(GenericArray::from_slice(&k[32..])),
        );
        for (first, sectors) in [(0u64, 8), (1, 1), (1000, 17), (u64::MAX - 8, 9), (77, 64)] {
            let plain: Vec<u8> = (0..sectors * SECTOR)
                .map(|i| (i * 13 % 251) as u8)
                .collect();
            let (mut a, mut b) = (plain.clone(), plain.clone());
            ours.encrypt(&mut a, first);
            theirs.encrypt_area(&mut b, SECTOR, first as u128, get_tweak_default);
            assert!(a == b, "sector {first}, {sectors} sectors");
            assert!(a != plain);
            ours.decrypt(&mut a, first);
            assert!(a == plain);
        }
    }

    /// NIST's CAVP XTS-AES-256 vectors (the 600 of whole blocks: data units of 2 and 3
    /// blocks, `tests/data/xts-aes256-nist.txt`), both ways, through the loop sectors take.
    #[test]
    fn nist_cavp_xts_aes_256_vectors() {
        let hex = |s: &str| -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        let text = include_str!("../tests/data/xts-aes256-nist.txt");
        let mut checked = 0;
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let f: Vec<&str> = line.split(' ').collect();
            let k: [u8; XTS_KEY_LEN] = hex(f[1]).try_into().unwrap();
            let number: u64 = f[2].parse().unwrap();
            let (plain, cipher) = (hex(f[3]), hex(f[4]));
            let per = plain.len() / 16;
            let c = XtsCipher::new(&k).unwrap();
            let mut out = vec![0u8; plain.len()];
            let (from, want, encrypt) = match f[0] {
                "E" => (&plain, &cipher, true),
                _ => (&cipher, &plain, false),
            };
            // SAFETY: `from` and `out` are both one unit of `per` blocks.
            unsafe { c.run(from.as_ptr(), out.as_mut_ptr(), 1, per, number, encrypt) };
            assert!(&out == want, "{line}");
            checked += 1;
        }
        assert_eq!(checked, 600);
    }

    /// IEEE 1619-2007 vector 10 (XTS-AES-256, data unit 0xff, 512 bytes of 0..255 twice):
    /// the first and last 16 bytes of its ciphertext.
    #[test]
    fn ieee_1619_vector_10() {
        let k1 = "2718281828459045235360287471352662497757247093699959574966967627";
        let k2 = "3141592653589793238462643383279502884197169399375105820974944592";
        let hex = |s: &str| -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        let mut k = [0u8; XTS_KEY_LEN];
        k[..32].copy_from_slice(&hex(k1));
        k[32..].copy_from_slice(&hex(k2));
        let mut data: Vec<u8> = (0..SECTOR).map(|i| i as u8).collect();
        XtsCipher::new(&k).unwrap().encrypt(&mut data, 0xff);
        assert_eq!(data[..16], hex("1c3b3a102f770386e4836c99e370cf9b")[..]);
        assert_eq!(data[496..], hex("c4f36ffda9fcea70b9c6e693e148c151")[..]);
    }

    /// The VAES-512 path (where this CPU has it) gives the batched path's bytes, both ways,
    /// for many keys, sector numbers (across 2⁶⁴) and lengths, in place and buffer to buffer.
    #[test]
    fn the_wide_path_matches_the_batched_one() {
        if !crate::xts_wide::available() {
            eprintln!("this CPU has no AVX-512 VAES: only the batched path runs here");
            return;
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..64 {
            let k: [u8; XTS_KEY_LEN] = std::array::from_fn(|_| next() as u8);
            let c = XtsCipher::new(&k).unwrap();
            assert!(c.wide.is_some());
            let sectors = 1 + (next() % 19) as usize;
            let first = match round % 4 {
                0 => u64::MAX - (next() % 8),
                _ => next(),
            };
            let plain: Vec<u8> = (0..sectors * SECTOR).map(|_| next() as u8).collect();
            let (mut wide, mut batched) = (vec![0u8; plain.len()], vec![0u8; plain.len()]);
            for encrypt in [true, false] {
                // SAFETY: three buffers of `sectors` sectors each.
                unsafe {
                    c.run(
                        plain.as_ptr(),
                        wide.as_mut_ptr(),
                        sectors,
                        BLOCKS,
                        first,
                        encrypt,
                    );
                    let (p, b) = (plain.as_ptr(), batched.as_mut_ptr());
                    c.run_batched(p, b, sectors, BLOCKS, first, encrypt);
                }
                assert!(wide == batched, "round {round}, encrypt {encrypt}");
                assert!(wide != plain);
            }
            let mut inplace = plain.clone();
            c.encrypt(&mut inplace, first);
            c.decrypt(&mut inplace, first);
            assert!(inplace == plain, "round {round}: in place");
        }
    }

    #[test]
    fn equal_halves_are_refused() {
        assert!(XtsCipher::new(&[5u8; XTS_KEY_LEN]).is_none());
    }
}
