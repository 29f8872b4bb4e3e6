//! An export of any NBD server as a device: `nbd://HOST[:PORT]/EXPORT` or
//! `nbd+unix:///EXPORT?socket=PATH` (the NBD project's URI form, as qemu and libnbd write
//! it). The way to put a copy of a volume on another host: a mirror leg on a remote export
//! (qemu-nbd, nbdkit, another spoold).
//!
//! Each queue has a connection of its own ([`NbdQueue`]); the synchronous calls (metadata,
//! probes) share one more, opened again after it breaks. Every connect and handshake has a
//! deadline ([`CONNECT_TIMEOUT`]), so an unreachable server fails an open or a probe instead
//! of holding it.
//!
//! Owns: opening, the synchronous I/O, probing. Must not know: health, pools, mirrors.

mod queue;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use spool_nbd::client::{
    self, Connection, Target, CMD_FLUSH, CMD_READ, CMD_WRITE, CMD_WRITE_ZEROES,
};

pub use queue::NbdQueue;

use crate::{BackendInfo, DeviceQueue, Error, PoolDevice, Probe, Result};

/// How long connecting and the handshake may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// An NBD export.
#[derive(Debug)]
pub struct NbdBackend {
    path: PathBuf,
    target: Target,
    size: u64,
    /// The server takes `NBD_CMD_WRITE_ZEROES`.
    write_zeroes: bool,
    /// The synchronous calls' connection (`None` after it broke).
    sync: Mutex<Option<Connection>>,
}

impl NbdBackend {
    /// Connects to the export `uri` names: its size, whether it takes writes.
    pub fn open(uri: &str) -> Result<NbdBackend> {
        let path = PathBuf::from(uri);
        let target = Target::parse(uri).map_err(|e| Error::Invalid {
            path: uri.into(),
            msg: e.to_string(),
        })?;
        let conn = client::connect(&target, CONNECT_TIMEOUT)
            .map_err(|e| Error::io(&path, "connect to the NBD server", e))?;
        if conn.read_only() {
            return Err(Error::Invalid {
                path: uri.into(),
                msg: "the NBD server serves this export read-only".into(),
            });
        }
        // The data path works in sectors: a tail shorter than one is not used.
        let size = conn.size / crate::SECTOR_SIZE * crate::SECTOR_SIZE;
        Ok(NbdBackend {
            path,
            target,
            size,
            write_zeroes: conn.can_write_zeroes(),
            sync: Mutex::new(Some(conn)),
        })
    }

    /// One request of `len` bytes on the synchronous connection (reconnecting first if it
    /// broke): its header, `payload`, then the reply and `into` filled by a read's data.
    fn request(
        &self,
        kind: u16,
        offset: u64,
        len: u64,
        payload: &[u8],
        into: &mut [u8],
    ) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.size) {
            return Err(Error::io(
                &self.path,
                "NBD request",
                std::io::Error::from_raw_os_error(libc::EINVAL),
            ));
        }
        let mut sync = self.sync.lock().unwrap_or_else(|e| e.into_inner());
        let mut run = |c: &mut Connection| -> std::io::Result<()> {
            let mut msg = client::request(kind, 0, offset, len as u32).to_vec();
            msg.extend_from_slice(payload);
            c.stream.write_all(&msg)?;
            let (_, err) = client::read_reply(&mut c.stream)?;
            if err != 0 {
                return Err(std::io::Error::from_raw_os_error(err as i32));
            }
            if !into.is_empty() {
                c.stream.read_exact(into)?;
            }
            Ok(())
        };
        if sync.is_none() {
            let c = client::connect(&self.target, CONNECT_TIMEOUT)
                .map_err(|e| Error::io(&self.path, "connect to the NBD server", e))?;
            *sync = Some(c);
        }
        let c = sync.as_mut().expect("connected above");
        run(c).map_err(|e| {
            // A request that failed halfway leaves the stream out of step: start afresh.
            if e.raw_os_error().is_none() {
                *sync = None;
            }
            Error::io(&self.path, "NBD request", e)
        })
    }

    fn flush(&self) -> Result<()> {
        self.request(CMD_FLUSH, 0, 0, &[], &mut [])
    }
}

impl PoolDevice for NbdBackend {
    fn path(&self) -> &Path {
        &self.path
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            backend: "nbd",
            direct_align: None,
            inline_io: false,
        }
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        for (i, part) in buf.chunks_mut(client::MAX_IO as usize / 2).enumerate() {
            let at = offset + (i * (client::MAX_IO as usize / 2)) as u64;
            self.request(CMD_READ, at, part.len() as u64, &[], part)?;
        }
        Ok(())
    }

    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        for (i, part) in buf.chunks(client::MAX_IO as usize / 2).enumerate() {
            let at = offset + (i * (client::MAX_IO as usize / 2)) as u64;
            self.request(CMD_WRITE, at, part.len() as u64, part, &mut [])?;
        }
        self.flush()
    }

    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        let step = if self.write_zeroes { 1 << 30 } else { 1 << 20 };
        let zeroes = vec![0u8; if self.write_zeroes { 0 } else { step as usize }];
        let mut at = 0;
        while at < len {
            let n = (len - at).min(step);
            match self.write_zeroes {
                true => self.request(CMD_WRITE_ZEROES, offset + at, n, &[], &mut [])?,
                false => {
                    let data = &zeroes[..n as usize];
                    self.request(CMD_WRITE, offset + at, n, data, &mut [])?
                }
            }
            at += n;
        }
        self.flush()
    }

    fn open_queue(&self, _depth: u32) -> std::io::Result<Box<dyn DeviceQueue>> {
        let conn = client::connect(&self.target, CONNECT_TIMEOUT)?;
        Ok(Box::new(NbdQueue::new(conn)?))
    }

    /// A fresh connection and a read of the first sector, within [`CONNECT_TIMEOUT`] for
    /// the connection.
    fn probe(&self) -> Probe {
        match client::connect(&self.target, CONNECT_TIMEOUT) {
            Ok(c) => {
                *self.sync.lock().unwrap_or_else(|e| e.into_inner()) = Some(c);
                let mut b = [0u8; 512];
                match self.request(CMD_READ, 0, 512, &[], &mut b) {
                    Ok(()) => Probe::Ok,
                    Err(Error::Io { source, .. }) => {
                        Probe::Failed(source.raw_os_error().unwrap_or(libc::EIO))
                    }
                    Err(e) => Probe::Gone(e.to_string()),
                }
            }
            Err(e) => Probe::Gone(format!("{}: {e}", self.target)),
        }
    }
}

#[cfg(test)]
mod tests;
