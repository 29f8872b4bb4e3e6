//! VFIO: the kernel interface that gives a process a PCI device's registers and an IOMMU
//! domain for its DMA (Documentation/driver-api/vfio.rst).
//!
//! One container per process holds every group, so one DMA mapping serves every controller.
//! Struct layouts come from rust-vmm's `vfio-bindings`; the handful of ioctls are issued
//! directly (rust-vmm's `vfio-ioctls` is built around a VMM's guest memory and KVM device
//! model, which a storage daemon does not have).
//!
//! Must not know: the DMA registry (`dma.rs` builds on this module, not the other way
//! round). What must be mapped once the first group sets the IOMMU type is the caller's
//! [`MapPending`]; the lock that orders the container's opening against registrations is
//! `mapping_lock`, which lives here because it guards the container's mappings.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use vfio_bindings::bindings::vfio as b;

use crate::handoff::{self, Handoff};
use crate::{Error, Result};

const VFIO_TYPE: u64 = b';' as u64;
const VFIO_BASE: u64 = 100;
const fn vfio_io(nr: u64) -> u64 {
    (VFIO_TYPE << 8) | (VFIO_BASE + nr)
}
const GET_API_VERSION: u64 = vfio_io(0);
const CHECK_EXTENSION: u64 = vfio_io(1);
const SET_IOMMU: u64 = vfio_io(2);
const GROUP_GET_STATUS: u64 = vfio_io(3);
const GROUP_SET_CONTAINER: u64 = vfio_io(4);
const GROUP_GET_DEVICE_FD: u64 = vfio_io(6);
const DEVICE_GET_REGION_INFO: u64 = vfio_io(8);
const DEVICE_SET_IRQS: u64 = vfio_io(10);
const DEVICE_RESET: u64 = vfio_io(11);
const IOMMU_MAP_DMA: u64 = vfio_io(13);
const IOMMU_UNMAP_DMA: u64 = vfio_io(14);

/// The process's VFIO container (IOMMU domain).
pub struct Container {
    file: File,
    /// Groups attached so far (kept open: closing a group detaches it).
    groups: Mutex<Vec<(u32, Arc<File>)>>,
    /// Taken over from the previous worker (IOMMU type set, old mappings still in place).
    pub restored: bool,
    /// Where the container and its groups are deposited: the handoff of the daemon that
    /// opened it (one per process, as the container is).
    handoff: Arc<Handoff>,
}

static CURRENT: Mutex<Option<Arc<Container>>> = Mutex::new(None);
/// Serialises registration, unregistration and map/unmap ioctls against container creation:
/// holders may drop the registry lock around ioctls (lookups go on) without the registry
/// changing under them. Process-wide like the container it guards.
static MAPPING: Mutex<()> = Mutex::new(());

/// Orders the container's opening and its first group's mappings against the DMA registry's
/// registrations and unregistrations (held across their map/unmap ioctls).
pub(crate) fn mapping_lock() -> std::sync::MutexGuard<'static, ()> {
    MAPPING.lock().unwrap_or_else(|p| p.into_inner())
}

/// Maps every region registered before the container could map (the DMA registry's
/// `map_all`); called with `mapping_lock` held, right after the first group set the IOMMU
/// type of a container this process opened.
pub type MapPending = fn(&Container) -> Result<()>;

