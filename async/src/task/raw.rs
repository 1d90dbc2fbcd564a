//! The task core: one allocation per task (a header, then the future), with no atomic
//! operation on the way from a wake on the reactor's thread to the task's next poll.
//!
//! `async-task`, which this replaces, counts references and tracks a task's state with
//! atomics, since any waker may be on any thread: five read-modify-writes per I/O (the
//! waker's clone, the wake, the start and the end of the run, the reference's drop), as
//! many as the rest of the I/O path costs. Here a task has two sides:
//!
//! - **The owner thread's** (its executor's thread): whether it is queued to run, whether
//!   its future is gone, how many [`LocalRef`]s this thread holds (an I/O in flight holds
//!   one), and its link in the local run queue. Plain cells, touched only on that thread.
//!   While the future is alive, the task is queued or a `LocalRef` is held, the owner side
//!   holds one counted reference, taken at spawn and given back once, when all three end.
//! - **Everyone's**: the counted references (wakers cloned, [`TaskRef`]s of join handles
//!   and of the remote queue), the cancel request, and whether the task sits in the remote
//!   queue. Atomics; the last reference frees the memory, on whichever thread drops it.
//!
//! The future is polled and dropped only on the owner thread, by [`Queued::run`] and
//! [`Owned`]'s drop; it is always dropped before the owner side lets its reference go, so
//! freeing the memory elsewhere never drops a future there. A wake on the owner thread
//! (`pthread_self`, a register read, says where it is) queues the task in the local run
//! queue; a wake from elsewhere hands a counted reference to the remote queue, which the
//! executor drains on its thread. An I/O completion, always on the owner thread, wakes its
//! task through a `LocalRef`: no waker clone, no atomic.
//!
//! Every `unsafe` block below rests on the invariants above; the types that reach the
//! executor ([`Queue`], [`Owned`], [`Queued`], [`Current`], [`LocalRef`]) cannot leave the
//! owner thread, and [`TaskRef`] touches only the atomics.

use std::cell::{Cell, UnsafeCell};
use std::future::Future;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};

use super::queue::RunQueue;

/// What the core does with a task whatever its future's type.
struct Vtable {
    /// Polls the future (owner thread, future alive).
    poll: unsafe fn(NonNull<Header>, &mut Context<'_>) -> Poll<()>,
    /// Drops the future in place (owner thread, future alive; once).
    drop_future: unsafe fn(NonNull<Header>),
    /// Frees the task (no reference left; the future already dropped).
    dealloc: unsafe fn(NonNull<Header>),
}

/// The start of every task's allocation.
pub(super) struct Header {
    vtable: &'static Vtable,
    /// Counted references, see the module's docs.
    refs: AtomicU32,
    /// [`TaskRef::cancel`] asked for the future to be dropped instead of polled.
    cancel: AtomicBool,
    /// The task is in the remote queue (or on its way there): later remote wakes skip it.
    remote_queued: AtomicBool,
    pub(super) queue: Arc<RunQueue>,
    /// Touched only on the owner thread.
    pub(super) owner: OwnerSide,
}

/// A task's state on its owner thread.
pub(super) struct OwnerSide {
    /// In the local run queue (see `RunQueue::push_local`).
    pub(super) queued: Cell<bool>,
    /// The future was dropped: finished, cancelled, or its executor closed.
    done: Cell<bool>,
    /// [`LocalRef`]s alive.
    local_refs: Cell<usize>,
    /// The next task in the local run queue.
    pub(super) next: Cell<Option<NonNull<Header>>>,
    /// Where the executor keeps it ([`Owned::set_key`]); a `u32` so that the header fits in
    /// less than a cache line (the executor keeps fewer than `u32::MAX` tasks).
    key: Cell<u32>,
}

/// A task: its header, then its future (dropped in place by `drop_future`, hence
/// `ManuallyDrop`). `repr(C)` so that a pointer to it is a pointer to its header; aligned
/// to a cache line so that the header and the start of the future share the first one (a
/// completion touches the header, and the poll after it the future).
#[repr(C, align(64))]
struct RawTask<F> {
    header: Header,
    future: UnsafeCell<ManuallyDrop<F>>,
}

impl<F: Future<Output = ()>> RawTask<F> {
    const VTABLE: Vtable = Vtable {
        poll: Self::poll,
        drop_future: Self::drop_future,
        dealloc: Self::dealloc,
    };

