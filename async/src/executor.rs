//! The executor of one reactor: its tasks, the loop that polls the woken ones, the poller
//! that runs that loop every reactor turn, and closing (every task dropped on its thread).

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::os::fd::BorrowedFd;
use std::rc::Rc;

use hypoll_reactor::{Poller, Reactor};
use slab::Slab;

use crate::io::IoCells;
use crate::join::{Filler, JoinHandle, Slot};
use crate::lend::Lend;
use crate::task::{Current, LocalRef, Owned, Queue, Ran, TaskFuture, TaskRef};
use crate::time::TimerCells;
use crate::{ExecutorCounters, HasExecutor, Local, SpawnError};

/// Most tasks one executor runs per call: per reactor turn from its poller, and per I/O
/// completion that woke one. A task that wakes itself (`yield_now`) cannot keep the reactor
/// from its messages, timers and completions for longer than this many polls.
pub const RUN_BATCH: usize = 128;
/// Default [`ExecutorConfig::tasks_max`].
pub const DEFAULT_TASKS_MAX: usize = 65_536;

/// How an executor is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExecutorConfig {
    /// Most tasks alive at once on this reactor; a spawn past it is refused
    /// ([`SpawnError::TooManyTasks`]).
    pub tasks_max: usize,
}

impl Default for ExecutorConfig {
    fn default() -> Self {
        ExecutorConfig {
            tasks_max: DEFAULT_TASKS_MAX,
        }
    }
}

impl ExecutorConfig {
    pub fn with_tasks_max(mut self, tasks_max: usize) -> ExecutorConfig {
        self.tasks_max = tasks_max;
        self
    }
}

/// What every task, future and handle of one executor shares (behind an `Rc`: it never
/// leaves the reactor's thread).
pub(crate) struct Core<S: 'static> {
    pub(crate) queue: Queue,
    /// The task being polled: its I/O futures wake it through it, without a waker.
    pub(crate) current: Current,
    pub(crate) lend: Lend<S>,
    /// Inside `run`: an I/O completion then only wakes tasks, it does not run them.
    running: Cell<bool>,
    /// The reactor was asked to run the woken tasks once its batch of completions has run
    /// its callbacks (`Reactor::after_completions`), and has not yet.
    pub(crate) run_asked: Cell<bool>,
    /// No more spawns; every task is being (or has been) dropped.
    closed: Cell<bool>,
    /// The executor was dropped while it ran tasks: it closes when the run ends.
    close_deferred: Cell<bool>,
    /// Every live task's future, to close them all; a task leaves when its future ends.
    tasks: RefCell<Slab<Owned>>,
    tasks_max: usize,
    pub(crate) io: RefCell<IoCells>,
    /// Why the last I/O a future submitted was refused, from the submission to the future
    /// (so that the usual answer, accepted, is one register wide).
    pub(crate) refusal: Cell<Option<hypoll_reactor::RejectReason>>,
    pub(crate) timers: RefCell<TimerCells>,
    /// What [`ExecutorCounters`] reports, each in a cell of its own: a count on the I/O
    /// path is one add, not a copy of the whole set.
    pub(crate) spawned: Cell<u64>,
    pub(crate) polls: Cell<u64>,
    pub(crate) panics: Cell<u64>,
    pub(crate) ios: Cell<u64>,
    pub(crate) ios_orphaned: Cell<u64>,
}

