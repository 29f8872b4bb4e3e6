//! AES-XTS-256 over whole 512-byte sectors with VAES on 512-bit registers (AVX-512), for CPUs
//! that have it: the same bytes as `xts.rs`'s loop, at the rate of the machine's widest AES.
//!
//! Why not only the `aes` crate: its VAES backend runs 64 blocks at a time from a buffer, so
//! XTS around it loads, XORs and stores every block twice more through that buffer; on this
//! project's machine (AMD EPYC, Zen 4) that ran at 2.2 GB/s per core, under half of
//! `openssl speed -evp aes-256-xts` (5.9 GB/s), while the VAES units themselves do 15.9 GB/s
//! of AES-256. Here a sector goes through once: four blocks per register, loaded from the
//! source, XORed with their tweaks, fourteen rounds with the round keys held in registers,
//! XORed again and stored at the destination. The key schedule is FIPS-197's, computed with
//! AES-NI's key-generation assist (as Intel's AES-NI white paper lays it out); it and this
//! path are checked against the `aes` crate's XTS for many keys and sectors, IEEE 1619's
//! vector and, through the daemon's layout test, OpenSSL.
//!
//! Tweaks: sector `n`'s first is AES-256 of `n` under the tweak key; register `i` holds the
//! tweaks of blocks `4i..4i + 4`, so the next register's are this one's times α⁴ in each
//! 128-bit lane: a shift by four and the four bits shifted out folded back with XTS's
//! polynomial (x¹²⁸ = x⁷ + x² + x + 1).
//!
//! Must not know: where keys come from, devices, volumes.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Bytes per sector (`xts::SECTOR`; this path takes only whole sectors).
const SECTOR: usize = 512;

/// Round keys of AES-256: 15 of them.
const ROUNDS: usize = 15;

/// The round keys this path needs, in the cipher's locked allocation; zeroed on drop.
pub(crate) struct WideKeys {
    enc: [[u8; 16]; ROUNDS],
    dec: [[u8; 16]; ROUNDS],
    tweak: [[u8; 16]; ROUNDS],
}

impl Drop for WideKeys {
    fn drop(&mut self) {
        for k in self
            .enc
            .iter_mut()
            .chain(&mut self.dec)
            .chain(&mut self.tweak)
        {
            zeroize::Zeroize::zeroize(k);
        }
    }
}

/// Whether this CPU runs the wide path (AVX-512 foundation, VAES, AES-NI), asked once.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *WIDE.get_or_init(|| {
            std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("vaes")
                && std::is_x86_feature_detected!("aes")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

impl WideKeys {
    /// Every round key (for tests looking for copies of them).
    #[cfg(test)]
    pub(crate) fn all(&self) -> Vec<[u8; 16]> {
        self.enc
            .iter()
            .chain(&self.dec)
            .chain(&self.tweak)
            .copied()
            .collect()
    }

    /// The round keys of data key `data` and tweak key `tweak`; `None` where the CPU lacks
    /// the wide path ([`available`]).
    pub(crate) fn new(data: &[u8; 32], tweak: &[u8; 32]) -> Option<WideKeys> {
        if !available() {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let mut k = WideKeys {
                enc: [[0; 16]; ROUNDS],
                dec: [[0; 16]; ROUNDS],
                tweak: [[0; 16]; ROUNDS],
            };
            // SAFETY: `available` found AES-NI on this CPU.
            unsafe {
                expand(data, &mut k.enc);
                expand(tweak, &mut k.tweak);
                invert(&k.enc, &mut k.dec);
            }
            Some(k)
        }
        #[cfg(not(target_arch = "x86_64"))]
        None
    }

