//! An NBD server (the protocol of <https://github.com/NetworkBlockDevice/nbd>, doc/proto.md)
//! for exporting snapshots to standard clients (`qemu-img`, `qemu-nbd`, libnbd's `nbdinfo`
//! and `nbdcopy`) and for receiving a volume's data (a writable export).
//!
//! It speaks the fixed newstyle handshake (`NBD_OPT_GO`, `NBD_OPT_INFO`, `NBD_OPT_LIST`,
//! `NBD_OPT_EXPORT_NAME`, `NBD_OPT_STRUCTURED_REPLY`, `NBD_OPT_SET_META_CONTEXT`,
//! `NBD_OPT_LIST_META_CONTEXT`) and serves `NBD_CMD_READ`, `NBD_CMD_BLOCK_STATUS`,
//! `NBD_CMD_FLUSH`, `NBD_CMD_CACHE` and `NBD_CMD_DISC`, and on a writable export
//! `NBD_CMD_WRITE`, `NBD_CMD_WRITE_ZEROES` and `NBD_CMD_TRIM` (a hint, taken and ignored);
//! on a read-only one those are refused with `EPERM`. Two meta contexts: `base:allocation` (holes, which read as zeroes) and, when the
//! export has a base, `qemu:dirty-bitmap:BASE` (what changed since it), as QEMU names its
//! dirty bitmaps, so `qemu-img map` with `x-dirty-bitmap` and `nbdinfo --map` read only what
//! changed.
//!
//! With TLS ([`tls`]), a server requires `NBD_OPT_STARTTLS` before any other option (every
//! other one gets `NBD_REP_ERR_TLS_REQD`), and a client of an `nbds://` URI starts it.
//!
//! [`client`] is the other side, for sending I/O to any NBD server: URIs, the handshake,
//! request and reply framing (spool-devices' `nbd:` backend drives it).
//!
//! Owns: the wire protocol, listening, one thread per connection. Must not know: pools,
//! maps, devices ([`Export`] is what it reads through).

pub mod client;
mod handshake;
mod proto;
mod server;
mod starttls;
pub mod tls;
mod transmit;

pub use server::{serve_io, Listen, Server, HANDSHAKE_LIMIT, MAX_CONNECTIONS};

/// What an export serves, in extents of one fixed size.
pub trait Export: Send + Sync + 'static {
    /// The export's name (what clients ask for; the empty name also gets it).
    fn name(&self) -> &str;
    /// A name only the export's users are told (a transfer's receive export): when set, a
    /// client must ask for exactly it (the export's name and the empty name get nothing,
    /// and listing shows nothing). What the export's name is still used for: logs.
    fn secret(&self) -> Option<&str> {
        None
    }
    /// Bytes.
    fn size(&self) -> u64;
    /// Reads `buf.len()` bytes at `offset` (within the size).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
    /// The size of the extents [`Export::allocated`] and [`Export::changed`] answer for (a
    /// power of two).
    fn extent(&self) -> u64;
    /// Whether extent `i` holds data (false: a hole, reading as zeroes).
    fn allocated(&self, i: u64) -> bool;
    /// The base the dirty bitmap is against, if any (its meta context is
    /// `qemu:dirty-bitmap:BASE`; default: none, no dirty bitmap is offered).
    fn base(&self) -> Option<&str> {
        None
    }
    /// Whether extent `i` changed since the base (asked only when there is one).
    fn changed(&self, _i: u64) -> bool {
        false
    }
    /// Whether clients may write (default: no, the export is read-only).
    fn writable(&self) -> bool {
        false
    }
    /// Writes `buf` at `offset` (within the size); called only when [`Export::writable`].
    fn write_at(&self, _buf: &[u8], _offset: u64) -> std::io::Result<()> {
        Err(std::io::Error::from_raw_os_error(1))
    }
    /// Whether clients are told they may send `NBD_CMD_WRITE_ZEROES` (default: yes, on a
    /// writable export); without it they write zeroes as data.
    fn offers_write_zeroes(&self) -> bool {
        true
    }
    /// Makes `len` bytes at `offset` read back as zeroes (by default, zeroes written).
    fn write_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        let zeroes = vec![0u8; len.min(1 << 20) as usize];
        let mut at = 0;
        while at < len {
            let n = (len - at).min(zeroes.len() as u64);
            self.write_at(&zeroes[..n as usize], offset + at)?;
            at += n;
        }
        Ok(())
    }
    /// Makes every write completed so far durable, whichever connection it came on (the
    /// server tells clients that one flush covers all their connections).
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Errors of the server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on {0}: {1}")]
    Listen(String, std::io::Error),
    #[error("'{0}' is not an NBD address: give unix:PATH or HOST:PORT")]
    Address(String),
    #[error(
        "'{0}' is not an NBD URI: give nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH"
    )]
    Uri(String),
}