    /// # Safety
    /// `h` is a `RawTask<F>`'s header; on its owner thread; its future is alive and not
    /// being polled or dropped.
    unsafe fn poll(h: NonNull<Header>, cx: &mut Context<'_>) -> Poll<()> {
        let task = h.cast::<RawTask<F>>();
        // SAFETY: the task is alive and its future too (the caller's promise); only this
        // thread touches the future, and nothing else borrows it now. It never moves: it
        // lives in its allocation until dropped in place.
        let future = unsafe { Pin::new_unchecked(&mut **task.as_ref().future.get()) };
        future.poll(cx)
    }

    /// # Safety
    /// As for `poll`; the future is not used again.
    unsafe fn drop_future(h: NonNull<Header>) {
        let task = h.cast::<RawTask<F>>();
        // SAFETY: as in `poll`; the caller marked it done first, so it is dropped once.
        unsafe { ManuallyDrop::drop(&mut *task.as_ref().future.get()) }
    }

    /// # Safety
    /// `h` is a `RawTask<F>`'s header, allocated by `Queue::spawn`, with no reference
    /// left and its future dropped.
    unsafe fn dealloc(h: NonNull<Header>) {
        // SAFETY: the pointer came from `Box::into_raw` of this type (`Queue::spawn`), and
        // nothing else can reach it any more. The future is `ManuallyDrop`: dropping the box
        // drops the header and frees the memory only.
        drop(unsafe { Box::from_raw(h.cast::<RawTask<F>>().as_ptr()) });
    }
}

/// # Safety (for every `fn` taking a header below)
/// `h` points to a live task: its caller holds a reference to it (counted, local, or the
/// owner side's, as each says).
#[inline]
unsafe fn header<'a>(h: NonNull<Header>) -> &'a Header {
    // SAFETY: alive, as the caller promises; shared: every field written after spawn is an
    // atomic or a cell of the owner side, written only on the owner thread.
    unsafe { h.as_ref() }
}

/// Takes a counted reference.
unsafe fn acquire(h: NonNull<Header>) {
    // SAFETY: see `header`.
    let refs = unsafe { header(h) }.refs.fetch_add(1, Ordering::Relaxed);
    // As `Arc` does: a count this high can only come from leaked references.
    if refs > u32::MAX / 2 {
        std::process::abort();
    }
}

/// Gives a counted reference back; the last one frees the task.
#[inline]
unsafe fn release(h: NonNull<Header>) {
    // SAFETY: see `header`.
    let task = unsafe { header(h) };
    if task.refs.fetch_sub(1, Ordering::Release) == 1 {
        // Every use of the task by other references happened before their release.
        fence(Ordering::Acquire);
        let dealloc = task.vtable.dealloc;
        // SAFETY: that was the last reference; the owner side gave its own back, which it
        // does only after dropping the future.
        unsafe { dealloc(h) };
    }
}

/// Owner thread: gives the owner side's counted reference back once nothing on this
/// thread holds the task (future gone, not queued, no `LocalRef`). Called at each of those
/// three ends; once all three hold they stay so, so it releases once.
#[inline(always)]
unsafe fn release_if_idle(h: NonNull<Header>) {
    // SAFETY: see `header`; on the owner thread, as the caller promises.
    let owner = &unsafe { header(h) }.owner;
    if owner.done.get() && !owner.queued.get() && owner.local_refs.get() == 0 {
        // SAFETY: the owner side's reference, still held (the condition just became true).
        unsafe { release(h) };
    }
}

/// Owner thread: queues the task to run, unless it is queued already or done.
#[inline]
unsafe fn schedule_local(h: NonNull<Header>) {
    // SAFETY: see `header`; on the owner thread, as the caller promises.
    let task = unsafe { header(h) };
    if task.owner.done.get() || task.owner.queued.get() {
        return;
    }
    // SAFETY: on the owner thread, and the task is alive and not queued.
    unsafe { task.queue.push_local(h) };
}

/// Any thread: queues the task to run, on its owner thread.
unsafe fn schedule(h: NonNull<Header>) {
    // SAFETY: see `header`.
    let task = unsafe { header(h) };
    if task.queue.on_owner() {
        // SAFETY: on the owner thread (checked just above).
        unsafe { schedule_local(h) };
        return;
    }
    if task.remote_queued.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: the caller's reference keeps it alive while the queue's is taken.
    unsafe { acquire(h) };
    task.queue.push_remote(TaskRef(h));
}

// ---- wakers: `data` is the header; an owned waker holds a counted reference ----

static WAKER: RawWakerVTable =
    RawWakerVTable::new(waker_clone, waker_wake, waker_wake_by_ref, waker_drop);

unsafe fn waker_clone(data: *const ()) -> RawWaker {
    let h = NonNull::new(data.cast_mut())
        .expect("a waker points to its task")
        .cast();
    // SAFETY: the waker being cloned keeps the task alive (owned: a counted reference;
    // borrowed: the poll it was lent to).
    unsafe { acquire(h) };
    RawWaker::new(data, &WAKER)
}

unsafe fn waker_wake(data: *const ()) {
    // SAFETY: an owned waker, with its counted reference, given up here.
    unsafe {
        waker_wake_by_ref(data);
        waker_drop(data);
    }
}

unsafe fn waker_wake_by_ref(data: *const ()) {
    let h = NonNull::new(data.cast_mut())
        .expect("a waker points to its task")
        .cast();
    // SAFETY: the waker keeps the task alive (see `waker_clone`).
    unsafe { schedule(h) };
}

unsafe fn waker_drop(data: *const ()) {
    let h = NonNull::new(data.cast_mut())
        .expect("a waker points to its task")
        .cast();
    // SAFETY: an owned waker's counted reference (borrowed ones are never dropped).
    unsafe { release(h) };
}

/// Whether `waker` is this task's own.
fn is_waker_of(waker: &Waker, h: NonNull<Header>) -> bool {
    waker.data() == h.as_ptr().cast_const().cast() && std::ptr::eq(waker.vtable(), &WAKER)
}

// ---- what the executor holds ----

/// The executor's handle to its run queue: made on the owner thread, and it stays there.
pub(crate) struct Queue {
    pub(super) queue: Arc<RunQueue>,
    _not_send: PhantomData<*const ()>,
}

impl Queue {
    /// A run queue owned by the calling thread.
    pub(crate) fn new() -> std::io::Result<Queue> {
        Ok(Queue {
            queue: Arc::new(RunQueue::new()?),
            _not_send: PhantomData,
        })
    }

