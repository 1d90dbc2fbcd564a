//! `adaptive`: hypoll's own policy. It decides from what it measures on the machine at hand,
//! with no tuning (docs/policies.md has the whole rationale):
//!
//! - **Wake-up overshoot**, from every sleep the reactor reports (requested versus actual),
//!   over the 64 most recent: its median is planned for, its spread (top 10 % left out as
//!   machine noise) counts against the latency budget. Short probe sleeps keep it measured
//!   even while sleeping does not pay.
//! - **What a sleep costs in CPU**, read from the OS by the reactor around a sample of
//!   sleeps. A sleep saves CPU only when the time it keeps the thread off the core exceeds
//!   that cost; where a sleep/wake cycle costs more CPU than a short sleep keeps the thread
//!   off the core, that sleep is a loss.
//! - **The device's latency distribution per bucket**, from completions seen by polling. A
//!   completion found on the first poll after a sleep is censored (it happened at an unknown
//!   time during the sleep): a latency measured exactly in that interval stands in for it,
//!   not the time the reactor noticed it, which is what makes hybrid's sleep "shelve"
//!   upwards. The exact ones come from I/Os nobody slept through: while sleeps pay, one I/O
//!   in 32 at queue depth 1 is spun through.
//! - **The lateness its sleeps really cause**, each censored completion against its
//!   stand-in, over windows of 512 I/Os: the budget the plan spends is scaled to meet it,
//!   and where even the smallest scale is too late (the overshoot's tail, which the plan
//!   leaves out, makes sleeps late however early they end), only a share of the I/Os sleep;
//!   where even the smallest share stays too late, none do for a while.
//! - **What its sleeps at queue depth 1 really cost**, by experiment (`sleep_trial`):
//!   windows of the lateness check that take the budgeted sleeps against windows that spin
//!   through them, in threes (sleep, spin, sleep while the sleeps look cheap; spin, sleep,
//!   spin once they look dear), for about a tenth of the time. Where a sleep slows
//!   the I/O itself (a halted vCPU takes the completion late), the lateness check counts
//!   nothing; the trial sees it, and lets only as many windows sleep as the budget pays
//!   for, the trial's own included.
//! - **What an interrupt wake-up costs in latency** (`sleep=interruptible` only), by
//!   experiment: while its sleeps pay, one I/O in 64 at queue depth 1 is a probe, alternately
//!   spun through or waited for on the interrupt; the price is the difference of the two
//!   arms' median latencies.
//!
//! For the oldest outstanding I/O, which has been in flight for `e`, once per I/O:
//!
//! 1. **Interrupt** when the median remaining time is more than 33 median overshoots (asked
//!    again once the I/O outlives its bucket's p90), on a device that has one; without, the
//!    I/O goes on to step 3 and sleeps.
//! 2. **Load.** With several I/Os outstanding on a device whose mean latency is mostly
//!    queueing (the published mean minus the service-time floor exceeds the floor), wait
//!    on the interrupt, or sleep through three quarters of the queueing time: queued
//!    commands keep the device busy, completions arrive in batches. A device merely wide
//!    looks the same, so a trial (`batch_trial`) alternates each way with spinning and
//!    keeps the first that is not late past the budget: the interrupt (on a device that
//!    has one; the wait is renewed on every decision while it holds), then a batch of 3/4,
//!    3/8 or 3/16 of the queueing time; none if all are. The interrupt is judged against
//!    the wider load budget ([`ADAPTIVE_LOAD_BUDGET_PCT`]): the arm it is compared with
//!    mostly spins, at the price of a core.
//! 3. **Latency budget.** Otherwise wake at the latest time `w` whose expected lateness, over
//!    the learnt latencies and the overshoot's spread together, stays within 2.5 % of the
//!    bucket's mean (scaled by the lateness check, shared by the outstanding I/Os; alone,
//!    in the windows the sleep trial lets sleep), if that
//!    saves CPU. With
//!    `sleep=interruptible` (experimental: it overruns the budget, see docs/policies.md),
//!    once the interrupt is priced on a device that has one, the sleep is interruptible: a
//!    completion ends it one interrupt wake-up later, so no I/O is later than that price,
//!    and `w` moves later.
//! 4. Otherwise spin.
//!
//! With nothing outstanding, and front ends reporting requests, it decides how long the
//! reactor spins for the next request before parking (`arrivals`): from the learnt gaps
//! between requests and what a park costs (the sleep's CPU and a wake-up's latency), the
//! spin whose expected cost is least; until both are measured, what the reactor spins
//! without a policy.
//!
//! The parts, each owning its state: `reservoir` (the sample store), `distribution` (the
//! learnt latencies per bucket), `calibration` (overshoot and sleep cost), `probe` (probe
//! sleeps and spin probes), `interrupt_price`, `lateness` (the lateness check),
//! `sleep_trial` (the share of its windows that sleep), `plan`
//! (step 2's batch and step 3's budgeted sleep), `batch_trial` and `arrivals` (the idle
//! decision). This file holds the
//! policy, its configuration, the current I/O, and [`PollPolicy::decide`], which dispatches
//! to them.

