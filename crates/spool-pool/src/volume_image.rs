//! A volume's data read and written outside the data path, through its layout's devices:
//! for receiving it from another host over NBD while no frontend serves it
//! (docs/transfer.md). Writes are durable when they return (each device's own durable write).
//!
//! Owns: splitting a byte range over the layout's segments, and which volumes may be
//! written so. Must not know: NBD, virtio, who
//! else may be writing the volume (the caller makes sure no frontend does).

use crate::{Error, Pool, Result, VolumeInfo, VolumeLayout};

fn io(e: spool_devices::Error) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

impl VolumeLayout {
    /// Reads `buf.len()` bytes at volume offset `offset` (within the size).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.each(offset, buf.len() as u64, |dev, at, range| {
            self.devices[dev].read_at(&mut buf[range], at).map_err(io)
        })
    }

    /// Writes `buf` at volume offset `offset` (within the size), durably.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.each(offset, buf.len() as u64, |dev, at, range| {
            self.devices[dev]
                .write_at_durable(&buf[range], at)
                .map_err(io)
        })
    }

    /// Makes `len` bytes at volume offset `offset` read back as zeroes, durably.
    pub fn zero(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.each(offset, len, |dev, at, range| {
            self.devices[dev]
                .zero_range(at, range.len() as u64)
                .map_err(io)
        })
    }

    /// Runs `f(device index, device offset, range within the request)` for each piece of
    /// `[offset, offset + len)`, stopping at the first error; a range past the size is one.
    fn each(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(usize, u64, std::ops::Range<usize>) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(std::io::Error::from(std::io::ErrorKind::StorageFull));
        }
        let mut r = Ok(());
        self.map(offset, len, |dev, at, n, done| {
            if r.is_ok() {
                r = f(dev, at, done as usize..(done + n) as usize);
            }
        });
        r
    }
}

impl Pool {
    /// Whether volume `id`'s data may be written outside the data path (through its
    /// layout: [`VolumeLayout::write_at`]): thick volumes, mirrored or not, and thin ones
    /// (through a queue of the thin device, which allocates chunks as a guest's writes do,
    /// and leaves holes where zeroes are written whole chunks at a time). A volume on RBD
    /// (shared, and claimed by whoever serves it), an encrypted one (whose data would cross
    /// the wire in the clear)
    /// unless the writer sends its `ciphertext` (another spoold sending it under the same
    /// data key: what is written is what the devices hold), and a read-only one are refused.
    pub fn check_writable_outside(&self, id: &str, ciphertext: bool) -> Result<VolumeInfo> {
        let v = self.volume(id)?;
        let why = if v.rbd.is_some() {
            "is on RBD (its image is shared by the cluster's hosts: it needs no transfer, and one would write it without its claim)"
        } else if v.encrypted && !ciphertext {
            "is encrypted (its data would cross the wire in the clear; only another spoold sends it, as ciphertext, through the transfer listener)"
        } else if v.read_only {
            "is read-only"
        } else {
            return Ok(v);
        };
        Err(Error::InvalidArgument(format!(
            "volume '{}' {why}: receiving its data is not built for it",
            v.name
        )))
    }
}
