//! `pool check`: the pool's metadata read back from the devices and checked whole, as
//! `thin_check` and `fsck` do, while the pool serves.
//!
//! What it proves: every extent of the table lies inside its device's data area, aligned,
//! and overlaps no other; every thin map (a volume's, a snapshot's, a clone's) decodes, and
//! each chunk it names lies on a member, aligned, outside every extent, at one entry index
//! only (maps share a chunk at the same entry); and the live allocators agree with it: what
//! the metadata holds is taken (else it could be handed out twice), what is taken is named
//! by the metadata or by a thin volume's allocator (else it leaked until the next start),
//! and the sharing counts say "shared" exactly for the chunks more than one map names (else
//! a write could change a snapshot, or a chunk would never go back). A map block whose last
//! write failed may hold on the device either what memory holds or what it held before, until
//! its next successful write: its chunks are held (not leaked) and their counts, which follow
//! memory, are not compared with what the device names.
//!
//! Thin allocators keep working during a check, so what they change between reading the
//! maps and reading the allocators can look wrong for an instant. A pass that finds nothing
//! ends the check; otherwise passes repeat (up to [`PASSES`]) until two in a row agree, and
//! what the last two both found is reported. A problem is known by what it concerns (a
//! chunk's or extent's place, a map), not by its wording, so one that changes shape between
//! passes (a chunk free while named, then handed out and named twice) is still reported,
//! in the last pass's words.
//!
//! Owns: [`CheckReport`] and the checks. Must not know: RPC, how maps are written.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use spool_thin::map::Placement;
use spool_thin::{MapScan, ScanProblem, ThinBackend};
use uuid::Uuid;

use crate::metadata::{ExtentEntry, VolumeEntry};
use crate::Pool;

/// At most this many passes.
pub const PASSES: usize = 5;
const PAUSE: Duration = Duration::from_millis(100);
/// At most this many leaked offsets are named per device.
const LEAKS_NAMED: usize = 8;
/// At most this many problems are listed (then how many more there are).
const PROBLEMS_LISTED: usize = 100;

/// What `pool check` found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// Volumes in the table.
    pub volumes: usize,
    /// Thin maps read (volumes', snapshots').
    pub maps: usize,
    /// Bytes of the table's extents (volumes' data, legs, maps).
    pub extent_bytes: u64,
    /// Distinct chunks the thin maps name.
    pub chunks: u64,
    /// Of those, how many more than one map names.
    pub shared_chunks: u64,
    /// Bytes taken in the allocators that nothing names.
    pub leaked_bytes: u64,
    /// What is wrong, one line each (empty: the pool is consistent).
    pub problems: Vec<String>,
    /// What could not be checked, and why (a missing device).
    pub skipped: Vec<String>,
}

/// Who holds each unit (`min_extent` bytes) of one member's data area.
struct Area {
    base: u64,
    /// 0: nothing; otherwise 1 + an index into [`Pass::owners`].
    owner: Vec<u32>,
}

/// What one pass found.
#[derive(Clone)]
struct Outcome {
    /// The counts (its `problems` and `skipped` are filled at the end).
    report: CheckReport,
    /// (what it concerns, what is wrong).
    problems: Vec<(String, String)>,
    leaked: BTreeSet<(Uuid, u64)>,
    /// Per missing device: how many extents or chunks, their bytes, and whose.
    skipped: BTreeMap<Uuid, (u64, u64, BTreeSet<String>)>,
}

impl Outcome {
    fn clean(&self) -> bool {
        self.problems.is_empty() && self.leaked.is_empty()
    }

    fn keys(&self) -> BTreeSet<&str> {
        self.problems.iter().map(|p| p.0.as_str()).collect()
    }

    /// What `self` and the pass before it both found, in `self`'s words.
    fn agreed(mut self, before: &Outcome) -> Outcome {
        let keys = before.keys();
        self.problems.retain(|p| keys.contains(p.0.as_str()));
        self.leaked = self.leaked.intersection(&before.leaked).copied().collect();
        self
    }
}

/// One pass of the check.
struct Pass<'a> {
    pool: &'a Pool,
    min: u64,
    areas: HashMap<Uuid, Area>,
    owners: Vec<String>,
    out: Outcome,
}

