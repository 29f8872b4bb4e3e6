//! Per-volume encryption at rest (docs/encryption.md).
//!
//! Owns: the data cipher (`xts`: AES-XTS-256 over 512-byte sectors, dm-crypt's
//! `aes-xts-plain64`; `xts_wide`: the same on VAES-512 where the CPU has it), keys (`keys`: the key-encryption key an operator gives spoold, data keys
//! wrapped under it with AES key wrap, key ids), memory for keys (`locked`: out of swap and
//! core dumps, zeroed on drop), `proof` (showing a shared secret such as a transfer's
//! token without sending it), and [`CryptQueue`] (`queue`: a device queue over another that
//! writes only ciphertext, with the volume's sector as the tweak).
//!
//! Sits above spool-devices (it wraps device queues, as the mirror wraps devices) and below
//! spool-pool (which keeps wrapped keys in the pool table) and the frontend (which wraps an
//! encrypted volume's queues). Must not know: volumes' metadata, virtio, where key material
//! comes from (the control plane reads files, credentials and commands).

mod keys;
mod locked;
pub mod proof;
mod queue;
mod xts;
mod xts_wide;

pub use keys::{from_hex, to_hex, DataKey, Kek, KeyError, KEK_LEN, WRAPPED_LEN};
pub use locked::Locked;
pub use queue::{CryptQueue, TweakMap};
pub use xts::{XtsCipher, SECTOR, XTS_KEY_LEN};

/// The cipher name the pool table records (and dm-crypt's for the same layout).
pub const CIPHER: &str = "aes-xts-plain64";
