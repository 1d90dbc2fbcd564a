//! The `uring` device: NVMe-shaped queue pairs over io_uring, on a regular file or a block
//! device. `uring:/path[,direct=0|1][,size=...][,lba=512|4096][,iopoll=auto|on|off|hybrid]
//! [,taskrun=defer|signal]`.
//!
//! Each queue pair owns one ring, with the file registered (fixed file 0), and in polled
//! modes a second one for the commands an IOPOLL ring refuses (see [`SideRing`]). Commands
//! map to io_uring operations: Read and Write (Write with FUA becomes a write with
//! `RWF_DSYNC`), Flush to `fdatasync`, Write Zeroes to `fallocate(ZERO_RANGE)` (where the
//! file system lacks zero-range, `PUNCH_HOLE`, then a plain `fallocate` to allocate the
//! blocks again unless the command allows deallocation), Deallocate to
//! `fallocate(PUNCH_HOLE)`.
//!
//! How completions are found depends on the device, detected when it is opened:
//! - **poll** (`IORING_SETUP_IOPOLL`): only for O_DIRECT on a device with poll queues (an
//!   NVMe namespace with `nvme.poll_queues` set). The kernel polls the device whenever the
//!   reactor polls the queue pair; there is no interrupt to wait for.
//! - **hybrid poll** (`iopoll=hybrid`, `IORING_SETUP_HYBRID_IOPOLL`, Linux 6.13): as poll,
//!   but the kernel sleeps for half of the device's runtime first. It is io_uring's own
//!   hybrid polling, there for comparison with hypoll's policies.
//! - **interrupt** (everything else, e.g. virtio disks and most file systems): the device
//!   interrupts, the kernel posts the completion into the ring, and the reactor's policy
//!   chooses between spinning on the ring from user space, sleeping then spinning, and
//!   blocking on the ring's registered eventfd (the queue pair's interrupt fd). The kernel
//!   posts a read's completion by task work in the submitting thread; with
//!   `IORING_SETUP_DEFER_TASKRUN` (the default where the kernel has it, see [`TaskRun`])
//!   that work waits for the queue pair's next `io_uring_enter`, made when the ring's
//!   `IORING_SQ_TASKRUN` flag shows work pending, so a completion neither wakes a sleeping
//!   reactor early nor interrupts a spinning one.
//!
//! Submissions are batched: `submit` only writes the submission entry, and the next
//! `process_completions` (or `arm_interrupt`) hands every pending entry to the kernel with
//! one `io_uring_enter`, as SPDK rings a doorbell once per batch.

mod sys;

use std::collections::VecDeque;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};

use crate::buf::IoBuf;
use crate::config::{parse_size_bytes, size_text, ConfigError};
use crate::qpair::{
    Command, Completion, Controller, QueuePair, QueuePairError, RecoveryError, SubmitError,
    QUEUE_DEPTH_MAX,
};
use crate::spec::{NamespaceInfo, Opcode, Status};
use crate::sys::EventFd;

/// Keys `uring:` accepts.
pub const URING_KEYS: &[&str] = &["direct", "size", "lba", "iopoll", "taskrun"];

/// Largest transfer one command may move: larger reads and writes complete with Invalid
/// Field, as on a controller with this MDTS. The kernel splits requests for the device.
pub const URING_MAX_TRANSFER_BYTES: u32 = 1 << 20;

/// Logical block size of a file namespace when `lba=` is not given: 4 KiB suits O_DIRECT
/// on every common file system and disk.
pub const URING_FILE_LBA_BYTES: u32 = 4096;

/// User data of an `ASYNC_CANCEL` request (an abort): never a slot index.
const CANCEL_USER_DATA: u64 = u64::MAX;

