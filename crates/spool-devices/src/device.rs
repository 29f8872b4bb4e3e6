//! [`Device`]: any [`PoolDevice`] backend with a health cell and fault injection stacked on
//! it, the way SPDK stacks its error bdev on a base bdev. This is the handle the pool,
//! the health monitor and the workers share.
//!
//! Owns: the device's [`DeviceHealth`] cell, its [`FaultSet`], putting every queue behind a
//! [`FaultyQueue`], injected probe failures and simulated SMART warnings in front of the
//! backend's own, and choosing the backend a path names (`nvme:BDF`, or a file / block
//! device).
//!
//! Must not know: how any backend does its I/O. A `Device` is itself a `PoolDevice`, so a
//! composed backend (a mirror) may be built from `Device`s, each with its own health.

use std::path::Path;
use std::sync::Arc;

use crate::backend::{BackendInfo, ControllerStatus, OpenOptions, PoolDevice, Probe};
use crate::file::FileBackend;
use crate::null::NullBackend;
use crate::nvme::NvmeBackend;
use crate::{
    DeviceHealth, DeviceQueue, ErrorClass, FaultSet, FaultyQueue, MetaOp, NullReads, Result,
};

/// A pool device: a backend, its health cell and its fault injection.
#[derive(Debug)]
pub struct Device {
    backend: Box<dyn PoolDevice>,
    /// Injected faults, applied in front of every queue of this device.
    faults: Arc<FaultSet>,
    /// The state the data path obeys (the health monitor moves it).
    health: Arc<DeviceHealth>,
}

impl Device {
    /// Stacks a fresh health cell and a fault set armed with `faults` on `backend`.
    pub fn new(backend: impl PoolDevice + 'static, faults: &[crate::FaultRule]) -> Device {
        Self::from_box(Box::new(backend), faults)
    }

    /// As [`Device::new`], for a backend already boxed.
    pub fn from_box(backend: Box<dyn PoolDevice>, faults: &[crate::FaultRule]) -> Device {
        let set = FaultSet::default();
        for rule in faults {
            set.add(rule.clone());
        }
        Device {
            backend,
            faults: Arc::new(set),
            health: Arc::default(),
        }
    }

    /// Opens (and with `create_size`, creates) a device and takes an exclusive lock on it.
    /// A path `nvme:DDDD:BB:DD.F` opens namespace 1 of an NVMe controller through VFIO
    /// (VFIO gives one process the device at a time, which is the lock); anything else is a
    /// regular file or a block device. `rbd:POOL/IMAGE` is a Ceph RBD image on the cluster
    /// `opts.ceph` names (created with `create_size` when missing). `nbd://HOST[:PORT]/EXPORT`
    /// and `nbd+unix:///EXPORT?socket=PATH` are an export of an NBD server.
    pub fn open(path: &Path, opts: &OpenOptions) -> Result<Device> {
        let name = path.to_str().unwrap_or_default();
        let backend: Box<dyn PoolDevice> = if let Some(bdf) = name.strip_prefix("nvme:") {
            Box::new(NvmeBackend::open(bdf, !opts.no_nvme_sgl, &opts.handoff)?)
        } else if crate::is_nbd_uri(name) {
            Box::new(crate::NbdBackend::open(name)?)
        } else if let Some(image) = name.strip_prefix("rbd:") {
            Box::new(crate::RbdBackend::open(
                image,
                &opts.ceph,
                opts.create_size,
            )?)
        } else {
            Box::new(FileBackend::open(path, opts)?)
        };
        Ok(Self::from_box(backend, &opts.faults))
    }

    /// A null device of `size` bytes named `name` (benchmarks only). Its pool metadata lives
    /// in memory only.
    pub fn open_null(
        name: &str,
        size: u64,
        reads: NullReads,
        opts: &OpenOptions,
    ) -> Result<Device> {
        Ok(Self::new(
            NullBackend::open(name, size, reads, &opts.handoff)?,
            &opts.faults,
        ))
    }

    /// The backend under the health cell and fault injection.
    pub fn backend(&self) -> &dyn PoolDevice {
        &*self.backend
    }

    /// The device's fault-injection rules.
    pub fn faults(&self) -> &Arc<FaultSet> {
        &self.faults
    }

    /// The device's health cell.
    pub fn health(&self) -> &Arc<DeviceHealth> {
        &self.health
    }

    /// Path (or name) the device was opened from.
    pub fn path(&self) -> &Path {
        self.backend.path()
    }

    /// Usable size in bytes (a multiple of 512).
    pub fn size(&self) -> u64 {
        self.backend.size()
    }

    /// What the backend is and how its queues do I/O.
    pub fn info(&self) -> BackendInfo {
        self.backend.info()
    }

    /// Alignment O_DIRECT I/O needs, or `None` when only buffered I/O is available.
    pub fn direct_align(&self) -> Option<u64> {
        self.backend.info().direct_align
    }

