//! Journal layer: one cross-process journal per virtqueue, in a file under `/dev/shm` that
//! outlives the process (Spool §4, Algorithms 1 and 2).
//!
//! Owns: the journal's shared-memory layout (docs/journal-format.md), the individual steps of
//! Algorithm 1 as single ordered stores, Algorithm 2's state repair, validation of journals
//! found on start-up (magic, version, queue size, checksum of the static part), and the
//! lifecycle of journal files (create, new generation, delete).
//!
//! The steps of Algorithm 1 are in `steps.rs`, Algorithm 2 in `recover.rs`, the files on
//! disk (names, private directory and files) in `files.rs`, the replay record in `replay.rs`;
//! this file owns the layout, validation and generations.
//!
//! Must not know: virtio ring layouts, guest memory or devices. It sees descriptor heads and
//! 16-bit ring indices only; the frontend maps these onto the virtqueue.
//!
//! # Memory ordering
//! After a crash the journal is read by another process, so what matters is the order in
//! which each step's stores reach memory. Every step is one atomic store (the `aux` word is a
//! single aligned 64-bit store: the paper's instruction merge), and a `Release` fence follows
//! each step so neither the compiler nor the CPU lets a later step's store (including the
//! frontend's stores into the used ring) become visible before it. On x86 these fences
//! compile to nothing (TSO already keeps stores in order); on weaker CPUs they emit the
//! needed barrier. A process crash does not lose stores that were issued: the memory is a
//! shared file mapping.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU16, AtomicU32, AtomicU64, Ordering};

use uuid::Uuid;

mod files;
mod recover;
mod replay;
mod steps;

use files::open_private;
pub use files::{ensure_private_dir, journal_path, remove_volume_journals};
pub use recover::{Recovery, RecoveryStep};
pub use replay::ReplayRecord;

/// Magic at offset 0.
pub const MAGIC: [u8; 8] = *b"SPOOLJN\x01";
/// Layout version written and understood by this build.
pub const FORMAT_VERSION: u32 = 1;
const HEADER_LEN: usize = 128;
const AUX_OFF: usize = 128;
const USED_OFF: usize = 136;
const SLOTS_OFF: usize = 144;
const STATIC_LEN: usize = 72;

/// State of a descriptor head in the journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReqState {
    None = 0,
    Inflight = 1,
    Done = 2,
}

/// Transaction state in the `aux` word.
const AUX_FINISHED: u64 = 0;
const AUX_START: u64 = 1;

/// Errors opening or validating a journal. Each names the file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("journal {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("journal {path} is not a Spool journal (bad magic); refusing to use it. Inspect it, then delete it to start the queue without it (requests it may describe are then lost)")]
    BadMagic { path: String },
    #[error("journal {path} has format version {found}, newer than this spoold understands ({supported}); run the newer spoold or delete the file (requests it describes are then lost)")]
    NewerFormat {
        path: String,
        found: u32,
        supported: u32,
    },
    #[error("journal {path} is damaged: {why}; refusing to replay it. Delete it to start the queue without it (requests it may describe are then lost)")]
    Corrupt { path: String, why: String },
    #[error("journal {path}: queue size {queue_size} is not a power of two between 1 and 32768")]
    QueueSize { path: String, queue_size: u16 },
    #[error(
        "{path}: {why}; refusing to use it (journals must live where only spoold's user can write)"
    )]
    NotPrivate { path: String, why: String },
}

/// Result type of the journal layer.
pub type Result<T> = std::result::Result<T, Error>;

/// Ring identity stored in the static part: a journal only applies to the same rings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RingAddrs {
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
}

/// Which object the frontend's guest memory lives in (the device and inode numbers of the
/// memfd or file holding the used ring). The same QEMU process sends the same memfds again
/// when it reconnects after spoold died; a new QEMU process (a migration's destination, a
/// restarted VM) has new ones. Kept at bytes 76..92 of the header, outside the checksum
/// (readers before it ignore those bytes; an unknown value is all zeroes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryId {
    pub dev: u64,
    pub ino: u64,
}

impl MemoryId {
    /// The object behind `file`, or None when it cannot be told.
    pub fn of(file: &File) -> Option<MemoryId> {
        use std::os::unix::fs::MetadataExt;
        let m = file.metadata().ok()?;
        Some(MemoryId {
            dev: m.dev(),
            ino: m.ino(),
        })
        .filter(|id| *id != MemoryId::default())
    }
}