impl<S: 'static> Core<S> {
    fn new(config: ExecutorConfig) -> std::io::Result<Core<S>> {
        Ok(Core {
            queue: Queue::new()?,
            current: Current::new(),
            lend: Lend::new(),
            running: Cell::new(false),
            run_asked: Cell::new(false),
            closed: Cell::new(false),
            close_deferred: Cell::new(false),
            tasks: RefCell::new(Slab::new()),
            tasks_max: config.tasks_max,
            io: RefCell::new(IoCells::default()),
            refusal: Cell::new(None),
            timers: RefCell::new(TimerCells::default()),
            spawned: Cell::new(0),
            polls: Cell::new(0),
            panics: Cell::new(0),
            ios: Cell::new(0),
            ios_orphaned: Cell::new(0),
        })
    }

    pub(crate) fn counters(&self) -> ExecutorCounters {
        ExecutorCounters {
            spawned: self.spawned.get(),
            polls: self.polls.get(),
            panics: self.panics.get(),
            ios: self.ios.get(),
            ios_orphaned: self.ios_orphaned.get(),
        }
    }

    /// Whether a task may be spawned now.
    pub(crate) fn may_spawn(&self) -> Result<(), SpawnError> {
        if self.closed.get() {
            return Err(SpawnError::Closed);
        }
        if self.tasks.borrow().len() >= self.tasks_max {
            return Err(SpawnError::TooManyTasks {
                max: self.tasks_max,
            });
        }
        Ok(())
    }

    /// Spawns `future` as a task of this executor; it first runs on the executor's next
    /// run (this reactor turn, if the reactor is in its turn).
    pub(crate) fn spawn<F>(self: &Rc<Self>, future: F) -> Result<JoinHandle<F::Output>, SpawnError>
    where
        F: Future + 'static,
        F::Output: 'static,
    {
        let slot = Slot::new();
        let task = self.spawn_filling(future, Filler(slot.clone()))?;
        Ok(JoinHandle::local(slot, task))
    }

    /// Spawns `future`, wrapped ([`TaskFuture`]) so that its output (or its panic, or its
    /// end unfinished) goes to `filler`.
    pub(crate) fn spawn_filling<F>(
        self: &Rc<Self>,
        future: F,
        filler: Filler<F::Output>,
    ) -> Result<TaskRef, SpawnError>
    where
        F: Future + 'static,
        F::Output: 'static,
    {
        self.may_spawn()?;
        let (owned, task) = self
            .queue
            .spawn(TaskFuture::new(future, filler, self.clone()));
        let mut tasks = self.tasks.borrow_mut();
        let entry = tasks.vacant_entry();
        owned.set_key(entry.key());
        entry.insert(owned);
        drop(tasks);
        count(&self.spawned, 1);
        Ok(task)
    }

    /// Tasks alive.
    pub(crate) fn tasks(&self) -> usize {
        self.tasks.borrow().len()
    }

    /// Polls up to `budget` woken tasks, lending them the reactor and its state. Returns
    /// how many it polled: 0 when every task is blocked (the reactor is then idle as far
    /// as tasks go, and its policy decides how to wait). Does nothing when called from
    /// inside a run (an I/O completed by a task's own call).
    #[inline]
    pub(crate) fn run(&self, reactor: &mut Reactor<S>, state: &mut S, budget: usize) -> usize {
        if self.running.get() {
            return 0;
        }
        self.queue.take_remote();
        if self.queue.len() == 0 {
            return 0;
        }
        self.run_queued(reactor, state, budget)
    }

    /// `run`, with tasks queued and no run in progress.
    #[inline(never)]
    fn run_queued(&self, reactor: &mut Reactor<S>, state: &mut S, budget: usize) -> usize {
        let ending = Running::start(&self.running);
        let mut polled = 0;
        self.lend.lend(reactor, state, || {
            while polled < budget {
                let Some(task) = self.queue.pop() else {
                    break;
                };
                match task.run(&self.current) {
                    Ran::Pending => {}
                    Ran::Ended { key, .. } => self.end(key),
                    // Its future was dropped while it waited in the queue.
                    Ran::Gone => continue,
                }
                polled += 1;
            }
        });
        drop(ending);
        count(&self.polls, polled as u64);
        if self.close_deferred.get() {
            self.close();
        }
        polled
    }

    /// Whether a task woken alone may be polled at once (by `poll_alone`): no other task
    /// waits to run or is being polled. (Nor is it queued already: a queued task is in the
    /// run queue, which is empty. A run asked of the reactor for this batch may be
    /// pending with nothing left to run, which is no reason to wait.)
    #[inline(always)]
    pub(crate) fn may_poll_alone(&self) -> bool {
        self.queue.len() == 0 && !self.running.get()
    }

    /// Polls `task` at once, lending it the reactor and its state: for a task whose I/O
    /// just completed (see `may_poll_alone`), which then needs no trip through the run
    /// queue. Inlined: it is the body of every I/O completion at queue depth 1.
    #[inline(always)]
    pub(crate) fn poll_alone(&self, reactor: &mut Reactor<S>, state: &mut S, task: LocalRef) {
        debug_assert!(self.may_poll_alone() && !task.is_queued());
        let ending = Running::start(&self.running);
        let polled = self
            .lend
            .lend(reactor, state, || match task.run_now(&self.current) {
                Ran::Pending => 1,
                Ran::Ended { key, .. } => {
                    self.end(key);
                    1
                }
                Ran::Gone => 0,
            });
        drop(ending);
        count(&self.polls, polled);
        if self.close_deferred.get() {
            self.close();
        }
    }

    /// A task ended (its future is ready, or it was cancelled): it leaves the registry,
    /// and its future is dropped here, inside the lending.
    #[cold]
    #[inline(never)]
    fn end(&self, key: usize) {
        // Out of the registry first: dropping the future may spawn.
        let owned = self.tasks.borrow_mut().remove(key);
        drop(owned);
    }

    /// Closes the executor: no more spawns, and every task's future is dropped here, on the
    /// reactor's thread (a task awaiting its join handle sees [`JoinError::Cancelled`]).
    ///
    /// [`JoinError::Cancelled`]: crate::JoinError::Cancelled
    pub(crate) fn close(&self) {
        if self.running.get() {
            self.close_deferred.set(true);
            return;
        }
        self.closed.set(true);
        // Dropping a future may wake other tasks, or free them: repeat until none is left.
        // Each round drops every future left, and no new task can be spawned.
        loop {
            let tasks = std::mem::take(&mut *self.tasks.borrow_mut());
            self.queue.take_remote();
            if tasks.is_empty() && self.queue.len() == 0 {
                break;
            }
            drop(tasks);
            // Only tasks whose future is gone are left in the queue.
            while let Some(task) = self.queue.pop() {
                drop(task);
            }
        }
        self.queue.close();
    }
}

