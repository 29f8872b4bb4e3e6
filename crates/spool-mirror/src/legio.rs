//! Synchronous I/O on the legs' devices for the resync thread and verify, through the
//! devices' own queues: the data path's way in (O_DIRECT for files). Going through the page
//! cache instead (the devices' metadata calls) collides with the data path's direct writes:
//! the kernel may then fail to invalidate a cached page ("Page cache invalidation failure on
//! direct I/O") and a later buffered read copies stale data onto another leg.
//!
//! Owns: one small queue per leg device, opened on first use, page-aligned buffers, and the
//! mapping of a leg's volume range to its devices' pieces. Must not know: regions, the bitmap.

use std::time::Duration;

use super::Shared;
pub(crate) use spool_devices::AlignedBuf;
use spool_devices::{DeviceIo, DeviceQueue, Error, ErrorReport, IoVec, Result, Signal};

/// Queues on the legs' devices, one per device, for synchronous use by one thread.
#[derive(Default)]
pub(crate) struct LegIo {
    queues: Vec<Option<Box<dyn DeviceQueue>>>,
    /// Devices found not to take write-zeroes (zeroes are written to them as data).
    no_zeroes: Vec<usize>,
}

/// Whether a write-zeroes failed because the device does not do it (an NVMe controller
/// without the command, a file system without fallocate), not because the device failed.
fn unsupported(errno: i32) -> bool {
    errno == libc::EOPNOTSUPP || errno == libc::EINVAL
}

impl LegIo {
    fn queue(&mut self, shared: &Shared, d: usize) -> Result<&mut Box<dyn DeviceQueue>> {
        if self.queues.len() <= d {
            self.queues.resize_with(d + 1, || None);
        }
        if self.queues[d].is_none() {
            let dev = shared.spec.devices.get(d).ok_or_else(|| gone(shared))?;
            let q = dev
                .open_queue(4)
                .map_err(|e| Error::io(dev.path(), "open a resync queue", e))?;
            self.queues[d] = Some(q);
        }
        Ok(self.queues[d].as_mut().expect("opened above"))
    }

    /// Reads (`write` false) or writes `buf` at byte `offset` of device `d`.
    pub(crate) fn rw(
        &mut self,
        shared: &Shared,
        d: usize,
        write: bool,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let iov = IoVec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        let io = DeviceIo::data(write, offset, buf.len() as u64, &iov, 1);
        self.run(shared, d, io)
    }

