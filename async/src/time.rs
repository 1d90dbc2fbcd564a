//! Time for tasks: `sleep` on the reactor's timers, `timeout` around any future, and
//! `yield_now`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hypoll_reactor::{Reactor, TimerId};
use pin_project_lite::pin_project;
use slab::Slab;

use crate::executor::Core;
use crate::{HasExecutor, Local};

/// One sleep's place between its future and its timer.
enum TimerCell {
    Waiting(Option<Waker>),
    Fired,
    /// Its future was dropped and the timer could not be cancelled: the timer frees it.
    Orphaned,
}

/// The executor's sleeps.
#[derive(Default)]
pub(crate) struct TimerCells {
    cells: Slab<TimerCell>,
}

impl<S: 'static> Core<S> {
    fn timer_fired(&self, key: usize) {
        let mut timers = self.timers.borrow_mut();
        let waker = match &mut timers.cells[key] {
            TimerCell::Waiting(waker) => {
                let waker = waker.take();
                timers.cells[key] = TimerCell::Fired;
                waker
            }
            TimerCell::Orphaned => {
                timers.cells.remove(key);
                None
            }
            TimerCell::Fired => unreachable!("a timer fires once"),
        };
        drop(timers);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The reactor's timer callback for a sleep: the task it wakes runs in this same turn
/// (pollers, the executor's among them, run after timers).
fn fired<S: HasExecutor>(_reactor: &mut Reactor<S>, state: &mut S, key: usize) {
    state.executor().local().core.timer_fired(key);
}

#[derive(Clone, Copy, Debug)]
enum Stage {
    Start(Duration),
    Armed { key: usize, timer: TimerId },
    Finished,
}

/// Waits for a time to pass, on the reactor's timers (see [`Local::sleep`]).
#[must_use = "a sleep does nothing until awaited"]
pub struct Sleep<'a, S: 'static> {
    local: &'a Local<S>,
    stage: Stage,
}

impl<'a, S: HasExecutor> Sleep<'a, S> {
    pub(crate) fn new(local: &'a Local<S>, duration: Duration) -> Self {
        Sleep {
            local,
            stage: Stage::Start(duration),
        }
    }
}

impl<S: HasExecutor> Future for Sleep<'_, S> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let core = &self.local.core;
        match self.stage {
            Stage::Start(duration) => {
                let key = core
                    .timers
                    .borrow_mut()
                    .cells
                    .insert(TimerCell::Waiting(Some(cx.waker().clone())));
                // `after` counts from this call, however late in a long turn it comes.
                let arm = |reactor: &mut Reactor<S>, _: &mut S| {
                    reactor.after(duration, move |r, s| fired(r, s, key))
                };
                let timer = core.lend.with(arm);
                let timer = timer.expect("a sleep was polled outside its reactor's executor");
                self.stage = Stage::Armed { key, timer };
                Poll::Pending
            }
            Stage::Armed { key, .. } => {
                let mut timers = core.timers.borrow_mut();
                match &mut timers.cells[key] {
                    TimerCell::Waiting(waker) => {
                        if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                            *waker = Some(cx.waker().clone());
                        }
                        Poll::Pending
                    }
                    TimerCell::Fired => {
                        timers.cells.remove(key);
                        drop(timers);
                        self.stage = Stage::Finished;
                        Poll::Ready(())
                    }
                    TimerCell::Orphaned => unreachable!("a live sleep's cell is not orphaned"),
                }
            }
            Stage::Finished => Poll::Ready(()),
        }
    }
}

impl<S: 'static> Drop for Sleep<'_, S> {
    fn drop(&mut self) {
        let Stage::Armed { key, timer } = self.stage else {
            return;
        };
        let core = &self.local.core;
        // Inside a task's poll (the usual place: a timeout that finished) the timer can be
        // cancelled; elsewhere it fires later, to no one, and frees the cell then.
        let cancelled = core.lend.with(|reactor, _| reactor.cancel_timer(timer));
        let mut timers = core.timers.borrow_mut();
        if cancelled == Some(true) || matches!(timers.cells[key], TimerCell::Fired) {
            timers.cells.remove(key);
        } else {
            timers.cells[key] = TimerCell::Orphaned;
        }
    }
}

/// A future given a time limit ran past it. The future was dropped; an I/O it had in
/// flight was not cancelled (see [`Local::timeout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("timed out")]
pub struct Elapsed;

pin_project! {
    /// A future with a time limit (see [`Local::timeout`]).
    #[must_use = "a timeout does nothing until awaited"]
    pub struct Timeout<'a, S: 'static, F> {
        #[pin]
        future: F,
        sleep: Sleep<'a, S>,
    }
}

impl<'a, S: HasExecutor, F> Timeout<'a, S, F> {
    pub(crate) fn new(local: &'a Local<S>, limit: Duration, future: F) -> Self {
        Timeout {
            future,
            sleep: Sleep::new(local, limit),
        }
    }
}

impl<S: HasExecutor, F: Future> Future for Timeout<'_, S, F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.future.poll(cx) {
            return Poll::Ready(Ok(output));
        }
        match Pin::new(this.sleep).poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(Elapsed)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Lets the reactor's other tasks, and the rest of its turn, run before this task goes on.
pub fn yield_now() -> YieldNow {
    YieldNow { yielded: false }
}

/// See [`yield_now`].
#[must_use = "yielding does nothing until awaited"]
pub struct YieldNow {
    yielded: bool,
}

impl Future for YieldNow {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.yielded {
            return Poll::Ready(());
        }
        self.yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
