//! The replay record: which heads a process is resubmitting after a restart, kept next to
//! the journal (`<journal>.replay`) while it does, so that a request that crashes every
//! process replaying it is failed instead of replayed forever (a poison request).
//!
//! The record's first byte is the crash mark. The process maps it while replaying, and its
//! fatal-signal hook (`spool_sigbus::mark_on_crash`) sets it to 1 if the process dies of a
//! fault (SIGSEGV, SIGBUS, SIGABRT, ...) before the replay finished. A process killed from
//! outside (SIGKILL) leaves it 0: being killed is no fault of the requests. The next process
//! that finds the same heads to replay with the mark set fails them instead.
//!
//! Layout: byte 0 crash mark, bytes 8..16 the journal generation, 16..20 the number of heads
//! n, then n little-endian u16 heads.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use crate::{Error, Journal, Result};

/// A replay in progress (the record exists while this lives).
#[derive(Debug)]
pub struct ReplayRecord {
    path: PathBuf,
    mark: *mut u8,
    len: usize,
}

// SAFETY: the mapping is a private byte of shared memory; moving the owner between threads
// moves nothing it points to.
unsafe impl Send for ReplayRecord {}

impl ReplayRecord {
    /// The crash mark's address (for the fatal-signal hook); valid while `self` lives.
    pub fn crash_mark(&self) -> *mut u8 {
        self.mark
    }
}

impl Drop for ReplayRecord {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `len` bytes; the hook's registration of the mark is
        // withdrawn by its owner before this drop (see the frontend's worker).
        unsafe { libc::munmap(self.mark.cast(), self.len) };
        let _ = std::fs::remove_file(&self.path);
    }
}

fn encode(generation: u64, heads: &[u16]) -> Vec<u8> {
    let mut b = vec![0u8; 20 + 2 * heads.len()];
    b[8..16].copy_from_slice(&generation.to_le_bytes());
    b[16..20].copy_from_slice(&(heads.len() as u32).to_le_bytes());
    for (i, h) in heads.iter().enumerate() {
        b[20 + 2 * i..22 + 2 * i].copy_from_slice(&h.to_le_bytes());
    }
    b
}

impl Journal {
    fn replay_path(&self) -> PathBuf {
        let mut p = self.path().as_os_str().to_owned();
        p.push(".replay");
        PathBuf::from(p)
    }

    /// Starts replaying `heads` (sorted or not). Returns the record (dropping it ends the
    /// replay) and whether the previous process died of a fault while replaying exactly these
    /// heads of this generation: then they are poison, and the caller fails them instead.
    pub fn begin_replay(&self, heads: &[u16]) -> Result<(ReplayRecord, bool)> {
        let path = self.replay_path();
        let io = |e| Error::Io {
            path: path.display().to_string(),
            source: e,
        };
        let mut sorted = heads.to_vec();
        sorted.sort_unstable();
        let want = encode(self.header().generation, &sorted);
        let mut poison = false;
        if let Ok(f) = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            let mut found = Vec::new();
            if f.take(want.len() as u64 + 1)
                .read_to_end(&mut found)
                .is_ok()
            {
                poison = found.len() == want.len() && found[0] == 1 && found[1..] == want[1..];
            }
        }
        let _ = std::fs::remove_file(&path);
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(io)?;
        f.write_all(&want).map_err(io)?;
        let len = want.len();
        use std::os::fd::AsRawFd;
        // SAFETY: a new shared mapping of the `len` bytes just written to our own file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            let _ = std::fs::remove_file(&path);
            return Err(io(e));
        }
        Ok((
            ReplayRecord {
                path,
                mark: p.cast(),
                len,
            },
            poison,
        ))
    }
}
