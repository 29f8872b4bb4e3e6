//! An export of any NBD server as a device: `nbd://HOST[:PORT]/EXPORT` or
//! `nbd+unix:///EXPORT?socket=PATH` (the NBD project's URI form, as qemu and libnbd write
//! it). The way to put a copy of a volume on another host: a mirror leg on a remote export
//! (qemu-nbd, nbdkit, another spoold).
//!
//! Each queue has a connection of its own ([`NbdQueue`]), so a flush on one must cover the
//! writes completed on the others: with a server that does not say so
//! (`NBD_FLAG_CAN_MULTI_CONN`), a second queue is refused rather than risking a flush that
//! leaves a completed write volatile. The synchronous calls (metadata) share one more
//! connection, opened again after it breaks, each call bounded by [`SYNC_TIMEOUT`]; a probe
//! opens its own. Every connect and handshake has a deadline ([`CONNECT_TIMEOUT`]), so an
//! unreachable or silent server fails an open or a probe instead of holding it.
//!
//! Owns: opening, the synchronous I/O, probing. Must not know: health, pools, mirrors.

mod queue;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use spool_nbd::client::{
    self, Connection, Target, CMD_FLUSH, CMD_READ, CMD_WRITE, CMD_WRITE_ZEROES,
};

pub use queue::NbdQueue;

use crate::{BackendInfo, DeviceQueue, Error, PoolDevice, Probe, Result};

/// How long connecting and the handshake may take, and a probe's read.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one synchronous request may take.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(30);

/// An NBD export.
#[derive(Debug)]
pub struct NbdBackend {
    path: PathBuf,
    target: Target,
    size: u64,
    /// The server takes `NBD_CMD_WRITE_ZEROES`.
    write_zeroes: bool,
    /// A flush covers every connection's writes (`NBD_FLAG_CAN_MULTI_CONN`).
    multi_conn: bool,
    /// The largest read or write in one request.
    max_io: u64,
    /// Queues open now.
    queues: Arc<AtomicUsize>,
    /// The synchronous calls' connection (`None` after it broke).
    sync: Mutex<Option<Connection>>,
    /// How long one synchronous request may take ([`SYNC_TIMEOUT`]).
    sync_timeout: Duration,
    /// The queues open on the export, for [`PoolDevice::abort`].
    live: Mutex<Vec<std::sync::Weak<queue::Shared>>>,
}

impl NbdBackend {
    /// Connects to the export `uri` names: its size, whether it takes writes.
    pub fn open(uri: &str) -> Result<NbdBackend> {
        Self::open_with(uri, SYNC_TIMEOUT)
    }

    /// [`Self::open`], each synchronous request bounded by `sync_timeout`: the first
    /// connection's as every later one's (a server that stops answering fails the request,
    /// never holds a copy or the pool for ever).
    pub(crate) fn open_with(uri: &str, sync_timeout: Duration) -> Result<NbdBackend> {
        let path = PathBuf::from(uri);
        let target = Target::parse(uri).map_err(|e| Error::Invalid {
            path: uri.into(),
            msg: e.to_string(),
        })?;
        let conn = client::connect(&target, CONNECT_TIMEOUT)
            .and_then(|c| c.stream.set_timeouts(Some(sync_timeout)).map(|_| c))
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
            multi_conn: conn.multi_conn(),
            max_io: conn.max_io as u64,
            queues: Arc::default(),
            sync: Mutex::new(Some(conn)),
            sync_timeout,
            live: Mutex::default(),
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
        // The server's answer: 0 or its errno (the stream stays in step either way).
        let mut run = |c: &mut Connection| -> std::io::Result<u32> {
            let mut msg = client::request(kind, 0, offset, len as u32).to_vec();
            msg.extend_from_slice(payload);
            c.stream.write_all(&msg)?;
            let (_, err) = client::read_reply(&mut c.stream)?;
            if err == 0 && !into.is_empty() {
                c.stream.read_exact(into)?;
            }
            Ok(err)
        };
        if sync.is_none() {
            let c = client::connect(&self.target, CONNECT_TIMEOUT)
                .and_then(|c| c.stream.set_timeouts(Some(self.sync_timeout)).map(|_| c))
                .map_err(|e| Error::io(&self.path, "connect to the NBD server", e))?;
            *sync = Some(c);
        }
        let c = sync.as_mut().expect("connected above");
        match run(c) {
            Ok(0) => Ok(()),
            Ok(err) => Err(Error::io(
                &self.path,
                "NBD request",
                std::io::Error::from_raw_os_error(err as i32),
            )),
            Err(e) => {
                // A request that failed on the socket leaves the stream out of step.
                *sync = None;
                Err(Error::io(&self.path, "NBD request", e))
            }
        }
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
        let step = self.max_io as usize;
        for (i, part) in buf.chunks_mut(step).enumerate() {
            let at = offset + (i * step) as u64;
            self.request(CMD_READ, at, part.len() as u64, &[], part)?;
        }
        Ok(())
    }