    /// True when queues on this device run inline rather than through io_uring (tmpfs).
    pub fn inline_io(&self) -> bool {
        self.backend.info().inline_io
    }

    /// Synchronous read used for metadata (never on the data path).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.injected(MetaOp::Read, offset, buf.len() as u64, "reading metadata")?;
        self.backend.read_at(buf, offset)
    }

    /// Synchronous, durable write used for metadata (never on the data path).
    pub fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.injected(MetaOp::Write, offset, buf.len() as u64, "writing metadata")?;
        self.backend.write_at_durable(buf, offset)?;
        self.synced();
        Ok(())
    }

    /// A synchronous durable operation returned: it synced the whole device (fdatasync), so
    /// every write completed before it is durable (for the power-cut log, when armed).
    fn synced(&self) {
        if let Some(log) = self.faults.write_log() {
            log.synced();
        }
    }

    /// Makes a range read back as zeroes, durably.
    pub fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        self.injected(MetaOp::Zero, offset, len, "zeroing a range")?;
        self.backend.zero_range(offset, len)?;
        self.synced();
        Ok(())
    }

    /// The error an armed metadata fault rule gives this operation, if one matches.
    fn injected(&self, op: MetaOp, offset: u64, len: u64, what: &'static str) -> Result<()> {
        match self.faults.check_meta(op, offset, len) {
            None => Ok(()),
            Some(e) => Err(crate::Error::Io {
                path: self.path().display().to_string(),
                what,
                source: std::io::Error::from_raw_os_error(e),
            }),
        }
    }

    /// Whether `[offset, offset + len)` is known never to have been written (reads back
    /// zeroes without being read: [`PoolDevice::known_unwritten`]); only while the device is
    /// healthy (a failing device's reads fail, and a copy must find that out by reading).
    pub fn known_unwritten(&self, offset: u64, len: u64) -> bool {
        self.health.state() == crate::HealthState::Healthy
            && self.backend.known_unwritten(offset, len)
    }

    /// Opens a queue on this device for one worker, behind the device's fault injection.
    pub fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        let inner = self.backend.open_queue(depth)?;
        Ok(Box::new(FaultyQueue::new(inner, self.faults.clone())))
    }

    /// Asks the device whether it still answers: injected probe faults first, then the
    /// backend's own probe.
    pub fn probe(&self) -> Probe {
        if let Some(e) = self.faults.probe_fault() {
            return match ErrorClass::of_errno(e) {
                ErrorClass::Gone => Probe::Gone(format!(
                    "injected: {}",
                    std::io::Error::from_raw_os_error(e)
                )),
                _ => Probe::Failed(e),
            };
        }
        self.backend.probe()
    }

    /// The periodic check of a device not being reset: is it still there? The backend's
    /// own presence check where it has one (NVMe: no I/O), else [`Device::probe`].
    pub fn presence(&self) -> Probe {
        match self.backend.presence() {
            Some(p) => p,
            None => self.probe(),
        }
    }

    /// The SMART critical-warning bits: the backend's and the simulated byte of fault
    /// injection, both when set.
    pub fn smart_warning(&self) -> u8 {
        self.backend.smart_warning() | self.faults.smart_warning()
    }

    /// Resets the device's controller when there is one to reset.
    pub fn reset_controller(&self) -> Option<Result<()>> {
        self.backend.reset_controller()
    }

    /// What the device's controller reports, when it has one of ours.
    pub fn controller_status(&self) -> Option<ControllerStatus> {
        self.backend.controller_status()
    }
}

/// A `Device` stacks like any backend: a composed backend (a mirror) can be built from
/// `Device`s, each keeping its own health cell and fault injection.
impl PoolDevice for Device {
    fn path(&self) -> &Path {
        Device::path(self)
    }

    fn size(&self) -> u64 {
        Device::size(self)
    }

    fn info(&self) -> BackendInfo {
        Device::info(self)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        Device::read_at(self, buf, offset)
    }

    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        Device::write_at_durable(self, buf, offset)
    }

    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        Device::zero_range(self, offset, len)
    }

    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        Device::open_queue(self, depth)
    }

    fn probe(&self) -> Probe {
        Device::probe(self)
    }

    fn presence(&self) -> Option<Probe> {
        Some(Device::presence(self))
    }

    fn smart_warning(&self) -> u8 {
        Device::smart_warning(self)
    }

    fn reset_controller(&self) -> Option<Result<()>> {
        Device::reset_controller(self)
    }

    fn controller_status(&self) -> Option<ControllerStatus> {
        Device::controller_status(self)
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        self.backend.as_any()
    }

    fn claim(&self, owner: &str, trusted: bool, wait: std::time::Duration) -> Result<()> {
        self.backend.claim(owner, trusted, wait)
    }

    fn release_claim(&self, owner: &str) -> Result<()> {
        self.backend.release_claim(owner)
    }
}

#[cfg(test)]
#[path = "device_tests.rs"]
mod tests;
