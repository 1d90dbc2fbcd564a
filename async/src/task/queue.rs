//! Where woken tasks wait to run: the owner thread's run queue, a list threaded through the
//! tasks' own headers (no allocation, no lock, no atomic: only that thread touches it), and
//! a queue for wakes from other threads, which signal an eventfd so that a parked reactor
//! wakes for them.
//!
//! The unsafe code here is the claim that the owner-only fields are touched only on the
//! owner thread: every function that touches them is `unsafe` with that as its contract,
//! and its callers (`raw`) either check the thread or hold a handle that cannot leave it.

use std::cell::{Cell, UnsafeCell};
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

use hypoll_reactor::nvme::sys::EventFd;
use parking_lot::Mutex;

use super::raw::{Header, TaskRef};

/// The run queues of one executor, shared by the executor and all its tasks.
pub(crate) struct RunQueue {
    /// The thread that made the queue (the reactor's): the only one that touches the
    /// fields below marked "owner only".
    owner: libc::pthread_t,
    /// Owner only: the first and last task queued to run, linked by their headers'
    /// `owner.next`. A task is queued at most once (its `owner.queued`), so the list holds
    /// at most as many as the executor has tasks.
    head: Cell<Option<NonNull<Header>>>,
    tail: Cell<Option<NonNull<Header>>>,
    len: Cell<usize>,
    /// Owner only: the remote queue's entries, moved out of the lock to be handled (kept
    /// so that its memory is reused).
    spare: UnsafeCell<Vec<TaskRef>>,
    /// Tasks woken on other threads, each with a counted reference.
    remote: Mutex<Remote>,
    /// Whether `remote` may hold tasks: read every poll, so checking costs no lock.
    remote_pending: AtomicBool,
    /// Signalled when `remote_pending` becomes true: the executor's poller's wake fd.
    eventfd: EventFd,
}

struct Remote {
    queue: Vec<TaskRef>,
    /// The executor closed: nothing will run what is queued.
    closed: bool,
}

// SAFETY: the owner-only fields are touched only on the owner thread (the contract of every
// function that touches them); the others are an atomic, a mutex and an fd. What a queue
// holds when it is dropped is `TaskRef`s (which may be dropped anywhere) and nothing else:
// a task in the local list keeps its header, and so this queue, alive.
unsafe impl Sync for RunQueue {}
// SAFETY: as for `Sync`.
unsafe impl Send for RunQueue {}

impl RunQueue {
    /// A queue owned by the calling thread.
    pub(super) fn new() -> std::io::Result<RunQueue> {
        Ok(RunQueue {
            // SAFETY: pthread_self has no preconditions and cannot fail.
            owner: unsafe { libc::pthread_self() },
            head: Cell::new(None),
            tail: Cell::new(None),
            len: Cell::new(0),
            spare: UnsafeCell::new(Vec::new()),
            remote: Mutex::new(Remote {
                queue: Vec::new(),
                closed: false,
            }),
            remote_pending: AtomicBool::new(false),
            eventfd: EventFd::new()?,
        })
    }

    #[inline]
    pub(super) fn on_owner(&self) -> bool {
        // SAFETY: pthread_self has no preconditions and cannot fail.
        let me = unsafe { libc::pthread_self() };
        // On Linux a `pthread_t` is an integer that names one live thread (glibc's and
        // musl's `pthread_equal` compare it so), which spares a call on every wake.
        me == self.owner
    }

    /// Queues `h` last to run.
    ///
    /// # Safety
    /// On the owner thread; `h` is alive, of this queue, and not queued.
    #[inline]
    pub(super) unsafe fn push_local(&self, h: NonNull<Header>) {
        // SAFETY: alive (the caller's promise); its owner side is ours to touch here.
        let owner = unsafe { &h.as_ref().owner };
        debug_assert!(!owner.queued.get());
        owner.queued.set(true);
        owner.next.set(None);
        match self.tail.get() {
            // SAFETY: a queued task is alive (queued, the owner side holds its reference).
            Some(tail) => unsafe { tail.as_ref() }.owner.next.set(Some(h)),
            None => self.head.set(Some(h)),
        }
        self.tail.set(Some(h));
        self.len.set(self.len.get() + 1);
    }

