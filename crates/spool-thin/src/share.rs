//! Chunks named by more than one map: a thin volume's and its snapshots', a clone's and the
//! snapshot it was made from.
//!
//! One table per pool (every thin volume's allocator and the pool use the same one): for each
//! chunk named by two maps or more, how many name it. A chunk not in the table is named by
//! one map at most, so the write path of a volume that never took a snapshot never looks
//! here. A chunk goes back to the pool when the last map naming it lets it go
//! ([`SharedChunks::release`] says so). The table lives in memory only: the pool rebuilds it
//! from every map when it opens, so it always agrees with what the maps say on disk.
//!
//! Owns: the counts. Must not know: maps, devices, virtio.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::map::Placement;

/// Chunks named by more than one map, and by how many (see the module doc).
#[derive(Debug, Default)]
pub struct SharedChunks {
    counts: Mutex<HashMap<Placement, u32>>,
}

impl SharedChunks {
    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<Placement, u32>> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One more map names `p` (which one map at least named already).
    pub fn add(&self, p: Placement) {
        *self.counts().entry(p).or_insert(1) += 1;
    }

    /// One map fewer names `p`; true when no map names it any more (it goes back to the
    /// pool).
    pub fn release(&self, p: Placement) -> bool {
        let mut c = self.counts();
        match c.get_mut(&p) {
            Some(n) if *n > 2 => {
                *n -= 1;
                false
            }
            Some(_) => {
                c.remove(&p);
                false
            }
            None => true,
        }
    }

    /// Whether more than one map names `p`.
    pub fn is_shared(&self, p: Placement) -> bool {
        self.counts().contains_key(&p)
    }

    /// How many maps name `p`, when more than one does (`None`: one at most).
    pub fn named_by(&self, p: Placement) -> Option<u32> {
        self.counts().get(&p).copied()
    }

    /// How many chunks more than one map names.
    pub fn shared_chunks(&self) -> u64 {
        self.counts().len() as u64
    }

    /// Replaces the table with what the maps say: how many maps name each chunk (the pool
    /// counts them when it opens).
    pub fn rebuild(&self, named: &HashMap<Placement, u32>) {
        let mut c = self.counts();
        c.clear();
        c.extend(named.iter().filter(|(_, &n)| n > 1).map(|(&p, &n)| (p, n)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn a_chunk_goes_back_when_its_last_map_lets_it_go() {
        let s = SharedChunks::default();
        let p = Placement {
            device: Uuid::new_v4(),
            offset: 4096,
        };
        assert!(!s.is_shared(p));
        s.add(p); // a snapshot
        s.add(p); // a clone of it
        assert!(s.is_shared(p));
        assert_eq!(s.shared_chunks(), 1);
        assert!(!s.release(p));
        assert!(!s.release(p));
        assert!(!s.is_shared(p), "named by one map now");
        assert!(s.release(p), "the last one let it go");
        let mut named = HashMap::new();
        named.insert(p, 3);
        s.rebuild(&named);
        assert!(s.is_shared(p));
    }
}
