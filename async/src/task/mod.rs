//! Tasks: the core that runs them ([`raw`], with its run queues in [`queue`]), and what
//! every task's future is wrapped in ([`TaskFuture`]): its output goes to its join handle's
//! slot, and a panic inside it ends the task with an error instead of unwinding into the
//! reactor.

mod queue;
mod raw;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;

pub(crate) use raw::{Current, LocalRef, Owned, Queue, Ran, TaskRef};

use crate::executor::Core;
use crate::join::Filler;
use crate::JoinError;

pin_project! {
    /// A task's future as its executor runs it.
    pub(crate) struct TaskFuture<F: Future, S: 'static> {
        #[pin]
        inner: F,
        // Taken when the task ends; dropped unfilled (the task was cancelled, or its
        // executor closed), it tells the join handle so.
        filler: Option<Filler<F::Output>>,
        core: Rc<Core<S>>,
    }
}

impl<F: Future, S: 'static> TaskFuture<F, S> {
    pub(crate) fn new(inner: F, filler: Filler<F::Output>, core: Rc<Core<S>>) -> Self {
        TaskFuture {
            inner,
            filler: Some(filler),
            core,
        }
    }
}

impl<F: Future, S: 'static> Future for TaskFuture<F, S> {
    type Output = ();

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        let inner = this.inner;
        // The future is not touched again after a panic (the task ends here and the
        // executor drops it), so whatever state the panic left it in is never observed.
        let result = match catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(output)) => Ok(output),
            Err(payload) => {
                let message = panic_message(payload.as_ref());
                tracing::error!(%message, "a task panicked; it ends, the reactor goes on");
                crate::executor::count(&this.core.panics, 1);
                Err(JoinError::Panicked { message })
            }
        };
        if let Some(filler) = this.filler.take() {
            filler.fill(result);
        }
        Poll::Ready(())
    }
}

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}