impl Pool {
    /// Checks the pool's metadata against itself and the live allocators (see the module
    /// doc).
    pub fn check(&self) -> CheckReport {
        let mut last = self.check_pass();
        let mut found = last.clone();
        for _ in 1..PASSES {
            if last.clean() {
                found = last;
                break;
            }
            std::thread::sleep(PAUSE);
            let next = self.check_pass();
            let settled = next.keys() == last.keys() && next.leaked == last.leaked;
            found = next.clone().agreed(&last);
            last = next;
            if last.clean() {
                found = last;
                break;
            }
            if settled {
                break;
            }
        }
        self.report(found)
    }

    /// The report of what the check found (problems listed, leaks and skips per device).
    fn report(&self, found: Outcome) -> CheckReport {
        let Outcome {
            mut report,
            problems,
            leaked,
            skipped,
        } = found;
        for (d, (n, bytes, whose)) in skipped {
            let whose: Vec<String> = whose.into_iter().collect();
            report.skipped.push(format!(
                "device {d} is not in the pool now: {n} extent(s) or chunk(s), {bytes} bytes, of {}",
                whose.join(", ")
            ));
        }
        let n = problems.len();
        report.problems = problems
            .into_iter()
            .take(PROBLEMS_LISTED)
            .map(|p| p.1)
            .collect();
        if n > PROBLEMS_LISTED {
            report
                .problems
                .push(format!("... and {} more problems", n - PROBLEMS_LISTED));
        }
        report.leaked_bytes = leaked.len() as u64 * self.table.min_extent;
        let mut by_device: Vec<(Uuid, Vec<u64>)> = Vec::new();
        for (d, off) in leaked {
            match by_device.last_mut() {
                Some((u, offs)) if *u == d => offs.push(off),
                _ => by_device.push((d, vec![off])),
            }
        }
        for (d, offs) in by_device {
            let named: Vec<String> = offs
                .iter()
                .take(LEAKS_NAMED)
                .map(|o| o.to_string())
                .collect();
            report.problems.push(format!(
                "device {d}: {} bytes taken in the allocator that no extent, map or allocation names (leaked until spoold restarts), at {}{}",
                offs.len() as u64 * self.table.min_extent,
                named.join(", "),
                if offs.len() > LEAKS_NAMED { ", ..." } else { "" }
            ));
        }
        report
    }

    fn check_pass(&self) -> Outcome {
        let min = self.table.min_extent;
        let areas = self
            .members
            .iter()
            .map(|m| {
                let b = m.buddy.lock().unwrap_or_else(|p| p.into_inner());
                let units = (b.total() / min) as usize;
                (
                    m.uuid,
                    Area {
                        base: b.base(),
                        owner: vec![0; units],
                    },
                )
            })
            .collect();
        let mut pass = Pass {
            pool: self,
            min,
            areas,
            owners: Vec::new(),
            out: Outcome {
                report: CheckReport {
                    volumes: self.table.volumes.len(),
                    ..Default::default()
                },
                problems: Vec::new(),
                leaked: BTreeSet::new(),
                skipped: BTreeMap::new(),
            },
        };
        for v in &self.table.volumes {
            pass.extents(v);
        }
        pass.retired();
        let named = pass.maps();
        pass.allocators(&named);
        pass.out
    }
}

