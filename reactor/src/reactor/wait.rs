//! Time and waiting behind one seam. A reactor reads the time through its `Clock` and
//! blocks through its `Waiter`: the real one sleeps the thread and waits in epoll; the
//! simulation's (`VirtualWaiter`) moves a virtual clock instead, so the whole idle path
//! (the policy's sleeps, interrupt waits, parks, the long-sleep bound) runs seeded and
//! replays. Only the idle path consults the waiter: the I/O path pays nothing for it. The
//! virtual waiter exists only with the `sim` feature (and in the crate's own tests): without
//! it the real waiter is the only one.

use super::{Reactor, WakeState};
#[cfg(any(test, feature = "sim"))]
use crate::sim::waiter::{emulated_deadline_ns, Block};
#[cfg(any(test, feature = "sim"))]
use crate::sim::VirtualWaiter;

/// How a reactor blocks.
#[derive(Default)]
pub(crate) enum Waiter {
    /// The thread sleeps (`clock_nanosleep`) or waits in epoll.
    #[default]
    Real,
    /// Virtual time moves instead (the simulation, behind the `sim` feature).
    #[cfg(any(test, feature = "sim"))]
    Virtual(Box<VirtualWaiter>),
}

impl<S> Reactor<S> {
    /// Runs the reactor on `waiter`'s virtual clock and waits through it.
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn simulate(&mut self, waiter: VirtualWaiter) {
        // Before any device: whether one has an emulated interrupt line is decided at attach.
        debug_assert!(self.devices.is_empty());
        self.set_clock(hypoll_nvme::Clock::Virtual(waiter.clock().clone()));
        self.waiter = Waiter::Virtual(Box::new(waiter));
    }

    /// The virtual waiter, in a simulation.
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn virtual_waiter(&self) -> Option<&VirtualWaiter> {
        match &self.waiter {
            Waiter::Real => None,
            #[cfg(any(test, feature = "sim"))]
            Waiter::Virtual(v) => Some(v),
        }
    }

    /// Whether a device without an interrupt fd has one in this reactor's world: an
    /// emulated device under a virtual waiter that gives it a line.
    #[cfg_attr(not(any(test, feature = "sim")), allow(unused_variables))]
    pub(super) fn emulated_interrupt(&self, qp: &(dyn hypoll_nvme::QueuePair + 'static)) -> bool {
        match &self.waiter {
            Waiter::Real => false,
            #[cfg(any(test, feature = "sim"))]
            Waiter::Virtual(v) => v.costs().interrupts && emulated_deadline_ns(qp).is_some(),
        }
    }

    /// Whether a simulated reactor is still in a wait (not to be turned).
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn sim_asleep(&self) -> bool {
        self.virtual_waiter()
            .is_some_and(|v| v.asleep(self.clock.now_ns()))
    }

    /// Tells a simulated reactor's waiter that a message arrived (it ends a block, not a
    /// timed sleep). Returns whether the reactor can take it now: awake, or woken by it.
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn sim_deliver(&mut self) -> bool {
        let now_ns = self.clock.now_ns();
        match &mut self.waiter {
            Waiter::Real => true,
            #[cfg(any(test, feature = "sim"))]
            Waiter::Virtual(v) => {
                v.deliver_message(now_ns);
                !v.asleep(now_ns)
            }
        }
    }

    /// One step of a simulated reactor: a turn at the clock's time and, when it found no
    /// work, the idle path, whose waits put it to sleep in virtual time. Returns the work
    /// done.
    #[cfg(any(test, feature = "sim"))]
    pub(crate) fn sim_step(&mut self, state: &mut S) -> usize {
        debug_assert!(matches!(self.waiter, Waiter::Virtual(_)));
        debug_assert!(!self.sim_asleep());
        let work = self.step(state, self.clock.now_ns());
        if work == 0 {
            self.when_idle();
        }
        work
    }

    /// Sleeps until `until_ns`; nothing ends it early. `piece`: not the I/O's sleep, but a
    /// piece of one (bounded by the long-sleep bound, or cut short at the next timer or
    /// timeout). Returns when it woke.
    #[cfg_attr(not(any(test, feature = "sim")), allow(unused_variables))]
    pub(super) fn sleep_until(&mut self, until_ns: u64, piece: bool) -> u64 {
        self.waited_from(self.now_ns);
        let woke_ns = match &mut self.waiter {
            Waiter::Real => {
                crate::sys::sleep_until_ns(until_ns);
                self.clock.now_ns()
            }
            #[cfg(any(test, feature = "sim"))]
            Waiter::Virtual(v) => v.sleep_until(self.now_ns, until_ns, piece),
        };
        debug_assert_eq!(self.wake_next_turn, WakeState::AfterWait);
        woke_ns
    }

    /// A stopping reactor's pause between polls for its last completions, until `until_ns`.
    #[cfg_attr(not(any(test, feature = "sim")), allow(unused_variables))]
    pub(super) fn wait_shutdown_poll(&mut self, until_ns: u64) {
        match &mut self.waiter {
            Waiter::Real => std::thread::sleep(super::SHUTDOWN_POLL),
            #[cfg(any(test, feature = "sim"))]
            Waiter::Virtual(v) => v.clock().advance_to(until_ns),
        }
    }

    /// The thread's CPU time, when it can be read.
    pub(super) fn thread_cpu_ns(&self) -> Option<u64> {
        match &self.waiter {
            Waiter::Real => self.me().stats.cpu_ns(),
            #[cfg(any(test, feature = "sim"))]
            Waiter::Virtual(v) => Some(v.cpu_ns()),
        }
    }

    /// Without the simulation the real waiter is the only one: the caller waits in epoll.
    #[cfg(not(any(test, feature = "sim")))]
    #[inline(always)]
    pub(super) fn block_virtually(&mut self, _for_io: bool, _until_ns: Option<u64>) -> Option<u64> {
        None
    }

    /// Blocks in virtual time for what `park` computed: `Some` with when it wakes, or
    /// `None` when the waiter is the real one (the caller waits in epoll).
    #[cfg(any(test, feature = "sim"))]
    pub(super) fn block_virtually(&mut self, for_io: bool, until_ns: Option<u64>) -> Option<u64> {
        let Waiter::Virtual(v) = &mut self.waiter else {
            return None;
        };
        let interrupt_ns = if for_io {
            self.devices
                .iter()
                .filter(|d| d.has_irq && d.qp.outstanding() > 0)
                .filter_map(|d| emulated_deadline_ns(&*d.qp).flatten())
                .min()
        } else {
            None
        };
        Some(v.block(Block {
            now_ns: self.now_ns,
            until_ns,
            timer_ns: self.timer_fd_armed_ns,
            interrupt_ns,
            for_io,
        }))
    }
}
