//! Keys: the key-encryption key ([`Kek`]) an operator gives spoold, the data keys it wraps
//! (AES-256 key wrap, RFC 3394, through RustCrypto's `aes-kw`: a wrong key-encryption key
//! fails the unwrap's integrity check instead of yielding a wrong data key), and the key id
//! that names a key-encryption key without revealing it.
//!
//! Every key lives in locked memory ([`Locked`]) and is zeroed when dropped. Nothing here
//! formats a key for display; errors name key ids only.
//!
//! Must not know: where key material comes from (files, credentials, commands: the control
//! plane reads them), the pool table's format.

use aes::cipher::{BlockCipherEncrypt, KeyInit};
use aes::{Aes256, Block};
use aes_kw::KwAes256;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use zeroize::{Zeroize, Zeroizing};

use crate::locked::Locked;
use crate::xts::{XtsCipher, XTS_KEY_LEN};

/// Bytes of a key-encryption key.
pub const KEK_LEN: usize = 32;
/// Bytes of a wrapped data key (RFC 3394 adds 8).
pub const WRAPPED_LEN: usize = XTS_KEY_LEN + 8;

/// What went wrong with a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// Key material of the wrong shape (the message says what was expected).
    Material(String),
    /// The key-encryption key does not unwrap this data key (a wrong key, or a damaged
    /// wrapped key).
    WrongKek { have: String },
    /// The system's random source failed.
    Random(String),
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyError::Material(m) => f.write_str(m),
            KeyError::WrongKek { have } => write!(
                f,
                "the key-encryption key in use (id {have}) does not unwrap this data key: a wrong key, or a damaged wrapped key"
            ),
            KeyError::Random(e) => write!(f, "the system's random source failed: {e}"),
        }
    }
}

impl std::error::Error for KeyError {}

/// A key-encryption key: 32 bytes, locked in memory, zeroed on drop.
pub struct Kek {
    key: Locked<[u8; KEK_LEN]>,
}

impl Kek {
    /// A key from its material: exactly 32 bytes, or 64 hexadecimal digits (surrounding
    /// whitespace, such as a trailing newline, ignored).
    pub fn from_material(material: &[u8]) -> Result<Kek, KeyError> {
        let mut key = Locked::new([0u8; KEK_LEN]);
        if material.len() == KEK_LEN {
            key.copy_from_slice(material);
            return Ok(Kek { key });
        }
        let text = material.trim_ascii();
        if text.len() == 2 * KEK_LEN && text.iter().all(|c| c.is_ascii_hexdigit()) {
            for (i, pair) in text.chunks_exact(2).enumerate() {
                key[i] = (hex_value(pair[0]) << 4) | hex_value(pair[1]);
            }
            return Ok(Kek { key });
        }
        Err(KeyError::Material(format!(
            "key material must be {KEK_LEN} bytes, or {} hexadecimal digits; got {} bytes",
            2 * KEK_LEN,
            material.len()
        )))
    }

    /// A fresh random key (tests).
    pub fn generate() -> Result<Kek, KeyError> {
        let mut key = Locked::new([0u8; KEK_LEN]);
        getrandom::fill(&mut key[..]).map_err(|e| KeyError::Random(e.to_string()))?;
        Ok(Kek { key })
    }

    /// The key's 64 hexadecimal digits (for writing a key file; never logged).
    pub fn to_hex(&self) -> Zeroizing<String> {
        Zeroizing::new(to_hex(&self.key[..]))
    }

    /// A name for the key that reveals nothing of it: the first 8 bytes of AES-256 under the
    /// key of a fixed block, in hex (a key check value).
    pub fn id(&self) -> String {
        let mut block = Block::from(*b"spool kek check\0");
        crate::locked::scrubbed(|| {
            Aes256::new_from_slice(&self.key[..])
                .expect("a key-encryption key is 32 bytes")
                .encrypt_block(&mut block)
        });
        block[..8].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A tag proving that whoever made it holds this key: HMAC-SHA256 of `message` under a
    /// key of its own for each `purpose` (itself HMAC-SHA256 of the purpose under this
    /// key), so a tag made for one purpose is worth nothing for another, and nothing of the
    /// key is revealed.
    pub fn authenticate(&self, purpose: &str, message: &[u8]) -> [u8; 32] {
        let mut derive = <Hmac<Sha256> as Mac>::new_from_slice(&self.key[..])
            .expect("HMAC takes a key of any length");
        derive.update(purpose.as_bytes());
        let subkey = Zeroizing::new(<[u8; 32]>::from(derive.finalize().into_bytes()));
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&subkey[..])
            .expect("HMAC takes a key of any length");
        mac.update(message);
        mac.finalize().into_bytes().into()
    }

    /// Whether `tag` is [`Kek::authenticate`]'s for `purpose` and `message`, compared in
    /// constant time.
    pub fn verify(&self, purpose: &str, message: &[u8], tag: &[u8]) -> bool {
        let want = self.authenticate(purpose, message);
        tag.len() == want.len() && tag.iter().zip(want).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
    }