impl Pass<'_> {
    /// Problem `text`, about `key` (what it concerns: the same key in two passes is the
    /// same problem).
    fn problem(&mut self, key: String, text: String) {
        self.out.problems.push((key, text));
    }

    /// Marks every extent of `v`'s table entry, checking where each lies.
    fn extents(&mut self, v: &VolumeEntry) {
        let mut labelled: Vec<(String, &ExtentEntry)> = Vec::new();
        let vol = format!("volume '{}'", v.name);
        labelled.extend(v.extents.iter().map(|e| (vol.clone(), e)));
        for l in &v.legs {
            let what = format!("{vol} copy {}", l.slot);
            labelled.extend(l.extents.iter().map(|e| (what.clone(), e)));
        }
        if let Some(t) = &v.thin {
            labelled.extend(t.map.iter().map(|e| (format!("{vol}'s map"), e)));
            for s in &t.snapshots {
                let what = format!("snapshot '{}@{}''s map", v.name, s.name);
                labelled.extend(s.map.iter().map(|e| (what.clone(), e)));
            }
        }
        for (l, m) in v.leg_maps() {
            let what = format!("{vol} copy {}'s map", l.slot);
            labelled.extend(m.map.iter().map(|e| (what.clone(), e)));
        }
        for (what, e) in labelled {
            let len = self.min.checked_shl(e.order).unwrap_or(0);
            self.out.report.extent_bytes = self.out.report.extent_bytes.saturating_add(len);
            self.owners.push(what.clone());
            let id = self.owners.len() as u32;
            self.mark(e.device, e.offset, len, id, &what);
        }
    }

    /// Marks the extents the pool holds back (a removed mirror leg the queues may still
    /// write, a thin map move's new extents: `retired.rs`): held, not leaked.
    fn retired(&mut self) {
        let retired: Vec<(Uuid, ExtentEntry, &str)> = (self.pool.retired_extents())
            .map(|(v, e, why)| (v, *e, why))
            .collect();
        for (v, e, why) in retired {
            let what = format!("volume {v}: {why}");
            let len = self.min.checked_shl(e.order).unwrap_or(0);
            self.owners.push(what.clone());
            let id = self.owners.len() as u32;
            self.mark(e.device, e.offset, len, id, &what);
        }
    }

    /// Marks `len` bytes at `offset` on `device` as held by owner `id` (`what`), checking
    /// they lie inside the device's data area, aligned, and that nothing holds them yet.
    fn mark(&mut self, device: Uuid, offset: u64, len: u64, id: u32, what: &str) {
        let min = self.min;
        let Some(area) = self.areas.get_mut(&device) else {
            let e = self.out.skipped.entry(device).or_default();
            e.0 += 1;
            e.1 = e.1.saturating_add(len);
            if e.2.len() < 4 {
                e.2.insert(what.split(':').next().unwrap_or(what).to_string());
            }
            return;
        };
        let rel = offset.checked_sub(area.base);
        let first = rel.map(|r| (r / min) as usize);
        let units = (len / min) as usize;
        let fits = first.is_some_and(|f| f.saturating_add(units) <= area.owner.len());
        let aligned = rel.is_some_and(|r| len > 0 && r % len == 0);
        if !fits || !aligned {
            let (base, size) = (area.base, area.owner.len() as u64 * min);
            self.problem(
                format!("{device}:{offset}"),
                format!(
                "{what}: {len} bytes at {offset} on device {device} do not lie {} in its data area (from {base}, {size} bytes)",
                if fits { "aligned" } else { "whole" },
            ),
            );
            return;
        }
        let first = first.expect("checked above");
        let mut clash = None;
        for u in &mut area.owner[first..first + units] {
            if *u != 0 && clash.is_none() {
                clash = Some(*u);
            }
            *u = id;
        }
        if let Some(other) = clash {
            let other = self.owners[other as usize - 1].clone();
            self.problem(
                format!("{device}:{offset}"),
                format!("{what}: {len} bytes at {offset} on device {device} overlap {other}"),
            );
        }
    }

    /// Reads every thin map from the devices and marks the chunks they name; returns how
    /// many maps name each chunk.
    fn maps(&mut self) -> HashMap<Placement, (u64, u32)> {
        let mut named: HashMap<Placement, (u64, u32)> = HashMap::new();
        self.owners.push("a thin volume's chunk".into());
        let chunk_id = self.owners.len() as u32;
        let pool = self.pool;
        for v in &pool.table.volumes {
            let Some(t) = &v.thin else { continue };
            for m in crate::thin_maps::map_refs(v) {
                self.out.report.maps += 1 + m.snapshots.len();
                let spec = match pool.thin_spec(v, &m) {
                    Ok(s) => s,
                    Err(e) => {
                        self.problem(
                            format!("map:{}", m.key),
                            format!(
                                "volume '{}'{}: its maps cannot be read: {e}",
                                v.name,
                                m.of()
                            ),
                        );
                        continue;
                    }
                };
                let members: Vec<_> = pool
                    .members
                    .iter()
                    .map(|m| (m.uuid, m.dev.clone()))
                    .collect();
                let resolve = |u: Uuid| members.iter().find(|m| m.0 == u).map(|m| m.1.clone());
                let scan = ThinBackend::scan(&spec, &resolve);
                self.scan_problems(v, &m, t, &scan);
                for &(i, p) in &scan.placements {
                    let what = format!("volume '{}'{}: chunk {i}", v.name, m.of());
                    if !m.devices.is_empty() && !m.devices.contains(&p.device) {
                        self.problem(
                            format!("{}:{}", p.device, p.offset),
                            format!(
                                "{what} is on device {}, which is not one of this copy's: a device's loss could cost two copies",
                                p.device
                            ),
                        );
                    }
                    match named.get_mut(&p) {
                        Some((at, n)) => {
                            *n += 1;
                            if *at != i {
                                let at = *at;
                                self.problem(
                                    format!("{}:{}", p.device, p.offset),
                                    format!(
                                        "{what} at {} on device {} is also named at entry {at}: two places of the volumes would share their data",
                                        p.offset, p.device
                                    ),
                                );
                            }
                        }
                        None => {
                            named.insert(p, (i, 1));
                            self.mark(p.device, p.offset, t.chunk, chunk_id, &what);
                        }
                    }
                }
            }
        }
        self.out.report.chunks = named.len() as u64;
        self.out.report.shared_chunks = named.values().filter(|n| n.1 > 1).count() as u64;
        named
    }

    /// What a scan of thin volume `v`'s maps found wrong: its own map (the volume is not
    /// served), and snapshots' maps found corrupt (they can only be deleted).
    fn scan_problems(
        &mut self,
        v: &VolumeEntry,
        m: &crate::thin_maps::MapRef,
        t: &crate::metadata::ThinMap,
        scan: &MapScan,
    ) {
        let named_snapshots = |mut why: String| {
            for s in &t.snapshots {
                let name = format!("snapshot '{}@{}'", v.name, s.name);
                why = why.replace(&format!("snapshot {}", s.uuid), &name);
            }
            why
        };
        match scan.problem.clone().map(|p| match p {
            ScanProblem::Corrupt(w) => ScanProblem::Corrupt(named_snapshots(w)),
            ScanProblem::Unreadable(w) => ScanProblem::Unreadable(named_snapshots(w)),
        }) {
            Some(ScanProblem::Corrupt(why)) => self.problem(
                format!("map:{}", m.key),
                format!("volume '{}'{}: a map is corrupt: {why}", v.name, m.of()),
            ),
            Some(ScanProblem::Unreadable(why)) => self.problem(
                format!("map:{}", m.key),
                format!("volume '{}'{}: a map cannot be read: {why}", v.name, m.of()),
            ),
            None => {}
        }
        for (uuid, why) in &scan.damaged {
            let name = t.snapshots.iter().find(|s| s.uuid == *uuid);
            let name = name.map_or(uuid.to_string(), |s| format!("{}@{}", v.name, s.name));
            self.problem(
                format!("snapshot:{uuid}"),
                format!("snapshot '{name}': its map is corrupt ({why}); the snapshot can only be deleted"),
            );
        }
    }

    /// Compares what the metadata holds with the allocators: free blocks, the thin
    /// allocators' chunks (in memory), the sharing counts.
    fn allocators(&mut self, named: &HashMap<Placement, (u64, u32)>) {
        let pool = self.pool;
        let ThinHeld {
            live,
            retiring,
            unsure,
        } = thin_held(pool);
        for m in &pool.members {
            let free = m
                .buddy
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .free_blocks();
            let Some(area) = self.areas.get(&m.uuid) else {
                continue;
            };
            let mut is_free = vec![false; area.owner.len()];
            for (off, order) in free {
                let first = ((off - area.base) / self.min) as usize;
                let n = 1usize << order;
                let end = (first + n).min(is_free.len());
                is_free[first..end].fill(true);
            }
            let mut held_free = Vec::new();
            for (u, (&owner, &free)) in area.owner.iter().zip(&is_free).enumerate() {
                let off = area.base + u as u64 * self.min;
                match (owner, free) {
                    (0, false) if !live.contains(&(m.uuid, off)) => {
                        self.out.leaked.insert((m.uuid, off));
                    }
                    (o, true) if o != 0 => held_free.push((o, off)),
                    _ => {}
                }
            }
            for (o, off) in held_free {
                let who = self.owners[o as usize - 1].clone();
                self.problem(
                    format!("{}:{off}", m.uuid),
                    format!(
                        "device {}: {} bytes at {off} are free in the allocator but {who} holds them: they could be handed out twice",
                        m.uuid, self.min
                    ),
                );
            }
        }
        let refs = &pool.space.refs;
        for (p, &(i, n)) in named {
            if unsure.contains(p) {
                continue; // Named by a map block that may differ on the device (below).
            }
            // A chunk let go by one map keeps that name until its grace period ends.
            let n = n + retiring.get(p).copied().unwrap_or(0);
            let counted = refs.named_by(*p);
            let wrong = match n {
                1 => counted.is_some(),
                _ => counted != Some(n),
            };
            if wrong {
                self.problem(
                    format!("{}:{}", p.device, p.offset),
                    format!(
                        "chunk {i} at {} on device {}: {n} map(s) name it, the sharing count says {}",
                        p.offset,
                        p.device,
                        counted.map_or("one".into(), |c| c.to_string())
                    ),
                );
            }
        }
    }
}

