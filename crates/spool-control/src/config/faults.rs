//! `[[faults]]` (docs/failures.md, "Fault injection"): fault rules armed on every device
//! from its first open, in every worker this spoold starts, so that a restarted worker meets
//! them again (a request that crashes the worker, a device that always fails a range). The
//! same vocabulary as `spoolctl device inject`, checked the same way (`crate::faults`).

use serde::Deserialize;

use super::ConfigError;
use crate::api::{ErrnoArg, FaultKind, InjectParams, SizeValue};
use crate::rpc::RpcError;

/// One `[[faults]]` entry as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFault {
    kind: String,
    op: Option<String>,
    offset: Option<SizeValue>,
    len: Option<SizeValue>,
    count: Option<u64>,
    duration_ms: Option<u64>,
    errno: Option<ErrnoArg>,
}

/// Each entry as the rule it arms; the error names the entry (`faults[N]`, from 0).
pub(super) fn faults(raw: &[RawFault]) -> Result<Vec<spool_devices::FaultRule>, ConfigError> {
    raw.iter()
        .enumerate()
        .map(|(i, f)| {
            let bad = |why: String| ConfigError::Invalid(format!("faults[{i}]: {why}"));
            if FaultKind::parse(&f.kind) == Some(FaultKind::Smart) {
                return Err(bad(
                    "kind smart is a device's state, not a rule: use `spoolctl device inject DEV smart`"
                        .into(),
                ));
            }
            let p = InjectParams {
                id: String::new(),
                kind: f.kind.clone(),
                op: f.op.clone(),
                offset: f.offset.clone(),
                len: f.len.clone(),
                count: f.count,
                duration_ms: f.duration_ms,
                errno: f.errno.clone(),
                bits: None,
            };
            // The range is checked on each device as it opens: a rule beyond a device's end
            // never matches there.
            crate::faults::rule_of(&p, u64::MAX).map_err(|e| match e {
                RpcError::InvalidParams(why) => bad(why),
                e => bad(e.to_string()),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::Config;
    use spool_devices::{FaultEffect, FaultOps};
    use std::path::Path;

    fn parse(extra: &str) -> Result<Config, crate::config::ConfigError> {
        Config::parse(&format!("state_dir = \"/s\"\n{extra}"), Path::new("/c"))
    }

    #[test]
    fn fault_rules_and_the_witness_come_from_the_config() {
        let c = parse(
            "[[faults]]\nkind = \"crash\"\nop = \"write\"\n\
             [[faults]]\nkind = \"media\"\nop = \"read\"\noffset = \"1M\"\nlen = 4096\n\
             [[faults]]\nkind = \"errno\"\nerrno = \"ENOSPC\"\ncount = 3\n\
             [debug]\nwrite_witness = \"w.map\"\n",
        )
        .unwrap();
        let r = &c.faults;
        assert_eq!(r.len(), 3);
        assert_eq!(
            (r[0].effect, r[0].ops),
            (FaultEffect::Crash, FaultOps::Write)
        );
        assert_eq!((r[0].offset, r[0].len, r[0].count), (0, 0, None));
        assert_eq!((r[1].offset, r[1].len), (1 << 20, 4096));
        assert_eq!(r[1].effect, FaultEffect::Errno(libc::ENODATA));
        assert_eq!(
            (r[2].effect, r[2].count),
            (FaultEffect::Errno(libc::ENOSPC), Some(3))
        );
        assert_eq!(c.write_witness.as_deref(), Some(Path::new("/c/w.map")));
        let none = parse("").unwrap();
        assert!(none.faults.is_empty() && none.write_witness.is_none());
    }

    #[test]
    fn a_bad_fault_rule_names_its_entry() {
        for (text, needle) in [
            ("kind = \"melt\"", "faults[0]: kind 'melt' must be one of"),
            (
                "kind = \"crash\"\nop = \"trim\"",
                "faults[0]: op 'trim' must be",
            ),
            ("kind = \"errno\"", "faults[0]: kind errno needs errno"),
            (
                "kind = \"errno\"\nerrno = \"EFOO\"",
                "faults[0]: errno \"EFOO\"",
            ),
            (
                "kind = \"smart\"",
                "faults[0]: kind smart is a device's state",
            ),
            ("kind = \"crash\"\noffset = \"1Q\"", "faults[0]: offset:"),
            (
                "kind = \"crash\"\noffset = 8192",
                "faults[0]: offset 8192 needs len",
            ),
            ("kind = \"crash\"\nwhen = 1", "when"),
        ] {
            let e = parse(&format!("[[faults]]\n{text}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
        let e = (parse("[[faults]]\nkind = \"crash\"\n[[faults]]\nkind = \"x\"\n").unwrap_err())
            .to_string();
        assert!(e.contains("faults[1]: kind 'x'"), "{e}");
        let e = parse("[debug]\nwitness = \"x\"\n").unwrap_err().to_string();
        assert!(e.contains("witness"), "{e}");
    }
}