    /// Makes a task of `future`, queued to run. Returns the executor's handle to the
    /// future, and a counted reference to it (for a join handle).
    pub(crate) fn spawn<F: Future<Output = ()> + 'static>(&self, future: F) -> (Owned, TaskRef) {
        let task = Box::new(RawTask {
            header: Header {
                vtable: &RawTask::<F>::VTABLE,
                // The owner side's and the returned `TaskRef`'s.
                refs: AtomicU32::new(2),
                cancel: AtomicBool::new(false),
                remote_queued: AtomicBool::new(false),
                queue: self.queue.clone(),
                owner: OwnerSide {
                    queued: Cell::new(false),
                    done: Cell::new(false),
                    local_refs: Cell::new(0),
                    next: Cell::new(None),
                    key: Cell::new(u32::MAX),
                },
            },
            future: UnsafeCell::new(ManuallyDrop::new(future)),
        });
        // SAFETY: `Box::into_raw` never returns null.
        let h = unsafe { NonNull::new_unchecked(Box::into_raw(task)) }.cast::<Header>();
        // SAFETY: just made, on this (the owner) thread: alive, not queued, not done.
        unsafe { schedule_local(h) };
        (
            Owned {
                h,
                _not_send: PhantomData,
            },
            TaskRef(h),
        )
    }

    /// The next task queued on this thread.
    #[inline]
    pub(crate) fn pop(&self) -> Option<Queued> {
        // SAFETY: on the owner thread (a `Queue` never leaves it).
        let h = unsafe { self.queue.pop_local() }?;
        Some(Queued {
            h,
            _not_send: PhantomData,
        })
    }

    /// Tasks queued to run on this thread.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        // SAFETY: on the owner thread.
        unsafe { self.queue.len_local() }
    }

    /// Queues the tasks woken from other threads here; returns how many. One atomic load
    /// when there are none.
    #[inline]
    pub(crate) fn take_remote(&self) -> usize {
        if !self.queue.remote_pending() {
            return 0;
        }
        self.take_remote_now()
    }

    #[cold]
    fn take_remote_now(&self) -> usize {
        let each = |task: TaskRef| {
            let h = task.0;
            // SAFETY: `task` keeps it alive. Clearing the flag first (a read-modify-write, so
            // it sees the last remote wake's write) lets a later wake queue it again.
            unsafe { header(h) }
                .remote_queued
                .swap(false, Ordering::AcqRel);
            // SAFETY: on the owner thread; alive, as just said.
            unsafe { schedule_local(h) };
        };
        // SAFETY: on the owner thread, and `each` does not take remote wakes.
        unsafe { self.queue.take_remote(each) }
    }

    /// Stops taking wakes from other threads (each is dropped from now on), and drops
    /// what they queued; for when every future is gone.
    pub(crate) fn close(&self) {
        drop(self.queue.close_remote());
    }

    pub(crate) fn wake_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.queue.wake_fd()
    }
}

