//! Encrypted volumes' keys in the pool table (docs/encryption.md): a fresh data key wrapped
//! under the pool's key-encryption key at create, unwrapped once into the volume's cipher
//! for its layout, every key rewrapped under a new key-encryption key (`rekey`), and the
//! wrapped key erased from both metadata slots of every member when the volume is deleted
//! (crypto-erase: its extents then hold ciphertext nobody can read, and need no zeroing).
//!
//! Must not know: where key material comes from, how data is encrypted on the way to a
//! device (spool-crypt and the frontend do that).

use std::collections::HashMap;
use std::sync::Arc;

use spool_crypt::{DataKey, Kek, Locked, XtsCipher};
use uuid::Uuid;

use crate::metadata::{VolumeEntry, VolumeKey};
use crate::{Error, Pool, Result};

/// What a transfer hello's tag is for (the key-encryption key's tags are kept apart by it).
const TRANSFER_PURPOSE: &str = "spool transfer hello v1";

/// Each encrypted volume's cipher, unwrapped once.
pub(crate) type CipherCache = HashMap<Uuid, Arc<Locked<XtsCipher>>>;

/// A volume cipher as the data path holds it.
pub type VolumeCipher = Arc<Locked<XtsCipher>>;

/// `v`'s data key unwrapped with `kek`, which must be the key it names.
fn unwrap_key(v: &VolumeEntry, key: &VolumeKey, kek: &Kek) -> Result<DataKey> {
    if kek.id() != key.kek_id {
        return Err(not_held(v, key, &[kek.id()]));
    }
    let wrapped = spool_crypt::from_hex(&key.wrapped).unwrap_or_default();
    kek.unwrap(&wrapped).map_err(|e| key_error(v, e))
}

/// Why `v`'s key unwraps with none of the keys spoold has (`have`: their ids).
fn not_held(v: &VolumeEntry, key: &VolumeKey, have: &[String]) -> Error {
    key_error(
        v,
        format!(
            "its key was wrapped under key-encryption key {}, and spoold has {}: give spoold that key (the wrong key file, or a key given to a rekey and lost with a restart of the whole daemon?)",
            key.kek_id,
            have.join(" and ")
        ),
    )
}

fn key_error(v: &VolumeEntry, why: impl std::fmt::Display) -> Error {
    Error::Key {
        volume: v.name.clone(),
        why: why.to_string(),
    }
}

/// The data key a new volume gets.
pub(crate) enum NewKey {
    /// None: the volume is not encrypted.
    Plain,
    /// A fresh one.
    Fresh,
    /// The key of a volume received from another host, as its table holds it.
    Given(VolumeKey),
}

impl NewKey {
    /// A fresh key when `encrypt`, else none.
    pub(crate) fn of(encrypt: bool) -> NewKey {
        match encrypt {
            true => NewKey::Fresh,
            false => NewKey::Plain,
        }
    }
}

impl Pool {
    /// The wrapped data key new volume `v` gets for `key` (None: not encrypted).
    pub(crate) fn key_for(&self, v: &VolumeEntry, key: NewKey) -> Result<Option<VolumeKey>> {
        Ok(match key {
            NewKey::Plain => None,
            NewKey::Fresh => Some(self.new_volume_key(v)?),
            NewKey::Given(k) => Some(self.check_received_key(v, k)?),
        })
    }

    /// The pool's key-encryption key, or an error saying how to give spoold one.
    fn kek(&self, v: &VolumeEntry) -> Result<&Arc<Kek>> {
        self.opts.kek.as_ref().ok_or_else(|| {
            key_error(
                v,
                "is encrypted and spoold has no key-encryption key: set [encryption] key_file, credential or key_command (docs/encryption.md)",
            )
        })
    }

    /// A fresh data key for `v`, wrapped under the pool's key-encryption key.
    pub(crate) fn new_volume_key(&self, v: &VolumeEntry) -> Result<VolumeKey> {
        let kek = self.kek(v)?;
        let dk = DataKey::generate().map_err(|e| key_error(v, e))?;
        Ok(VolumeKey {
            cipher: spool_crypt::CIPHER.into(),
            kek_id: kek.id(),
            wrapped: spool_crypt::to_hex(&kek.wrap(&dk)),
        })
    }

