//! The NBD wire protocol's numbers and the framing of its messages (doc/proto.md of the NBD
//! project).
//!
//! Owns: constants, reading options and requests, writing replies. Must not know: exports.

use std::io::{self, Read, Write};

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

pub const FLAG_FIXED_NEWSTYLE: u16 = 1;
pub const FLAG_NO_ZEROES: u16 = 2;
pub const CLIENT_NO_ZEROES: u32 = 2;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

pub const INFO_EXPORT: u16 = 0;
pub const INFO_BLOCK_SIZE: u16 = 3;

pub const TFLAG_HAS_FLAGS: u16 = 1;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

pub const REPLY_FLAG_DONE: u16 = 1;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

pub const STATE_HOLE: u32 = 1;
pub const STATE_ZERO: u32 = 2;
pub const STATE_DIRTY: u32 = 1;

pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;
pub const EOVERFLOW: u32 = 75;

/// The longest option payload accepted (names, queries): anything larger is refused.
pub const MAX_OPTION: u32 = 64 << 10;
/// The largest read or write served in one request (advertised as the maximum block size;
/// clients split larger ones). It bounds what one connection holds in memory.
pub const MAX_READ: u32 = 8 << 20;

pub fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

pub fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// A length-prefixed (u32) string at `at`: the string and where the next field starts.
pub fn string_at(b: &[u8], at: usize) -> Option<(String, usize)> {
    let n = u32_at(b, at)? as usize;
    let s = b.get(at + 4..(at + 4).checked_add(n)?)?;
    Some((String::from_utf8_lossy(s).into_owned(), at + 4 + n))
}

/// An option from the client: its number and payload.
pub fn read_option(r: &mut impl Read) -> io::Result<(u32, Vec<u8>)> {
    read_option_up_to(r, MAX_OPTION)
}

/// [`read_option`] with a payload of at most `max` bytes.
pub fn read_option_up_to(r: &mut impl Read, max: u32) -> io::Result<(u32, Vec<u8>)> {
    let mut h = [0u8; 16];
    r.read_exact(&mut h)?;
    if u64::from_be_bytes(h[0..8].try_into().expect("8 bytes")) != IHAVEOPT {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "bad option magic",
        ));
    }
    let opt = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "option too long",
        ));
    }
    let mut data = vec![0u8; len as usize];
    r.read_exact(&mut data)?;
    Ok((opt, data))
}

pub fn option_reply(w: &mut impl Write, opt: u32, kind: u32, data: &[u8]) -> io::Result<()> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    w.write_all(&b)
}

/// A request of the transmission phase.
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
}

pub fn read_request(r: &mut impl Read) -> io::Result<Request> {
    let mut h = [0u8; 28];
    r.read_exact(&mut h)?;
    if u32_at(&h, 0) != Some(REQUEST_MAGIC) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "bad request magic",
        ));
    }
    Ok(Request {
        flags: u16_at(&h, 4).expect("in the header"),
        kind: u16_at(&h, 6).expect("in the header"),
        cookie: u64::from_be_bytes(h[8..16].try_into().expect("8 bytes")),
        offset: u64::from_be_bytes(h[16..24].try_into().expect("8 bytes")),
        len: u32_at(&h, 24).expect("in the header"),
    })
}

pub fn simple_reply(w: &mut impl Write, cookie: u64, error: u32, data: &[u8]) -> io::Result<()> {
    let mut b = Vec::with_capacity(16 + data.len());
    b.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&error.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(data);
    w.write_all(&b)
}

pub fn chunk(
    w: &mut impl Write,
    cookie: u64,
    flags: u16,
    kind: u16,
    payload: &[u8],
) -> io::Result<()> {
    chunk_header(w, cookie, flags, kind, payload.len())?;
    w.write_all(payload)
}

/// A structured reply chunk's header; its `len` bytes of payload follow.
pub fn chunk_header(
    w: &mut impl Write,
    cookie: u64,
    flags: u16,
    kind: u16,
    len: usize,
) -> io::Result<()> {
    let mut b = Vec::with_capacity(20);
    b.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&(len as u32).to_be_bytes());
    w.write_all(&b)
}

/// An error chunk (structured) ending the reply.
pub fn error_chunk(w: &mut impl Write, cookie: u64, error: u32, msg: &str) -> io::Result<()> {
    let mut p = Vec::new();
    p.extend_from_slice(&error.to_be_bytes());
    p.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    p.extend_from_slice(msg.as_bytes());
    chunk(w, cookie, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, &p)
}
