//! A user-space NVMe driver over VFIO: spec `vfio:0000:00:04.0`.
//!
//! The PCI function must be bound to `vfio-pci` and its IOMMU group must be viable. Opening
//! it: the group joins a type-1 IOMMU container, BAR0 is mapped, bus mastering is enabled,
//! the controller is disabled, given an admin queue and enabled again, then Identify
//! Controller and Identify Namespace (namespace 1) tell the block size, capacity and MDTS.
//! Each [`VfioController::create_queue_pair`] creates one I/O completion/submission queue
//! pair on the controller, owned by the calling reactor; the reactor rings its doorbells and
//! reaps its completion queue by phase tag, with no kernel on the I/O path. MSI-X vector
//! `qid` is routed to an eventfd, the queue pair's [`QueuePair::interrupt_fd`].
//!
//! Data moves through bounce pages: each queue pair owns a pool of pinned 4 KiB pages mapped
//! for the device; a write is copied in before the doorbell, a read copied out when its
//! completion is reaped. PRP lists name the pages, so they need not be contiguous.
//!
//! [`VfioController::reset`] resets the controller (CC.EN 1 -> 0 -> 1) and rebuilds the
//! admin queue; each queue pair notices on its next call, completes every command the
//! controller had not completed with "Command Aborted due to SQ Deletion", and recreates
//! its I/O queues, after which new I/O works.
//!
//! Layout: `sys` (ioctls, mmap: the kernel interface), `dma` (IOVA allocator, DMA regions,
//! page pool), `regs` (BAR0 registers and doorbells), `prp` (PRP entries and lists),
//! `queue` (the I/O queue pair). See docs/vfio.md for running it under QEMU.

mod dma;
mod prp;
mod queue;
mod regs;
mod sys;

use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::qpair::{Controller, QueuePair, QueuePairError, QUEUE_DEPTH_MAX};
use crate::spec::{CompletionEntry, NamespaceInfo, Opcode, Status, SubmissionEntry};
use crate::sys::EventFd;

pub use dma::{IovaAllocator, PagePool, IOVA_BASE, IOVA_END};
pub use prp::{build as build_prps, pages_spanned, PrpError, PAGE_BYTES};
pub use queue::VfioQueuePair;

/// Entries of the admin submission and completion queues.
pub const ADMIN_QUEUE_ENTRIES: u16 = 32;
/// How long one admin command may take (generous: QEMU under software emulation is slow).
pub const ADMIN_TIMEOUT_MS: u64 = 10_000;
/// I/O queue pairs the driver asks the controller for (Set Features, Number of Queues).
pub const IO_QUEUES_MAX: u16 = 63;
/// The largest transfer one command may move: the bounce pages of one command, and so the
/// size of a slot's PRP list. The namespace reports min(MDTS, this).
pub const TRANSFER_BYTES_MAX: u32 = 128 << 10;
/// Bounce memory per queue pair is depth x TRANSFER_BYTES_MAX, capped at this: deep queues
/// of small I/O share the pool, and a command that finds too few free pages is back-pressure
/// ([`crate::SubmitError::QueueFull`]).
pub const BOUNCE_POOL_BYTES_MAX: usize = 8 << 20;
/// Longest wait for CSTS.RDY to follow CC.EN when CAP.TO says less (or nothing).
const READY_TIMEOUT_MS_MIN: u64 = 2_000;

/// Admin opcodes (Base spec, "Opcodes for Admin Commands").
mod admin_op {
    pub const DELETE_IO_SQ: u8 = 0x00;
    pub const CREATE_IO_SQ: u8 = 0x01;
    pub const DELETE_IO_CQ: u8 = 0x04;
    pub const CREATE_IO_CQ: u8 = 0x05;
    pub const IDENTIFY: u8 = 0x06;
    pub const SET_FEATURES: u8 = 0x09;
}
const CNS_NAMESPACE: u32 = 0x00;
const CNS_CONTROLLER: u32 = 0x01;
const FEATURE_NUMBER_OF_QUEUES: u32 = 0x07;

/// Where the driver looks for sysfs and device nodes (tests point these at a fake tree).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SysPaths {
    pub sysfs: PathBuf,
    pub dev: PathBuf,
}

impl Default for SysPaths {
    fn default() -> Self {
        SysPaths {
            sysfs: PathBuf::from("/sys"),
            dev: PathBuf::from("/dev"),
        }
    }
}

/// A parsed `vfio:` spec: the PCI function's address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VfioConfig {
    /// Domain:bus:device.function, as sysfs writes it: `0000:00:04.0`.
    pub bdf: String,
    pub paths: SysPaths,
}

