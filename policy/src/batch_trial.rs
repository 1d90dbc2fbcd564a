//! The experiment that tells `adaptive` whether batching under load pays.
//!
//! Batching (sleeping through most of the queueing time with several I/Os outstanding)
//! assumes a saturated device, whose queued commands keep it busy while the reactor sleeps.
//! The latencies alone cannot tell such a device from one that is merely wide: a NAND
//! device with 64 units at queue depth 4-32 has a mean (88 us) more than twice its fastest
//! read, yet it never queues, and every completion left unreaped while the reactor sleeps
//! idles a unit (measured: batching made it 1.18-1.30 x classic's latency).
//!
//! So the reactor tries both. Arms of [`ARM_NS`] alternately batch and do not, in the order
//! batch, not, not, batch (a drift in the device's latency then weighs on both alike), for
//! [`PAIRS`] pairs. Each arm's mean latency, as seen (lateness included), counts the I/Os
//! submitted and completed within it, so that no arm is charged for its neighbour's
//! queue. At a fixed queue depth Little's law ties that mean to the throughput, so it is
//! the one figure to compare. Batching is refused only when it was later than the other arm
//! by more than the latency budget in at least [`WORSE_PAIRS`] of the pairs: a wide device
//! that does not queue loses 18-30 % to it, every pair, while on a noisy device (the virtio
//! disk: 10 ms means scatter by 10-20 %) where batching is harmless a refusal needs a run of
//! bad luck (under 4 % when each pair is a coin flip). The verdict holds for [`HOLD_NS`],
//! then the device is tried again (its load and its state change).

/// How long an arm lasts at least; it also waits for [`ARM_MIN_IOS`] completions.
pub(crate) const ARM_NS: u64 = 10_000_000;
/// How long an arm lasts at most: a slower device's pair is then left out of the count.
pub(crate) const ARM_MAX_NS: u64 = 100_000_000;
/// Completions an arm waits for, up to [`ARM_MAX_NS`].
pub(crate) const ARM_MIN_IOS: u64 = 16;
/// Pairs of arms per trial.
pub(crate) const PAIRS: u32 = 8;
/// Pairs in which batching must be late past the budget for it to be refused.
pub(crate) const WORSE_PAIRS: u32 = 7;
/// How long a verdict holds.
pub(crate) const HOLD_NS: u64 = 5_000_000_000;

/// One arm's completions: their latencies' sum and count.
#[derive(Clone, Copy, Debug, Default)]
struct ArmTotal {
    latency_sum_ns: u64,
    ios: u64,
}

impl ArmTotal {
    fn mean_ns(&self) -> Option<f64> {
        (self.ios >= ARM_MIN_IOS).then(|| self.latency_sum_ns as f64 / self.ios as f64)
    }
}

/// The trial's state; see the module's documentation.
#[derive(Clone, Debug, Default)]
pub(crate) struct BatchTrial {
    /// The arm in progress (0..2 * PAIRS), while a trial runs, and when it began.
    arm: Option<u32>,
    arm_start_ns: u64,
    current: ArmTotal,
    /// The pair's first arm, once over.
    first: ArmTotal,
    /// Pairs compared so far, and those in which batching was late past the budget.
    compared: u32,
    worse: u32,
    /// The last verdict (batching allowed) and when it was reached.
    verdict: Option<(bool, u64)>,
    /// When the policy last asked: a trial not asked about for [`ARM_MAX_NS`] (the load
    /// went) starts afresh.
    asked_ns: u64,
    /// Trials concluded.
    pub(crate) trials: u64,
}

/// Whether arm `arm` of a trial batches: batch, not, not, batch, repeated.
fn arm_batches(arm: u32) -> bool {
    matches!(arm % 4, 0 | 3)
}