impl Container {
    /// The container, if a controller has been opened.
    pub fn current() -> Option<Arc<Container>> {
        CURRENT.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The container, opened on first use (or taken from what `handoff` was offered).
    pub(crate) fn get(handoff: &Arc<Handoff>) -> Result<Arc<Container>> {
        let _g = mapping_lock();
        let mut cur = CURRENT.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cur.as_ref() {
            if !Arc::ptr_eq(&c.handoff, handoff) {
                // One daemon per process opens controllers, all with its one handoff; a
                // second one would find the container kept only through the first.
                tracing::warn!("a VFIO device is opened with another handoff than the container's: what it keeps goes through the container's");
            }
            return Ok(c.clone());
        }
        if let Some((_, mut files)) = handoff.take(handoff::CONTAINER_KEY) {
            if let Some(file) = files.pop() {
                let c = Arc::new(Container {
                    file,
                    groups: Mutex::new(Vec::new()),
                    restored: true,
                    handoff: handoff.clone(),
                });
                *cur = Some(c.clone());
                return Ok(c);
            }
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/vfio/vfio")
            .map_err(|e| Error::Os {
                what: "open /dev/vfio/vfio (is the vfio module loaded?)".into(),
                source: e,
            })?;
        // SAFETY: VFIO_GET_API_VERSION takes no argument.
        let v = unsafe { libc::ioctl(file.as_raw_fd(), GET_API_VERSION as _) };
        if v != b::VFIO_API_VERSION as i32 {
            return Err(Error::Invalid(format!(
                "VFIO API version {v} is not supported"
            )));
        }
        // SAFETY: VFIO_CHECK_EXTENSION takes an integer argument.
        let ok = unsafe {
            libc::ioctl(
                file.as_raw_fd(),
                CHECK_EXTENSION as _,
                b::VFIO_TYPE1v2_IOMMU,
            )
        };
        if ok != 1 {
            return Err(Error::Invalid(
                "VFIO has no type1v2 IOMMU (is vfio_iommu_type1 loaded and an IOMMU enabled?)"
                    .into(),
            ));
        }
        handoff.keep(handoff::CONTAINER_KEY, "{}".into(), &[file.as_raw_fd()]);
        let c = Arc::new(Container {
            file,
            groups: Mutex::new(Vec::new()),
            restored: false,
            handoff: handoff.clone(),
        });
        *cur = Some(c.clone());
        Ok(c)
    }

    /// Maps `[vaddr, vaddr+size)` of this process at `iova` for device reads and writes.
    pub(crate) fn map_dma(&self, vaddr: u64, iova: u64, size: u64) -> Result<()> {
        let m = b::vfio_iommu_type1_dma_map {
            argsz: std::mem::size_of::<b::vfio_iommu_type1_dma_map>() as u32,
            flags: b::VFIO_DMA_MAP_FLAG_READ | b::VFIO_DMA_MAP_FLAG_WRITE,
            vaddr,
            iova,
            size,
        };
        // SAFETY: the kernel reads the struct we pass (on our stack) and pins the pages of
        // the range, which the caller keeps mapped until it unmaps them.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), IOMMU_MAP_DMA as _, &m) } != 0 {
            return Err(Error::os(format!(
                "VFIO_IOMMU_MAP_DMA vaddr={vaddr:#x} iova={iova:#x} size={size:#x}"
            )));
        }
        Ok(())
    }

    /// Unmaps every mapping inside `[from, to)` (a previous worker's, after a takeover).
    pub(crate) fn unmap_range(&self, from: u64, to: u64) {
        self.unmap_dma(from, to - from);
    }

    /// Unmaps `[iova, iova+size)`; false (and logged) if the IOMMU refused, in which case
    /// the range may still be mapped and its IOVAs must not be reused.
    pub(crate) fn unmap_dma(&self, iova: u64, size: u64) -> bool {
        let mut m = b::vfio_iommu_type1_dma_unmap {
            argsz: std::mem::size_of::<b::vfio_iommu_type1_dma_unmap>() as u32,
            flags: 0,
            iova,
            size,
            data: Default::default(),
        };
        // SAFETY: the kernel reads and updates the struct we pass (on our stack).
        if unsafe { libc::ioctl(self.file.as_raw_fd(), IOMMU_UNMAP_DMA as _, &mut m) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOENT) {
                tracing::warn!(iova, size, error = %e, "VFIO_IOMMU_UNMAP_DMA failed");
                return false;
            }
        }
        true
    }