    /// Takes the first task queued to run; it is no longer queued.
    ///
    /// # Safety
    /// On the owner thread.
    #[inline]
    pub(super) unsafe fn pop_local(&self) -> Option<NonNull<Header>> {
        let h = self.head.get()?;
        // SAFETY: a queued task is alive; its owner side is ours to touch here.
        let owner = unsafe { &h.as_ref().owner };
        let next = owner.next.take();
        self.head.set(next);
        match next {
            Some(next) => prefetch_task(next),
            None => self.tail.set(None),
        }
        owner.queued.set(false);
        self.len.set(self.len.get() - 1);
        Some(h)
    }

    /// # Safety
    /// On the owner thread.
    #[inline]
    pub(super) unsafe fn len_local(&self) -> usize {
        self.len.get()
    }

    /// Any thread: queues a woken task for the owner thread, and wakes it (its reactor may
    /// be parked). Dropped instead if the executor closed.
    #[cold]
    pub(super) fn push_remote(&self, task: TaskRef) {
        let mut remote = self.remote.lock();
        if remote.closed {
            drop(remote);
            // Every future of a closed executor is gone: dropping the reference here only
            // frees memory, if it was the last.
            drop(task);
            return;
        }
        remote.queue.push(task);
        drop(remote);
        if !self.remote_pending.swap(true, Ordering::AcqRel) {
            // The eventfd stays readable until the executor drains it, so a wake that comes
            // just before the reactor blocks is not lost.
            if let Err(e) = self.eventfd.signal() {
                tracing::error!(error = %e, "waking a reactor for a remote task wake failed");
            }
        }
    }

    #[inline]
    pub(super) fn remote_pending(&self) -> bool {
        self.remote_pending.load(Ordering::Acquire)
    }

    /// Calls `f` with each task woken from other threads since the last call.
    ///
    /// # Safety
    /// On the owner thread, and `f` does not call this again.
    pub(super) unsafe fn take_remote(&self, mut f: impl FnMut(TaskRef)) -> usize {
        // Clear the flag and the eventfd before taking the queue: a wake after this point
        // sets them again, so the next poll (or the reactor's epoll) sees it.
        self.remote_pending.store(false, Ordering::Release);
        self.eventfd.drain();
        // SAFETY: on the owner thread, and not re-entered (the caller's promise).
        let spare = unsafe { &mut *self.spare.get() };
        std::mem::swap(&mut self.remote.lock().queue, spare);
        let n = spare.len();
        spare.drain(..).for_each(&mut f);
        n
    }

    /// Refuses remote wakes from now on; returns what was queued.
    pub(super) fn close_remote(&self) -> Vec<TaskRef> {
        let mut remote = self.remote.lock();
        remote.closed = true;
        std::mem::take(&mut remote.queue)
    }

    pub(super) fn wake_fd(&self) -> BorrowedFd<'_> {
        self.eventfd.as_fd()
    }
}

/// Asks the CPU to start loading the first cache lines of task `h`, which runs after the
/// one just popped: with many tasks in flight their memory exceeds the L1 cache, and the
/// loads then overlap the poll of the task before it instead of stalling its own.
#[inline(always)]
fn prefetch_task(h: NonNull<Header>) {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse"))]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = h.as_ptr().cast::<i8>();
        // SAFETY: the instruction needs SSE, which this build enables (the `cfg` above);
        // a prefetch reads nothing into the program and never faults, so any address
        // will do: lines past a small task's end cost a load, nothing else
        // (`wrapping_add` keeps the arithmetic defined).
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(p);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(128));
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse")))]
    let _ = h;
}
