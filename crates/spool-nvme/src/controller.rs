//! One NVMe controller: bring-up (reset, admin queue, enable), identify, I/O queue pair
//! creation for workers, synchronous I/O for pool metadata, health log pages.
//!
//! Only namespace 1 is used (a pool device is one namespace, as with a file).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once, RwLock};
use std::time::{Duration, Instant};

use crate::arena::Arena;
use crate::spec::{self, admin, io, le16, le32, le64, Cap, Sqe, Status};
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

/// SMART / Health Information log (log page 0x02), the fields the health layer reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SmartLog {
    pub critical_warning: u8,
    /// Kelvin.
    pub temperature: u16,
    pub available_spare: u8,
    pub percentage_used: u8,
    pub media_errors: u64,
    pub error_log_entries: u64,
}

/// One Error Information log entry (log page 0x01).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorLogEntry {
    pub error_count: u64,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
    pub lba: u64,
    pub nsid: u32,
}

struct Admin {
    qp: QueuePair,
    /// Arena page 3: identify data and log pages.
    buf: (*mut u8, u64),
}

// SAFETY: `buf` points into the controller's arena, which lives as long as the controller;
// the admin lock serialises its use.
unsafe impl Send for Admin {}

struct SyncIo {
    qp: QueuePair,
    buf: DmaBuf,
}

/// An enabled controller.
pub struct Controller {
    bdf: String,
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

/// A controller the previous worker left, prepared by [`take_over_all`].
enum Prepared {
    /// Re-attached to the live admin queue; the old I/O queues are deleted.
    Attached {
        dev: Device,
        bar: Bar,
        arena: Arena,
        admin: QueuePair,
    },
    /// Could not re-attach (why): reset it, reusing the kept descriptor and arena.
    Reset {
        dev: Device,
        arena: Option<Arena>,
        why: String,
    },
}

static PREPARED: Mutex<Option<HashMap<String, Prepared>>> = Mutex::new(None);
static TAKEOVER: Once = Once::new();

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

/// Takes over every controller the previous worker deposited: re-attaches to each live admin
/// queue, deletes the previous worker's I/O queues (the controller aborts what they held),
/// then clears the previous worker's DMA mappings of guest and bounce memory. Runs once,
/// before any controller is opened.
fn take_over_all() {
    let bdfs = crate::handoff::offered_controllers();
    if bdfs.is_empty() {
        return;
    }
    let container = match Container::get() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot take the kept VFIO container over; controllers will be reopened and reset");
            return;
        }
    };
    let mut out = HashMap::new();
    for bdf in bdfs {
        let Some((value, mut files)) = crate::handoff::take(&crate::handoff::ctrl_key(&bdf)) else {
            continue;
        };
        let t = Instant::now();
        let iova = serde_iova(&value);
        let arena_file = if files.len() == 2 { files.pop() } else { None };
        let Some(dev_file) = files.pop() else {
            continue;
        };
        let dev = match Device::open(&bdf, Some(dev_file)) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(controller = %bdf, error = %e, "cannot reuse the kept device descriptor");
                continue;
            }
        };
        let arena = match (arena_file, iova) {
            (Some(f), Some(iova)) => match Arena::restore(f, iova) {
                Ok(a) => Some(a),
                Err(e) => {
                    tracing::warn!(controller = %bdf, error = %e, "kept arena unusable");
                    None
                }
            },
            _ => None,
        };
        let p = match arena {
            None => Prepared::Reset {
                dev,
                arena: None,
                why: "no usable arena was kept".into(),
            },
            Some(arena) => match attach(&bdf, &dev, &arena) {
                Ok((bar, admin)) => {
                    tracing::info!(controller = %bdf, ms = format!("{:.2}", t.elapsed().as_secs_f64() * 1e3),
                        "re-attached to the live controller (no reset); the previous worker's I/O queues are deleted");
                    Prepared::Attached {
                        dev,
                        bar,
                        arena,
                        admin,
                    }
                }
                Err(why) => Prepared::Reset {
                    dev,
                    arena: Some(arena),
                    why,
                },
            },
        };
        out.insert(bdf, p);
    }
    if container.restored {
        if let Err(e) = crate::dma::remap_all_after_takeover(&container) {
            tracing::error!(error = %e, "cannot map registered memory after the takeover");
        }
    }
    *PREPARED.lock().unwrap_or_else(|p| p.into_inner()) = Some(out);
}