impl BatchTrial {
    /// Whether a device that looks saturated is batched now, at `now_ns`: the verdict while
    /// it holds, otherwise the current arm of the trial (started, moved on or concluded
    /// here). `budget_fraction` is the latency budget, a fraction of the mean.
    pub(crate) fn allows(&mut self, now_ns: u64, budget_fraction: f64) -> bool {
        let stale = now_ns > self.asked_ns.saturating_add(ARM_MAX_NS);
        self.asked_ns = now_ns;
        if let Some((allowed, at_ns)) = self.verdict {
            if now_ns < at_ns.saturating_add(HOLD_NS) {
                return allowed;
            }
        }
        let arm = match self.arm {
            Some(arm) if !stale => arm,
            _ => return self.start(now_ns),
        };
        let elapsed_ns = now_ns.saturating_sub(self.arm_start_ns);
        let over =
            (elapsed_ns >= ARM_NS && self.current.ios >= ARM_MIN_IOS) || elapsed_ns >= ARM_MAX_NS;
        if !over {
            return arm_batches(arm);
        }
        if arm % 2 == 1 {
            let (batched, other) = if arm_batches(arm) {
                (self.current, self.first)
            } else {
                (self.first, self.current)
            };
            if let (Some(batched_ns), Some(other_ns)) = (batched.mean_ns(), other.mean_ns()) {
                self.compared += 1;
                self.worse += u32::from(batched_ns > other_ns * (1.0 + budget_fraction));
            }
        } else {
            self.first = self.current;
        }
        self.current = ArmTotal::default();
        self.arm_start_ns = now_ns;
        let next = arm + 1;
        if next < 2 * PAIRS {
            self.arm = Some(next);
            return arm_batches(next);
        }
        // Pairs an arm of which saw too few completions are not counted either way: with
        // too little evidence, batching stays, which is what the policy did before trials.
        let allowed = self.worse < WORSE_PAIRS;
        self.arm = None;
        self.verdict = Some((allowed, now_ns));
        self.trials += 1;
        allowed
    }

    /// A new trial from `now_ns`, in its first arm (which batches).
    fn start(&mut self, now_ns: u64) -> bool {
        self.arm = Some(0);
        self.arm_start_ns = now_ns;
        self.current = ArmTotal::default();
        self.compared = 0;
        self.worse = 0;
        arm_batches(0)
    }

    /// A completion seen `latency_ns` after its submission at `submit_ns`: it counts for the
    /// current arm if the arm saw it submitted.
    pub(crate) fn record(&mut self, submit_ns: u64, latency_ns: u64) {
        if self.arm.is_some() && submit_ns >= self.arm_start_ns {
            self.current.latency_sum_ns += latency_ns;
            self.current.ios += 1;
        }
    }