    /// Attaches the IOMMU group `n`; the first group also picks the IOMMU type and then has
    /// `map_pending` map what was registered before.
    fn attach_group(&self, n: u32, map_pending: MapPending) -> Result<Arc<File>> {
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, f)) = groups.iter().find(|(g, _)| *g == n) {
            return Ok(f.clone());
        }
        if let Some((_, mut files)) = self.handoff.take(&handoff::group_key(n)) {
            if let Some(f) = files.pop() {
                // Already attached to the (kept) container by the previous worker.
                let f = Arc::new(f);
                groups.push((n, f.clone()));
                return Ok(f);
            }
        }
        let path = format!("/dev/vfio/{n}");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::Os {
                what: format!("open {path} (another process holds the device, or it is not bound to vfio-pci)"),
                source: e,
            })?;
        let mut st = b::vfio_group_status {
            argsz: std::mem::size_of::<b::vfio_group_status>() as u32,
            flags: 0,
        };
        // SAFETY: the kernel fills the struct we pass (on our stack).
        if unsafe { libc::ioctl(f.as_raw_fd(), GROUP_GET_STATUS as _, &mut st) } != 0 {
            return Err(Error::os(format!("VFIO_GROUP_GET_STATUS {path}")));
        }
        if st.flags & b::VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(Error::Invalid(format!(
                "IOMMU group {n} is not viable: bind every device in it to vfio-pci"
            )));
        }
        let cfd = self.file.as_raw_fd();
        // SAFETY: the kernel reads the container descriptor through the pointer we pass.
        if unsafe { libc::ioctl(f.as_raw_fd(), GROUP_SET_CONTAINER as _, &cfd) } != 0 {
            return Err(Error::os(format!("VFIO_GROUP_SET_CONTAINER {path}")));
        }
        self.handoff
            .keep(&handoff::group_key(n), "{}".into(), &[f.as_raw_fd()]);
        if groups.is_empty() && !self.restored {
            // SAFETY: VFIO_SET_IOMMU takes an integer argument.
            if unsafe { libc::ioctl(cfd, SET_IOMMU as _, b::VFIO_TYPE1v2_IOMMU) } != 0 {
                return Err(Error::os("VFIO_SET_IOMMU type1v2"));
            }
            // Memory registered before the first controller (guest memory) can map now.
            let _g = mapping_lock();
            map_pending(self)?;
        }
        let f = Arc::new(f);
        groups.push((n, f.clone()));
        Ok(f)
    }
}

/// One PCI device opened through VFIO.
pub struct Device {
    pub bdf: String,
    file: File,
    config_offset: u64,
    _group: Arc<File>,
    _container: Arc<Container>,
}

