//! Snapshots and clones of an RBD image, kept by RBD itself (docs/ceph.md, "Snapshots and
//! clones"): every spoold on the cluster, and the `rbd` tool, sees the same ones.
//!
//! A snapshot is taken through the image handle the data path writes through: librbd
//! blocks new writes and waits for those in flight on that handle before it records the
//! snapshot, so every write completed before it is in it, whole, and none started after.
//! A clone is RBD's layered clone (the snapshot is protected first, as format-1 clones need
//! and as keeps it from being deleted under a clone).
//!
//! Owns: the librbd calls. Must not know: the pool table, names' rules.

use std::ffi::{c_int, CStr};

use super::{cstring, ffi, rc, RbdBackend};
use crate::{Error, Result};

/// One snapshot of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdSnapshot {
    /// RBD's id of the snapshot (unique in the image).
    pub id: u64,
    pub name: String,
    /// The image's size when it was taken.
    pub size: u64,
    /// Seconds since the Unix epoch.
    pub created: u64,
}

impl RbdBackend {
    fn invalid(&self, msg: String) -> Error {
        Error::Invalid {
            path: self.path.display().to_string(),
            msg,
        }
    }

    /// Takes snapshot `name` of the image (crash-consistent with this handle's writes).
    pub fn snapshot_create(&self, name: &str) -> Result<()> {
        let c = cstring(&self.path, "snapshot name", name)?;
        // SAFETY: an open image and a NUL-terminated name.
        let r = unsafe { (ffi::loaded().rbd_snap_create)(self.image.handle, c.as_ptr()) };
        if r == -libc::EEXIST {
            return Err(self.invalid(format!("a snapshot named '{name}' exists already")));
        }
        rc(&self.path, "create a snapshot", r as i64).map(drop)
    }

    /// The image's snapshots, oldest first.
    pub fn snapshots(&self) -> Result<Vec<RbdSnapshot>> {
        let mut max: c_int = 16;
        loop {
            let mut infos: Vec<ffi::rbd_snap_info_t> = (0..max.max(1))
                .map(|_| ffi::rbd_snap_info_t {
                    id: 0,
                    size: 0,
                    name: std::ptr::null(),
                })
                .collect();
            // SAFETY: an open image; `infos` holds `max` entries, as `max` says.
            let r = unsafe {
                (ffi::loaded().rbd_snap_list)(self.image.handle, infos.as_mut_ptr(), &mut max)
            };
            if r == -libc::ERANGE {
                continue; // `max` now says how many there are.
            }
            let n = rc(&self.path, "list snapshots", r as i64)? as usize;
            let mut out = Vec::with_capacity(n);
            for i in infos.iter().take(n) {
                // SAFETY: librbd filled the first `n` entries with NUL-terminated names,
                // valid until `rbd_snap_list_end` below.
                let name = unsafe { CStr::from_ptr(i.name) }
                    .to_string_lossy()
                    .into_owned();
                let mut ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: an open image, a snapshot id it listed, an out-pointer to a local.
                let t = unsafe {
                    (ffi::loaded().rbd_snap_get_timestamp)(self.image.handle, i.id, &mut ts)
                };
                out.push(RbdSnapshot {
                    id: i.id,
                    name,
                    size: i.size,
                    created: if t < 0 { 0 } else { ts.tv_sec.max(0) as u64 },
                });
            }
            // SAFETY: the array `rbd_snap_list` filled; frees the names only.
            unsafe { (ffi::loaded().rbd_snap_list_end)(infos.as_mut_ptr()) };
            out.sort_by_key(|s| s.id);
            return Ok(out);
        }
    }