    /// Whether the last trial refused batching (none yet: no).
    pub(crate) fn refused(&self) -> bool {
        matches!(self.verdict, Some((false, _)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: f64 = 0.025;

    /// Runs one whole trial from `start_ns` on a device whose mean latency is `batched_ns`
    /// in the arms that batch and `other_ns` in the others, times `noise(arm)`; 100
    /// completions per arm. Returns the verdict and the order of the arms.
    fn run(
        trial: &mut BatchTrial,
        start_ns: u64,
        batched_ns: u64,
        other_ns: u64,
        noise: impl Fn(u32) -> f64,
    ) -> (bool, Vec<bool>) {
        let mut now_ns = start_ns;
        let mut arms = Vec::new();
        let mut batching = trial.allows(now_ns, BUDGET);
        for arm in 0..2 * PAIRS {
            arms.push(batching);
            let mean_ns = if batching { batched_ns } else { other_ns };
            let latency_ns = (mean_ns as f64 * noise(arm)) as u64;
            for i in 0..100 {
                let submit_ns = now_ns + i * (ARM_NS / 100);
                trial.record(submit_ns, latency_ns);
                assert_eq!(trial.allows(submit_ns + 1, BUDGET), batching);
            }
            now_ns += ARM_NS;
            batching = trial.allows(now_ns, BUDGET);
        }
        assert_eq!(trial.trials, 1, "the trial ends after {} arms", 2 * PAIRS);
        (batching, arms)
    }

    #[test]
    fn arms_alternate_batch_not_not_batch() {
        let mut trial = BatchTrial::default();
        let (_, arms) = run(&mut trial, 1_000, 50_000, 50_000, |_| 1.0);
        let expected: Vec<bool> = (0..2 * PAIRS).map(|a| matches!(a % 4, 0 | 3)).collect();
        assert_eq!(arms, expected);
    }

    #[test]
    fn batching_that_makes_every_pair_late_is_refused_and_the_verdict_holds() {
        let mut trial = BatchTrial::default();
        let (allowed, _) = run(&mut trial, 1_000, 115_000, 88_000, |_| 1.0);
        assert!(!allowed);
        assert!(trial.refused());
        // Held: no new trial until the verdict has aged.
        let later_ns = 1_000 + 2 * u64::from(PAIRS) * ARM_NS + HOLD_NS / 2;
        assert!(!trial.allows(later_ns, BUDGET));
        assert_eq!(trial.trials, 1);
        // Then the device is tried again, from a batching arm.
        assert!(trial.allows(later_ns + HOLD_NS, BUDGET));
    }

    #[test]
    fn batching_within_the_budget_stays() {
        let mut trial = BatchTrial::default();
        let (allowed, _) = run(&mut trial, 1_000, 49_000, 48_000, |_| 1.0);
        assert!(allowed);
        assert!(!trial.refused());
    }

    #[test]
    fn noise_alone_does_not_refuse_batching() {
        // Each arm's mean off by up to 15 % either way, the same device behind both: batching
        // loses some pairs past the budget, not nearly all.
        let mut trial = BatchTrial::default();
        let noise = |arm: u32| 1.0 + 0.15 * (((arm * 7 + 3) % 5) as f64 - 2.0) / 2.0;
        let (allowed, _) = run(&mut trial, 1_000, 400_000, 400_000, noise);
        assert!(trial.worse > 0, "the noise should cost batching some pairs");
        assert!(allowed);
    }

    #[test]
    fn completions_submitted_in_the_arm_before_do_not_count() {
        let mut trial = BatchTrial::default();
        assert!(trial.allows(0, BUDGET));
        for i in 0..ARM_MIN_IOS {
            trial.record(i, 50_000);
        }
        // Arm 1 (not batching) begins; the batching arm's queue drains into it, late.
        assert!(!trial.allows(ARM_NS, BUDGET));
        for _ in 0..1000 {
            trial.record(ARM_NS - 1, 500_000);
        }
        assert_eq!(trial.current.ios, 0);
    }

    #[test]
    fn an_arm_waits_for_enough_completions_then_gives_up() {
        let mut trial = BatchTrial::default();
        assert!(trial.allows(0, BUDGET));
        // 10 ms and only 3 completions: the arm goes on.
        for i in 0..3 {
            trial.record(i, 2_000_000);
        }
        assert!(trial.allows(ARM_NS, BUDGET));
        assert!(trial.allows(ARM_NS * 5, BUDGET));
        // At ARM_MAX_NS it ends anyway; the pair will not be counted.
        assert!(!trial.allows(ARM_MAX_NS, BUDGET));
        for _ in 0..ARM_MIN_IOS {
            trial.record(ARM_MAX_NS, 1_000_000);
        }
        assert!(!trial.allows(ARM_MAX_NS + ARM_NS, BUDGET));
        assert_eq!((trial.compared, trial.worse), (0, 0));
    }

    #[test]
    fn a_trial_left_unasked_starts_again() {
        let mut trial = BatchTrial::default();
        assert!(trial.allows(0, BUDGET));
        for i in 0..ARM_MIN_IOS {
            trial.record(i, 50_000);
        }
        assert!(!trial.allows(ARM_NS, BUDGET));
        // The load went away for a second: the next question starts a trial, batching.
        assert!(trial.allows(ARM_NS + 1_000_000_000, BUDGET));
        assert_eq!(trial.arm, Some(0));
    }
}
