//! A thin volume's chunk map: the on-device entries (one per chunk of the volume) and the
//! in-memory table the data path reads.
//!
//! An entry is 32 bytes: magic `SPTC`, a CRC32C, the UUID of the pool device holding the
//! chunk and the chunk's byte offset on it. Thirty-two zero bytes are a hole (never written,
//! or discarded). The CRC covers the volume's UUID and the chunk's index too, so an entry
//! copied from another volume or another place fails it. Entries are written in whole 4 KiB
//! blocks encoded from memory; a torn block changes only entries that were being changed
//! (the others are written with the bytes they had), and those were not yet acknowledged.
//!
//! Owns: the entry format, where entry `i` lives ([`MapStore`]), the atomic table
//! ([`ChunkMap`]). Must not know: virtio, the pool table, how chunks are allocated.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use spool_devices::Device;
use uuid::Uuid;

use crate::Error;

/// Bytes per map entry.
pub const ENTRY_BYTES: u64 = 32;
/// Bytes per map block (the unit the map is written in).
pub const BLOCK_BYTES: u64 = 4096;
const PER_BLOCK: u64 = BLOCK_BYTES / ENTRY_BYTES;
const MAGIC: &[u8; 4] = b"SPTC";

/// Where a chunk's data lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Placement {
    pub device: Uuid,
    pub offset: u64,
}

fn entry_crc(volume: Uuid, index: u64, body: &[u8]) -> u32 {
    let c = crc32c::crc32c(volume.as_bytes());
    let c = crc32c::crc32c_append(c, &index.to_le_bytes());
    crc32c::crc32c_append(c, body)
}

/// The 32 bytes of entry `index` of `volume`'s map.
pub fn encode(volume: Uuid, index: u64, p: Option<Placement>) -> [u8; ENTRY_BYTES as usize] {
    let mut b = [0u8; ENTRY_BYTES as usize];
    if let Some(p) = p {
        b[0..4].copy_from_slice(MAGIC);
        b[8..24].copy_from_slice(p.device.as_bytes());
        b[24..32].copy_from_slice(&p.offset.to_le_bytes());
        let crc = entry_crc(volume, index, &b[8..32]);
        b[4..8].copy_from_slice(&crc.to_le_bytes());
    }
    b
}

/// Entry `index` of `volume`'s map from its bytes: `None` for a hole.
pub fn decode(volume: Uuid, index: u64, b: &[u8]) -> Result<Option<Placement>, DecodeError> {
    if b.len() != ENTRY_BYTES as usize {
        return Err(DecodeError::Length {
            index,
            len: b.len(),
        });
    }
    if b.iter().all(|&x| x == 0) {
        return Ok(None);
    }
    if &b[0..4] != MAGIC {
        return Err(DecodeError::Magic(index));
    }
    let crc = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
    if crc != entry_crc(volume, index, &b[8..32]) {
        return Err(DecodeError::Checksum(index));
    }
    let device = Uuid::from_bytes(b[8..24].try_into().expect("16 bytes"));
    let offset = u64::from_le_bytes(b[24..32].try_into().expect("8 bytes"));
    Ok(Some(Placement { device, offset }))
}

/// Why a map entry does not decode, and which entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("entry {index}: {len} bytes, not {ENTRY_BYTES}")]
    Length { index: u64, len: usize },
    #[error("entry {0}: bad magic")]
    Magic(u64),
    #[error("entry {0}: checksum mismatch")]
    Checksum(u64),
}

/// One piece of the map's storage: `len` bytes at `offset` on `device`.
#[derive(Debug, Clone)]
pub struct MapExtent {
    pub device: Arc<Device>,
    pub offset: u64,
    pub len: u64,
}

/// Where a volume's map lives: extents in order, entry `i` at map byte `32 * i`.
#[derive(Debug, Clone)]
pub struct MapStore {
    pub(crate) extents: Vec<MapExtent>,
}