    /// Encrypts (`encrypt`) or decrypts `sectors` sectors read at `src` into `dst`, the first
    /// numbered `first`.
    ///
    /// # Safety
    /// As `XtsCipher::encrypt_from`: `src` readable and `dst` writable for `sectors * SECTOR`
    /// bytes, either possibly another process's memory (only raw unaligned loads and stores
    /// touch them), equal or not overlapping (each sector is loaded whole before it is
    /// stored).
    pub(crate) unsafe fn run(
        &self,
        src: *const u8,
        dst: *mut u8,
        sectors: usize,
        first: u64,
        encrypt: bool,
    ) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `WideKeys` exists only where `available` found the features; the
        // pointers are the caller's contract.
        unsafe {
            match encrypt {
                true => sectors_enc(self, src, dst, sectors, first),
                false => sectors_dec(self, src, dst, sectors, first),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (src, dst, sectors, first, encrypt);
    }
}

/// `w` XORed with itself shifted by one, two and three words: each word of the result is the
/// XOR of the words up to it (the key schedule's running XOR over a round key's words).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "aes")]
fn running_xor(w: __m128i) -> __m128i {
    let mut t = w;
    let mut s = _mm_slli_si128::<4>(w);
    t = _mm_xor_si128(t, s);
    s = _mm_slli_si128::<4>(s);
    t = _mm_xor_si128(t, s);
    s = _mm_slli_si128::<4>(s);
    _mm_xor_si128(t, s)
}

/// One step of the AES-256 key schedule (Intel's white paper, figure 33): the next even
/// round key from the last two and the key-generation assist of the odd one.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "aes")]
fn next_even(prev: __m128i, assist: __m128i) -> __m128i {
    _mm_xor_si128(running_xor(prev), _mm_shuffle_epi32::<0xff>(assist))
}

/// The next odd round key from the odd one before and the even one just made.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "aes")]
fn next_odd(prev: __m128i, even: __m128i) -> __m128i {
    let assist = _mm_shuffle_epi32::<0xaa>(_mm_aeskeygenassist_si128::<0>(even));
    _mm_xor_si128(running_xor(prev), assist)
}

/// AES-256's 15 encryption round keys of `key` (FIPS-197 §5.2).
///
/// # Safety
/// The CPU has AES-NI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "aes")]
unsafe fn expand(key: &[u8; 32], out: &mut [[u8; 16]; ROUNDS]) {
    // SAFETY: `key` is 32 bytes of ours.
    let (mut a, mut b) = unsafe {
        (
            _mm_loadu_si128(key.as_ptr().cast()),
            _mm_loadu_si128(key.as_ptr().add(16).cast()),
        )
    };
    let mut rk = [a, b, a, a, a, a, a, a, a, a, a, a, a, a, a];
    macro_rules! round {
        ($i:expr, $rcon:literal) => {
            a = next_even(a, _mm_aeskeygenassist_si128::<$rcon>(b));
            b = next_odd(b, a);
            (rk[2 * $i], rk[2 * $i + 1]) = (a, b);
        };
    }
    round!(1, 0x01);
    round!(2, 0x02);
    round!(3, 0x04);
    round!(4, 0x08);
    round!(5, 0x10);
    round!(6, 0x20);
    // The last round key is an even one alone.
    rk[14] = next_even(a, _mm_aeskeygenassist_si128::<0x40>(b));
    for (o, k) in out.iter_mut().zip(&rk) {
        // SAFETY: `o` is 16 bytes of ours.
        unsafe { _mm_storeu_si128(o.as_mut_ptr().cast(), *k) };
    }
}

/// The equivalent inverse cipher's round keys (FIPS-197 §5.3.5): the encryption keys in
/// reverse order, the middle ones through InvMixColumns.
///
/// # Safety
/// The CPU has AES-NI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "aes")]
unsafe fn invert(enc: &[[u8; 16]; ROUNDS], dec: &mut [[u8; 16]; ROUNDS]) {
    for (i, d) in dec.iter_mut().enumerate() {
        let e = enc[ROUNDS - 1 - i];
        // SAFETY: 16 bytes of ours each.
        unsafe {
            let k = _mm_loadu_si128(e.as_ptr().cast());
            let k = match i {
                0 | 14 => k,
                _ => _mm_aesimc_si128(k),
            };
            _mm_storeu_si128(d.as_mut_ptr().cast(), k);
        }
    }
}

/// `t` times α in GF(2¹²⁸) (XTS's little-endian convention).
#[inline]
fn times_alpha(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

/// Each 128-bit lane of `t` times α⁴.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn times_alpha4(t: __m512i) -> __m512i {
    // The top four bits of each 64-bit half, moved to the other half of their lane: into the
    // high half they carry as they are; into the low half, the bits shifted out of the lane
    // (x¹²⁸..x¹³¹), times the polynomial 0x87 (carryless: four bits never overflow it).
    let out = _mm512_shuffle_epi32::<0x4e>(_mm512_srli_epi64::<60>(t));
    let folded = _mm512_xor_si512(
        _mm512_xor_si512(out, _mm512_slli_epi64::<1>(out)),
        _mm512_xor_si512(_mm512_slli_epi64::<2>(out), _mm512_slli_epi64::<7>(out)),
    );
    let carry = _mm512_mask_blend_epi64(0b0101_0101, out, folded);
    _mm512_xor_si512(_mm512_slli_epi64::<4>(t), carry)
}

/// Round keys broadcast to all four lanes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn broadcast(keys: &[[u8; 16]; ROUNDS]) -> [__m512i; ROUNDS] {
    // SAFETY: each key is 16 bytes of ours.
    keys.map(|k| unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(k.as_ptr().cast())) })
}

