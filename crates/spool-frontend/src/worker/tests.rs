use super::dispatch::slice_iov;
use spool_devices::IoVec;

#[test]
fn slice_iov_splits_across_buffers() {
    let v = [
        IoVec {
            iov_base: 0x1000 as *mut _,
            iov_len: 512,
        },
        IoVec {
            iov_base: 0x5000 as *mut _,
            iov_len: 1024,
        },
    ];
    let s = slice_iov(&v, 256, 512);
    assert_eq!(s.len(), 2);
    assert_eq!((s[0].iov_base as usize, s[0].iov_len), (0x1100, 256));
    assert_eq!((s[1].iov_base as usize, s[1].iov_len), (0x5000, 256));
    let s = slice_iov(&v, 512, 1024);
    assert_eq!(s.len(), 1);
    assert_eq!((s[0].iov_base as usize, s[0].iov_len), (0x5000, 1024));
}
