//! The serving fence of an RBD image: which spoold may serve it. Any spoold on the cluster can
//! open an image, so two of them could write it at once (a VM migrating from host A to host
//! B, an operator starting the VM on B while A still serves it). A spoold claims an image
//! before its first queue takes a request and gives the claim back when its frontend has
//! stopped every queue (drained) or gone away: the destination of a migration then waits
//! for the source to drain, and a second host never serves a volume the first still writes.
//!
//! The claim is an RBD advisory exclusive lock (`rbd lock ls` shows it) whose cookie names
//! the owner: one spoold (its pool), not one process. It is taken through librados' object
//! locks on the image's header object, as librbd's own `rbd_lock_exclusive` does, but
//! without librbd's header-update notification: that waits for every watcher of the image
//! to answer, and a killed worker's watch lingers for 30 s, so each lock or unlock took 5 s
//! (the notify timeout) — in a migration's downtime. A worker that is killed leaves the lock
//! in place, and the worker that takes over finds its own owner's cookie and goes on without
//! a lock to wait out (one round trip records it on the image: `Fence::enlist`, so that
//! its own successor can blocklist it in turn); a whole spoold that is lost leaves the lock
//! too, and a new host is let in only when an operator removes it (`rbd lock rm`, which also
//! blocklists the old client: docs/ceph.md).
//!
//! Owns: the lock calls, the records of the processes that served the image, and the count
//! of this process's claims. Must not know: who serves
//! what (the frontend decides when to claim and release).

use std::ffi::{c_char, CString};

use std::time::{Duration, Instant};

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::{ffi, Image};
use crate::{Error, Result};

/// librbd's name for an image's advisory lock.
const LOCK_NAME: &str = "rbd_lock";
/// Prefix of the header object's attributes that record which processes served the image
/// (`Fence::enlist`).
const SERVED_BY: &str = "spoold.served_by.";
/// How long a claim waits for its record ([`Fence::enlist`]) to reach the cluster.
const ENLIST_WAIT: Duration = Duration::from_millis(200);
/// How long a dead predecessor's cluster client stays blocklisted (the cluster's default).
const BLOCKLIST_S: u32 = 3600;

/// How often a claim waiting for another owner asks again.
const RETRY: Duration = Duration::from_millis(20);

/// One holder of an image's advisory lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Locker {
    /// The cluster client holding it (`client.4151`).
    pub client: String,
    /// Whose it is: the cookie of the owner given to [`Fence::claim`].
    pub cookie: String,
    /// The client's address.
    pub addr: String,
}

/// The cookie of an owner's lock.
fn cookie(owner: &str) -> String {
    format!("spoold {owner}")
}

/// An image's lock as this process holds it: the count of its claims.
#[derive(Debug)]
pub(super) struct Fence {
    image: Arc<Image>,
    path: PathBuf,
    claims: Mutex<usize>,
    /// Addresses of earlier processes' cluster clients this process blocklisted already.
    fenced: Mutex<Vec<String>>,
}

impl Fence {
    pub(super) fn new(image: Arc<Image>, path: PathBuf) -> Arc<Fence> {
        Arc::new(Fence {
            image,
            path,
            claims: Mutex::new(0),
            fenced: Mutex::new(Vec::new()),
        })
    }

