//! Reading snapshots without the data path: a snapshot's chunks as an image (for the NBD
//! export), and the chunks that differ between two maps (`volume diff`, the dirty bitmap).
//!
//! A snapshot's chunks never change while it exists (writes copy them first), so they are
//! read straight from the pool devices. The caller must stop reading before the snapshot is
//! deleted: its chunks may then go to another volume. A snapshot of an encrypted volume is
//! read decrypted (the volume's data key, the volume's sector as the tweak): its chunks as
//! the guest reads them; its holes as zeroes, as they are reported (the guest reads the
//! noise zeroes decrypt to).
//!
//! Owns: building images and diffs from the maps. Must not know: NBD, virtio.

use std::collections::HashMap;
use std::sync::Arc;

use spool_devices::Device;
use spool_thin::map::Placement;

use crate::{Error, Pool, Result};

/// A snapshot, readable (see the module doc).
#[derive(Debug)]
pub struct SnapshotImage {
    /// `VOLUME@SNAPSHOT`.
    pub name: String,
    pub size: u64,
    pub chunk: u64,
    /// Each chunk's device and offset; `None`: a hole.
    chunks: Vec<Option<(Arc<Device>, u64)>>,
    /// The snapshot the dirty bitmap is against, and which chunks differ from it.
    pub base: Option<(String, Vec<bool>)>,
    /// The volume's cipher when it is encrypted: what is read is decrypted.
    cipher: Option<crate::VolumeCipher>,
}

/// Bytes per encrypted sector (the XTS data unit).
const SECTOR: u64 = 512;

impl SnapshotImage {
    /// Reads `buf.len()` bytes at `offset` (within the size): holes read as zeroes.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let (i, within) = (pos / self.chunk, pos % self.chunk);
            let n = ((self.chunk - within) as usize).min(buf.len() - done);
            let piece = &mut buf[done..done + n];
            match self.chunks.get(i as usize).and_then(Option::as_ref) {
                Some((dev, at)) => match &self.cipher {
                    None => dev
                        .read_at(piece, at + within)
                        .map_err(|e| std::io::Error::other(e.to_string()))?,
                    Some(c) => read_decrypted(c, dev, *at, pos, within, piece)?,
                },
                None => piece.fill(0),
            }
            done += n;
        }
        Ok(())
    }

    /// Whether chunk `i` holds data.
    pub fn allocated(&self, i: u64) -> bool {
        self.chunks.get(i as usize).is_some_and(Option::is_some)
    }

    /// Whether chunk `i` differs from the base (false without one).
    pub fn changed(&self, i: u64) -> bool {
        self.base
            .as_ref()
            .is_some_and(|(_, c)| c.get(i as usize).copied().unwrap_or(false))
    }
}

/// Reads `piece` (volume offset `pos`, `within` bytes into the chunk at `at` on `dev`)
/// decrypted: the whole sectors around it are read and decrypted, then the part asked for
/// is copied out. Chunks are whole sectors, so the sectors lie within the chunk.
fn read_decrypted(
    cipher: &crate::VolumeCipher,
    dev: &Device,
    at: u64,
    pos: u64,
    within: u64,
    piece: &mut [u8],
) -> std::io::Result<()> {
    let skip = pos % SECTOR;
    let len = (skip + piece.len() as u64).div_ceil(SECTOR) * SECTOR;
    let mut buf = vec![0u8; len as usize];
    dev.read_at(&mut buf, at + within - skip)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    cipher.decrypt(&mut buf, (pos - skip) / SECTOR);
    piece.copy_from_slice(&buf[skip as usize..skip as usize + piece.len()]);
    Ok(())
}

/// The byte ranges of `[0, size)` that differ between two maps, merged: chunks named by
/// one map and not the other, or by both at different places (a chunk is copied whole, so
/// the same place means the same data).
pub fn differ(a: &[(u64, Placement)], b: &[(u64, Placement)], chunks: u64) -> Vec<bool> {
    let mut out = vec![false; chunks as usize];
    let a: HashMap<u64, Placement> = a.iter().copied().collect();
    let b: HashMap<u64, Placement> = b.iter().copied().collect();
    for (i, d) in out.iter_mut().enumerate() {
        *d = a.get(&(i as u64)) != b.get(&(i as u64));
    }
    out
}

