//! Where woken tasks wait to run: the reactor's own run queue, touched without a lock or an
//! atomic by wakes on the reactor's thread, and a queue for wakes from other threads, which
//! then signal an eventfd so a parked reactor wakes for them.
//!
//! `async-task` asks for a schedule function that is `Send + Sync`, since a waker may travel
//! to any thread, while almost every wake of a storage task comes from the reactor's own
//! thread (an I/O completion, a timer, another task). So the schedule function asks which
//! thread it is on (`pthread_self`, a register read) and takes the lock-free path only on
//! the reactor's thread; everything else goes to the remote queue. The unsafe code here is
//! that claim: the local queue is touched only by the thread that made it (the schedule
//! function checks the thread; the executor holds a [`LocalQueue`], which cannot leave the
//! thread that made it); and the claim that a task's future is polled and dropped only
//! there ([`LocalQueue::spawn`]).
//!
//! The schedule function captures nothing: each task finds its queue in its header
//! (async-task's metadata), because a schedule function with captures costs every wake a
//! clone and a drop of the waker (two atomic operations) to keep the task alive meanwhile.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::future::Future;
use std::marker::PhantomData;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use hypoll_reactor::nvme::sys::EventFd;
use parking_lot::Mutex;

/// A woken task, with its queue in its header.
pub(crate) type Runnable = async_task::Runnable<Arc<RunQueue>>;
/// A task's handle to its result.
pub(crate) type Task<T> = async_task::Task<T, Arc<RunQueue>>;

/// The schedule function of every task: queues a woken task where its executor will find
/// it.
#[inline]
fn schedule(runnable: Runnable) {
    let queue = Arc::as_ptr(runnable.metadata());
    // SAFETY: the queue is alive while the runnable is (its task's header holds an `Arc` to
    // it), and on the owner thread the runnable goes into the queue itself, where only this
    // thread could take it out again, after this function returns.
    let queue = unsafe { &*queue };
    if queue.on_owner() && !queue.closed.load(Ordering::Relaxed) {
        // SAFETY: on the owner thread (checked just above), and no reference into `local`
        // is held across a call that could schedule (see `LocalQueue::pop`).
        unsafe { (*queue.local.get()).push_back(runnable) };
    } else {
        // Off the owner thread the runnable may be run, and its task freed, as soon as it
        // is queued: keep the queue alive by an `Arc` of our own meanwhile.
        let queue = runnable.metadata().clone();
        queue.schedule_remote(runnable);
    }
}

/// The run queues of one executor, shared by the executor and every task of it.
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
// `owner` thread: by `schedule` after checking the thread, by the `LocalQueue`, which never
// leaves it, and by `Drop`, which has the queue to itself and leaks what is left rather
// than drop it elsewhere. The other fields are atomics, a mutex and an fd.
unsafe impl Sync for RunQueue {}
// SAFETY: as for `Sync`.
unsafe impl Send for RunQueue {}

impl RunQueue {
    #[inline]
    fn on_owner(&self) -> bool {
        // SAFETY: pthread_self has no preconditions and cannot fail.
        let me = unsafe { libc::pthread_self() };
        // On Linux a `pthread_t` is an integer that names one live thread (glibc's and
        // musl's `pthread_equal` compare it so), which spares a call on every wake.
        me == self.owner
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
}

impl Drop for RunQueue {
    fn drop(&mut self) {
        // A queue is dropped where its last task goes, maybe on another thread: whatever is
        // left in it must not be dropped there (a local task's future belongs to its
        // reactor's thread). `LocalQueue::close` empties it; what a queue never closed (a
        // leaked executor) holds leaks rather than be dropped on the wrong thread.
        let local = std::mem::take(self.local.get_mut());
        let remote = std::mem::take(&mut self.remote.get_mut().queue);
        if self.on_owner() {
            drop((local, remote));
        } else {
            std::mem::forget((local, remote));
        }
    }
}

/// The executor's own handle to its run queue: made on the reactor's thread and unable to
/// leave it (it is not `Send`), so what it does needs no check of the thread.
pub(crate) struct LocalQueue {
    queue: Arc<RunQueue>,
    _not_send: PhantomData<*const ()>,
}

impl LocalQueue {
    /// A queue owned by the calling thread, with room for `capacity` woken tasks before it
    /// grows.
    pub(crate) fn new(capacity: usize) -> std::io::Result<LocalQueue> {
        let queue = RunQueue {
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
        };
        Ok(LocalQueue {
            queue: Arc::new(queue),
            _not_send: PhantomData,
        })
    }

