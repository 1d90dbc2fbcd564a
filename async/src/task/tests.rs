//! The task core alone, driven by hand as the executor drives it: wakes on and off the
//! owner thread, wakes after the end, cancelling, futures dropped with references out,
//! panics, and every allocation freed (each task's header holds its run queue, so the
//! queue's reference count says how many tasks are still allocated).

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use slab::Slab;

use super::{Current, LocalRef, Owned, Queue, Ran, TaskRef};

/// An executor in miniature: a queue, the task being polled, the live futures.
struct Harness {
    queue: Queue,
    current: Rc<Current>,
    tasks: RefCell<Slab<Owned>>,
}

impl Harness {
    fn new() -> Harness {
        Harness {
            queue: Queue::new().unwrap(),
            current: Rc::new(Current::new()),
            tasks: RefCell::new(Slab::new()),
        }
    }

    fn spawn(&self, future: impl Future<Output = ()> + 'static) -> TaskRef {
        let (owned, task) = self.queue.spawn(future);
        let mut tasks = self.tasks.borrow_mut();
        let entry = tasks.vacant_entry();
        owned.set_key(entry.key());
        entry.insert(owned);
        task
    }

    /// Runs queued tasks until none is; returns the polls and cancels.
    fn run(&self) -> usize {
        self.queue.take_remote();
        let mut ran = 0;
        while let Some(task) = self.queue.pop() {
            match task.run(&self.current) {
                Ran::Pending => {}
                Ran::Ended { key, .. } => drop(self.tasks.borrow_mut().remove(key)),
                Ran::Gone => continue,
            }
            ran += 1;
        }
        ran
    }

    /// Tasks still allocated.
    fn allocated(&self) -> usize {
        Arc::strong_count(&self.queue.queue) - 1
    }

    fn live(&self) -> usize {
        self.tasks.borrow().len()
    }
}

/// A future that counts its polls, keeps its task's waker (a clone) or a local reference
/// to its task where told to, and ends when told to.
#[derive(Clone, Default)]
struct Probe {
    polls: Rc<Cell<u32>>,
    end: Rc<Cell<bool>>,
    waker: Rc<RefCell<Option<Waker>>>,
    dropped: Rc<Cell<bool>>,
}

struct ProbeFuture(Probe);

