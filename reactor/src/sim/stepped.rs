//! One reactor on a virtual clock and a virtual waiter, driven through the step API as an
//! embedder drives a standalone reactor: a test of how a reactor waits (its policy's
//! sleeps and interrupt waits, parking, timers, its CPU) that runs in virtual time, the same
//! on a busy machine as on a quiet one, instead of measuring the real clock and CPU.
//!
//! Time moves only here: a turn costs the reactor `turn_ns` of virtual time and CPU (a spin
//! is a turn), and a wait moves the clock to when it ends, costing only what the virtual
//! waiter charges. Emulated devices on the same clock complete at their virtual deadlines
//! (with an interrupt line when [`WaitCosts::interrupts`]).

use hypoll_nvme::VirtualClock;

use super::waiter::{VirtualWaiter, WaitCosts, WaitsSeen};
use crate::reactor::{Reactor, ReactorHandle, SendError, StandaloneConfig};
use crate::set::ReactorStartError;
use crate::stats::ReactorStats;

/// A reactor driven turn by turn in virtual time (see the module's note).
pub struct SimReactor<S = ()> {
    reactor: Reactor<S>,
    handle: ReactorHandle<S>,
    clock: VirtualClock,
    turn_ns: u64,
    turns: u64,
    start_ns: u64,
}

impl<S> SimReactor<S> {
    /// A standalone reactor ([`Reactor::standalone`]) on `clock`, waiting through a virtual
    /// waiter with the machine's `costs` (`seed` draws each timed wake-up's overshoot).
    /// Attach devices on the same clock after this.
    pub fn new(
        cfg: StandaloneConfig,
        clock: &VirtualClock,
        costs: WaitCosts,
        seed: u64,
        turn_ns: u64,
    ) -> Result<SimReactor<S>, ReactorStartError> {
        let (mut reactor, handle) = Reactor::standalone(cfg)?;
        reactor.simulate(VirtualWaiter::new(clock.clone(), costs, seed));
        Ok(SimReactor {
            reactor,
            handle,
            clock: clock.clone(),
            turn_ns: turn_ns.max(1),
            turns: 0,
            start_ns: clock.now_ns(),
        })
    }

    pub fn reactor(&mut self) -> &mut Reactor<S> {
        &mut self.reactor
    }

    pub fn handle(&self) -> &ReactorHandle<S> {
        &self.handle
    }

    pub fn clock(&self) -> &VirtualClock {
        &self.clock
    }

    /// Sends `f` as another thread would: through the handle, then the wake-up the mailbox's
    /// eventfd gives a blocked reactor (a timed sleep runs its course).
    pub fn send(
        &mut self,
        f: impl FnOnce(&mut Reactor<S>, &mut S) + Send + 'static,
    ) -> Result<(), SendError> {
        self.handle.send(f)?;
        self.reactor.sim_deliver();
        Ok(())
    }

    /// A poller's wake fd became readable (a guest's kick on a virtqueue, a socket's data),
    /// as the poller's source would make it: a blocked reactor (parked, or waiting on the
    /// interrupts) wakes an interrupt's latency later, as for a message; a timed sleep runs
    /// its course. Only a poller whose signal is on (see `Poller::before_block`) would
    /// signal: the caller decides that.
    pub fn signal(&mut self) {
        self.reactor.sim_deliver();
    }

    /// One step: a reactor in a wait sleeps on to its end (no later than `limit_ns`); an
    /// awake one takes a turn and, if it found nothing, its idle step.
    fn step(&mut self, state: &mut S, limit_ns: u64) {
        let now_ns = self.clock.now_ns();
        if let Some(w) = self.reactor.virtual_waiter().and_then(|v| v.last_wait()) {
            if now_ns < w.woke_ns {
                self.clock.advance_to(w.woke_ns.min(limit_ns));
                return;
            }
        }
        self.turns += 1;
        if self.reactor.poll(state) == 0 {
            self.reactor.idle();
        }
        self.clock.advance_by(self.turn_ns);
    }

    /// Runs while `go_on` holds, for at most `for_ns` of virtual time. Returns whether
    /// `go_on` stopped it (false: the time ran out).
    pub fn run_while(
        &mut self,
        state: &mut S,
        for_ns: u64,
        mut go_on: impl FnMut(&mut Reactor<S>, &mut S) -> bool,
    ) -> bool {
        let end_ns = self.clock.now_ns().saturating_add(for_ns);
        while go_on(&mut self.reactor, state) {
            if self.clock.now_ns() >= end_ns {
                return false;
            }
            self.step(state, end_ns);
        }
        true
    }

    /// Runs for `for_ns` of virtual time.
    pub fn run_for(&mut self, state: &mut S, for_ns: u64) {
        self.run_while(state, for_ns, |_, _| true);
    }

    /// The reactor's CPU in virtual time: its turns and what its waits cost.
    pub fn cpu_ns(&self) -> u64 {
        let waits_ns = self.waiter().cpu_ns();
        self.turns * self.turn_ns + waits_ns
    }

    /// What the virtual waiter carried out.
    pub fn waits(&self) -> WaitsSeen {
        self.waiter().seen()
    }

    /// The reactor's statistics in virtual time: its counters, the virtual time since it
    /// was built as wall time, [`SimReactor::cpu_ns`] as CPU.
    pub fn stats(&self) -> ReactorStats {
        ReactorStats {
            core: self.reactor.core(),
            counters: *self.reactor.counters(),
            wall_ns: self.clock.now_ns() - self.start_ns,
            cpu_ns: self.cpu_ns(),
            outstanding: self.reactor.outstanding() as u64,
        }
    }

    fn waiter(&self) -> &VirtualWaiter {
        self.reactor
            .virtual_waiter()
            .expect("a simulated reactor has a virtual waiter")
    }
}
