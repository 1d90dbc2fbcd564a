//! What a sleep costs on this machine, as `adaptive` measures it from the sleeps the reactor
//! reports: how late a sleep wakes (its overshoot) and how much CPU a sleep/wake cycle
//! spends; and from those, whether a sleep of a given length pays.

use super::probe::PROBE_WARMUP;
use super::reservoir::Reservoir;
use crate::policy::{Decision, Slept};

/// Sleeps shorter than this are not attempted (except probes).
const SLEEP_NS_MIN: u64 = 1_000;
/// A sleep must save at least this much CPU over spinning.
const SAVING_NS_MIN: u64 = 1_000;
/// Recent sleeps whose overshoot, and whose CPU cost, the plan is made from.
const OVERSHOOT_SAMPLES: usize = 64;
const SLEEP_CPU_SAMPLES: usize = 32;
/// The overshoot and sleep-cost views are rebuilt every this many sleeps.
pub(super) const SLEEP_REFRESH_EVERY: u32 = 16;
/// Sleeps measured before the plan trusts the overshoot.
const PROBES_FIRST: u64 = 16;
/// Overshoot samples above the 1 - 1/10 quantile are left out of the plan.
const OVERSHOOT_TRIM_DIVISOR: usize = 10;

/// The overshoot and CPU cost of recent sleeps, and which sleeps are learnt.
#[derive(Clone)]
pub(super) struct Calibration {
    overshoot: Reservoir<OVERSHOOT_SAMPLES>,
    sleep_cpu: Reservoir<SLEEP_CPU_SAMPLES>,
    /// Sleeps still to come before the current burst's overshoots are learnt (see
    /// [`PROBE_WARMUP`]).
    warmup_left: u32,
    /// Whether the next sleep learnt starts a probe burst afresh: its overshoot replaces the
    /// ones kept (see [`Calibration::learn`]).
    restart: bool,
}

impl Calibration {
    /// Nothing measured yet. The reactor spins until its bucket has samples, so the first
    /// probe burst warms up too.
    pub(super) fn new() -> Calibration {
        Calibration {
            overshoot: Reservoir::empty(SLEEP_REFRESH_EVERY),
            sleep_cpu: Reservoir::empty(SLEEP_REFRESH_EVERY),
            warmup_left: PROBE_WARMUP,
            restart: false,
        }
    }

    fn assert_invariants(&self) {
        debug_assert!(self.warmup_left <= PROBE_WARMUP);
        // Once a sleep is learnt the plan always has an overshoot to go by: a restart clears
        // the overshoots only to learn the next one at once.
        debug_assert!(self.overshoot.added() == 0 || self.overshoot.sorted_len() > 0);
        debug_assert!(self.sleep_cpu.added() == 0 || self.sleep_cpu.sorted_len() > 0);
    }

    /// A probe burst begins: its first [`PROBE_WARMUP`] sleeps are not learnt, and the first
    /// one learnt after them replaces the overshoots kept.
    pub(super) fn begin_burst(&mut self) {
        self.assert_invariants();
        self.warmup_left = PROBE_WARMUP;
        self.restart = true;
        self.assert_invariants();
    }

    /// Learns one sleep the reactor reports (and the CPU it cost, when it measured it).
    pub(super) fn learn(&mut self, slept: &Slept, cpu_ns: Option<u64>) {
        self.assert_invariants();
        // The first sleeps of a burst measure the VM adapting to a vCPU that halts again
        // (see [`PROBE_WARMUP`]), whatever decided them: not learnt.
        if self.warmup_left > 0 {
            self.warmup_left -= 1;
            self.assert_invariants();
            return;
        }
        // The first sleep of a probe burst learnt: the policy had stopped sleeping, and the
        // overshoots it kept are those that made it stop. Kept, they would keep it spinning:
        // a burst of 16 cannot outvote 64 of them, and after a long spin the host may wake a
        // vCPU late again, a reactor then staying stuck on overshoots it no longer has (see
        // docs/lab/ for the campaign). So the burst measures afresh.
        let added = self.overshoot.added();
        if std::mem::take(&mut self.restart) {
            self.overshoot.clear();
        }
        self.overshoot.add(slept.overshoot_ns());
        if let Some(cpu_ns) = cpu_ns {
            self.sleep_cpu.add(cpu_ns);
        }
        self.assert_invariants();
        debug_assert!(!self.restart);
        debug_assert_eq!(self.overshoot.added(), added + 1);
        debug_assert!(self.overshoot.sorted_len() >= 1);
    }

    /// Whether enough sleeps were measured for the plan to trust the overshoot.
    pub(super) fn calibrated(&self) -> bool {
        self.overshoot.added() >= PROBES_FIRST
    }

    /// The overshoot planned for: the median of recent sleeps, once measured.
    pub(super) fn overshoot_plan_ns(&self) -> Option<u64> {
        let median_ns = self.overshoot.quantile(0.5);
        // Within the range it was fitted on.
        debug_assert!(median_ns.is_none_or(|m| {
            let xs = self.overshoot.samples();
            xs[0] <= m && m <= xs[xs.len() - 1]
        }));
        median_ns
    }

    /// The overshoot planned for, 0 before any is measured.
    pub(super) fn median_overshoot_ns(&self) -> u64 {
        self.overshoot_plan_ns().unwrap_or(0)
    }

    /// The overshoots whose spread around the median the plan counts against its budget,
    /// ascending. The top 10 % are left out: a vCPU descheduled for a millisecond delays a
    /// spinning reactor just as much, so it is the machine's noise, not a cost of sleeping;
    /// one such outlier in 64 would otherwise forbid every sleep.
    pub(super) fn overshoots_planned(&self) -> &[u64] {
        let all = self.overshoot.samples();
        let planned = &all[..all.len() - all.len() / OVERSHOOT_TRIM_DIVISOR];
        debug_assert!(planned.len() <= all.len() && (all.is_empty() || !planned.is_empty()));
        planned
    }

    /// Times the overshoot's sorted view was rebuilt: plans made from it are stale after.
    pub(super) fn overshoot_refreshes(&self) -> u64 {
        self.overshoot.refreshes()
    }

    /// The CPU one sleep costs (median of recent measurements), once measured.
    pub(super) fn sleep_cpu_ns(&self) -> Option<u64> {
        self.sleep_cpu.quantile(0.5)
    }

    /// A sleep of `sleep_ns`, if it is long enough and saves CPU: the time it keeps the
    /// thread off the core (the sleep and its overshoot) must exceed what a sleep costs.
    pub(super) fn paying_sleep(&self, sleep_ns: u64, interruptible: bool) -> Option<Decision> {
        let cpu_ns = self.sleep_cpu_ns()?;
        let off_core_ns = sleep_ns + self.overshoot.quantile(0.5).unwrap_or(0);
        let paying =
            (sleep_ns >= SLEEP_NS_MIN && off_core_ns >= cpu_ns + SAVING_NS_MIN).then(|| {
                if interruptible {
                    Decision::sleep_interruptible_ns(sleep_ns)
                } else {
                    Decision::sleep_ns(sleep_ns)
                }
            });
        debug_assert!(paying.is_none() || off_core_ns >= cpu_ns + SAVING_NS_MIN);
        debug_assert!(paying.is_none() || sleep_ns >= SLEEP_NS_MIN);
        paying
    }
}