mod arrivals;
mod batch_trial;
mod calibration;
mod distribution;
mod interrupt_price;
mod lateness;
mod plan;
mod probe;
mod reservoir;
mod sleep_trial;
#[cfg(test)]
mod tests;

use arrivals::Arrivals;
use batch_trial::{BatchTrial, LoadWait};
use calibration::Calibration;
use distribution::Buckets;
use interrupt_price::InterruptPrice;
use lateness::Lateness;
use probe::Probes;

use std::time::Duration;

use crate::arrivals::{Arrival, IdleContext};
use crate::policy::{Decision, Observation, PollContext, PollPolicy, Slept};
use crate::stats::Bucket;

/// Latencies kept per bucket (the most recent ones seen by polling, and stand-ins for
/// those a sleep censored).
pub const ADAPTIVE_RESERVOIR: usize = 256;
/// Samples a bucket needs before the policy sleeps for its I/Os.
pub const ADAPTIVE_SAMPLES_MIN: usize = 16;
/// Default latency budget, percent of the bucket's mean latency.
pub const ADAPTIVE_BUDGET_PCT: f64 = 2.5;
/// Default load budget, percent of the mean latency under load: how much later than the
/// per-I/O plan's arms waiting on the interrupt's arms may be, in most of a batch trial's
/// pairs, before the trial refuses it. The plan under load mostly spins, so what the
/// interrupt gives up is bought back with most of a core; where the plan sleeps itself, the
/// trial sees less of the loss than spinning would show.
pub const ADAPTIVE_LOAD_BUDGET_PCT: f64 = 10.0;
/// Wait for the interrupt when the median remaining time exceeds this many overshoots.
pub const ADAPTIVE_INTERRUPT_RATIO: u64 = 33;
/// Share of the device's queueing time slept through under load: the longest batch, which
/// the batch trial halves while it is late past the budget.
pub const ADAPTIVE_BATCH_FRACTION: f64 = 0.75;

/// hypoll's adaptive policy (see the module documentation).
#[derive(Clone)]
pub struct Adaptive {
    name: String,
    budget_pct: f64,
    /// The load budget (see [`ADAPTIVE_LOAD_BUDGET_PCT`]).
    load_budget_pct: f64,
    /// Whether its budgeted sleeps may be ended by the completion's interrupt (on devices
    /// that have one): [`Decision::SleepInterruptible`] rather than [`Decision::Sleep`].
    interruptible: bool,
    /// The oldest outstanding I/O decided for last.
    current: CurrentIo,
    /// What it learnt of the device, per bucket.
    buckets: Buckets,
    /// What a sleep costs on this machine.
    calibration: Calibration,
    /// The probe sleeps and spin probes that keep the measurements true.
    probes: Probes,
    /// What an interrupt wake-up costs in latency.
    irq: InterruptPrice,
    /// The lateness its sleeps really cause, and the scale and share that answer it.
    lateness: Lateness,
    /// Whether batching under load pays on this device, by experiment.
    batch_trial: BatchTrial,
    /// The gaps between its front ends' requests, for the idle decision.
    arrivals: Arrivals,
}

