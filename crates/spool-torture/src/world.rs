//! A world: a pool of real file devices of random sizes, its free space fragmented by
//! volumes made (and some deleted) first, and one volume of a kind the product allows under
//! test, with a health monitor watching the devices as the daemon's does.
//!
//! Owns: making the world from its spec, and opening it again from the devices (a restart).
//! Must not know: the requests, the model.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use spool_devices::{FaultEffect, FaultOps, FaultRule};
use spool_pool::{DeviceSpec, Pool, PoolOptions};

use crate::model::Wrong;
use crate::rng::Rng;

/// Bytes of an extent (and of a thin chunk).
pub const EXTENT: u64 = 1 << 20;

/// The volume's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Plain,
    Mirror(u8),
    Encrypted,
    EncryptedMirror(u8),
    Thin,
    EncryptedThin,
    MirroredThin(u8),
}

impl Kind {
    pub fn encrypted(self) -> bool {
        matches!(
            self,
            Kind::Encrypted | Kind::EncryptedMirror(_) | Kind::EncryptedThin
        )
    }

    pub fn thin(self) -> bool {
        matches!(
            self,
            Kind::Thin | Kind::EncryptedThin | Kind::MirroredThin(_)
        )
    }

    fn copies(self) -> u8 {
        match self {
            Kind::Mirror(n) | Kind::EncryptedMirror(n) | Kind::MirroredThin(n) => n,
            _ => 1,
        }
    }
}

/// What a world is made of (all of it from the seed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorldSpec {
    /// Device sizes, MiB.
    pub devices: Vec<u64>,
    /// Volumes made before the one under test (MiB, and whether deleted again).
    pub pads: Vec<(u64, bool)>,
    pub kind: Kind,
    /// The volume's size in bytes (a multiple of 512, often not of an extent).
    pub size: u64,
    /// Volume queues driving it.
    pub queues: usize,
}

impl WorldSpec {
    /// A random world.
    pub fn generate(rng: &mut Rng) -> WorldSpec {
        let n = 1 + rng.below(4) as usize;
        let devices: Vec<u64> = (0..n).map(|_| 24 + rng.below(48)).collect();
        let mut kinds = vec![
            Kind::Plain,
            Kind::Encrypted,
            Kind::Thin,
            Kind::EncryptedThin,
        ];
        if n >= 2 {
            kinds.extend([
                Kind::Mirror(2),
                Kind::EncryptedMirror(2),
                Kind::MirroredThin(2),
            ]);
        }
        if n >= 3 {
            kinds.extend([Kind::Mirror(3), Kind::MirroredThin(3)]);
        }
        let kind = kinds[rng.below(kinds.len() as u64) as usize];
        let pads = (0..rng.below(4))
            .map(|_| (1 + rng.below(4), rng.below(2) == 0))
            .collect();
        let smallest = *devices.iter().min().unwrap();
        let mib = 2 + rng.below(smallest / 2);
        let size = mib * EXTENT - rng.below(4) * 512 * (1 + rng.below(64));
        WorldSpec {
            devices,
            pads,
            kind,
            size,
            queues: 1 + rng.below(3) as usize,
        }
    }
}

/// The world's pool, its devices' paths and the monitor watching them.
pub struct World {
    pub spec: WorldSpec,
    pool: Option<Pool>,
    specs: Vec<DeviceSpec>,
    dir: std::path::PathBuf,
    kek: Arc<spool_crypt::Kek>,
    pub monitor: Arc<spool_health::Monitor>,
    /// Each device's power-cut log.
    logs: Vec<(std::path::PathBuf, Arc<spool_devices::WriteLog>)>,
}

/// The volume under test.
pub const VOLUME: &str = "v";

fn options(kek: &Arc<spool_crypt::Kek>, dir: &Path) -> PoolOptions {
    PoolOptions {
        min_extent: EXTENT,
        // Write-intent bitmaps on disk, as the daemon keeps them (in memory they survive no
        // restart).
        mirror_dir: Some(dir.join("mirror")),
        no_direct: true,
        kek: Some(kek.clone()),
        thin_full_wait: Duration::from_millis(300),
        lock_wait: Duration::from_secs(5),
        ..Default::default()
    }
}

fn monitor() -> Arc<spool_health::Monitor> {
    spool_health::Monitor::start(spool_health::Policy {
        reset_timeout: Duration::from_secs(5),
        poll_interval: Duration::from_millis(50),
        ..Default::default()
    })
}

