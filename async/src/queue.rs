//! Where woken tasks wait to run: the reactor's own run queue, touched without a lock or an
//! atomic by wakes on the reactor's thread, and a queue for wakes from other threads, which
//! then signal an eventfd so a parked reactor wakes for them.
//!
//! `async-task` asks for a schedule function that is `Send + Sync`, since a waker may travel
//! to any thread, while almost every wake of a storage task comes from the reactor's own
//! thread (an I/O completion, a timer, another task). So the schedule function asks which
//! thread it is on (`pthread_self`, a register read) and takes the lock-free path only on
//! the reactor's thread; everything else goes to the remote queue. The unsafe code here is
//! that claim: the local queue is touched only by the thread that made it.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};

use async_task::Runnable;
use hypoll_reactor::nvme::sys::EventFd;
use parking_lot::Mutex;

/// The run queues of one executor, shared by the executor and every waker of its tasks.
pub(crate) struct RunQueue {
    /// The thread that made the queue (the reactor's): the only one that touches `local`.
    owner: libc::pthread_t,
    /// Tasks woken on the owner thread, oldest first. A task is in at most one queue at a
    /// time (async-task makes at most one `Runnable` per task), so it holds at most as many
    /// as the executor has tasks.
    local: UnsafeCell<VecDeque<Runnable>>,
    /// Set once the executor closed: a wake after it (even on the owner thread) must not
    /// reach a queue that nobody drains.
    closed: AtomicBool,
    /// Tasks woken on other threads; the executor moves them to `local` on its next poll.
    remote: Mutex<Remote>,
    /// Whether `remote` may hold tasks: read every poll, so checking costs no lock.
    remote_pending: AtomicBool,
    /// Signalled when `remote_pending` becomes true: the executor's poller's wake fd.
    eventfd: EventFd,
}

struct Remote {
    queue: Vec<Runnable>,
    closed: bool,
}

// SAFETY: `local` (the only field that is not thread-safe by itself) is touched only on the
// `owner` thread: every access goes through `on_owner`, checked at run time, and `close`
// empties it on the owner thread before any other thread can hold the last reference (see
// `Drop`). The other fields are atomics, a mutex and an fd.
unsafe impl Sync for RunQueue {}
// SAFETY: as for `Sync`: moving the queue to another thread (the last `Arc` dropped by a
// waker there) moves `local` only once it is empty, which `Drop` checks.
unsafe impl Send for RunQueue {}

impl RunQueue {
    /// A queue owned by the calling thread.
    pub(crate) fn new(capacity: usize) -> std::io::Result<RunQueue> {
        Ok(RunQueue {
            // SAFETY: pthread_self has no preconditions and cannot fail.
            owner: unsafe { libc::pthread_self() },
            local: UnsafeCell::new(VecDeque::with_capacity(capacity)),
            closed: AtomicBool::new(false),
            remote: Mutex::new(Remote {
                queue: Vec::new(),
                closed: false,
            }),
            remote_pending: AtomicBool::new(false),
            eventfd: EventFd::new()?,
        })
    }

    #[inline]
    fn on_owner(&self) -> bool {
        // SAFETY: pthread_self has no preconditions and cannot fail.
        let me = unsafe { libc::pthread_self() };
        // SAFETY: pthread_equal compares two thread ids; both are valid ids.
        unsafe { libc::pthread_equal(me, self.owner) != 0 }
    }

    /// The schedule function of every task: queues a woken task where its executor will
    /// find it.
    #[inline]
    pub(crate) fn schedule(&self, runnable: Runnable) {
        if self.on_owner() && !self.closed.load(Ordering::Relaxed) {
            // SAFETY: on the owner thread (checked just above), and no reference into
            // `local` is held across a call that could schedule (see `pop_local`).
            unsafe { (*self.local.get()).push_back(runnable) };
        } else {
            self.schedule_remote(runnable);
        }
    }

