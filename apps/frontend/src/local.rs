//! How code running on a reactor finds that reactor's shard: each reactor thread keeps its
//! shards (one per protocol it serves) in a thread-local, so a device completion callback
//! or a message from the listener captures nothing and costs no allocation to find its
//! connection. The poller that drives a shard each reactor turn lives here too.

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::os::fd::{AsFd, BorrowedFd};
use std::rc::Rc;

use hypoll_reactor::{Poller, Reactor};

use crate::epoll::Epoll;
use crate::protocol::Protocol;
use crate::shard::Shard;

thread_local! {
    /// The shards of the reactor running on this thread, by protocol.
    static SHARDS: RefCell<Vec<(TypeId, Rc<dyn Any>)>> = const { RefCell::new(Vec::new()) };
}

/// Makes `shard` the shard of protocol `P` on this thread (replacing an earlier one).
pub(crate) fn install<P: Protocol>(shard: Rc<RefCell<Shard<P>>>) {
    SHARDS.with(|s| {
        let mut shards = s.borrow_mut();
        shards.retain(|(t, _)| *t != TypeId::of::<P>());
        shards.push((TypeId::of::<P>(), shard));
    });
}

/// Runs `f` on this reactor's shard of protocol `P`; `None` where the thread has none.
pub fn with_shard<P: Protocol, R>(f: impl FnOnce(&mut Shard<P>) -> R) -> Option<R> {
    let any = SHARDS.with(|s| {
        s.borrow()
            .iter()
            .find(|(t, _)| *t == TypeId::of::<P>())
            .map(|(_, shard)| shard.clone())
    })?;
    let shard = any.downcast::<RefCell<Shard<P>>>().ok()?;
    let mut s = shard.borrow_mut();
    Some(f(&mut s))
}

/// Polls a shard every reactor turn; its wake fd is the shard's epoll set, so a parked
/// reactor wakes when a client sends.
pub(crate) struct ShardPoller<P: Protocol> {
    pub(crate) epoll: Rc<Epoll>,
    pub(crate) shard: Rc<RefCell<Shard<P>>>,
}

impl<P: Protocol> Poller for ShardPoller<P> {
    fn poll(&mut self, reactor: &mut Reactor) -> usize {
        self.shard.borrow_mut().poll(reactor)
    }

    fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.epoll.as_fd())
    }
}