const MEMORY_ID_OFF: usize = 76;

/// The static header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub queue_size: u16,
    pub queue_index: u16,
    pub generation: u64,
    pub volume: Uuid,
    pub rings: RingAddrs,
}

/// A journal mapped into this process.
pub struct Journal {
    path: PathBuf,
    ptr: *mut u8,
    len: usize,
    queue_size: u16,
    _file: File,
}

// SAFETY: the mapping is owned by this value (unmapped only with `&mut self`) and holds no
// thread-bound state; it is accessed through atomics, and the static header only through
// `&mut self` or before any other thread sees the journal.
unsafe impl Send for Journal {}

/// A journal's slots are indexed by head masked with `queue_size - 1`: only a power of two
/// keeps every head inside the mapping.
fn check_queue_size(path: &Path, queue_size: u16) -> Result<()> {
    if queue_size == 0 || !queue_size.is_power_of_two() {
        return Err(Error::QueueSize {
            path: path.display().to_string(),
            queue_size,
        });
    }
    Ok(())
}

fn size_for(queue_size: u16) -> usize {
    SLOTS_OFF + 4 * queue_size as usize
}

impl Journal {
    /// Opens an existing journal (validated) or creates a fresh one. Returns the journal and
    /// whether it existed before.
    pub fn open_or_create(
        dir: &Path,
        volume: Uuid,
        queue: u16,
        queue_size: u16,
    ) -> Result<(Journal, bool)> {
        let path = journal_path(dir, volume, queue);
        check_queue_size(&path, queue_size)?;
        let io = |e| Error::Io {
            path: path.display().to_string(),
            source: e,
        };
        ensure_private_dir(dir)?;
        let file = open_private(&path)?;
        let existing = file.metadata().map_err(io)?.len();
        let j = if existing == 0 {
            let len = size_for(queue_size);
            file.set_len(len as u64).map_err(io)?;
            let mut j = Journal::map(path.clone(), file, len)?;
            j.queue_size = queue_size;
            j.write_header(&Header {
                queue_size,
                queue_index: queue,
                generation: 1,
                volume,
                rings: RingAddrs::default(),
            });
            return Ok((j, false));
        } else {
            if existing < SLOTS_OFF as u64 || existing > size_for(u16::MAX) as u64 {
                return Err(Error::Corrupt {
                    path: path.display().to_string(),
                    why: format!("size {existing} is impossible"),
                });
            }
            Journal::map(path.clone(), file, existing as usize)?
        };
        let j = j.validated()?;
        let h = j.header();
        if h.volume != volume || h.queue_index != queue {
            return Err(Error::Corrupt {
                path: path.display().to_string(),
                why: format!("belongs to volume {} queue {}", h.volume, h.queue_index),
            });
        }
        Ok((j, true))
    }

    fn map(path: PathBuf, file: File, len: usize) -> Result<Journal> {
        let ptr = map_raw(&file, len).map_err(|e| Error::Io {
            path: path.display().to_string(),
            source: e,
        })?;
        Ok(Journal {
            path,
            ptr,
            len,
            queue_size: 0,
            _file: file,
        })
    }

    fn bytes(&self, off: usize, n: usize) -> &[u8] {
        assert!(off + n <= self.len);
        // SAFETY: `off + n <= self.len` (asserted) and `self.len` bytes are mapped. The file is
        // private (`open_private`: our uid, 0600, one link, 0700 dir), so the static header
        // changes only through `&mut self` methods of this process while the borrow lives.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), n) }
    }

    fn validated(mut self) -> Result<Journal> {
        let path = self.path.display().to_string();
        let b = self.bytes(0, HEADER_LEN).to_vec();
        if b[0..7] != MAGIC[0..7] {
            return Err(Error::BadMagic { path });
        }
        let version = u32::from_le_bytes(b[8..12].try_into().expect("4"));
        if version > FORMAT_VERSION || b[7] > MAGIC[7] {
            return Err(Error::NewerFormat {
                path,
                found: version.max(b[7] as u32),
                supported: FORMAT_VERSION,
            });
        }
        let crc = u32::from_le_bytes(b[72..76].try_into().expect("4"));
        if crc32c::crc32c(&b[0..STATIC_LEN]) != crc {
            return Err(Error::Corrupt {
                path,
                why: "checksum of the static header does not match".into(),
            });
        }
        let qs = u16::from_le_bytes(b[16..18].try_into().expect("2"));
        if qs == 0 || !qs.is_power_of_two() || size_for(qs) != self.len {
            return Err(Error::Corrupt {
                path,
                why: format!("queue size {qs} does not match the file size {}", self.len),
            });
        }
        self.queue_size = qs;
        Ok(self)
    }

