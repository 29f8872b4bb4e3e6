//! Option haggling: which export, structured replies, which meta contexts; ends with the
//! transmission phase starting (`NBD_OPT_GO`, `NBD_OPT_EXPORT_NAME`) or the client leaving.
//!
//! Owns: the options and their replies. Must not know: how data is read.

use std::io::{self, Read, Write};

use crate::proto::*;
use crate::Export;

/// The meta context ids this server gives.
pub const ALLOCATION_ID: u32 = 1;
pub const DIRTY_ID: u32 = 2;

/// What a connection negotiated.
#[derive(Debug, Default)]
pub struct Session {
    pub structured: bool,
    /// The meta contexts chosen, by id.
    pub contexts: Vec<u32>,
}

fn flags(e: &dyn Export) -> u16 {
    let base = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_CAN_MULTI_CONN | TFLAG_SEND_CACHE;
    match e.writable() {
        true if e.offers_write_zeroes() => base | TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES,
        true => base | TFLAG_SEND_TRIM,
        false => base | TFLAG_READ_ONLY,
    }
}

fn dirty_name(e: &dyn Export) -> Option<String> {
    e.base().map(|b| format!("qemu:dirty-bitmap:{b}"))
}

/// Whether `name` asks for this export (the empty name is the default export, unless the
/// export has a secret name: then only that, compared in constant time).
fn ours(e: &dyn Export, name: &str) -> bool {
    match e.secret() {
        Some(secret) => {
            let (a, b) = (name.as_bytes(), secret.as_bytes());
            let differ = (a.iter().zip(b)).fold(0u8, |acc, (x, y)| acc | (x ^ y));
            a.len() == b.len() && differ == 0
        }
        None => name.is_empty() || name == e.name(),
    }
}

/// Runs the option phase: `Some` when transmission starts, `None` when the client aborted.
pub fn run(
    r: &mut impl Read,
    w: &mut impl Write,
    e: &dyn Export,
    no_zeroes: bool,
) -> io::Result<Option<Session>> {
    let mut sess = Session::default();
    loop {
        let (opt, data) = read_option(r)?;
        match opt {
            OPT_EXPORT_NAME => {
                // No reply on failure is possible here: the connection just closes.
                if !ours(e, &String::from_utf8_lossy(&data)) {
                    return Ok(None);
                }
                w.write_all(&e.size().to_be_bytes())?;
                w.write_all(&flags(e).to_be_bytes())?;
                if !no_zeroes {
                    w.write_all(&[0u8; 124])?;
                }
                w.flush()?;
                return Ok(Some(sess));
            }
            OPT_ABORT => {
                option_reply(w, opt, REP_ACK, &[])?;
                w.flush()?;
                return Ok(None);
            }
            OPT_LIST => {
                // An export with a secret name is not listed: its users were told the name.
                if e.secret().is_none() {
                    let mut d = (e.name().len() as u32).to_be_bytes().to_vec();
                    d.extend_from_slice(e.name().as_bytes());
                    option_reply(w, opt, REP_SERVER, &d)?;
                }
                option_reply(w, opt, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                if info(w, e, opt, &data)? && opt == OPT_GO {
                    w.flush()?;
                    return Ok(Some(sess));
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    option_reply(w, opt, REP_ERR_INVALID, b"no payload expected")?;
                } else {
                    sess.structured = true;
                    option_reply(w, opt, REP_ACK, &[])?;
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                meta(w, e, opt, &data, &mut sess)?;
            }
            _ => option_reply(w, opt, REP_ERR_UNSUP, b"option not supported")?,
        }
        w.flush()?;
    }
}

/// `NBD_OPT_INFO`/`NBD_OPT_GO`: true when the export was found and described.
fn info(w: &mut impl Write, e: &dyn Export, opt: u32, data: &[u8]) -> io::Result<bool> {
    let Some((name, at)) = string_at(data, 0) else {
        option_reply(w, opt, REP_ERR_INVALID, b"malformed request")?;
        return Ok(false);
    };
    let Some(n) = u16_at(data, at) else {
        option_reply(w, opt, REP_ERR_INVALID, b"malformed request")?;
        return Ok(false);
    };
    if data.len() != at + 2 + 2 * n as usize {
        option_reply(w, opt, REP_ERR_INVALID, b"malformed request")?;
        return Ok(false);
    }
    if !ours(e, &name) {
        option_reply(w, opt, REP_ERR_UNKNOWN, b"no such export")?;
        return Ok(false);
    }
    let wants_sizes =
        (0..n as usize).any(|i| u16_at(data, at + 2 + 2 * i) == Some(INFO_BLOCK_SIZE));
    let mut d = INFO_EXPORT.to_be_bytes().to_vec();
    d.extend_from_slice(&e.size().to_be_bytes());
    d.extend_from_slice(&flags(e).to_be_bytes());
    option_reply(w, opt, REP_INFO, &d)?;
    if wants_sizes {
        let mut d = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&4096u32.to_be_bytes());
        d.extend_from_slice(&MAX_READ.to_be_bytes());
        option_reply(w, opt, REP_INFO, &d)?;
    }
    option_reply(w, opt, REP_ACK, &[])?;
    Ok(true)
}

/// The contexts a query names: `base:allocation`, `qemu:dirty-bitmap:BASE`, or a prefix
/// (`base:`, `qemu:`, `qemu:dirty-bitmap:`) when listing.
fn matching(e: &dyn Export, query: &str, listing: bool) -> Vec<(u32, String)> {
    let mut all = vec![(ALLOCATION_ID, "base:allocation".to_string())];
    all.extend(dirty_name(e).map(|n| (DIRTY_ID, n)));
    all.into_iter()
        .filter(|(_, n)| {
            n == query
                || (listing && (query.is_empty() || query.ends_with(':') && n.starts_with(query)))
        })
        .collect()
}

fn meta(
    w: &mut impl Write,
    e: &dyn Export,
    opt: u32,
    data: &[u8],
    sess: &mut Session,
) -> io::Result<()> {
    let listing = opt == OPT_LIST_META_CONTEXT;
    if !listing && !sess.structured {
        return option_reply(w, opt, REP_ERR_INVALID, b"structured replies first");
    }
    let parsed = (|| {
        let (name, mut at) = string_at(data, 0)?;
        let n = u32_at(data, at)?;
        at += 4;
        let mut queries = Vec::new();
        for _ in 0..n {
            let (q, next) = string_at(data, at)?;
            queries.push(q);
            at = next;
        }
        (at == data.len()).then_some((name, queries))
    })();
    let Some((name, queries)) = parsed else {
        return option_reply(w, opt, REP_ERR_INVALID, b"malformed request");
    };
    if !ours(e, &name) {
        return option_reply(w, opt, REP_ERR_UNKNOWN, b"no such export");
    }
    if queries.iter().any(|q| q.len() > 4096) {
        return option_reply(w, opt, REP_ERR_TOO_BIG, b"query too long");
    }
    let mut chosen: Vec<(u32, String)> = Vec::new();
    let queries = if listing && queries.is_empty() {
        vec![String::new()]
    } else {
        queries
    };
    for q in &queries {
        for c in matching(e, q, listing) {
            if !chosen.contains(&c) {
                chosen.push(c);
            }
        }
    }
    for (id, n) in &chosen {
        let mut d = id.to_be_bytes().to_vec();
        d.extend_from_slice(n.as_bytes());
        option_reply(w, opt, REP_META_CONTEXT, &d)?;
    }
    if !listing {
        sess.contexts = chosen.iter().map(|c| c.0).collect();
    }
    option_reply(w, opt, REP_ACK, &[])
}