impl VfioConfig {
    /// Parses a PCI address `dddd:bb:dd.f` (or `bb:dd.f`, domain 0), hex, lower-cased. The
    /// error says what was expected (the caller names the bad value).
    pub fn parse(addr: &str) -> Result<VfioConfig, String> {
        let expected = "a PCI address such as 0000:00:04.0 (domain:bus:device.function, hex)";
        let full = if addr.matches(':').count() == 1 {
            format!("0000:{addr}")
        } else {
            addr.to_string()
        };
        let bad = || expected.to_string();
        let (dbd, func) = full.rsplit_once('.').ok_or_else(bad)?;
        let parts: Vec<&str> = dbd.split(':').collect();
        let [domain, bus, dev] = parts[..] else {
            return Err(bad());
        };
        let hex = |s: &str, len: usize, max: u32| {
            (s.len() == len && s.chars().all(|c| c.is_ascii_hexdigit()))
                .then(|| u32::from_str_radix(s, 16).ok())
                .flatten()
                .filter(|v| *v <= max)
        };
        let (Some(domain), Some(bus), Some(dev), Some(func)) = (
            hex(domain, 4, 0xffff),
            hex(bus, 2, 0xff),
            hex(dev, 2, 0x1f),
            hex(func, 1, 7),
        ) else {
            return Err(bad());
        };
        Ok(VfioConfig {
            bdf: format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"),
            paths: SysPaths::default(),
        })
    }
}

impl fmt::Display for VfioConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "vfio:{}", self.bdf)
    }
}

/// Why a VFIO device could not be opened or driven. Each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error(
        "no PCI function {bdf} (nothing at {path}); list functions with `ls /sys/bus/pci/devices`"
    )]
    NoSuchDevice { bdf: String, path: PathBuf },
    #[error(
        "PCI function {bdf} is not bound to vfio-pci ({}); {}",
        match driver { Some(d) => format!("it is bound to {d}"), None => "it has no driver".into() },
        bind_hint(bdf, driver.as_deref())
    )]
    NotBoundToVfio { bdf: String, driver: Option<String> },
    #[error(
        "PCI function {bdf} has no IOMMU group: the kernel runs without an IOMMU; boot with \
         intel_iommu=on (or amd_iommu=on) and an IOMMU enabled in firmware or the VM"
    )]
    NoIommuGroup { bdf: String },
    #[error(
        "{path} is missing: load the VFIO modules (modprobe vfio-pci, which loads vfio and \
         vfio_iommu_type1) and check that /dev is devtmpfs"
    )]
    VfioMissing { path: PathBuf },
    #[error(
        "IOMMU group {group} of {bdf} is not viable: every function in the group must be bound \
         to vfio-pci or to no driver, and these are not: {}; unbind them (echo ADDR > \
         /sys/bus/pci/devices/ADDR/driver/unbind) or bind them to vfio-pci",
        if others.is_empty() { "(none found in sysfs)".to_string() } else { others.join(", ") }
    )]
    GroupNotViable {
        bdf: String,
        group: u32,
        others: Vec<String>,
    },
    #[error(
        "cannot pin {len_bytes} bytes of DMA memory ({source}); RLIMIT_MEMLOCK is {}: raise it \
         (ulimit -l, or LimitMEMLOCK= in a systemd unit) or run with CAP_IPC_LOCK",
        match memlock_limit_bytes { Some(b) => format!("{b} bytes"), None => "unlimited".into() }
    )]
    PinFailed {
        len_bytes: usize,
        memlock_limit_bytes: Option<u64>,
        source: std::io::Error,
    },
    #[error("the IOMMU address space is used up: no room for {len_bytes} more bytes")]
    IovaExhausted { len_bytes: usize },
    #[error("{what}: {source}")]
    Os {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("the controller {0}")]
    Controller(String),
    #[error("admin command {what} failed: {status}")]
    AdminStatus { what: &'static str, status: Status },
    #[error("admin command {what} got no completion within {ADMIN_TIMEOUT_MS} ms")]
    AdminTimeout { what: &'static str },
}

fn bind_hint(bdf: &str, driver: Option<&str>) -> String {
    let bind = format!(
        "bind it with `echo {bdf} > /sys/bus/pci/drivers/vfio-pci/bind` after `modprobe \
         vfio-pci` (if vfio-pci does not know the device, write its vendor and device ids, \
         from /sys/bus/pci/devices/{bdf}/vendor and device, to \
         /sys/bus/pci/drivers/vfio-pci/new_id)"
    );
    match driver {
        Some(d) => format!(
            "first unbind it from {d} with `echo {bdf} > /sys/bus/pci/devices/{bdf}/driver/unbind`, then {bind}"
        ),
        None => bind,
    }
}

impl From<VfioError> for std::io::Error {
    fn from(e: VfioError) -> std::io::Error {
        std::io::Error::other(e)
    }
}

fn os(what: &'static str) -> impl FnOnce(std::io::Error) -> VfioError {
    move |source| VfioError::Os { what, source }
}

/// Name of the last path component a symlink points at (`.../drivers/vfio-pci` -> vfio-pci).
fn link_name(path: &Path) -> Option<String> {
    let target = std::fs::read_link(path).ok()?;
    Some(target.file_name()?.to_string_lossy().into_owned())
}

/// Finds the function's IOMMU group through sysfs and checks what can be checked before any
/// VFIO call: the function exists, is bound to vfio-pci, has a group, and /dev/vfio exists.
pub fn locate(bdf: &str, paths: &SysPaths) -> Result<u32, VfioError> {
    let dev = paths.sysfs.join("bus/pci/devices").join(bdf);
    if !dev.exists() {
        return Err(VfioError::NoSuchDevice {
            bdf: bdf.into(),
            path: dev,
        });
    }
    let driver = link_name(&dev.join("driver"));
    if driver.as_deref() != Some("vfio-pci") {
        return Err(VfioError::NotBoundToVfio {
            bdf: bdf.into(),
            driver,
        });
    }
    let group = link_name(&dev.join("iommu_group"))
        .and_then(|g| g.parse::<u32>().ok())
        .ok_or_else(|| VfioError::NoIommuGroup { bdf: bdf.into() })?;
    for node in [
        paths.dev.join("vfio/vfio"),
        paths.dev.join(format!("vfio/{group}")),
    ] {
        if !node.exists() {
            return Err(VfioError::VfioMissing { path: node });
        }
    }
    Ok(group)
}

/// Functions in `group` that keep it from being viable: bound to a driver other than
/// vfio-pci or pci-stub (bridges on pcieport are allowed). "ADDR (driver)" each.
pub fn group_offenders(group: u32, paths: &SysPaths) -> Vec<String> {
    let dir = paths
        .sysfs
        .join(format!("kernel/iommu_groups/{group}/devices"));
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let driver = link_name(&e.path().join("driver"))?;
            (!matches!(driver.as_str(), "vfio-pci" | "pci-stub" | "pcieport"))
                .then(|| format!("{name} ({driver})"))
        })
        .collect();
    out.sort();
    out
}

