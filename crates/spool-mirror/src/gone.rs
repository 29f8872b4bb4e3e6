//! A leg device's queue that could not be opened (a remote leg whose link is down as the
//! worker reopens its queues): every command fails at once with `ENOTCONN`, so the leg
//! drops out of the requests (a path error on that leg only) instead of the whole mirror
//! failing to open its queue, which would fail the guest's requests.
//!
//! Owns: the failed commands' completions. Must not know: legs, regions.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};

use spool_devices::{DeviceIo, DeviceQueue};

pub(crate) struct GoneQueue {
    done: VecDeque<(u64, i32)>,
    event: File,
}

impl GoneQueue {
    pub(crate) fn new() -> std::io::Result<GoneQueue> {
        Ok(GoneQueue {
            done: VecDeque::new(),
            event: spool_devices::completion_eventfd()?,
        })
    }
}

impl DeviceQueue for GoneQueue {
    unsafe fn submit(&mut self, _io: DeviceIo, tag: u64) {
        self.done.push_back((tag, -libc::ENOTCONN));
        let _ = (&self.event).write(&1u64.to_ne_bytes());
    }

    fn kick(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        spool_devices::drain_done(&mut self.done, done)
    }

    fn completion_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    fn ack_completion_event(&self) {
        let mut buf = [0u8; 8];
        let _ = (&self.event).read(&mut buf);
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }
}