    /// Claims the image for `owner` (one spoold). With `trusted`, the caller knows this owner
    /// already holds it (a session continued from a process that had claimed it) and only
    /// counts the claim. Otherwise it takes the lock, or finds it held under `owner`'s
    /// cookie (by a process of the same spoold that was killed); while another owner holds
    /// it, it asks again every 20 ms for up to `wait`, then fails naming the holder.
    ///
    /// A trusted first claim fences the predecessor in the background: the lock stays the
    /// killed or upgraded predecessor's (under this owner's cookie, so it is ours), and that
    /// process's cluster client is blocklisted, so a process that is not quite dead can
    /// never write again. The restart does not wait for it, and giving the lock back later
    /// does not blocklist again.
    pub(super) fn claim(
        self: &Arc<Self>,
        owner: &str,
        trusted: bool,
        wait: Duration,
    ) -> Result<()> {
        let cookie = cookie(owner);
        let mut count = self.claims.lock().unwrap_or_else(|p| p.into_inner());
        if *count > 0 {
            *count += 1;
            return Ok(());
        }
        if trusted {
            self.enlist(&cookie);
            *count = 1;
            self.take_over_later(&cookie);
            return Ok(());
        }
        let deadline = Instant::now() + wait;
        loop {
            if self.try_lock(&cookie)? {
                // Records an earlier claim of this owner left (processes that are gone) are
                // fenced by the next take-over; no thread of ours may hold the image past a
                // graceful stop (it must close for its watch to leave the cluster).
                self.enlist(&cookie);
                *count = 1;
                return Ok(());
            }
            let lockers = self.lockers()?;
            if lockers.iter().any(|l| l.cookie == cookie) {
                self.enlist(&cookie);
                *count = 1;
                self.take_over_later(&cookie);
                return Ok(());
            }
            match lockers.into_iter().next() {
                Some(other) if Instant::now() >= deadline => {
                    return Err(Error::Invalid {
                        path: self.path.display().to_string(),
                        msg: format!(
                            "served by another host: {} ({} at {}) holds the image's lock; \
                             if that host is gone for good, remove the lock with `rbd lock rm`",
                            other.cookie, other.client, other.addr
                        ),
                    })
                }
                // Given back between the two calls: at once again.
                None => continue,
                Some(_) => std::thread::sleep(RETRY),
            }
        }
    }

    fn take_over_later(self: &Arc<Self>, cookie: &str) {
        let (me, cookie) = (self.clone(), cookie.to_string());
        let _ = std::thread::Builder::new()
            .name("rbd-fence".into())
            .spawn(move || me.take_over(&cookie));
    }

    /// Gives back one claim of `owner`; the last one removes the lock, whichever process of
    /// this owner took it. A lock an earlier process of this owner took (a killed or
    /// upgraded worker) is broken, and that process's cluster client blocklisted first, so
    /// that it can never write again.
    pub(super) fn release_claim(&self, owner: &str) -> Result<()> {
        let mut count = self.claims.lock().unwrap_or_else(|p| p.into_inner());
        if *count == 0 {
            return Ok(());
        }
        *count -= 1;
        if *count > 0 {
            return Ok(());
        }
        let cookie = cookie(owner);
        let (oid, name, c) = (self.header()?, cs(LOCK_NAME), self.cstr("cookie", &cookie)?);
        // SAFETY: the image's I/O context and NUL-terminated strings.
        let r = unsafe {
            (ffi::loaded().rados_unlock)(self.image.ioctx, oid.as_ptr(), name.as_ptr(), c.as_ptr())
        };
        if r == 0 {
            return Ok(());
        }
        if r != -libc::ENOENT {
            return Err(self.err("unlock the RBD image", r));
        }
        for l in self.lockers()?.into_iter().filter(|l| l.cookie == cookie) {
            self.break_lock(&l, &cookie)?;
        }
        Ok(())
    }