/// The executor's handle to a task whose future is alive: dropping it drops the future
/// (on the owner thread: it cannot leave it).
pub(crate) struct Owned {
    h: NonNull<Header>,
    _not_send: PhantomData<*const ()>,
}

impl Owned {
    /// Remembers where the executor keeps it (returned by [`Queued::run`]).
    pub(crate) fn set_key(&self, key: usize) {
        let key = u32::try_from(key).expect("an executor keeps fewer than u32::MAX tasks");
        // SAFETY: the future is alive, so the owner side's reference keeps the task; on the
        // owner thread.
        unsafe { header(self.h) }.owner.key.set(key);
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        let h = self.h;
        // SAFETY: alive (its future is, until just below); on the owner thread.
        let task = unsafe { header(h) };
        // Done first: a wake from inside the future's drop does not queue it, and it is
        // dropped once even if its drop panics. A local reference meanwhile: the future may
        // hold the others (an I/O future does), and the owner side must keep the task until
        // the drop is over.
        let owner = &task.owner;
        owner.done.set(true);
        owner.local_refs.set(owner.local_refs.get() + 1);
        let drop_future = task.vtable.drop_future;
        // SAFETY: the future is alive and nobody polls it (an `Owned` exists once per task,
        // and the executor does not drop it while polling the task).
        unsafe { drop_future(h) };
        owner.local_refs.set(owner.local_refs.get() - 1);
        // SAFETY: on the owner thread.
        unsafe { release_if_idle(h) };
    }
}

/// A task taken off the local run queue.
pub(crate) struct Queued {
    h: NonNull<Header>,
    _not_send: PhantomData<*const ()>,
}

/// What running a task came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ran {
    /// Polled; it waits.
    Pending,
    /// Polled to its end, or found cancelled: the executor drops its [`Owned`] (by key).
    Ended { key: usize, polled: bool },
    /// Its future was already gone.
    Gone,
}

impl Queued {
    /// Polls the task, with `current` saying which task runs; or reports it cancelled.
    #[inline]
    pub(crate) fn run(self, current: &Current) -> Ran {
        // SAFETY: queued until `pop` returned it, and `self` keeps the owner side's
        // reference until dropped; on the owner thread.
        unsafe { run(self.h, current) }
    }
}

/// Polls task `h`, with `current` saying which task runs; or reports it cancelled, or gone.
///
/// # Safety
/// On the owner thread; the caller holds a reference to the task (the owner side's, or a
/// local one) until this returns; the task is not being polled.
#[inline(always)]
unsafe fn run(h: NonNull<Header>, current: &Current) -> Ran {
    // SAFETY: alive, as the caller promises.
    let task = unsafe { header(h) };
    if task.owner.done.get() {
        return Ran::Gone;
    }
    let key = task.owner.key.get() as usize;
    if task.cancel.load(Ordering::Relaxed) {
        return Ran::Ended { key, polled: false };
    }
    // The task's own waker, lent to the poll (it holds no reference: never dropped).
    // SAFETY: `WAKER`'s functions take a live header, and this one outlives the poll.
    let waker = ManuallyDrop::new(unsafe {
        Waker::from_raw(RawWaker::new(h.as_ptr().cast_const().cast(), &WAKER))
    });
    let mut cx = Context::from_waker(&waker);
    let before = current.0.replace(Some(h));
    /// Says no task runs however the poll ends.
    struct Restore<'a>(&'a Cell<Option<NonNull<Header>>>, Option<NonNull<Header>>);
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            self.0.set(self.1);
        }
    }
    let _restore = Restore(&current.0, before);
    let poll = task.vtable.poll;
    // SAFETY: the future is alive (not done), on its owner thread, and nothing else
    // polls or drops it meanwhile: its `Owned` is dropped only when this returns.
    match unsafe { poll(h, &mut cx) } {
        Poll::Pending => Ran::Pending,
        Poll::Ready(()) => Ran::Ended { key, polled: true },
    }
}

impl Drop for Queued {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: popped from the queue (`queued` is false now): the owner side's reference
        // is still held if the task is done, and given back here if nothing else holds it.
        unsafe { release_if_idle(self.h) };
    }
}

