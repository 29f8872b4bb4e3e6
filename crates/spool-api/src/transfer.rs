//! The wire form of moving a volume's data between hosts (docs/transfer.md): receiving (the
//! volume served as a writable NBD export until a frontend starts it or the operator stops
//! the transfer) and sending (the volume's copy on the other host kept as a remote mirror
//! leg).

use serde::{Deserialize, Serialize};

/// `volume_receive`: serve volume `id` as a writable NBD export on `nbd` (`unix:PATH` or
/// `HOST:PORT`), for a sender (another spoold, `qemu-img convert`, `nbdcopy`) to write; or,
/// with `token` instead, expect a spoold sending volume `id` (which need not exist yet) on
/// the `[transfer] listen` socket, with that token.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiveParams {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// With `token`: the largest volume the sender may send (and so create here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_size: Option<crate::SizeValue>,
    /// With `token`: the volume becomes a standing replica of the sender's (`volume
    /// replicate` there): no VM runs it here until `volume_promote` (docs/replicas.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replica: bool,
}

/// `volume_promote`: replica `id` becomes this host's volume (docs/replicas.md); with
/// `force`, even one whose primary never said it was complete.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromoteParams {
    pub id: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// `volume_receive_stop`: stop receiving volume `id`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiveStopParams {
    pub id: String,
}

/// A volume being received, or (from `volume_receive_stop`) one that was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiveInfo {
    pub volume: String,
    /// Where it listens (`unix:PATH` or `HOST:PORT`).
    pub nbd: String,
    /// The NBD URI senders use.
    pub uri: String,
    pub size: u64,
    /// Bytes written (data and zeroes) so far.
    pub written: u64,
    /// Why it ended, once it has (`stopped`, `a frontend started the volume`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<String>,
    /// Expected on the transfer listener (`nbd` its address), no sender has said hello yet.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expecting: bool,
}

/// `volume_send`: start (or resume) sending volume `id` to the NBD export `to`, or, with
/// `cancel`, stop sending it, or, with `finish`, delete the volume here once its copy there
/// is complete and no frontend runs it. With none of them: how the send stands.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendParams {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// With `to` a destination's transfer listener (`HOST:PORT`): the token its operator
    /// gave `volume receive` there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    #[serde(default)]
    pub cancel: bool,
    #[serde(default)]
    pub finish: bool,
    /// With `to` and `token`: the copy there is a standing replica (`volume replicate`),
    /// which its host runs only once promoted (docs/replicas.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replica: bool,
}

/// How sending a volume stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SendInfo {
    pub volume: String,
    /// The destination's NBD URI.
    pub to: String,
    /// "copying", "current" (every write completed here is there too), "disconnected"
    /// (the link is down while copying), "waiting" (the link is down and the copy there was
    /// current: the volume's requests wait until it is back, or `cancel`), "fenced" (a
    /// replica there was promoted: the volume's writes fail here), "cancelled" or
    /// "finished" (the volume here was deleted).
    pub state: String,
    /// The copy there was complete at least once (the pool table says so).
    pub synced: bool,
    /// Bytes still to copy, bytes copied since the copy (re)started, bytes per second,
    /// seconds left.
    pub remaining_bytes: u64,
    pub copied_bytes: u64,
    pub rate: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_secs: Option<u64>,
    /// Why the destination is not connected now, if it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trouble: Option<String>,
}

/// What a destination's transfer listener says first (one JSON line): its version and a
/// fresh nonce, which the sender's hello must carry and its proof cover (no hello replays).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferChallenge {
    /// [`TRANSFER_VERSION`].
    pub version: u32,
    /// 32 random bytes, in hex.
    pub nonce: String,
}

/// What a sending spoold says to the challenge (one JSON line): the volume as the
/// destination is to create it if it does not exist, and the proof that it holds the
/// token, which never crosses the network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferHello {
    /// [`TRANSFER_VERSION`].
    pub version: u32,
    /// The challenge's nonce.
    pub nonce: String,
    /// The sender's own fresh nonce (32 random bytes, in hex), which the answer's proof
    /// covers: an answer recorded earlier does not answer this hello.
    pub sender_nonce: String,
    /// HMAC-SHA256 (hex) under the token of the whole hello as JSON with this field and the
    /// key's tag empty (`spool_crypt::proof`, purpose [`HELLO_PROOF`]): every field, the data
    /// key included, is as the token's holder wrote it for this challenge.
    pub proof: String,
    pub volume: String,
    pub size: u64,
    pub num_queues: u16,
    /// Copies the volume keeps on the sending host (the remote one not counted).
    pub copies: u8,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qos: Option<crate::QosLimits>,
    /// An encrypted volume's data key, which the destination's copy is to have: what is
    /// sent is its ciphertext.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<TransferKey>,
    /// The volume is thin here: the destination creates it thin too, so that only what the
    /// copy writes takes space there (its holes cross as write-zeroes and stay holes).
    /// Left out when false, so a thick volume's hello reads as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub thin: bool,
    /// The copy there is to be a standing replica (`volume replicate`); it must be expected
    /// as one (`volume receive --replica`). Left out when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replica: bool,
    /// The epoch the sender serves the volume under: a destination that promoted its copy
    /// at a higher one refuses it (the sender is fenced off). Left out when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u64,
    /// A replica's sender says again, once its copy there became current: the destination
    /// records the replica as complete (promoting it loses nothing from then on). Left out
    /// when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub current: bool,
    /// A replica's sender asks about a transfer already answered (whether its copy there is
    /// still a replica; with `current`, to say it became current): never starts one. Left
    /// out when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ask: bool,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// An encrypted volume's data key as the sender's pool table holds it: wrapped (AES key
/// wrap) under the key-encryption key `kek_id`, which the destination must have too. Never
/// the key in the clear: it tells an eavesdropper what a stolen device's metadata does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferKey {
    /// `aes-xts-plain64`.
    pub cipher: String,
    pub kek_id: String,
    /// The wrapped key, in hex.
    pub wrapped: String,
    /// HMAC-SHA256 (hex), under a key derived from the key-encryption key, of the whole
    /// hello as JSON with this field empty: proves the sender holds the key-encryption key,
    /// so only such a host makes the destination adopt a data key.
    pub tag: String,
}

/// The transfer hello's version: 2 proves the token over a challenge's nonce (1 sent it).
pub const TRANSFER_VERSION: u32 = 2;
/// The purpose the hello's proof is made for.
pub const HELLO_PROOF: &str = "spool transfer hello";
/// The purpose the answer's proof is made for.
pub const ANSWER_PROOF: &str = "spool transfer answer";

/// The destination's answer (one JSON line): the NBD URI to send to, or why not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferReply {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd: Option<String>,
    /// With `nbd`: HMAC-SHA256 (hex) under the token of both nonces and `nbd` (purpose
    /// [`ANSWER_PROOF`]), so the sender sends only where the token's other holder said, in
    /// answer to this hello.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proof: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// With `error`: the destination promoted its replica of the volume at this epoch,
    /// above the sender's, which is fenced off it (docs/replicas.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced: Option<u64>,
}
