//! The part of librados' and librbd's C API the RBD backend uses, declared by hand from
//! Debian's librados-dev / librbd-dev headers (`rados/librados.h`, `rbd/librbd.h`, Ceph 16)
//! and loaded at run time (`librados.so.2`, `librbd.so.1`, through `libloading`): spoold
//! builds and runs without Ceph installed, and only an `rbd:` device needs the libraries.
//!
//! Must not know: anything but the C signatures and the libraries' names.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

pub type rados_t = *mut c_void;
pub type rados_ioctx_t = *mut c_void;
pub type rados_xattrs_iter_t = *mut c_void;
pub type rados_completion_t = *mut c_void;
pub type rados_callback_t = Option<extern "C" fn(rados_completion_t, *mut c_void)>;
pub type rbd_image_t = *mut c_void;
pub type rbd_completion_t = *mut c_void;
pub type rbd_callback_t = extern "C" fn(rbd_completion_t, *mut c_void);
type iovec = libc::iovec;

/// `rbd_snap_info_t`: one snapshot of an image.
#[repr(C)]
pub struct rbd_snap_info_t {
    pub id: u64,
    pub size: u64,
    pub name: *const c_char,
}

/// `RBD_FEATURE_LAYERING`: the only feature images spoold creates have (no exclusive-lock:
/// a worker restarted after a crash must not wait for the dead one's lock to time out).
pub const RBD_FEATURE_LAYERING: u64 = 1;

macro_rules! api {
    ($($lib:literal => { $(fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)* })*) => {
        /// The loaded functions (kept with their libraries for the life of the process).
        pub struct Api {
            $($(pub $name: unsafe extern "C" fn($($ty),*) -> $ret,)*)*
            _libs: Vec<libloading::Library>,
        }

        fn load() -> Result<Api, LoadError> {
            let mut libs = Vec::new();
            $(
                // SAFETY: loading a system library runs its initializers; librados and
                // librbd are the distribution's, made to be loaded by any process.
                let lib = unsafe { libloading::Library::new($lib) }
                    .map_err(|why| LoadError::Library { lib: $lib, why })?;
                $(
                    // SAFETY: the symbol has the C signature declared here (the library's
                    // header); the pointer stays valid while `lib` is loaded, which is as
                    // long as `Api` lives (it keeps the library).
                    let $name = *unsafe {
                        lib.get::<unsafe extern "C" fn($($ty),*) -> $ret>(
                            concat!(stringify!($name), "\0").as_bytes(),
                        )
                    }
                    .map_err(|why| LoadError::Symbol { lib: $lib, why })?;
                )*
                libs.push(lib);
            )*
            Ok(Api { $($($name,)*)* _libs: libs })
        }
    };
}

