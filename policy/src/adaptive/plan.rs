//! The sleep plan of `adaptive` for one I/O: under load the interrupt or a batch, sleeping
//! through part of the device's queueing time, as the trial found; otherwise a sleep to the latest wake-up whose expected
//! lateness, over the learnt latencies and the overshoot's spread together, stays within
//! the budget (the plans cached per bucket, sleep kind and load class).

use super::batch_trial::{Budgets, LoadWait};
use super::reservoir::Reservoir;
use super::{Adaptive, ADAPTIVE_RESERVOIR};
use crate::policy::{Decision, PollContext};
use crate::stats::Bucket;

/// Load classes with their own plan: 1, 2-3, 4-7, 8-15, 16+ I/Os outstanding.
const PLAN_CLASSES: usize = 5;
/// When even the fastest latency seen is too late a wake-up, the plan searches below it to
/// this fraction of it.
const WAKE_BELOW_FASTEST_STEPS: u64 = 64;

/// The wake-up times planned for one bucket, per sleep kind (timed, interruptible) and load
/// class, valid for one version of what they were computed from.
#[derive(Clone)]
pub(super) struct PlanCache {
    wake_ns: [[Option<u64>; PLAN_CLASSES]; 2],
    /// (overshoot, interrupt price and budget scale; the bucket's latencies) refreshes.
    version: (u64, u64),
}

impl PlanCache {
    pub(super) const EMPTY: PlanCache = PlanCache {
        wake_ns: [[None; PLAN_CLASSES]; 2],
        version: (u64::MAX, u64::MAX),
    };

    /// The plan cached for `kind` and `class`, if it was made from `version`; a cache of an
    /// older version is emptied.
    fn lookup(&mut self, version: (u64, u64), kind: usize, class: usize) -> Option<u64> {
        if self.version != version {
            self.version = version;
            self.wake_ns = [[None; PLAN_CLASSES]; 2];
        }
        self.wake_ns[kind][class]
    }

    fn store(&mut self, kind: usize, class: usize, wake_ns: u64) {
        debug_assert!(self.wake_ns[kind][class].is_none(), "a plan made twice");
        self.wake_ns[kind][class] = Some(wake_ns);
    }
}