fn serde_iova(value: &str) -> Option<u64> {
    // The kept value is `{"arena_iova":N}`.
    let v = value.split("\"arena_iova\":").nth(1)?;
    v.trim_end_matches('}').trim().parse().ok()
}

/// Re-attaches to a live controller's admin queue and deletes its I/O queues.
fn attach(bdf: &str, dev: &Device, arena: &Arena) -> std::result::Result<(Bar, QueuePair), String> {
    let bar = dev.map_bar(0).map_err(|e| e.to_string())?;
    // SAFETY: register offsets inside the BAR (NVMe BAR0 is at least 8 KiB; checked below).
    let rd32 = |at: usize| unsafe { bar.ptr.add(at).cast::<u32>().read_volatile() };
    if bar.len < 0x2000 {
        return Err("BAR0 too small".into());
    }
    let (cc, csts) = (rd32(spec::REG_CC), rd32(spec::REG_CSTS));
    if csts == u32::MAX {
        return Err("registers read all ones".into());
    }
    if cc & spec::CC_EN == 0 || csts & spec::CSTS_RDY == 0 || csts & spec::CSTS_CFS != 0 {
        return Err(format!(
            "controller not running (CC {cc:#x}, CSTS {csts:#x})"
        ));
    }
    let cap = Cap::decode(rd32(spec::REG_CAP) as u64 | (rd32(spec::REG_CAP + 4) as u64) << 32);
    let mut admin = admin_qp(arena, true, bar.ptr, cap.doorbell_stride);
    let left = arena
        .header()
        .admin
        .outstanding
        .load(std::sync::atomic::Ordering::Acquire);
    if admin.resume(RESUME_TIMEOUT).is_none() {
        return Err(format!(
            "{left} admin commands of the previous worker did not complete"
        ));
    }
    let csts_fn = || rd32(spec::REG_CSTS);
    for qid in arena.header().live_qids() {
        for (op, what) in [
            (admin::DELETE_SQ, "delete old I/O submission queue"),
            (admin::DELETE_CQ, "delete old I/O completion queue"),
        ] {
            match Controller::run_sync(
                bdf,
                &mut admin,
                Sqe {
                    cdw10: qid as u32,
                    ..Sqe::new(op, 0)
                },
                what,
                &csts_fn,
            ) {
                Ok(_) | Err(Error::Command { .. }) => {}
                Err(e) => return Err(format!("{what} {qid}: {e}")),
            }
        }
        arena.header().set_qid(qid, false);
    }
    Ok((bar, admin))
}

