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
        let replica = Some(ReplicaOf {
            primary: primary.into(),
            epoch,
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

    /// Promotes replica `id`: it is this host's volume from now on, at an epoch above its
    /// primary's. Refused for a volume that is not a replica.
    pub fn promote(&mut self, id: &str) -> Result<VolumeInfo> {
        let i = self.find(id)?;
        let v = &self.table.volumes[i];
        let Some(r) = &v.replica else {
            return Err(Error::invalid(format!(
                "volume '{}' is not a replica here: nothing to promote",
                v.name
            )));
        };
        let epoch = r.epoch.max(v.epoch) + 1;
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
        let e = p.promote("nope").unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        assert_eq!(p.promote("v").unwrap().epoch, 4);
        let e = p.promote("v").unwrap_err();
        assert!(e.to_string().contains("not a replica"), "{e}");
        drop(p);
        let mut p = Pool::open(&specs, opts()).unwrap();
        let v = p.volume("v").unwrap();
        assert_eq!((v.replica, v.epoch), (None, 4));
        let e = p.make_replica("v", "10.0.0.1", 3).unwrap_err();
        assert!(e.to_string().contains("promoted (epoch 4)"), "{e}");
        assert_eq!(p.make_replica("v", "10.0.0.1", 4).unwrap().epoch, 4);
        assert_eq!(p.promote("v").unwrap().epoch, 5);
    }
}