    /// Wraps `data_key` (a fresh one from [`DataKey::generate`]).
    pub fn wrap(&self, data_key: &DataKey) -> [u8; WRAPPED_LEN] {
        let mut out = [0u8; WRAPPED_LEN];
        crate::locked::scrubbed(|| {
            KwAes256::new_from_slice(&self.key[..])
                .expect("a key-encryption key is 32 bytes")
                .wrap_key(&data_key.key[..], &mut out)
                .expect("a 64-byte key wraps into 72 bytes");
        });
        out
    }

    /// Unwraps a data key this key wrapped.
    pub fn unwrap(&self, wrapped: &[u8]) -> Result<DataKey, KeyError> {
        if wrapped.len() != WRAPPED_LEN {
            return Err(KeyError::Material(format!(
                "a wrapped data key is {WRAPPED_LEN} bytes, not {}",
                wrapped.len()
            )));
        }
        let mut key = Locked::new([0u8; XTS_KEY_LEN]);
        let unwrapped = crate::locked::scrubbed(|| {
            KwAes256::new_from_slice(&self.key[..])
                .expect("a key-encryption key is 32 bytes")
                .unwrap_key(wrapped, &mut key[..])
                .is_ok()
        });
        if !unwrapped {
            return Err(KeyError::WrongKek { have: self.id() });
        }
        Ok(DataKey { key })
    }
}

impl std::fmt::Debug for Kek {
    /// The id only: key material is never formatted.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kek({})", self.id())
    }
}

impl PartialEq for Kek {
    /// Whether both are the same key (compared by id, not byte by byte in a way that leaks
    /// timing of the material itself).
    fn eq(&self, other: &Kek) -> bool {
        self.id() == other.id()
    }
}

/// A volume's data key (XTS-256: 64 bytes), locked in memory, zeroed on drop.
pub struct DataKey {
    key: Locked<[u8; XTS_KEY_LEN]>,
}

impl DataKey {
    /// A fresh random key whose two halves differ.
    pub fn generate() -> Result<DataKey, KeyError> {
        let mut key = Locked::new([0u8; XTS_KEY_LEN]);
        loop {
            getrandom::fill(&mut key[..]).map_err(|e| KeyError::Random(e.to_string()))?;
            if key[..32] != key[32..] {
                return Ok(DataKey { key });
            }
        }
    }

    /// The key's bytes (for recovery with `cryptsetup`: written only to a file the operator
    /// asked for).
    pub fn bytes(&self) -> &[u8; XTS_KEY_LEN] {
        &self.key
    }

    /// The volume's cipher, in locked memory; the copies key setup made on the stack are
    /// overwritten ([`crate::locked::scrubbed`]).
    pub fn cipher(&self) -> Result<Locked<XtsCipher>, KeyError> {
        crate::locked::scrubbed(|| XtsCipher::new(&self.key).map(Locked::new))
            .ok_or_else(|| KeyError::Material("an XTS key's two halves must differ".into()))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_value(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        _ => c - b'A' + 10,
    }
}

/// Bytes as lowercase hex (wrapped keys in the pool table).
pub fn to_hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .flat_map(|b| {
            [
                HEX[(b >> 4) as usize] as char,
                HEX[(b & 15) as usize] as char,
            ]
        })
        .collect()
}

/// Lowercase or uppercase hex back to bytes; `None` if it is not hex of even length.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    let s = s.as_bytes();
    (s.len().is_multiple_of(2) && s.iter().all(|c| c.is_ascii_hexdigit())).then(|| {
        s.chunks_exact(2)
            .map(|p| (hex_value(p[0]) << 4) | hex_value(p[1]))
            .collect()
    })
}

impl Drop for Kek {
    fn drop(&mut self) {
        self.key.zeroize();
    }
}

