//! Join handles: a task's result, awaited from any task on any reactor or waited for by a
//! plain thread; and the one-shot slot that carries the result of a task spawned from
//! another thread.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use parking_lot::Mutex;

use crate::task::TaskRef;

/// Why a task has no result.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JoinError {
    /// The task panicked: it ended there, and its reactor and other tasks went on.
    #[error("the task panicked: {message}")]
    Panicked { message: String },
    /// The task was dropped before it finished: cancelled, or its executor closed (its
    /// reactor stopped).
    #[error("the task was cancelled before it finished (or its reactor stopped)")]
    Cancelled,
    /// A task asked for from another thread was never spawned: its reactor refused it.
    #[error("the reactor did not spawn the task: {0}")]
    NotSpawned(crate::SpawnError),
}

/// A spawned task's result, to await (from any task, on any reactor) or to
/// [`wait`](JoinHandle::wait) for (from a plain thread). Dropping it detaches the task,
/// which runs on; [`JoinHandle::cancel`] stops it.
#[must_use = "dropping a join handle detaches its task"]
pub struct JoinHandle<T> {
    inner: Option<Inner<T>>,
}

/// Where the result comes from: the task's slot, and for a task spawned on its reactor a
/// reference to the task, to cancel it.
struct Inner<T> {
    slot: Arc<Slot<T>>,
    task: Option<TaskRef>,
}

impl<T> JoinHandle<T> {
    pub(crate) fn local(slot: Arc<Slot<T>>, task: TaskRef) -> Self {
        JoinHandle {
            inner: Some(Inner {
                slot,
                task: Some(task),
            }),
        }
    }

    pub(crate) fn remote(slot: Arc<Slot<T>>) -> Self {
        JoinHandle {
            inner: Some(Inner { slot, task: None }),
        }
    }

    /// Whether the task has finished (or will never run again).
    pub fn is_finished(&self) -> bool {
        match &self.inner {
            Some(inner) => inner.slot.state.lock().done,
            None => true,
        }
    }

    /// Stops the task: its future is dropped on its reactor, at the reactor's next turn.
    /// A task asked for from another thread ([`SpawnExt::spawn`](crate::SpawnExt::spawn))
    /// cannot be cancelled this way; it is detached instead.
    pub fn cancel(mut self) {
        if let Some(task) = self.inner.take().and_then(|inner| inner.task) {
            task.cancel();
        }
    }

    /// Blocks this thread until the task ends, and returns its result. For plain threads
    /// only: on a reactor's thread it would stop that reactor (and a task on it would never
    /// finish); await the handle there instead.
    pub fn wait(self) -> Result<T, JoinError> {
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        let mut handle = self;
        loop {
            if let Poll::Ready(result) = Pin::new(&mut handle).poll(&mut cx) {
                return result;
            }
            std::thread::park();
        }
    }
}

struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

impl<T> Future for JoinHandle<T> {
    type Output = Result<T, JoinError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.inner.as_ref().expect("polled after it finished");
        let result = {
            let mut state = inner.slot.state.lock();
            if !state.done {
                if !state
                    .waker
                    .as_ref()
                    .is_some_and(|w| w.will_wake(cx.waker()))
                {
                    state.waker = Some(cx.waker().clone());
                }
                return Poll::Pending;
            }
            state.result.take().unwrap_or(Err(JoinError::Cancelled))
        };
        self.inner = None;
        Poll::Ready(result)
    }
}

/// Where a task spawned from another thread leaves its result.
pub(crate) struct Slot<T> {
    state: Mutex<SlotState<T>>,
}

struct SlotState<T> {
    result: Option<Result<T, JoinError>>,
    /// The task ended (with a result, or dropped without one).
    done: bool,
    waker: Option<Waker>,
}

impl<T> Slot<T> {
    pub(crate) fn new() -> Arc<Slot<T>> {
        Arc::new(Slot {
            state: Mutex::new(SlotState {
                result: None,
                done: false,
                waker: None,
            }),
        })
    }
}

/// The reactor's end of a [`Slot`]: fills it once; dropped unfilled (the task was
/// cancelled, or the message carrying it never ran), it tells the waiter so.
pub(crate) struct Filler<T>(pub(crate) Arc<Slot<T>>);

impl<T> Filler<T> {
    pub(crate) fn fill(self, result: Result<T, JoinError>) {
        self.0.state.lock().result = Some(result);
        // `Drop` marks it done and wakes the waiter.
    }
}

impl<T> Drop for Filler<T> {
    fn drop(&mut self) {
        let waker = {
            let mut state = self.0.state.lock();
            state.done = true;
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}