/// Identify Controller fields the driver uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerIdentity {
    pub model: String,
    pub serial: String,
    pub firmware: String,
    /// MDTS in bytes (`None`: no limit).
    pub mdts_bytes: Option<u64>,
    /// Number of namespaces (NN).
    pub namespaces: u32,
    /// Optional NVM Command Support (ONCS): bit 2 Dataset Management, bit 3 Write Zeroes.
    pub oncs: u16,
}

impl ControllerIdentity {
    /// Whether the controller carries out `opcode` (see [`ControllerIdentity::oncs`]).
    pub fn supports(&self, opcode: Opcode) -> bool {
        match opcode {
            Opcode::DatasetManagement => self.oncs & (1 << 2) != 0,
            Opcode::WriteZeroes => self.oncs & (1 << 3) != 0,
            Opcode::Read | Opcode::Write | Opcode::Flush => true,
        }
    }

    /// Decodes a 4096-byte Identify Controller data structure.
    pub fn parse(data: &[u8], mpsmin_bytes: u64) -> ControllerIdentity {
        // Space-padded by the spec; some controllers pad with NULs.
        let text = |r: std::ops::Range<usize>| {
            String::from_utf8_lossy(&data[r])
                .trim_end_matches([' ', '\0'])
                .to_string()
        };
        let mdts = data[77];
        ControllerIdentity {
            serial: text(4..24),
            model: text(24..64),
            firmware: text(64..72),
            mdts_bytes: (mdts != 0).then(|| mpsmin_bytes << mdts),
            namespaces: u32::from_le_bytes(data[516..520].try_into().expect("4 bytes")),
            oncs: u16::from_le_bytes(data[520..522].try_into().expect("2 bytes")),
        }
    }
}