/// A memory-mapped BAR.
pub struct Bar {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: the BAR is device memory; every access goes through volatile reads/writes by the
// owner, which serialises register use itself.
unsafe impl Send for Bar {}
// SAFETY: as above.
unsafe impl Sync for Bar {}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: unmapping the BAR mapping made in `Device::map_bar`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Checks a PCI address is in the `DDDD:BB:DD.F` form and returns it normalised.
pub fn parse_bdf(s: &str) -> Result<String> {
    let bad = || {
        Error::Invalid(format!(
            "\"{s}\" is not a PCI address (DDDD:BB:DD.F, e.g. 0000:00:04.0)"
        ))
    };
    let s = s.trim();
    let full = if s.matches(':').count() == 1 {
        format!("0000:{s}")
    } else {
        s.to_string()
    };
    let (dom, rest) = full.split_once(':').ok_or_else(bad)?;
    let (bus, rest) = rest.split_once(':').ok_or_else(bad)?;
    let (dev, func) = rest.split_once('.').ok_or_else(bad)?;
    let hex = |x: &str, n: usize| x.len() == n && x.chars().all(|c| c.is_ascii_hexdigit());
    if !(hex(dom, 4)
        && hex(bus, 2)
        && hex(dev, 2)
        && func.len() == 1
        && (b'0'..=b'7').contains(&func.as_bytes()[0]))
    {
        return Err(bad());
    }
    Ok(full.to_ascii_lowercase())
}

impl Device {
    /// Opens the device at PCI address `bdf`, which must be bound to vfio-pci; `kept` is its
    /// descriptor when a previous worker left it open (no new open, so no function reset);
    /// `map_pending` maps registered memory if this is the container's first group; the
    /// container is opened through `handoff` if no device opened it yet.
    pub fn open(
        bdf: &str,
        kept: Option<File>,
        map_pending: MapPending,
        handoff: &Arc<Handoff>,
    ) -> Result<Device> {
        let bdf = parse_bdf(bdf)?;
        let sys = Path::new("/sys/bus/pci/devices").join(&bdf);
        if !sys.exists() {
            return Err(Error::Invalid(format!("no PCI device {bdf}")));
        }
        let driver = std::fs::read_link(sys.join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
        if driver.as_deref() != Some("vfio-pci") && kept.is_none() {
            return Err(Error::Invalid(format!(
                "PCI device {bdf} is bound to {}, not vfio-pci (echo vfio-pci > {}/driver_override; echo {bdf} > /sys/bus/pci/drivers_probe)",
                driver.as_deref().unwrap_or("no driver"),
                sys.display()
            )));
        }
        let group = std::fs::read_link(sys.join("iommu_group"))
            .ok()
            .and_then(|p| p.file_name().and_then(|n| n.to_str()?.parse::<u32>().ok()))
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "PCI device {bdf} has no IOMMU group (boot with intel_iommu=on)"
                ))
            })?;
        let container = Container::get(handoff)?;
        let gfile = container.attach_group(group, map_pending)?;
        let file = match kept {
            Some(f) => f,
            None => {
                let name =
                    std::ffi::CString::new(bdf.clone()).expect("no NUL in a checked address");
                // SAFETY: the kernel reads the NUL-terminated name; the result is a new descriptor.
                let fd = unsafe {
                    libc::ioctl(gfile.as_raw_fd(), GROUP_GET_DEVICE_FD as _, name.as_ptr())
                };
                if fd < 0 {
                    return Err(Error::os(format!("VFIO_GROUP_GET_DEVICE_FD {bdf}")));
                }
                // SAFETY: `fd` is a fresh descriptor we exclusively own.
                unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) }
            }
        };
        let mut d = Device {
            bdf,
            file,
            config_offset: 0,
            _group: gfile,
            _container: container,
        };
        d.config_offset = d.region(b::VFIO_PCI_CONFIG_REGION_INDEX)?.offset;
        Ok(d)
    }

    fn region(&self, index: u32) -> Result<b::vfio_region_info> {
        let mut info = b::vfio_region_info {
            argsz: std::mem::size_of::<b::vfio_region_info>() as u32,
            index,
            ..Default::default()
        };
        // SAFETY: the kernel fills the struct we pass (on our stack); argsz says its size.
        if unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                DEVICE_GET_REGION_INFO as _,
                &mut info,
            )
        } != 0
        {
            return Err(Error::os(format!(
                "VFIO_DEVICE_GET_REGION_INFO {} region {index}",
                self.bdf
            )));
        }
        Ok(info)
    }

    /// The device descriptor (to deposit with a keeper).
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }

    /// Maps BAR `index` (0 for NVMe registers).
    pub fn map_bar(&self, index: u32) -> Result<Bar> {
        let info = self.region(index)?;
        if info.flags & b::VFIO_REGION_INFO_FLAG_MMAP == 0 || info.size == 0 {
            return Err(Error::Invalid(format!(
                "{}: BAR{index} cannot be memory-mapped",
                self.bdf
            )));
        }
        // SAFETY: maps the device region the kernel described; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                info.size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.file.as_raw_fd(),
                info.offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::os(format!("{}: mmap BAR{index}", self.bdf)));
        }
        Ok(Bar {
            ptr: ptr.cast(),
            len: info.size as usize,
        })
    }

    /// Reads a 16-bit PCI config register.
    pub fn config_read16(&self, at: u64) -> Result<u16> {
        let mut b = [0u8; 2];
        self.file
            .read_exact_at(&mut b, self.config_offset + at)
            .map_err(|e| Error::Os {
                what: format!("{}: read PCI config", self.bdf),
                source: e,
            })?;
        Ok(u16::from_le_bytes(b))
    }

    /// Writes a 16-bit PCI config register.
    pub fn config_write16(&self, at: u64, v: u16) -> Result<()> {
        self.file
            .write_all_at(&v.to_le_bytes(), self.config_offset + at)
            .map_err(|e| Error::Os {
                what: format!("{}: write PCI config", self.bdf),
                source: e,
            })
    }

    /// Turns on memory decoding and bus mastering (the device may DMA from now on).
    pub fn enable_bus_master(&self) -> Result<()> {
        let cmd = self.config_read16(4)?;
        self.config_write16(4, cmd | 0x6)
    }

    /// An eventfd the kernel signals when it wants the device back (PCI hot removal: the
    /// device is being unplugged and vfio-pci waits for us to let go of it). `None` when the
    /// kernel does not offer the request interrupt.
    pub fn request_eventfd(&self) -> Option<File> {
        // SAFETY: eventfd takes no pointers; the result is checked.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if efd < 0 {
            return None;
        }
        // SAFETY: `efd` is a fresh descriptor we exclusively own.
        let ev = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(efd) };
        #[repr(C)]
        struct IrqSetOne {
            hdr: b::vfio_irq_set,
            fd: i32,
        }
        let set = IrqSetOne {
            hdr: b::vfio_irq_set {
                argsz: std::mem::size_of::<IrqSetOne>() as u32,
                flags: b::VFIO_IRQ_SET_DATA_EVENTFD | b::VFIO_IRQ_SET_ACTION_TRIGGER,
                index: b::VFIO_PCI_REQ_IRQ_INDEX,
                start: 0,
                count: 1,
                data: Default::default(),
            },
            fd: ev.as_raw_fd(),
        };
        // SAFETY: the kernel reads the header and one descriptor from the struct we pass.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), DEVICE_SET_IRQS as _, &set) } != 0 {
            tracing::info!(device = %self.bdf, error = %std::io::Error::last_os_error(), "no VFIO device request interrupt: hot removal is seen only when the device stops answering");
            return None;
        }
        Some(ev)
    }

    /// Function-level reset through VFIO (used only when the controller does not respond).
    pub fn reset(&self) -> Result<()> {
        // SAFETY: VFIO_DEVICE_RESET takes no argument.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), DEVICE_RESET as _) } != 0 {
            return Err(Error::os(format!("VFIO_DEVICE_RESET {}", self.bdf)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_linux() {
        assert_eq!(GET_API_VERSION, 0x3b64);
        assert_eq!(IOMMU_MAP_DMA, 0x3b71);
        assert_eq!(IOMMU_UNMAP_DMA, 0x3b72);
        assert_eq!(GROUP_GET_DEVICE_FD, 0x3b6a);
    }

    #[test]
    fn pci_addresses() {
        assert_eq!(parse_bdf("0000:00:04.0").unwrap(), "0000:00:04.0");
        assert_eq!(parse_bdf("01:00.1").unwrap(), "0000:01:00.1");
        assert_eq!(parse_bdf("0000:0A:1f.7").unwrap(), "0000:0a:1f.7");
        for bad in [
            "",
            "00:04",
            "0000:00:04.8",
            "zz:00.0",
            "0000:00:004.0",
            "../../etc",
        ] {
            assert!(parse_bdf(bad).is_err(), "{bad}");
        }
    }
}