/// The oldest outstanding I/O decided for last, and where its decision stands.
#[derive(Clone)]
struct CurrentIo {
    /// Its submission time (`u64::MAX` before the first).
    submit_ns: u64,
    /// Whether it has had its one decision to sleep or spin, and its second look at the
    /// interrupt once it outlived most of its bucket.
    settled: bool,
    tail_checked: bool,
    /// Whether its decision was an interruptible sleep, which something other than its
    /// deadline may have ended (then the I/O has not slept, and it is decided afresh).
    sleep_interruptible: bool,
    /// Whether it was decided for at queue depth 1 (it counts in the lateness check).
    alone: bool,
    /// Distinct oldest I/Os decided for.
    ios_seen: u64,
}

impl CurrentIo {
    const NONE: CurrentIo = CurrentIo {
        submit_ns: u64::MAX,
        settled: false,
        tail_checked: false,
        sleep_interruptible: false,
        alone: false,
        ios_seen: 0,
    };

    fn assert_invariants(&self) {
        // The second look at the interrupt comes after the decision, never before.
        debug_assert!(!self.tail_checked || self.settled);
    }

    /// A new oldest I/O, submitted at `submit_ns`, with `outstanding` I/Os in flight.
    fn begin(&mut self, submit_ns: u64, outstanding: usize) {
        self.assert_invariants();
        let ios_seen = self.ios_seen;
        self.submit_ns = submit_ns;
        self.settled = false;
        self.tail_checked = false;
        self.ios_seen += 1;
        self.alone = outstanding == 1;
        self.assert_invariants();
        debug_assert_eq!(self.ios_seen, ios_seen + 1);
    }
}

impl std::fmt::Debug for Adaptive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adaptive")
            .field("budget_pct", &self.budget_pct)
            .field("load_budget_pct", &self.load_budget_pct)
            .field("overshoot_plan_ns", &self.overshoot_plan_ns())
            .field("sleep_cpu_ns", &self.sleep_cpu_ns())
            .field("budget_scale", &self.lateness.budget_scale)
            .field("sleep_share", &self.lateness.sleep_share)
            .field("sleep_trials", &self.lateness.trial.trials)
            .field("sleep_cost", &self.lateness.trial.cost)
            .field("sleep_window_share", &self.lateness.trial.share)
            .field("batch_trials", &self.batch_trial.trials)
            .field("batch_fraction", &self.batch_trial.held_fraction())
            .field("arrival_gaps", &self.arrivals.learnt())
            .finish()
    }
}

impl Adaptive {
    /// The policy's name, without parameters.
    pub const NAME: &'static str = "adaptive";

    /// An adaptive policy with a latency budget of `budget_pct` percent of the mean, whose
    /// sleeps are timed ones.
    pub fn new(budget_pct: f64) -> Adaptive {
        Adaptive::with(budget_pct, false)
    }

    /// An adaptive policy with a latency budget of `budget_pct` percent of the mean; with
    /// `interruptible`, its budgeted sleeps are ones a completion's interrupt can end early
    /// (experimental: it can overrun its budget, see docs/policies.md); otherwise timed ones
    /// that always last (the hybrid polling of Linux).
    pub fn with(budget_pct: f64, interruptible: bool) -> Adaptive {
        assert!(
            budget_pct > 0.0,
            "a latency budget must be above 0, not {budget_pct}"
        );
        Adaptive {
            name: Self::name_for(budget_pct, ADAPTIVE_LOAD_BUDGET_PCT, interruptible),
            budget_pct,
            load_budget_pct: ADAPTIVE_LOAD_BUDGET_PCT,
            interruptible,
            current: CurrentIo::NONE,
            buckets: Buckets::new(),
            calibration: Calibration::new(),
            probes: Probes::new(),
            irq: InterruptPrice::new(),
            lateness: Lateness::new(budget_pct),
            batch_trial: BatchTrial::default(),
            arrivals: Arrivals::new(),
        }
    }

