//! One NVMe controller: bring-up (reset, admin queue, enable), identify, I/O queue pair
//! creation for workers, synchronous I/O for pool metadata, health log pages.
//!
//! Only namespace 1 is used (a pool device is one namespace, as with a file).
//!
//! This module owns the controller's registers, bring-up, reset and admin command loop; the
//! rest of its life is split by job: `takeover` (controllers the previous worker left),
//! `admin_pages` (identify and log pages), `queues` (I/O queue pairs for workers) and
//! `sync_io` (metadata I/O). It must not know pools, volumes or the keeper's protocol.

mod admin_pages;
mod queues;
mod sync_io;
mod takeover;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

pub use admin_pages::{ErrorLogEntry, SmartLog};
use sync_io::SyncIo;
use takeover::Prepared;

use crate::arena::Arena;
use crate::handoff::Handoff;
use crate::spec::{self, admin, Cap, Sqe};
use crate::vfio::{Bar, Container, Device};
use crate::{DmaBuf, Error, QueuePair, Result, PAGE};

/// Identify Controller fields the driver uses.
#[derive(Debug, Clone, Default)]
pub struct ControllerInfo {
    pub serial: String,
    pub model: String,
    pub firmware: String,
    /// NVMe version (major, minor).
    pub version: (u16, u8),
    /// Largest transfer of one command, in bytes (MDTS; capped by the driver's PRP list).
    pub max_transfer: u64,
    /// Volatile write cache present (Flush means something).
    pub write_cache: bool,
    /// Optional NVM commands (ONCS): bit 2 Dataset Management, bit 3 Write Zeroes.
    pub oncs: u16,
    /// SGL support (SGLS bits 1:0): 0 none, 1 any alignment, 2 dword-aligned.
    pub sgl: u8,
    /// I/O queue pairs the controller granted.
    pub io_queues: u16,
    /// Largest queue the controller accepts (CAP.MQES).
    pub max_queue_entries: u32,
}

/// Namespace 1.
#[derive(Debug, Clone, Copy, Default)]
pub struct NamespaceInfo {
    pub nsid: u32,
    pub lba_size: u64,
    pub blocks: u64,
}

struct Admin {
    qp: QueuePair,
    /// Arena page 3: identify data and log pages.
    buf: (*mut u8, u64),
}

// SAFETY: `buf` points into the controller's arena, which lives as long as the controller;
// the admin lock serialises its use.
unsafe impl Send for Admin {}

/// An enabled controller.
pub struct Controller {
    bdf: String,
    /// The daemon's handoff: whether a keeper keeps the running controller at drop.
    handoff: Arc<Handoff>,
    // Field order is drop order: queues before the BAR they ring and the arena they live in,
    // the BAR before the device.
    admin: Mutex<Admin>,
    sync: Mutex<Option<SyncIo>>,
    arena: Arena,
    bar: Bar,
    /// Kept open while we drive the controller: closing the device descriptor hands it back
    /// to the kernel (which is what a hot removal waits for).
    dev: Mutex<Option<Device>>,
    /// Signalled by the kernel when it wants the device back (hot removal).
    removal: Option<std::fs::File>,
    /// SIGBUS-watch slot of the BAR mapping.
    bar_slot: Option<usize>,
    /// Released or found gone: every operation fails fast with [`Error::Gone`].
    gone: std::sync::atomic::AtomicBool,
    cap: Cap,
    info: ControllerInfo,
    ns: NamespaceInfo,
    qids: Mutex<Vec<bool>>,
    /// Queue pairs are created and deleted under the read side, a reset holds the write
    /// side: a queue pair exists on the controller exactly when its generation is current,
    /// and a reset never frees an identifier that a creation in progress holds.
    reset_gate: RwLock<()>,
    /// Times this process reset the controller (bring-up included).
    resets: AtomicU64,
    /// Taken over live from the previous worker (no reset).
    attached: bool,
    /// Data requests that pointed the controller straight at the caller's memory.
    pub zero_copy_requests: AtomicU64,
    /// Data requests that went through a bounce buffer.
    pub bounced_requests: AtomicU64,
    /// Zero-copy requests described by an SGL (scatter lists PRPs cannot describe).
    pub sgl_requests: AtomicU64,
    /// Flush, Dataset Management (deallocate) and Write Zeroes commands issued by I/O queues.
    pub flush_commands: AtomicU64,
    pub deallocate_commands: AtomicU64,
    pub write_zeroes_commands: AtomicU64,
}