    /// `key`, the data key of a volume another host sends here, if it is one this pool can
    /// use: the cipher spoold speaks, wrapped under this pool's key-encryption key (its
    /// unwrap checks that), so the sender's ciphertext is this volume's.
    pub(crate) fn check_received_key(&self, v: &VolumeEntry, key: VolumeKey) -> Result<VolumeKey> {
        if key.cipher != spool_crypt::CIPHER {
            return Err(key_error(
                v,
                format!(
                    "its cipher '{}' is not spoold's ({})",
                    key.cipher,
                    spool_crypt::CIPHER
                ),
            ));
        }
        let kek = self.opts.kek.as_ref().ok_or_else(|| {
            key_error(
                v,
                format!(
                    "is sent encrypted under key-encryption key {}, and spoold here has none: give this host that key ([encryption], docs/encryption.md)",
                    key.kek_id
                ),
            )
        })?;
        if kek.id() != key.kek_id {
            return Err(key_error(
                v,
                format!(
                    "is sent encrypted under key-encryption key {}, and spoold here has {}: give both hosts the same key-encryption key (docs/transfer.md)",
                    key.kek_id,
                    kek.id()
                ),
            ));
        }
        let wrapped = spool_crypt::from_hex(&key.wrapped)
            .filter(|w| w.len() == spool_crypt::WRAPPED_LEN)
            .ok_or_else(|| key_error(v, "its wrapped data key is malformed"))?;
        // As this pool writes it (lowercase), so that equal keys compare equal.
        let key = VolumeKey {
            wrapped: spool_crypt::to_hex(&wrapped),
            ..key
        };
        if let Some(other) = (self.table.volumes.iter()).find(|o| {
            o.encryption
                .as_ref()
                .is_some_and(|k| k.wrapped == key.wrapped)
        }) {
            return Err(key_error(
                v,
                format!(
                    "volume '{}' here has that data key already: one data key is one volume's",
                    other.name
                ),
            ));
        }
        unwrap_key(v, &key, kek)?;
        Ok(key)
    }