/// Which task the executor is polling now, if any.
pub(crate) struct Current(Cell<Option<NonNull<Header>>>, PhantomData<*const ()>);

impl Current {
    pub(crate) fn new() -> Current {
        Current(Cell::new(None), PhantomData)
    }

    /// A reference to the task being polled, if `waker` is its own: to wake it later
    /// without a waker (an I/O completion does). `None` for any other waker (a combinator's,
    /// or outside a poll).
    #[inline]
    pub(crate) fn local_ref(&self, waker: &Waker) -> Option<LocalRef> {
        let h = self.0.get()?;
        if !is_waker_of(waker, h) {
            return None;
        }
        // SAFETY: being polled, so alive; on the owner thread (`Current` never leaves it).
        let owner = &unsafe { header(h) }.owner;
        owner.local_refs.set(owner.local_refs.get() + 1);
        Some(LocalRef {
            h,
            _not_send: PhantomData,
        })
    }
}

/// A reference to a task held on its owner thread, with no atomic: wakes it from there.
pub(crate) struct LocalRef {
    h: NonNull<Header>,
    _not_send: PhantomData<*const ()>,
}

impl LocalRef {
    /// Queues the task to run (unless queued already, or done), giving the reference up.
    #[inline]
    pub(crate) fn wake(self) {
        let h = ManuallyDrop::new(self).h;
        // SAFETY: the reference just given up keeps it alive until it is counted out
        // below; on the owner thread.
        let owner = &unsafe { header(h) }.owner;
        owner.local_refs.set(owner.local_refs.get() - 1);
        if owner.done.get() {
            // SAFETY: on the owner thread; the reference was counted out just above.
            unsafe { release_if_idle(h) };
        } else if !owner.queued.get() {
            // SAFETY: on the owner thread; alive (not done: the owner side holds it) and
            // not queued.
            unsafe { header(h).queue.push_local(h) };
        }
    }

    /// Whether this is the only `LocalRef` to its task: for a completion's, whether the
    /// task awaits no other I/O of its own (each holds one).
    #[inline]
    pub(crate) fn is_only(&self) -> bool {
        // SAFETY: `self` keeps it alive; on the owner thread.
        unsafe { header(self.h) }.owner.local_refs.get() == 1
    }

    /// Whether the task waits in the run queue already (it will be polled from there).
    #[inline]
    pub(crate) fn is_queued(&self) -> bool {
        // SAFETY: `self` keeps it alive; on the owner thread.
        unsafe { header(self.h) }.owner.queued.get()
    }

    /// Polls the task now, instead of queueing it (see [`run`]), giving the reference up:
    /// for a task whose I/O just completed, when no other task is being polled.
    #[inline]
    pub(crate) fn run_now(self, current: &Current) -> Ran {
        // SAFETY: on the owner thread (a `LocalRef` never leaves it); `self` holds a local
        // reference until it drops at the end of this call; the caller polls no task.
        unsafe { run(self.h, current) }
    }

    /// Whether `waker` would wake the same task.
    #[inline]
    pub(crate) fn will_wake(&self, waker: &Waker) -> bool {
        is_waker_of(waker, self.h)
    }
}

impl Drop for LocalRef {
    #[inline]
    fn drop(&mut self) {
        let h = self.h;
        // SAFETY: `self` keeps it alive until the end of this call; on the owner thread.
        let owner = &unsafe { header(h) }.owner;
        owner.local_refs.set(owner.local_refs.get() - 1);
        // SAFETY: on the owner thread.
        unsafe { release_if_idle(h) };
    }
}

/// A counted reference to a task, usable from any thread: a join handle's, to cancel it,
/// and the remote queue's.
pub(crate) struct TaskRef(NonNull<Header>);

// SAFETY: a `TaskRef` touches only the header's atomics and the run queue's thread-safe
// remote side (`schedule` checks the thread before anything else), and its drop frees the
// memory only (the future is gone by then: see the module's docs).
unsafe impl Send for TaskRef {}
// SAFETY: as for `Send`; every method takes `&self` and touches only what `Send` says.
unsafe impl Sync for TaskRef {}

impl TaskRef {
    /// Asks for the task's future to be dropped on its thread, unpolled, at its next run.
    pub(crate) fn cancel(&self) {
        // SAFETY: `self` keeps it alive.
        unsafe { header(self.0) }
            .cancel
            .store(true, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { schedule(self.0) };
    }
}

impl Drop for TaskRef {
    fn drop(&mut self) {
        // SAFETY: this reference's own count.
        unsafe { release(self.0) };
    }
}
