//! The allocator thread of one thin volume: chunks for writes to holes, holes for discards
//! of whole chunks, each change durable in the map before anyone sees it.
//!
//! Allocating a chunk: take it from the pool, zero it on its device (durably), write the map
//! block holding its entry (durably), then publish the entry to the queues and wake the
//! requests waiting for it. A crash before the map write leaves the chunk free (the pool
//! rebuilds its free space from the maps); after it, the chunk is the volume's and reads
//! zeroes where nothing was written. Unmapping: clear the entries in memory, write the map
//! blocks, wait out the grace period, then give the chunks back. When the pool is full, a
//! write waits up to `full_wait` for free space (discards are still served meanwhile) and
//! then fails with `ENOSPC`.
//!
//! Owns: the thread, the work queue, the mailboxes that carry results back to the queues.
//! Must not know: virtio, the pool table.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::map::{self, BLOCK_BYTES, ENTRY_BYTES};
use crate::shared::{Mailbox, Note, Shared, Unmap};

/// Starts the thread of `shared`; it ends when the backend shuts down.
pub(crate) fn start(shared: &Arc<Shared>) -> std::io::Result<std::thread::JoinHandle<()>> {
    let s = shared.clone();
    std::thread::Builder::new()
        .name("spool-thin".into())
        .spawn(move || run(&s))
}