    /// A tag (hex) proving to a host with the same key-encryption key that this one sent
    /// `message` (a transfer hello carrying a data key: docs/transfer.md).
    pub fn transfer_tag(&self, message: &[u8]) -> Result<String> {
        let kek = self
            .opts
            .kek
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("spoold has no key-encryption key".into()))?;
        Ok(spool_crypt::to_hex(
            &kek.authenticate(TRANSFER_PURPOSE, message),
        ))
    }

    /// Whether `tag` is [`Self::transfer_tag`]'s for `message` under this pool's
    /// key-encryption key, which must be `kek_id` (the sender's): an error says which
    /// check failed, naming key ids only.
    pub fn check_transfer_tag(&self, kek_id: &str, message: &[u8], tag: &str) -> Result<()> {
        let refuse =
            |why: String| Error::InvalidArgument(format!("the hello's data key is refused: {why}"));
        let kek = self.opts.kek.as_ref().ok_or_else(|| {
            refuse(format!(
                "it is wrapped under key-encryption key {kek_id}, and spoold here has none: give this host that key ([encryption], docs/encryption.md)"
            ))
        })?;
        if kek.id() != kek_id {
            return Err(refuse(format!(
                "it is wrapped under key-encryption key {kek_id}, and spoold here has {}: give both hosts the same key-encryption key (docs/transfer.md)",
                kek.id()
            )));
        }
        let tag = spool_crypt::from_hex(tag).unwrap_or_default();
        match kek.verify(TRANSFER_PURPOSE, message, &tag) {
            true => Ok(()),
            false => Err(refuse(
                "its tag does not prove the sender holds this host's key-encryption key (a forged or altered hello)".into(),
            )),
        }
    }

    /// The wrapped data key of volume `id` as the table holds it (None: not encrypted),
    /// for sending it to a host with the same key-encryption key: wrapped, it is no more
    /// than the pool's own metadata gives away.
    pub fn wrapped_key(&self, id: &str) -> Result<Option<VolumeKey>> {
        Ok(self.table.volumes[self.find(id)?].encryption.clone())
    }

    /// Whether volume `id` has exactly the data key `key` (both None: neither encrypted),
    /// for a transfer into a volume that exists here: AES key wrap is deterministic, so
    /// under one key-encryption key the same data key wraps to the same bytes.
    pub fn check_same_key(&self, id: &str, key: Option<&VolumeKey>) -> Result<()> {
        let v = &self.table.volumes[self.find(id)?];
        let lower = key.map(|k| VolumeKey {
            wrapped: k.wrapped.to_ascii_lowercase(),
            ..k.clone()
        });
        if v.encryption == lower {
            return Ok(());
        }
        let why = match (&v.encryption, key) {
            (None, _) => "it is not encrypted here, and the sender's copy is",
            (Some(_), None) => "it is encrypted here, and the sender's copy is not",
            _ => "its data key here is not the sender's",
        };
        Err(Error::InvalidArgument(format!(
            "volume '{}' cannot receive the sender's data: {why}; delete it here and let the transfer create it",
            v.name
        )))
    }

    /// The data key of encrypted volume `v`, unwrapped with whichever key spoold has that
    /// it names (the key in use, or the other side of a rekey).
    fn data_key(&self, v: &VolumeEntry, key: &VolumeKey) -> Result<DataKey> {
        let kek = self.kek(v)?;
        match std::iter::once(kek)
            .chain(&self.opts.other_keks)
            .find(|k| k.id() == key.kek_id)
        {
            Some(k) => unwrap_key(v, key, k),
            None => Err(not_held(v, key, &self.kek_ids())),
        }
    }

    /// The cipher of `v` when it is encrypted (unwrapped once, then cached).
    pub(crate) fn volume_cipher(&self, v: &VolumeEntry) -> Result<Option<VolumeCipher>> {
        let Some(key) = &v.encryption else {
            return Ok(None);
        };
        let mut cache = self.ciphers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cache.get(&v.uuid) {
            return Ok(Some(c.clone()));
        }
        let cipher = Arc::new(
            self.data_key(v, key)?
                .cipher()
                .map_err(|e| key_error(v, e))?,
        );
        cache.insert(v.uuid, cipher.clone());
        Ok(Some(cipher))
    }

    /// Forgets a deleted volume's cipher.
    pub(crate) fn drop_cipher(&self, uuid: Uuid) {
        let mut cache = self.ciphers.lock().unwrap_or_else(|p| p.into_inner());
        cache.remove(&uuid);
    }

    /// A volume's data key in the clear, for recovery without spoold (`spoold export-key`:
    /// `cryptsetup open --type plain` with it reads a contiguous volume).
    pub fn export_data_key(&self, id: &str) -> Result<DataKey> {
        let v = &self.table.volumes[self.find(id)?];
        let key = v
            .encryption
            .as_ref()
            .ok_or_else(|| key_error(v, "is not encrypted"))?;
        self.data_key(v, key)
    }

    /// Rewraps every encrypted volume's data key under `new` without touching any data, and
    /// makes `new` the pool's key-encryption key. Both metadata slots of every member are
    /// rewritten, so no key wrapped under the old one remains. Returns how many keys were
    /// rewrapped (those under `new` already are left: a rekey that failed part way is
    /// finished by running it again). Every key is unwrapped before anything is written: a
    /// key spoold cannot unwrap fails the whole rekey and changes nothing. Until the commit
    /// has succeeded both keys are kept ([`Pool::keks`]): a commit that failed part way may
    /// have left a table wrapped under either on some member, or in memory.
    pub fn rekey(&mut self, new: Arc<Kek>) -> Result<usize> {
        let mut table = self.table.clone();
        let mut n = 0;
        for v in table.volumes.iter_mut() {
            let Some(key) = v.encryption.clone() else {
                continue;
            };
            if key.kek_id == new.id() {
                continue;
            }
            let dk = self.data_key(v, &key)?;
            v.encryption = Some(VolumeKey {
                cipher: key.cipher,
                kek_id: new.id(),
                wrapped: spool_crypt::to_hex(&new.wrap(&dk)),
            });
            n += 1;
        }
        if !self.kek_ids().contains(&new.id()) {
            self.opts.other_keks.push(new.clone());
        }
        self.commit_erasing(table)?;
        tracing::info!(keys = n, kek = %new.id(), "data keys rewrapped under a new key-encryption key");
        self.opts.kek = Some(new);
        self.settle_keys();
        Ok(n)
    }

    /// Chooses, at open and after a rekey, the key new data keys are wrapped under and the
    /// keys kept besides it. The key in use is the first of those a previous worker held,
    /// then the configured one, that the table names; with none named, the configured one
    /// (or, without one, the first kept).
    /// So a restart between a rekey and the config change, or between putting the new key
    /// where the config points and the rekey, serves every volume. Every other key stays
    /// only while the table names it: an old key is let go once nothing is wrapped under it.
    pub(crate) fn settle_keys(&mut self) {
        let named: std::collections::HashSet<String> = (self.table.volumes.iter())
            .filter_map(|v| v.encryption.as_ref().map(|k| k.kek_id.clone()))
            .collect();
        let configured = self.opts.kek.clone();
        let mut all: Vec<Arc<Kek>> = Vec::new();
        let given = self.opts.other_keks.drain(..).chain(self.opts.kek.take());
        for k in given {
            if !all.iter().any(|a| a.id() == k.id()) {
                all.push(k);
            }
        }
        let in_use = (all.iter().find(|k| named.contains(&k.id())).cloned())
            .or(configured)
            .or_else(|| all.first().cloned());
        self.opts.other_keks = all
            .into_iter()
            .filter(|k| named.contains(&k.id()))
            .filter(|k| in_use.as_ref().is_none_or(|u| u.id() != k.id()))
            .collect();
        self.opts.kek = in_use;
        if !self.opts.other_keks.is_empty() {
            tracing::warn!(kek = ?self.kek_id(), others = ?self.kek_ids(), "data keys are wrapped under more than one key-encryption key (a rekey that did not finish): run `spoolctl volume rekey` again");
        }
    }

    /// Every key-encryption key spoold holds: the one in use first, then those some data
    /// key is still wrapped under (for the next worker: the daemon keeps them with the
    /// keeper).
    pub fn keks(&self) -> Vec<Arc<Kek>> {
        self.opts
            .kek
            .iter()
            .chain(&self.opts.other_keks)
            .cloned()
            .collect()
    }

    /// The ids of [`Pool::keks`].
    pub fn kek_ids(&self) -> Vec<String> {
        self.keks().iter().map(|k| k.id()).collect()
    }

    /// The key-encryption key's id, if spoold has one.
    pub fn kek_id(&self) -> Option<String> {
        self.opts.kek.as_ref().map(|k| k.id())
    }
}