/// What the thin allocators hold in memory: every chunk they name, are giving back or are
/// allocating (`live`), per chunk the names the sharing counts still keep for maps letting
/// it go (a grace period, a retired map), and the chunks of map blocks whose last write
/// failed (the device may name others there than memory does until the block is written
/// again: their counts are not compared).
fn thin_held(pool: &Pool) -> ThinHeld {
    let mut unsure: HashSet<Placement> = HashSet::new();
    // Held by a thin allocator: named in memory, in a grace period, or being allocated.
    let mut live: BTreeSet<(Uuid, u64)> = BTreeSet::new();
    // Names a grace period still holds in the sharing counts, per chunk.
    let mut retiring: HashMap<Placement, u32> = HashMap::new();
    {
        let thins = pool.thins.lock().unwrap_or_else(|p| p.into_inner());
        for d in thins.values().filter_map(|d| d.as_ref().ok()) {
            if let Some(t) = ThinBackend::of(d) {
                let maybe = t.unsure_placements();
                let held = t.placements().into_iter().chain(t.in_hand());
                live.extend(
                    held.chain(maybe.iter().copied())
                        .map(|p| (p.device, p.offset)),
                );
                unsure.extend(maybe);
                for p in t.retiring() {
                    *retiring.entry(p).or_default() += 1;
                }
            }
        }
        // A map the table no longer names but queues may still use (a clone's own map
        // after its copies took over: `Pool::retire_map`) keeps its names in the counts
        // until it is released: counted as a name each, as a grace period's are.
        for key in pool.retired_map_keys() {
            let t = thins.get(&key).and_then(|d| d.as_ref().ok());
            if let Some(t) = t.and_then(|d| ThinBackend::of(d)) {
                for (_, p) in t.live_entries() {
                    *retiring.entry(p).or_default() += 1;
                }
            }
        }
    }
    ThinHeld {
        live,
        retiring,
        unsure,
    }
}