/// Decodes Identify Namespace: (capacity in blocks, block size in bytes).
pub fn parse_identify_namespace(data: &[u8]) -> Result<(u64, u32), String> {
    let nsze = u64::from_le_bytes(data[0..8].try_into().expect("8 bytes"));
    let nlbaf = data[25];
    let flbas = (data[26] & 0xf) as usize;
    if flbas > nlbaf as usize {
        return Err(format!("FLBAS {flbas} names a format past NLBAF {nlbaf}"));
    }
    let lbaf = u32::from_le_bytes(
        data[128 + 4 * flbas..132 + 4 * flbas]
            .try_into()
            .expect("4"),
    );
    let lbads = (lbaf >> 16) & 0xff;
    let metadata_bytes = lbaf & 0xffff;
    if !(9..=16).contains(&lbads) {
        return Err(format!("LBA data size 2^{lbads} is not a block size"));
    }
    if metadata_bytes != 0 {
        return Err(format!(
            "the namespace's format carries {metadata_bytes} bytes of metadata per block, which \
             this driver does not handle; format it without metadata"
        ));
    }
    if nsze == 0 {
        return Err("namespace 1 has no blocks (NSZE 0)".into());
    }
    Ok((nsze, 1 << lbads))
}

/// The admin queue pair, driven one command at a time under the controller's lock.
#[derive(Debug)]
struct AdminQueue {
    sq: dma::DmaRegion,
    cq: dma::DmaRegion,
    /// 4 KiB of data for Identify.
    data: dma::DmaRegion,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    next_cid: u16,
}

impl AdminQueue {
    fn new(container: &Arc<dma::Container>) -> Result<AdminQueue, VfioError> {
        let entries = usize::from(ADMIN_QUEUE_ENTRIES);
        Ok(AdminQueue {
            sq: dma::DmaRegion::new(container, entries * 64)?,
            cq: dma::DmaRegion::new(container, entries * 16)?,
            data: dma::DmaRegion::new(container, PAGE_BYTES)?,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
            next_cid: 0,
        })
    }

    /// Empties both rings, for a controller that is disabled.
    fn clear(&mut self) {
        self.sq.zero();
        self.cq.zero();
        self.sq_tail = 0;
        self.cq_head = 0;
        self.phase = true;
    }

    /// Runs one admin command to completion.
    fn run(
        &mut self,
        bar: &regs::Bar,
        what: &'static str,
        mut cmd: SubmissionEntry,
    ) -> Result<CompletionEntry, VfioError> {
        let entries = ADMIN_QUEUE_ENTRIES;
        cmd.cid = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1);
        self.sq.write_volatile(usize::from(self.sq_tail) * 64, cmd);
        self.sq_tail = (self.sq_tail + 1) % entries;
        bar.ring_sq(0, self.sq_tail);
        let deadline = Instant::now() + Duration::from_millis(ADMIN_TIMEOUT_MS);
        loop {
            let off = usize::from(self.cq_head) * 16;
            let cqe: CompletionEntry = self.cq.read_volatile(off);
            if cqe.phase() == self.phase {
                std::sync::atomic::fence(Ordering::Acquire);
                let cqe: CompletionEntry = self.cq.read_volatile(off);
                self.cq_head = (self.cq_head + 1) % entries;
                if self.cq_head == 0 {
                    self.phase = !self.phase;
                }
                bar.ring_cq(0, self.cq_head);
                if cqe.cid != cmd.cid {
                    // A completion for an earlier command that timed out: skip it.
                    continue;
                }
                let status = cqe.status();
                if !status.is_success() {
                    return Err(VfioError::AdminStatus { what, status });
                }
                return Ok(cqe);
            }
            if Instant::now() > deadline {
                return Err(VfioError::AdminTimeout { what });
            }
            std::hint::spin_loop();
        }
    }

    /// Identify with `cns` for `nsid`; the 4 KiB result is left in `self.data`.
    fn identify(&mut self, bar: &regs::Bar, cns: u32, nsid: u32) -> Result<Vec<u8>, VfioError> {
        let cmd = SubmissionEntry {
            opcode: admin_op::IDENTIFY,
            nsid,
            prp1: self.data.iova(),
            cdw10: cns,
            ..Default::default()
        };
        let what = if cns == CNS_CONTROLLER {
            "Identify Controller"
        } else {
            "Identify Namespace"
        };
        self.data.zero();
        self.run(bar, what, cmd)?;
        let mut out = vec![0u8; PAGE_BYTES];
        self.data.read_bytes(0, &mut out);
        Ok(out)
    }
}

/// What queue pairs share with the controller.
#[derive(Debug)]
struct Inner {
    cfg: VfioConfig,
    bar: regs::Bar,
    cap: regs::Cap,
    admin: Mutex<AdminQueue>,
    /// Which I/O queue ids are in use (index = qid - 1).
    qids: Mutex<Vec<bool>>,
    /// Controller resets so far; each queue pair rebuilds its queues when it sees a change.
    generation: AtomicU64,
    ns: NamespaceInfo,
    identity: ControllerIdentity,
    /// One eventfd per MSI-X vector (vector 0: admin); empty without MSI-X.
    irqs: Vec<EventFd>,
    /// The pinned buffer pool mapped for the device (zero-copy I/O), or why not.
    pool: Result<dma::PoolWindow, String>,
    container: Arc<dma::Container>,
    device: OwnedFd,
    _group: OwnedFd,
}