    /// Whether snapshot `name` is protected (a clone may be made of it).
    fn protected(&self, name: &CStr) -> Result<bool> {
        let mut p: c_int = 0;
        // SAFETY: an open image, a NUL-terminated name, an out-pointer to a local.
        let r = unsafe {
            (ffi::loaded().rbd_snap_is_protected)(self.image.handle, name.as_ptr(), &mut p)
        };
        if r == -libc::ENOENT {
            return Err(self.invalid(format!("no snapshot named '{}'", name.to_string_lossy())));
        }
        rc(&self.path, "look at a snapshot", r as i64)?;
        Ok(p != 0)
    }

    /// Deletes snapshot `name`; refused while a clone of it exists.
    pub fn snapshot_remove(&self, name: &str) -> Result<()> {
        let c = cstring(&self.path, "snapshot name", name)?;
        if self.protected(&c)? {
            // SAFETY: an open image and a NUL-terminated name.
            let r = unsafe { (ffi::loaded().rbd_snap_unprotect)(self.image.handle, c.as_ptr()) };
            if r == -libc::EBUSY {
                return Err(self.invalid(format!(
                    "snapshot '{name}' has clones: delete them, or `volume inflate` them, first"
                )));
            }
            rc(&self.path, "unprotect a snapshot", r as i64)?;
        }
        // SAFETY: an open image and a NUL-terminated name.
        let r = unsafe { (ffi::loaded().rbd_snap_remove)(self.image.handle, c.as_ptr()) };
        rc(&self.path, "remove a snapshot", r as i64).map(drop)
    }

    /// Makes the image hold snapshot `name`'s data again (nothing may write to it meanwhile).
    pub fn rollback(&self, name: &str) -> Result<()> {
        let c = cstring(&self.path, "snapshot name", name)?;
        self.protected(&c)?; // A clear error for a name that does not exist.
                             // SAFETY: an open image and a NUL-terminated name.
        let r = unsafe { (ffi::loaded().rbd_snap_rollback)(self.image.handle, c.as_ptr()) };
        rc(&self.path, "roll back to a snapshot", r as i64).map(drop)
    }

    /// Copies everything the image still reads from its parent (a clone stops depending on
    /// its snapshot).
    pub fn flatten(&self) -> Result<()> {
        // SAFETY: an open image.
        let r = unsafe { (ffi::loaded().rbd_flatten)(self.image.handle) };
        if r == -libc::EINVAL {
            return Ok(()); // Not a clone: nothing to copy.
        }
        rc(&self.path, "flatten the image", r as i64).map(drop)
    }

    /// Makes image `child` in this image's pool a clone of snapshot `snap` (protected first);
    /// returns its `POOL/IMAGE`.
    pub fn clone_snapshot(&self, snap: &str, child: &str) -> Result<String> {
        let spec = self.path.display().to_string();
        let spec = spec.strip_prefix("rbd:").unwrap_or(&spec);
        let (_, pool, parent) = super::parse(spec)?;
        let csnap = cstring(&self.path, "snapshot name", snap)?;
        let cparent = cstring(&self.path, "image name", parent)?;
        let cchild = cstring(&self.path, "image name", child)?;
        if !self.protected(&csnap)? {
            // SAFETY: an open image and a NUL-terminated name.
            let r = unsafe { (ffi::loaded().rbd_snap_protect)(self.image.handle, csnap.as_ptr()) };
            if r != -libc::EBUSY {
                rc(&self.path, "protect a snapshot", r as i64)?;
            }
        }
        let mut order: c_int = 0;
        // SAFETY: the image's own I/O context for both sides (same pool), NUL-terminated
        // names, an out-pointer to a local.
        let r = unsafe {
            (ffi::loaded().rbd_clone)(
                self.image.ioctx,
                cparent.as_ptr(),
                csnap.as_ptr(),
                self.image.ioctx,
                cchild.as_ptr(),
                ffi::RBD_FEATURE_LAYERING,
                &mut order,
            )
        };
        if r == -libc::EEXIST {
            return Err(self.invalid(format!("RBD image {pool}/{child} exists already")));
        }
        rc(&self.path, "clone a snapshot", r as i64)?;
        Ok(format!("{pool}/{child}"))
    }
}
