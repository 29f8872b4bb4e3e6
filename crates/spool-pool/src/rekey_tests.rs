//! Rekeys that fail part way, and restarts between a rekey and the config change: every
//! encrypted volume stays served, whichever order the operator's steps and the restarts
//! come in (docs/encryption.md, "Rotating the key-encryption key").

use std::sync::Arc;

use spool_crypt::Kek;

use crate::metadata::{METADATA_AREA, SLOT_SIZE};
use crate::tests::{opts, spec};
use crate::{Pool, PoolOptions};

/// Options with `kek` configured and `kept` handed over by a previous worker.
fn keys(kek: &Arc<Kek>, kept: &[Arc<Kek>]) -> PoolOptions {
    PoolOptions {
        kek: Some(kek.clone()),
        other_keks: kept.to_vec(),
        ..opts()
    }
}

fn key() -> Arc<Kek> {
    Arc::new(Kek::generate().unwrap())
}

/// A pool on one member with encrypted volume `s` under `k1`; returns its data key.
fn one_encrypted(d: &std::path::Path, k1: &Arc<Kek>) -> ([crate::DeviceSpec; 1], Vec<u8>) {
    let specs = [spec(d, "a", 9)];
    let mut p = Pool::open(&specs, keys(k1, &[])).unwrap();
    p.create_volume_opts("s", 2 << 20, false, 1, 1, true)
        .unwrap();
    let dk = p.export_data_key("s").unwrap().bytes().to_vec();
    (specs, dk)
}

/// `volume rekey --key-file NEW`, then the worker restarts before the config gives NEW: the
/// previous worker's keys (the keeper's) serve the volume, NEW is the key in use and the old
/// one, which nothing is wrapped under any more, is let go. Before, the restart loaded the
/// old key alone and the volume was not served.
#[test]
fn a_restart_between_a_rekey_and_the_config_change_serves_every_volume() {
    let d = tempfile::tempdir().unwrap();
    let (k1, k2) = (key(), key());
    let (specs, dk) = one_encrypted(d.path(), &k1);
    let mut p = Pool::open(&specs, keys(&k1, &[])).unwrap();
    assert_eq!(p.rekey(k2.clone()).unwrap(), 1);
    assert_eq!(p.kek_ids(), vec![k2.id()], "the old key is let go");
    let kept = p.keks();
    drop(p);
    let p = Pool::open(&specs, keys(&k1, &kept)).unwrap();
    assert_eq!(p.export_data_key("s").unwrap().bytes(), &dk[..]);
    assert_eq!(p.kek_id(), Some(k2.id()));
    assert_eq!(p.kek_ids(), vec![k2.id()]);
    drop(p);
    // Without the kept key (the whole daemon restarted) the old key is refused by name.
    let p = Pool::open(&specs, keys(&k1, &[])).unwrap();
    let e = p.layout("s").unwrap_err().to_string();
    assert!(e.contains(&k1.id()) && e.contains(&k2.id()), "{e}");
}

/// The documented order: the new key where the config points, then the rekey. A restart in
/// between loads the new key from the config; the kept old one serves the volume and stays
/// the key in use (new volumes are wrapped under it), and the rekey then moves everything.
#[test]
fn a_restart_between_the_new_key_in_place_and_the_rekey_serves_every_volume() {
    let d = tempfile::tempdir().unwrap();
    let (k1, k2) = (key(), key());
    let (specs, dk) = one_encrypted(d.path(), &k1);
    let kept = vec![k1.clone()];
    let mut p = Pool::open(&specs, keys(&k2, &kept)).unwrap();
    assert_eq!(p.export_data_key("s").unwrap().bytes(), &dk[..]);
    assert_eq!(p.kek_id(), Some(k1.id()), "the key the table names");
    p.create_volume_opts("t", 2 << 20, false, 1, 1, true)
        .unwrap();
    assert_eq!(p.rekey(k2.clone()).unwrap(), 2);
    assert_eq!(p.kek_ids(), vec![k2.id()]);
    drop(p);
    let p = Pool::open(&specs, keys(&k2, &[])).unwrap();
    assert_eq!(p.export_data_key("s").unwrap().bytes(), &dk[..]);
    assert!(p.layout("t").is_ok());
}

/// The second of a rekey's two commits fails (the first rewrapped the table in memory and on
/// the member): both keys stay, the volume is served, a worker restart with the kept keys
/// serves it too, and the rekey run again finishes. Before, the key in use stayed the old
/// one while the table named the new: the volume's key no longer unwrapped.
#[test]
fn a_rekey_that_fails_part_way_keeps_both_keys_and_finishes_when_run_again() {
    let d = tempfile::tempdir().unwrap();
    let (k1, k2) = (key(), key());
    let (specs, dk) = one_encrypted(d.path(), &k1);
    let mut p = Pool::open(&specs, keys(&k1, &[])).unwrap();
    // The second commit goes to the slot the current table is in.
    let slot = p.generation % 2;
    p.members[0].dev.faults().add(spool_devices::FaultRule {
        effect: spool_devices::FaultEffect::Errno(5),
        ops: spool_devices::FaultOps::MetaWrite,
        offset: slot * SLOT_SIZE,
        len: SLOT_SIZE.min(METADATA_AREA),
        count: Some(1),
        duration: None,
        fails_probe: false,
    });
    p.rekey(k2.clone()).unwrap_err();
    let mut ids = p.kek_ids();
    ids.sort();
    let mut both = vec![k1.id(), k2.id()];
    both.sort();
    assert_eq!(ids, both, "both keys are kept");
    p.drop_cipher(p.table.volumes[0].uuid);
    assert_eq!(p.export_data_key("s").unwrap().bytes(), &dk[..]);
    assert!(p.layout("s").is_ok(), "the volume's cipher opens");
    let kept = p.keks();
    drop(p);
    let mut p = Pool::open(&specs, keys(&k1, &kept)).unwrap();
    assert_eq!(p.export_data_key("s").unwrap().bytes(), &dk[..]);
    p.rekey(k2.clone()).unwrap();
    assert_eq!(p.kek_ids(), vec![k2.id()]);
    drop(p);
    let p = Pool::open(&specs, keys(&k2, &[])).unwrap();
    assert_eq!(p.export_data_key("s").unwrap().bytes(), &dk[..]);
}