    /// The same policy with a load budget of `load_budget_pct` percent of the mean latency
    /// under load (see [`ADAPTIVE_LOAD_BUDGET_PCT`]).
    pub fn with_load_budget(mut self, load_budget_pct: f64) -> Adaptive {
        assert!(
            load_budget_pct > 0.0,
            "a load budget must be above 0, not {load_budget_pct}"
        );
        self.load_budget_pct = load_budget_pct;
        self.name = Self::name_for(self.budget_pct, load_budget_pct, self.interruptible);
        self
    }

    /// The name with the parameters that differ from the defaults, in the registry's order.
    fn name_for(budget_pct: f64, load_budget_pct: f64, interruptible: bool) -> String {
        let mut params = Vec::new();
        if budget_pct != ADAPTIVE_BUDGET_PCT {
            params.push(format!("budget={budget_pct}"));
        }
        if load_budget_pct != ADAPTIVE_LOAD_BUDGET_PCT {
            params.push(format!("load_budget={load_budget_pct}"));
        }
        if interruptible {
            params.push("sleep=interruptible".to_string());
        }
        if params.is_empty() {
            Self::NAME.to_string()
        } else {
            format!("{}:{}", Self::NAME, params.join(","))
        }
    }

    /// The overshoot it plans for (the median of recent sleeps; the spread around it counts
    /// against the latency budget), once measured.
    pub fn overshoot_plan_ns(&self) -> Option<u64> {
        self.calibration.overshoot_plan_ns()
    }

    /// The CPU one sleep costs (median of recent measurements), once measured.
    pub fn sleep_cpu_ns(&self) -> Option<u64> {
        self.calibration.sleep_cpu_ns()
    }

    /// What waiting on the interrupt adds to an I/O's latency, once measured: the median
    /// latency of probe I/Os waited for on the interrupt less that of probe I/Os spun all
    /// the way (each an offset from its bucket's median).
    pub fn interrupt_cost_ns(&self) -> Option<u64> {
        self.irq.cost_ns()
    }

    /// The wake-up delay a completion seen after an interrupt wait is learnt without: the
    /// interrupt's price, the median overshoot until it is measured.
    fn interrupt_wake_ns(&self) -> u64 {
        self.irq
            .cost_ns()
            .unwrap_or_else(|| self.calibration.median_overshoot_ns())
    }

    /// What a park costs, once measured: the CPU of a sleep/wake cycle, and the wake-up it
    /// adds to the next request's latency.
    pub fn park_cost_ns(&self) -> Option<u64> {
        if !self.calibration.calibrated() {
            return None;
        }
        let cpu_ns = self.calibration.sleep_cpu_ns()?;
        Some(cpu_ns.saturating_add(self.interrupt_wake_ns()))
    }

    /// A new oldest I/O: it may be an interrupt probe or a spin probe.
    fn begin_io(&mut self, ctx: &PollContext<'_>, bucket: Bucket) {
        let submit_ns = ctx.oldest.submit_ns;
        self.current.begin(submit_ns, ctx.outstanding);
        let ios_seen = self.current.ios_seen;
        let irq_probe_eligible = self.interruptible
            && self.probes.budget_sleeps
            && ctx.interrupts
            && ctx.outstanding == 1
            && self.buckets[bucket.index()].planned_samples() >= ADAPTIVE_SAMPLES_MIN;
        self.irq.on_new_io(ios_seen, irq_probe_eligible, submit_ns);
        self.probes.on_new_io(ios_seen, ctx.outstanding, submit_ns);
    }

