//! The NVMe backend: namespace 1 of a controller driven by Spool's userspace driver
//! (`spool-nvme`) over VFIO, path `nvme:DDDD:BB:DD.F`.
//!
//! Owns: opening the controller, synchronous metadata I/O through it (read-modify-write of
//! partial blocks), Write Zeroes for zeroing, the presence check from registers and the
//! kernel's removal request, the probe read, controller resets, SMART warnings (read at most
//! once a second) and the controller status. Per-worker queues are [`NvmeQueue`]
//! (`queue.rs`, commands built in `commands.rs`).
//!
//! Must not know: health cells and fault injection (the [`crate::Device`] wrapper). No type
//! of `spool-nvme` leaves this module through the public API: callers see
//! [`ControllerStatus`] and [`Probe`].

mod commands;
mod queue;

pub use queue::NvmeQueue;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use spool_nvme::handoff::Handoff;
use spool_nvme::Controller;

use crate::backend::{
    check_range, BackendInfo, ControllerStatus, ErrorLogRecord, PoolDevice, Probe, SmartHealth,
};
use crate::{DeviceQueue, Error, Result};

/// An NVMe namespace as a pool device.
#[derive(Debug)]
pub struct NvmeBackend {
    path: PathBuf,
    ctrl: Arc<Controller>,
    size: u64,
    /// Queues may describe scatter lists by SGLs (config `[io] nvme_sgl`).
    sgl: bool,
    /// Last SMART critical-warning byte read from the controller, and when.
    smart_cache: Mutex<(u8, Option<Instant>)>,
}

impl NvmeBackend {
    /// Opens the NVMe controller at PCI address `bdf` (bound to vfio-pci) and uses its
    /// namespace 1. VFIO gives one process the device at a time, which is the lock. `sgl`
    /// lets its queues use SGLs where the controller has them. What is kept for the next
    /// worker goes through `handoff`.
    pub fn open(bdf: &str, sgl: bool, handoff: &Arc<Handoff>) -> Result<Self> {
        let path = PathBuf::from(format!("nvme:{bdf}"));
        let ctrl = Controller::open(bdf, handoff).map_err(|e| Error::Invalid {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
        let size = ctrl.size();
        Ok(NvmeBackend {
            path,
            ctrl,
            size,
            sgl,
            smart_cache: Mutex::default(),
        })
    }

    /// Reads the whole blocks covering `[offset, offset+len)`; returns their start and bytes.
    fn read_covering(&self, offset: u64, len: u64) -> Result<(u64, Vec<u8>)> {
        let lba = self.ctrl.namespace().lba_size;
        let start = offset / lba * lba;
        let end = (offset + len).div_ceil(lba) * lba;
        let mut data = vec![0u8; (end - start) as usize];
        self.ctrl
            .read(start, &mut data)
            .map_err(|e| self.error("read", e))?;
        Ok((start, data))
    }

    fn error(&self, what: &'static str, e: spool_nvme::Error) -> Error {
        Error::Io {
            path: self.path.display().to_string(),
            what,
            source: std::io::Error::new(
                std::io::Error::from_raw_os_error(e.errno()).kind(),
                e.to_string(),
            ),
        }
    }
}

impl PoolDevice for NvmeBackend {
    fn path(&self) -> &Path {
        &self.path
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            backend: "nvme",
            direct_align: None,
            inline_io: false,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(&self.path, self.size, offset, buf.len() as u64)?;
        let (start, data) = self.read_covering(offset, buf.len() as u64)?;
        let at = (offset - start) as usize;
        buf.copy_from_slice(&data[at..at + buf.len()]);
        Ok(())
    }

    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(&self.path, self.size, offset, buf.len() as u64)?;
        let lba = self.ctrl.namespace().lba_size;
        let (start, mut data) =
            if offset.is_multiple_of(lba) && (buf.len() as u64).is_multiple_of(lba) {
                (offset, buf.to_vec())
            } else {
                // Read-modify-write of the partial blocks at either end.
                self.read_covering(offset, buf.len() as u64)?
            };
        let at = (offset - start) as usize;
        data[at..at + buf.len()].copy_from_slice(buf);
        self.ctrl
            .write_durable(start, &data)
            .map_err(|e| self.error("write", e))
    }

    /// Write Zeroes for whole blocks; a partial block is written with zeroes.
    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        check_range(&self.path, self.size, offset, len)?;
        let lba = self.ctrl.namespace().lba_size;
        if offset.is_multiple_of(lba) && len.is_multiple_of(lba) {
            return self
                .ctrl
                .zero_durable(offset, len)
                .map_err(|e| self.error("write zeroes", e));
        }
        self.write_at_durable(&vec![0u8; len as usize], offset)
    }

