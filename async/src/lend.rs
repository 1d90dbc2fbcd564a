//! How a future reaches its reactor: while the executor polls tasks it holds `&mut Reactor`
//! and `&mut S`, and lends them, one borrower at a time, to the task being polled.
//!
//! A future cannot be handed `&mut Reactor` through `poll`'s arguments, and the repository
//! keeps no thread-local to find "the current reactor" by. So the executor, which is called
//! with both (by the reactor, as a poller or from an I/O callback), parks raw pointers to
//! them in its own cell for exactly as long as it runs tasks, and [`Lend::with`] hands them
//! out as `&mut` to one closure at a time. The unsafe code here is that promise.

use std::cell::Cell;
use std::ptr::NonNull;

use hypoll_reactor::Reactor;

/// Where the lent reactor and state are.
type Pointers<S> = (NonNull<Reactor<S>>, NonNull<S>);

/// The reactor and its state, lent out while the executor runs tasks.
pub(crate) struct Lend<S> {
    /// `Some` only inside [`Lend::lend`], and then only while no [`Lend::with`] holds them.
    lent: Cell<Option<Pointers<S>>>,
}

impl<S> Lend<S> {
    pub(crate) fn new() -> Lend<S> {
        Lend {
            lent: Cell::new(None),
        }
    }

    /// Runs `f`, during which [`Lend::with`] may reach `reactor` and `state`. Not
    /// re-entrant: panics if already lending.
    pub(crate) fn lend<R>(
        &self,
        reactor: &mut Reactor<S>,
        state: &mut S,
        f: impl FnOnce() -> R,
    ) -> R {
        let pointers = (NonNull::from(reactor), NonNull::from(state));
        let before = self.lent.replace(Some(pointers));
        assert!(before.is_none(), "the executor lent its reactor twice");
        /// Takes the pointers back however `f` ends (a panic included), so they never
        /// outlive the borrows they came from.
        struct Reclaim<'a, S>(&'a Cell<Option<Pointers<S>>>);
        impl<S> Drop for Reclaim<'_, S> {
            fn drop(&mut self) {
                self.0.set(None);
            }
        }
        let _reclaim = Reclaim(&self.lent);
        f()
    }

    /// Runs `f` with the reactor and its state if they are lent now (a task is being polled
    /// by this executor, and no other `with` holds them); `None` otherwise.
    #[inline(always)]
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Reactor<S>, &mut S) -> R) -> Option<R> {
        let (mut reactor, mut state) = self.lent.take()?;
        /// Puts the pointers back however `f` ends, for the next borrower.
        struct GiveBack<'a, S>(&'a Cell<Option<Pointers<S>>>, Pointers<S>);
        impl<S> Drop for GiveBack<'_, S> {
            fn drop(&mut self) {
                self.0.set(Some(self.1));
            }
        }
        let _give_back = GiveBack(&self.lent, (reactor, state));
        // SAFETY: the pointers were made in `lend` from `&mut` borrows that last for the
        // whole of `lend`'s call, during which `lend` uses neither borrow, and `lend`
        // takes them back before it returns or unwinds, so they point to live, unaliased
        // values now. They were taken out of the cell above, so no other `with` can make a
        // second `&mut` until `f` is done; and the `&mut` made here cannot outlive `f`,
        // whose result type cannot name their lifetime.
        let (reactor, state) = unsafe { (reactor.as_mut(), state.as_mut()) };
        Some(f(reactor, state))
    }
}
