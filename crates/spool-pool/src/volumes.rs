//! Volumes: create, delete and grow, and the extent allocation behind them.
//!
//! Owns: the allocation policy (largest blocks first, each on the device with the most free
//! space), scrubbing new extents (a volume never reads another tenant's old data) and the
//! argument checks of the volume operations. Must not know: the data path, virtio.

use crate::encryption::NewKey;
use crate::metadata::{self, ExtentEntry, LegEntry, VolumeEntry, VolumeKey, MAX_QUEUES};
use crate::{Error, Pool, QosLimits, Result, VolumeInfo};
use uuid::Uuid;

pub(crate) fn valid_name(name: &str) -> Result<()> {
    metadata::check_volume_name(name).map_err(Error::invalid)
}

/// Extents `grown` has that `old` had not (a grown volume's new extents, on every leg).
fn new_extents(old: &VolumeEntry, grown: &VolumeEntry) -> Vec<ExtentEntry> {
    let had: Vec<&[ExtentEntry]> = old.copies_extents();
    grown
        .copies_extents()
        .iter()
        .zip(had)
        .flat_map(|(now, before)| now[before.len()..].iter().copied())
        .collect()
}

impl Pool {
    /// Grows every copy of `v` by `bytes` starting at logical offset `from`; frees what it
    /// took on failure.
    fn grow_copies(&mut self, v: &mut VolumeEntry, from: u64, bytes: u64) -> Result<()> {
        if !v.is_mirrored() {
            v.extents.extend(self.allocate(bytes)?);
            return Ok(());
        }
        let mut added: Vec<Vec<ExtentEntry>> = Vec::new();
        for i in 0..v.legs.len() {
            let others: Vec<&[ExtentEntry]> = v
                .legs
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, l)| l.extents.as_slice())
                .collect();
            match self.allocate_leg(from, bytes, &others) {
                Ok(e) => {
                    v.legs[i].extents.extend(e.iter().copied());
                    added.push(e);
                }
                Err(e) => {
                    for a in &added {
                        self.release(a);
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Allocates extents covering `bytes` (a multiple of the minimum extent), largest blocks
    /// first, each on the device with the most free space that has a block of that order.
    pub(crate) fn allocate(&mut self, bytes: u64) -> Result<Vec<ExtentEntry>> {
        self.allocate_on(bytes, |_| true)
    }

    /// [`Self::allocate`] on devices other than `avoid`.
    pub(crate) fn allocate_off(
        &mut self,
        bytes: u64,
        avoid: Option<Uuid>,
    ) -> Result<Vec<ExtentEntry>> {
        self.allocate_on(bytes, |u| Some(u) != avoid)
    }

    /// [`Self::allocate`] on the devices `ok` accepts.
    pub(crate) fn allocate_on(
        &mut self,
        bytes: u64,
        ok: impl Fn(Uuid) -> bool,
    ) -> Result<Vec<ExtentEntry>> {
        self.check_not_frozen()?;
        let min = self.table.min_extent;
        let mut units = bytes / min;
        let mut out: Vec<ExtentEntry> = Vec::new();
        let mut pending: Vec<u32> = Vec::new();
        while units > 0 {
            let order = 63 - units.leading_zeros();
            pending.push(order);
            units -= 1 << order;
        }
        pending.reverse(); // pop() then takes the largest block first
        while let Some(order) = pending.pop() {
            let best = self
                .members
                .iter_mut()
                .filter(|m| !m.isolated() && ok(m.uuid) && m.has_order(order))
                .filter(|m| !self.space.blocked(m.uuid))
                .max_by_key(|m| m.free_bytes());
            match best.map(|m| (m.uuid, m.alloc(order))) {
                // A thin volume's allocator took the block since the check: look again.
                Some((_, None)) => pending.push(order),
                Some((uuid, Some(off))) => {
                    out.push(ExtentEntry {
                        device: uuid,
                        offset: off,
                        order,
                    });
                }
                None if order > 0 => {
                    pending.push(order - 1);
                    pending.push(order - 1);
                }
                None => {
                    let available = self.members.iter().map(|m| m.free_bytes()).sum::<u64>()
                        + out.iter().map(|e| min << e.order).sum::<u64>();
                    self.release(&out);
                    return Err(Error::NoSpace {
                        requested: bytes,
                        available,
                    });
                }
            }
        }
        // Largest extents first in the volume's address space.
        out.sort_by_key(|e| std::cmp::Reverse(e.order));
        Ok(out)
    }

    pub(crate) fn release(&mut self, extents: &[ExtentEntry]) {
        if self.commit_unsure {
            // A table that names them may be what the next start opens (`commit_with`).
            self.hold_until_restart(Uuid::nil(), extents.to_vec());
            return;
        }
        for e in extents {
            if let Some(m) = self.members.iter_mut().find(|m| m.uuid == e.device) {
                m.free(e.offset, e.order);
            }
        }
    }

    /// Zeroes newly allocated extents so a volume never reads another tenant's old data.
    pub(crate) fn scrub(&self, extents: &[ExtentEntry]) -> Result<()> {
        for e in extents {
            if let Some(m) = self.members.iter().find(|m| m.uuid == e.device) {
                m.dev
                    .zero_range(e.offset, self.table.min_extent << e.order)?;
            }
        }
        Ok(())
    }

    pub(crate) fn check_size(size: u64) -> Result<()> {
        if size == 0 || !size.is_multiple_of(512) {
            return Err(Error::InvalidArgument(format!(
                "volume size {size} must be a positive multiple of 512 bytes"
            )));
        }
        Ok(())
    }

    /// `size` rounded up to whole minimum extents; sizes so large that this overflows (near
    /// 2^64) are refused rather than wrapping to zero extents.
    pub(crate) fn round_up(&self, size: u64) -> Result<u64> {
        size.checked_next_multiple_of(self.table.min_extent)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "volume size {size} is too large (it does not fit in 64 bits once rounded up to the minimum extent {})",
                    self.table.min_extent
                ))
            })
    }

    /// Refuses at once an allocation of `bytes` larger than all free space together (the
    /// allocator would find out too, one block split at a time).
    pub(crate) fn check_space(&self, bytes: u64) -> Result<()> {
        let free = self
            .members
            .iter()
            .filter(|m| !m.isolated())
            .fold(0u64, |a, m| a.saturating_add(m.free_bytes()));
        if bytes > free {
            return Err(Error::NoSpace {
                requested: bytes,
                available: free,
            });
        }
        Ok(())
    }

    /// What every new volume must be: a valid name not taken, a valid size and queue
    /// count, a pool with devices.
    pub(crate) fn check_new_volume(&self, name: &str, size: u64, num_queues: u16) -> Result<()> {
        valid_name(name)?;
        Self::check_size(size)?;
        if !(1..=MAX_QUEUES).contains(&num_queues) {
            return Err(Error::InvalidArgument(format!(
                "num_queues {num_queues} must be between 1 and {MAX_QUEUES}"
            )));
        }
        if self.table.volumes.iter().any(|v| v.name == name) {
            return Err(Error::VolumeExists(name.into()));
        }
        if self.members.is_empty() {
            return Err(Error::NoDevices);
        }
        Ok(())
    }

    /// Refuses to allocate while a thin map could not be read (docs/thin.md, "The map").
    pub(crate) fn check_not_frozen(&self) -> Result<()> {
        match self.space.frozen() {
            Some(why) => Err(Error::InvalidArgument(format!(
                "no space is allocated in this pool until every thin volume's map can be read ({why}); restart spoold once the device is back"
            ))),
            None => Ok(()),
        }
    }

    /// Refuses what mirrored thin volumes do not do yet (docs/thin.md, "Mirrored thin
    /// volumes"), naming `what`.
    pub(crate) fn refuse_mirrored_thin(v: &VolumeEntry, what: &str) -> Result<()> {
        match v.is_mirrored_thin() {
            true => Err(Error::InvalidArgument(format!(
                "volume '{}' is a mirrored thin volume; {what} is not supported for mirrored thin volumes yet",
                v.name
            ))),
            false => Ok(()),
        }
    }

    /// Creates a plain volume.
    pub fn create_volume(
        &mut self,
        name: &str,
        size: u64,
        read_only: bool,
        num_queues: u16,
    ) -> Result<VolumeInfo> {
        self.create_volume_copies(name, size, read_only, num_queues, 1)
    }

    /// Creates a volume keeping `copies` copies of its data (1: plain; 2 or 3: mirrored, each
    /// copy on a different device at every logical range).
    pub fn create_volume_copies(
        &mut self,
        name: &str,
        size: u64,
        read_only: bool,
        num_queues: u16,
        copies: u8,
    ) -> Result<VolumeInfo> {
        self.create_volume_opts(name, size, read_only, num_queues, copies, false)
    }

    /// [`Self::create_volume_copies`]; with `encrypt`, the volume's data is encrypted under a
    /// data key of its own (docs/encryption.md), which needs the pool's key-encryption key.
    pub fn create_volume_opts(
        &mut self,
        name: &str,
        size: u64,
        read_only: bool,
        num_queues: u16,
        copies: u8,
        encrypt: bool,
    ) -> Result<VolumeInfo> {
        self.create_volume_with(
            name,
            size,
            read_only,
            num_queues,
            copies,
            NewKey::of(encrypt),
        )
    }

    /// A writable volume of `copies` copies received from another host (docs/transfer.md):
    /// with `key`, encrypted under the data key the sender's table holds, wrapped under the
    /// same key-encryption key as this pool's (checked: the sender's ciphertext is then
    /// this volume's).
    pub fn create_received_volume(
        &mut self,
        name: &str,
        size: u64,
        num_queues: u16,
        copies: u8,
        key: Option<VolumeKey>,
    ) -> Result<VolumeInfo> {
        let key = match key {
            Some(k) => NewKey::Given(k),
            None => NewKey::Plain,
        };
        self.create_volume_with(name, size, false, num_queues, copies, key)
    }

    fn create_volume_with(
        &mut self,
        name: &str,
        size: u64,
        read_only: bool,
        num_queues: u16,
        copies: u8,
        key: NewKey,
    ) -> Result<VolumeInfo> {
        self.check_new_volume(name, size, num_queues)?;
        self.check_copies(copies)?;
        let bytes = self.round_up(size)?;
        let mirror_room = |pool: &Pool, e: Error| match e {
            Error::NoSpace { .. } if copies > 1 => pool.mirror_room(bytes, copies),
            e => e,
        };
        self.check_space(bytes.saturating_mul(copies as u64))
            .map_err(|e| mirror_room(self, e))?;
        let mut v = VolumeEntry::new(name, size, read_only, num_queues);
        v.encryption = self.key_for(&v, key)?;
        let encrypt = v.encryption.is_some();
        if copies > 1 {
            v.copies = copies;
            let legs = match self.allocate_legs(bytes, copies) {
                Ok(legs) => legs,
                Err(e) => return Err(mirror_room(self, e)),
            };
            for (slot, extents) in legs.into_iter().enumerate() {
                v.legs.push(LegEntry::local(slot as u8, true, extents));
            }
        } else {
            v.extents = self.allocate(bytes)?;
        }
        let all: Vec<ExtentEntry> = v.all_extents().copied().collect();
        // Every leg zeroed: the copies start identical, and nobody reads old data.
        if let Err(e) = self.scrub(&all) {
            self.release(&all);
            return Err(e);
        }
        if let Some(path) = v.is_mirrored().then(|| self.bitmap_path(v.uuid)).flatten() {
            // Identical (zeroed) legs: a bitmap that says so, before the table names them.
            if let Err(e) = spool_mirror::create_clean_bitmap(&path, bytes) {
                self.release(&all);
                return Err(Error::InvalidArgument(format!(
                    "cannot create the write-intent bitmap {}: {e}",
                    path.display()
                )));
            }
        }
        let mut table = self.table.clone();
        table.volumes.push(v.clone());
        if let Err(e) = self.commit(table) {
            self.release(&all);
            return Err(e);
        }
        tracing::info!(volume = %v.name, uuid = %v.uuid, size, copies, extents = all.len(), encrypted = encrypt, "volume created");
        Ok(self.volume_info(&v))
    }

    /// Deletes a volume and frees its extents. The caller stops serving it first.
    pub fn delete_volume(&mut self, id: &str) -> Result<VolumeInfo> {
        self.delete_volume_with(id, false)
    }

    /// [`Self::delete_volume`]; a volume on an RBD image this pool did not create (attached)
    /// keeps the image unless `remove_image`.
    pub fn delete_volume_with(&mut self, id: &str, remove_image: bool) -> Result<VolumeInfo> {
        let i = self.find(id)?;
        if self.table.volumes[i].rbd.is_some() {
            return self.delete_rbd_volume(i, remove_image);
        }
        let mut table = self.table.clone();
        let v = table.volumes.remove(i);
        let info = self.volume_info(&v);
        // An encrypted volume's wrapped key leaves both slots of every member before its
        // extents are free (crypto-erase).
        if v.encryption.is_some() {
            self.commit_erasing(table)?;
            self.drop_cipher(v.uuid);
        } else {
            self.commit(table)?;
        }
        // A thin volume being sent: its mirror (whose copy reads the thin device) ends first.
        self.drop_mirror(v.uuid);
        // A thin volume's allocators (one per copy) stop before its maps' extents are free.
        for m in crate::thin_maps::map_refs(&v) {
            self.release_thin(m.key);
            // A copy not served kept its devices out of allocations: nothing names them now.
            self.space.unblock(m.key);
        }
        let all: Vec<ExtentEntry> = v.all_extents().copied().collect();
        self.release(&all);
        tracing::info!(volume = %v.name, uuid = %v.uuid, "volume deleted");
        Ok(info)
    }

    /// Grows a volume to `new_size` bytes. Shrinking is refused (it would destroy data).
    pub fn resize_volume(&mut self, id: &str, new_size: u64) -> Result<VolumeInfo> {
        let i = self.find(id)?;
        Self::check_size(new_size)?;
        let old = self.table.volumes[i].clone();
        if new_size < old.size {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' is {} bytes; shrinking to {new_size} would destroy data and is not supported",
                old.name, old.size
            )));
        }
        if old.rbd.is_some() {
            return self.resize_rbd_volume(i, new_size);
        }
        if let Some(r) = old.remote_leg().and_then(|l| l.remote.as_ref()) {
            return Err(Error::InvalidArgument(format!(
                "volume '{}' is being sent to {}, whose size is fixed: finish or cancel the send before growing it",
                old.name, r.uri
            )));
        }
        if old.thin.is_some() {
            return self.resize_thin_volume(i, new_size);
        }
        let have = self.round_up(old.size)?;
        let need = self.round_up(new_size)?;
        let mut v = old.clone();
        v.size = new_size;
        if need > have {
            let copies = v.copies_extents().len() as u64;
            self.check_space((need - have).saturating_mul(copies))?;
            self.grow_copies(&mut v, have, need - have)?;
        }
        let extents = new_extents(&old, &v);
        if let Err(e) = self.scrub(&extents) {
            self.release(&extents);
            return Err(e);
        }
        let mut table = self.table.clone();
        table.volumes[i] = v.clone();
        if let Err(e) = self.commit(table) {
            self.release(&extents);
            return Err(e);
        }
        tracing::info!(volume = %v.name, old_size = old.size, new_size, "volume resized");
        Ok(self.volume_info(&v))
    }

    /// Sets (or, with `None` or all rates 0, clears) a volume's I/O limits. The caller
    /// publishes the new layout to the volume's workers.
    pub fn set_qos(&mut self, id: &str, qos: Option<QosLimits>) -> Result<VolumeInfo> {
        let i = self.find(id)?;
        let qos = qos.filter(|q| !q.is_default());
        if let Some(q) = &qos {
            q.validate().map_err(Error::invalid)?;
        }
        if self.table.volumes[i].qos == qos {
            return Ok(self.volume_info(&self.table.volumes[i]));
        }
        let mut table = self.table.clone();
        table.volumes[i].qos = qos;
        let v = table.volumes[i].clone();
        self.commit(table)?;
        tracing::info!(volume = %v.name, qos = ?v.qos, "volume I/O limits set");
        Ok(self.volume_info(&v))
    }
}
