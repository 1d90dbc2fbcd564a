//! The idle decision: how long a reactor with nothing outstanding spins for its front ends'
//! next request before it parks. `adaptive` learns the gaps between request batches and
//! weighs spinning against what a park costs on this machine, as it measured it.
//!
//! A park costs the thread a sleep/wake cycle of CPU (`Calibration::sleep_cpu_ns`) and the
//! next request a wake-up of latency (the interrupt's price, or the median overshoot until
//! it is priced); spinning costs the CPU it spins, and no latency. Spinning for `s` then
//! parking costs, for a next request `g` after the last: `g - e` if it comes within the spin
//! (`e` is the time already gone since the last), `s + park` if not. The policy spins for the
//! `s` whose expected cost over the learnt gaps longer than `e` is least: 0 (park at once)
//! when no gap is likely short enough, else up to the gap it expects. This is the ski-rental
//! problem with a learnt distribution in place of the worst case: a client that sends every
//! few microseconds is spun for, one idle for seconds is parked on at once.
//!
//! A gap the reactor did not watch all through (it waited, and found the batch on waking)
//! is learnt one wake-up shorter than seen: the front end's signal ended the wait about that
//! long after the request came. Learnt as seen, a client parked on would look a wake-up
//! slower than it is, and the policy would go on parking on it.

use super::reservoir::Reservoir;
use super::ADAPTIVE_SAMPLES_MIN;
use crate::arrivals::{Arrival, IdleContext};

/// Gaps between request batches kept (the most recent).
pub(super) const ARRIVAL_SAMPLES: usize = 64;
/// The sorted view of the gaps is rebuilt every this many batches.
const ARRIVAL_REFRESH_EVERY: u32 = 16;

/// The learnt gaps between request batches.
#[derive(Clone)]
pub(super) struct Arrivals {
    gaps: Reservoir<ARRIVAL_SAMPLES>,
}

impl Arrivals {
    pub(super) fn new() -> Arrivals {
        Arrivals {
            gaps: Reservoir::empty(ARRIVAL_REFRESH_EVERY),
        }
    }

    /// Learns the gap before `arrival`; `wake_ns` is what a wake-up from a park delays the
    /// sight of a request by.
    pub(super) fn learn(&mut self, arrival: &Arrival, wake_ns: u64) {
        let Some(seen_ns) = arrival.gap_ns() else {
            return;
        };
        let gap_ns = match (arrival.previous_ns, arrival.waited_from_ns) {
            (Some(previous_ns), Some(waited_from_ns)) => {
                // It came after the wait began (the reactor polled until then) and about a
                // wake-up before it was seen.
                let polled_ns = waited_from_ns.saturating_sub(previous_ns).min(seen_ns);
                seen_ns.saturating_sub(wake_ns).max(polled_ns)
            }
            _ => seen_ns,
        };
        debug_assert!(gap_ns <= seen_ns);
        self.gaps.add(gap_ns);
    }

    /// Gaps learnt so far.
    pub(super) fn learnt(&self) -> u64 {
        self.gaps.added()
    }

    /// How long to spin for the next request, from `ctx.now_ns`, when a park costs
    /// `park_ns` (see the module's note); `None` until enough gaps are learnt.
    pub(super) fn spin_ns(&self, ctx: &IdleContext, park_ns: u64) -> Option<u64> {
        let gaps = self.gaps.samples();
        if gaps.len() < ADAPTIVE_SAMPLES_MIN {
            return None;
        }
        let gone_ns = ctx.since_last_ns();
        // The gaps still possible: longer than the time already gone.
        let later = &gaps[gaps.partition_point(|&g| g <= gone_ns)..];
        let n = later.len() as u64;
        // Spinning for 0: every one of them pays the park (costs summed over the gaps, not
        // averaged: the comparison is the same).
        let mut best_cost = n.saturating_mul(park_ns);
        let mut best_spin_ns = 0;
        let mut spun_ns = 0u64;
        for (k, &gap_ns) in later.iter().enumerate() {
            // Spin until this gap: it and the shorter ones are caught, each after its own
            // spin; the longer ones pay the whole spin and the park.
            let spin_ns = gap_ns - gone_ns;
            spun_ns = spun_ns.saturating_add(spin_ns);
            let missed = n - k as u64 - 1;
            let cost =
                spun_ns.saturating_add(missed.saturating_mul(spin_ns.saturating_add(park_ns)));
            if cost < best_cost {
                best_cost = cost;
                best_spin_ns = spin_ns;
            }
        }
        // Never more than the longest gap still possible, and nothing when none is.
        debug_assert!(later.last().is_none_or(|&g| best_spin_ns <= g - gone_ns));
        debug_assert!(!later.is_empty() || best_spin_ns == 0);
        Some(best_spin_ns)
    }
}

#[cfg(test)]
mod tests;