/// The first tweak of sector `n` (AES-256 of `n` under the tweak key), as the four
/// tweaks of blocks 0..4 in one register.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,aes")]
fn first_tweaks(keys: &[[u8; 16]; ROUNDS], n: u64) -> __m512i {
    // SAFETY: 16-byte loads of ours.
    let key = |i: usize| unsafe { _mm_loadu_si128(keys[i].as_ptr().cast()) };
    let mut t = _mm_xor_si128(_mm_set_epi64x(0, n as i64), key(0));
    for i in 1..ROUNDS - 1 {
        t = _mm_aesenc_si128(t, key(i));
    }
    t = _mm_aesenclast_si128(t, key(ROUNDS - 1));
    let mut lanes = [0u128; 4];
    // SAFETY: 16 bytes into `lanes[0]`.
    unsafe { _mm_storeu_si128(lanes.as_mut_ptr().cast(), t) };
    for i in 1..4 {
        lanes[i] = times_alpha(lanes[i - 1]);
    }
    // SAFETY: 64 bytes of ours.
    let v = unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) };
    zeroize::Zeroize::zeroize(&mut lanes);
    v
}

/// Registers per sector: 32 blocks, four to a register.
const REGS: usize = SECTOR / 64;

macro_rules! sectors_fn {
    ($name:ident, $keys:ident, $round:ident, $last:ident) => {
        /// XTS over `sectors` whole sectors (see [`WideKeys::run`]).
        ///
        /// # Safety
        /// The CPU has AVX-512F, VAES and AES-NI; the pointers as [`WideKeys::run`].
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,vaes,aes")]
        unsafe fn $name(k: &WideKeys, src: *const u8, dst: *mut u8, sectors: usize, first: u64) {
            let rk = broadcast(&k.$keys);
            for s in 0..sectors {
                let mut t = [first_tweaks(&k.tweak, first.wrapping_add(s as u64)); REGS];
                for i in 1..REGS {
                    t[i] = times_alpha4(t[i - 1]);
                }
                let mut d = [_mm512_setzero_si512(); REGS];
                for i in 0..REGS {
                    // SAFETY: register i of sector s lies within the caller's `src` range.
                    let v = unsafe { _mm512_loadu_si512(src.add(s * SECTOR + i * 64).cast()) };
                    d[i] = _mm512_xor_si512(_mm512_xor_si512(v, t[i]), rk[0]);
                }
                for key in &rk[1..ROUNDS - 1] {
                    for v in d.iter_mut() {
                        *v = $round(*v, *key);
                    }
                }
                for i in 0..REGS {
                    let v = _mm512_xor_si512($last(d[i], rk[ROUNDS - 1]), t[i]);
                    // SAFETY: register i of sector s lies within the caller's `dst` range.
                    unsafe { _mm512_storeu_si512(dst.add(s * SECTOR + i * 64).cast(), v) };
                }
            }
        }
    };
}

sectors_fn!(
    sectors_enc,
    enc,
    _mm512_aesenc_epi128,
    _mm512_aesenclast_epi128
);
sectors_fn!(
    sectors_dec,
    dec,
    _mm512_aesdec_epi128,
    _mm512_aesdeclast_epi128
);