/// Runs of `true` in `changed` as (offset, length) byte ranges, clipped to `size`.
pub fn ranges(changed: &[bool], chunk: u64, size: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (i, _) in changed.iter().enumerate().filter(|x| *x.1) {
        let at = i as u64 * chunk;
        let len = chunk.min(size.saturating_sub(at));
        match out.last_mut() {
            Some((o, l)) if *o + *l == at => *l += len,
            _ => out.push((at, len)),
        }
    }
    out
}

/// A volume's name, the size a map covers, and the chunks it names.
type MapEntries = (String, u64, Vec<(u64, Placement)>);

impl Pool {
    /// The chunks snapshot `snap` of volume `id` names, or (`None`) the volume's own now;
    /// with the volume's name and the size the map covers.
    fn map_entries(&self, id: &str, snap: Option<&str>) -> Result<MapEntries> {
        let i = self.find(id)?;
        let v = &self.table.volumes[i];
        if v.rbd.is_some() {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' is on RBD: changed blocks and NBD exports of its snapshots are not built yet (`rbd export-diff --from-snap` reads the changes)",
                v.name
            )));
        }
        let t = v.thin.as_ref().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "volume '{}' is not thin: it has no snapshots",
                v.name
            ))
        })?;
        let dev = self.thin_device(v)?;
        let backend = crate::snapshots::thin_backend(v, &dev)?;
        let Some(snap) = snap else {
            return Ok((v.name.clone(), v.size, backend.live_entries()));
        };
        let s = t.snapshots.iter().find(|s| s.name == snap).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "volume '{}' has no snapshot named '{snap}'; `spoolctl volume snapshots {}` lists them",
                v.name, v.name
            ))
        })?;
        let entries = crate::snapshots::usable_entries(v, backend, s)?;
        Ok((v.name.clone(), s.size, entries))
    }

    /// The byte ranges that differ between snapshot `from` of volume `id` and snapshot `to`
    /// (`None`: the volume now), in whole chunks; and the chunk size.
    pub fn diff(&self, id: &str, from: &str, to: Option<&str>) -> Result<(u64, Vec<(u64, u64)>)> {
        let (_, _, a) = self.map_entries(id, Some(from))?;
        let (_, size, b) = self.map_entries(id, to)?;
        let chunk = self.table.min_extent;
        let changed = differ(&a, &b, size.div_ceil(chunk));
        Ok((chunk, ranges(&changed, chunk, size)))
    }

    /// Snapshot `snap` of volume `id` as an image to read, with a dirty bitmap against
    /// snapshot `since` if given. A snapshot of an encrypted volume reads decrypted.
    pub fn snapshot_image(
        &self,
        id: &str,
        snap: &str,
        since: Option<&str>,
    ) -> Result<SnapshotImage> {
        let v = &self.table.volumes[self.find(id)?];
        let cipher = self.volume_cipher(v)?;
        let (name, size, entries) = self.map_entries(id, Some(snap))?;
        let chunk = self.table.min_extent;
        let n = size.div_ceil(chunk);
        let mut chunks: Vec<Option<(Arc<Device>, u64)>> = vec![None; n as usize];
        for (i, p) in &entries {
            // A chunk whose device is gone must not read as zeroes (a backup would copy them).
            let m = self
                .members
                .iter()
                .find(|m| m.uuid == p.device)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "snapshot '{snap}' has a chunk on device {}, which is not in the pool",
                        p.device
                    ))
                })?;
            if let Some(slot) = chunks.get_mut(*i as usize) {
                *slot = Some((m.dev.clone(), p.offset));
            }
        }
        let base = match since {
            Some(b) => {
                let (_, _, a) = self.map_entries(id, Some(b))?;
                Some((b.to_string(), differ(&a, &entries, n)))
            }
            None => None,
        };
        Ok(SnapshotImage {
            name: format!("{name}@{snap}"),
            size,
            chunk,
            chunks,
            base,
            cipher,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn changed_chunks_become_merged_ranges() {
        let d = Uuid::new_v4();
        let p = |o| Placement {
            device: d,
            offset: o,
        };
        let a = vec![(0, p(0)), (1, p(10)), (3, p(30))];
        let b = vec![(0, p(0)), (1, p(11)), (2, p(20)), (4, p(40))];
        let c = differ(&a, &b, 6);
        assert_eq!(c, vec![false, true, true, true, true, false]);
        assert_eq!(ranges(&c, 100, 550), vec![(100, 400)]);
        assert_eq!(ranges(&[false, true], 100, 150), vec![(100, 50)]);
    }
}
