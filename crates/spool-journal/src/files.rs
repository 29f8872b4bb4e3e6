//! Journal files on disk: where a queue's journal lives, the private directory they live in
//! and opening one as a private file (no symlinks followed, spoold's own uid, one link, no
//! access for others), and deleting a volume's journals.
//!
//! Owns: the naming scheme (`spool-<volume>-q<queue>.journal`) and the privacy checks.
//!
//! Must not know: the journal's layout or its algorithms (that is `lib.rs`).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use uuid::Uuid;

use crate::{Error, Result};

/// File name of a queue's journal.
pub fn journal_path(dir: &Path, volume: Uuid, queue: u16) -> PathBuf {
    dir.join(format!("spool-{}-q{queue}.journal", volume.simple()))
}

/// Removes every journal of a volume (the volume was deleted).
pub fn remove_volume_journals(dir: &Path, volume: Uuid) {
    let prefix = format!("spool-{}-q", volume.simple());
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Makes sure `dir` is a directory only spoold's user can write: creates it (mode 0700) when
/// missing; refuses a symlink, a non-directory, a directory owned by another user or one that
/// group or others may write (a local user who created it first could plant symlinks, forge
/// journals for recovery to replay, or truncate live ones). A private directory of our own
/// with looser read bits is tightened to 0700.
pub fn ensure_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let bad = |why: String| Error::NotPrivate {
        path: dir.display().to_string(),
        why,
    };
    let io = |e| Error::Io {
        path: dir.display().to_string(),
        source: e,
    };
    if std::fs::symlink_metadata(dir).is_err() {
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(e)),
        }
    }
    let m = std::fs::symlink_metadata(dir).map_err(io)?;
    if m.file_type().is_symlink() {
        return Err(bad("is a symbolic link".into()));
    }
    if !m.is_dir() {
        return Err(bad("is not a directory".into()));
    }
    // SAFETY: geteuid has no preconditions and touches no memory.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me {
        return Err(bad(format!(
            "is owned by uid {}, not by spoold's uid {me} (another user may have created it \
             first; remove it and spoold creates it itself)",
            m.uid()
        )));
    }
    if m.mode() & 0o022 != 0 {
        return Err(bad(format!(
            "is writable by group or others (mode {:o}); make it 0700",
            m.mode() & 0o7777
        )));
    }
    if m.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
    }
    Ok(())
}

/// Opens a journal file without following symlinks: an existing one must be a regular file
/// of spoold's user with one link and no access for others; a new one is created exclusively
/// (mode 0600), so nothing planted in its place is ever written through.
pub(crate) fn open_private(path: &Path) -> Result<File> {
    use std::os::unix::fs::MetadataExt;
    let io = |e| Error::Io {
        path: path.display().to_string(),
        source: e,
    };
    let open = |create: bool| {
        let mut o = OpenOptions::new();
        o.read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
        if create {
            o.create_new(true).mode(0o600);
        }
        o.open(path)
    };
    let file = match open(false) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match open(true) {
            Ok(f) => f,
            // Created by someone else between the two opens: check that one.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => open(false).map_err(io)?,
            Err(e) => return Err(io(e)),
        },
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(Error::NotPrivate {
                path: path.display().to_string(),
                why: "is a symbolic link".into(),
            })
        }
        Err(e) => return Err(io(e)),
    };
    let m = file.metadata().map_err(io)?;
    // SAFETY: geteuid has no preconditions and touches no memory.
    let me = unsafe { libc::geteuid() };
    let why = if !m.is_file() {
        Some("is not a regular file".to_string())
    } else if m.uid() != me {
        Some(format!(
            "is owned by uid {}, not spoold's uid {me}",
            m.uid()
        ))
    } else if m.nlink() != 1 {
        Some(format!("has {} hard links", m.nlink()))
    } else if m.mode() & 0o077 != 0 {
        Some(format!(
            "is accessible by group or others (mode {:o})",
            m.mode() & 0o7777
        ))
    } else {
        None
    };
    match why {
        Some(why) => Err(Error::NotPrivate {
            path: path.display().to_string(),
            why,
        }),
        None => Ok(file),
    }
}
