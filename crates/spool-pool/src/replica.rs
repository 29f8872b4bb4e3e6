//! A volume that is another host's copy (docs/replicas.md): marked in the table while its
//! primary writes it through a transfer, so that no frontend runs it across restarts, and
//! promoted at an epoch above its primary's, which a hello from that primary never passes
//! again.
//!
//! Owns: the table's `replica` and `epoch` fields. Must not know: the transfer, frontends.

use crate::metadata::ReplicaOf;
use crate::{Error, Pool, Result, VolumeInfo};

impl Pool {
    /// Marks volume `id` as the copy of `primary` at its `epoch`. Refused when the volume
    /// was promoted at `epoch` or later here (that primary is fenced off it), and for a
    /// volume on RBD or being sent itself.
    pub fn make_replica(&mut self, id: &str, primary: &str, epoch: u64) -> Result<VolumeInfo> {
        let i = self.find(id)?;
        let v = &self.table.volumes[i];
        if v.epoch > epoch {
            return Err(Error::invalid(format!(
                "volume '{}' here was promoted (epoch {}): a primary at epoch {epoch} is behind it and may not write it",
                v.name, v.epoch
            )));
        }
        if v.rbd.is_some() || v.remote_leg().is_some() {
            return Err(Error::invalid(format!(
                "volume '{}' is on RBD or being sent itself: it cannot be another host's copy",
                v.name
            )));
        }
        // A new transfer copies anew: complete once its primary says so again.
        let replica = Some(ReplicaOf {
            primary: primary.into(),
            epoch,
            complete: false,
        });
        if v.replica == replica {
            return Ok(self.volume_info(v));
        }
        let mut table = self.table.clone();
        table.volumes[i].replica = replica;
        let v = table.volumes[i].clone();
        self.commit(table)?;
        tracing::info!(volume = %v.name, %primary, epoch, "the volume is another host's copy here: frontends wait until it is promoted");
        Ok(self.volume_info(&v))
    }

    /// Replica `id`, if it may be promoted (see [`Pool::promote`]).
    pub fn check_promotable(&self, id: &str, force: bool) -> Result<ReplicaOf> {
        let v = &self.table.volumes[self.find(id)?];
        let Some(r) = &v.replica else {
            return Err(Error::invalid(format!(
                "volume '{}' is not a replica here: nothing to promote",
                v.name
            )));
        };
        if !r.complete && !force {
            return Err(Error::invalid(format!(
                "volume '{}' here never held a complete copy of its primary's (the copy was never current there): promoting it loses what was not copied yet; --force promotes it all the same",
                v.name
            )));
        }
        Ok(r.clone())
    }

    /// Replica `id`'s primary said the copy here is current: from now on it holds every
    /// write the primary completes (until a new transfer starts over).
    pub fn replica_complete(&mut self, id: &str) -> Result<VolumeInfo> {
        let i = self.find(id)?;
        let v = &self.table.volumes[i];
        match &v.replica {
            None => Err(Error::invalid(format!(
                "volume '{}' is not a replica here",
                v.name
            ))),
            Some(r) if r.complete => Ok(self.volume_info(v)),
            Some(_) => {
                let mut table = self.table.clone();
                if let Some(r) = &mut table.volumes[i].replica {
                    r.complete = true;
                }
                let v = table.volumes[i].clone();
                self.commit(table)?;
                tracing::info!(volume = %v.name, "the replica is complete: its primary says every write it completes is here");
                Ok(self.volume_info(&v))
            }
        }
    }

    /// Promotes replica `id`: it is this host's volume from now on, at an epoch above its
    /// primary's. Refused for a volume that is not a replica, and (unless `force`) for one
    /// whose primary never said it was complete.
    pub fn promote(&mut self, id: &str, force: bool) -> Result<VolumeInfo> {
        let r = self.check_promotable(id, force)?;
        let i = self.find(id)?;
        let v = &self.table.volumes[i];
        let epoch = (r.epoch.max(v.epoch).checked_add(1)).ok_or_else(|| {
            Error::invalid(format!("volume '{}': its epoch cannot be raised", v.name))
        })?;
        let mut table = self.table.clone();
        table.volumes[i].replica = None;
        table.volumes[i].epoch = epoch;
        let v = table.volumes[i].clone();
        self.commit(table)?;
        tracing::info!(volume = %v.name, epoch, "replica promoted: this host serves the volume now");
        Ok(self.volume_info(&v))
    }
}

#[cfg(test)]
mod tests {
    use crate::tests::{opts, spec};
    use crate::Pool;

    /// A replica stays one across restarts until promoted; the promotion's epoch is above
    /// the primary's and outlives restarts too, and a hello from that primary's epoch is
    /// refused from then on, while one from a later epoch (this host's own copy elsewhere,
    /// promoted again) is taken.
    #[test]
    fn a_replica_is_kept_until_promoted_and_its_old_primary_is_fenced_off() {
        let d = tempfile::tempdir().unwrap();
        let specs = [spec(d.path(), "a", 16)];
        {
            let mut p = Pool::open(&specs, opts()).unwrap();
            p.create_volume("v", 4 << 20, false, 1).unwrap();
            let v = p.make_replica("v", "10.0.0.1", 3).unwrap();
            assert_eq!(v.replica.unwrap().epoch, 3);
            assert_eq!(p.table.format_version(), 11);
            let e = p.make_replica("v", "bad address", 3).unwrap_err();
            assert!(e.to_string().contains("printable"), "{e}");
        }
        let mut p = Pool::open(&specs, opts()).unwrap();
        let v = p.volume("v").unwrap();
        assert_eq!(v.replica.as_ref().unwrap().primary, "10.0.0.1");
        let e = p.promote("nope", false).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        let e = p.promote("v", false).unwrap_err();
        assert!(e.to_string().contains("never held a complete copy"), "{e}");
        assert!(p.replica_complete("v").unwrap().replica.unwrap().complete);
        drop(p);
        let mut p = Pool::open(&specs, opts()).unwrap();
        assert!(p.volume("v").unwrap().replica.unwrap().complete);
        // A new transfer starts over: not complete until its primary says so again.
        let v = p.make_replica("v", "10.0.0.1", 3).unwrap();
        assert!(!v.replica.unwrap().complete);
        p.replica_complete("v").unwrap();
        assert_eq!(p.promote("v", false).unwrap().epoch, 4);
        let e = p.promote("v", false).unwrap_err();
        assert!(e.to_string().contains("not a replica"), "{e}");
        drop(p);
        let mut p = Pool::open(&specs, opts()).unwrap();
        let v = p.volume("v").unwrap();
        assert_eq!((v.replica, v.epoch), (None, 4));
        let e = p.make_replica("v", "10.0.0.1", 3).unwrap_err();
        assert!(e.to_string().contains("promoted (epoch 4)"), "{e}");
        assert_eq!(p.make_replica("v", "10.0.0.1", 4).unwrap().epoch, 4);
        assert!(p.replica_complete("nope").is_err());
        assert_eq!(p.promote("v", true).unwrap().epoch, 5, "forced");
        assert!(p.replica_complete("v").is_err(), "not a replica any more");
    }
}
