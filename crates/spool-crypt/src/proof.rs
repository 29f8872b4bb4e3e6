//! Proof of a shared secret without sending it: two hosts that were both given a secret (a
//! transfer's token) show each other they hold it by an HMAC-SHA256 over a fresh nonce and
//! the message they exchange, so a message cannot be altered, replayed or answered by anyone
//! who does not hold the secret, and an eavesdropper learns nothing that opens anything.
//!
//! Owns: the tag's construction (a purpose string, then each part with its length, so no two
//! different messages share a tag) and its constant-time check. Must not know: what the
//! messages mean (the transfer hello lives in the control plane).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a tag ([`prove`]) and of a nonce ([`nonce`]).
pub const PROOF_LEN: usize = 32;

/// The tag that proves a holder of `secret` wrote `parts` for `purpose`.
pub fn prove(secret: &[u8], purpose: &str, parts: &[&[u8]]) -> [u8; PROOF_LEN] {
    mac(secret, purpose, parts).finalize().into_bytes().into()
}

/// Whether `tag` is [`prove`]'s for these `secret`, `purpose` and `parts`, compared in a time
/// that does not depend on the tags' bytes.
pub fn check(secret: &[u8], purpose: &str, parts: &[&[u8]], tag: &[u8]) -> bool {
    mac(secret, purpose, parts).verify_slice(tag).is_ok()
}

/// A fresh random nonce, or an error when the system's random source fails.
pub fn nonce() -> Result<[u8; PROOF_LEN], crate::KeyError> {
    let mut n = [0u8; PROOF_LEN];
    getrandom::fill(&mut n).map_err(|e| crate::KeyError::Random(e.to_string()))?;
    Ok(n)
}

fn mac(secret: &[u8], purpose: &str, parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut m =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes a key of any length");
    for p in std::iter::once(purpose.as_bytes()).chain(parts.iter().copied()) {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_holds_only_for_its_secret_purpose_and_parts() {
        let t = prove(b"token-0123456789", "hello", &[b"ab", b"c"]);
        assert!(check(b"token-0123456789", "hello", &[b"ab", b"c"], &t));
        assert!(!check(b"token-0123456789", "answer", &[b"ab", b"c"], &t));
        assert!(!check(b"token-012345678X", "hello", &[b"ab", b"c"], &t));
        // The lengths are in the tag: moving a byte between parts changes it.
        assert!(!check(b"token-0123456789", "hello", &[b"a", b"bc"], &t));
        assert!(!check(
            b"token-0123456789",
            "hello",
            &[b"ab", b"c"],
            &t[..31]
        ));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn the_tag_is_hmac_sha256_over_the_length_prefixed_parts() {
        // Computed apart, by Python's hmac over the purpose and part, each after its length
        // as 8 bytes little-endian: what another implementation of the hello must do.
        let want = "ac7e7887e455ec1de5921885054ee3ae5bb7c774ea3dbffda0ae696d58917964";
        assert_eq!(crate::to_hex(&prove(b"k", "p", &[b"xyz"])), want);
    }
}
