//! Choosing how a `uring:` device's completions are found: interrupts, polling or hybrid
//! polling, as the device string asks, probing IOPOLL with one polled read when it leaves
//! the choice open.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring};

use super::open::UringOpenError;
use super::{sys, CompletionMode, IopollMode, UringConfig};
use crate::buf::IoBuf;

/// How long opening waits for the IOPOLL probe read before it gives up on polled mode.
const IOPOLL_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Decides between interrupts, polling and hybrid polling, probing the device with one
/// polled read when the device string leaves it to us.
pub(super) fn choose_mode(
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