impl Future for ProbeFuture {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let probe = &self.0;
        probe.polls.set(probe.polls.get() + 1);
        *probe.waker.borrow_mut() = Some(cx.waker().clone());
        if probe.end.get() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl Drop for ProbeFuture {
    fn drop(&mut self) {
        self.0.dropped.set(true);
    }
}

#[test]
fn a_spawned_task_runs_once_per_wake_and_its_memory_goes_with_its_last_reference() {
    let h = Harness::new();
    let probe = Probe::default();
    let task = h.spawn(ProbeFuture(probe.clone()));
    assert_eq!(h.run(), 1);
    assert_eq!(h.run(), 0, "not woken: not run");
    let waker = probe.waker.borrow_mut().take().unwrap();
    // Woken twice before it runs: queued once.
    waker.wake_by_ref();
    waker.wake_by_ref();
    assert_eq!(h.queue.len(), 1);
    assert_eq!(h.run(), 1);
    probe.end.set(true);
    waker.wake_by_ref();
    assert_eq!(h.run(), 1);
    assert!(probe.dropped.get(), "the future is dropped when it ends");
    assert_eq!(h.live(), 0);
    // The join handle's reference, the waker and the one the last poll kept hold it.
    assert_eq!(h.allocated(), 1);
    // A wake after the end does nothing.
    waker.wake_by_ref();
    assert_eq!(h.run(), 0);
    drop((task, waker));
    probe.waker.borrow_mut().take();
    assert_eq!(h.allocated(), 0);
    assert_eq!(probe.polls.get(), 3);
}

#[test]
fn a_local_reference_wakes_its_task_without_a_waker_and_outlives_its_future() {
    let h = Harness::new();
    let kept: Rc<RefCell<Option<LocalRef>>> = Rc::default();
    let polls = Rc::new(Cell::new(0));
    let (k, p, current) = (kept.clone(), polls.clone(), h.current.clone());
    let task = h.spawn(std::future::poll_fn(move |cx| {
        p.set(p.get() + 1);
        // What an I/O future does with its task's own waker.
        *k.borrow_mut() = Some(current.local_ref(cx.waker()).unwrap());
        Poll::<()>::Pending
    }));
    assert_eq!(h.run(), 1);
    // The completion: the reference wakes it, and goes.
    kept.borrow_mut().take().unwrap().wake();
    assert_eq!(h.run(), 1);
    assert_eq!(polls.get(), 2);
    // Dropped with a local reference out (an I/O in flight): the memory stays until the
    // reference goes; its wake then does nothing.
    let in_flight = kept.borrow_mut().take().unwrap();
    task.cancel();
    assert_eq!(h.run(), 1);
    assert_eq!(h.live(), 0);
    drop(task);
    assert_eq!(h.allocated(), 1);
    in_flight.wake();
    assert_eq!(h.run(), 0);
    assert_eq!(h.allocated(), 0);
    assert_eq!(polls.get(), 2, "cancelled, not polled");
}

/// A completion that polls its task at once (no trip through the run queue): the task is
/// polled through the reference, which goes with the poll; a task that ends in that poll
/// is reported ended (the executor then drops its future), and its memory goes with its
/// last reference; a reference to a task already gone polls nothing.
#[test]
fn a_local_reference_polls_its_task_at_once_and_goes_with_the_poll() {
    let h = Harness::new();
    let kept: Rc<RefCell<Option<LocalRef>>> = Rc::default();
    let polls = Rc::new(Cell::new(0));
    let (k, p, current) = (kept.clone(), polls.clone(), h.current.clone());
    let task = h.spawn(std::future::poll_fn(move |cx| {
        p.set(p.get() + 1);
        if p.get() == 3 {
            return Poll::Ready(());
        }
        *k.borrow_mut() = Some(current.local_ref(cx.waker()).unwrap());
        Poll::Pending
    }));
    assert_eq!(h.run(), 1);
    let first = kept.borrow_mut().take().unwrap();
    assert!(!first.is_queued());
    assert_eq!(first.run_now(&h.current), Ran::Pending);
    assert_eq!(polls.get(), 2);
    assert_eq!(h.queue.len(), 0, "polled, not queued");
    // The poll took a new reference (a new I/O in flight); this one ends the task.
    let second = kept.borrow_mut().take().unwrap();
    let Ran::Ended { key, polled: true } = second.run_now(&h.current) else {
        panic!("the task ended in that poll");
    };
    assert_eq!(polls.get(), 3);
    drop(h.tasks.borrow_mut().remove(key));
    assert_eq!(h.live(), 0);
    // The join handle holds the memory now, and only it.
    assert_eq!(h.allocated(), 1);
    drop(task);
    assert_eq!(h.allocated(), 0);

    // A reference that outlives its task's future polls nothing.
    let task = h.spawn(std::future::poll_fn({
        let (k, current) = (kept.clone(), h.current.clone());
        move |cx| {
            *k.borrow_mut() = Some(current.local_ref(cx.waker()).unwrap());
            Poll::<()>::Pending
        }
    }));
    assert_eq!(h.run(), 1);
    let in_flight = kept.borrow_mut().take().unwrap();
    task.cancel();
    assert_eq!(h.run(), 1);
    drop(task);
    assert_eq!(h.allocated(), 1, "the reference keeps the memory");
    assert_eq!(in_flight.run_now(&h.current), Ran::Gone);
    assert_eq!(h.allocated(), 0);
}

#[test]
fn a_waker_that_is_not_the_running_tasks_own_gets_no_local_reference() {
    let h = Harness::new();
    let probe = Probe::default();
    let _task = h.spawn(ProbeFuture(probe.clone()));
    h.run();
    let waker = probe.waker.borrow_mut().take().unwrap();
    // Outside a poll, even the task's own waker.
    assert!(h.current.local_ref(&waker).is_none());
    assert!(h.current.local_ref(Waker::noop()).is_none());
}

#[test]
fn a_wake_from_another_thread_queues_the_task_and_signals_the_fd() {
    let h = Harness::new();
    let probe = Probe::default();
    let _task = h.spawn(ProbeFuture(probe.clone()));
    h.run();
    let waker = probe.waker.borrow_mut().take().unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            waker.wake_by_ref();
            waker.wake_by_ref();
            // An owned waker, woken by value (its reference goes with it).
            #[allow(clippy::waker_clone_wake)]
            waker.clone().wake();
        });
    });
    assert_eq!(h.queue.len(), 0, "not queued here until taken");
    // (Miri cannot call poll(2); it runs the rest.)
    if !cfg!(miri) {
        let readable = hypoll_reactor::nvme::sys::wait_readable(h.queue.wake_fd(), 0).unwrap();
        assert!(readable, "the wake fd tells a parked reactor");
    }
    assert_eq!(h.queue.take_remote(), 1, "queued once");
    assert_eq!(h.run(), 1);
    assert_eq!(probe.polls.get(), 2);
}