    /// Step 1: whether the current I/O, `elapsed_ns` in flight, blocks on the interrupt.
    /// Asked when the I/O is new, and once more if it outlives most of its bucket (a
    /// slow-path I/O): not on every poll.
    fn long_wait(&mut self, bucket: Bucket, elapsed_ns: u64) -> bool {
        let dist = &self.buckets[bucket.index()];
        let tail_check = self.current.settled
            && !self.current.tail_checked
            && dist
                .latencies
                .quantile(0.9)
                .is_some_and(|p90| elapsed_ns >= p90);
        if self.current.settled && !tail_check {
            return false;
        }
        self.current.tail_checked |= tail_check;
        let median_ov_ns = self.calibration.median_overshoot_ns();
        dist.median_remaining_exceeds(elapsed_ns, ADAPTIVE_INTERRUPT_RATIO * median_ov_ns.max(1))
    }

    /// The decision for the oldest outstanding I/O (see the module documentation).
    fn decide_for(&mut self, ctx: &PollContext<'_>) -> Decision {
        self.buckets.drift_floors(ctx.now_ns, ctx.outstanding);
        let Some(bucket) = ctx.oldest.bucket else {
            return Decision::Spin;
        };
        let submit_ns = ctx.oldest.submit_ns;
        if submit_ns != self.current.submit_ns {
            self.begin_io(ctx, bucket);
        }
        // An interruptible sleep ended before its deadline (by a message, a poller's fd or
        // another I/O's completion) leaves the I/O unslept: plan again for the time left.
        if std::mem::take(&mut self.current.sleep_interruptible) && !ctx.oldest.slept {
            self.current.settled = false;
        }
        if self.buckets[bucket.index()].planned_samples() < ADAPTIVE_SAMPLES_MIN {
            return Decision::Spin;
        }
        if let Some(probe) = self.irq.probe_decision(submit_ns) {
            return probe;
        }
        let elapsed_ns = ctx.now_ns.saturating_sub(submit_ns);
        let calibrated = self.calibration.calibrated();
        // Without an interrupt line a wait would be a spin: a long wait is planned as a
        // sleep instead (step 3).
        if calibrated && ctx.interrupts && self.long_wait(bucket, elapsed_ns) {
            return Decision::WaitInterrupt;
        }
        // Step 2: under load, the interrupt if the trial has it, on every decision (each
        // wake-up renews the wait), whatever the I/O's own decision was.
        let load = if calibrated {
            self.load_wait(ctx, bucket)
        } else {
            None
        };
        if load == Some(LoadWait::Interrupt) {
            self.current.settled = true;
            return Decision::WaitInterrupt;
        }
        // One sleep per I/O; once settled on spinning, it spins without recomputing. A spin
        // probe never sleeps (but may still wait on the interrupt for a slow-path I/O).
        if self.current.settled || self.probes.is_spin_probe(submit_ns) {
            self.current.settled = true;
            return Decision::Spin;
        }
        self.current.settled = true;
        if calibrated {
            let decision = self.plan_sleep(ctx, bucket, elapsed_ns, load);
            if decision != Decision::Spin {
                return decision;
            }
        }
        // Keep the overshoot and the cost of a sleep measured: a probe, now and then; but
        // none in a window that spins through its budgeted sleeps, the sleep trial's or
        // its share's. A burst's first sleeps are slow on a VM: the trial compares those
        // windows with sleeping ones and would count them as spinning's, and in the
        // share's they would cost outside the budget. A burst due waits for a lone I/O the
        // plan spins in a sleeping window (or a deeper queue); meanwhile the budgeted
        // sleeps keep the overshoot measured.
        if ctx.outstanding == 1 && !self.lateness.trial.window_sleeps() {
            return Decision::Spin;
        }
        self.probes
            .probe_sleep(
                ctx.now_ns,
                self.current.ios_seen,
                ctx.outstanding,
                elapsed_ns,
                &self.buckets[bucket.index()],
                &mut self.calibration,
            )
            .unwrap_or(Decision::Spin)
    }