fn run(s: &Shared) {
    loop {
        let work = {
            let mut w = s.work.lock().unwrap_or_else(|p| p.into_inner());
            while w.allocs.is_empty() && w.unmaps.is_empty() && !s.stopping() {
                w = s
                    .wake
                    .wait_timeout(w, Duration::from_secs(1))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            std::mem::take(&mut *w)
        };
        if s.stopping() {
            for (chunk, m) in work.allocs {
                m.post(Some(Note::Failed {
                    chunk,
                    errno: -libc::ENOMEDIUM,
                }));
            }
            for u in work.unmaps {
                u.mailbox.post(Some(Note::Unmapped {
                    token: u.token,
                    errno: -libc::ENOMEDIUM,
                }));
            }
            return;
        }
        allocate(s, work.allocs);
        unmap(s, work.unmaps);
    }
}

/// Allocates every chunk asked for that is still a hole.
fn allocate(s: &Shared, allocs: Vec<(u64, Arc<Mailbox>)>) {
    let mut want: BTreeMap<u64, Vec<Arc<Mailbox>>> = BTreeMap::new();
    for (c, m) in allocs {
        want.entry(c).or_default().push(m);
    }
    let mut fresh = Vec::new();
    for (&c, boxes) in &want {
        if s.map.get(c).is_some() {
            continue;
        }
        match take_zeroed(s) {
            Ok(p) => fresh.push((c, Some(p))),
            Err(errno) => {
                for m in boxes {
                    m.post(Some(Note::Failed { chunk: c, errno }));
                }
            }
        }
    }
    let failed = persist(s, &fresh);
    for &(c, p) in &fresh {
        let (d, off) = p.expect("allocations are placements");
        if failed.contains(&map::block_of(c)) {
            if let Some(pl) = s.placement(d, off) {
                s.source.give_back(pl.device, pl.offset);
            }
            for m in &want[&c] {
                m.post(Some(Note::Failed {
                    chunk: c,
                    errno: -libc::EIO,
                }));
            }
        } else {
            s.map.set(c, Some((d, off)));
        }
    }
    for boxes in want.values() {
        for m in boxes {
            m.post(None);
        }
    }
}

/// A chunk from the pool, zeroed durably; waits for free space up to `full_wait`, serving
/// unmaps meanwhile (they are what frees space).
fn take_zeroed(s: &Shared) -> Result<(usize, u64), i32> {
    let deadline = Instant::now() + s.spec.full_wait;
    let mut waited = false;
    let got = loop {
        if let Some(got) = s.source.take() {
            break Ok(got);
        }
        if s.stopping() {
            break Err(-libc::ENOMEDIUM);
        }
        if Instant::now() >= deadline {
            tracing::error!(volume = %s.spec.path.display(), waited_ms = s.spec.full_wait.as_millis() as u64, "the pool is full: failing a write to an unallocated chunk of a thin volume (add a device, or free space)");
            break Err(-libc::ENOSPC);
        }
        if !waited {
            waited = true;
            s.waiting_for_space.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(volume = %s.spec.path.display(), wait_ms = s.spec.full_wait.as_millis() as u64, "the pool is full: a write to an unallocated chunk of a thin volume waits for free space");
        }
        let unmaps = std::mem::take(&mut s.work.lock().unwrap_or_else(|p| p.into_inner()).unmaps);
        if unmaps.is_empty() {
            std::thread::sleep(Duration::from_millis(20));
        }
        unmap(s, unmaps);
    };
    if waited {
        s.waiting_for_space.fetch_sub(1, Ordering::Relaxed);
    }
    let (uuid, dev, off) = got?;
    if let Err(e) = dev.zero_range(off, s.spec.chunk) {
        tracing::error!(volume = %s.spec.path.display(), error = %e, "zeroing a new chunk failed");
        s.source.give_back(uuid, off);
        return Err(-libc::EIO);
    }
    Ok((s.device_index(uuid, &dev), off))
}

/// Unmaps every chunk asked for, then gives the chunks back after the grace period.
fn unmap(s: &Shared, unmaps: Vec<Unmap>) {
    if unmaps.is_empty() {
        return;
    }
    let mut old = Vec::new();
    for u in &unmaps {
        for c in u.first..u.end.min(s.map.len()) {
            if let Some(p) = s.map.get(c) {
                s.map.set(c, None);
                old.push((c, p));
            }
        }
    }
    let holes: Vec<Change> = old.iter().map(|&(c, _)| (c, None)).collect();
    let failed = persist(s, &holes);
    for &(c, p) in &old {
        if failed.contains(&map::block_of(c)) {
            s.map.set(c, Some(p));
        }
    }
    s.grace.wait(&|| s.stopping());
    for &(c, (d, off)) in &old {
        if !failed.contains(&map::block_of(c)) {
            if let Some(pl) = s.placement(d, off) {
                s.source.give_back(pl.device, pl.offset);
            }
        }
    }
    for u in unmaps {
        let bad = (u.first..u.end).any(|c| failed.contains(&map::block_of(c)));
        u.mailbox.post(Some(Note::Unmapped {
            token: u.token,
            errno: if bad { -libc::EIO } else { 0 },
        }));
    }
}

/// A map change: chunk, and its new device index and offset (`None`: a hole).
type Change = (u64, Option<(usize, u64)>);

/// Writes the map blocks holding `changes` (other entries as the table has them); returns
/// the blocks that could not be written.
fn persist(s: &Shared, changes: &[Change]) -> Vec<u64> {
    let mut blocks: BTreeMap<u64, Vec<Change>> = BTreeMap::new();
    for &(c, p) in changes {
        blocks.entry(map::block_of(c)).or_default().push((c, p));
    }
    let mut failed = Vec::new();
    let mut buf = vec![0u8; BLOCK_BYTES as usize];
    for (b, ch) in blocks {
        for i in map::block_entries(b, s.map.len()) {
            let p = ch
                .iter()
                .find(|x| x.0 == i)
                .map_or_else(|| s.map.get(i), |x| x.1);
            let at = ((i % (BLOCK_BYTES / ENTRY_BYTES)) * ENTRY_BYTES) as usize;
            let e = map::encode(s.spec.volume, i, p.and_then(|(d, o)| s.placement(d, o)));
            buf[at..at + ENTRY_BYTES as usize].copy_from_slice(&e);
        }
        if let Err(e) = s.spec.store.write_block(b, &buf) {
            tracing::error!(volume = %s.spec.path.display(), block = b, error = %e, "writing the thin volume's map failed");
            failed.push(b);
        }
        buf.fill(0);
    }
    failed
}
