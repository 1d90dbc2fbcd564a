//! Ring plumbing shared by opening and the queue pair: creating a queue pair's main ring for
//! its completion mode (deferred task work, polling, a submission thread), entering pushed
//! entries, and which `io_uring_enter` failures are worth retrying.
//!
//! With a submission thread (`sqpoll=on`, `IORING_SETUP_SQPOLL`) the kernel takes entries
//! from the ring as soon as their tail is published, without a system call, as long as the
//! thread is awake. After `sqpoll_idle_ms` with nothing to take it sets
//! `IORING_SQ_NEED_WAKEUP` in the ring's flags and sleeps; then nothing is taken until an
//! `io_uring_enter` with `IORING_ENTER_SQ_WAKEUP`. The io-uring crate's `submit` makes that
//! enter exactly when the flag is set (after a full fence, so a thread falling asleep
//! either sees the new entries or is seen asleep), so every submission here goes through it.

use std::io;

use io_uring::IoUring;

use super::{sys, CompletionMode, SqPoll};

/// A ring whose task work waits for `io_uring_enter` with GETEVENTS, and which flags pending
/// work in the submission ring (`IORING_SQ_TASKRUN`). One thread only, as every queue pair.
pub(super) fn deferred_ring(entries: u32) -> io::Result<IoUring> {
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_taskrun_flag()
        .build(entries)
}

/// A queue pair's main ring for `mode`. With `sqpoll` the ring gets a submission thread of
/// its own; the kernel refuses `DEFER_TASKRUN` and `TASKRUN_FLAG` beside it (completions'
/// task work then runs in that thread), so `defer_taskrun` must be false, and
/// `SINGLE_ISSUER` is left out: the thread, not the reactor, issues.
pub(super) fn main_ring(
    mode: CompletionMode,
    defer_taskrun: bool,
    sqpoll: Option<SqPoll>,
    entries: u32,
) -> io::Result<IoUring> {
    debug_assert!(!(defer_taskrun && sqpoll.is_some()));
    match (mode, sqpoll) {
        (CompletionMode::HybridPoll, _) => sys::hybrid_iopoll_ring(entries, sqpoll),
        (_, Some(sq)) => {
            let mut builder = IoUring::builder();
            if mode == CompletionMode::Poll {
                builder.setup_iopoll();
            }
            builder.setup_sqpoll(sq.idle_ms);
            if let Some(cpu) = sq.cpu {
                builder.setup_sqpoll_cpu(cpu);
            }
            builder.build(entries)
        }
        (CompletionMode::Interrupt, None) if defer_taskrun => deferred_ring(entries),
        (CompletionMode::Interrupt, None) => IoUring::builder()
            .setup_single_issuer()
            .build(entries)
            .or_else(|_| IoUring::new(entries)),
        (CompletionMode::Poll, None) => IoUring::builder().setup_iopoll().build(entries),
    }
}

/// Enters the entries pushed on `ring` (`unsubmitted` of them), if any.
pub(super) fn enter(ring: &mut IoUring, unsubmitted: &mut usize) {
    if *unsubmitted == 0 {
        return;
    }
    match ring.submit() {
        Ok(n) => entered(ring, unsubmitted, n),
        // Transient: the kernel is short of memory or completions; the next poll retries.
        Err(e) if transient(&e) => {}
        Err(e) => panic!("io_uring_enter failed on a valid ring: {e}"),
    }
}

/// Accounts for a successful submission that reported `n` entries taken. A ring with a
/// submission thread reports only what was still in the queue when it looked (the thread
/// may have taken the rest already), but once `submit` returns the thread is awake or was
/// woken, so everything pushed is the kernel's.
pub(super) fn entered(ring: &IoUring, unsubmitted: &mut usize, n: usize) {
    if ring.params().is_setup_sqpoll() {
        *unsubmitted = 0;
    } else {
        *unsubmitted -= n.min(*unsubmitted);
    }
}

/// Entries of `ring` not yet the kernel's after an `io_uring_enter` that failed: those
/// still in the submission queue, or none where a submission thread takes them (the enter
/// woke it before anything could fail).
pub(super) fn unentered(ring: &mut IoUring) -> usize {
    if ring.params().is_setup_sqpoll() {
        0
    } else {
        ring.submission().len()
    }
}

/// Waits until a ring with a submission thread has room in its submission queue: the
/// thread takes entries on its own time, so a full queue empties without an enter from us,
/// but only once the thread is awake.
pub(super) fn wait_for_room(ring: &mut IoUring) {
    debug_assert!(ring.params().is_setup_sqpoll());
    let woken = ring.submit();
    let waited = woken.and_then(|_| ring.submitter().squeue_wait());
    match waited {
        Ok(_) => {}
        // The caller finds the queue still full and refuses, as on a ring without a thread.
        Err(e) if transient(&e) => {}
        Err(e) => panic!("io_uring_enter (SQ wait) failed on a valid ring: {e}"),
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