    /// Zeroes `len` bytes at `offset` of device `d` with write-zeroes through its queue;
    /// `Ok(false)` when the device does not do write-zeroes (the caller writes zeroes as
    /// data; not a device error, so not reported to its health).
    pub(crate) fn zeroes(
        &mut self,
        shared: &Shared,
        d: usize,
        offset: u64,
        len: u64,
    ) -> Result<bool> {
        if self.no_zeroes.contains(&d) {
            return Ok(false);
        }
        match self.run(shared, d, DeviceIo::WriteZeroes { offset, len }) {
            Ok(()) => Ok(true),
            Err(Error::Io { source, .. }) if source.raw_os_error().is_some_and(unsupported) => {
                self.no_zeroes.push(d);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Makes the writes done on device `d` durable.
    pub(crate) fn flush(&mut self, shared: &Shared, d: usize) -> Result<()> {
        self.run(shared, d, DeviceIo::Flush)
    }

    /// Submits `io` and waits for its completion. A command that does not come back within
    /// 10 s is aborted; the wait goes on until the queue gives it back (the buffers it
    /// points at belong to the caller until then). An error is reported to the device's
    /// health, as the data path's are (a copy reading a failing source must get it
    /// isolated, or the copy would retry it for ever while another leg could serve).
    fn run(&mut self, shared: &Shared, d: usize, io: DeviceIo) -> Result<()> {
        let write = !matches!(io, DeviceIo::Read { .. });
        let zeroes = matches!(io, DeviceIo::WriteZeroes { .. });
        let (offset, len) = match io {
            DeviceIo::Read { offset, len, .. }
            | DeviceIo::Write { offset, len, .. }
            | DeviceIo::Discard { offset, len }
            | DeviceIo::WriteZeroes { offset, len } => (offset, len),
            DeviceIo::Flush => (0, 0),
        };
        let path = shared
            .spec
            .devices
            .get(d)
            .map(|dev| dev.path().to_path_buf());
        let q = self.queue(shared, d)?;
        // SAFETY: the iovec and buffer `io` points at outlive this call, which returns only
        // once the command's completion is reaped; the queue has nothing else in flight.
        let r = unsafe { spool_devices::run_one(&mut **q, io, Duration::from_secs(10)) };
        if r < 0 && r != -libc::ECANCELED && !(zeroes && unsupported(-r)) {
            if let Some(dev) = shared.spec.devices.get(d) {
                dev.health().report(ErrorReport {
                    signal: Signal::Errno(-r),
                    offset,
                    len,
                    write,
                });
            }
        }
        match r {
            r if r >= 0 => Ok(()),
            r => Err(Error::io(
                path.as_deref().unwrap_or(std::path::Path::new("?")),
                "resync I/O",
                std::io::Error::from_raw_os_error(-r),
            )),
        }
    }
}

fn gone(shared: &Shared) -> Error {
    Error::io(
        std::path::Path::new(&shared.spec.name),
        "leg",
        std::io::Error::from_raw_os_error(libc::ENODEV),
    )
}

/// Calls `f(device index, device offset, length, offset within the range)` for each piece of
/// leg `slot` in volume range `[off, off + len)`.
fn leg_pieces(
    shared: &Shared,
    slot: u8,
    off: u64,
    len: u64,
    mut f: impl FnMut(usize, u64, u64, u64) -> Result<()>,
) -> Result<()> {
    let Some(pieces) = shared.leg(slot).map(|l| &l.pieces) else {
        return Err(Error::io(
            std::path::Path::new(&shared.spec.name),
            "leg",
            std::io::Error::other(format!("leg {slot} is missing")),
        ));
    };
    let mut done = 0;
    for p in pieces
        .iter()
        .skip(pieces.partition_point(|p| p.logical + p.len <= off))
    {
        if done >= len {
            break;
        }
        let within = off + done - p.logical;
        let n = (p.len - within).min(len - done);
        if p.device >= shared.spec.devices.len() {
            return Err(Error::io(
                std::path::Path::new(&shared.spec.name),
                "leg",
                std::io::Error::from_raw_os_error(libc::ENODEV),
            ));
        }
        f(p.device, p.offset + within, n, done)?;
        done += n;
    }
    Ok(())
}

/// Whether leg `slot` never wrote volume range `[off, off + len)`: every device piece of it
/// says so ([`spool_devices::Device::known_unwritten`]: a thin copy's holes) or lies past the
/// leg's end (read as zeroes). False for a leg that is missing or on a missing device.
pub(super) fn leg_unwritten(shared: &Shared, slot: u8, off: u64, len: u64) -> bool {
    let mut all = true;
    let walked = leg_pieces(shared, slot, off, len, |d, o, n, _| {
        all &= shared.spec.devices[d].known_unwritten(o, n);
        Ok(())
    });
    walked.is_ok() && all
}

pub(super) fn leg_read(
    shared: &Shared,
    io: &mut LegIo,
    slot: u8,
    off: u64,
    buf: &mut [u8],
) -> Result<()> {
    // Past the leg's last piece (a remote leg ends at the volume's size, the legs here at
    // their last extent's end): not the volume's bytes; read as zeroes.
    let end = shared
        .leg(slot)
        .and_then(|l| l.pieces.last())
        .map_or(0, |p| p.logical + p.len);
    if off + buf.len() as u64 > end {
        let from = end.saturating_sub(off).min(buf.len() as u64) as usize;
        buf[from..].fill(0);
    }
    leg_pieces(shared, slot, off, buf.len() as u64, |d, o, n, at| {
        io.rw(
            shared,
            d,
            false,
            o,
            &mut buf[at as usize..(at + n) as usize],
        )
    })
}

/// Writes `data` (or zeroes, when `None`, `len` bytes) to leg `slot` at volume offset `off`,
/// adding the devices written to `written` (the caller flushes them).
pub(super) fn leg_write(
    shared: &Shared,
    io: &mut LegIo,
    slot: u8,
    off: u64,
    data: Option<&mut [u8]>,
    len: u64,
    written: &mut Vec<usize>,
) -> Result<()> {
    let mut data = data;
    leg_pieces(shared, slot, off, len, |d, o, n, at| {
        if !written.contains(&d) {
            written.push(d);
        }
        match data.as_deref_mut() {
            Some(b) => io.rw(shared, d, true, o, &mut b[at as usize..(at + n) as usize]),
            None => shared.spec.devices[d].zero_range(o, n),
        }
    })
}

/// Zeroes `len` bytes of leg `slot` at volume offset `off` through the leg devices' queues
/// (write-zeroes; on a device that does not do it, `zero` is written as data: `len` bytes
/// of zeroes), adding the devices written to `written` (the caller flushes them). Returns
/// whether every piece went as write-zeroes.
pub(super) fn leg_zeroes(
    shared: &Shared,
    io: &mut LegIo,
    (slot, off, len): (u8, u64, u64),
    zero: &mut [u8],
    written: &mut Vec<usize>,
) -> Result<bool> {
    let mut all = true;
    leg_pieces(shared, slot, off, len, |d, o, n, at| {
        if !written.contains(&d) {
            written.push(d);
        }
        if !io.zeroes(shared, d, o, n)? {
            all = false;
            io.rw(
                shared,
                d,
                true,
                o,
                &mut zero[at as usize..(at + n) as usize],
            )?;
        }
        Ok(())
    })?;
    Ok(all)
}