    /// Makes a task of `future`, scheduled into this queue when woken.
    pub(crate) fn spawn<F>(&self, future: F) -> (Runnable, Task<F::Output>)
    where
        F: Future + 'static,
        F::Output: 'static,
    {
        let builder = async_task::Builder::new().metadata(self.queue.clone());
        // SAFETY: `future` and `schedule` are `'static`, and `schedule` is `Send + Sync` (a
        // function), so what is left to keep is that the task's `Runnable` is used and
        // dropped only on the thread that made it, this one: a runnable reaches code here
        // only through `schedule`, which queues it in `local` (on this thread, where the
        // executor pops it to run it or drop it) or in `remote` (moved to `local` by this
        // thread, and leaked, never dropped, anywhere else: `schedule_remote` after `close`,
        // and `Drop`). async-task itself polls and drops a future only in `Runnable::run`
        // and `Runnable`'s drop: a task cancelled, detached or released on another thread
        // is scheduled once more for its executor to drop it.
        unsafe { builder.spawn_unchecked(move |_| future, schedule) }
    }

    /// The next task woken on this thread.
    #[inline]
    pub(crate) fn pop(&self) -> Option<Runnable> {
        // SAFETY: on the owner thread (a `LocalQueue` never leaves it); the borrow ends
        // within this call, before the runnable is run or dropped (which may schedule).
        unsafe { (*self.queue.local.get()).pop_front() }
    }

    /// Tasks waiting to run.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        // SAFETY: as in `pop`.
        unsafe { (*self.queue.local.get()).len() }
    }

    /// Moves the tasks woken on other threads into the local queue; returns how many. A
    /// load of one flag when there are none.
    #[inline]
    pub(crate) fn take_remote(&self) -> usize {
        if !self.queue.remote_pending.load(Ordering::Acquire) {
            return 0;
        }
        self.take_remote_now()
    }

    #[cold]
    fn take_remote_now(&self) -> usize {
        let queue = &self.queue;
        // Clear the flag and the eventfd before taking the queue: a wake after this point
        // sets them again, so the next poll (or the reactor's epoll) sees it.
        queue.remote_pending.store(false, Ordering::Release);
        queue.eventfd.drain();
        let mut remote = queue.remote.lock();
        let moved = remote.queue.len();
        // SAFETY: as in `pop`; pushing schedules nothing.
        unsafe { (*queue.local.get()).extend(remote.queue.drain(..)) };
        moved
    }

    /// The fd that becomes readable when a task is woken from another thread.
    pub(crate) fn wake_fd(&self) -> BorrowedFd<'_> {
        self.queue.eventfd.as_fd()
    }

    /// Stops taking wakes: from now on a wake leaks its task instead of queueing it. Called
    /// once every task is gone; returns what was still queued, for the caller to drop here.
    pub(crate) fn close(&self) -> Vec<Runnable> {
        let queue = &self.queue;
        queue.closed.store(true, Ordering::Release);
        let mut left = {
            let mut remote = queue.remote.lock();
            remote.closed = true;
            std::mem::take(&mut remote.queue)
        };
        // SAFETY: as in `pop`.
        left.extend(unsafe { (*queue.local.get()).drain(..) });
        left
    }
}