    /// The latency a completion is learnt as: as seen when polled for; a stand-in when a
    /// sleep censored it; less one interrupt wake-up when it ended an interrupt wait; `None`
    /// when it completed while the reactor slept for another I/O (nothing to learn).
    fn learnt_latency_ns(&mut self, bucket: Bucket, seen: &Observation) -> Option<u64> {
        match (seen.censored, seen.slept) {
            (false, _) => Some(seen.latency_ns),
            // It completed at an unknown time while we slept for it, after the sleep began
            // (we had polled) and before we saw it: a learnt latency from that interval
            // stands in for it. Dropping such samples instead would keep only the I/Os
            // slower than our wake-up, and the learnt distribution would creep upwards.
            (true, Some(slept)) => Some(self.buckets.stand_in(
                bucket.index(),
                seen.latency_ns.saturating_sub(slept.actual_ns),
                seen.latency_ns,
            )),
            // It woke the reactor from an interrupt wait: it completed about one interrupt
            // wake-up before it was seen (the measured price; the median overshoot until
            // then). Dropping these would keep only the I/Os that outlived the wake-up, and
            // the plan would creep later.
            (true, None) if seen.after_interrupt => Some(
                seen.latency_ns
                    .saturating_sub(self.interrupt_wake_ns())
                    .max(1),
            ),
            (true, None) => None,
        }
    }
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive::new(ADAPTIVE_BUDGET_PCT)
    }
}

impl PollPolicy for Adaptive {
    fn name(&self) -> &str {
        &self.name
    }

    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
        self.current.assert_invariants();
        let decision = self.decide_for(ctx);
        self.current.assert_invariants();
        // A sleep is the I/O's one decision; an interruptible one is remembered, to decide
        // afresh if something else ends it.
        debug_assert!(
            !matches!(
                decision,
                Decision::Sleep(_) | Decision::SleepInterruptible(_)
            ) || self.current.settled
        );
        debug_assert!(
            !matches!(decision, Decision::SleepInterruptible(_))
                || self.current.sleep_interruptible
        );
        decision
    }

    fn on_completion(&mut self, seen: &Observation) {
        let Some(bucket) = seen.bucket else {
            return;
        };
        // As seen, lateness included: what batching is judged by.
        self.batch_trial.record(seen.submit_ns, seen.latency_ns);
        let dist = &self.buckets[bucket.index()];
        let irq_probe = self.irq.record(seen.submit_ns, seen.latency_ns, dist);
        let Some(latency_ns) = self.learnt_latency_ns(bucket, seen) else {
            return;
        };
        let drawn = seen.censored && seen.slept.is_some();
        // A spin probe is not counted in the lateness check (nor is an interrupt probe):
        // neither is an I/O the plan decided for.
        if !self.probes.spin_probe_completed(seen.submit_ns)
            && seen.submit_ns == self.current.submit_ns
            && self.current.alone
            && !irq_probe
        {
            let mean_ns = self.buckets[bucket.index()].mean_ns().max(1);
            self.lateness.observe(seen, latency_ns, drawn, mean_ns);
        }
        let polled = !seen.censored && seen.slept.is_none();
        self.buckets[bucket.index()].learn(latency_ns, polled, drawn);
    }

    fn on_sleep(&mut self, slept: &Slept, cpu_ns: Option<u64>) {
        self.calibration.learn(slept, cpu_ns);
    }

    fn on_arrivals(&mut self, arrival: &Arrival) {
        let wake_ns = self.interrupt_wake_ns();
        self.arrivals.learn(arrival, wake_ns);
    }

    fn decide_idle(&mut self, ctx: &IdleContext) -> Duration {
        // Until the gaps and a park's cost are measured, what the reactor spins without a
        // policy.
        let spin_ns = self
            .park_cost_ns()
            .and_then(|park_ns| self.arrivals.spin_ns(ctx, park_ns))
            .unwrap_or(ctx.idle_spin_ns);
        Duration::from_nanos(spin_ns)
    }
}
