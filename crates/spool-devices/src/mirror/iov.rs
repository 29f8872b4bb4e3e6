//! Splitting a request's iovec array at byte offsets: a request that spans leg pieces on
//! several devices goes out as one piece per leg piece, each with its own iovec array.
//!
//! Owns: nothing but the arithmetic. Must not know: legs, devices.

use crate::IoVec;

/// The part `[at, at + n)` of the bytes `iov` describes, as its own iovec array.
pub(crate) fn split_iov(iov: &[IoVec], mut at: u64, mut n: u64) -> Box<[IoVec]> {
    let mut out = Vec::new();
    for v in iov {
        let l = v.iov_len as u64;
        if at >= l {
            at -= l;
            continue;
        }
        let take = (l - at).min(n);
        out.push(IoVec {
            iov_base: (v.iov_base as usize + at as usize) as *mut libc::c_void,
            iov_len: take as usize,
        });
        n -= take;
        at = 0;
        if n == 0 {
            break;
        }
    }
    out.into_boxed_slice()
}
