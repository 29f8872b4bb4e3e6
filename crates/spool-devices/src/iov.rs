//! Splitting a request's iovec array at byte offsets: a request that spans pieces on
//! several devices (a mirror's legs, a thin volume's chunks) goes out as one piece per
//! device piece, each with its own iovec array.
//!
//! Owns: nothing but the arithmetic. Must not know: legs, chunks, devices.

use crate::IoVec;

/// The part `[at, at + n)` of the bytes `iov` describes, as its own iovec array.
pub fn split_iov(iov: &[IoVec], mut at: u64, mut n: u64) -> Box<[IoVec]> {
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
