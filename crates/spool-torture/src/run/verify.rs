//! The check's reads of what the volume's snapshots and clones hold, each against the model
//! it was made from.
//!
//! Owns: opening them (through an armed fault's refusal) and reading them whole. Must not
//! know: how steps are drawn.

use spool_pool::{Pool, Result as PoolResult};

use super::{Runner, DEPTH, RETRIES};
use crate::engine::{Engine, Kind as Io};
use crate::model::{Model, Wrong, SECTOR};
use crate::world::VOLUME;

impl Runner {
    /// Reads clone `name` whole through queues of its own and checks it against `m`.
    pub(super) fn verify_clone(&mut self, name: &str, m: &Model) -> Result<(), Wrong> {
        let layout = self.opened(|p| p.layout(name), &format!("clone {name}"))?;
        let mut e = Engine::open(layout, 1, DEPTH).map_err(|e| format!("clone {name}: {e}"))?;
        let size = m.sectors() * SECTOR;
        let mut at = 0;
        while at < size {
            let len = (1u64 << 20).min(size - at);
            e.submit(0, Io::Read, at, len, 0, vec![0xee; len as usize]);
            for r in e.reap_until(|e| e.in_flight(None) == 0)? {
                if r.error != 0 {
                    return Err(Wrong(format!(
                        "clone {name}: read at {} failed: {}",
                        r.offset, r.error
                    )));
                }
                self.check(m, r.offset, &r.buf, &format!("clone {name}"))?;
            }
            at += len;
        }
        Ok(())
    }

    /// `open` (a clone's layout, a snapshot's image: maps read from the devices). A rule
    /// armed for an earlier step may fail its map's read: the pool then serves that map no
    /// more until it restarts (seed 9234), so the check restarts it (the faults cleared),
    /// and only a second refusal is wrong.
    fn opened<T>(
        &mut self,
        open: impl Fn(&mut Pool) -> PoolResult<T>,
        what: &str,
    ) -> Result<T, Wrong> {
        if let Ok(t) = open(self.world.pool()) {
            return Ok(t);
        }
        self.restart_quiet()?;
        open(self.world.pool()).map_err(|e| Wrong(format!("{what}: {e}")))
    }

    pub(super) fn verify_snapshots(&mut self, snaps: &[(String, Model)]) -> Result<(), Wrong> {
        for (name, m) in snaps {
            let img = self.opened(
                |p| p.snapshot_image(VOLUME, name, None),
                &format!("snapshot {name}"),
            )?;
            let size = m.sectors() * SECTOR;
            let mut buf = vec![0u8; 1 << 20];
            let mut at = 0;
            while at < size {
                let len = (1u64 << 20).min(size - at) as usize;
                // A read an injected fault fails is read again, as a backup client would.
                // The image reads through the devices' synchronous path, which metadata
                // faults reach too: rules armed for earlier steps may outlast the tries
                // (seed 9554), so they are cleared then, and only a failure after is wrong.
                let mut tries = 0;
                while let Err(e) = img.read_at(&mut buf[..len], at) {
                    tries += 1;
                    if tries == RETRIES {
                        self.clear_faults();
                    } else if tries > RETRIES {
                        return Err(Wrong(format!("snapshot {name} at {at}: {e}")));
                    }
                }
                self.check(m, at, &buf[..len], &format!("snapshot {name}"))?;
                at += len as u64;
            }
        }
        Ok(())
    }
}
