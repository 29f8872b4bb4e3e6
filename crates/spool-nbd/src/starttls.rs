//! The server's option phase before TLS (`NBD_OPT_STARTTLS`): a server with TLS answers
//! nothing but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` in the clear (qemu-nbd's
//! `--tls-creds` behaviour: every other option gets `NBD_REP_ERR_TLS_REQD`, and
//! `NBD_OPT_EXPORT_NAME`, which cannot be refused, closes the connection), then the TLS
//! handshake, after which the option phase goes on in the usual way over the encrypted
//! connection.
//!
//! Owns: the options before TLS. Must not know: exports, the options after it.

use std::io::{self, Read};

use std::os::unix::net::UnixStream;
use std::time::Instant;

use crate::proto::*;
use crate::tls::ServerTls;

/// The longest option a client may send before TLS (no option before it carries data).
const MAX_BEFORE_TLS: u32 = 4096;

/// After the greeting and the client's flags were read: options in the clear until the
/// client starts TLS (`Some`: the plaintext end of the encrypted connection) or leaves
/// (`None`). `r` reads `s` within the handshake's deadline `until`.
pub(crate) fn until_tls<S: crate::tls::Pumpable>(
    s: S,
    r: &mut impl Read,
    tls: &ServerTls,
    until: Instant,
) -> io::Result<Option<UnixStream>> {
    let mut w = s;
    loop {
        let (opt, data) = read_option_up_to(r, MAX_BEFORE_TLS)?;
        let len = data.len();
        match opt {
            OPT_STARTTLS if len == 0 => {
                option_reply(&mut w, opt, REP_ACK, &[])?;
                w.flush()?;
                return tls.accept(w, until).map(Some);
            }
            OPT_STARTTLS => option_reply(&mut w, opt, REP_ERR_INVALID, b"no payload expected")?,
            OPT_ABORT => {
                option_reply(&mut w, opt, REP_ACK, &[])?;
                return Ok(None);
            }
            // No reply can refuse it: the connection closes.
            OPT_EXPORT_NAME => return Ok(None),
            _ => option_reply(
                &mut w,
                opt,
                REP_ERR_TLS_REQD,
                b"TLS is required: send NBD_OPT_STARTTLS first",
            )?,
        }
        w.flush()?;
    }
}
