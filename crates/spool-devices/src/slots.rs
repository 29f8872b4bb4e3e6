//! [`Slots`]: operations in flight under ids of a queue's own (their index), for a queue
//! that wraps another and must not hand the caller's tags down (one request's pieces share
//! a tag: the crypt queue, the power-cut log).
//!
//! Owns: the table. Must not know: what is kept in it.

/// A table of `T` by small integer id, ids reused once removed.
#[derive(Debug)]
pub struct Slots<T> {
    slots: Vec<Option<T>>,
    vacant: Vec<usize>,
}

impl<T> Default for Slots<T> {
    fn default() -> Self {
        Slots {
            slots: Vec::new(),
            vacant: Vec::new(),
        }
    }
}

impl<T> Slots<T> {
    /// Keeps `v`; returns its id (below 2^62 for any table that fits in memory).
    pub fn insert(&mut self, v: T) -> u64 {
        match self.vacant.pop() {
            Some(i) => {
                self.slots[i] = Some(v);
                i as u64
            }
            None => {
                self.slots.push(Some(v));
                (self.slots.len() - 1) as u64
            }
        }
    }

    /// Takes what `id` holds (`None`: no such id, or taken already).
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let i = usize::try_from(id).ok()?;
        let v = self.slots.get_mut(i)?.take()?;
        self.vacant.push(i);
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_reused_and_taken_once() {
        let mut s = super::Slots::default();
        let (a, b) = (s.insert('a'), s.insert('b'));
        assert_ne!(a, b);
        assert_eq!(s.remove(a), Some('a'));
        assert_eq!(s.remove(a), None);
        assert_eq!(s.insert('c'), a);
        assert_eq!(s.remove(99), None);
        assert_eq!(s.remove(b), Some('b'));
    }
}
