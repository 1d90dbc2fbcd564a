//! Opening a `uring:` device: the file or block device (with O_DIRECT unless `direct=0`),
//! its size and block size checked against the device string, a first ring to see that
//! io_uring works here and takes the pinned pool as fixed buffers, the choice of how
//! completions will be found (made in `iopoll`), and whether reads and writes are made
//! inline (`inline=`). Every refusal is an error that says what to do about it.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;

use io_uring::IoUring;

use super::iopoll::choose_mode;
use super::ring::{deferred_ring, main_ring};
use super::{
    atime, sys, AtimeMode, CompletionMode, InlineMode, TaskRun, UringConfig, UringController,
    URING_FILE_LBA_BYTES, URING_TRANSFER_BYTES_MAX,
};
use crate::config::size_text;
use crate::spec::NamespaceInfo;

/// Why a `uring:` device could not be opened. Each message says what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UringOpenError {
    #[error("{path}: no such file or block device; create it and fill it with data first (e.g. `fio --name=fill --filename={path} --size=1G --rw=write --bs=1M --direct=1`)")]
    NotFound { path: String },
    #[error("{path}: permission denied: the device needs {access} access (check the file's mode and owner, or the block device's group)")]
    PermissionDenied { path: String, access: &'static str },
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
    #[error("{path}: polled I/O (iopoll={mode}) is not supported here: {detail}; it needs O_DIRECT on a disk that polls (an NVMe namespace with poll queues: nvme.poll_queues=N), or on a file in a file system on one; use iopoll=auto to fall back to interrupts, or iopoll=off")]
    IopollUnsupported {
        path: String,
        mode: &'static str,
        detail: String,
    },
    #[error("{path}: inline=on needs direct=0: with O_DIRECT every read waits for the disk, and inline would make the reactor wait for it too")]
    InlineNeedsPageCache { path: String },
    #[error("{path}: sqpoll=on: the kernel refused a ring with a submission thread ({detail}); leave out sqpoll_cpu, or use sqpoll=off")]
    SqpollRefused { path: String, detail: String },
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
            UringOpenError::Unavailable { .. }
            | UringOpenError::IopollUnsupported { .. }
            | UringOpenError::SqpollRefused { .. } => io::ErrorKind::Unsupported,
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

impl UringController {
    /// Opens the file or block device, checks its size against the block size, checks that
    /// io_uring works, and decides how completions will be found.
    pub fn open(cfg: &UringConfig) -> Result<UringController, UringOpenError> {
        let path = cfg.path.display().to_string();
        if cfg.inline == InlineMode::On && cfg.direct {
            return Err(UringOpenError::InlineNeedsPageCache { path });
        }
        let file = open_file(&cfg.path, cfg.direct, cfg.read_only)?;
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
        let (mode, mode_note) = choose_mode(cfg, &file, lba_bytes, size_bytes)?;
        if let Some(sq) = cfg.sqpoll() {
            // Every queue pair's ring is made as this one: refused here, with the reason,
            // rather than on the first queue pair.
            main_ring(mode, false, Some(sq), 2).map_err(|e| UringOpenError::SqpollRefused {
                path: path.clone(),
                detail: sqpoll_refusal(&e, sq.cpu),
            })?;
        }
        let (defer_taskrun, taskrun_note) = match (mode, cfg.taskrun) {
            (CompletionMode::Interrupt, _) if cfg.sqpoll => (
                false,
                "completions posted by the submission thread (sqpoll=on: the kernel takes no \
                 DEFER_TASKRUN beside SQPOLL, so taskrun= does not apply)"
                    .to_string(),
            ),
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
        let (inline, inline_note) = choose_inline(cfg, &file, meta.is_file());
        let (noatime, atime_note) = choose_atime(cfg, &file);
        Ok(UringController {
            cfg: cfg.clone(),
            file: Arc::new(file),
            ns: NamespaceInfo {
                nsid: 1,
                lba_size_bytes: lba_bytes,
                capacity_lbas: size_bytes / u64::from(lba_bytes),
                transfer_bytes_max: URING_TRANSFER_BYTES_MAX,
            },
            mode,
            mode_note,
            fixed_note,
            defer_taskrun,
            taskrun_note,
            inline,
            inline_note,
            noatime,
            atime_note,
        })
    }
}

/// The second descriptor reads through the page cache go through (see `atime.rs`), and what
/// `describe` says of it (empty with O_DIRECT, where the access time is left to the kernel).
fn choose_atime(cfg: &UringConfig, file: &File) -> (Option<Arc<File>>, String) {
    match (cfg.direct, cfg.atime) {
        (true, _) => (None, String::new()),
        (false, AtimeMode::Kernel) => (
            None,
            "each read's access time checked (atime=kernel)".to_string(),
        ),
        (false, AtimeMode::Coarse) => match atime::noatime_reader(file) {
            Ok(reader) => (
                Some(Arc::new(reader)),
                "the access time checked on one read a minute (atime=coarse)".to_string(),
            ),
            Err(why) => (None, format!("each read's access time checked: {why}")),
        },
    }
}

/// Whether reads and writes are made by the reactor's thread (see [`InlineMode`]), and why,
/// for `describe` (empty when there is nothing to say: through io_uring as asked).
/// `inline=on` with O_DIRECT was refused before the file was opened.
fn choose_inline(cfg: &UringConfig, file: &File, regular_file: bool) -> (bool, String) {
    let probe = || {
        // A file system that cannot be asked counts as not in memory: io_uring as usual.
        let in_memory = sys::in_memory_fs(file).unwrap_or(false);
        (in_memory, sys::nowait_read_refused(file))
    };
    let inline = inline_wanted(cfg, regular_file, probe);
    let note = match (inline, cfg.inline) {
        (false, _) => "",
        (true, InlineMode::On) => "reads and writes made inline (inline=on)",
        (true, _) => {
            "reads and writes made inline: the file is in memory, and its file system \
             refuses non-blocking reads, so io_uring would hand each to a worker thread"
        }
    };
    (inline, note.into())
}

/// Whether reads and writes are made inline, as `cfg` asks, for a regular file or not:
/// `inline=auto` asks `probe` (whether the file is in memory, whether its file system
/// refuses a non-blocking read) only for a regular file read through the page cache
/// without a submission thread. A block device never counts as in memory: its node lies
/// in devtmpfs, which `fstatfs` reports as tmpfs.
pub(super) fn inline_wanted(
    cfg: &UringConfig,
    regular_file: bool,
    probe: impl FnOnce() -> (bool, bool),
) -> bool {
    match cfg.inline {
        InlineMode::Off => false,
        InlineMode::On => true,
        InlineMode::Auto if cfg.direct || cfg.sqpoll || !regular_file => false,
        InlineMode::Auto => {
            let (in_memory, nowait_refused) = probe();
            in_memory && nowait_refused
        }
    }
}

/// Why the kernel would not create a ring with a submission thread, in words.
fn sqpoll_refusal(e: &io::Error, cpu: Option<u32>) -> String {
    match (e.raw_os_error(), cpu) {
        (Some(libc::EINVAL), Some(cpu)) => format!(
            "{e}: CPU {cpu} is offline, does not exist, or is outside this process's cpuset"
        ),
        (Some(libc::EPERM), _) => {
            format!("{e}: before Linux 5.11 a submission thread needs CAP_SYS_NICE (or root)")
        }
        _ => e.to_string(),
    }
}

fn open_file(path: &Path, direct: bool, read_only: bool) -> Result<File, UringOpenError> {
    let display = path.display().to_string();
    let mut opts = OpenOptions::new();
    opts.read(true).write(!read_only);
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
            UringOpenError::PermissionDenied {
                path: display,
                access: if read_only { "read" } else { "read and write" },
            }
        }
        Some(libc::EINVAL) if direct => UringOpenError::DirectUnsupported { path: display },
        _ => UringOpenError::Os {
            path: display,
            what: "opening it",
            source: e,
        },
    })
}