/// What [`thin_held`] finds.
struct ThinHeld {
    live: BTreeSet<(Uuid, u64)>,
    retiring: HashMap<Placement, u32>,
    unsure: HashSet<Placement>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(problems: &[(&str, &str)], leaked: &[u64]) -> Outcome {
        Outcome {
            report: CheckReport::default(),
            problems: problems
                .iter()
                .map(|p| (p.0.to_string(), p.1.to_string()))
                .collect(),
            leaked: leaked.iter().map(|&o| (Uuid::nil(), o)).collect(),
            skipped: BTreeMap::new(),
        }
    }

    /// A problem that changes its wording between passes (a chunk free while named, then
    /// handed out and named twice) is the same problem: it is kept, in the later words; a
    /// passing one is dropped.
    #[test]
    fn passes_agree_on_what_a_problem_concerns_not_its_words() {
        let first = outcome(&[("d:1", "free while held"), ("d:2", "transient")], &[7, 8]);
        let second = outcome(&[("d:1", "named at two entries"), ("d:3", "new")], &[8]);
        let agreed = second.agreed(&first);
        assert_eq!(
            agreed.problems,
            vec![("d:1".to_string(), "named at two entries".to_string())]
        );
        assert_eq!(agreed.leaked.len(), 1);
    }
}
