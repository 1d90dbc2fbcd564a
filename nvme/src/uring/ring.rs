//! Ring plumbing shared by opening and the queue pair: a ring that defers task work to its
//! owner's `io_uring_enter`, entering pushed entries, and which `io_uring_enter` failures
//! are worth retrying.

use std::io;

use io_uring::IoUring;

/// A ring whose task work waits for `io_uring_enter` with GETEVENTS, and which flags pending
/// work in the submission ring (`IORING_SQ_TASKRUN`). One thread only, as every queue pair.
pub(super) fn deferred_ring(entries: u32) -> io::Result<IoUring> {
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_taskrun_flag()
        .build(entries)
}

/// Enters the entries pushed on `ring` (`unsubmitted` of them), if any.
pub(super) fn enter(ring: &mut IoUring, unsubmitted: &mut usize) {
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
pub(super) fn transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAGAIN | libc::EBUSY | libc::EINTR)
    )
}
