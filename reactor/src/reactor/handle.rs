//! The way in from other threads: a [`ReactorHandle`], the bounded mailbox it sends closures
//! through, and the eventfd that wakes a parked reactor when one arrives.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TrySendError};
use hypoll_nvme::sys::EventFd;

use super::{Message, Reactor};
use crate::stats::{ReactorStats, SharedStats};

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The reactor's mailbox is full: back-pressure, retry later.
    #[error("the reactor's mailbox is full")]
    Full,
    /// The reactor stopped, or died.
    #[error("the reactor has stopped")]
    Stopped,
}

/// Shared between a reactor and the handles to it.
pub(crate) struct Wake {
    pub(super) eventfd: EventFd,
    /// The reactor is (about to be) blocked in epoll: senders must signal the eventfd.
    pub(super) parked: AtomicBool,
    pub(super) stop: AtomicBool,
}

/// A handle to a reactor whose state is an `S`, usable from any thread.
pub struct ReactorHandle<S = ()> {
    index: usize,
    pub(super) core: usize,
    tx: Sender<Message<S>>,
    pub(super) wake: Arc<Wake>,
    pub(super) stats: Arc<SharedStats>,
}

// Not derived: a derived `Clone` would ask `S: Clone`, and the handle holds no `S`.
impl<S> Clone for ReactorHandle<S> {
    fn clone(&self) -> Self {
        ReactorHandle {
            index: self.index,
            core: self.core,
            tx: self.tx.clone(),
            wake: self.wake.clone(),
            stats: self.stats.clone(),
        }
    }
}

impl<S> ReactorHandle<S> {
    /// Queues `f` to run on the reactor, given the reactor and its state. A full mailbox is
    /// an error, never a wait.
    pub fn send(
        &self,
        f: impl FnOnce(&mut Reactor<S>, &mut S) + Send + 'static,
    ) -> Result<(), SendError> {
        if self.wake.stop.load(Ordering::Acquire) {
            return Err(SendError::Stopped);
        }
        match self.tx.try_send(Box::new(f)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(SendError::Full),
            Err(TrySendError::Disconnected(_)) => return Err(SendError::Stopped),
        }
        self.wake_if_parked();
        Ok(())
    }

    /// Queues `f` to run on the reactor, waiting up to `timeout` for room in a full mailbox:
    /// back-pressure that slows the sender down instead of failing it at once. Never waits
    /// longer than `timeout` (then [`SendError::Full`]), never grows the mailbox. Meant for
    /// threads outside the reactors: a reactor sending to a full mailbox (its own included)
    /// should use [`ReactorHandle::send`] and retry from a timer, since while it waits it
    /// runs nothing else.
    pub fn send_timeout(
        &self,
        f: impl FnOnce(&mut Reactor<S>, &mut S) + Send + 'static,
        timeout: Duration,
    ) -> Result<(), SendError> {
        if self.wake.stop.load(Ordering::Acquire) {
            return Err(SendError::Stopped);
        }
        match self.tx.send_timeout(Box::new(f), timeout) {
            Ok(()) => {}
            Err(crossbeam_channel::SendTimeoutError::Timeout(_)) => return Err(SendError::Full),
            Err(crossbeam_channel::SendTimeoutError::Disconnected(_)) => {
                return Err(SendError::Stopped)
            }
        }
        self.wake_if_parked();
        Ok(())
    }

    /// After a message went into the mailbox: signals the eventfd if the reactor is parked.
    #[inline]
    fn wake_if_parked(&self) {
        // Pairs with the fence in `Reactor::park`: either the reactor sees the message before
        // it blocks, or we see `parked` and wake it.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.wake.parked.load(Ordering::SeqCst) {
            let _ = self.wake.eventfd.signal();
        }
    }

    /// Asks the reactor to stop: it finishes what is queued, drains or fails its I/O and
    /// exits. Idempotent.
    pub(crate) fn stop(&self) {
        self.wake.stop.store(true, Ordering::Release);
        let _ = self.wake.eventfd.signal();
    }

    /// The reactor's counters as last published (every 10 ms while it runs, and before it
    /// parks), with its CPU time read from the OS now.
    pub fn stats(&self) -> ReactorStats {
        self.stats.read(self.core)
    }

    /// The reactor thread's CPU time (user + system) from the OS; `None` before it started
    /// or after it exited.
    pub fn cpu_ns(&self) -> Option<u64> {
        self.stats.cpu_ns()
    }

    pub fn core(&self) -> usize {
        self.core
    }

    pub fn index(&self) -> usize {
        self.index
    }

    pub(crate) fn stats_cell(&self) -> &SharedStats {
        &self.stats
    }
}

/// Creates the mailbox of one reactor: the handle and what the reactor keeps.
pub(crate) fn mailbox<S>(
    index: usize,
    core: usize,
    capacity: usize,
) -> std::io::Result<(ReactorHandle<S>, Receiver<Message<S>>)> {
    let (tx, rx) = crossbeam_channel::bounded(capacity);
    let wake = Arc::new(Wake {
        eventfd: EventFd::new()?,
        parked: AtomicBool::new(false),
        stop: AtomicBool::new(false),
    });
    let handle = ReactorHandle {
        index,
        core,
        tx,
        wake,
        stats: Arc::new(SharedStats::default()),
    };
    Ok((handle, rx))
}
