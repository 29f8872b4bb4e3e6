//! The serving fence of an RBD image: which spoold may serve it. Any spoold on the cluster can
//! open an image, so two of them could write it at once (a VM migrating from host A to host
//! B, an operator starting the VM on B while A still serves it). A spoold claims an image
//! before its first queue takes a request and gives the claim back when its frontend has
//! stopped every queue (drained) or gone away: the destination of a migration then waits
//! for the source to drain, and a second host never serves a volume the first still writes.
//!
//! The claim is an RBD advisory exclusive lock (`rbd lock ls` shows it) whose cookie names
//! the owner: one spoold (its pool), not one process. A worker that is killed leaves the lock
//! in place, and the worker that takes over finds its own owner's cookie and goes on without
//! a cluster round trip or a lock to wait out; a whole spoold that is lost leaves the lock
//! too, and a new host is let in only when an operator removes it (`rbd lock rm`, which also
//! blocklists the old client: docs/ceph.md).
//!
//! Owns: the lock calls and the count of this process's claims. Must not know: who serves
//! what (the frontend decides when to claim and release).

use std::ffi::{c_char, CString};

use std::time::{Duration, Instant};

use super::{ffi, RbdBackend};
use crate::{Error, Result};

/// How often a claim waiting for another owner asks again.
const RETRY: Duration = Duration::from_millis(20);

/// One holder of an image's advisory lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Locker {
    /// The cluster client holding it (`client.4151`).
    pub client: String,
    /// Whose it is: the owner string given to [`RbdBackend::claim`].
    pub cookie: String,
    /// The client's address.
    pub addr: String,
}

/// The cookie of an owner's lock.
fn cookie(owner: &str) -> String {
    format!("spoold {owner}")
}

impl RbdBackend {
    /// Claims the image for `owner` (one spoold). With `trusted`, the caller knows this owner
    /// already holds it (a session continued from a process that had claimed it) and only
    /// counts the claim. Otherwise it takes the lock, or finds it held under `owner`'s
    /// cookie (by a process of the same spoold that was killed); while another owner holds
    /// it, it asks again every 20 ms for up to `wait`, then fails naming the holder.
    pub fn claim(&self, owner: &str, trusted: bool, wait: Duration) -> Result<()> {
        let mut count = self.claims.lock().unwrap_or_else(|p| p.into_inner());
        if *count > 0 || trusted {
            *count += 1;
            return Ok(());
        }
        let cookie = cookie(owner);
        let c = self.cstr("lock cookie", &cookie)?;
        let deadline = Instant::now() + wait;
        loop {
            // SAFETY: an open image and a NUL-terminated cookie.
            let r = unsafe { (ffi::loaded().rbd_lock_exclusive)(self.image.handle, c.as_ptr()) };
            let held_by = match r {
                0 => None,
                r if r == -libc::EEXIST => None,
                r if r == -libc::EBUSY => {
                    let lockers = self.lockers()?;
                    if lockers.iter().any(|l| l.cookie == cookie) {
                        None
                    } else {
                        lockers.into_iter().next()
                    }
                }
                r => {
                    return Err(Error::io(
                        &self.path,
                        "lock the RBD image",
                        std::io::Error::from_raw_os_error(-r),
                    ))
                }
            };
            let Some(other) = held_by else {
                *count += 1;
                return Ok(());
            };
            if Instant::now() >= deadline {
                return Err(Error::Invalid {
                    path: self.path.display().to_string(),
                    msg: format!(
                        "served by another host: {} ({} at {}) holds the image's lock; \
                         if that host is gone for good, remove the lock with `rbd lock rm`",
                        other.cookie, other.client, other.addr
                    ),
                });
            }
            std::thread::sleep(RETRY);
        }
    }

