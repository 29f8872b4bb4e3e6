//! How a mirrored volume's copies are shown: state, a progress line (with a bar on a
//! terminal) while copying, one row per leg; and what `volume verify` found.

use std::io::IsTerminal;

use spool_api::size::format_size;
use spool_api::{MirrorStatus, VerifyResult};

use super::table::{header, table};

/// The copies of a mirrored volume, under its table row.
pub fn status(m: &MirrorStatus) {
    let current = m.legs.iter().filter(|l| l.state == "current").count();
    println!(
        "mirror: {} copies, {} current, {}",
        m.copies, current, m.state
    );
    if m.remaining_bytes > 0 {
        let eta = m.eta_secs.map_or("-".into(), |s| format!("{s}s"));
        println!(
            "  copying {}{:.1}%  {} left at {}/s, ETA {eta}",
            bar(m.percent),
            m.percent,
            format_size(m.remaining_bytes),
            format_size(m.rate),
        );
    }
    if m.regions_without_current > 0 {
        println!(
            "  {} regions have NO usable current copy (first at offsets {:?}): reads there wait\n  \
             for a device to come back; see docs/mirror.md before `volume mirror accept`",
            m.regions_without_current, m.without_current_offsets
        );
    }
    if m.out_of_sync_bytes > 0 {
        println!(
            "  out of sync after an unclean stop: {} (every copy holds every acknowledged write)",
            format_size(m.out_of_sync_bytes)
        );
    }
    if m.resync_at_open > 0 {
        println!(
            "  resynced after an unclean stop: {} regions of {}",
            m.resync_at_open,
            format_size(m.region_size)
        );
    }
    let mut rows = vec![header(&["LEG", "STATE", "SYNCED", "TO COPY", "DEVICES"])];
    for l in &m.legs {
        rows.push(vec![
            l.slot.to_string(),
            l.state.clone(),
            if l.synced { "yes" } else { "no" }.into(),
            format_size(l.stale_bytes),
            l.devices
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(","),
        ]);
    }
    println!("{}", table(rows));
}

/// A 20-character progress bar on a terminal, nothing otherwise.
fn bar(percent: f64) -> String {
    if !std::io::stdout().is_terminal() {
        return String::new();
    }
    let done = ((percent / 5.0).round() as usize).min(20);
    format!("[{}{}] ", "#".repeat(done), "-".repeat(20 - done))
}

pub fn verify(r: &VerifyResult) {
    let verdict = match (r.regions_differing, r.regions_skipped) {
        (0, 0) => "the copies are identical".to_string(),
        (0, s) => format!("no differences; {s} regions not compared (still being copied)"),
        (d, _) => format!(
            "{d} regions DIFFER, first at offsets {:?}",
            r.first_differences
        ),
    };
    println!(
        "volume {}: compared {} in {} regions: {verdict}",
        r.volume,
        format_size(r.bytes_compared),
        r.regions
    );
}
