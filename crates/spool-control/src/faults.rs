//! Turning fault-injection params (a `device_inject` call, or a `[[faults]]` entry of the
//! config) into a fault rule: the kinds, their effects and defaults, errnos by number or
//! name, and the checks on op and range.
//!
//! Must not know: the daemon or the config (both call it).

use std::time::Duration;

use spool_devices::{FaultEffect, FaultOps, FaultRule};

use crate::api::{ErrnoArg, FaultKind, InjectParams, SizeValue};
use crate::rpc::RpcError;

/// A size param in bytes; the error names it.
fn size_arg(s: &SizeValue, what: &str) -> Result<u64, RpcError> {
    s.bytes()
        .map_err(|e| RpcError::InvalidParams(format!("{what}: {e}")))
}

/// Errnos that may be given by name.
const NAMED_ERRNOS: [(&str, i32); 10] = [
    ("EIO", libc::EIO),
    ("ENODATA", libc::ENODATA),
    ("EILSEQ", libc::EILSEQ),
    ("ENOLINK", libc::ENOLINK),
    ("ETIMEDOUT", libc::ETIMEDOUT),
    ("ENODEV", libc::ENODEV),
    ("ENXIO", libc::ENXIO),
    ("ENOSPC", libc::ENOSPC),
    ("EINVAL", libc::EINVAL),
    ("EREMOTEIO", libc::EREMOTEIO),
];