/// Marks an executor as polling tasks until dropped, however the polling ends.
struct Running<'a>(&'a Cell<bool>);

impl<'a> Running<'a> {
    #[inline(always)]
    fn start(running: &'a Cell<bool>) -> Running<'a> {
        debug_assert!(!running.get());
        running.set(true);
        Running(running)
    }
}

impl Drop for Running<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.0.set(false);
    }
}

/// Adds `n` to a counter.
#[inline]
pub(crate) fn count(counter: &Cell<u64>, n: u64) {
    counter.set(counter.get() + n);
}

/// The executor of one reactor: lives in the reactor's state (see [`HasExecutor`]), and
/// closes when dropped, dropping every task's future on the reactor's thread.
pub struct Executor<S: 'static> {
    pub(crate) local: Local<S>,
}

impl<S: HasExecutor> Executor<S> {
    /// Makes an executor for `reactor` and adds its poller, which runs woken tasks every
    /// turn; call it from the reactor's `init` and keep the executor in the state.
    pub fn install(reactor: &mut Reactor<S>) -> std::io::Result<Executor<S>> {
        Executor::install_with(reactor, ExecutorConfig::default())
    }

    /// [`Executor::install`] with limits of one's own.
    pub fn install_with(
        reactor: &mut Reactor<S>,
        config: ExecutorConfig,
    ) -> std::io::Result<Executor<S>> {
        let core = Rc::new(Core::new(config)?);
        reactor.add_poller(Box::new(ExecutorPoller { core: core.clone() }))?;
        Ok(Executor {
            local: Local { core },
        })
    }
}

impl<S: 'static> Executor<S> {
    /// A handle for tasks: I/O, timers, spawning, and the reactor and state themselves.
    pub fn local(&self) -> Local<S> {
        self.local.clone()
    }

    /// Spawns a task on this reactor (see [`Local::spawn_local`]).
    pub fn spawn_local<F>(&self, future: F) -> Result<JoinHandle<F::Output>, SpawnError>
    where
        F: Future + 'static,
        F::Output: 'static,
    {
        self.local.spawn_local(future)
    }

    /// What this executor did so far.
    pub fn counters(&self) -> ExecutorCounters {
        self.local.counters()
    }
}

impl<S: 'static> Drop for Executor<S> {
    fn drop(&mut self) {
        self.local.core.close();
    }
}

/// Runs woken tasks of the reactor's executor now, up to [`RUN_BATCH`], instead of at its
/// poller's next turn: for a callback or message that spawned or woke tasks and wants them
/// to start at once. Returns how many it polled; 0 from inside a task (whose executor is
/// running already).
pub fn run_now<S: HasExecutor>(reactor: &mut Reactor<S>, state: &mut S) -> usize {
    let core = state.executor().local.core.clone();
    core.run(reactor, state, RUN_BATCH)
}

/// Runs the executor every reactor turn; its wake fd wakes a parked reactor for tasks woken
/// on other threads.
struct ExecutorPoller<S: 'static> {
    core: Rc<Core<S>>,
}

impl<S: HasExecutor> Poller<S> for ExecutorPoller<S> {
    fn poll(&mut self, reactor: &mut Reactor<S>, state: &mut S) -> usize {
        self.core.wake_for_room(reactor);
        self.core.run(reactor, state, RUN_BATCH)
    }

    fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.core.queue.wake_fd())
    }
}