const ADMIN_DEPTH: u16 = 32;
const SYNC_DEPTH: u16 = 16;
const SYNC_BUF: usize = 1 << 20;
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a re-attach waits for the previous worker's admin commands.
const RESUME_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest transfer per command: one PRP list page describes 512 pages plus PRP1.
const PRP_LIMIT: u64 = 512 * PAGE;

fn admin_qp(arena: &Arena, resume: bool, bar: *mut u8, stride: usize) -> QueuePair {
    // SAFETY: pages 1 and 2 of the arena hold the admin SQ (32 × 64 bytes) and CQ (32 × 16
    // bytes), the header's mirror is in page 0; the arena outlives the queue pair (the
    // controller drops its admin queue before its arena) and nothing else uses them.
    unsafe {
        QueuePair::in_shared_memory(
            0,
            ADMIN_DEPTH,
            arena.page(1),
            arena.page(2),
            &arena.header().admin,
            resume,
            bar,
            stride,
        )
    }
}

impl Controller {
    /// Opens the controller at PCI address `bdf` (bound to vfio-pci) and identifies
    /// namespace 1. A controller the previous worker left running (kept by the keeper) is
    /// taken over without a reset; any other is reset and enabled.
    /// What is kept for the next worker goes through `handoff` (the daemon's).
    pub fn open(bdf: &str, handoff: &Arc<Handoff>) -> Result<Arc<Controller>> {
        takeover::take_over_once(handoff);
        let bdf = crate::vfio::parse_bdf(bdf)?;
        let (dev, bar, arena, admin, attached) = Self::take_device(&bdf, handoff)?;
        dev.enable_bus_master()?;
        let (cap, vs) = Self::check_registers(&bdf, &bar)?;
        let admin = Admin {
            qp: match admin {
                Some(q) => q,
                None => admin_qp(&arena, false, bar.ptr, cap.doorbell_stride),
            },
            buf: arena.page(3),
        };
        let max_qid =
            ((bar.len - spec::REG_DOORBELLS) / (2 * cap.doorbell_stride)).min(1024) as u16 - 1;
        let removal = dev.request_eventfd();
        let bar_slot = crate::sigbus::watch(bar.ptr as usize, bar.len);
        handoff.keep(
            &crate::handoff::ctrl_key(&bdf),
            format!("{{\"arena_iova\":{}}}", arena.iova),
            &[dev.raw_fd(), arena.raw_fd()],
        );
        let mut c = Controller {
            handoff: handoff.clone(),
            bdf: bdf.clone(),
            admin: Mutex::new(admin),
            sync: Mutex::new(None),
            arena,
            bar,
            dev: Mutex::new(Some(dev)),
            removal,
            bar_slot,
            gone: Default::default(),
            cap,
            info: ControllerInfo::default(),
            ns: NamespaceInfo::default(),
            qids: Mutex::new(vec![false; max_qid as usize + 1]),
            reset_gate: RwLock::new(()),
            resets: AtomicU64::new(0),
            attached,
            zero_copy_requests: AtomicU64::new(0),
            bounced_requests: AtomicU64::new(0),
            sgl_requests: AtomicU64::new(0),
            flush_commands: AtomicU64::new(0),
            deallocate_commands: AtomicU64::new(0),
            write_zeroes_commands: AtomicU64::new(0),
        };
        c.bring_up(vs)?;
        Ok(Arc::new(c))
    }

    /// The device, its BAR, its arena and (when taken over live) its running admin queue:
    /// what the previous worker left of `bdf` if anything, else the device opened afresh.
    /// The last element is true for a live takeover (no reset).
    fn take_device(
        bdf: &str,
        handoff: &Arc<Handoff>,
    ) -> Result<(Device, Bar, Arena, Option<QueuePair>, bool)> {
        Ok(match takeover::take_prepared(bdf) {
            Some(Prepared::Attached {
                dev,
                bar,
                arena,
                admin,
            }) => (dev, bar, arena, Some(admin), true),
            Some(Prepared::Reset { dev, arena, why }) => {
                tracing::warn!(controller = %bdf, why = %why, "cannot re-attach to the controller the previous worker left: resetting it");
                let bar = dev.map_bar(0)?;
                let arena = match arena {
                    Some(a) => a,
                    None => Arena::create(&*Container::get(handoff)?)?,
                };
                (dev, bar, arena, None, false)
            }
            None => {
                let dev = Device::open(bdf, None, crate::dma::map_all, handoff)?;
                let bar = dev.map_bar(0)?;
                let arena = Arena::create(&*Container::get(handoff)?)?;
                (dev, bar, arena, None, false)
            }
        })
    }