/// The errno `v` stands for.
pub fn errno_of(v: &ErrnoArg) -> Result<i32, RpcError> {
    let found = match v {
        ErrnoArg::Number(n) if (1..4096).contains(n) => Some(*n as i32),
        ErrnoArg::Name(s) => NAMED_ERRNOS
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(s))
            .map(|(_, e)| *e),
        _ => None,
    };
    found.ok_or_else(|| {
        RpcError::InvalidParams(format!(
            "errno {v} must be a number 1..4095 or one of {}",
            NAMED_ERRNOS
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
}

/// Kind smart without its byte.
pub fn smart_needs_bits() -> RpcError {
    RpcError::InvalidParams(
        "kind smart needs bits (the critical-warning byte, e.g. 4 = reliability degraded)".into(),
    )
}

/// The kind named in the params.
pub fn kind_of(p: &InjectParams) -> Result<FaultKind, RpcError> {
    FaultKind::parse(&p.kind).ok_or_else(|| {
        RpcError::InvalidParams(format!(
            "kind '{}' must be one of {}",
            p.kind,
            FaultKind::ALL.map(|(_, n)| n).join(", ")
        ))
    })
}

/// The rule `p` asks for on a device of `size` bytes (any kind but smart).
pub fn rule_of(p: &InjectParams, size: u64) -> Result<FaultRule, RpcError> {
    let ops = match p.op.as_deref().unwrap_or("any") {
        "read" => FaultOps::Read,
        "write" => FaultOps::Write,
        "any" => FaultOps::Any,
        "meta-read" => FaultOps::MetaRead,
        "meta-write" => FaultOps::MetaWrite,
        "meta-zero" => FaultOps::MetaZero,
        "meta" => FaultOps::Meta,
        o => {
            return Err(RpcError::InvalidParams(format!(
                "op '{o}' must be read, write or any (the queues' I/O), or meta-read, \
                 meta-write, meta-zero or meta (metadata: pool tables, thin maps, chunk \
                 zeroing and copies)"
            )))
        }
    };
    // (effect, default count, fails the probe)
    let (effect, count, fails_probe) = match kind_of(p)? {
        FaultKind::Media => (FaultEffect::Errno(libc::ENODATA), 0, false),
        FaultKind::Transient => (FaultEffect::Errno(libc::EIO), 1, false),
        FaultKind::LinkDown => (FaultEffect::Errno(libc::EIO), 0, true),
        FaultKind::Timeout => (FaultEffect::Hang, 1, false),
        FaultKind::Stuck => (FaultEffect::Stuck, 1, false),
        FaultKind::Removed => (FaultEffect::Errno(libc::ENODEV), 0, true),
        FaultKind::ResetPanic => (FaultEffect::PanicOnReset, 1, false),
        FaultKind::ResetWedge => (FaultEffect::WedgeOnReset, 1, false),
        // Until cleared: a request that crashes the worker does so in every worker that
        // takes it again (armed from the config, every restarted worker has it too).
        FaultKind::Crash => (FaultEffect::Crash, 0, false),
        FaultKind::Smart => return Err(smart_needs_bits()),
        FaultKind::Errno => {
            let e = p.errno.as_ref().ok_or_else(|| {
                RpcError::InvalidParams("kind errno needs errno (e.g. \"EIO\" or 61)".into())
            })?;
            (FaultEffect::Errno(errno_of(e)?), 1, false)
        }
    };
    if ops.is_meta()
        && matches!(
            effect,
            FaultEffect::Crash | FaultEffect::PanicOnReset | FaultEffect::WedgeOnReset
        )
    {
        return Err(RpcError::InvalidParams(format!(
            "kind '{}' acts on queue I/O or the reset path, not on metadata: use op read, write or any",
            p.kind
        )));
    }
    let offset = p
        .offset
        .as_ref()
        .map(|s| size_arg(s, "offset"))
        .transpose()?;
    let len = p.len.as_ref().map(|s| size_arg(s, "len")).transpose()?;
    let (offset, len) = (offset.unwrap_or(0), len.unwrap_or(0));
    if offset.saturating_add(len) > size {
        return Err(RpcError::InvalidParams(format!(
            "range {offset}+{len} is beyond the device's {size} bytes"
        )));
    }
    if offset > 0 && len == 0 {
        // len 0 is the whole device: an offset alone would hit every command.
        return Err(RpcError::InvalidParams(format!(
            "offset {offset} needs len (the bytes from it the rule hits; without both, the whole device)"
        )));
    }
    Ok(FaultRule {
        effect,
        ops,
        offset,
        len,
        count: match p.count.unwrap_or(count) {
            0 => None,
            n => Some(n),
        },
        duration: p.duration_ms.map(Duration::from_millis),
        fails_probe,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(kind: &str) -> InjectParams {
        serde_json::from_value(serde_json::json!({"id": "d", "kind": kind})).unwrap()
    }

    /// Metadata ops reach the device's synchronous I/O; effects that only a queue or the
    /// reset path has are refused there.
    #[test]
    fn metadata_ops_and_what_they_refuse() {
        let with = |kind: &str, op: &str| {
            let mut p = params(kind);
            p.op = Some(op.into());
            rule_of(&p, 1 << 30)
        };
        for (op, want) in [
            ("meta-read", FaultOps::MetaRead),
            ("meta-write", FaultOps::MetaWrite),
            ("meta-zero", FaultOps::MetaZero),
            ("meta", FaultOps::Meta),
        ] {
            let r = with("transient", op).unwrap();
            assert_eq!((r.ops, r.effect), (want, FaultEffect::Errno(libc::EIO)));
        }
        let e = with("crash", "meta-write").unwrap_err().to_string();
        assert!(e.contains("not on metadata"), "{e}");
        let e = with("transient", "metadata").unwrap_err().to_string();
        assert!(e.contains("meta-write"), "{e}");
    }

    #[test]
    fn errnos_by_number_or_name() {
        assert_eq!(errno_of(&ErrnoArg::Number(61)).unwrap(), 61);
        assert_eq!(errno_of(&ErrnoArg::Name("eio".into())).unwrap(), libc::EIO);
        let e = errno_of(&ErrnoArg::Name("EFOO".into())).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("invalid params: errno \"EFOO\" must be"),
            "{e}"
        );
        let e = errno_of(&ErrnoArg::Number(5000)).unwrap_err();
        assert!(e.to_string().contains("errno 5000 must"), "{e}");
        let e = errno_of(&ErrnoArg::Other(serde_json::json!(true))).unwrap_err();
        assert!(e.to_string().contains("errno true must"), "{e}");
    }

    #[test]
    fn kinds_and_defaults() {
        let e = kind_of(&params("melt")).unwrap_err();
        assert!(e.to_string().contains("kind 'melt' must be one of media, transient, link-down, timeout, stuck, removed, errno, smart"), "{e}");
        let r = rule_of(&params("transient"), 1 << 20).unwrap();
        assert_eq!((r.count, r.fails_probe), (Some(1), false));
        let r = rule_of(&params("link-down"), 1 << 20).unwrap();
        assert_eq!((r.count, r.fails_probe), (None, true));
        let mut p = params("media");
        p.offset = Some(crate::api::SizeValue::Text("1M".into()));
        p.len = Some(crate::api::SizeValue::Bytes(1));
        let e = rule_of(&p, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("beyond the device"), "{e}");
    }
}
