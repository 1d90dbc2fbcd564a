//! What every task's future is wrapped in: it leaves its executor's registry when dropped,
//! and a panic inside it ends the task with an error instead of unwinding into the reactor.

use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;

use crate::executor::Core;
use crate::JoinError;

pin_project! {
    /// A task's future as its executor runs it.
    pub(crate) struct TaskFuture<F, S: 'static> {
        #[pin]
        inner: F,
        core: Rc<Core<S>>,
        // Its place in the executor's registry of live tasks.
        key: usize,
    }

    impl<F, S: 'static> PinnedDrop for TaskFuture<F, S> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            this.core.forget_task(*this.key);
        }
    }
}

impl<F, S: 'static> TaskFuture<F, S> {
    pub(crate) fn new(inner: F, core: Rc<Core<S>>, key: usize) -> Self {
        TaskFuture { inner, core, key }
    }
}

impl<F: Future, S: 'static> Future for TaskFuture<F, S> {
    type Output = Result<F::Output, JoinError>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let inner = this.inner;
        // The future is not touched again after a panic (the task ends here and async-task
        // drops it), so whatever state the panic left it in is never observed.
        match catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(payload) => {
                let message = panic_message(payload.as_ref());
                tracing::error!(%message, "a task panicked; it ends, the reactor goes on");
                crate::executor::count(&this.core.panics, 1);
                Poll::Ready(Err(JoinError::Panicked { message }))
            }
        }
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