    /// Gives back one claim of `owner`; the last one removes the lock, whichever process of
    /// this owner took it. Never `rbd_break_lock` on this process's own lock: librbd would
    /// blocklist this very client, cutting every image of the process off the cluster.
    pub fn release_claim(&self, owner: &str) -> Result<()> {
        let mut count = self.claims.lock().unwrap_or_else(|p| p.into_inner());
        if *count == 0 {
            return Ok(());
        }
        *count -= 1;
        if *count > 0 {
            return Ok(());
        }
        let cookie = cookie(owner);
        let c = self.cstr("lock cookie", &cookie)?;
        // SAFETY: an open image and a NUL-terminated cookie.
        let r = unsafe { (ffi::loaded().rbd_unlock)(self.image.handle, c.as_ptr()) };
        if r == 0 {
            return Ok(());
        }
        if r != -libc::ENOENT {
            return Err(Error::io(
                &self.path,
                "unlock the RBD image",
                std::io::Error::from_raw_os_error(-r),
            ));
        }
        // Not this process's lock: an earlier process of this owner took it (a killed or
        // upgraded worker). Breaking it blocklists that process's cluster client too
        // (librbd's `rbd_blocklist_on_break_lock`), so it can never write again.
        for l in self.lockers()?.into_iter().filter(|l| l.cookie == cookie) {
            let client = self.cstr("lock client", &l.client)?;
            let c = self.cstr("lock cookie", &cookie)?;
            // SAFETY: an open image and two NUL-terminated strings.
            let r = unsafe {
                (ffi::loaded().rbd_break_lock)(self.image.handle, client.as_ptr(), c.as_ptr())
            };
            if r < 0 && r != -libc::ENOENT {
                return Err(Error::io(
                    &self.path,
                    "unlock the RBD image",
                    std::io::Error::from_raw_os_error(-r),
                ));
            }
        }
        Ok(())
    }

    /// This process's claims on the image (0: it serves nothing on it).
    pub fn claims(&self) -> usize {
        *self.claims.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Who holds the image's advisory lock.
    pub fn lockers(&self) -> Result<Vec<Locker>> {
        let mut lens = [256usize; 4];
        for _ in 0..8 {
            let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n.max(1)]).collect();
            let mut exclusive = 0;
            let [tag, clients, cookies, addrs] = &mut bufs[..] else {
                unreachable!("four buffers")
            };
            let [tl, cl, kl, al] = &mut lens;
            // SAFETY: an open image; every buffer is as long as the length passed with it,
            // which librbd reads and updates (to the size needed, with -ERANGE).
            let r = unsafe {
                (ffi::loaded().rbd_list_lockers)(
                    self.image.handle,
                    &mut exclusive,
                    tag.as_mut_ptr() as *mut c_char,
                    tl,
                    clients.as_mut_ptr() as *mut c_char,
                    cl,
                    cookies.as_mut_ptr() as *mut c_char,
                    kl,
                    addrs.as_mut_ptr() as *mut c_char,
                    al,
                )
            };
            if r == -(libc::ERANGE as isize) {
                continue;
            }
            if r < 0 {
                return Err(Error::io(
                    &self.path,
                    "list the RBD image's lockers",
                    std::io::Error::from_raw_os_error(-r as i32),
                ));
            }
            let n = r as usize;
            let split = |b: &[u8], len: usize| -> Vec<String> {
                b[..len.min(b.len())]
                    .split(|&c| c == 0)
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .take(n)
                    .collect()
            };
            let clients = split(&bufs[1], lens[1]);
            let cookies = split(&bufs[2], lens[2]);
            let addrs = split(&bufs[3], lens[3]);
            return Ok((0..n)
                .map(|i| Locker {
                    client: clients.get(i).cloned().unwrap_or_default(),
                    cookie: cookies.get(i).cloned().unwrap_or_default(),
                    addr: addrs.get(i).cloned().unwrap_or_default(),
                })
                .collect());
        }
        Err(Error::Invalid {
            path: self.path.display().to_string(),
            msg: "the image's locker list keeps growing".into(),
        })
    }

    fn cstr(&self, what: &str, s: &str) -> Result<CString> {
        super::cstring(&self.path, what, s)
    }
}