    /// Path of the journal file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The static header.
    pub fn header(&self) -> Header {
        let b = self.bytes(0, STATIC_LEN);
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8"));
        Header {
            queue_size: u16::from_le_bytes(b[16..18].try_into().expect("2")),
            queue_index: u16::from_le_bytes(b[18..20].try_into().expect("2")),
            generation: u64_at(24),
            volume: Uuid::from_slice(&b[32..48]).expect("16"),
            rings: RingAddrs {
                desc: u64_at(48),
                avail: u64_at(56),
                used: u64_at(64),
            },
        }
    }

    fn write_header(&mut self, h: &Header) {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
        b[16..18].copy_from_slice(&h.queue_size.to_le_bytes());
        b[18..20].copy_from_slice(&h.queue_index.to_le_bytes());
        b[24..32].copy_from_slice(&h.generation.to_le_bytes());
        b[32..48].copy_from_slice(h.volume.as_bytes());
        b[48..56].copy_from_slice(&h.rings.desc.to_le_bytes());
        b[56..64].copy_from_slice(&h.rings.avail.to_le_bytes());
        b[64..72].copy_from_slice(&h.rings.used.to_le_bytes());
        let crc = crc32c::crc32c(&b[0..STATIC_LEN]);
        b[72..76].copy_from_slice(&crc.to_le_bytes());
        // SAFETY: HEADER_LEN (128) < SLOTS_OFF <= self.len (`size_for`; the size check in
        // `open_or_create`); `&mut self` means no reference into the mapping is alive.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.ptr, HEADER_LEN) };
        fence(Ordering::Release);
    }

    /// Starts a new generation: a new session, a guest reset or a changed queue size. Nothing
    /// of the previous generation can be replayed afterwards.
    pub fn new_generation(
        &mut self,
        queue_size: u16,
        rings: RingAddrs,
        last_avail: u16,
        used_idx: u16,
    ) -> Result<()> {
        check_queue_size(&self.path, queue_size)?;
        let mut h = self.header();
        if queue_size != self.queue_size {
            let len = size_for(queue_size);
            let io = |e| Error::Io {
                path: self.path.display().to_string(),
                source: e,
            };
            // The new mapping is made before the old one goes: on any failure the journal
            // keeps its old size and mapping, and stays usable.
            self._file.set_len(len as u64).map_err(io)?;
            let ptr = match map_raw(&self._file, len) {
                Ok(p) => p,
                Err(e) => {
                    let _ = self._file.set_len(self.len as u64);
                    return Err(io(e));
                }
            };
            // SAFETY: our own mapping of `self.len` bytes (`map_raw`); `&mut self` guarantees no
            // reference into it is alive, and nothing reads it between the resize and here.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
            self.ptr = ptr;
            self.len = len;
            self.queue_size = queue_size;
        }
        // Invalidate the old static part first, so a crash in the middle leaves a journal
        // that fails validation rather than a mix of two generations.
        // SAFETY: byte 72 < HEADER_LEN <= self.len (see `write_header`); `&mut self`.
        unsafe { *self.ptr.add(72) ^= 0xff };
        fence(Ordering::Release);
        for i in 0..queue_size {
            self.slot(i).store(0, Ordering::Relaxed);
        }
        self.used_atomic().store(used_idx, Ordering::Relaxed);
        self.aux_atomic()
            .store(pack_aux(AUX_FINISHED, last_avail, 0), Ordering::Relaxed);
        fence(Ordering::Release);
        h.generation = h.generation.wrapping_add(1);
        h.queue_size = queue_size;
        h.rings = rings;
        self.write_header(&h);
        Ok(())
    }

