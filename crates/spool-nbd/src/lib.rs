//! A read-only NBD server (the protocol of <https://github.com/NetworkBlockDevice/nbd>,
//! doc/proto.md) for exporting snapshots to standard clients: `qemu-img`, `qemu-nbd`,
//! libnbd's `nbdinfo` and `nbdcopy`.
//!
//! It speaks the fixed newstyle handshake (`NBD_OPT_GO`, `NBD_OPT_INFO`, `NBD_OPT_LIST`,
//! `NBD_OPT_EXPORT_NAME`, `NBD_OPT_STRUCTURED_REPLY`, `NBD_OPT_SET_META_CONTEXT`,
//! `NBD_OPT_LIST_META_CONTEXT`) and serves `NBD_CMD_READ`, `NBD_CMD_BLOCK_STATUS`,
//! `NBD_CMD_FLUSH`, `NBD_CMD_CACHE` and `NBD_CMD_DISC`; writes and trims are refused with
//! `EPERM`. Two meta contexts: `base:allocation` (holes, which read as zeroes) and, when the
//! export has a base, `qemu:dirty-bitmap:BASE` (what changed since it), as QEMU names its
//! dirty bitmaps, so `qemu-img map` with `x-dirty-bitmap` and `nbdinfo --map` read only what
//! changed.
//!
//! Owns: the wire protocol, listening, one thread per connection. Must not know: pools,
//! maps, devices ([`Export`] is what it reads through).

mod handshake;
mod proto;
mod server;
mod transmit;

pub use server::{serve_io, Listen, Server};

/// What an export serves, in extents of one fixed size.
pub trait Export: Send + Sync + 'static {
    /// The export's name (what clients ask for; the empty name also gets it).
    fn name(&self) -> &str;
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
    /// `qemu:dirty-bitmap:BASE`).
    fn base(&self) -> Option<&str>;
    /// Whether extent `i` changed since the base.
    fn changed(&self, i: u64) -> bool;
}

/// Errors of the server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on {0}: {1}")]
    Listen(String, std::io::Error),
    #[error("'{0}' is not an NBD address: give unix:PATH or HOST:PORT")]
    Address(String),
}