    #[cold]
    fn schedule_remote(&self, runnable: Runnable) {
        let mut remote = self.remote.lock();
        if remote.closed {
            // The executor is gone and nothing will run this task; dropping the runnable
            // here would drop a future on a thread that must not touch it. Its memory leaks.
            tracing::warn!("a task was woken after its executor closed; it is leaked");
            std::mem::forget(runnable);
            return;
        }
        remote.queue.push(runnable);
        drop(remote);
        if !self.remote_pending.swap(true, Ordering::AcqRel) {
            // The reactor may be parked: the eventfd stays readable until the executor
            // drains it, so a wake that comes just before the reactor blocks is not lost.
            if let Err(e) = self.eventfd.signal() {
                tracing::error!(error = %e, "waking a reactor for a remote task wake failed");
            }
        }
    }

    /// The next task woken on the owner thread. Panics on another thread.
    #[inline]
    pub(crate) fn pop_local(&self) -> Option<Runnable> {
        assert!(self.on_owner(), "an executor ran off its reactor's thread");
        // SAFETY: on the owner thread (asserted above); the borrow ends within this call,
        // before the runnable is run or dropped (which may schedule).
        unsafe { (*self.local.get()).pop_front() }
    }

    /// Tasks waiting in the local queue.
    pub(crate) fn local_len(&self) -> usize {
        assert!(self.on_owner(), "an executor ran off its reactor's thread");
        // SAFETY: on the owner thread (asserted above); the borrow ends within this call.
        unsafe { (*self.local.get()).len() }
    }

    /// Moves the tasks woken on other threads into the local queue; returns how many. A
    /// relaxed load when there are none.
    pub(crate) fn take_remote(&self) -> usize {
        if !self.remote_pending.load(Ordering::Acquire) {
            return 0;
        }
        // Clear the flag and the eventfd before taking the queue: a wake after this point
        // sets them again, so the next poll (or the reactor's epoll) sees it.
        self.remote_pending.store(false, Ordering::Release);
        self.eventfd.drain();
        let mut remote = self.remote.lock();
        let moved = remote.queue.len();
        for runnable in remote.queue.drain(..) {
            assert!(self.on_owner(), "an executor ran off its reactor's thread");
            // SAFETY: on the owner thread (asserted above); no other borrow of `local` is
            // live, and pushing schedules nothing.
            unsafe { (*self.local.get()).push_back(runnable) };
        }
        moved
    }

    /// The fd that becomes readable when a task is woken from another thread.
    pub(crate) fn wake_fd(&self) -> BorrowedFd<'_> {
        self.eventfd.as_fd()
    }

    /// Stops taking wakes: from now on a wake leaks its task instead of queueing it. Called
    /// on the owner thread once every task is gone; returns what was still queued, for the
    /// caller to drop here.
    pub(crate) fn close(&self) -> Vec<Runnable> {
        assert!(
            self.on_owner(),
            "an executor closed off its reactor's thread"
        );
        self.closed.store(true, Ordering::Release);
        let mut left = {
            let mut remote = self.remote.lock();
            remote.closed = true;
            std::mem::take(&mut remote.queue)
        };
        // SAFETY: on the owner thread (asserted above); no other borrow of `local` is live.
        left.extend(unsafe { (*self.local.get()).drain(..) });
        left
    }
}

impl Drop for RunQueue {
    fn drop(&mut self) {
        // A queue is dropped where its last waker goes, maybe on another thread: whatever is
        // left in it must not be dropped there (a local task's future belongs to its
        // reactor's thread). `close` empties it; one never closed (a leaked executor) leaks
        // what it holds rather than drop it on the wrong thread.
        let local = std::mem::take(self.local.get_mut());
        let remote = std::mem::take(&mut self.remote.get_mut().queue);
        if self.on_owner() {
            drop((local, remote));
        } else {
            std::mem::forget((local, remote));
        }
    }
}
