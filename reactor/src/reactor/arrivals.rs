//! Requests arriving from front ends: what a front end's poller reports
//! ([`Reactor::note_arrivals`]), what the reactor keeps of it and tells its policy, and the
//! idle decision it asks for from that: how long to spin for the next request before it
//! parks, when nothing is outstanding.

use hypoll_policy::{Arrival, ArrivalStats, IdleContext};

use super::Reactor;

/// The longest idle spin a policy's decision may ask for, unless the reactor's own tuning
/// (`ReactorTuning::idle_spin_ns`, the embedder's explicit choice) is longer. A policy
/// that wants to spin longer is cut here: spinning for a request that has not come in this
/// long costs far more than the one wake-up a park would, on any machine, and a policy
/// that got its arithmetic wrong must not keep a core busy with nothing to do.
pub const IDLE_SPIN_NS_MAX: u64 = 10_000_000;

impl<S> Reactor<S> {
    /// A front end took `requests` new requests (off a guest's avail ring, a socket): the
    /// reactor counts them, keeps when they came ([`Reactor::arrivals`]) and tells its
    /// policy ([`PollPolicy::on_arrivals`](hypoll_policy::PollPolicy::on_arrivals)), which
    /// then decides how long an idle reactor spins for the next request before it parks
    /// ([`PollPolicy::decide_idle`](hypoll_policy::PollPolicy::decide_idle)). Call it from a
    /// poller's `poll` (or anything else the reactor runs) once per batch taken, with the
    /// batch's size; 0 does nothing. A few integer operations and the policy's own: no
    /// allocation, no clock read (the batch is stamped with the turn's time,
    /// [`Reactor::now_ns`]).
    #[inline]
    pub fn note_arrivals(&mut self, requests: usize) {
        if requests == 0 {
            return;
        }
        let now_ns = self.now_ns;
        let previous_ns = self.arrivals.record(now_ns, requests as u64);
        self.counters.arrivals += requests as u64;
        // Found on the first turn after a wait that began after the previous batch: the
        // requests came at some time during the wait.
        let waited_from_ns = (self.wake_this_turn.after_wait()
            && previous_ns.is_some_and(|p| p <= self.slept_from_ns))
        .then_some(self.slept_from_ns);
        self.policy.on_arrivals(&Arrival {
            now_ns,
            requests: requests as u64,
            previous_ns,
            waited_from_ns,
        });
        debug_assert_eq!(self.arrivals.last_ns, now_ns);
    }

    /// What the reactor kept of the requests its front ends reported.
    pub fn arrivals(&self) -> &ArrivalStats {
        &self.arrivals
    }

    /// How long this idle stretch spins before it parks (asked at its first turn): the
    /// policy's decision once a front end has reported requests, the tuning's
    /// `idle_spin_ns` before (a reactor without front ends never asks).
    pub(super) fn decide_idle_spin_ns(&mut self) -> u64 {
        if !self.arrivals.seen() {
            return self.tuning.idle_spin_ns;
        }
        let ctx = IdleContext {
            now_ns: self.now_ns,
            arrivals: self.arrivals,
            idle_spin_ns: self.tuning.idle_spin_ns,
        };
        let spin = self.policy.decide_idle(&ctx);
        self.counters.idle_decisions += 1;
        let bound_ns = IDLE_SPIN_NS_MAX.max(self.tuning.idle_spin_ns);
        u64::try_from(spin.as_nanos()).map_or(bound_ns, |ns| ns.min(bound_ns))
    }
}