    /// Checks that BAR0 holds an NVMe controller this driver can drive; returns its
    /// capabilities and its version register.
    fn check_registers(bdf: &str, bar: &Bar) -> Result<(Cap, u32)> {
        if bar.len < 0x2000 {
            return Err(Error::Invalid(format!(
                "{bdf}: BAR0 is {} bytes, too small for NVMe",
                bar.len
            )));
        }
        let rd32 = |at: usize| -> u32 {
            // SAFETY: `at` is a register offset inside the BAR (checked size above).
            unsafe { bar.ptr.add(at).cast::<u32>().read_volatile() }
        };
        let cap_raw = rd32(spec::REG_CAP) as u64 | (rd32(spec::REG_CAP + 4) as u64) << 32;
        if cap_raw == u64::MAX {
            return Err(Error::Gone(bdf.to_string()));
        }
        let cap = Cap::decode(cap_raw);
        if !cap.nvm || cap.mps_min > PAGE {
            return Err(Error::Invalid(format!(
                "{bdf}: controller lacks the NVM command set or 4 KiB pages (CAP {cap_raw:#x})"
            )));
        }
        Ok((cap, rd32(spec::REG_VS)))
    }

    /// Resets and enables the controller unless it was taken over live, identifies it and
    /// creates the synchronous queue; `vs` is its version register.
    fn bring_up(&mut self, vs: u32) -> Result<()> {
        let attached = self.attached;
        if !attached {
            self.reset_and_enable()?;
        }
        self.identify(!attached)?;
        self.info.version = ((vs >> 16) as u16, (vs >> 8) as u8);
        let qp = self.create_queue_pair(SYNC_DEPTH)?;
        *self.sync.get_mut().unwrap_or_else(|p| p.into_inner()) = Some(SyncIo {
            qp,
            buf: DmaBuf::new(SYNC_BUF)?,
        });
        tracing::info!(controller = %self.bdf, model = %self.info.model, serial = %self.info.serial,
            lba_size = self.ns.lba_size, blocks = self.ns.blocks, io_queues = self.info.io_queues,
            max_transfer = self.info.max_transfer, sgl = self.info.sgl, attached, resets = self.resets(), "NVMe controller ready");
        Ok(())
    }

    /// True when this process took the controller over live from the previous worker.
    pub fn attached(&self) -> bool {
        self.attached
    }

    fn rd32(&self, at: usize) -> u32 {
        // SAFETY: register offsets used here are below 0x1000, inside the BAR (checked at open).
        unsafe { self.bar.ptr.add(at).cast::<u32>().read_volatile() }
    }
    fn wr32(&self, at: usize, v: u32) {
        // SAFETY: as in rd32.
        unsafe { self.bar.ptr.add(at).cast::<u32>().write_volatile(v) }
    }
    fn wr64(&self, at: usize, v: u64) {
        self.wr32(at, v as u32);
        self.wr32(at + 4, (v >> 32) as u32);
    }