impl Drop for DataKey {
    fn drop(&mut self) {
        self.key.zeroize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where a key schedule's copies would stay behind: the stack below the caller's frame
    /// after key setup returned, read through /proc/self/mem (no read of memory Rust does
    /// not own). AES-256's first two round keys are the key's halves, so every copy of a
    /// schedule holds them.
    fn copies_below_here(needles: &[&[u8]]) -> usize {
        use std::os::unix::fs::FileExt;
        let here = 0u8;
        let sp = std::hint::black_box(&here) as *const u8 as u64;
        const SPAN: u64 = 48 << 10;
        let mut below = vec![0u8; SPAN as usize];
        let mem = std::fs::File::open("/proc/self/mem").unwrap();
        mem.read_exact_at(&mut below, sp - SPAN).unwrap();
        (needles.iter())
            .map(|n| below.windows(n.len()).filter(|w| w == n).count())
            .sum()
    }

    /// Key setup leaves no copy of a data key's or a KEK's schedule on the stack (13 to 18
    /// copies were found in a core dump before: `Aes256::new` returns it by value).
    #[test]
    fn key_setup_leaves_no_copy_of_a_key_on_the_stack() {
        // On a thread of its own: nothing else ran on its stack.
        std::thread::spawn(|| {
            let kek = Kek::from_material(&[0x3cu8; 32]).unwrap();
            let key = DataKey::generate().unwrap();
            let cipher = key.cipher().unwrap();
            let halves = [&key.bytes()[..32], &key.bytes()[32..]];
            assert_eq!(copies_below_here(&halves), 0, "the cipher's key setup");
            let wrapped = kek.wrap(&key);
            let back = kek.unwrap(&wrapped).unwrap();
            let _ = kek.id();
            let needles = [&back.bytes()[..32], &back.bytes()[32..]];
            assert_eq!(
                copies_below_here(&needles),
                0,
                "wrapping, unwrapping, the id"
            );
            drop(cipher);
        })
        .join()
        .unwrap();
    }

    /// Encrypting and decrypting leave no round key on the stack either: one sector (the
    /// batched path) and 32 (the VAES-512 path, where the CPU has it), each way. Every
    /// round key of both keys is looked for, as the wide path computes them (the batched
    /// path's are the same values).
    #[test]
    fn the_data_path_leaves_no_round_key_on_the_stack() {
        let key = DataKey::generate().unwrap();
        // The round keys computed here, on this thread: the ones that encrypt run nothing
        // else.
        let (d, t) = key.bytes().split_at(32);
        let Some(wide) =
            crate::xts_wide::WideKeys::new(d.try_into().unwrap(), t.try_into().unwrap())
        else {
            return; // no AES-NI with VAES here: the round keys are not computed apart
        };
        let keys = wide.all();
        let bytes = key.bytes();
        let ciphers = [
            std::sync::Arc::new(XtsCipher::new(bytes).unwrap()),
            std::sync::Arc::new(XtsCipher::new(bytes).unwrap().narrow()),
        ];
        for (c, n) in ciphers
            .iter()
            .flat_map(|c| [(c.clone(), 1), (c.clone(), 32)])
        {
            let keys = keys.clone();
            std::thread::spawn(move || {
                let mut data = vec![0x11u8; 32 * 512];
                c.encrypt(&mut data[..n * 512], 9);
                c.decrypt(&mut data[..n * 512], 9);
                let needles: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
                let wide = if c.wide.is_some() { "wide" } else { "batched" };
                assert_eq!(
                    copies_below_here(&needles),
                    0,
                    "round keys on the stack ({n} sectors, the {wide} path)"
                );
            })
            .join()
            .unwrap();
        }
    }

    #[test]
    fn material_is_32_bytes_or_64_hex_digits() {
        let raw = [0x5au8; 32];
        let a = Kek::from_material(&raw).unwrap();
        let b = Kek::from_material(format!("{}\n", "5A".repeat(32)).as_bytes()).unwrap();
        assert!(a == b);
        assert_eq!(
            Kek::from_material(a.to_hex().as_bytes()).unwrap().id(),
            a.id()
        );
        let e = Kek::from_material(b"short").err().unwrap();
        assert!(e.to_string().contains("got 5 bytes"), "{e}");
        assert!(Kek::from_material(&[b'g'; 64]).is_err());
    }

    /// Standard HMAC-SHA256 twice (checked against Python's `hmac`), a tag per purpose,
    /// and nothing verifies under another key, purpose, message or a cut tag.
    #[test]
    fn a_tag_proves_the_key_for_one_purpose_and_message() {
        let k = Kek::from_material(&[0x5a; 32]).unwrap();
        let tag = k.authenticate("spool transfer hello", b"message");
        assert_eq!(
            to_hex(&tag),
            "e07fe2bcb1f0fd6859a2f33c4d2e737741eca08b36a2505ccea505055bee693b"
        );
        assert!(k.verify("spool transfer hello", b"message", &tag));
        assert!(!k.verify("another purpose", b"message", &tag));
        assert!(!k.verify("spool transfer hello", b"messagf", &tag));
        assert!(!k.verify("spool transfer hello", b"message", &tag[..31]));
        let other = Kek::generate().unwrap();
        assert!(!other.verify("spool transfer hello", b"message", &tag));
    }

    #[test]
    fn wrap_unwrap_and_a_wrong_kek() {
        let (k1, k2) = (Kek::generate().unwrap(), Kek::generate().unwrap());
        assert_ne!(k1.id(), k2.id());
        let dk = DataKey::generate().unwrap();
        let w = k1.wrap(&dk);
        assert_eq!(k1.unwrap(&w).unwrap().bytes(), dk.bytes());
        let e = k2.unwrap(&w).err().unwrap();
        assert_eq!(e, KeyError::WrongKek { have: k2.id() });
        let mut damaged = w;
        damaged[40] ^= 1;
        assert!(k1.unwrap(&damaged).is_err());
        assert!(k1.unwrap(&w[..70]).is_err());
        // No wrapped byte string contains the key in the clear.
        assert!(!w.windows(32).any(|x| x == &dk.bytes()[..32]));
    }

    #[test]
    fn hex_round_trip() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(from_hex(&to_hex(&b)).unwrap(), b);
        assert_eq!(from_hex("0"), None);
        assert_eq!(from_hex("zz"), None);
    }
}