impl Controller {
    /// Opens the controller at PCI address `bdf` (bound to vfio-pci) and identifies
    /// namespace 1. A controller the previous worker left running (kept by the keeper) is
    /// taken over without a reset; any other is reset and enabled.
    pub fn open(bdf: &str) -> Result<Arc<Controller>> {
        TAKEOVER.call_once(take_over_all);
        let bdf = crate::vfio::parse_bdf(bdf)?;
        let prepared = PREPARED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .and_then(|m| m.remove(&bdf));
        let (dev, bar, arena, admin, attached) = match prepared {
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
                    None => Arena::create(&*Container::get()?)?,
                };
                (dev, bar, arena, None, false)
            }
            None => {
                let dev = Device::open(&bdf, None)?;
                let bar = dev.map_bar(0)?;
                let arena = Arena::create(&*Container::get()?)?;
                (dev, bar, arena, None, false)
            }
        };
        dev.enable_bus_master()?;
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
            return Err(Error::Gone(bdf));
        }
        let cap = Cap::decode(cap_raw);
        if !cap.nvm || cap.mps_min > PAGE {
            return Err(Error::Invalid(format!(
                "{bdf}: controller lacks the NVM command set or 4 KiB pages (CAP {cap_raw:#x})"
            )));
        }
        let vs = rd32(spec::REG_VS);
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
        crate::handoff::keep(
            &crate::handoff::ctrl_key(&bdf),
            format!("{{\"arena_iova\":{}}}", arena.iova),
            &[dev.raw_fd(), arena.raw_fd()],
        );
        let mut c = Controller {
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
        if !attached {
            c.reset_and_enable()?;
        }
        c.identify(!attached)?;
        c.info.version = ((vs >> 16) as u16, (vs >> 8) as u8);
        let qp = c.create_queue_pair(SYNC_DEPTH)?;
        *c.sync.get_mut().unwrap_or_else(|p| p.into_inner()) = Some(SyncIo {
            qp,
            buf: DmaBuf::new(SYNC_BUF)?,
        });
        tracing::info!(controller = %bdf, model = %c.info.model, serial = %c.info.serial,
            lba_size = c.ns.lba_size, blocks = c.ns.blocks, io_queues = c.info.io_queues,
            max_transfer = c.info.max_transfer, sgl = c.info.sgl, attached, resets = c.resets(), "NVMe controller ready");
        Ok(Arc::new(c))
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

    fn identify(&mut self, set_queues: bool) -> Result<()> {
        let page = self.admin_page(
            Sqe {
                cdw10: 1,
                ..Sqe::new(admin::IDENTIFY, 0)
            },
            "identify controller",
        )?;
        let mdts = page[77];
        let max_transfer = if mdts == 0 {
            PRP_LIMIT
        } else {
            (PAGE << mdts).min(PRP_LIMIT)
        };
        let mut info = ControllerInfo {
            serial: spec::ascii(&page[4..24]),
            model: spec::ascii(&page[24..64]),
            firmware: spec::ascii(&page[64..72]),
            max_transfer,
            oncs: le16(&page, 520),
            sgl: (le32(&page, 536) & 3) as u8,
            write_cache: page[525] & 1 == 1,
            max_queue_entries: self.cap.mqes,
            ..ControllerInfo::default()
        };
        let nn = le32(&page, 516);
        if nn == 0 {
            return Err(Error::Invalid(format!(
                "{}: controller has no namespaces",
                self.bdf
            )));
        }
        let ns = self.admin_page(
            Sqe {
                cdw10: 0,
                ..Sqe::new(admin::IDENTIFY, 1)
            },
            "identify namespace 1",
        )?;
        let blocks = le64(&ns, 0);
        let flbas = (ns[26] & 0xf) as usize;
        let lbads = ns[128 + 4 * flbas + 2];
        if blocks == 0 || !(9..=16).contains(&lbads) {
            return Err(Error::Invalid(format!(
                "{}: namespace 1 is not usable (size {blocks} blocks, LBA data size 2^{lbads})",
                self.bdf
            )));
        }
        let max_qid = self.qids.get_mut().unwrap_or_else(|p| p.into_inner()).len() as u32 - 1;
        let want = max_qid.min(64);
        let hdr = &self.arena.header().io_queues;
        let kept = hdr.load(std::sync::atomic::Ordering::Acquire);
        info.io_queues = if set_queues || kept == 0 {
            // Number of Queues may be set once per controller reset.
            self.set_queue_count(want)?
        } else {
            kept.min(want) as u16
        };
        hdr.store(info.io_queues as u32, std::sync::atomic::Ordering::Release);
        let qids = self.qids.get_mut().unwrap_or_else(|p| p.into_inner());
        qids.truncate(info.io_queues as usize + 1);
        qids[0] = true;
        self.info = info;
        self.ns = NamespaceInfo {
            nsid: 1,
            lba_size: 1 << lbads,
            blocks,
        };
        Ok(())
    }

    /// Runs an admin command that returns one 4 KiB page (PRP1 = the admin buffer).
    fn admin_page(&self, mut sqe: Sqe, what: &'static str) -> Result<Vec<u8>> {
        self.check_present()?;
        let mut adm = self.admin.lock().unwrap_or_else(|p| p.into_inner());
        let (ptr, iova) = adm.buf;
        // SAFETY: arena page 3 is 4 KiB reserved for admin data; the admin lock is held.
        unsafe { std::ptr::write_bytes(ptr, 0, PAGE as usize) };
        sqe.prp1 = iova;
        Self::run_sync(&self.bdf, &mut adm.qp, sqe, what, &|| {
            self.rd32(spec::REG_CSTS)
        })?;
        // SAFETY: as above; the command has completed, the controller no longer writes it.
        Ok(unsafe { std::slice::from_raw_parts(ptr, PAGE as usize) }.to_vec())
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
        crate::handoff::withdraw(&crate::handoff::ctrl_key(&self.bdf));
        tracing::warn!(controller = %self.bdf, why, "controller released");
    }

    /// Creates an I/O queue pair of up to `depth` entries for one worker.
    pub fn create_queue_pair(&self, depth: u16) -> Result<QueuePair> {
        let _gate = self.reset_gate.read().unwrap_or_else(|p| p.into_inner());
        self.create_queue_pair_gated(depth)
    }

    /// [`Controller::create_queue_pair`] with the reset gate held by the caller.
    fn create_queue_pair_gated(&self, depth: u16) -> Result<QueuePair> {
        self.check_present()?;
        let depth = (depth as u32).clamp(2, self.cap.mqes.min(1024)) as u16;
        let qid = {
            let mut q = self.qids.lock().unwrap_or_else(|p| p.into_inner());
            let Some(i) = q.iter().position(|b| !b) else {
                return Err(Error::Invalid(format!(
                    "{}: all {} I/O queues are in use (fewer workers or more controllers)",
                    self.bdf,
                    q.len() - 1
                )));
            };
            q[i] = true;
            // Recorded before the queue exists, so a successor deletes it whatever happens.
            self.arena.header().set_qid(i as u16, true);
            i as u16
        };
        let release = |e| {
            self.qids.lock().unwrap_or_else(|p| p.into_inner())[qid as usize] = false;
            self.arena.header().set_qid(qid, false);
            e
        };
        let mut qp =
            QueuePair::new(qid, depth, self.bar.ptr, self.cap.doorbell_stride).map_err(release)?;
        qp.generation = self.generation();
        let size_qid = ((depth as u32 - 1) << 16) | qid as u32;
        self.admin_cmd(
            Sqe {
                prp1: qp.cq_iova(),
                cdw10: size_qid,
                cdw11: 1,
                ..Sqe::new(admin::CREATE_CQ, 0)
            },
            "create I/O completion queue",
        )
        .map_err(release)?;
        if let Err(e) = self.admin_cmd(
            Sqe {
                prp1: qp.sq_iova(),
                cdw10: size_qid,
                cdw11: ((qid as u32) << 16) | 1,
                ..Sqe::new(admin::CREATE_SQ, 0)
            },
            "create I/O submission queue",
        ) {
            let _ = self.admin_cmd(
                Sqe {
                    cdw10: qid as u32,
                    ..Sqe::new(admin::DELETE_CQ, 0)
                },
                "delete I/O completion queue",
            );
            return Err(release(e));
        }
        Ok(qp)
    }

    /// Deletes a queue pair made by [`Controller::create_queue_pair`]; outstanding commands
    /// are aborted by the controller.
    pub fn delete_queue_pair(&self, qp: QueuePair) {
        let _gate = self.reset_gate.read().unwrap_or_else(|p| p.into_inner());
        let qid = qp.qid as u32;
        if qp.generation != self.generation() {
            // A reset already destroyed it (and freed its identifier, which may be reused by
            // now): nothing to tell the controller.
            drop(qp);
            return;
        }
        if self.is_gone() {
            // Nothing to tell a controller that is gone; its rings can simply be freed.
            drop(qp);
            return;
        }
        let r1 = self.admin_cmd(
            Sqe {
                cdw10: qid,
                ..Sqe::new(admin::DELETE_SQ, 0)
            },
            "delete I/O submission queue",
        );
        let r2 = self.admin_cmd(
            Sqe {
                cdw10: qid,
                ..Sqe::new(admin::DELETE_CQ, 0)
            },
            "delete I/O completion queue",
        );
        if let Err(e) = r1.and(r2) {
            tracing::warn!(controller = %self.bdf, qid, error = %e, "cannot delete I/O queue pair");
        }
        // The rings stay allocated until here, after the controller let go of them.
        drop(qp);
        self.arena.header().set_qid(qid as u16, false);
        if let Some(b) = self
            .qids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(qid as usize)
        {
            *b = false;
        }
    }

    fn sync_io<F>(&self, what: &'static str, mut f: F) -> Result<()>
    where
        F: FnMut(&mut dyn FnMut(Sqe) -> Result<()>, &mut DmaBuf) -> Result<()>,
    {
        self.check_present()?;
        let mut g = self.sync.lock().unwrap_or_else(|p| p.into_inner());
        let s = g
            .as_mut()
            .ok_or_else(|| Error::Invalid(format!("{}: no synchronous queue", self.bdf)))?;
        let SyncIo { qp, buf } = s;
        let buf_iova = buf.iova();
        let bdf = self.bdf.clone();
        let csts = || self.rd32(spec::REG_CSTS);
        let mut run = |mut sqe: Sqe| -> Result<()> {
            if sqe.prp1 == u64::MAX {
                // Data in the sync buffer: PRP1 its start, PRP2 a list if needed (built in
                // the buffer's last page, which data never uses).
                let len = ((sqe.cdw12 & 0xffff) as u64 + 1) * self.ns.lba_size;
                let pages = len.div_ceil(PAGE);
                sqe.prp1 = buf_iova;
                if pages == 2 {
                    sqe.prp2 = buf_iova + PAGE;
                } else if pages > 2 {
                    sqe.prp2 = buf_iova + (SYNC_BUF as u64 - PAGE);
                }
            }
            Self::run_sync(&bdf, qp, sqe, what, &csts).map(|_| ())
        };
        f(&mut run, buf)
    }

    /// Largest data chunk the synchronous path moves per command.
    fn sync_chunk(&self) -> u64 {
        (SYNC_BUF as u64 - PAGE).min(self.info.max_transfer)
    }

    fn write_prp_list(buf: &mut DmaBuf, pages: u64) {
        let iova = buf.iova();
        let last = SYNC_BUF - PAGE as usize;
        let list = &mut buf.bytes_mut()[last..];
        for i in 1..pages.min(512) {
            list[(i as usize - 1) * 8..i as usize * 8]
                .copy_from_slice(&(iova + i * PAGE).to_le_bytes());
        }
    }

    fn check(&self, offset: u64, len: u64) -> Result<()> {
        let lba = self.ns.lba_size;
        if !offset.is_multiple_of(lba)
            || !len.is_multiple_of(lba)
            || offset.checked_add(len).is_none_or(|e| e > self.size())
        {
            return Err(Error::Invalid(format!(
                "{}: access {offset}+{len} is not whole {lba}-byte blocks inside the namespace",
                self.bdf
            )));
        }
        Ok(())
    }

    /// Synchronous block-aligned read (pool metadata, probes; never the data path).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len() as u64)?;
        let chunk = self.sync_chunk();
        let lba = self.ns.lba_size;
        let nsid = self.ns.nsid;
        self.sync_io("read", |run, buf| {
            let mut done = 0u64;
            while done < out.len() as u64 {
                let n = (out.len() as u64 - done).min(chunk);
                Self::write_prp_list(buf, n.div_ceil(PAGE));
                let sqe = Sqe {
                    prp1: u64::MAX,
                    ..Sqe::new(io::READ, nsid).lba((offset + done) / lba, (n / lba) as u32)
                };
                run(sqe)?;
                out[done as usize..(done + n) as usize].copy_from_slice(&buf.bytes()[..n as usize]);
                done += n;
            }
            Ok(())
        })
    }

    /// Synchronous block-aligned write followed by a flush (durable when it returns).
    pub fn write_durable(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len() as u64)?;
        let chunk = self.sync_chunk();
        let lba = self.ns.lba_size;
        let nsid = self.ns.nsid;
        let flush = self.info.write_cache;
        self.sync_io("write", |run, buf| {
            let mut done = 0u64;
            while done < data.len() as u64 {
                let n = (data.len() as u64 - done).min(chunk);
                buf.bytes_mut()[..n as usize]
                    .copy_from_slice(&data[done as usize..(done + n) as usize]);
                Self::write_prp_list(buf, n.div_ceil(PAGE));
                let sqe = Sqe {
                    prp1: u64::MAX,
                    ..Sqe::new(io::WRITE, nsid).lba((offset + done) / lba, (n / lba) as u32)
                };
                run(sqe)?;
                done += n;
            }
            if flush {
                run(Sqe::new(io::FLUSH, nsid))?;
            }
            Ok(())
        })
    }

    /// Makes a block-aligned range read back as zeroes, durably: Write Zeroes when the
    /// controller has it, zero-filled writes otherwise.
    pub fn zero_durable(&self, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        let lba = self.ns.lba_size;
        let nsid = self.ns.nsid;
        let has_wz = self.info.oncs & (1 << 3) != 0;
        let chunk = if has_wz {
            0x10000 * lba
        } else {
            self.sync_chunk()
        };
        let flush = self.info.write_cache;
        self.sync_io("write zeroes", |run, buf| {
            let mut done = 0u64;
            if !has_wz {
                buf.bytes_mut().fill(0);
            }
            while done < len {
                let n = (len - done).min(chunk);
                let mut sqe = Sqe::new(if has_wz { io::WRITE_ZEROES } else { io::WRITE }, nsid)
                    .lba((offset + done) / lba, (n / lba) as u32);
                if !has_wz {
                    Self::write_prp_list(buf, n.div_ceil(PAGE));
                    sqe.prp1 = u64::MAX;
                }
                run(sqe)?;
                done += n;
            }
            if flush {
                run(Sqe::new(io::FLUSH, nsid))?;
            }
            Ok(())
        })
    }

    /// Reads the SMART / Health Information log.
    pub fn smart_log(&self) -> Result<SmartLog> {
        let p = self.admin_page(
            Sqe {
                cdw10: ((512 / 4 - 1) << 16) | spec::LOG_SMART as u32,
                ..Sqe::new(admin::GET_LOG_PAGE, 0xffff_ffff)
            },
            "get SMART log",
        )?;
        Ok(SmartLog {
            critical_warning: p[0],
            temperature: le16(&p, 1),
            available_spare: p[3],
            percentage_used: p[5],
            media_errors: le64(&p, 160),
            error_log_entries: le64(&p, 176),
        })
    }

    /// Reads the newest `n` (≤ 64) Error Information log entries (non-empty ones).
    pub fn error_log(&self, n: usize) -> Result<Vec<ErrorLogEntry>> {
        let n = n.clamp(1, 64);
        let p = self.admin_page(
            Sqe {
                cdw10: (((n * 64 / 4 - 1) as u32) << 16) | spec::LOG_ERROR as u32,
                ..Sqe::new(admin::GET_LOG_PAGE, 0)
            },
            "get error log",
        )?;
        Ok((0..n)
            .map(|i| &p[i * 64..(i + 1) * 64])
            .map(|e| ErrorLogEntry {
                error_count: le64(e, 0),
                sqid: le16(e, 8),
                cid: le16(e, 10),
                status: Status::from_cqe(le16(e, 12)),
                lba: le64(e, 16),
                nsid: le32(e, 24),
            })
            .filter(|e| e.error_count != 0)
            .collect())
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
        if self.is_gone() || crate::handoff::has_keeper() {
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
