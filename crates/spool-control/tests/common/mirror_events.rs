//! The events a mirrored volume must survive while a guest or a workload runs on it, and what
//! each did: worker kills (with the regions each left in doubt), upgrades, short link-downs
//! and single transient errors on a leg's device, and a leg's device failing for good right
//! after a kill (then replaced by a fresh file, the next failure's spare).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::Spoold;

/// One mirrored volume "vm" under events (see the module doc).
pub struct MirrorEvents<'a> {
    d: &'a Spoold,
    pub kills: u64,
    pub upgrades: u64,
    pub flaps: u64,
    pub transients: u64,
    /// Devices failed for good (UUIDs), in order.
    pub failed: Vec<String>,
    /// Regions each kill left in doubt, and bytes still out of sync when a failure hit.
    pub in_doubt: Vec<u64>,
    pub out_of_sync_at_failure: Vec<u64>,
}

impl<'a> MirrorEvents<'a> {
    pub fn new(d: &'a Spoold) -> MirrorEvents<'a> {
        MirrorEvents {
            d,
            kills: 0,
            upgrades: 0,
            flaps: 0,
            transients: 0,
            failed: Vec::new(),
            in_doubt: Vec::new(),
            out_of_sync_at_failure: Vec::new(),
        }
    }

    pub fn mirror(&self) -> Value {
        self.d.rpc("volume_show", json!({"id": "vm"})).unwrap()["mirror"].clone()
    }

    /// The device of the leg in `slot` order position `i` (legs are listed by slot).
    fn leg_device(&self, i: usize) -> String {
        self.mirror()["legs"][i]["devices"][0]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// The mirror once the worker serves it again.
    fn served(&self) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let m = self.mirror();
            if m["legs"][0]["state"] != json!("idle") {
                return m;
            }
            assert!(Instant::now() < deadline, "not served again: {m}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn kill(&mut self) {
        self.d.kill_worker();
        self.kills += 1;
    }

    /// Event `i` of the cycle: kill, kill, upgrade, link-down, transient error (the last two
    /// on legs in turn).
    pub fn event(&mut self, i: u64) {
        match i % 5 {
            0 | 1 => {
                self.kill();
                let m = self.served();
                self.in_doubt
                    .push(m["resync_at_open"].as_u64().unwrap_or(0));
            }
            2 => {
                self.d.upgrade(None).expect("upgrade");
                self.upgrades += 1;
            }
            3 => {
                let dev = self.leg_device((i / 5 % 2) as usize);
                self.d
                    .rpc(
                        "device_inject",
                        json!({"id": dev, "kind": "link-down", "duration_ms": 300}),
                    )
                    .unwrap();
                self.flaps += 1;
            }
            _ => {
                let dev = self.leg_device((i / 5 % 2) as usize);
                self.d
                    .rpc("device_inject", json!({"id": dev, "kind": "transient"}))
                    .unwrap();
                self.transients += 1;
            }
        }
    }

    /// Waits (at most 3 minutes) until both copies are current and nothing is left to copy.
    pub fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let m = self.mirror();
            if m["state"] == json!("healthy") && m["remaining_bytes"] == json!(0) {
                return;
            }
            assert!(Instant::now() < deadline, "never healthy: {m}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The failure of issue 32: once healthy, the worker is killed and at once the device of
    /// the leg serving the reads of the regions it left in doubt (the lowest current slot)
    /// fails for good. From the second failure on, the device failed before is first
    /// replaced by a fresh file, so the failed leg has somewhere to move.
    pub fn fail_the_read_source_right_after_a_kill(&mut self, nth: u64) {
        self.wait_healthy();
        if let Some(old) = self.failed.last() {
            let new = self.d.dir.path().join(format!("spare{nth}.img"));
            self.d
                .rpc(
                    "device_replace",
                    json!({"old": old, "new": new, "create_size": 128u64 << 20}),
                )
                .unwrap();
        }
        let source = self.leg_device(0);
        // A kill that leaves regions in doubt (the guest has writes in flight most of the
        // time, not always).
        for _ in 0..10 {
            self.kill();
            if self.served()["resync_at_open"].as_u64().unwrap_or(0) > 0 {
                break;
            }
        }
        self.d
            .rpc(
                "device_inject",
                json!({"id": source, "kind": "media", "op": "any"}),
            )
            .unwrap();
        let m = self.served();
        self.in_doubt
            .push(m["resync_at_open"].as_u64().unwrap_or(0));
        self.out_of_sync_at_failure
            .push(m["out_of_sync_bytes"].as_u64().unwrap_or(0));
        self.failed.push(source);
    }

    /// One line on what was survived.
    pub fn summary(&self) -> String {
        let m = self.mirror();
        format!(
            "{} events: {} kills, {} upgrades, {} link-downs, {} transient errors, {} devices failed; regions in doubt after each kill: {:?}; bytes out of sync when each failure hit: {:?}; bitmap syncs {} (mean {} µs) since the last restart",
            self.kills + self.upgrades + self.flaps + self.transients,
            self.kills,
            self.upgrades,
            self.flaps,
            self.transients,
            self.failed.len(),
            self.in_doubt,
            self.out_of_sync_at_failure,
            m["bitmap_syncs"],
            m["bitmap_sync_us"],
        )
    }
}
