//! Choosing how a `uring:` device's completions are found: interrupts, polling or hybrid
//! polling, as the device string asks.
//!
//! Polled mode needs two things, and each is checked. The disk under the file must poll: its
//! request queue says so in sysfs (`queue/io_poll`), and without it every polled read that
//! reaches the disk fails with `EOPNOTSUPP`. And the file system and kernel must take a
//! polled read at all, which one polled read of the file shows. That read alone is not
//! enough: where it lands on a hole (a sparse file, a file just made with `truncate`) the
//! file system answers with zeroes and the disk is never asked. It reads a block that holds
//! data where the file has one, so it also reaches the disk, but a file may have none, and
//! the probe must never write to a user's file. Checking sysfs is what makes the choice hold
//! on any file.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};

use super::open::UringOpenError;
use super::{sys, CompletionMode, IopollMode, UringConfig};
use crate::buf::IoBuf;

/// How long opening waits for the IOPOLL probe read before it gives up on polled mode.
const IOPOLL_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Where sysfs lists block devices by number (`MAJOR:MINOR`).
const SYS_DEV_BLOCK: &str = "/sys/dev/block";

/// Decides between interrupts, polling and hybrid polling. When the device string leaves it
/// to us, polling is chosen only where the disk polls and a polled read of the file works;
/// otherwise interrupts, and the reason is logged and kept for `describe`.
pub(super) fn choose_mode(
    cfg: &UringConfig,
    file: &File,
    lba_bytes: u32,
    size_bytes: u64,
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
    let probed = device_polls(file).and_then(|disk| {
        let read = probe_iopoll(file, lba_bytes, size_bytes, hybrid)?;
        Ok(format!("{disk}; {read}"))
    });
    match probed {
        Ok(note) if hybrid => Ok((CompletionMode::HybridPoll, format!("iopoll=hybrid: {note}"))),
        Ok(note) => Ok((
            CompletionMode::Poll,
            format!("polled I/O supported: {note}"),
        )),
        Err(detail) if cfg.iopoll == IopollMode::Auto => {
            tracing::info!(
                device = %cfg,
                "polled I/O is unavailable, so completions come by interrupt: {detail}"
            );
            Ok((
                CompletionMode::Interrupt,
                format!("polled I/O unavailable: {detail}"),
            ))
        }
        Err(detail) => Err(unsupported(detail)),
    }
}

/// Whether the disk under `file` (the block device itself, or the one holding the file
/// system the file is on) polls; `Ok` names it, `Err` says why not.
pub(super) fn device_polls(file: &File) -> Result<String, String> {
    let meta = file
        .metadata()
        .map_err(|e| format!("reading the file's metadata failed ({e})"))?;
    let dev = if meta.file_type().is_block_device() {
        meta.rdev()
    } else {
        meta.dev()
    };
    queue_polls_at(Path::new(SYS_DEV_BLOCK), libc::major(dev), libc::minor(dev))
}

/// Whether the request queue of block device `major:minor` polls, as the sysfs directory
/// `sys_dev_block` (`/sys/dev/block`, or a copy of its shape in a test) shows it.
pub(super) fn queue_polls_at(
    sys_dev_block: &Path,
    major: u32,
    minor: u32,
) -> Result<String, String> {
    let number = format!("{major}:{minor}");
    // tmpfs, overlayfs, btrfs, network file systems and the like give their files a device
    // number of their own that no block device has.
    let dev_dir = std::fs::canonicalize(sys_dev_block.join(&number)).map_err(|_| {
        format!(
            "no block device holds the file (device {number} is not in {}): a file can be \
             polled only on a file system that lies on one disk (not tmpfs, overlayfs, \
             btrfs or a network file system)",
            sys_dev_block.display()
        )
    })?;
    // A partition has no request queue of its own: its I/O goes through its disk's.
    let disk_dir = if dev_dir.join("partition").exists() {
        dev_dir.parent().unwrap_or(&dev_dir)
    } else {
        &dev_dir
    };
    let name = disk_dir
        .file_name()
        .map_or_else(|| number.clone(), |n| n.to_string_lossy().into_owned());
    match std::fs::read_to_string(disk_dir.join("queue/io_poll")) {
        Ok(v) if v.trim() == "1" => Ok(format!("{name} ({number}) polls")),
        Ok(v) => Err(format!(
            "the disk {name} ({number}) has no poll queues (its queue/io_poll is {})",
            v.trim()
        )),
        Err(e) => Err(format!(
            "the disk {name} ({number}) does not say whether it polls (reading its \
             queue/io_poll failed: {e})"
        )),
    }
}

/// Reads one block through a polled ring: the first that holds data within the namespace,
/// so that the read reaches the disk, which reports a lack of poll queues per request
/// (`EOPNOTSUPP`); where there is none, block 0, a hole, which shows only that the file
/// system and kernel take polled reads. `Ok` says which it read.
fn probe_iopoll(
    file: &File,
    lba_bytes: u32,
    size_bytes: u64,
    hybrid: bool,
) -> Result<String, String> {
    let mut ring = if hybrid {
        sys::hybrid_iopoll_ring(2, None).map_err(|e| {
            format!("creating a hybrid iopoll ring failed ({e}); it needs Linux 6.13")
        })?
    } else {
        IoUring::builder()
            .setup_iopoll()
            .build(2)
            .map_err(|e| format!("creating an iopoll ring failed ({e})"))?
    };
    let lba = u64::from(lba_bytes);
    let data_offset_bytes = sys::data_offset_bytes(file)
        .ok()
        .flatten()
        .map(|at| at - at % lba)
        .filter(|at| at + lba <= size_bytes);
    let mut buf = IoBuf::zeroed(lba_bytes as usize);
    let read = opcode::Read::new(types::Fd(file.as_raw_fd()), buf.as_mut_ptr(), lba_bytes)
        .offset(data_offset_bytes.unwrap_or(0))
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
                r if r >= 0 => Ok(match data_offset_bytes {
                    Some(at) => format!("a polled read of block {} worked", at / lba),
                    None => "the file holds no data yet: a polled read of a hole worked".into(),
                }),
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
