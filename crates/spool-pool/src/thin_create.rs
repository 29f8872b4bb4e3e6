//! Creating thin volumes (docs/thin.md): one copy, whose map may lie on any device and whose
//! chunks come from the whole pool, or a mirrored one, each copy's map and chunks on devices
//! of its own (`thin_mirror.rs` splits them).
//!
//! Owns: the new volume's table entry, its zeroed maps and its clean bitmap. Must not know:
//! the data path, how maps are read.

use uuid::Uuid;

use crate::encryption::NewKey;
use crate::metadata::{ExtentEntry, LegEntry, ThinMap, VolumeEntry};
use crate::{Error, Pool, Result, VolumeInfo};

impl Pool {
    /// Creates a thin volume: only its map is allocated (zeroed: every chunk a hole).
    pub fn create_thin_volume(
        &mut self,
        name: &str,
        size: u64,
        read_only: bool,
        num_queues: u16,
        encrypt: bool,
    ) -> Result<VolumeInfo> {
        self.create_thin_copies(name, size, read_only, num_queues, 1, encrypt)
    }

    /// Creates a thin volume of `copies` copies (docs/thin.md, "Mirrored thin volumes"): the
    /// usable devices are split into `copies` groups of about equal free space, and each
    /// copy's map and chunks lie on its group only, so one device's loss costs at most one
    /// copy. One copy: [`Self::create_thin_volume`].
    pub fn create_thin_copies(
        &mut self,
        name: &str,
        size: u64,
        read_only: bool,
        num_queues: u16,
        copies: u8,
        encrypt: bool,
    ) -> Result<VolumeInfo> {
        self.create_thin_with(
            name,
            size,
            read_only,
            num_queues,
            NewKey::of(encrypt),
            copies,
        )
    }

    /// Creates thin volume `name` for a transfer from another host (docs/transfer.md): as
    /// the sender has it, under the sender's data key if it is encrypted.
    pub fn create_received_thin_volume(
        &mut self,
        name: &str,
        size: u64,
        num_queues: u16,
        key: Option<crate::metadata::VolumeKey>,
    ) -> Result<VolumeInfo> {
        let key = key.map_or(NewKey::Plain, NewKey::Given);
        self.create_thin_with(name, size, false, num_queues, key, 1)
    }

    fn create_thin_with(
        &mut self,
        name: &str,
        size: u64,
        read_only: bool,
        num_queues: u16,
        key: NewKey,
        copies: u8,
    ) -> Result<VolumeInfo> {
        self.check_new_volume(name, size, num_queues)?;
        if copies > 1 {
            self.check_copies(copies)?;
        }
        let groups = match copies {
            0 | 1 => vec![Vec::new()],
            n => self.copy_groups(n)?,
        };
        let chunk = self.table.min_extent;
        let map_bytes = spool_thin::map::map_bytes(size.div_ceil(chunk));
        let bytes = self.round_up(map_bytes)?;
        self.check_space(bytes.saturating_mul(groups.len() as u64))?;
        let mut v = VolumeEntry::new(name, size, read_only, num_queues);
        v.encryption = self.key_for(&v, key)?;
        let encrypt = v.encryption.is_some();
        let mut maps = self.zeroed_maps(&groups, bytes)?;
        let all: Vec<ExtentEntry> = maps.iter().flatten().copied().collect();
        v.thin = Some(ThinMap {
            chunk,
            map: Vec::new(),
            snapshots: Vec::new(),
            origin: None,
        });
        if copies <= 1 {
            v.thin.as_mut().expect("set above").map = maps.pop().expect("one map");
        } else {
            // Every map zeroed: the copies start identical (all holes).
            v.copies = copies;
            for (slot, (map, devices)) in (0..).zip(maps.into_iter().zip(groups)) {
                v.legs.push(LegEntry::thin_copy(slot, true, map, devices));
            }
            if let Err(e) = self.new_clean_bitmap(&v) {
                self.release(&all);
                return Err(e);
            }
        }
        let mut table = self.table.clone();
        table.volumes.push(v.clone());
        if let Err(e) = table
            .validate()
            .map_err(Error::invalid)
            .and_then(|_| self.commit(table))
        {
            self.release(&all);
            return Err(e);
        }
        self.open_thin(&v);
        tracing::info!(volume = %v.name, uuid = %v.uuid, size, chunk, copies = copies.max(1), map_bytes = bytes, encrypted = encrypt, "thin volume created");
        Ok(self.volume_info(&v))
    }

    /// A zeroed map of `bytes` for each group of devices (an empty group: any device);
    /// nothing stays allocated on failure.
    pub(crate) fn zeroed_maps(
        &mut self,
        groups: &[Vec<Uuid>],
        bytes: u64,
    ) -> Result<Vec<Vec<ExtentEntry>>> {
        let mut maps: Vec<Vec<ExtentEntry>> = Vec::new();
        for g in groups {
            let map = self
                .allocate_on(bytes, |u| g.is_empty() || g.contains(&u))
                .and_then(|map| match self.scrub(&map) {
                    Ok(()) => Ok(map),
                    Err(e) => {
                        self.release(&map);
                        Err(e)
                    }
                });
            match map {
                Ok(map) => maps.push(map),
                Err(e) => {
                    maps.iter().for_each(|m| self.release(m));
                    return Err(e);
                }
            }
        }
        Ok(maps)
    }

    /// A write-intent bitmap that says new mirrored volume `v`'s copies are identical.
    pub(crate) fn new_clean_bitmap(&self, v: &VolumeEntry) -> Result<()> {
        let Some(path) = self.bitmap_path(v.uuid) else {
            return Ok(());
        };
        spool_mirror::create_clean_bitmap(&path, v.size).map_err(|e| {
            Error::InvalidArgument(format!(
                "cannot create the write-intent bitmap {}: {e}",
                path.display()
            ))
        })
    }
}