    /// The frontend memory this generation was started for (None: not recorded, a journal
    /// of an older spoold or one whose frontend's memory could not be told).
    pub fn frontend_memory(&self) -> Option<MemoryId> {
        let b = self.bytes(MEMORY_ID_OFF, 16);
        let id = MemoryId {
            dev: u64::from_le_bytes(b[0..8].try_into().expect("8")),
            ino: u64::from_le_bytes(b[8..16].try_into().expect("8")),
        };
        (id != MemoryId::default()).then_some(id)
    }

    /// Records the frontend memory of the current generation (right after
    /// [`Self::new_generation`], which clears it).
    pub fn set_frontend_memory(&mut self, id: Option<MemoryId>) {
        let id = id.unwrap_or_default();
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&id.dev.to_le_bytes());
        b[8..16].copy_from_slice(&id.ino.to_le_bytes());
        // SAFETY: 76 + 16 <= HEADER_LEN <= self.len (see `write_header`); `&mut self` means
        // no reference into the mapping is alive.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.ptr.add(MEMORY_ID_OFF), 16) };
        fence(Ordering::Release);
    }

    #[inline]
    fn atomic_at<T>(&self, off: usize) -> &T {
        // Offsets are the constant header fields or a slot index masked by the queue size, and
        // the mapping is at least `size_for(queue_size)` bytes (checked at open and at every
        // new generation), so this only guards against a bug in this file.
        debug_assert!(off + std::mem::size_of::<T>() <= self.len);
        debug_assert!(off.is_multiple_of(std::mem::align_of::<T>()));
        // SAFETY: in bounds and aligned (see above; the mapping is page-aligned; `slot` masks by
        // `queue_size`, a power of two with `size_for(queue_size) <= len`: `check_queue_size`,
        // `validated`); shared with other processes, hence atomics; borrows `self`.
        unsafe { &*(self.ptr.add(off) as *const T) }
    }

    #[inline]
    fn aux_atomic(&self) -> &AtomicU64 {
        self.atomic_at(AUX_OFF)
    }

    #[inline]
    fn used_atomic(&self) -> &AtomicU16 {
        self.atomic_at(USED_OFF)
    }

    #[inline]
    fn slot(&self, head: u16) -> &AtomicU32 {
        // queue_size is a power of two (validated), so the mask keeps every head in range.
        self.atomic_at(SLOTS_OFF + 4 * (head as usize & (self.queue_size as usize - 1)))
    }

    /// Queue size of the current generation.
    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    /// The journal's last avail index (where the next request will be taken).
    pub fn last_avail(&self) -> u16 {
        unpack_aux(self.aux_atomic().load(Ordering::Acquire)).1
    }

    /// The journal's used index.
    pub fn used_idx(&self) -> u16 {
        self.used_atomic().load(Ordering::Acquire)
    }

    /// State of one head.
    pub fn state(&self, head: u16) -> ReqState {
        match self.slot(head).load(Ordering::Acquire) & 0xff {
            1 => ReqState::Inflight,
            2 => ReqState::Done,
            _ => ReqState::None,
        }
    }

    /// True when the journal describes requests not yet completed to the guest.
    pub fn has_work(&self) -> bool {
        let (state, _, _) = unpack_aux(self.aux_atomic().load(Ordering::Acquire));
        state == AUX_START || (0..self.queue_size).any(|h| self.state(h) != ReqState::None)
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: `len > 0`: `ptr..ptr+len` is our mapping from `map_raw` (after a failed
            // `new_generation`, `len` is 0 and nothing is unmapped); references borrow `self`.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

fn map_raw(file: &File, len: usize) -> std::io::Result<*mut u8> {
    use std::os::fd::AsRawFd;
    // SAFETY: a new mapping at a kernel-chosen address replaces nothing. `len` is the file's
    // length (`open_or_create` reads it, or `set_len` just set it); the file is spoold's own
    // (`open_private`), so no other user can shrink it under us (SIGBUS).
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(ptr.cast())
}

fn pack_aux(state: u64, last_avail: u16, head: u16) -> u64 {
    state | (last_avail as u64) << 16 | (head as u64) << 32
}

fn unpack_aux(v: u64) -> (u64, u16, u16) {
    (v & 0xff, (v >> 16) as u16, (v >> 32) as u16)
}

#[cfg(test)]
mod tests;
