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
//! a write could change a snapshot, or a chunk would never go back).
//!
//! Thin allocators keep working during a check, so what they change between reading the
//! maps and reading the allocators can look wrong for an instant: the check runs again
//! (up to [`PASSES`] times) while it finds something, and reports only what every pass
//! found.
//!
//! Owns: [`CheckReport`] and the checks. Must not know: RPC, how maps are written.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use spool_thin::map::Placement;
use spool_thin::{ScanProblem, ThinBackend};
use uuid::Uuid;

use crate::metadata::{ExtentEntry, VolumeEntry};
use crate::Pool;

/// How many times a check that finds something looks again.
pub const PASSES: usize = 3;
const PAUSE: Duration = Duration::from_millis(100);
/// At most this many leaked offsets are named per device.
const LEAKS_NAMED: usize = 8;

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

/// One pass of the check.
struct Pass<'a> {
    pool: &'a Pool,
    min: u64,
    areas: HashMap<Uuid, Area>,
    owners: Vec<String>,
    report: CheckReport,
    leaked: BTreeSet<(Uuid, u64)>,
}

impl Pool {
    /// Checks the pool's metadata against itself and the live allocators (see the module
    /// doc).
    pub fn check(&self) -> CheckReport {
        let mut out = self.check_pass();
        for _ in 1..PASSES {
            if out.0.problems.is_empty() && out.1.is_empty() {
                break;
            }
            std::thread::sleep(PAUSE);
            let (again, leaked) = self.check_pass();
            let seen: BTreeSet<String> = again.problems.iter().cloned().collect();
            out.0.problems.retain(|p| seen.contains(p));
            out.1 = out.1.intersection(&leaked).copied().collect();
        }
        let (mut report, leaked) = out;
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

    fn check_pass(&self) -> (CheckReport, BTreeSet<(Uuid, u64)>) {
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
            report: CheckReport {
                volumes: self.table.volumes.len(),
                ..Default::default()
            },
            leaked: BTreeSet::new(),
        };
        for v in &self.table.volumes {
            pass.extents(v);
        }
        let named = pass.maps();
        pass.allocators(&named);
        (pass.report, pass.leaked)
    }
}

impl Pass<'_> {
    fn problem(&mut self, p: String) {
        self.report.problems.push(p);
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
        for (what, e) in labelled {
            let len = self.min.checked_shl(e.order).unwrap_or(0);
            self.report.extent_bytes = self.report.extent_bytes.saturating_add(len);
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
            self.report.skipped.push(format!(
                "{what}: {len} bytes at {offset} on device {device}, which is not in the pool now"
            ));
            return;
        };
        let rel = offset.checked_sub(area.base);
        let first = rel.map(|r| (r / min) as usize);
        let units = (len / min) as usize;
        let fits = first.is_some_and(|f| f.saturating_add(units) <= area.owner.len());
        let aligned = rel.is_some_and(|r| len > 0 && r % len == 0);
        if !fits || !aligned {
            let (base, size) = (area.base, area.owner.len() as u64 * min);
            self.problem(format!(
                "{what}: {len} bytes at {offset} on device {device} do not lie {} in its data area (from {base}, {size} bytes)",
                if fits { "aligned" } else { "whole" },
            ));
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
            self.problem(format!(
                "{what}: {len} bytes at {offset} on device {device} overlap {other}"
            ));
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
            self.report.maps += 1 + t.snapshots.len();
            let spec = match pool.thin_spec(v, t) {
                Ok(s) => s,
                Err(e) => {
                    self.report
                        .skipped
                        .push(format!("volume '{}': maps not read: {e}", v.name));
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
            let named_snapshots = |mut why: String| {
                for s in &t.snapshots {
                    let name = format!("snapshot '{}@{}'", v.name, s.name);
                    why = why.replace(&format!("snapshot {}", s.uuid), &name);
                }
                why
            };
            match scan.problem.map(|p| match p {
                ScanProblem::Corrupt(w) => ScanProblem::Corrupt(named_snapshots(w)),
                ScanProblem::Unreadable(w) => ScanProblem::Unreadable(named_snapshots(w)),
            }) {
                Some(ScanProblem::Corrupt(why)) => {
                    self.problem(format!("volume '{}': a map is corrupt: {why}", v.name))
                }
                Some(ScanProblem::Unreadable(why)) => {
                    self.problem(format!("volume '{}': a map cannot be read: {why}", v.name))
                }
                None => {}
            }
            for (uuid, why) in &scan.damaged {
                let name = t.snapshots.iter().find(|s| s.uuid == *uuid);
                let name = name.map_or(uuid.to_string(), |s| format!("{}@{}", v.name, s.name));
                self.problem(format!(
                    "snapshot '{name}': its map is corrupt ({why}); the volume is served, the snapshot can only be deleted"
                ));
            }
            for &(i, p) in &scan.placements {
                let what = format!("volume '{}': chunk {i}", v.name);
                match named.get_mut(&p) {
                    Some((at, n)) => {
                        *n += 1;
                        if *at != i {
                            let at = *at;
                            self.problem(format!(
                                "{what} at {} on device {} is also named at entry {at}: two places of the volumes would share their data",
                                p.offset, p.device
                            ));
                        }
                    }
                    None => {
                        named.insert(p, (i, 1));
                        self.mark(p.device, p.offset, t.chunk, chunk_id, &what);
                    }
                }
            }
        }
        self.report.chunks = named.len() as u64;
        self.report.shared_chunks = named.values().filter(|n| n.1 > 1).count() as u64;
        named
    }

    /// Compares what the metadata holds with the allocators: free blocks, the thin
    /// allocators' chunks (in memory), the sharing counts.
    fn allocators(&mut self, named: &HashMap<Placement, (u64, u32)>) {
        let pool = self.pool;
        let mut live: BTreeSet<(Uuid, u64)> = BTreeSet::new();
        {
            let thins = pool.thins.lock().unwrap_or_else(|p| p.into_inner());
            for d in thins.values().filter_map(|d| d.as_ref().ok()) {
                if let Some(t) = ThinBackend::of(d) {
                    live.extend(t.placements().iter().map(|p| (p.device, p.offset)));
                }
            }
        }
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
                        self.leaked.insert((m.uuid, off));
                    }
                    (o, true) if o != 0 => held_free.push((o, off)),
                    _ => {}
                }
            }
            for (o, off) in held_free {
                let who = self.owners[o as usize - 1].clone();
                self.problem(format!(
                    "device {}: {} bytes at {off} are free in the allocator but {who} holds them: they could be handed out twice",
                    m.uuid, self.min
                ));
            }
        }
        let refs = &pool.space.refs;
        for (p, &(i, n)) in named {
            let counted = refs.named_by(*p);
            let wrong = match n {
                1 => counted.is_some(),
                _ => counted != Some(n),
            };
            if wrong {
                self.problem(format!(
                    "chunk {i} at {} on device {}: {n} map(s) name it, the sharing count says {}",
                    p.offset,
                    p.device,
                    counted.map_or("one".into(), |c| c.to_string())
                ));
            }
        }
    }
}