/// The chunk pieces of `[offset, offset + len)` with chunks of `chunk` bytes, in order:
/// (chunk index, offset within it, length, offset within the range).
pub(crate) fn chunk_pieces(
    chunk: u64,
    offset: u64,
    len: u64,
) -> impl Iterator<Item = (u64, u64, u64, u64)> {
    let mut done = 0;
    std::iter::from_fn(move || {
        (done < len).then(|| {
            let pos = offset + done;
            let within = pos % chunk;
            let n = (chunk - within).min(len - done);
            let piece = (pos / chunk, within, n, done);
            done += n;
            piece
        })
    })
}

/// Map bytes needed for `chunks` entries (whole blocks).
pub fn map_bytes(chunks: u64) -> u64 {
    chunks.div_ceil(PER_BLOCK) * BLOCK_BYTES
}

impl MapStore {
    /// A store over `extents`; each must be a multiple of the block size.
    pub fn new(extents: Vec<MapExtent>) -> Result<MapStore, Error> {
        if let Some(e) = extents.iter().find(|e| e.len % BLOCK_BYTES != 0) {
            return Err(Error::Corrupt(format!(
                "map extent of {} bytes is not a multiple of {BLOCK_BYTES}",
                e.len
            )));
        }
        Ok(MapStore { extents })
    }

    /// How many entries it holds.
    pub fn capacity(&self) -> u64 {
        self.extents.iter().map(|e| e.len).sum::<u64>() / ENTRY_BYTES
    }

    /// The device and device offset of map byte `at` (block aligned).
    pub(crate) fn locate(&self, mut at: u64) -> Option<(&Arc<Device>, u64)> {
        for e in &self.extents {
            if at < e.len {
                return Some((&e.device, e.offset + at));
            }
            at -= e.len;
        }
        None
    }

    /// Reads block `block` of the map.
    pub(crate) fn read_block(&self, block: u64, buf: &mut [u8]) -> Result<(), Error> {
        let (dev, off) = self
            .locate(block * BLOCK_BYTES)
            .ok_or_else(|| Error::Corrupt(format!("map block {block} lies past the map")))?;
        Ok(dev.read_at(buf, off)?)
    }

    /// Writes block `block` of the map durably.
    pub(crate) fn write_block(&self, block: u64, buf: &[u8]) -> Result<(), Error> {
        let (dev, off) = self
            .locate(block * BLOCK_BYTES)
            .ok_or_else(|| Error::Corrupt(format!("map block {block} lies past the map")))?;
        Ok(dev.write_at_durable(buf, off)?)
    }
}

/// Writes the map of `volume` naming `entries` (chunk index, where; every other entry a
/// hole) to `store`, durably, block by block. Blocks naming nothing are not written: the
/// store must read as zeroes there (a new, zeroed map).
pub fn write_image(
    store: &MapStore,
    volume: Uuid,
    entries: &[(u64, Placement)],
) -> Result<(), Error> {
    let mut blocks: std::collections::BTreeMap<u64, Vec<(u64, Placement)>> = Default::default();
    for &(i, p) in entries {
        if i >= store.capacity() {
            return Err(Error::Corrupt(format!(
                "entry {i} lies past a map of {} entries",
                store.capacity()
            )));
        }
        blocks.entry(block_of(i)).or_default().push((i, p));
    }
    let mut buf = vec![0u8; BLOCK_BYTES as usize];
    for (b, named) in blocks {
        buf.fill(0);
        for (i, p) in named {
            let at = ((i % PER_BLOCK) * ENTRY_BYTES) as usize;
            buf[at..at + ENTRY_BYTES as usize].copy_from_slice(&encode(volume, i, Some(p)));
        }
        store.write_block(b, &buf)?;
    }
    Ok(())
}

/// Makes entries `indexes` of the map in `store` holes, durably: each block holding one is
/// read, those 32-byte slots are zeroed, and it is written back (every other entry, even
/// one that does not decode, stays as it was). Stops at the first block that fails.
pub fn clear_entries(store: &MapStore, indexes: &[u64]) -> Result<(), Error> {
    let mut blocks: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
    for &i in indexes {
        blocks.entry(block_of(i)).or_default().push(i);
    }
    let mut buf = vec![0u8; BLOCK_BYTES as usize];
    for (b, slots) in blocks {
        store.read_block(b, &mut buf)?;
        for i in slots {
            let at = ((i % PER_BLOCK) * ENTRY_BYTES) as usize;
            buf[at..at + ENTRY_BYTES as usize].fill(0);
        }
        store.write_block(b, &buf)?;
    }
    Ok(())
}