#[test]
fn cancelling_from_another_thread_drops_the_future_here_unpolled() {
    let h = Harness::new();
    let dropped_on = Rc::new(Cell::new(None));
    struct Tell(Rc<Cell<Option<std::thread::ThreadId>>>);
    impl Drop for Tell {
        fn drop(&mut self) {
            self.0.set(Some(std::thread::current().id()));
        }
    }
    let tell = Tell(dropped_on.clone());
    let polls = Rc::new(Cell::new(0));
    let p = polls.clone();
    let task = h.spawn(std::future::poll_fn(move |_| {
        let _keep = &tell;
        p.set(p.get() + 1);
        Poll::<()>::Pending
    }));
    h.run();
    std::thread::spawn(move || task.cancel()).join().unwrap();
    assert_eq!(h.run(), 1);
    assert_eq!(polls.get(), 1);
    assert_eq!(dropped_on.get(), Some(std::thread::current().id()));
    assert_eq!(h.allocated(), 0);
}

#[test]
fn the_last_reference_dropped_on_another_thread_frees_the_task_there() {
    let h = Harness::new();
    let probe = Probe::default();
    let task = h.spawn(ProbeFuture(probe.clone()));
    h.run();
    let waker = probe.waker.borrow_mut().take().unwrap();
    probe.end.set(true);
    waker.wake_by_ref();
    h.run();
    assert!(probe.dropped.get());
    // The one its last poll kept goes too.
    let last = probe.waker.borrow_mut().take().unwrap();
    assert_eq!(h.allocated(), 1);
    std::thread::spawn(move || drop((task, waker, last)))
        .join()
        .unwrap();
    assert_eq!(h.allocated(), 0);
}

#[test]
fn a_panic_in_a_poll_leaves_the_task_to_be_dropped_normally() {
    let h = Harness::new();
    let task = h.spawn(std::future::poll_fn(|_| -> Poll<()> { panic!("inside") }));
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.run()));
    assert!(unwound.is_err());
    let probe = Probe::default();
    assert!(
        h.current.local_ref(Waker::noop()).is_none(),
        "no task is current after the unwind"
    );
    // The other tasks run on; the one that panicked is dropped with the rest.
    let other = h.spawn(ProbeFuture(probe.clone()));
    assert_eq!(h.run(), 1);
    drop(std::mem::take(&mut *h.tasks.borrow_mut()));
    drop((task, other));
    probe.waker.borrow_mut().take();
    assert_eq!(h.allocated(), 0);
}

#[test]
fn a_future_that_wakes_itself_from_its_drop_is_dropped_once() {
    let h = Harness::new();
    let probe = Probe::default();
    struct WakeOnDrop(Probe);
    impl Future for WakeOnDrop {
        type Output = ();
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            *self.0.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        }
    }
    impl Drop for WakeOnDrop {
        fn drop(&mut self) {
            if let Some(w) = self.0.waker.borrow_mut().take() {
                w.wake();
            }
            self.0.dropped.set(true);
        }
    }
    let task = h.spawn(WakeOnDrop(probe.clone()));
    h.run();
    task.cancel();
    assert_eq!(h.run(), 1);
    assert!(probe.dropped.get());
    assert_eq!(h.run(), 0);
    drop(task);
    assert_eq!(h.allocated(), 0);
}

#[test]
fn a_future_dropped_with_the_last_local_reference_inside_it_is_dropped_whole() {
    let h = Harness::new();
    let current = h.current.clone();
    // What an I/O future holds while its I/O is in flight, kept in the future itself.
    let held: RefCell<Option<LocalRef>> = RefCell::new(None);
    let task = h.spawn(std::future::poll_fn(move |cx| {
        *held.borrow_mut() = current.local_ref(cx.waker());
        assert!(held.borrow().is_some());
        Poll::<()>::Pending
    }));
    h.run();
    task.cancel();
    // The join handle's reference goes first: the owner side's is the last.
    drop(task);
    assert_eq!(h.run(), 1);
    assert_eq!(h.allocated(), 0);
}