/// How long opening waits for the IOPOLL probe read before it gives up on polled mode.
const IOPOLL_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether to find completions by polling the device (`IORING_SETUP_IOPOLL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IopollMode {
    /// Poll when the device supports it (probed when opened), otherwise interrupts.
    Auto,
    /// Always interrupts.
    Off,
    /// Poll, or fail to open.
    On,
    /// io_uring's hybrid polling (sleep, then poll), or fail to open.
    Hybrid,
}

impl IopollMode {
    fn as_str(self) -> &'static str {
        match self {
            IopollMode::Auto => "auto",
            IopollMode::Off => "off",
            IopollMode::On => "on",
            IopollMode::Hybrid => "hybrid",
        }
    }
}

/// How a queue pair finds its completions, decided when the device is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionMode {
    /// The device interrupts; completions land in the ring; the policy spins, sleeps or
    /// blocks on the eventfd.
    Interrupt,
    /// `IORING_SETUP_IOPOLL`: the kernel polls the device when the queue pair is polled.
    Poll,
    /// `IORING_SETUP_HYBRID_IOPOLL`: the kernel sleeps, then polls.
    HybridPoll,
}

impl fmt::Display for CompletionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CompletionMode::Interrupt => "interrupt",
            CompletionMode::Poll => "iopoll",
            CompletionMode::HybridPoll => "hybrid iopoll",
        })
    }
}

/// Where the kernel finishes a completion in interrupt mode. A read's completion is posted
/// into the ring by task work that runs in the submitting thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskRun {
    /// `IORING_SETUP_DEFER_TASKRUN` (Linux 6.1+; the default where the kernel has it): the
    /// task work waits for the reactor's next `io_uring_enter`, which the queue pair makes
    /// as soon as the ring's `IORING_SQ_TASKRUN` flag shows some pending, and the ring's
    /// eventfd fires for it. A sleeping reactor is not woken by a completion, nor a spinning
    /// one interrupted by an inter-processor interrupt.
    Defer,
    /// The kernel's default: a completion signals the thread, which runs the task work at
    /// once, waking it from a sleep (which then resumes) or interrupting its spin.
    Signal,
}

/// A parsed `uring:` spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UringConfig {
    pub path: PathBuf,
    /// O_DIRECT (the default): bypass the page cache, so every read reaches the device.
    pub direct: bool,
    /// Expose only the first `size_bytes` of the file or device.
    pub size_bytes: Option<u64>,
    /// Logical block size; by default the block device's, or 4 KiB for a file.
    pub lba_bytes: Option<u32>,
    pub iopoll: IopollMode,
    /// Interrupt mode only: when completions are posted into the ring.
    pub taskrun: TaskRun,
}

impl UringConfig {
    pub fn new(path: impl Into<PathBuf>) -> UringConfig {
        UringConfig {
            path: path.into(),
            direct: true,
            size_bytes: None,
            lba_bytes: None,
            iopoll: IopollMode::Auto,
            taskrun: TaskRun::Defer,
        }
    }

    /// Sets one `key=value` of the spec.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let bad = |expected: &str| ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            expected: expected.to_string(),
        };
        match key {
            "direct" => {
                self.direct = match value {
                    "1" | "true" | "on" => true,
                    "0" | "false" | "off" => false,
                    _ => return Err(bad("0 or 1")),
                }
            }
            "size" => {
                self.size_bytes = Some(
                    parse_size_bytes(value)
                        .ok()
                        .filter(|v| *v > 0)
                        .ok_or_else(|| bad("a size such as 512M, 8G, 1T"))?,
                )
            }
            "lba" => {
                self.lba_bytes = Some(match value {
                    "512" => 512,
                    "4096" | "4k" | "4K" => 4096,
                    _ => return Err(bad("512 or 4096")),
                })
            }
            "iopoll" => {
                self.iopoll = match value {
                    "auto" => IopollMode::Auto,
                    "off" | "0" => IopollMode::Off,
                    "on" | "1" => IopollMode::On,
                    "hybrid" => IopollMode::Hybrid,
                    _ => return Err(bad("auto, on, off or hybrid")),
                }
            }
            "taskrun" => {
                self.taskrun = match value {
                    "defer" => TaskRun::Defer,
                    "signal" => TaskRun::Signal,
                    _ => return Err(bad("defer or signal")),
                }
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    device: "uring".into(),
                    key: key.into(),
                    accepted: URING_KEYS.join(", "),
                })
            }
        }
        Ok(())
    }
}

/// The canonical spec string: `uring:/path` and every key that differs from its default.
impl fmt::Display for UringConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "uring:{}", self.path.display())?;
        if !self.direct {
            write!(f, ",direct=0")?;
        }
        if let Some(size_bytes) = self.size_bytes {
            write!(f, ",size={}", size_text(size_bytes))?;
        }
        if let Some(lba_bytes) = self.lba_bytes {
            write!(f, ",lba={lba_bytes}")?;
        }
        if self.iopoll != IopollMode::Auto {
            write!(f, ",iopoll={}", self.iopoll.as_str())?;
        }
        if self.taskrun == TaskRun::Signal {
            write!(f, ",taskrun=signal")?;
        }
        Ok(())
    }
}

/// Why a `uring:` device could not be opened. Each message says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum UringOpenError {
    #[error("{path}: no such file or block device; create it and fill it with data first (e.g. `fio --name=fill --filename={path} --size=1G --rw=write --bs=1M --direct=1`)")]
    NotFound { path: String },
    #[error("{path}: permission denied: the device needs read and write access (check the file's mode and owner, or the block device's group)")]
    PermissionDenied { path: String },
    #[error("{path}: this file system does not support O_DIRECT; add direct=0 to go through the page cache (reads may then never reach the device)")]
    DirectUnsupported { path: String },
    #[error("{path}: not a regular file or a block device")]
    NotFileOrBlockDevice { path: String },
    #[error(
        "{path}: the file is empty; fill it with data first, or give size= with a larger file"
    )]
    Empty { path: String },
    #[error("{path}: size {size_bytes} bytes is not a multiple of the block size ({lba_bytes} bytes); give size= with a multiple, or lba=512")]
    NotBlockMultiple {
        path: String,
        size_bytes: u64,
        lba_bytes: u32,
    },
    #[error("{path}: size={want_bytes} is larger than the file or device ({have_bytes} bytes)")]
    TooSmall {
        path: String,
        want_bytes: u64,
        have_bytes: u64,
    },
    #[error("{path}: lba={want_bytes} is smaller than the device's logical block size ({device_bytes} bytes)")]
    LbaTooSmall {
        path: String,
        want_bytes: u32,
        device_bytes: u32,
    },
    #[error("io_uring is not available: {reason}")]
    Unavailable { reason: String },
    #[error("{path}: polled I/O (iopoll={mode}) is not supported here: {detail}; it needs O_DIRECT on an NVMe namespace with poll queues (nvme.poll_queues=N); use iopoll=auto or iopoll=off")]
    IopollUnsupported {
        path: String,
        mode: &'static str,
        detail: String,
    },
    #[error("{path}: {what}: {source}")]
    Os {
        path: String,
        what: &'static str,
        source: io::Error,
    },
}

impl From<UringOpenError> for io::Error {
    fn from(e: UringOpenError) -> io::Error {
        let kind = match &e {
            UringOpenError::NotFound { .. } => io::ErrorKind::NotFound,
            UringOpenError::PermissionDenied { .. } => io::ErrorKind::PermissionDenied,
            UringOpenError::Unavailable { .. } | UringOpenError::IopollUnsupported { .. } => {
                io::ErrorKind::Unsupported
            }
            UringOpenError::Os { source, .. } => source.kind(),
            _ => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, e)
    }
}

/// Explains an `io_uring_setup` failure: the kernel lacks io_uring, a seccomp filter blocks
/// it, or the `kernel.io_uring_disabled` sysctl forbids it.
fn unavailable(e: &io::Error) -> UringOpenError {
    let sysctl = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "absent".to_string());
    let reason = match e.raw_os_error() {
        Some(libc::ENOSYS) => format!(
            "io_uring_setup returned ENOSYS: the kernel was built without io_uring, or a \
             seccomp filter (a container runtime's default profile) blocks it; \
             kernel.io_uring_disabled = {sysctl}"
        ),
        Some(libc::EPERM) => format!(
            "io_uring_setup returned EPERM: the sysctl kernel.io_uring_disabled is {sysctl} \
             (0 allows everyone, 1 only members of kernel.io_uring_group), or a seccomp \
             filter denies it"
        ),
        _ => format!("io_uring_setup failed: {e}"),
    };
    UringOpenError::Unavailable { reason }
}

/// An opened `uring:` device. Every queue pair is a ring of its own on the shared file.
pub struct UringController {
    cfg: UringConfig,
    file: Arc<File>,
    ns: NamespaceInfo,
    mode: CompletionMode,
    /// Why the mode was chosen, for `describe`.
    mode_note: String,
    /// Whether the pinned pool registers as fixed buffers, for `describe`.
    fixed_note: String,
    /// Whether queue pairs defer task work to their `io_uring_enter` (interrupt mode with
    /// `taskrun=defer`, on a kernel that takes it), and why, for `describe`.
    defer_taskrun: bool,
    taskrun_note: String,
}

impl UringController {
    /// Opens the file or block device, checks its size against the block size, checks that
    /// io_uring works, and decides how completions will be found.
    pub fn open(cfg: &UringConfig) -> Result<UringController, UringOpenError> {
        let path = cfg.path.display().to_string();
        let file = open_file(&cfg.path, cfg.direct)?;
        let os = |what: &'static str| {
            let path = path.clone();
            move |source: io::Error| UringOpenError::Os { path, what, source }
        };
        let meta = file.metadata().map_err(os("reading its metadata"))?;
        let (have_bytes, device_lba_bytes) = if meta.file_type().is_block_device() {
            (
                sys::block_device_size_bytes(&file).map_err(os("reading the device's size"))?,
                Some(
                    sys::block_device_lba_bytes(&file)
                        .map_err(os("reading the device's block size"))?,
                ),
            )
        } else if meta.is_file() {
            (meta.len(), None)
        } else {
            return Err(UringOpenError::NotFileOrBlockDevice { path });
        };
        let lba_bytes = match (cfg.lba_bytes, device_lba_bytes) {
            (Some(want), Some(device)) if want < device => {
                return Err(UringOpenError::LbaTooSmall {
                    path,
                    want_bytes: want,
                    device_bytes: device,
                })
            }
            (Some(want), _) => want,
            (None, Some(device)) => device,
            (None, None) => URING_FILE_LBA_BYTES,
        };
        let size_bytes = match cfg.size_bytes {
            Some(want) if want > have_bytes => {
                return Err(UringOpenError::TooSmall {
                    path,
                    want_bytes: want,
                    have_bytes,
                })
            }
            Some(want) => want,
            None if have_bytes == 0 => return Err(UringOpenError::Empty { path }),
            None => have_bytes,
        };
        if !size_bytes.is_multiple_of(u64::from(lba_bytes)) {
            return Err(UringOpenError::NotBlockMultiple {
                path,
                size_bytes,
                lba_bytes,
            });
        }
        // Does io_uring work at all here, and will it take the pinned pool as fixed buffers?
        let probe = IoUring::new(2).map_err(|e| unavailable(&e))?;
        let fixed_note = match crate::buf::pinned_region() {
            None => "no fixed buffers: the pinned pool is off".to_string(),
            Some((base, len)) => {
                let iov = libc::iovec {
                    iov_base: base.cast(),
                    iov_len: len,
                };
                // SAFETY: as in UringQueuePair::new: the region is never unmapped.
                match unsafe { probe.submitter().register_buffers(&[iov]) } {
                    Ok(()) => format!("fixed buffers: the {} pinned pool", size_text(len as u64)),
                    Err(e) => format!("no fixed buffers: registering the pinned pool failed ({e})"),
                }
            }
        };
        drop(probe);
        let (mode, mode_note) = choose_mode(cfg, &file, lba_bytes)?;
        let (defer_taskrun, taskrun_note) = match (mode, cfg.taskrun) {
            (CompletionMode::Interrupt, TaskRun::Defer) => match deferred_ring(2) {
                Ok(_) => (
                    true,
                    "completions posted on the reactor's io_uring_enter (DEFER_TASKRUN)"
                        .to_string(),
                ),
                Err(e) => (
                    false,
                    format!("completions signalled: DEFER_TASKRUN refused ({e}; Linux 6.1+)"),
                ),
            },
            (CompletionMode::Interrupt, TaskRun::Signal) => {
                (false, "completions signalled (taskrun=signal)".to_string())
            }
            // Polled rings post completions from the reactor's own io_uring_enter already.
            _ => (false, String::new()),
        };
        Ok(UringController {
            cfg: cfg.clone(),
            file: Arc::new(file),
            ns: NamespaceInfo {
                nsid: 1,
                lba_size_bytes: lba_bytes,
                capacity_lbas: size_bytes / u64::from(lba_bytes),
                transfer_bytes_max: URING_MAX_TRANSFER_BYTES,
            },
            mode,
            mode_note,
            fixed_note,
            defer_taskrun,
            taskrun_note,
        })
    }

    /// How this device's queue pairs find completions.
    pub fn mode(&self) -> CompletionMode {
        self.mode
    }

    /// Opens a queue pair of `depth` commands on its own ring.
    pub fn queue_pair(&self, depth: usize) -> Result<UringQueuePair, QueuePairError> {
        UringQueuePair::new(
            self.file.clone(),
            self.ns,
            self.mode,
            self.defer_taskrun,
            depth,
            self.mode != CompletionMode::Interrupt,
        )
    }
}

/// A ring whose task work waits for `io_uring_enter` with GETEVENTS, and which flags pending
/// work in the submission ring (`IORING_SQ_TASKRUN`). One thread only, as every queue pair.
fn deferred_ring(entries: u32) -> io::Result<IoUring> {
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_taskrun_flag()
        .build(entries)
}

fn open_file(path: &Path, direct: bool) -> Result<File, UringOpenError> {
    let display = path.display().to_string();
    let mut opts = OpenOptions::new();
    opts.read(true).write(true);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    opts.open(path).map_err(|e| match e.raw_os_error() {
        _ if std::fs::metadata(path)
            .is_ok_and(|m| !(m.is_file() || m.file_type().is_block_device())) =>
        {
            UringOpenError::NotFileOrBlockDevice { path: display }
        }
        Some(libc::ENOENT) => UringOpenError::NotFound { path: display },
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => {
            UringOpenError::PermissionDenied { path: display }
        }
        Some(libc::EINVAL) if direct => UringOpenError::DirectUnsupported { path: display },
        _ => UringOpenError::Os {
            path: display,
            what: "opening it",
            source: e,
        },
    })
}

/// Decides between interrupts, polling and hybrid polling, probing the device with one
/// polled read when the spec leaves it to us.
fn choose_mode(
    cfg: &UringConfig,
    file: &File,
    lba_bytes: u32,
) -> Result<(CompletionMode, String), UringOpenError> {
    let path = cfg.path.display().to_string();
    let unsupported = |detail: String| UringOpenError::IopollUnsupported {
        path: path.clone(),
        mode: cfg.iopoll.as_str(),
        detail,
    };
    match cfg.iopoll {
        IopollMode::Off => return Ok((CompletionMode::Interrupt, "iopoll=off".into())),
        IopollMode::On | IopollMode::Hybrid if !cfg.direct => {
            return Err(unsupported("polled I/O needs direct=1".into()))
        }
        IopollMode::Auto if !cfg.direct => {
            return Ok((
                CompletionMode::Interrupt,
                "page cache I/O cannot be polled".into(),
            ))
        }
        _ => {}
    }
    let hybrid = cfg.iopoll == IopollMode::Hybrid;
    match probe_iopoll(file, lba_bytes, hybrid) {
        Ok(()) if hybrid => Ok((CompletionMode::HybridPoll, "iopoll=hybrid".into())),
        Ok(()) => Ok((CompletionMode::Poll, "polled I/O supported".into())),
        Err(detail) if cfg.iopoll == IopollMode::Auto => Ok((
            CompletionMode::Interrupt,
            format!("IOPOLL unsupported: {detail}"),
        )),
        Err(detail) => Err(unsupported(detail)),
    }
}

/// Reads the first block through a polled ring: the only sure test of IOPOLL support, which
/// the kernel reports per request (`EOPNOTSUPP` from a device without poll queues).
fn probe_iopoll(file: &File, lba_bytes: u32, hybrid: bool) -> Result<(), String> {
    let mut ring = if hybrid {
        sys::hybrid_iopoll_ring(2).map_err(|e| {
            format!("creating a hybrid iopoll ring failed ({e}); it needs Linux 6.13")
        })?
    } else {
        IoUring::builder()
            .setup_iopoll()
            .build(2)
            .map_err(|e| format!("creating an iopoll ring failed ({e})"))?
    };
    let mut buf = IoBuf::zeroed(lba_bytes as usize);
    let read = opcode::Read::new(types::Fd(file.as_raw_fd()), buf.as_mut_ptr(), lba_bytes)
        .offset(0)
        .build();
    // SAFETY: `buf` stays alive until the read completes: this function returns only after
    // its completion is reaped, or leaks the buffer when the read may still be in flight.
    unsafe { ring.submission().push(&read) }.map_err(|_| "probe ring is full".to_string())?;
    let deadline = Instant::now() + IOPOLL_PROBE_TIMEOUT;
    loop {
        match ring.submit_and_wait(0) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => {
                // The read may have been entered before the failure: its buffer must
                // outlive it, as on the timeout below.
                std::mem::forget(buf);
                return Err(format!("io_uring_enter failed ({e})"));
            }
        }
        if let Some(cqe) = ring.completion().next() {
            return match cqe.result() {
                r if r >= 0 => Ok(()),
                r => Err(format!(
                    "a polled read returned {}",
                    io::Error::from_raw_os_error(-r)
                )),
            };
        }
        if Instant::now() > deadline {
            // The read is still in the kernel's hands: its buffer must outlive it.
            std::mem::forget(buf);
            return Err(format!(
                "a polled read did not complete within {IOPOLL_PROBE_TIMEOUT:?}"
            ));
        }
        std::thread::yield_now();
    }
}

impl Controller for UringController {
    fn describe(&self) -> String {
        let taskrun = if self.taskrun_note.is_empty() {
            String::new()
        } else {
            format!("; {}", self.taskrun_note)
        };
        format!(
            "{} ({}, {} completions: {}{taskrun}; {})",
            self.cfg,
            if self.cfg.direct {
                "O_DIRECT"
            } else {
                "page cache"
            },
            self.mode,
            self.mode_note,
            self.fixed_note
        )
    }

    fn namespace(&self) -> NamespaceInfo {
        self.ns
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        Ok(Box::new(self.queue_pair(depth)?))
    }
}

/// A command in the kernel's hands: what its completion must be checked against.
#[derive(Clone, Copy, Debug)]
struct InFlight {
    tag: u64,
    opcode: Opcode,
    /// Bytes the command covers; a read or write that moves fewer is an error.
    len_bytes: u64,
    offset_bytes: u64,
    /// For Write Zeroes: whether the blocks may be deallocated, and which `fallocate` is in
    /// the kernel.
    may_deallocate: bool,
    zeroing: Zeroing,
    /// On the side ring (see [`SideRing`]).
    side: bool,
}

/// How a Write Zeroes is carried out. Zero-range first; where the file system has none
/// (tmpfs), punch-hole, which zeroes by deallocating, and then, unless the command allows
/// deallocation, a plain `fallocate` to allocate the blocks again (as zeroes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Zeroing {
    ZeroRange,
    PunchHole,
    Allocate,
}

/// In polled modes, a second ring for what an IOPOLL ring refuses. The kernel fails
/// `fsync`, `fallocate` and `ASYNC_CANCEL` with EINVAL on a ring set up with IOPOLL, so
/// Flush, Write Zeroes, Deallocate and their aborts go to this one, on the same file,
/// without IOPOLL: the kernel's workers complete them as on any ring, and every poll of
/// the queue pair reaps both rings. Reads and writes stay on the polled ring.
struct SideRing {
    ring: IoUring,
    /// Of the queue pair's `in_kernel`, the commands on this ring (Write Zeroes waiting for
    /// their next step included, as there).
    in_kernel: usize,
    /// Entries pushed on this ring and not yet entered.
    unsubmitted: usize,
    /// Aborts on this ring, each with a completion of its own.
    cancels_in_kernel: usize,
}

/// One io_uring ring as an NVMe queue pair (two in polled modes: see [`SideRing`]). Owned
/// by one thread (not `Send`): the ring is created with `IORING_SETUP_SINGLE_ISSUER` where
/// the kernel has it.
pub struct UringQueuePair {
    ring: IoUring,
    /// Polled modes only (and tests): the ring for everything but reads and writes.
    side: Option<SideRing>,
    /// Keeps the registered file open for as long as the ring may use it.
    _file: Arc<File>,
    mode: CompletionMode,
    ns: NamespaceInfo,
    depth: usize,
    /// In-flight commands by slot; the slot index is the io_uring user data.
    slots: Vec<Option<InFlight>>,
    free_slots: Vec<u32>,
    /// Commands handed to the ring (pushed), not yet reaped.
    in_kernel: usize,
    /// Of those, the ones still in the submission queue, not yet entered.
    unsubmitted: usize,
    /// Commands completed without the kernel (out-of-range LBAs, oversized transfers).
    local: VecDeque<Completion>,
    /// Write Zeroes with a next step to submit: punch-hole after a refused zero-range,
    /// allocate after a punch-hole (see [`Zeroing`]).
    retry_zeroes: Vec<u32>,
    zero_range_unsupported: bool,
    /// The ring's registered eventfd, in interrupt mode.
    event_fd: Option<EventFd>,
    /// Task work waits for our `io_uring_enter` ([`TaskRun::Defer`]).
    defer_taskrun: bool,
    /// The pinned pool's region, registered as fixed buffer 0: (start address, length).
    fixed_region: Option<(usize, usize)>,
    /// Reads and writes that went through the fixed buffer.
    fixed_ios: u64,
    /// Abort (`ASYNC_CANCEL`) requests in the kernel; each posts one completion of its own.
    cancels_in_kernel: usize,
    _not_send: PhantomData<*const ()>,
}

impl UringQueuePair {
    fn new(
        file: Arc<File>,
        ns: NamespaceInfo,
        mode: CompletionMode,
        defer_taskrun: bool,
        depth: usize,
        side_ring: bool,
    ) -> Result<UringQueuePair, QueuePairError> {
        if depth == 0 || depth > QUEUE_DEPTH_MAX {
            return Err(QueuePairError::BadDepth {
                depth,
                max: QUEUE_DEPTH_MAX,
            });
        }
        let entries = depth.next_power_of_two() as u32;
        let ring = match mode {
            CompletionMode::Interrupt if defer_taskrun => deferred_ring(entries)?,
            CompletionMode::Interrupt => IoUring::builder()
                .setup_single_issuer()
                .build(entries)
                .or_else(|_| IoUring::new(entries))?,
            CompletionMode::Poll => IoUring::builder().setup_iopoll().build(entries)?,
            CompletionMode::HybridPoll => sys::hybrid_iopoll_ring(entries)?,
        };
        ring.submitter().register_files(&[file.as_raw_fd()])?;
        // Register the pinned pool once: reads and writes into it skip the kernel's per-I/O
        // page pinning. Refused registration (RLIMIT_MEMLOCK for an unprivileged user)
        // leaves plain reads and writes.
        let fixed_region = crate::buf::pinned_region().and_then(|(base, len)| {
            let iov = libc::iovec {
                iov_base: base.cast(),
                iov_len: len,
            };
            // SAFETY: the pinned pool's region is mapped for the life of the process and
            // never remapped, so the pages the kernel pins stay the ones at these addresses.
            unsafe { ring.submitter().register_buffers(&[iov]) }
                .ok()
                .map(|()| (base as usize, len))
        });
        let side = if side_ring {
            let ring = IoUring::builder()
                .setup_single_issuer()
                .build(entries)
                .or_else(|_| IoUring::new(entries))?;
            ring.submitter().register_files(&[file.as_raw_fd()])?;
            Some(SideRing {
                ring,
                in_kernel: 0,
                unsubmitted: 0,
                cancels_in_kernel: 0,
            })
        } else {
            None
        };
        let event_fd = if mode == CompletionMode::Interrupt {
            let efd = EventFd::new()?;
            ring.submitter().register_eventfd(efd.as_fd().as_raw_fd())?;
            if let Some(side) = &side {
                side.ring
                    .submitter()
                    .register_eventfd(efd.as_fd().as_raw_fd())?;
            }
            Some(efd)
        } else {
            None
        };
        Ok(UringQueuePair {
            ring,
            side,
            _file: file,
            mode,
            ns,
            depth,
            slots: vec![None; depth],
            free_slots: (0..depth as u32).rev().collect(),
            in_kernel: 0,
            unsubmitted: 0,
            local: VecDeque::with_capacity(depth),
            retry_zeroes: Vec::with_capacity(depth),
            zero_range_unsupported: false,
            event_fd,
            defer_taskrun,
            fixed_region,
            fixed_ios: 0,
            cancels_in_kernel: 0,
            _not_send: PhantomData,
        })
    }

    /// Whether the pinned buffer pool is registered with this ring.
    pub fn has_fixed_buffers(&self) -> bool {
        self.fixed_region.is_some()
    }

    /// Reads and writes so far whose buffer lay in the registered pool.
    pub fn fixed_ios(&self) -> u64 {
        self.fixed_ios
    }

    /// Whether `len` bytes at `ptr` lie inside the registered region.
    fn in_fixed_region(&self, ptr: *mut u8, len: u64) -> bool {
        self.fixed_region.is_some_and(|(base, region_len)| {
            let at = ptr as usize;
            at >= base && (at - base) as u64 + len <= region_len as u64
        })
    }

    /// How this queue pair finds completions.
    pub fn mode(&self) -> CompletionMode {
        self.mode
    }

    /// Hands every pending submission entry to the kernel: one `io_uring_enter` per ring
    /// with entries.
    fn flush(&mut self) {
        enter(&mut self.ring, &mut self.unsubmitted);
        if let Some(side) = &mut self.side {
            enter(&mut side.ring, &mut side.unsubmitted);
        }
    }

    /// The main ring, or the side ring where there is one and `side` asks for it.
    fn ring_of(&mut self, side: bool) -> &mut IoUring {
        match (&mut self.side, side) {
            (Some(s), true) => &mut s.ring,
            _ => &mut self.ring,
        }
    }

    /// Pushes `entry` on its ring, entering a full submission queue first; false if it is
    /// still full.
    ///
    /// # Safety
    /// As [`io_uring::SubmissionQueue::push`]: whatever the entry points at must stay valid
    /// until its completion.
    unsafe fn push(&mut self, entry: &squeue::Entry, side: bool) -> bool {
        if self.ring_of(side).submission().is_full() {
            self.flush();
        }
        // SAFETY: the caller's guarantee.
        if unsafe { self.ring_of(side).submission().push(entry) }.is_err() {
            return false;
        }
        match (&mut self.side, side) {
            (Some(s), true) => s.unsubmitted += 1,
            _ => self.unsubmitted += 1,
        }
        true
    }

    /// Commands in the kernel on the main ring.
    fn main_in_kernel(&self) -> usize {
        self.in_kernel - self.side.as_ref().map_or(0, |s| s.in_kernel)
    }

    /// In polled modes the kernel finds completions only when asked; with deferred task work,
    /// it posts them only when asked. Either way one `io_uring_enter` with GETEVENTS, and in
    /// interrupt mode only when the ring flags work pending (a shared-memory load; no
    /// syscall while the device is still busy).
    fn poll_kernel(&mut self) {
        let asked = if self.mode == CompletionMode::Interrupt {
            self.defer_taskrun && self.ring.submission().taskrun()
        } else {
            self.main_in_kernel() > self.unsubmitted
        };
        if asked {
            match self.ring.submit_and_wait(0) {
                Ok(_) => {}
                Err(e) if transient(&e) => {}
                Err(e) => panic!("io_uring_enter (getevents) failed on a valid ring: {e}"),
            }
        }
    }

    fn sqe_for(&self, slot: u32, flight: &InFlight) -> squeue::Entry {
        let file = types::Fixed(0);
        let entry = match flight.opcode {
            Opcode::Read | Opcode::Write => unreachable!("reads and writes carry a buffer"),
            Opcode::Flush => opcode::Fsync::new(file)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Opcode::WriteZeroes if flight.zeroing == Zeroing::ZeroRange => {
                opcode::Fallocate::new(file, flight.len_bytes)
                    .offset(flight.offset_bytes)
                    .mode(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE)
                    .build()
            }
            Opcode::WriteZeroes if flight.zeroing == Zeroing::Allocate => {
                opcode::Fallocate::new(file, flight.len_bytes)
                    .offset(flight.offset_bytes)
                    .mode(libc::FALLOC_FL_KEEP_SIZE)
                    .build()
            }
            Opcode::WriteZeroes | Opcode::DatasetManagement => {
                opcode::Fallocate::new(file, flight.len_bytes)
                    .offset(flight.offset_bytes)
                    .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                    .build()
            }
        };
        entry.user_data(u64::from(slot))
    }

    /// Submits the next step of the Write Zeroes that have one (see [`Zeroing`]). One that
    /// finds the submission queue full waits for the next poll.
    fn resubmit_zeroes(&mut self) {
        while let Some(&slot) = self.retry_zeroes.last() {
            let flight = self.slots[slot as usize].expect("retried slot is in flight");
            let entry = self.sqe_for(slot, &flight);
            // SAFETY: fallocate carries no buffer.
            if !unsafe { self.push(&entry, flight.side) } {
                return;
            }
            self.retry_zeroes.pop();
        }
    }

    fn complete_locally(&mut self, tag: u64, status: Status) {
        self.local.push_back(Completion { tag, status });
    }

    /// Reaps up to `max` completions from one ring (the side ring if `side`).
    /// One look at the completion queue per batch: a batch that comes back short emptied it,
    /// and the poll ends there without another look.
    fn reap(&mut self, side: bool, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        let mut done = 0;
        let mut batch = [(0u64, 0i32); REAP_BATCH];
        while done < max {
            let want = (max - done).min(REAP_BATCH);
            let mut n = 0;
            for cqe in self.ring_of(side).completion().take(want) {
                batch[n] = (cqe.user_data(), cqe.result());
                n += 1;
            }
            for &(user_data, result) in &batch[..n] {
                done += self.take_cqe(user_data, result, side, out);
            }
            if n < want {
                break;
            }
        }
        done
    }

    /// Accounts for one completion of a ring; returns 1 if it completed a command.
    fn take_cqe(
        &mut self,
        user_data: u64,
        result: i32,
        side: bool,
        out: &mut dyn FnMut(Completion),
    ) -> usize {
        if user_data == CANCEL_USER_DATA {
            // An abort's own completion; the aborted command completes by itself.
            match (&mut self.side, side) {
                (Some(s), true) => s.cancels_in_kernel -= 1,
                _ => self.cancels_in_kernel -= 1,
            }
            return 0;
        }
        let slot = user_data as u32;
        let mut flight = self.slots[slot as usize]
            .take()
            .unwrap_or_else(|| panic!("io_uring completion for idle slot {slot}"));
        let next = match (flight.opcode, flight.zeroing, result) {
            // The file system has no zero-range (tmpfs): punching a hole zeroes too.
            (Opcode::WriteZeroes, Zeroing::ZeroRange, r) if r == -libc::EOPNOTSUPP => {
                self.zero_range_unsupported = true;
                Some(Zeroing::PunchHole)
            }
            // Zeroed by deallocating: allocate again unless deallocation was allowed.
            (Opcode::WriteZeroes, Zeroing::PunchHole, 0) if !flight.may_deallocate => {
                Some(Zeroing::Allocate)
            }
            _ => None,
        };
        if let Some(next) = next {
            flight.zeroing = next;
            self.slots[slot as usize] = Some(flight);
            self.retry_zeroes.push(slot);
            return 0;
        }
        self.in_kernel -= 1;
        if flight.side {
            if let Some(s) = &mut self.side {
                s.in_kernel -= 1;
            }
        }
        self.free_slots.push(slot);
        out(Completion {
            tag: flight.tag,
            status: status_of(result, &flight),
        });
        1
    }

    /// Commands and aborts in the kernel on either ring.
    fn in_kernel_total(&self) -> usize {
        self.in_kernel
            + self.cancels_in_kernel
            + self.side.as_ref().map_or(0, |s| s.cancels_in_kernel)
    }
}

/// Completions taken from a ring at a time, into a buffer on the stack.
const REAP_BATCH: usize = 32;

/// Enters the entries pushed on `ring` (`unsubmitted` of them), if any.
fn enter(ring: &mut IoUring, unsubmitted: &mut usize) {
    if *unsubmitted == 0 {
        return;
    }
    match ring.submit() {
        Ok(n) => *unsubmitted -= n.min(*unsubmitted),
        // Transient: the kernel is short of memory or completions; the next poll retries.
        Err(e) if transient(&e) => {}
        Err(e) => panic!("io_uring_enter failed on a valid ring: {e}"),
    }
}

/// An `io_uring_enter` failure that the next call may not repeat: the kernel was short of
/// memory or completion space, or a signal interrupted the call.
fn transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAGAIN | libc::EBUSY | libc::EINTR)
    )
}

/// The NVMe status an io_uring result stands for.
fn status_of(result: i32, flight: &InFlight) -> Status {
    if result >= 0 {
        let short = matches!(flight.opcode, Opcode::Read | Opcode::Write)
            && result as u64 != flight.len_bytes;
        return if short {
            Status::DATA_TRANSFER_ERROR
        } else {
            Status::SUCCESS
        };
    }
    match -result {
        libc::EIO | libc::ENODATA | libc::EBADMSG | libc::EILSEQ => match flight.opcode {
            Opcode::Read => Status::UNRECOVERED_READ_ERROR,
            _ => Status::WRITE_FAULT,
        },
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => Status::CAPACITY_EXCEEDED,
        libc::EINVAL => Status::INVALID_FIELD,
        libc::EOPNOTSUPP => Status::INVALID_OPCODE,
        libc::ECANCELED | libc::EINTR => Status::ABORT_REQUESTED,
        _ => Status::INTERNAL_ERROR,
    }
}

impl QueuePair for UringQueuePair {
    unsafe fn submit(&mut self, cmd: &Command<'_>, tag: u64) -> Result<(), SubmitError> {
        if self.in_kernel + self.local.len() >= self.depth {
            return Err(SubmitError::QueueFull { depth: self.depth });
        }
        let lba_bytes = self.ns.lba_size_bytes;
        cmd.check(lba_bytes)?;
        let in_range = match cmd.opcode() {
            Opcode::Flush => true,
            _ => cmd
                .slba()
                .checked_add(u64::from(cmd.nlb()))
                .is_some_and(|end| end <= self.ns.capacity_lbas),
        };
        if !in_range {
            self.complete_locally(tag, Status::LBA_OUT_OF_RANGE);
            return Ok(());
        }
        let len_bytes = u64::from(cmd.nlb()) * u64::from(lba_bytes);
        let moves_data = matches!(cmd.opcode(), Opcode::Read | Opcode::Write);
        if moves_data && len_bytes > u64::from(self.ns.transfer_bytes_max) {
            self.complete_locally(tag, Status::INVALID_FIELD);
            return Ok(());
        }
        let slot = self
            .free_slots
            .pop()
            .expect("a free slot exists below the queue depth");
        let flight = InFlight {
            tag,
            opcode: cmd.opcode(),
            len_bytes,
            offset_bytes: cmd.slba() * u64::from(lba_bytes),
            may_deallocate: cmd.may_deallocate(),
            zeroing: if self.zero_range_unsupported {
                Zeroing::PunchHole
            } else {
                Zeroing::ZeroRange
            },
            side: !moves_data && self.side.is_some(),
        };
        let file = types::Fixed(0);
        let fixed = moves_data && self.in_fixed_region(cmd.buf_ptr(), len_bytes);
        self.fixed_ios += u64::from(fixed);
        let entry = match cmd.opcode() {
            Opcode::Read if fixed => {
                opcode::ReadFixed::new(file, cmd.buf_ptr(), len_bytes as u32, 0)
                    .offset(flight.offset_bytes)
                    .build()
                    .user_data(u64::from(slot))
            }
            Opcode::Write if fixed => {
                opcode::WriteFixed::new(file, cmd.buf_ptr(), len_bytes as u32, 0)
                    .offset(flight.offset_bytes)
                    .rw_flags(if cmd.fua() { libc::RWF_DSYNC } else { 0 })
                    .build()
                    .user_data(u64::from(slot))
            }
            Opcode::Read => opcode::Read::new(file, cmd.buf_ptr(), len_bytes as u32)
                .offset(flight.offset_bytes)
                .build()
                .user_data(u64::from(slot)),
            Opcode::Write => opcode::Write::new(file, cmd.buf_ptr(), len_bytes as u32)
                .offset(flight.offset_bytes)
                .rw_flags(if cmd.fua() { libc::RWF_DSYNC } else { 0 })
                .build()
                .user_data(u64::from(slot)),
            _ => self.sqe_for(slot, &flight),
        };
        // SAFETY: the caller of `submit` guarantees the command's buffer stays valid and
        // untouched until its completion is reaped (QueuePair::submit's contract), and Drop
        // waits for every command in the kernel before the ring goes away.
        if !unsafe { self.push(&entry, flight.side) } {
            self.free_slots.push(slot);
            return Err(SubmitError::QueueFull { depth: self.depth });
        }
        self.slots[slot as usize] = Some(flight);
        self.in_kernel += 1;
        if let Some(side) = self.side.as_mut().filter(|_| flight.side) {
            side.in_kernel += 1;
        }
        Ok(())
    }

    fn process_completions(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        if !self.retry_zeroes.is_empty() {
            self.resubmit_zeroes();
        }
        self.flush();
        let mut done = 0;
        while done < max {
            let Some(c) = self.local.pop_front() else {
                break;
            };
            out(c);
            done += 1;
        }
        if done == max || self.in_kernel_total() == 0 {
            return done;
        }
        self.poll_kernel();
        done += self.reap(false, max - done, out);
        if self.side.is_some() {
            done += self.reap(true, max - done, out);
        }
        self.resubmit_zeroes();
        done
    }

    fn interrupt_fd(&self) -> Option<BorrowedFd<'_>> {
        self.event_fd.as_ref().map(EventFd::as_fd)
    }

    fn arm_interrupt(&mut self) {
        self.flush();
        let Some(efd) = &self.event_fd else {
            return;
        };
        // The eventfd counts every completion posted since it was last drained: clear it,
        // then make it readable again if completions already wait in the ring, so a reactor
        // blocking on it cannot miss them.
        efd.drain();
        // Deferred task work pending: the kernel signalled the eventfd for it (possibly before
        // the drain); the completion is posted once the reactor polls. Entries a transient
        // `io_uring_enter` failure left unsubmitted, and Write Zeroes with a next step, wait
        // for the reactor's next poll too: nothing in the kernel would signal for them.
        let ready = !self.local.is_empty()
            || !self.ring.completion().is_empty()
            || (self.defer_taskrun && self.ring.submission().taskrun())
            || self.unsubmitted > 0
            || !self.retry_zeroes.is_empty()
            || self
                .side
                .as_mut()
                .is_some_and(|s| !s.ring.completion().is_empty() || s.unsubmitted > 0);
        if ready {
            efd.signal().expect("signalling our own eventfd");
        }
    }

    /// Drains the eventfd, which the kernel bumped for every completion polled for since it
    /// was last armed.
    fn disarm_interrupt(&mut self) {
        if let Some(efd) = &self.event_fd {
            efd.drain();
        }
    }

    fn outstanding(&self) -> usize {
        self.in_kernel + self.local.len()
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn namespace(&self) -> NamespaceInfo {
        self.ns
    }

    /// Asks the kernel to cancel the command (`IORING_OP_ASYNC_CANCEL`). A request still
    /// queued in the kernel (an `fsync` or `fallocate` waiting for a worker) completes with
    /// Abort Requested; one already at the device cannot be pulled back and completes with
    /// its own status when the device (or the block layer's own timeout) finishes it.
    ///
    /// In polled modes a read or write is not asked about: an IOPOLL ring refuses
    /// `ASYNC_CANCEL`, and the command is at the device, to complete by itself. The other
    /// commands, on the side ring, are asked about there.
    fn abort(&mut self, tag: u64) -> Result<(), RecoveryError> {
        let Some((slot, flight)) = self
            .slots
            .iter()
            .enumerate()
            .find_map(|(i, f)| f.filter(|f| f.tag == tag).map(|f| (i, f)))
        else {
            return Ok(()); // completed meanwhile, or completed locally
        };
        if self.mode != CompletionMode::Interrupt && !flight.side {
            return Ok(());
        }
        let cancels = match (&self.side, flight.side) {
            (Some(s), true) => s.cancels_in_kernel,
            _ => self.cancels_in_kernel,
        };
        if cancels >= self.depth {
            return Err(RecoveryError::Failed("too many aborts in flight"));
        }
        let cancel = opcode::AsyncCancel::new(slot as u64)
            .build()
            .user_data(CANCEL_USER_DATA);
        // SAFETY: a cancel request carries no buffer.
        if !unsafe { self.push(&cancel, flight.side) } {
            return Err(RecoveryError::Failed("submission queue full"));
        }
        match (&mut self.side, flight.side) {
            (Some(s), true) => s.cancels_in_kernel += 1,
            _ => self.cancels_in_kernel += 1,
        }
        self.flush();
        Ok(())
    }

    // `reset` keeps the default (Unsupported): io_uring cannot take back a command the
    // device holds, so no reset could promise that its buffer is left alone. The reactor
    // quarantines such a command until its completion arrives; the kernel's own block-layer
    // timeout (30 s for NVMe and SCSI) guarantees that it does.
}

impl Drop for UringQueuePair {
    /// Waits for every command the kernel holds: their buffers belong to the caller and
    /// must not be written after the queue pair is gone. Block I/O always completes (the
    /// kernel's own timeouts fail it), so this ends.
    fn drop(&mut self) {
        loop {
            // Write Zeroes waiting to be resubmitted are not in the kernel: nothing to wait
            // for (a completion reaped below may add one).
            for slot in std::mem::take(&mut self.retry_zeroes) {
                let flight = self.slots[slot as usize].take();
                self.in_kernel -= 1;
                if let Some(side) = self
                    .side
                    .as_mut()
                    .filter(|_| flight.is_some_and(|f| f.side))
                {
                    side.in_kernel -= 1;
                }
            }
            if self.in_kernel_total() == 0 {
                return;
            }
            // Each ring is waited on for its own commands: the main ring's first.
            let on_main = self.main_in_kernel() + self.cancels_in_kernel > 0;
            match self.ring_of(!on_main).submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if transient(&e) => {}
                Err(e) => {
                    eprintln!(
                        "hypoll: io_uring queue pair cannot wait for its {} commands ({e}); \
                         aborting rather than let the kernel write freed memory",
                        self.in_kernel
                    );
                    std::process::abort();
                }
            }
            self.reap(false, usize::MAX, &mut |_| {});
            if self.side.is_some() {
                self.reap(true, usize::MAX, &mut |_| {});
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::SyncIo;

    #[test]
    fn spec_keys_parse_and_print_back() {
        let mut cfg = UringConfig::new("/tmp/disk.img");
        assert_eq!(cfg.to_string(), "uring:/tmp/disk.img");
        cfg.set("direct", "0").unwrap();
        cfg.set("size", "64M").unwrap();
        cfg.set("lba", "512").unwrap();
        cfg.set("iopoll", "hybrid").unwrap();
        cfg.set("taskrun", "signal").unwrap();
        assert_eq!(
            cfg.to_string(),
            "uring:/tmp/disk.img,direct=0,size=64M,lba=512,iopoll=hybrid,taskrun=signal"
        );
        cfg.set("taskrun", "defer").unwrap();
        assert_eq!(cfg.taskrun, TaskRun::Defer);
        assert!(matches!(
            cfg.set("taskrun", "later"),
            Err(ConfigError::BadValue { .. })
        ));
        assert!(matches!(
            cfg.set("iopoll", "sometimes"),
            Err(ConfigError::BadValue { .. })
        ));
        assert!(matches!(
            cfg.set("depth", "4"),
            Err(ConfigError::UnknownKey { .. })
        ));
    }

    /// Reaps until one completion comes, for up to 10 s.
    fn wait_one(qp: &mut UringQueuePair) -> (u64, Status) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = None;
        while seen.is_none() {
            qp.process_completions(1, &mut |c| seen = Some((c.tag, c.status)));
            assert!(Instant::now() < deadline, "no completion within 10 s");
        }
        seen.unwrap()
    }

    /// Polled modes put Flush, Write Zeroes, Deallocate and their aborts on a side ring,
    /// which an IOPOLL ring cannot carry. This VM's disk has no polled mode, so the side
    /// ring is forced here on an interrupt-mode queue pair, which then wakes on either ring.
    #[test]
    fn the_side_ring_carries_every_command_but_reads_and_writes() {
        const LBA: usize = 4096;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        let data: Vec<u8> = (0..64 * LBA).map(|i| (i * 13 + i / LBA) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let mut cfg = UringConfig::new(&path);
        cfg.set("direct", "0").unwrap();
        let ctrl = UringController::open(&cfg).unwrap();
        let mut qp = UringQueuePair::new(
            ctrl.file.clone(),
            ctrl.ns,
            ctrl.mode,
            ctrl.defer_taskrun,
            8,
            true,
        )
        .unwrap();
        // A flush goes to the side ring, and its completion wakes an armed queue pair.
        // SAFETY: a flush carries no buffer.
        unsafe { qp.submit(&Command::flush(), 1) }.unwrap();
        assert_eq!(qp.side.as_ref().map(|s| s.in_kernel), Some(1));
        qp.arm_interrupt();
        let fd = qp.interrupt_fd().expect("interrupt mode");
        assert!(crate::sys::wait_readable(fd, 10_000).unwrap(), "no wake-up");
        assert_eq!(wait_one(&mut qp), (1, Status::SUCCESS));
        // An abort of a side command goes there too; the command completes once.
        // SAFETY: as above.
        unsafe { qp.submit(&Command::flush(), 2) }.unwrap();
        qp.abort(2).unwrap();
        let (tag, status) = wait_one(&mut qp);
        assert_eq!(tag, 2);
        assert!(
            matches!(status, Status::SUCCESS | Status::ABORT_REQUESTED),
            "{status}"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while qp.in_kernel_total() > 0 {
            qp.process_completions(8, &mut |c| panic!("completed twice: {c:?}"));
            assert!(
                Instant::now() < deadline,
                "the abort's own completion never came"
            );
        }
        // Reads and writes stay on the main ring; the rest round-trips through the side.
        let mut io = SyncIo::new(&mut qp, Duration::from_secs(10));
        let pattern: Vec<u8> = (0..2 * LBA).map(|i| (i * 7 + 3) as u8).collect();
        io.write(2, &pattern).unwrap();
        io.flush().unwrap();
        io.write_zeroes(10, 2).unwrap();
        io.write_zeroes_deallocating(20, 2).unwrap();
        io.deallocate(30, 2).unwrap();
        assert_eq!(&io.read(2, 2).unwrap()[..], &pattern[..]);
        for lba in [10, 20, 30] {
            assert!(
                io.read(lba, 2).unwrap().iter().all(|&b| b == 0),
                "lba {lba}"
            );
        }
        assert_eq!(&io.read(12, 1).unwrap()[..], &data[12 * LBA..13 * LBA]);
        assert_eq!(&io.read(32, 1).unwrap()[..], &data[32 * LBA..33 * LBA]);
        drop(io);
        assert_eq!(qp.side.as_ref().map(|s| s.in_kernel), Some(0));
        // Dropped with a side command in flight: the drop waits for it.
        // SAFETY: as above.
        unsafe { qp.submit(&Command::flush(), 3) }.unwrap();
        drop(qp);
    }

    #[test]
    fn io_uring_results_map_to_nvme_statuses() {
        let read = InFlight {
            tag: 1,
            opcode: Opcode::Read,
            len_bytes: 4096,
            offset_bytes: 0,
            may_deallocate: false,
            zeroing: Zeroing::ZeroRange,
            side: false,
        };
        let write = InFlight {
            opcode: Opcode::Write,
            ..read
        };
        assert_eq!(status_of(4096, &read), Status::SUCCESS);
        assert_eq!(status_of(512, &read), Status::DATA_TRANSFER_ERROR);
        assert_eq!(status_of(-libc::EIO, &read), Status::UNRECOVERED_READ_ERROR);
        assert_eq!(status_of(-libc::EIO, &write), Status::WRITE_FAULT);
        assert_eq!(status_of(-libc::ENOSPC, &write), Status::CAPACITY_EXCEEDED);
        assert_eq!(status_of(-libc::ECANCELED, &read), Status::ABORT_REQUESTED);
        let flush = InFlight {
            opcode: Opcode::Flush,
            len_bytes: 0,
            ..read
        };
        assert_eq!(status_of(0, &flush), Status::SUCCESS);
    }
}