    fn wait_ready(&self, ready: bool) -> Result<()> {
        let deadline = Instant::now() + Duration::from_millis(self.cap.timeout_ms);
        loop {
            let csts = self.rd32(spec::REG_CSTS);
            if csts == u32::MAX {
                return Err(Error::Gone(self.bdf.clone()));
            }
            if ready && csts & spec::CSTS_CFS != 0 {
                return Err(Error::Invalid(format!(
                    "{}: controller fatal status while enabling",
                    self.bdf
                )));
            }
            if (csts & spec::CSTS_RDY != 0) == ready {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout(
                    self.bdf.clone(),
                    if ready { "becoming ready" } else { "disabling" },
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Disables the controller (aborting everything outstanding), reprograms the admin queue
    /// and enables it again.
    fn reset_and_enable(&self) -> Result<()> {
        let mut adm = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        self.resets.fetch_add(1, Ordering::AcqRel);
        self.wr32(spec::REG_CC, 0);
        self.wait_ready(false)?;
        // Every I/O queue is gone with the reset.
        for q in self.arena.header().live_qids() {
            self.arena.header().set_qid(q, false);
        }
        {
            let mut q = self.qids.lock().unwrap_or_else(|p| p.into_inner());
            q.iter_mut().for_each(|b| *b = false);
            if let Some(b) = q.first_mut() {
                *b = true;
            }
        }
        adm.qp = admin_qp(&self.arena, false, self.bar.ptr, self.cap.doorbell_stride);
        let (sq, cq) = (adm.qp.sq_iova(), adm.qp.cq_iova());
        let n = ADMIN_DEPTH as u32 - 1;
        self.wr32(spec::REG_AQA, (n << 16) | n);
        self.wr64(spec::REG_ASQ, sq);
        self.wr64(spec::REG_ACQ, cq);
        self.wr32(spec::REG_CC, spec::CC_ENTRY_SIZES | spec::CC_EN);
        self.wait_ready(true)
    }

    /// Asks for `want` I/O queue pairs (Set Features, Number of Queues); returns how many the
    /// controller granted (at most `want`).
    fn set_queue_count(&self, want: u32) -> Result<u16> {
        let dw0 = self.admin_cmd(
            Sqe {
                cdw10: spec::FEAT_NUM_QUEUES as u32,
                cdw11: ((want - 1) << 16) | (want - 1),
                ..Sqe::new(admin::SET_FEATURES, 0)
            },
            "set number of queues",
        )?;
        Ok(((dw0 & 0xffff).min(dw0 >> 16) + 1).min(want) as u16)
    }

    /// The controller generation: how many resets this process did. Queue pairs of an older
    /// generation no longer exist on the controller.
    pub fn generation(&self) -> u64 {
        self.resets.load(Ordering::Acquire)
    }

    /// Resets a running controller (a controller-level failure, a hang that deleting queues
    /// did not cure, or an operator's request): disable, re-create the admin queue, enable,
    /// grant queues again and re-create the synchronous queue. Every I/O queue pair is gone
    /// afterwards; their owners notice the new [`Controller::generation`], fail what they had
    /// outstanding with ECANCELED (the journal resubmits it) and create new ones.
    pub fn reset(&self) -> Result<()> {
        self.check_present()?;
        let t = Instant::now();
        let _gate = self.reset_gate.write().unwrap_or_else(|p| p.into_inner());
        let mut sync = self.sync.lock().unwrap_or_else(|p| p.into_inner());
        self.reset_and_enable()?;
        self.set_queue_count(self.info.io_queues.max(1) as u32)?;
        if let Some(s) = sync.as_mut() {
            s.qp = self.create_queue_pair_gated(SYNC_DEPTH)?;
        }
        tracing::warn!(controller = %self.bdf, ms = format!("{:.2}", t.elapsed().as_secs_f64() * 1e3), resets = self.resets(), "controller reset");
        Ok(())
    }

    /// Runs one admin command to completion; returns its dword 0.
    fn admin_cmd(&self, sqe: Sqe, what: &'static str) -> Result<u32> {
        self.check_present()?;
        let mut adm = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        Self::run_sync(&self.bdf, &mut adm.qp, sqe, what, &|| {
            self.rd32(spec::REG_CSTS)
        })
    }

    fn run_sync(
        bdf: &str,
        qp: &mut QueuePair,
        sqe: Sqe,
        what: &'static str,
        csts: &dyn Fn() -> u32,
    ) -> Result<u32> {
        let Some(cid) = qp.push(sqe) else {
            return Err(Error::Invalid(format!("{bdf}: queue {} is full", qp.qid)));
        };
        qp.ring();
        let deadline = Instant::now() + ADMIN_TIMEOUT;
        let mut result = None;
        let mut spins = 0u32;
        while result.is_none() {
            qp.poll(&mut |c| {
                if c.cid == cid {
                    result = Some(c);
                }
            });
            if result.is_some() {
                break;
            }
            spins += 1;
            if spins.is_multiple_of(1024) {
                let s = csts();
                if s == u32::MAX {
                    return Err(Error::Gone(bdf.to_string()));
                }
                if s & spec::CSTS_CFS != 0 {
                    return Err(Error::Invalid(format!(
                        "{bdf}: controller fatal status during {what}"
                    )));
                }
                if Instant::now() > deadline {
                    return Err(Error::Timeout(bdf.to_string(), what));
                }
                std::thread::yield_now();
            }
        }
        let c = result.expect("loop exits with a result");
        if c.status.ok() {
            Ok(c.dw0)
        } else {
            Err(Error::Command {
                bdf: bdf.to_string(),
                what,
                status: c.status,
            })
        }
    }

    pub fn bdf(&self) -> &str {
        &self.bdf
    }
    pub fn info(&self) -> &ControllerInfo {
        &self.info
    }
    pub fn namespace(&self) -> NamespaceInfo {
        self.ns
    }
    /// Namespace size in bytes.
    pub fn size(&self) -> u64 {
        self.ns.blocks * self.ns.lba_size
    }
    /// Controller resets done by this process (1 = the bring-up reset only).
    pub fn resets(&self) -> u64 {
        self.resets.load(Ordering::Relaxed)
    }
    /// Controller Status register (all ones: the device is gone).
    pub fn csts(&self) -> u32 {
        self.rd32(spec::REG_CSTS)
    }

    /// True once the controller was released, its BAR faulted (SIGBUS) or its registers read
    /// all ones (surprise removal).
    pub fn is_gone(&self) -> bool {
        if self.gone.load(Ordering::Acquire) {
            return true;
        }
        if self.bar_slot.is_some_and(crate::sigbus::faulted) || self.csts() == u32::MAX {
            self.gone.store(true, Ordering::Release);
            return true;
        }
        false
    }

    fn check_present(&self) -> Result<()> {
        if self.is_gone() {
            return Err(Error::Gone(self.bdf.clone()));
        }
        Ok(())
    }

    /// Whether the kernel asked for the device back (a hot removal is waiting for us).
    pub fn removal_requested(&self) -> bool {
        let Some(ev) = &self.removal else {
            return false;
        };
        let mut b = [0u8; 8];
        matches!(std::io::Read::read(&mut &*ev, &mut b), Ok(8))
    }

    /// Lets go of the device for good (hot removal, or a device found gone): the BAR is
    /// covered with an all-ones dummy mapping, so queue owners still ringing doorbells touch
    /// nothing and see "gone", and the VFIO device descriptor is closed, which lets the
    /// kernel finish the removal. Outstanding commands never complete; owners abort them.
    pub fn release(&self, why: &str) {
        let mut dev = self.dev.lock().unwrap_or_else(|p| p.into_inner());
        if dev.is_none() {
            return;
        }
        self.gone.store(true, Ordering::Release);
        // SAFETY: the BAR mapping is ours and stays mapped (now as dummy memory) until the
        // controller is dropped; concurrent accesses hit either the old or the new mapping.
        if !unsafe { crate::sigbus::cover_with_ones(self.bar.ptr as usize, self.bar.len) } {
            tracing::warn!(controller = %self.bdf, "cannot cover the BAR; keeping the device open");
            return;
        }
        drop(dev.take());
        // The keeper's copy of the descriptor must go too, or the removal keeps waiting.
        self.handoff.withdraw(&crate::handoff::ctrl_key(&self.bdf));
        tracing::warn!(controller = %self.bdf, why, "controller released");
    }
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("bdf", &self.bdf)
            .field("model", &self.info.model)
            .field("namespace", &self.ns)
            .finish()
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let Some(s) = self
            .sync
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            // Leave the rings to the shutdown below; deleting here needs the admin queue.
            drop(s);
        }
        if let Some(slot) = self.bar_slot {
            crate::sigbus::unwatch(slot);
        }
        if self.is_gone() || self.handoff.has_keeper() {
            // Kept by the keeper: the next worker takes the running controller over.
            return;
        }
        // Normal shutdown: the controller flushes its cache and stops DMA.
        let cc = self.rd32(spec::REG_CC);
        self.wr32(spec::REG_CC, cc | spec::CC_SHN_NORMAL);
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.rd32(spec::REG_CSTS) & (3 << 2) != spec::CSTS_SHST_DONE
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.wr32(spec::REG_CC, 0);
    }
}
