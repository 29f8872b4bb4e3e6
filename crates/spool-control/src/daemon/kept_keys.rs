//! The key-encryption keys one worker hands the next through the keeper, so that a worker
//! restart or upgrade between a rekey and the config change (or between the new key put in
//! place and the rekey) serves every encrypted volume (docs/encryption.md). Each key's 64
//! hex digits are in a sealed memfd only the keeper holds (and, under systemd, its file
//! descriptor store); the kept value lists their ids in the pool's order, the key in use
//! first.
//!
//! Owns: the kept record and its memfds. Must not know: how keys wrap or which one the pool
//! uses (spool-pool settles that), or the keeper's protocol.

use std::io::{Read, Seek, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;

use spool_crypt::Kek;
use spool_frontend::StateStore;
use zeroize::Zeroizing;

use super::keeper::Keeping;
use crate::kept::KEK_KEY;

/// The keys the previous worker kept, in its order (a file that does not read back as the
/// key its id names is logged and left out).
pub(super) fn take(k: &Keeping) -> Vec<Arc<Kek>> {
    let Some((value, files)) = k.take(KEK_KEY) else {
        return Vec::new();
    };
    let ids: Vec<String> = serde_json::from_str(&value).unwrap_or_default();
    let mut out = Vec::new();
    for (id, mut f) in ids.iter().zip(files) {
        let mut material = Zeroizing::new(Vec::new());
        let read = f.rewind().and_then(|_| f.read_to_end(&mut material));
        match read
            .map_err(|e| e.to_string())
            .and_then(|_| Kek::from_material(&material).map_err(|e| e.to_string()))
        {
            Ok(kek) if kek.id() == *id => out.push(Arc::new(kek)),
            Ok(kek) => {
                tracing::error!(kept = %id, read = %kek.id(), "a kept key-encryption key reads back as another; left out")
            }
            Err(e) => {
                tracing::error!(kek = %id, "a kept key-encryption key cannot be read: {e}; left out")
            }
        }
    }
    if !out.is_empty() {
        let ids: Vec<String> = out.iter().map(|k| k.id()).collect();
        tracing::info!(keks = ?ids, "key-encryption keys taken over from the previous worker");
    }
    out
}

/// Deposits `keks` (the pool's, the key in use first) for the next worker; none: the record
/// is removed. A failure is logged: the next worker then has the configured key only.
pub(super) fn keep(store: &dyn StateStore, keks: &[Arc<Kek>]) {
    if keks.is_empty() {
        if let Err(e) = store.remove(KEK_KEY) {
            tracing::error!("keeper: {e}");
        }
        return;
    }
    let files: std::io::Result<Vec<std::fs::File>> = keks.iter().map(|k| sealed(k)).collect();
    let ids: Vec<String> = keks.iter().map(|k| k.id()).collect();
    let put = files.and_then(|files| {
        let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
        store.put(
            KEK_KEY,
            serde_json::to_string(&ids).unwrap_or_default(),
            &fds,
        )
    });
    if let Err(e) = put {
        tracing::error!(keks = ?ids, "cannot keep the key-encryption keys with the keeper: {e}; a worker restart now has the configured key only");
    }
}

/// A memfd holding `kek`'s hex digits, sealed against any change.
fn sealed(kek: &Kek) -> std::io::Result<std::fs::File> {
    // SAFETY: memfd_create reads the NUL-terminated name and takes flags; the result is
    // checked. The memory file is shared with the keeper, which only holds it.
    let fd = unsafe {
        libc::memfd_create(
            c"spool-kek".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor this function owns.
    let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.write_all(kek.to_hex().as_bytes())?;
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on a descriptor we own, with an integer argument.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(f)
}