/// The block holding entry `index`.
pub(crate) fn block_of(index: u64) -> u64 {
    index / PER_BLOCK
}

/// The entries of block `block`: `[first, end)`, clipped to `chunks`.
pub(crate) fn block_entries(block: u64, chunks: u64) -> std::ops::Range<u64> {
    let first = block * PER_BLOCK;
    first.min(chunks)..(first + PER_BLOCK).min(chunks)
}

/// A mapped chunk as the data path holds it: device index + 1 in the top 16 bits, bit 47
/// set while the chunk may be named by another map too (a snapshot's, a clone's: a write
/// copies it first), the offset in 4 KiB units below (0: a hole).
const DEV_SHIFT: u32 = 48;
const SHARED: u64 = 1 << 47;
const OFFSET_MASK: u64 = SHARED - 1;
/// Entries per page of the in-memory table (a page is allocated on its first mapping).
const PAGE: u64 = 512;

type Page = Box<[AtomicU64]>;

/// The volume's chunks in memory, read lock-free by every queue and changed only by the
/// allocator thread (after the entry is durable). It covers every entry the map's extents
/// hold, so the volume can grow up to that without a new table; a page of 512 entries is
/// allocated when one of them is first mapped (an unwritten stretch costs one pointer).
#[derive(Debug)]
pub struct ChunkMap {
    pages: Box<[OnceLock<Page>]>,
    capacity: u64,
}

impl ChunkMap {
    pub(crate) fn new(capacity: u64) -> ChunkMap {
        ChunkMap {
            pages: (0..capacity.div_ceil(PAGE))
                .map(|_| OnceLock::new())
                .collect(),
            capacity,
        }
    }

    /// How many chunks the table can hold.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    #[inline]
    fn raw(&self, i: u64) -> u64 {
        let Some(page) = self.pages.get((i / PAGE) as usize).and_then(OnceLock::get) else {
            return 0;
        };
        page[(i % PAGE) as usize].load(Ordering::Acquire)
    }

    /// Chunk `i`: its device index and offset, or `None` for a hole.
    #[inline]
    pub fn get(&self, i: u64) -> Option<(usize, u64)> {
        unpack(self.raw(i))
    }

    /// Chunk `i` if a write may go to it as it is: mapped and named by this map alone.
    /// `None` for a hole or a shared chunk (the allocator maps or copies it first).
    #[inline]
    pub fn get_for_write(&self, i: u64) -> Option<(usize, u64)> {
        let v = self.raw(i);
        if v & SHARED != 0 {
            return None;
        }
        unpack(v)
    }

    /// Chunk `i` in one read: where it is (`None`: a hole) and whether it is marked shared.
    #[inline]
    pub fn state(&self, i: u64) -> (Option<(usize, u64)>, bool) {
        let v = self.raw(i);
        (unpack(v & !SHARED), v & SHARED != 0)
    }

    /// The entry of chunk `i` as stored (to tell whether it changed since).
    #[inline]
    pub(crate) fn stamp(&self, i: u64) -> u64 {
        self.raw(i)
    }

    /// Whether chunk `i` is mapped and marked shared.
    pub fn is_shared(&self, i: u64) -> bool {
        self.raw(i) & SHARED != 0
    }

    /// Marks mapped chunk `i` shared (a write then asks the allocator first).
    pub(crate) fn mark_shared(&self, i: u64) {
        let v = self.raw(i);
        if v != 0 {
            self.store(i, v | SHARED);
        }
    }

    /// Sets chunk `i` (a hole, or a chunk other maps name too, marked shared) in one store.
    pub(crate) fn set_shared(&self, i: u64, p: Option<(usize, u64)>) {
        let v = p.map_or(0, |(d, off)| {
            ((d as u64 + 1) << DEV_SHIFT) | (off >> 12) | SHARED
        });
        self.store(i, v);
    }