/// What recovery without spoold needs of an encrypted volume, read from one member device's
/// metadata without opening the pool (spoold may be running): its data key, and where its
/// bytes lie when they are contiguous on that device.
pub struct ExportedKey {
    pub key: DataKey,
    pub volume: String,
    pub size: u64,
    /// Byte offset on the device read, when the whole volume (a plain volume, or one copy of
    /// a mirrored one) lies there contiguously: `cryptsetup open --type plain --offset` in
    /// 512-byte sectors.
    pub contiguous_at: Option<u64>,
}

/// Reads the newest valid pool table on `device` (a file or block device, read only, no
/// lock taken) and unwraps volume `id`'s data key with `kek`.
pub fn export_key_offline(device: &std::path::Path, id: &str, kek: &Kek) -> Result<ExportedKey> {
    use crate::metadata::{decode, SlotState, HEADER_SIZE, SLOT_SIZE};
    use std::os::unix::fs::FileExt;
    let path = device.display().to_string();
    let f = std::fs::File::open(device).map_err(|e| Error::Metadata(format!("{path}: {e}")))?;
    let mut best: Option<crate::metadata::Record> = None;
    for slot in 0..2u64 {
        let mut header = [0u8; HEADER_SIZE];
        if f.read_exact_at(&mut header, slot * SLOT_SIZE).is_err() {
            continue;
        }
        let state = decode(&header, |len| {
            let mut p = vec![0u8; len];
            f.read_exact_at(&mut p, slot * SLOT_SIZE + HEADER_SIZE as u64)
                .map(|_| p)
        });
        if let SlotState::Valid(r) = state {
            if best.as_ref().is_none_or(|b| b.generation < r.generation) {
                best = Some(r);
            }
        }
    }
    let rec = best.ok_or_else(|| Error::Corrupt {
        path: path.clone(),
        why: "no valid pool metadata on it".into(),
    })?;
    let by_uuid = Uuid::parse_str(id).ok();
    let v = rec
        .table
        .volumes
        .iter()
        .find(|v| v.name == id || Some(v.uuid) == by_uuid)
        .ok_or_else(|| Error::NoSuchVolume(id.into()))?;
    let key = v
        .encryption
        .as_ref()
        .ok_or_else(|| key_error(v, "is not encrypted"))?;
    let key = unwrap_key(v, key, kek)?;
    let min = rec.table.min_extent;
    // A plain volume's extents, or any whole copy of a mirrored one (every leg holds all of
    // the volume's ciphertext), lying contiguously on this device.
    let contiguous_at = v.copies_extents().into_iter().find_map(|extents| {
        let here = !extents.is_empty()
            && extents.iter().all(|e| e.device == rec.device_uuid)
            && extents
                .windows(2)
                .all(|w| w[0].offset + (min << w[0].order) == w[1].offset);
        here.then(|| extents[0].offset)
    });
    Ok(ExportedKey {
        key,
        volume: v.name.clone(),
        size: v.size,
        contiguous_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{opts, spec};
    use crate::PoolOptions;

    fn with_kek(kek: &Arc<Kek>) -> PoolOptions {
        PoolOptions {
            kek: Some(kek.clone()),
            ..opts()
        }
    }

    /// Create, reopen, a wrong key, a rekey and a delete, on the pool table alone.
    #[test]
    fn keys_follow_the_volume_through_reopen_rekey_and_delete() {
        let d = tempfile::tempdir().unwrap();
        let specs = [spec(d.path(), "a", 9), spec(d.path(), "b", 9)];
        let k1 = Arc::new(Kek::generate().unwrap());
        let mut p = Pool::open(&specs, opts()).unwrap();
        let e = p
            .create_volume_opts("s", 1 << 20, false, 1, 1, true)
            .unwrap_err();
        assert!(e.to_string().contains("no key-encryption key"), "{e}");
        drop(p);
        let mut p = Pool::open(&specs, with_kek(&k1)).unwrap();
        let v = p
            .create_volume_opts("s", 2 << 20, false, 1, 2, true)
            .unwrap();
        assert!(v.encrypted);
        p.create_volume("plain", 1 << 20, false, 1).unwrap();
        assert!(p.layout("s").unwrap().cipher.is_some());
        assert!(p.layout("plain").unwrap().cipher.is_none());
        assert_eq!(p.table.format_version(), 5);
        let key = p.export_data_key("s").unwrap().bytes().to_vec();
        drop(p);
        // Another key: refused with both ids named; the plain volume is unaffected.
        let k2 = Arc::new(Kek::generate().unwrap());
        let p = Pool::open(&specs, with_kek(&k2)).unwrap();
        let e = p.layout("s").unwrap_err().to_string();
        assert!(e.contains(&k1.id()) && e.contains(&k2.id()), "{e}");
        assert!(p.layout("plain").is_ok());
        drop(p);
        // Rekey to k2: the same data key, now only under k2, in both slots.
        let mut p = Pool::open(&specs, with_kek(&k1)).unwrap();
        assert_eq!(p.rekey(k2.clone()).unwrap(), 1);
        assert_eq!(p.kek_id(), Some(k2.id()));
        drop(p);
        let img = std::fs::read(d.path().join("a")).unwrap();
        let meta =
            String::from_utf8_lossy(&img[..crate::metadata::METADATA_AREA as usize]).to_string();
        assert!(
            !meta.contains(&k1.id()),
            "a slot still names the old key-encryption key"
        );
        let mut p = Pool::open(&specs, with_kek(&k2)).unwrap();
        assert_eq!(p.export_data_key("s").unwrap().bytes().to_vec(), key);
        let wrapped = p.table.volumes[p.find("s").unwrap()]
            .encryption
            .clone()
            .unwrap()
            .wrapped;
        p.delete_volume("s").unwrap();
        drop(p);
        for dev in ["a", "b"] {
            let img = std::fs::read(d.path().join(dev)).unwrap();
            let meta = &img[..crate::metadata::METADATA_AREA as usize];
            assert!(
                !meta.windows(wrapped.len()).any(|w| w == wrapped.as_bytes()),
                "{dev}: the wrapped key survived"
            );
        }
    }

    /// Damaged key records are refused field by field.
    #[test]
    fn malformed_key_records_are_refused() {
        let good = VolumeKey {
            cipher: spool_crypt::CIPHER.into(),
            kek_id: "00112233aabbccdd".into(),
            wrapped: "ab".repeat(spool_crypt::WRAPPED_LEN),
        };
        assert!(good.validate().is_ok());
        let bad = [
            VolumeKey {
                cipher: "aes-cbc-essiv".into(),
                ..good.clone()
            },
            VolumeKey {
                kek_id: "xyz".into(),
                ..good.clone()
            },
            VolumeKey {
                wrapped: "ab".repeat(10),
                ..good.clone()
            },
            VolumeKey {
                wrapped: "zz".repeat(spool_crypt::WRAPPED_LEN),
                ..good.clone()
            },
        ];
        for b in bad {
            assert!(b.validate().is_err(), "{b:?}");
        }
    }
}

#[cfg(test)]
mod transfer_tests {
    use super::*;
    use crate::tests::{opts, spec};
    use crate::PoolOptions;

    fn pool(dir: &std::path::Path, kek: Option<&Arc<Kek>>) -> Pool {
        let specs = [spec(dir, "a", 9)];
        let o = PoolOptions {
            kek: kek.cloned(),
            ..opts()
        };
        Pool::open(&specs, o).unwrap()
    }

    /// A volume received with the sender's wrapped key has the sender's data key, so the
    /// sender's ciphertext is its own; a key this pool cannot use is refused, naming why.
    #[test]
    fn a_received_volume_takes_the_senders_data_key_under_the_same_kek_only() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let k1 = Arc::new(Kek::generate().unwrap());
        let mut a = pool(da.path(), Some(&k1));
        a.create_volume_opts("s", 1 << 20, false, 1, 1, true)
            .unwrap();
        let sent = a.wrapped_key("s").unwrap().expect("encrypted");
        assert_eq!(
            a.wrapped_key("nobody").unwrap_err().to_string(),
            a.find("nobody").unwrap_err().to_string()
        );

        let mut b = pool(db.path(), Some(&k1));
        let v = b
            .create_received_volume("s", 1 << 20, 1, 1, Some(sent.clone()))
            .unwrap();
        assert!(v.encrypted);
        assert_eq!(
            b.export_data_key("s").unwrap().bytes(),
            a.export_data_key("s").unwrap().bytes()
        );
        b.check_same_key("s", Some(&sent)).unwrap();
        let e = b.check_same_key("s", None).unwrap_err().to_string();
        assert!(
            e.contains("encrypted here, and the sender's copy is not"),
            "{e}"
        );

        let refused = |b: &mut Pool, key: VolumeKey| {
            let e = b.create_received_volume("t", 1 << 20, 1, 1, Some(key));
            assert!(b.volume("t").is_err(), "created on a refusal");
            e.unwrap_err().to_string()
        };
        let other = VolumeKey {
            cipher: "aes-cbc-essiv".into(),
            ..sent.clone()
        };
        assert!(refused(&mut b, other).contains("not spoold's"));
        let mut bad = sent.clone();
        bad.wrapped.truncate(10);
        assert!(refused(&mut b, bad).contains("malformed"));
        let mut flipped = sent.clone();
        flipped.wrapped.replace_range(
            0..2,
            if sent.wrapped.starts_with("00") {
                "01"
            } else {
                "00"
            },
        );
        assert!(refused(&mut b, flipped).contains("does not unwrap"));

        let k2 = Arc::new(Kek::generate().unwrap());
        let (dc, dd) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let e = refused(&mut pool(dc.path(), Some(&k2)), sent.clone());
        assert!(e.contains(&k1.id()) && e.contains(&k2.id()), "{e}");
        assert!(e.contains("same key-encryption key"), "{e}");
        let e = refused(&mut pool(dd.path(), None), sent);
        assert!(e.contains("spoold here has none"), "{e}");
    }

    /// One data key is one volume's; a key sent in uppercase is the same key; an existing
    /// volume takes a transfer only with the sender's key; a hello's tag proves the KEK.
    #[test]
    fn a_received_key_is_one_volumes_and_its_hello_is_proven() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let k = Arc::new(Kek::generate().unwrap());
        let mut a = pool(da.path(), Some(&k));
        a.create_volume_opts("s", 1 << 20, false, 1, 1, true)
            .unwrap();
        a.create_volume_opts("o", 1 << 20, false, 1, 1, true)
            .unwrap();
        let sent = a.wrapped_key("s").unwrap().unwrap();
        let mut b = pool(db.path(), Some(&k));
        let upper = VolumeKey {
            wrapped: sent.wrapped.to_ascii_uppercase(),
            ..sent.clone()
        };
        b.create_received_volume("s", 1 << 20, 1, 1, Some(upper.clone()))
            .unwrap();
        assert_eq!(b.wrapped_key("s").unwrap(), Some(sent.clone()));
        b.check_same_key("s", Some(&upper)).unwrap();
        let e = b.create_received_volume("t", 1 << 20, 1, 1, Some(sent.clone()));
        let e = e.unwrap_err().to_string();
        assert!(
            e.contains("volume 's' here has that data key already"),
            "{e}"
        );
        let other = a.wrapped_key("o").unwrap();
        let e = b
            .check_same_key("s", other.as_ref())
            .unwrap_err()
            .to_string();
        assert!(e.contains("its data key here is not the sender's"), "{e}");
        b.create_volume("p", 1 << 20, false, 1).unwrap();
        let e = b.check_same_key("p", Some(&sent)).unwrap_err().to_string();
        assert!(e.contains("not encrypted here"), "{e}");
        b.check_same_key("p", None).unwrap();

        let tag = a.transfer_tag(b"hello").unwrap();
        b.check_transfer_tag(&k.id(), b"hello", &tag).unwrap();
        let e = b.check_transfer_tag(&k.id(), b"hellO", &tag).unwrap_err();
        assert!(e.to_string().contains("does not prove"), "{e}");
        let e = b.check_transfer_tag("00ff", b"hello", &tag).unwrap_err();
        assert!(e.to_string().contains("same key-encryption key"), "{e}");
    }

    /// Only through a transfer listener (which took the key) is an encrypted volume sent.
    #[test]
    fn an_encrypted_volume_is_sendable_only_where_its_key_goes_too() {
        let d = tempfile::tempdir().unwrap();
        let k = Arc::new(Kek::generate().unwrap());
        let mut a = pool(d.path(), Some(&k));
        a.create_volume_opts("s", 1 << 20, false, 1, 1, true)
            .unwrap();
        let e = a.check_sendable("s", false).unwrap_err().to_string();
        assert!(e.contains("transfer listener"), "{e}");
        let e = a
            .send_volume("s", "nbd://127.0.0.1:1/s", false)
            .unwrap_err();
        assert!(e.to_string().contains("transfer listener"), "{e}");
        a.check_sendable("s", true).unwrap();
    }
}