impl World {
    /// Makes the world of `spec` in `dir`.
    pub fn build(dir: &Path, spec: &WorldSpec) -> Result<World, Wrong> {
        let specs: Vec<DeviceSpec> = (spec.devices.iter().enumerate())
            .map(|(i, &mib)| DeviceSpec {
                path: dir.join(format!("d{i}.img")),
                create_size: Some(mib << 20),
                null: None,
            })
            .collect();
        let kek = Arc::new(
            spool_crypt::Kek::from_material(&[0x5a; 32]).map_err(|e| format!("kek: {e}"))?,
        );
        let mut pool = Pool::open(&specs, options(&kek, dir)).map_err(|e| format!("open: {e}"))?;
        for (i, &(mib, delete)) in spec.pads.iter().enumerate() {
            let name = format!("pad{i}");
            pool.create_volume(&name, mib << 20, false, 1)
                .map_err(|e| format!("pad: {e}"))?;
            if delete {
                pool.delete_volume(&name).map_err(|e| format!("pad: {e}"))?;
            }
        }
        let (k, size) = (spec.kind, spec.size);
        let made = match k {
            _ if k.thin() => {
                pool.create_thin_copies(VOLUME, size, false, 1, k.copies(), k.encrypted())
            }
            _ => pool.create_volume_opts(VOLUME, size, false, 1, k.copies(), k.encrypted()),
        };
        made.map_err(|e| format!("creating the {k:?} volume of {size} bytes: {e}"))?;
        let monitor = monitor();
        for (u, d) in pool.device_handles() {
            monitor.watch(u, d);
        }
        let mut w = World {
            spec: spec.clone(),
            pool: Some(pool),
            specs,
            dir: dir.to_path_buf(),
            kek,
            monitor,
            logs: Vec::new(),
        };
        w.arm_logs();
        Ok(w)
    }

    /// Drops the pool and opens it again from its devices, as a restarted spoold does.
    pub fn reopen(&mut self) -> Result<(), Wrong> {
        // The monitor and the pool let go of the devices first: their locks go with them.
        self.monitor.stop();
        self.monitor = monitor();
        self.pool = None;
        let pool = Pool::open(&self.specs, options(&self.kek, &self.dir))
            .map_err(|e| format!("reopen: {e}"))?;
        for (u, d) in pool.device_handles() {
            self.monitor.watch(u, d);
        }
        self.pool = Some(pool);
        self.arm_logs();
        Ok(())
    }

    /// Arms a power-cut log on every device (before any queue of theirs opens).
    fn arm_logs(&mut self) {
        self.logs.clear();
        for (_, d) in self.pool().device_handles() {
            let path = d.path().to_path_buf();
            let file = std::fs::File::open(&path).ok();
            let log = Arc::new(spool_devices::WriteLog::new(Box::new(move |at, buf| {
                use std::os::unix::fs::FileExt;
                buf.fill(0);
                if let Some(f) = &file {
                    let _ = f.read_at(buf, at);
                }
            })));
            if d.faults().set_write_log(log.clone()) {
                self.logs.push((path, log));
            }
        }
    }

    /// Cuts the power: the pool goes (every request done), then each device keeps what its
    /// last completed flush covered and a random subset of the writes since (applied in
    /// order, as dm-log-writes replays do), and the pool opens again. Returns how many
    /// writes were lost.
    pub fn power_cut(&mut self, rng: &mut Rng) -> Result<u64, Wrong> {
        use std::os::unix::fs::FileExt;
        self.monitor.stop();
        self.monitor = monitor();
        self.pool = None;
        let mut lost = 0;
        for (path, log) in std::mem::take(&mut self.logs) {
            let writes = log.volatile();
            let f = (std::fs::OpenOptions::new().write(true).open(&path))
                .map_err(|e| format!("power cut: {}: {e}", path.display()))?;
            let put = |at: u64, data: &[u8]| {
                f.write_all_at(data, at)
                    .map_err(|e| Wrong(format!("power cut: {}: {e}", path.display())))
            };
            for w in writes.iter().rev() {
                put(w.offset, &w.old)?;
            }
            for w in &writes {
                match rng.chance(50) {
                    true => put(w.offset, &w.new)?,
                    false => lost += 1,
                }
            }
        }
        self.reopen()?;
        Ok(lost)
    }

    /// The pool (open but while `reopen` runs).
    pub fn pool(&mut self) -> &mut Pool {
        self.pool.as_mut().expect("the pool is open")
    }

    /// Arms a fault on device `dev` (modulo their number): its next `count` data or
    /// metadata reads or writes fail with EIO.
    pub fn fault(&mut self, dev: usize, meta: bool, write: bool, count: u64) {
        let devices = self.pool().device_handles();
        let (_, d) = &devices[dev % devices.len()];
        let ops = match (meta, write) {
            (true, true) => FaultOps::MetaWrite,
            (true, false) => FaultOps::MetaRead,
            (false, true) => FaultOps::Write,
            (false, false) => FaultOps::Read,
        };
        d.faults().add(FaultRule {
            effect: FaultEffect::Errno(libc::EIO),
            ops,
            offset: 0,
            len: 0,
            count: Some(count),
            duration: None,
            fails_probe: false,
        });
    }
}