    /// Fences the earlier process of the same owner that holds the lock
    /// (see [`Fence::claim`]); nothing if every claim was given back meanwhile.
    fn take_over(&self, cookie: &str) {
        let count = self.claims.lock().unwrap_or_else(|p| p.into_inner());
        if *count == 0 {
            return;
        }
        // The lock stays as it is (under this owner's cookie): breaking it to take it again
        // would leave it free for a moment, and another host waiting for it would get in.
        let holders = (|| -> Result<Vec<Locker>> {
            if self.try_lock(cookie)? {
                return Ok(Vec::new());
            }
            Ok(self
                .lockers()?
                .into_iter()
                .filter(|l| l.cookie == cookie)
                .collect())
        })();
        drop(count);
        // Not under the claims' lock: blocklisting is a monitor command (it makes a new OSD
        // map), and a claim given back meanwhile (a migration's drain) must not wait for it.
        let r = holders.and_then(|holders| {
            for l in &holders {
                self.blocklist(&l.addr, &l.client);
            }
            Ok(holders.len() + self.fence_enlisted(cookie)?)
        });
        match r {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(image = %self.path.display(), fenced = n, "fenced the earlier process of this spoold holding the image's lock (its cluster client blocklisted)")
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot fence the earlier process holding the image's lock; the lock is given back all the same")
            }
        }
    }

    /// This process's cluster client address (as `rados_list_lockers` and the blocklist
    /// write it).
    fn own_addr(&self) -> Option<String> {
        let mut p: *mut c_char = std::ptr::null_mut();
        // SAFETY: a connected cluster; librados allocates the string, freed below.
        let r = unsafe { (ffi::loaded().rados_getaddrs)(self.image.cluster.handle, &mut p) };
        if r < 0 || p.is_null() {
            return None;
        }
        // SAFETY: a NUL-terminated string librados allocated, read once and then freed.
        let s = unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: allocated by librados for the caller to free.
        unsafe { (ffi::loaded().rados_buffer_free)(p) };
        // An address vector prints as `[v2:ADDR,v1:ADDR]`; a client has one legacy address.
        let s = s.trim_matches(|c| c == '[' || c == ']');
        let a = s.split(',').next()?.trim();
        Some(
            a.strip_prefix("v1:")
                .or(a.strip_prefix("any:"))
                .unwrap_or(a)
                .to_string(),
        )
    }

    /// Records, before this process serves the image for `cookie`, that it does: an
    /// attribute `spoold.served_by.ADDRESS` = cookie on the header object. The lock stays
    /// with the process that first took it (breaking it to take it again would free it for a
    /// moment), so the lock alone names only that one; the records name every later process
    /// of the owner, and the next one to take over blocklists them all
    /// ([`Self::fence_enlisted`]): a worker killed at any point never writes after its
    /// successor. One cluster round trip in a takeover's stall, waited for at most
    /// [`ENLIST_WAIT`]: a cluster that does not answer must not hold a restart.
    fn enlist(&self, cookie: &str) {
        let r = (|| -> Result<()> {
            let me = self.own_addr().ok_or_else(|| Error::Invalid {
                path: self.path.display().to_string(),
                msg: "cannot tell this process's cluster address".into(),
            })?;
            let (oid, name) = (
                self.header()?,
                self.cstr("attribute", &format!("{SERVED_BY}{me}"))?,
            );
            let f = ffi::loaded();
            let mut c: ffi::rados_completion_t = std::ptr::null_mut();
            // SAFETY: an out-pointer to a local; no callback.
            let r = unsafe { (f.rados_aio_create_completion2)(std::ptr::null_mut(), None, &mut c) };
            if r < 0 {
                return Err(self.err("record this process on the RBD image", r));
            }
            // SAFETY: the image's I/O context, a live completion, NUL-terminated names and
            // `cookie`'s bytes for its length (librados copies name and value when the call
            // is made).
            let r = unsafe {
                (f.rados_aio_setxattr)(
                    self.image.ioctx,
                    oid.as_ptr(),
                    c,
                    name.as_ptr(),
                    cookie.as_ptr() as *const c_char,
                    cookie.len(),
                )
            };
            // A cluster that does not answer (an OSD down) must not hold a restart: the
            // record goes on in the background past ENLIST_WAIT.
            let deadline = Instant::now() + ENLIST_WAIT;
            // SAFETY: `c` is the live completion made above (released only below).
            let complete = || unsafe { (f.rados_aio_is_complete)(c) } != 0;
            while r == 0 && !complete() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(100));
            }
            let done = r == 0 && complete();
            let r = if done {
                // SAFETY: as above; the operation is complete.
                unsafe { (f.rados_aio_get_return_value)(c) }
            } else {
                r
            };
            // Released even while in flight: librados frees it once the operation is done.
            // SAFETY: the completion made above, released once; not used afterwards.
            unsafe { (f.rados_aio_release)(c) };
            if r < 0 {
                return Err(self.err("record this process on the RBD image", r));
            }
            if !done {
                tracing::warn!(image = %self.path.display(), "the cluster did not record this worker in time; serving anyway (a kill now may leave it unfenced)");
            }
            Ok(())
        })();
        if let Err(e) = r {
            tracing::warn!(error = %e, "a worker killed from now on may not be fenced by the next one");
        }
    }

    /// Blocklists every other process recorded as serving the image for `cookie`
    /// ([`Self::enlist`]; only one process of an owner lives at a time, so the others are
    /// gone or going) and removes its record. Returns how many were fenced.
    fn fence_enlisted(&self, cookie: &str) -> Result<usize> {
        let me = self.own_addr().unwrap_or_default();
        let oid = self.header()?;
        let mut fenced = 0;
        for addr in self.enlisted(cookie)? {
            if addr == me {
                continue;
            }
            self.blocklist(&addr, "an earlier worker");
            fenced += 1;
            let name = self.cstr("attribute", &format!("{SERVED_BY}{addr}"))?;
            // SAFETY: the image's I/O context and NUL-terminated names.
            unsafe { (ffi::loaded().rados_rmxattr)(self.image.ioctx, oid.as_ptr(), name.as_ptr()) };
        }
        Ok(fenced)
    }

    /// The addresses recorded as serving the image for `cookie`.
    fn enlisted(&self, cookie: &str) -> Result<Vec<String>> {
        let oid = self.header()?;
        let f = ffi::loaded();
        let mut it: ffi::rados_xattrs_iter_t = std::ptr::null_mut();
        // SAFETY: the image's I/O context, a NUL-terminated name, an out-pointer to a local.
        let r = unsafe { (f.rados_getxattrs)(self.image.ioctx, oid.as_ptr(), &mut it) };
        if r < 0 {
            return Err(self.err("list the RBD image's attributes", r));
        }
        let mut out = Vec::new();
        loop {
            let (mut name, mut val, mut len): (*const c_char, *const c_char, usize) =
                (std::ptr::null(), std::ptr::null(), 0);
            // SAFETY: a live iterator; librados points `name`/`val` at its own buffers,
            // valid until the next call, and sets both to null at the end.
            let r = unsafe { (f.rados_getxattrs_next)(it, &mut name, &mut val, &mut len) };
            if r < 0 || name.is_null() {
                break;
            }
            // SAFETY: `name` is NUL-terminated and `val` holds `len` bytes (see above).
            let (n, v) = unsafe {
                (
                    std::ffi::CStr::from_ptr(name)
                        .to_string_lossy()
                        .into_owned(),
                    std::slice::from_raw_parts(val as *const u8, len).to_vec(),
                )
            };
            if let Some(addr) = n.strip_prefix(SERVED_BY) {
                if v == cookie.as_bytes() {
                    out.push(addr.to_string());
                }
            }
        }
        // SAFETY: the iterator from `rados_getxattrs`, ended once.
        unsafe { (f.rados_getxattrs_end)(it) };
        Ok(out)
    }

    /// One attempt at the lock: whether this client holds it now.
    fn try_lock(&self, cookie: &str) -> Result<bool> {
        let (oid, name, c) = (self.header()?, cs(LOCK_NAME), self.cstr("cookie", cookie)?);
        let desc = cs("spoold serves this image");
        // SAFETY: the image's I/O context and NUL-terminated strings; no duration.
        let r = unsafe {
            (ffi::loaded().rados_lock_exclusive)(
                self.image.ioctx,
                oid.as_ptr(),
                name.as_ptr(),
                c.as_ptr(),
                desc.as_ptr(),
                std::ptr::null_mut(),
                0,
            )
        };
        match r {
            0 => Ok(true),
            r if r == -libc::EEXIST => Ok(true),
            r if r == -libc::EBUSY => Ok(false),
            r => Err(self.err("lock the RBD image", r)),
        }
    }

    /// Blocklists the cluster client at `at` (`client`: who it is, for the log), an earlier
    /// process of this owner, once per process, so that it can never write again.
    fn blocklist(&self, at: &str, client: &str) {
        let mut fenced = self.fenced.lock().unwrap_or_else(|p| p.into_inner());
        if fenced.iter().any(|a| a == at) {
            return;
        }
        let Ok(addr) = self.cstr("locker address", at) else {
            return;
        };
        let mut addr = addr.into_bytes_with_nul();
        // SAFETY: a connected cluster and a NUL-terminated address in a buffer we own (the
        // C API takes it as mutable; it does not write it).
        let r = unsafe {
            (ffi::loaded().rados_blocklist_add)(
                self.image.cluster.handle,
                addr.as_mut_ptr() as *mut c_char,
                BLOCKLIST_S,
            )
        };
        if r < 0 {
            tracing::warn!(image = %self.path.display(), client = %client, "cannot blocklist an earlier process that served the image: {}", std::io::Error::from_raw_os_error(-r));
        } else {
            fenced.push(at.to_string());
        }
    }

    /// Blocklists the lock holder `l` (another process of this owner) unless done already,
    /// and breaks its lock.
    fn break_lock(&self, l: &Locker, cookie: &str) -> Result<()> {
        self.blocklist(&l.addr, &l.client);
        let (oid, name, c) = (self.header()?, cs(LOCK_NAME), self.cstr("cookie", cookie)?);
        let client = self.cstr("lock client", &l.client)?;
        // SAFETY: the image's I/O context and NUL-terminated strings.
        let r = unsafe {
            (ffi::loaded().rados_break_lock)(
                self.image.ioctx,
                oid.as_ptr(),
                name.as_ptr(),
                client.as_ptr(),
                c.as_ptr(),
            )
        };
        if r < 0 && r != -libc::ENOENT {
            return Err(self.err("break the RBD image's lock", r));
        }
        Ok(())
    }

    /// Who holds the image's advisory lock.
    fn lockers(&self) -> Result<Vec<Locker>> {
        let (oid, name) = (self.header()?, cs(LOCK_NAME));
        let mut lens = [256usize; 4];
        for _ in 0..8 {
            let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n.max(1)]).collect();
            let mut exclusive = 0;
            let [tag, clients, cookies, addrs] = &mut bufs[..] else {
                unreachable!("four buffers")
            };
            let [tl, cl, kl, al] = &mut lens;
            // SAFETY: the image's I/O context, NUL-terminated names; every buffer is as long
            // as the length passed with it, which librados reads and updates (to the size
            // needed, with -ERANGE).
            let r = unsafe {
                (ffi::loaded().rados_list_lockers)(
                    self.image.ioctx,
                    oid.as_ptr(),
                    name.as_ptr(),
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
                return Err(self.err("list the RBD image's lockers", r as i32));
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

    /// The image's header object, which carries its advisory lock (`rbd_header.ID`).
    fn header(&self) -> Result<CString> {
        let mut id = [0u8; 64];
        // SAFETY: an open image and a buffer of the length passed.
        let r = unsafe {
            (ffi::loaded().rbd_get_id)(self.image.handle, id.as_mut_ptr() as *mut c_char, id.len())
        };
        if r < 0 {
            return Err(self.err("read the RBD image's id (a format 2 image)", r));
        }
        let id = id.split(|&c| c == 0).next().unwrap_or_default();
        self.cstr(
            "image id",
            &format!("rbd_header.{}", String::from_utf8_lossy(id)),
        )
    }

    fn err(&self, what: &'static str, r: i32) -> Error {
        Error::io(&self.path, what, std::io::Error::from_raw_os_error(-r))
    }

    fn cstr(&self, what: &str, s: &str) -> Result<CString> {
        super::cstring(&self.path, what, s)
    }
}

/// A constant as a C string.
fn cs(s: &str) -> CString {
    CString::new(s).unwrap_or_default()
}