/// The latest wake-up time `w`, from submission, whose expected lateness over the
/// `latencies` and the overshoots `ovs` (around their median `median_ov`) stays within
/// `budget_ns`, each I/O late by at most `cap_ns` if there is a cap. 0 without samples.
fn wake_within_lateness(
    latencies: &Reservoir<ADAPTIVE_RESERVOIR>,
    ovs: &[u64],
    median_ov: i64,
    budget_ns: u64,
    cap_ns: Option<u64>,
) -> u64 {
    let xs = latencies.samples();
    let n = xs.len() as u64;
    let m = ovs.len().max(1) as u64;
    // E_T[min(cap, (v - T)+)] when waking at v: each sample at or below v - cap is late
    // by the cap, each in (v - cap, v] by v - T.
    let late_at = |v: u64| -> u64 {
        let j = xs.partition_point(|&x| x <= v);
        let k = match cap_ns {
            Some(cap) if v >= cap => xs.partition_point(|&x| x <= v - cap),
            _ => 0,
        };
        let capped = k as u64 * cap_ns.unwrap_or(0);
        let within =
            ((j - k) as u64 * v).saturating_sub(latencies.sum_below(j) - latencies.sum_below(k));
        (capped + within) / n
    };
    // Mean over overshoot samples of the lateness of waking at w + ov - median_ov.
    let lateness = |w: u64| -> u64 {
        if ovs.is_empty() {
            return late_at(w);
        }
        let total: u64 = ovs
            .iter()
            .map(|&ov| late_at((w as i64 + ov as i64 - median_ov).max(0) as u64))
            .sum();
        total / m
    };
    // Lateness grows with w: binary search the last sample value within budget.
    if xs.is_empty() {
        return 0;
    }
    let wake_ns = if lateness(xs[0]) > budget_ns {
        // Even waking at the fastest latency seen is too late on average: the
        // overshoot's spread carries the late wake-ups past it. An earlier wake-up can
        // still save CPU where the device has a floor well above zero (a device whose
        // reads never complete quickly; a slowly drifting device): the latest one
        // within budget, to 1/64 of that fastest latency (at most 6 more steps).
        let (mut lo, mut hi) = (0u64, xs[0]);
        let step_ns = (xs[0] / WAKE_BELOW_FASTEST_STEPS).max(1);
        while hi - lo > step_ns {
            let mid = lo + (hi - lo) / 2;
            if lateness(mid) <= budget_ns {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    } else {
        let (mut lo, mut hi) = (0usize, xs.len() - 1);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if lateness(xs[mid]) <= budget_ns {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        xs[lo]
    };
    // Never past the slowest latency seen, and within the budget unless no wake-up at all
    // is (then the earliest searched, the submission).
    debug_assert!(wake_ns <= xs[xs.len() - 1]);
    debug_assert!(wake_ns == 0 || lateness(wake_ns) <= budget_ns);
    wake_ns
}

impl Adaptive {
    /// The wake-up time, from submission, whose expected lateness stays within the budget,
    /// for a bucket with `outstanding` I/Os in flight (the budget is shared among them, any
    /// of which may complete next). Lateness counts the device's spread and the overshoot's
    /// spread around its median together: the actual wake-up is the plan plus (overshoot -
    /// median overshoot). For an `interruptible` sleep a completion before the wake-up is
    /// seen one interrupt wake-up after it, so no I/O is later than that: the lateness of
    /// each is capped at [`Adaptive::interrupt_cost_ns`]. Computed from the samples once
    /// per refresh, cached per sleep kind and load class.
    pub(super) fn planned_wake_ns(
        &mut self,
        bucket: usize,
        outstanding: usize,
        interruptible: bool,
    ) -> u64 {
        let class = (outstanding.max(1).ilog2() as usize).min(PLAN_CLASSES - 1);
        let kind = usize::from(interruptible);
        let version = self.calibration.overshoot_refreshes()
            + self.irq.refreshes()
            + self.lateness.budget_scale_changes;
        // The most an I/O can be late by: unbounded for a timed sleep.
        let cap_ns = interruptible.then(|| self.interrupt_wake_ns().max(1));
        let dist = &mut self.buckets[bucket];
        let latency_version = dist.latencies.refreshes();
        if let Some(wake_ns) = dist.plans.lookup((version, latency_version), kind, class) {
            return wake_ns;
        }
        let shares = 1u64 << class;
        let budget_ns = (dist.mean_ns() as f64 * self.budget_pct * self.lateness.budget_scale
            / 100.0) as u64
            / shares;
        let median_ov = self.calibration.median_overshoot_ns() as i64;
        let ovs = self.calibration.overshoots_planned();
        let wake_ns = wake_within_lateness(&dist.latencies, ovs, median_ov, budget_ns, cap_ns);
        dist.plans.store(kind, class, wake_ns);
        wake_ns
    }

    /// The device's queueing time: the mean of every completion in `bucket`, as the reactor
    /// publishes it, less the service-time floor.
    fn queueing_ns(&self, ctx: &PollContext<'_>, bucket: Bucket) -> u64 {
        // Little's law pins that mean at a fixed queue depth (depth / throughput), however
        // long the reactor sleeps, as long as the device keeps busy. The learnt distribution
        // cannot be used here: under load it holds the completions seen while polling and
        // the stand-ins, in a mix the sleeps themselves set, and its median can fall far
        // below the true latency; the batching sleeps then stop paying and the reactor
        // spins (see docs/lab/ for the campaign that showed it).
        ctx.stats
            .bucket(bucket)
            .mean_ns
            .saturating_sub(self.buckets[bucket.index()].floor_ns)
    }

    /// Step 2 of the module documentation: how the reactor waits under load, if the device
    /// looks saturated and the trial has a way other than the per-I/O plan (a device
    /// merely wide looks the same, hence the trial). Asked on every decision at depth, so
    /// that a wait on the interrupt is renewed after each wake-up, as `interrupt` does.
    pub(super) fn load_wait(&mut self, ctx: &PollContext<'_>, bucket: Bucket) -> Option<LoadWait> {
        let floor_ns = self.buckets[bucket.index()].floor_ns;
        if ctx.outstanding < 2 || self.queueing_ns(ctx, bucket) <= floor_ns {
            return None;
        }
        let published_mean_ns = ctx.stats.bucket(bucket).mean_ns;
        let budgets = Budgets {
            batch_fraction: self.budget_pct / 100.0,
            interrupt_fraction: self.load_budget_pct / 100.0,
        };
        self.batch_trial.set_depth(ctx.outstanding);
        self.batch_trial
            .load_wait(ctx.now_ns, published_mean_ns, budgets, ctx.interrupts)
    }

    /// Steps 2 and 3 of the module documentation for the current I/O, `elapsed_ns` in
    /// flight in `bucket`, once the overshoot is calibrated: the batch `load` asks for, else
    /// the budgeted sleep, if it pays (and, for a lone I/O, if the lateness check lets it
    /// sleep); otherwise spin.
    pub(super) fn plan_sleep(
        &mut self,
        ctx: &PollContext<'_>,
        bucket: Bucket,
        elapsed_ns: u64,
        load: Option<LoadWait>,
    ) -> Decision {
        debug_assert!(self.calibration.calibrated());
        debug_assert!(self.current.settled);
        let median_ov_ns = self.calibration.median_overshoot_ns();
        let queueing_ns = self.queueing_ns(ctx, bucket);
        // A budgeted sleep is interruptible where the device can interrupt, once the
        // interrupt's price is known; a batching one never is: it means to sleep through
        // completions.
        let interruptible = self.interruptible && ctx.interrupts && self.irq.cost_ns().is_some();
        let batch_fraction = load.and_then(LoadWait::fraction);
        let batching = batch_fraction.is_some();
        let (sleep_ns, bound_ns, interruptible) = if let Some(fraction) = batch_fraction {
            // Saturated: queued commands keep the device busy while we sleep. A late
            // wake-up past the queue's end idles the device briefly, which costs far less
            // than polling every completion.
            let batch_ns = (queueing_ns as f64 * fraction) as u64;
            debug_assert!(batch_ns <= queueing_ns);
            (batch_ns.saturating_sub(median_ov_ns), batch_ns, false)
        } else {
            let wake_ns = self.planned_wake_ns(bucket.index(), ctx.outstanding, interruptible);
            (
                wake_ns.saturating_sub(elapsed_ns + median_ov_ns),
                wake_ns.saturating_sub(elapsed_ns),
                interruptible,
            )
        };
        let mut decision = self
            .calibration
            .paying_sleep(sleep_ns, interruptible)
            .unwrap_or(Decision::Spin);
        if !batching {
            self.probes.budget_sleeps = decision != Decision::Spin;
            // Only a share of the lone I/Os sleep while the lateness check asks for it: the
            // rest spin.
            if self.probes.budget_sleeps && ctx.outstanding == 1 && !self.lateness.admits_sleep() {
                decision = Decision::Spin;
            }
        }
        self.current.sleep_interruptible = matches!(decision, Decision::SleepInterruptible(_));
        // The sleep never outlasts its bound: the batch, or the planned wake-up; a batch is
        // never interruptible.
        debug_assert!(match decision {
            Decision::Sleep(d) => d.as_nanos() as u64 == sleep_ns && sleep_ns <= bound_ns,
            Decision::SleepInterruptible(d) => {
                !batching && d.as_nanos() as u64 == sleep_ns && sleep_ns <= bound_ns
            }
            _ => true,
        });
        decision
    }
}