api! {
    "librados.so.2" => {
        fn rados_create2(cluster: *mut rados_t, clustername: *const c_char, name: *const c_char, flags: u64) -> c_int;
        fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
        fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
        fn rados_connect(cluster: rados_t) -> c_int;
        fn rados_shutdown(cluster: rados_t) -> ();
        fn rados_ioctx_create(cluster: rados_t, pool_name: *const c_char, ioctx: *mut rados_ioctx_t) -> c_int;
        fn rados_ioctx_destroy(io: rados_ioctx_t) -> ();
        fn rados_lock_exclusive(io: rados_ioctx_t, oid: *const c_char, name: *const c_char, cookie: *const c_char, desc: *const c_char, duration: *mut libc::timeval, flags: u8) -> c_int;
        fn rados_unlock(io: rados_ioctx_t, oid: *const c_char, name: *const c_char, cookie: *const c_char) -> c_int;
        fn rados_break_lock(io: rados_ioctx_t, oid: *const c_char, name: *const c_char, client: *const c_char, cookie: *const c_char) -> c_int;
        fn rados_list_lockers(io: rados_ioctx_t, oid: *const c_char, name: *const c_char, exclusive: *mut c_int, tag: *mut c_char, tag_len: *mut usize, clients: *mut c_char, clients_len: *mut usize, cookies: *mut c_char, cookies_len: *mut usize, addrs: *mut c_char, addrs_len: *mut usize) -> isize;
        fn rados_blocklist_add(cluster: rados_t, client_address: *mut c_char, expire_seconds: u32) -> c_int;
        fn rados_getaddrs(cluster: rados_t, addrs: *mut *mut c_char) -> c_int;
        fn rados_buffer_free(buf: *mut c_char) -> ();
        fn rados_aio_create_completion2(cb_arg: *mut c_void, cb_complete: rados_callback_t, pc: *mut rados_completion_t) -> c_int;
        fn rados_aio_setxattr(io: rados_ioctx_t, o: *const c_char, completion: rados_completion_t, name: *const c_char, buf: *const c_char, len: usize) -> c_int;
        fn rados_aio_is_complete(c: rados_completion_t) -> c_int;
        fn rados_aio_get_return_value(c: rados_completion_t) -> c_int;
        fn rados_aio_release(c: rados_completion_t) -> ();
        fn rados_rmxattr(io: rados_ioctx_t, o: *const c_char, name: *const c_char) -> c_int;
        fn rados_getxattrs(io: rados_ioctx_t, oid: *const c_char, iter: *mut rados_xattrs_iter_t) -> c_int;
        fn rados_getxattrs_next(iter: rados_xattrs_iter_t, name: *mut *const c_char, val: *mut *const c_char, len: *mut usize) -> c_int;
        fn rados_getxattrs_end(iter: rados_xattrs_iter_t) -> ();
    }
    "librbd.so.1" => {
        fn rbd_create2(io: rados_ioctx_t, name: *const c_char, size: u64, features: u64, order: *mut c_int) -> c_int;
        fn rbd_open(io: rados_ioctx_t, name: *const c_char, image: *mut rbd_image_t, snap_name: *const c_char) -> c_int;
        fn rbd_close(image: rbd_image_t) -> c_int;
        fn rbd_remove(io: rados_ioctx_t, name: *const c_char) -> c_int;
        fn rbd_resize(image: rbd_image_t, size: u64) -> c_int;
        fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
        fn rbd_read2(image: rbd_image_t, ofs: u64, len: usize, buf: *mut c_char, op_flags: c_int) -> isize;
        fn rbd_write2(image: rbd_image_t, ofs: u64, len: usize, buf: *const c_char, op_flags: c_int) -> isize;
        fn rbd_flush(image: rbd_image_t) -> c_int;
        fn rbd_write_zeroes(image: rbd_image_t, ofs: u64, len: usize, zero_flags: c_int, op_flags: c_int) -> isize;
        fn rbd_aio_create_completion(cb_arg: *mut c_void, complete_cb: rbd_callback_t, c: *mut rbd_completion_t) -> c_int;
        fn rbd_aio_get_return_value(c: rbd_completion_t) -> isize;
        fn rbd_aio_release(c: rbd_completion_t) -> ();
        fn rbd_aio_readv(image: rbd_image_t, iov: *const iovec, iovcnt: c_int, off: u64, c: rbd_completion_t) -> c_int;
        fn rbd_aio_writev(image: rbd_image_t, iov: *const iovec, iovcnt: c_int, off: u64, c: rbd_completion_t) -> c_int;
        fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
        fn rbd_aio_discard(image: rbd_image_t, off: u64, len: u64, c: rbd_completion_t) -> c_int;
        fn rbd_aio_write_zeroes(image: rbd_image_t, off: u64, len: usize, c: rbd_completion_t, zero_flags: c_int, op_flags: c_int) -> c_int;
        fn rbd_get_id(image: rbd_image_t, id: *mut c_char, id_len: usize) -> c_int;
        fn rbd_snap_create(image: rbd_image_t, snapname: *const c_char) -> c_int;
        fn rbd_snap_remove(image: rbd_image_t, snapname: *const c_char) -> c_int;
        fn rbd_snap_rollback(image: rbd_image_t, snapname: *const c_char) -> c_int;
        fn rbd_snap_list(image: rbd_image_t, snaps: *mut rbd_snap_info_t, max_snaps: *mut c_int) -> c_int;
        fn rbd_snap_list_end(snaps: *mut rbd_snap_info_t) -> ();
        fn rbd_snap_get_timestamp(image: rbd_image_t, snap_id: u64, timestamp: *mut libc::timespec) -> c_int;
        fn rbd_snap_protect(image: rbd_image_t, snap_name: *const c_char) -> c_int;
        fn rbd_snap_unprotect(image: rbd_image_t, snap_name: *const c_char) -> c_int;
        fn rbd_snap_is_protected(image: rbd_image_t, snap_name: *const c_char, is_protected: *mut c_int) -> c_int;
        fn rbd_clone(p_ioctx: rados_ioctx_t, p_name: *const c_char, p_snapname: *const c_char, c_ioctx: rados_ioctx_t, c_name: *const c_char, features: u64, c_order: *mut c_int) -> c_int;
        fn rbd_flatten(image: rbd_image_t) -> c_int;
    }
}

/// Why librados or librbd cannot be used: the library, or the function of it, that is
/// missing.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot load {lib} (install Debian's librbd1): {why}")]
    Library {
        lib: &'static str,
        why: libloading::Error,
    },
    #[error("{lib}: {why}")]
    Symbol {
        lib: &'static str,
        why: libloading::Error,
    },
}

/// The libraries, loaded on first use (an error names what is missing).
pub fn api() -> Result<&'static Api, &'static LoadError> {
    static API: OnceLock<Result<Api, LoadError>> = OnceLock::new();
    API.get_or_init(load).as_ref()
}

/// The libraries of an image that exists (so they were loaded).
pub fn loaded() -> &'static Api {
    match api() {
        Ok(a) => a,
        Err(_) => unreachable!("an RBD handle exists only once the libraries loaded"),
    }
}
