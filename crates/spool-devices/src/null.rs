//! The `null` device: completes every request at once without storing anything, to measure the
//! software stack alone (like SPDK's null bdev and qemu-storage-daemon's `null-co`).
//!
//! Reads either leave the guest's buffers untouched (SPDK's null bdev, qsd
//! `read-zeroes=off`) or zero them (qsd `read-zeroes=on`): [`NullReads`] makes the choice
//! explicit so benchmarks compare like with like.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};

use crate::queue::{DeviceIo, DeviceQueue};

/// What a null device does with read buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NullReads {
    /// Never touch them (fastest; data read back is whatever the buffer held).
    #[default]
    Untouched,
    /// Fill them with zeroes (one memory write per byte read).
    Zero,
}

/// Queue of a null device.
pub struct NullQueue {
    reads: NullReads,
    done: VecDeque<(u64, i32)>,
    event: File,
}

impl NullQueue {
    /// A new queue.
    pub fn new(reads: NullReads) -> std::io::Result<Self> {
        Ok(NullQueue {
            reads,
            done: VecDeque::new(),
            event: crate::queue::completion_eventfd()?,
        })
    }
}

impl DeviceQueue for NullQueue {
    unsafe fn submit(&mut self, io: DeviceIo, tag: u64) {
        let res = match io {
            DeviceIo::Read {
                len, iov, iovcnt, ..
            } => {
                if self.reads == NullReads::Zero {
                    // SAFETY: `iovcnt` valid iovecs (the `submit` contract; the worker's come
                    // from `HostMap::host`/`pieces`, each inside one guest region).
                    for v in unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) } {
                        // SAFETY: each buffer is `iov_len` writable bytes (`submit` contract);
                        // written as bytes, never through a reference to guest memory.
                        unsafe { std::ptr::write_bytes(v.iov_base.cast::<u8>(), 0, v.iov_len) };
                    }
                }
                len.min(i32::MAX as u64) as i32
            }
            DeviceIo::Write { len, .. } => len.min(i32::MAX as u64) as i32,
            _ => 0,
        };
        self.done.push_back((tag, res));
    }

    fn kick(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    fn reap(&mut self, done: &mut dyn FnMut(u64, i32)) -> usize {
        crate::queue::drain_done(&mut self.done, done)
    }

    fn completion_fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    fn ack_completion_event(&self) {}

    fn in_flight(&self) -> usize {
        self.done.len()
    }
}