    fn write_at_durable(&self, buf: &[u8], offset: u64) -> Result<()> {
        let step = self.max_io as usize;
        for (i, part) in buf.chunks(step).enumerate() {
            let at = offset + (i * step) as u64;
            self.request(CMD_WRITE, at, part.len() as u64, part, &mut [])?;
        }
        self.flush()
    }

    fn zero_range(&self, offset: u64, len: u64) -> Result<()> {
        let step = if self.write_zeroes {
            1 << 30
        } else {
            self.max_io.min(1 << 20)
        };
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
        if !self.multi_conn && self.queues.load(Ordering::SeqCst) > 0 {
            return Err(std::io::Error::other(format!(
                "{}: the NBD server does not let a flush on one connection cover the others \
                 (NBD_FLAG_CAN_MULTI_CONN), so only one queue may use it: give the volume \
                 one queue, or serve the export with multi-connection support \
                 (qemu-nbd --shared=N with N > 1)",
                self.target
            )));
        }
        let conn = client::connect(&self.target, CONNECT_TIMEOUT)?;
        Ok(Box::new(NbdQueue::new(
            conn,
            self.queues.clone(),
            &self.live,
        )?))
    }

    /// Cuts every queue's connection: what they have in flight fails with `ENOTCONN`, now,
    /// even on a server that never answers. (The synchronous connection ends its requests
    /// by its timeout.)
    fn abort(&self) {
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        for q in live.iter().filter_map(std::sync::Weak::upgrade) {
            q.cut();
        }
    }

    /// A connection of its own and a read of the first sector, each within
    /// [`CONNECT_TIMEOUT`]: a server that does not answer fails the probe instead of holding
    /// the health monitor.
    fn probe(&self) -> Probe {
        let read = |c: &mut Connection| -> std::io::Result<u32> {
            c.stream.set_timeouts(Some(CONNECT_TIMEOUT))?;
            c.stream.write_all(&client::request(CMD_READ, 0, 0, 512))?;
            let (_, err) = client::read_reply(&mut c.stream)?;
            if err == 0 {
                c.stream.read_exact(&mut [0u8; 512])?;
            }
            let _ = client::disconnect(&mut c.stream);
            Ok(err)
        };
        match client::connect(&self.target, CONNECT_TIMEOUT) {
            Ok(mut c) => match read(&mut c) {
                Ok(0) => Probe::Ok,
                // A server shutting down may come back: a path error, not a gone device.
                Ok(108) => Probe::Failed(libc::ENOTCONN),
                Ok(err) => Probe::Failed(err as i32),
                Err(e) => Probe::Failed(e.raw_os_error().unwrap_or(libc::ETIMEDOUT)),
            },
            Err(e) => Probe::Gone(format!("{}: {e}", self.target)),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
