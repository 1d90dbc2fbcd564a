//! Spawning from another thread: a `Send` closure travels through the reactor's mailbox and
//! builds the (non-`Send`) future on the reactor.

use std::future::Future;

use hypoll_reactor::{ReactorHandle, SendError};

use crate::executor::RUN_BATCH;
use crate::join::{Filler, JoinHandle, Slot};
use crate::task::panic_message;
use crate::{HasExecutor, JoinError, Local};

/// Spawning on a reactor through its [`ReactorHandle`], from any thread.
pub trait SpawnExt<S: 'static> {
    /// Sends `make` to the reactor, which calls it with its [`Local`] handle and runs the
    /// future it returns as a task, starting in the turn that receives it. The future need
    /// not be `Send` (it may hold `Rc`, a `RefCell`, the reactor's own buffers): only `make`
    /// and the result cross threads.
    ///
    /// A full mailbox is [`SendError::Full`] at once (`make` is dropped, nothing is
    /// spawned). If the reactor refuses the task (too many tasks, or stopping) the handle
    /// yields [`JoinError::NotSpawned`]; if the reactor stops before the message runs, or
    /// the task is dropped unfinished, [`JoinError::Cancelled`].
    fn spawn<F, Fut>(&self, make: F) -> Result<JoinHandle<Fut::Output>, SendError>
    where
        F: FnOnce(Local<S>) -> Fut + Send + 'static,
        Fut: Future + 'static,
        Fut::Output: Send + 'static;
}

impl<S: HasExecutor> SpawnExt<S> for ReactorHandle<S> {
    fn spawn<F, Fut>(&self, make: F) -> Result<JoinHandle<Fut::Output>, SendError>
    where
        F: FnOnce(Local<S>) -> Fut + Send + 'static,
        Fut: Future + 'static,
        Fut::Output: Send + 'static,
    {
        let slot = Slot::new();
        let filler = Filler(slot.clone());
        self.send(move |reactor, state| {
            let local = state.executor().local();
            if let Err(e) = local.core.may_spawn() {
                tracing::warn!(error = %e, "a task sent from another thread was refused");
                return filler.fill(Err(JoinError::NotSpawned(e)));
            }
            // A panic in `make` is the task's: reported through its handle, not the
            // reactor's death.
            let made =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| make(local.clone())));
            let future = match made {
                Ok(future) => future,
                Err(payload) => {
                    let message = panic_message(payload.as_ref());
                    tracing::error!(%message, "building a task sent from another thread panicked");
                    return filler.fill(Err(JoinError::Panicked { message }));
                }
            };
            // `make` itself may have spawned up to the limit.
            if let Err(e) = local.core.may_spawn() {
                tracing::warn!(error = %e, "a task sent from another thread was refused");
                return filler.fill(Err(JoinError::NotSpawned(e)));
            }
            // The task's result (or its panic, caught by its wrapper) goes to the slot.
            let spawned = local.core.spawn_filling(future, filler);
            debug_assert!(spawned.is_ok(), "room was checked just above");
            local.core.run(reactor, state, RUN_BATCH);
        })?;
        Ok(JoinHandle::remote(slot))
    }
}
