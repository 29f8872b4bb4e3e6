//! The data path's view of a volume: its logical→physical map onto device handles.
//!
//! Owns: [`VolumeLayout`] and [`Segment`], and building them from the pool table. Must not
//! know: how I/O is submitted (the frontend does that), metadata on disk.

use std::sync::Arc;

use uuid::Uuid;

use crate::{Error, Pool, QosLimits, Result};
use spool_devices::Device;

/// One piece of a volume's address space mapped onto a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Volume byte offset where the segment starts.
    pub logical: u64,
    pub len: u64,
    /// Index into [`VolumeLayout::devices`].
    pub device: usize,
    /// Device byte offset.
    pub offset: u64,
}

/// Everything the data path needs to serve one volume.
#[derive(Debug, Clone)]
pub struct VolumeLayout {
    pub uuid: Uuid,
    pub name: String,
    /// Capacity in bytes.
    pub size: u64,
    pub read_only: bool,
    pub num_queues: u16,
    /// Ascending by `logical`, contiguous, covering at least `size`.
    pub segments: Vec<Segment>,
    /// I/O limits the workers enforce (None: unlimited, and no cost).
    pub qos: Option<QosLimits>,
    pub devices: Vec<Arc<Device>>,
}

impl VolumeLayout {
    /// Index of the segment holding volume byte `offset` (`segments.len()` past the end).
    #[inline]
    fn segment_at(&self, offset: u64) -> usize {
        self.segments
            .partition_point(|s| s.logical + s.len <= offset)
    }

    /// The device and device offset of `[offset, offset + len)` when it lies within one
    /// segment (the common case); `None` when it spans segments or lies outside them.
    #[inline]
    pub fn map_one(&self, offset: u64, len: u64) -> Option<(usize, u64)> {
        let s = self.segments.get(self.segment_at(offset))?;
        let within = offset.checked_sub(s.logical)?;
        (s.len - within >= len).then_some((s.device, s.offset + within))
    }

    /// Splits the volume range `[offset, offset + len)` into device pieces:
    /// `f(device index, device offset, piece length, offset within the range)`.
    /// The caller has checked the range against `size`.
    pub fn map(&self, offset: u64, len: u64, mut f: impl FnMut(usize, u64, u64, u64)) {
        let mut i = self.segment_at(offset);
        let mut done = 0;
        while done < len && i < self.segments.len() {
            let s = &self.segments[i];
            let pos = offset + done;
            let within = pos - s.logical;
            let n = (s.len - within).min(len - done);
            f(s.device, s.offset + within, n, done);
            done += n;
            i += 1;
        }
    }
}

impl Pool {
    /// The data-path view of a volume. Fails when one of its devices is missing.
    pub fn layout(&self, id: &str) -> Result<VolumeLayout> {
        let v = &self.table.volumes[self.find(id)?];
        let mut devices: Vec<Arc<Device>> = Vec::new();
        let mut dev_index: Vec<Uuid> = Vec::new();
        let mut segments: Vec<Segment> = Vec::new();
        let mut logical = 0;
        for e in &v.extents {
            let m = self
                .members
                .iter()
                .find(|m| m.uuid == e.device)
                .ok_or_else(|| Error::Corrupt {
                    path: format!("volume '{}'", v.name),
                    why: format!("device {} is missing; the volume is offline", e.device),
                })?;
            let d = match dev_index.iter().position(|u| *u == e.device) {
                Some(d) => d,
                None => {
                    dev_index.push(e.device);
                    devices.push(m.dev.clone());
                    dev_index.len() - 1
                }
            };
            let len = self.table.min_extent << e.order;
            match segments.last_mut() {
                Some(s) if s.device == d && s.offset + s.len == e.offset => s.len += len,
                _ => segments.push(Segment {
                    logical,
                    len,
                    device: d,
                    offset: e.offset,
                }),
            }
            logical += len;
        }
        Ok(VolumeLayout {
            uuid: v.uuid,
            name: v.name.clone(),
            size: v.size,
            read_only: v.read_only,
            num_queues: v.num_queues,
            segments,
            devices,
            qos: v.qos,
        })
    }
}