    /// Sets chunk `i`, named by this map alone (below the capacity: the callers check it
    /// against the volume's size).
    pub(crate) fn set(&self, i: u64, p: Option<(usize, u64)>) {
        let v = p.map_or(0, |(d, off)| ((d as u64 + 1) << DEV_SHIFT) | (off >> 12));
        self.store(i, v);
    }

    fn store(&self, i: u64, v: u64) {
        let Some(slot) = self.pages.get((i / PAGE) as usize) else {
            return;
        };
        if v == 0 && slot.get().is_none() {
            return;
        }
        let page = slot.get_or_init(|| (0..PAGE).map(|_| AtomicU64::new(0)).collect());
        page[(i % PAGE) as usize].store(v, Ordering::Release);
    }

    /// Chunks mapped now.
    pub fn mapped(&self) -> u64 {
        self.pages
            .iter()
            .filter_map(OnceLock::get)
            .flat_map(|p| p.iter())
            .filter(|s| s.load(Ordering::Relaxed) != 0)
            .count() as u64
    }

    /// Every mapped chunk: (chunk, device index, offset).
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u64, usize, u64)> + '_ {
        (0..self.capacity).filter_map(|i| self.get(i).map(|(d, o)| (i, d, o)))
    }
}

#[inline]
fn unpack(v: u64) -> Option<(usize, u64)> {
    (v != 0).then(|| (((v >> DEV_SHIFT) - 1) as usize, (v & OFFSET_MASK) << 12))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_reject_what_is_not_theirs() {
        let vol = Uuid::new_v4();
        let p = Placement {
            device: Uuid::new_v4(),
            offset: 64 << 20,
        };
        let b = encode(vol, 7, Some(p));
        assert_eq!(decode(vol, 7, &b).unwrap(), Some(p));
        assert_eq!(decode(vol, 7, &[0; 32]).unwrap(), None);
        assert_eq!(decode(vol, 8, &b), Err(DecodeError::Checksum(8)));
        assert!(decode(Uuid::new_v4(), 7, &b).is_err());
        let mut bad = b;
        bad[30] ^= 1;
        assert!(decode(vol, 7, &bad).is_err());
        bad = b;
        bad[0] = b'X';
        assert_eq!(decode(vol, 7, &bad), Err(DecodeError::Magic(7)));
        let short = decode(vol, 7, &b[..31]).unwrap_err();
        assert_eq!(short.to_string(), "entry 7: 31 bytes, not 32");
    }

    #[test]
    fn the_table_packs_device_and_offset() {
        let m = ChunkMap::new(1000);
        assert_eq!(m.get(1), None);
        m.set(1, Some((5, 1 << 40)));
        m.set(999, Some((0, 4096)));
        assert_eq!(m.get(1), Some((5, 1 << 40)));
        assert_eq!(m.get(999), Some((0, 4096)));
        assert_eq!(m.get(3), None);
        assert_eq!(m.get(1000), None);
        assert_eq!(m.mapped(), 2);
        m.mark_shared(1);
        m.mark_shared(3);
        assert_eq!(m.get(1), Some((5, 1 << 40)));
        assert_eq!(m.get_for_write(1), None);
        assert_eq!(m.get_for_write(999), Some((0, 4096)));
        assert!(m.is_shared(1) && !m.is_shared(3) && !m.is_shared(999));
        m.set(1, Some((5, 1 << 40)));
        assert_eq!(m.get_for_write(1), Some((5, 1 << 40)));
        m.set(1, None);
        assert_eq!(m.mapped(), 1);
        assert_eq!(m.entries().collect::<Vec<_>>(), vec![(999, 0, 4096)]);
        assert_eq!(map_bytes(1), 4096);
        assert_eq!(map_bytes(128), 4096);
        assert_eq!(map_bytes(129), 8192);
        assert_eq!(block_entries(1, 130), 128..130);
    }
}