impl Inner {
    /// Resets and re-enables the controller. Every queue pair sees the new generation the
    /// next time it is touched, fails what the controller had not finished with "Command
    /// Aborted due to SQ Deletion" and creates its queues again.
    fn reset(&self) -> Result<(), VfioError> {
        let mut admin = self.admin.lock();
        let result = self.enable(&mut admin);
        // The old queues are gone only if the controller stopped: it came back (the disable
        // before the enable took), or it reads as disabled (CSTS.RDY = 0). A controller that
        // never stopped (RDY stuck, or all ones) may still write the commands' buffers, so
        // the queue pairs must not make up their completions: no new generation, and the
        // caller keeps those buffers quarantined.
        let stopped = result.is_ok() || self.bar.read32(regs::CSTS) & regs::CSTS_RDY == 0;
        if stopped {
            self.generation.fetch_add(1, Ordering::SeqCst);
            // Queue pairs notice the reset when touched; wake the ones whose reactors block
            // on their interrupt, so the aborted commands complete now, not at a timeout.
            for irq in &self.irqs {
                let _ = irq.signal();
            }
        }
        result
    }

    fn wait_ready(&self, ready: bool) -> Result<(), VfioError> {
        let timeout_ms = self.cap.timeout_ms.max(READY_TIMEOUT_MS_MIN);
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        loop {
            let csts = self.bar.read32(regs::CSTS);
            if csts == u32::MAX {
                return Err(VfioError::Controller(
                    "reads as all ones: the function is gone or its BAR is not enabled".into(),
                ));
            }
            if ready && csts & regs::CSTS_CFS != 0 {
                return Err(VfioError::Controller(
                    "reports a fatal status (CSTS.CFS) while enabling".into(),
                ));
            }
            if (csts & regs::CSTS_RDY != 0) == ready {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(VfioError::Controller(format!(
                    "did not become {} within {timeout_ms} ms (CSTS {csts:#x})",
                    if ready { "ready" } else { "disabled" }
                )));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Tells the controller the host is done (CC.SHN, normal shutdown) so a real device
    /// flushes its volatile write cache, and waits for CSTS.SHST to say it has, up to CAP.TO.
    fn shut_down(&self) {
        let cc = self.bar.read32(regs::CC);
        if cc & regs::CC_EN == 0 {
            return;
        }
        self.bar
            .write32(regs::CC, (cc & !regs::CC_SHN_MASK) | regs::CC_SHN_NORMAL);
        let deadline =
            Instant::now() + Duration::from_millis(self.cap.timeout_ms.max(READY_TIMEOUT_MS_MIN));
        while self.bar.read32(regs::CSTS) & regs::CSTS_SHST_MASK != regs::CSTS_SHST_COMPLETE
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    fn disable(&self) -> Result<(), VfioError> {
        let cc = self.bar.read32(regs::CC);
        if cc & regs::CC_EN != 0 {
            self.bar.write32(regs::CC, cc & !regs::CC_EN);
        }
        self.wait_ready(false)
    }

    /// Disables the controller, installs a fresh admin queue and enables it again (Base spec,
    /// "Initialization"). Every I/O queue is gone afterwards.
    fn enable(&self, admin: &mut AdminQueue) -> Result<(), VfioError> {
        self.disable()?;
        admin.clear();
        let n = u32::from(ADMIN_QUEUE_ENTRIES) - 1;
        self.bar.write32(regs::AQA, n | (n << 16));
        self.bar.write64(regs::ASQ, admin.sq.iova());
        self.bar.write64(regs::ACQ, admin.cq.iova());
        // NVM command set (CSS 0), 4 KiB pages (MPS 0), round robin (AMS 0).
        self.bar.write32(
            regs::CC,
            regs::CC_IOSQES_64 | regs::CC_IOCQES_16 | regs::CC_EN,
        );
        self.wait_ready(true)?;
        let want = u32::from(IO_QUEUES_MAX) - 1;
        let cmd = SubmissionEntry {
            opcode: admin_op::SET_FEATURES,
            cdw10: FEATURE_NUMBER_OF_QUEUES,
            cdw11: want | (want << 16),
            ..Default::default()
        };
        admin.run(&self.bar, "Set Features (Number of Queues)", cmd)?;
        Ok(())
    }

    fn admin_run(&self, what: &'static str, cmd: SubmissionEntry) -> Result<(), VfioError> {
        self.admin.lock().run(&self.bar, what, cmd).map(drop)
    }

    /// Creates I/O completion queue and submission queue `qid`, `entries` each. Returns the
    /// generation of the controller they were created on, read under the admin lock that a
    /// reset holds while it bumps it: read before, a reset between the read and the
    /// creation would pass for one the new queues had missed.
    fn create_io_queues(
        &self,
        qid: u16,
        entries: u16,
        cq_iova: u64,
        sq_iova: u64,
        vector: Option<u16>,
    ) -> Result<u64, VfioError> {
        let size = u32::from(qid) | ((u32::from(entries) - 1) << 16);
        let (ien, iv) = match vector {
            Some(v) => (1 << 1, u32::from(v) << 16),
            None => (0, 0),
        };
        let mut admin = self.admin.lock();
        admin.run(
            &self.bar,
            "Create I/O Completion Queue",
            SubmissionEntry {
                opcode: admin_op::CREATE_IO_CQ,
                prp1: cq_iova,
                cdw10: size,
                // Physically contiguous (bit 0), interrupts enabled (bit 1), vector.
                cdw11: 1 | ien | iv,
                ..Default::default()
            },
        )?;
        admin.run(
            &self.bar,
            "Create I/O Submission Queue",
            SubmissionEntry {
                opcode: admin_op::CREATE_IO_SQ,
                prp1: sq_iova,
                cdw10: size,
                // Physically contiguous, its completion queue id in bits 31:16.
                cdw11: 1 | (u32::from(qid) << 16),
                ..Default::default()
            },
        )?;
        Ok(self.generation.load(Ordering::SeqCst))
    }

    /// Deletes I/O queues `qid` (submission queue first, as the spec requires).
    fn delete_io_queues(&self, qid: u16) -> Result<(), VfioError> {
        self.admin_run(
            "Delete I/O Submission Queue",
            SubmissionEntry {
                opcode: admin_op::DELETE_IO_SQ,
                cdw10: u32::from(qid),
                ..Default::default()
            },
        )?;
        self.admin_run(
            "Delete I/O Completion Queue",
            SubmissionEntry {
                opcode: admin_op::DELETE_IO_CQ,
                cdw10: u32::from(qid),
                ..Default::default()
            },
        )
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every queue pair is gone (each holds an Arc). Shut the controller down and stop it
        // so it touches no memory once the admin queue is unmapped; if it will not stop, keep
        // that memory.
        self.shut_down();
        if self.disable().is_err() {
            let admin = self.admin.get_mut();
            admin.sq.leak();
            admin.cq.leak();
            admin.data.leak();
        }
        if !self.irqs.is_empty() {
            let _ = sys::disable_msix(&self.device);
        }
    }
}

/// An NVMe controller driven from user space through VFIO.
#[derive(Debug)]
pub struct VfioController {
    inner: Arc<Inner>,
}

impl VfioController {
    /// Opens the PCI function `cfg.bdf` and brings the controller up.
    pub fn open(cfg: &VfioConfig) -> Result<VfioController, VfioError> {
        let group_id = locate(&cfg.bdf, &cfg.paths)?;
        let container_fd =
            sys::open_rw(&cfg.paths.dev.join("vfio/vfio")).map_err(os("opening /dev/vfio/vfio"))?;
        let version = sys::api_version(&container_fd).map_err(os("VFIO_GET_API_VERSION"))?;
        if version != sys::VFIO_API_VERSION {
            return Err(VfioError::Controller(format!(
                "speaks VFIO API version {version}, this driver knows {}",
                sys::VFIO_API_VERSION
            )));
        }
        let group_path = cfg.paths.dev.join(format!("vfio/{group_id}"));
        let group = sys::open_rw(&group_path).map_err(|e| match e.raw_os_error() {
            Some(libc::EBUSY) => VfioError::Controller(format!(
                "IOMMU group {group_id} is already open in another process ({group_path:?} is \
                 busy): VFIO lets one process own a group at a time"
            )),
            _ => VfioError::Os {
                what: "opening the IOMMU group",
                source: e,
            },
        })?;
        let flags = sys::group_flags(&group).map_err(os("VFIO_GROUP_GET_STATUS"))?;
        if flags & sys::VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(VfioError::GroupNotViable {
                bdf: cfg.bdf.clone(),
                group: group_id,
                others: group_offenders(group_id, &cfg.paths),
            });
        }
        sys::group_set_container(&group, &container_fd)
            .map_err(os("adding the group to the container"))?;
        let iommu = if sys::check_extension(&container_fd, sys::VFIO_TYPE1V2_IOMMU).unwrap_or(false)
        {
            sys::VFIO_TYPE1V2_IOMMU
        } else if sys::check_extension(&container_fd, sys::VFIO_TYPE1_IOMMU).unwrap_or(false) {
            sys::VFIO_TYPE1_IOMMU
        } else {
            return Err(VfioError::Controller(
                "has no type-1 IOMMU: load vfio_iommu_type1".into(),
            ));
        };
        sys::set_iommu(&container_fd, iommu).map_err(os("VFIO_SET_IOMMU"))?;
        let device =
            sys::group_device_fd(&group, &cfg.bdf).map_err(os("VFIO_GROUP_GET_DEVICE_FD"))?;
        let container = Arc::new(dma::Container::new(container_fd));

        // Memory decoding and bus mastering on: the controller may now DMA.
        let (config, _) = sys::region_info(&device, sys::VFIO_PCI_CONFIG_REGION_INDEX)
            .map_err(os("reading the config space region"))?;
        let command = sys::config_read_u16(&device, config.offset, sys::PCI_COMMAND)
            .map_err(os("reading the PCI command register"))?;
        sys::config_write_u16(
            &device,
            config.offset,
            sys::PCI_COMMAND,
            command | sys::PCI_COMMAND_MEMORY | sys::PCI_COMMAND_MASTER,
        )
        .map_err(os("enabling bus mastering"))?;

        let bar = map_bar0(&device)?;
        let cap = regs::Cap::parse(bar.read64(regs::CAP));
        let mut bar = bar;
        bar.set_doorbell_stride(cap.dstrd);
        if !cap.nvm_css {
            return Err(VfioError::Controller(
                "does not support the NVM command set".into(),
            ));
        }
        if cap.mpsmin_shift > 12 {
            return Err(VfioError::Controller(format!(
                "needs pages of at least {} bytes; this driver uses 4 KiB",
                1u64 << cap.mpsmin_shift
            )));
        }
        let irqs = setup_msix(&device)?;

        let admin = AdminQueue::new(&container)?;
        let pool = dma::PoolWindow::map(&container);
        let mut inner = Inner {
            cfg: cfg.clone(),
            bar,
            cap,
            admin: Mutex::new(admin),
            qids: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            ns: NamespaceInfo {
                nsid: 1,
                lba_size_bytes: 512,
                capacity_lbas: 0,
                transfer_bytes_max: TRANSFER_BYTES_MAX,
            },
            identity: ControllerIdentity {
                model: String::new(),
                serial: String::new(),
                firmware: String::new(),
                mdts_bytes: None,
                namespaces: 0,
                oncs: 0,
            },
            irqs,
            pool,
            container,
            device,
            _group: group,
        };
        let (identity, ns) = {
            let mut admin = inner.admin.lock();
            inner.enable(&mut admin)?;
            let ctrl = admin.identify(&inner.bar, CNS_CONTROLLER, 0)?;
            let identity = ControllerIdentity::parse(&ctrl, 1 << cap.mpsmin_shift);
            if identity.namespaces == 0 {
                return Err(VfioError::Controller("has no namespaces".into()));
            }
            let nsdata = admin.identify(&inner.bar, CNS_NAMESPACE, 1)?;
            let (capacity_lbas, lba_size_bytes) = parse_identify_namespace(&nsdata)
                .map_err(|e| VfioError::Controller(format!("namespace 1: {e}")))?;
            let transfer_bytes_max = identity.mdts_bytes.map_or(TRANSFER_BYTES_MAX, |m| {
                m.min(u64::from(TRANSFER_BYTES_MAX)) as u32
            });
            let ns = NamespaceInfo {
                nsid: 1,
                lba_size_bytes,
                capacity_lbas,
                transfer_bytes_max,
            };
            (identity, ns)
        };
        inner.identity = identity;
        inner.ns = ns;
        let mut queues = usize::from(IO_QUEUES_MAX).min(inner.bar.queues_mapped() - 1);
        if !inner.irqs.is_empty() {
            queues = queues.min(inner.irqs.len() - 1);
        }
        inner.qids = Mutex::new(vec![false; queues]);
        Ok(VfioController {
            inner: Arc::new(inner),
        })
    }

    /// What Identify Controller said.
    pub fn identity(&self) -> &ControllerIdentity {
        &self.inner.identity
    }

    /// The NVMe version register, as (major, minor).
    pub fn version(&self) -> (u16, u8) {
        let vs = self.inner.bar.read32(regs::VS);
        ((vs >> 16) as u16, (vs >> 8) as u8)
    }

    /// Resets the controller: disables it (the controller drops every queue and every
    /// command in flight), rebuilds the admin queue and enables it again. Queue pairs finish
    /// their outstanding commands with "Command Aborted due to SQ Deletion" and recreate
    /// their queues on their next call.
    pub fn reset(&self) -> Result<(), VfioError> {
        self.inner.reset()
    }

    /// Controller resets so far.
    pub fn resets(&self) -> u64 {
        self.inner.generation.load(Ordering::Relaxed)
    }

    /// Creates an I/O queue pair (the concrete type; the trait method boxes it).
    pub fn queue_pair(&self, depth: usize) -> Result<VfioQueuePair, QueuePairError> {
        if depth == 0 || depth > QUEUE_DEPTH_MAX || depth + 1 > self.inner.cap.mqes_entries as usize
        {
            return Err(QueuePairError::BadDepth {
                depth,
                max: QUEUE_DEPTH_MAX.min(self.inner.cap.mqes_entries as usize - 1),
            });
        }
        let qid = {
            let mut qids = self.inner.qids.lock();
            let max = qids.len();
            let Some(i) = qids.iter().position(|used| !used) else {
                return Err(QueuePairError::NoQueuesLeft { max });
            };
            qids[i] = true;
            (i + 1) as u16
        };
        VfioQueuePair::new(self.inner.clone(), qid, depth).map_err(|e| {
            self.inner.qids.lock()[usize::from(qid) - 1] = false;
            QueuePairError::Os(e.into())
        })
    }
}

impl Controller for VfioController {
    fn describe(&self) -> String {
        match &self.inner.pool {
            Ok(w) => format!(
                "{} (zero-copy for buffers in the {} pinned pool, bounce pages otherwise)",
                self.inner.cfg,
                crate::config::size_text(w.len_bytes() as u64)
            ),
            Err(why) => format!("{} (bounce pages only: {why})", self.inner.cfg),
        }
    }

    fn namespace(&self) -> NamespaceInfo {
        self.inner.ns
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        Ok(Box::new(self.queue_pair(depth)?))
    }

    fn supports(&self, opcode: Opcode) -> bool {
        self.inner.identity.supports(opcode)
    }
}

/// Maps BAR0: whole if the kernel allows it, else its first mmap-able area (the registers
/// and doorbells; the MSI-X table that shares the BAR stays with the kernel).
fn map_bar0(device: &OwnedFd) -> Result<regs::Bar, VfioError> {
    let (info, sparse) = sys::region_info(device, sys::VFIO_PCI_BAR0_REGION_INDEX)
        .map_err(os("reading BAR0's region info"))?;
    if info.flags & sys::VFIO_REGION_INFO_FLAG_MMAP == 0 {
        return Err(VfioError::Controller(
            "BAR0 cannot be mmapped (vfio-pci built without VFIO_PCI_MMAP?)".into(),
        ));
    }
    let whole = sys::Mapping::device(device, info.offset, info.size as usize);
    let map = match (whole, sparse) {
        (Ok(m), _) => m,
        (Err(_), Some((0, size))) if size as usize > regs::DOORBELL_BASE => {
            sys::Mapping::device(device, info.offset, size as usize).map_err(os("mmap of BAR0"))?
        }
        (Err(e), _) => return Err(os("mmap of BAR0")(e)),
    };
    if map.len_bytes() < regs::DOORBELL_BASE + 16 {
        return Err(VfioError::Controller(format!(
            "BAR0 maps only {} bytes: too small for NVMe registers and doorbells",
            map.len_bytes()
        )));
    }
    Ok(regs::Bar::new(map))
}

/// Routes every MSI-X vector (up to 1 + IO_QUEUES_MAX) to its own eventfd; none if the
/// function has no MSI-X.
fn setup_msix(device: &OwnedFd) -> Result<Vec<EventFd>, VfioError> {
    let info = sys::irq_info(device, sys::VFIO_PCI_MSIX_IRQ_INDEX)
        .map_err(os("reading the MSI-X interrupt info"))?;
    let count = (info.count as usize)
        .min(usize::from(IO_QUEUES_MAX) + 1)
        .min(sys::MAX_IRQ_VECTORS);
    if count < 2 {
        return Ok(Vec::new());
    }
    let fds: Vec<EventFd> = (0..count)
        .map(|_| EventFd::new())
        .collect::<Result<_, _>>()
        .map_err(os("creating interrupt eventfds"))?;
    let raw: Vec<i32> = fds.iter().map(|f| f.as_fd().as_raw_fd()).collect();
    sys::set_msix_eventfds(device, &raw).map_err(os("routing MSI-X to eventfds"))?;
    Ok(fds)
}

#[cfg(test)]
mod tests;