    fn open_queue(&self, depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        Ok(Box::new(NvmeQueue::new(
            self.ctrl.clone(),
            depth,
            self.sgl,
        )?))
    }

    /// Gone (presence), a fatal controller status, or a 4 KiB read at offset 0.
    fn probe(&self) -> Probe {
        if let Some(gone @ Probe::Gone(_)) = self.presence() {
            return gone;
        }
        if self.ctrl.csts() & spool_nvme::spec::CSTS_CFS != 0 {
            return Probe::Failed(libc::EIO);
        }
        let mut buf = vec![0u8; 4096.min(self.size as usize)];
        match self.ctrl.read(0, &mut buf) {
            Ok(()) => Probe::Ok,
            Err(spool_nvme::Error::Gone(why)) => Probe::Gone(why),
            Err(e) => Probe::Failed(e.errno()),
        }
    }

    /// The kernel's removal request and the registers: no I/O (a probe read would queue
    /// behind whatever the controller is stuck on and stall the monitor).
    fn presence(&self) -> Option<Probe> {
        let c = &self.ctrl;
        if c.removal_requested() {
            c.release("the kernel asked for the device back (hot removal)");
            return Some(Probe::Gone(
                "hot removal: the kernel asked for the device back; released it".into(),
            ));
        }
        if c.is_gone() {
            return Some(Probe::Gone(
                "the controller's registers read all ones or faulted (removed)".into(),
            ));
        }
        Some(Probe::Ok)
    }

    /// The controller's critical-warning byte, read at most once a second.
    fn smart_warning(&self) -> u8 {
        let mut cache = self.smart_cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache
            .1
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            match self.ctrl.smart_log() {
                Ok(log) => cache.0 = log.critical_warning,
                Err(e) => {
                    tracing::debug!(device = %self.path.display(), error = %e, "cannot read the SMART log")
                }
            }
            cache.1 = Some(Instant::now());
        }
        cache.0
    }

    fn reset_controller(&self) -> Option<Result<()>> {
        Some(self.ctrl.reset().map_err(|e| Error::Controller {
            path: self.path.display().to_string(),
            msg: e.to_string(),
        }))
    }

    /// Identify data, queue and copy counters, and a fresh SMART log when the controller
    /// answers.
    fn controller_status(&self) -> Option<ControllerStatus> {
        let c = &self.ctrl;
        let i = c.info();
        let ns = c.namespace();
        let gone = c.is_gone();
        Some(ControllerStatus {
            pci: c.bdf().to_string(),
            model: i.model.clone(),
            serial: i.serial.clone(),
            firmware: i.firmware.clone(),
            version: format!("{}.{}", i.version.0, i.version.1),
            lba_size: ns.lba_size,
            blocks: ns.blocks,
            io_queues: i.io_queues,
            max_transfer: i.max_transfer,
            resets: c.resets(),
            attached: c.attached(),
            zero_copy_requests: c.zero_copy_requests.load(Relaxed),
            bounced_requests: c.bounced_requests.load(Relaxed),
            sgl_requests: c.sgl_requests.load(Relaxed),
            sgl: i.sgl,
            flush_commands: c.flush_commands.load(Relaxed),
            deallocate_commands: c.deallocate_commands.load(Relaxed),
            write_zeroes_commands: c.write_zeroes_commands.load(Relaxed),
            gone,
            smart: if gone { None } else { c.smart_log().ok() }.map(|s| SmartHealth {
                critical_warning: s.critical_warning,
                temperature: s.temperature,
                available_spare: s.available_spare,
                percentage_used: s.percentage_used,
                media_errors: s.media_errors,
                error_log_entries: s.error_log_entries,
            }),
            error_log: if gone {
                Vec::new()
            } else {
                c.error_log(4).unwrap_or_default()
            }
            .into_iter()
            .map(|e| ErrorLogRecord {
                error_count: e.error_count,
                sqid: e.sqid,
                cid: e.cid,
                status: e.status.to_string(),
                lba: e.lba,
                nsid: e.nsid,
            })
            .collect(),
        })
    }
}
