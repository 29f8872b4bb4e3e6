//! `volume snapshot`, `volume snapshots`, `volume clone`, `snapshot delete`: a snapshot
//! named as `VOLUME@SNAPSHOT`, and how their results print.

use spool_api::size::format_size;
use spool_api::{DiffResult, ExportInfo, Snapshot};

use super::table::{header, table};
use super::CtlError;

/// `VOLUME@SNAPSHOT` split at its last `@`.
pub fn split(s: &str) -> Result<(String, String), CtlError> {
    match s.rsplit_once('@') {
        Some((v, n)) if !v.is_empty() && !n.is_empty() => Ok((v.into(), n.into())),
        _ => Err(CtlError::Usage(format!(
            "'{s}': give the snapshot as VOLUME@SNAPSHOT (`spoolctl volume snapshots VOLUME` lists them)"
        ))),
    }
}

/// Seconds since the Unix epoch as `YYYY-MM-DD HH:MM:SS` UTC.
pub fn utc(secs: u64) -> String {
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// A snapshot's space: RBD's own are counted by RBD (`rbd du`), not here.
fn space(s: &Snapshot, bytes: u64) -> String {
    match s.rbd {
        true => "-".into(),
        false => format_size(bytes),
    }
}

pub fn list(snaps: &[Snapshot]) {
    let mut rows = vec![header(&[
        "SNAPSHOT",
        "SIZE",
        "TAKEN (UTC)",
        "MAPPED",
        "ITS OWN",
    ])];
    for s in snaps {
        rows.push(vec![
            format!("{}@{}", s.volume, s.name),
            format_size(s.size),
            utc(s.created),
            space(s, s.mapped),
            space(s, s.exclusive),
        ]);
    }
    println!("{}", table(rows));
    if snaps.is_empty() {
        println!("(no snapshots)");
    }
    for s in snaps {
        if let Some(why) = &s.error {
            println!("{}@{} cannot be used: {why}", s.volume, s.name);
        }
    }
}

pub fn taken(s: &Snapshot) {
    if s.rbd {
        println!(
            "snapshot {}@{} taken (an RBD snapshot of the volume's image)",
            s.volume, s.name
        );
        return;
    }
    println!(
        "snapshot {}@{} taken: {} of {} backed by chunks, shared with the volume until it writes there",
        s.volume,
        s.name,
        format_size(s.mapped),
        format_size(s.size)
    );
    if let Some(w) = &s.warning {
        eprintln!("warning: snapshot {}@{}: {w}", s.volume, s.name);
    }
}

pub fn deleted(s: &Snapshot) {
    if s.rbd {
        println!(
            "deleted snapshot {}@{} (RBD gives its space back)",
            s.volume, s.name
        );
        return;
    }
    println!(
        "deleted snapshot {}@{}: {} given back to the pool (the rest is named by other maps)",
        s.volume,
        s.name,
        format_size(s.exclusive)
    );
}

pub fn diff(d: &DiffResult) {
    let mut rows = vec![header(&["OFFSET", "LENGTH"])];
    for (o, l) in &d.ranges {
        rows.push(vec![o.to_string(), l.to_string()]);
    }
    println!("{}", table(rows));
    println!(
        "{} changed in {} ranges (whole chunks of {})",
        format_size(d.changed),
        d.ranges.len(),
        format_size(d.chunk)
    );
}

pub fn exported(e: &ExportInfo) {
    println!(
        "serving {}@{} read-only over NBD: {}",
        e.volume, e.snapshot, e.uri
    );
    if let Some(b) = &e.base {
        println!(
            "what changed since {}@{b}: meta context qemu:dirty-bitmap:{b} (nbdinfo --map=qemu:dirty-bitmap:{b} '{}')",
            e.volume, e.uri
        );
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn dates_and_names() {
        assert_eq!(super::utc(0), "1970-01-01 00:00:00");
        assert_eq!(super::utc(1_795_000_000), "2026-11-18 11:06:40");
        assert_eq!(super::utc(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(super::split("a@b@c").unwrap(), ("a@b".into(), "c".into()));
        assert!(super::split("ab").is_err() && super::split("a@").is_err());
    }
}
