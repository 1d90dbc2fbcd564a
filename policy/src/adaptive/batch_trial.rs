//! The experiment that tells `adaptive` how to wait under load: on the interrupt, or by
//! sleeping through a batch, and how long a batch may be.
//!
//! Batching (sleeping through most of the queueing time with several I/Os outstanding)
//! assumes a saturated device, whose queued commands keep it busy while the reactor sleeps.
//! The latencies alone cannot tell such a device from one that is merely wide: a NAND
//! device with many units can have a mean latency more than twice its fastest read at a
//! moderate queue depth, yet never queue, and every completion left unreaped while the
//! reactor sleeps idles a unit, so batching makes it markedly slower than spinning.
//!
//! On a device with an interrupt, waiting for it comes first: the reactor wakes one
//! interrupt wake-up after the first completion of a batch, never a timer's overshoot
//! after it, and spins for none of the rest. Where completions arrive in bursts (a disk
//! behind a hypervisor, a device that coalesces its interrupts) that is as cheap as any
//! batch and less late; where every wake-up costs a large share of the latency, the trial
//! refuses it and the batches are tried next.
//!
//! So the reactor tries each way against not doing it. Arms of as many completions as
//! [`ARM_LATENCIES`] mean latencies give at queue depth 1 (and at least [`ARM_NS_MIN`]; a
//! deep queue completes many I/Os per mean latency, and half of every trial is spent not
//! waiting, so arms no longer than the evidence needs) alternately wait that way and do not (the per-I/O
//! plan, which under load mostly spins, as classic does), in the order try, not, not, try:
//! a drift in the device's latency then weighs on both alike. [`PAIRS`] pairs. Each arm's
//! mean latency, as seen (lateness included), counts the I/Os submitted after its first
//! quarter and completed within it: the device's queue takes a while to settle after a
//! switch, and an arm is not to be charged for the one before it. (On a slow, noisy disk,
//! shorter or longer arms alike left batching late past the budget in about half the pairs
//! or more; see docs/lab/ for the campaign.) At a fixed queue depth Little's law ties that
//! mean to the throughput, so it is the one figure to compare.
//!
//! A way of waiting is refused when it was later than the other arm by more than the
//! latency budget in at least [`WORSE_PAIRS`] of the pairs; the next is then tried at once:
//! the interrupt (where the device has one), then [`LEVELS`] batch lengths, each half the
//! one before, past which the reactor neither batches nor waits on the interrupt under load.
//! A wide device that does not queue loses to batching in every pair, by far more than the
//! budget; so does the longest batch on a queueing device while the machine's wake-ups
//! overshoot badly, by less (docs/lab/ has the figures). Where a way is harmless, a refusal
//! needs bad luck: the chance that at least [`WORSE_PAIRS`] of [`PAIRS`] coin flips come up
//! "worse". On a device whose means scatter from arm to arm by more than the budget, a cost
//! smaller than the noise is not always seen. The way found holds for [`HOLD_NS`], through
//! pauses in the load; then trials start again from the first, since the device's load and
//! state change. A trial that the load leaves for [`STALE_NS`] starts again when it returns.

use super::ADAPTIVE_BATCH_FRACTION;

/// An arm lasts as long as this many of the device's mean latencies take at queue depth 1:
/// at depth `d`, `d` I/Os complete per mean latency (Little's law), so the same evidence
/// takes `ARM_LATENCIES / d` of them; but never less than [`ARM_SETTLE_LATENCIES`], and
/// within [`ARM_NS_MIN`] and [`ARM_NS_MAX`]. It also waits for [`ARM_IOS_MIN`] counted
/// completions.
pub(crate) const ARM_LATENCIES: u64 = 128;
/// An arm lasts at least this many mean latencies, whatever the depth: its first quarter,
/// which is not counted, is then two mean latencies, time for the queue left by the arm
/// before to turn over (one mean latency, at a fixed depth) with room to spare.
pub(crate) const ARM_SETTLE_LATENCIES: u64 = 8;
pub(crate) const ARM_NS_MIN: u64 = 10_000_000;
pub(crate) const ARM_NS_MAX: u64 = 1_000_000_000;
/// Counted completions an arm waits for, up to [`ARM_GIVE_UP`] times its length; a pair
/// with an arm short of them is left out of the count.
pub(crate) const ARM_IOS_MIN: u64 = 16;
pub(crate) const ARM_GIVE_UP: u64 = 4;
/// A trial not asked about for this long (the load went away) starts afresh.
pub(crate) const STALE_NS: u64 = 1_000_000_000;
/// Pairs of arms per trial.
pub(crate) const PAIRS: u32 = 8;
/// Pairs in which batching must be late past the budget for it to be refused.
pub(crate) const WORSE_PAIRS: u32 = 6;
/// How long the batch length found holds.
pub(crate) const HOLD_NS: u64 = 10_000_000_000;

/// Batch lengths tried: the policy's fraction of the queueing time, then half of it, and so
/// on, this many; past the last, no batching.
pub(crate) const LEVELS: u32 = 3;
/// The level that waits on the interrupt; the batch lengths are the levels after it.
const INTERRUPT_LEVEL: u32 = 0;
/// The level past every way of waiting: the per-I/O plan alone.
const NO_LEVEL: u32 = LEVELS + 1;

/// How a reactor under load waits for the oldest I/O, as the trial has it now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum LoadWait {
    /// Block on the device's interrupt.
    Interrupt,
    /// Sleep through this share of the queueing time.
    Batch(f64),
}

impl LoadWait {
    /// The batch's share of the queueing time, if it is a batch.
    pub(crate) fn fraction(self) -> Option<f64> {
        match self {
            LoadWait::Batch(f) => Some(f),
            LoadWait::Interrupt => None,
        }
    }
}

/// One arm's completions: their latencies' sum and count.
#[derive(Clone, Copy, Debug, Default)]
struct ArmTotal {
    latency_sum_ns: u64,
    ios: u64,
}

impl ArmTotal {
    fn mean_ns(&self) -> Option<f64> {
        (self.ios >= ARM_IOS_MIN).then(|| self.latency_sum_ns as f64 / self.ios as f64)
    }
}

/// The trial's state; see the module's documentation.
#[derive(Clone, Debug, Default)]
pub(crate) struct BatchTrial {
    /// The way of waiting on trial or held: [`INTERRUPT_LEVEL`], then batch lengths from
    /// [`ADAPTIVE_BATCH_FRACTION`], each half the one before, then [`NO_LEVEL`].
    level: u32,
    /// Until when the level found is held, once a trial is over.
    held_until_ns: Option<u64>,
    /// The arm in progress (0..2 * PAIRS), while a trial runs, when it began, how long it
    /// lasts and from when the I/Os submitted count.
    arm: Option<u32>,
    arm_start_ns: u64,
    arm_ns: u64,
    count_from_ns: u64,
    current: ArmTotal,
    /// The pair's first arm, once over.
    first: ArmTotal,
    /// Pairs so far in which batching was late past the budget.
    worse: u32,
    /// When the policy last asked (see [`STALE_NS`]), and the I/Os then outstanding (0
    /// before it is told, taken as 1), which set the length of the next arm.
    asked_ns: u64,
    depth: u64,
    /// Trials concluded.
    pub(crate) trials: u64,
}

/// Whether arm `arm` of a trial waits the way on trial: try, not, not, try, repeated.
fn arm_tries(arm: u32) -> bool {
    matches!(arm % 4, 0 | 3)
}

impl BatchTrial {
    /// What holds between any two calls: a trial runs or a length is held, never both; the
    /// arm and level stay in their ranges; a pair counts as worse at most once.
    fn assert_invariants(&self) {
        debug_assert!(self.held_until_ns.is_none() || self.arm.is_none());
        debug_assert!(self.level <= NO_LEVEL);
        debug_assert!(self
            .arm
            .is_none_or(|arm| arm < 2 * PAIRS && self.level < NO_LEVEL));
        // Each pair concluded so far counted once at most.
        debug_assert!(self.worse <= self.arm.map_or(PAIRS, |arm| arm / 2));
    }

    /// How a reactor under load on a device that looks saturated waits now, at `now_ns`, if
    /// it does otherwise than by its per-I/O plan: the way found while it holds, otherwise
    /// the current arm of a trial (started, moved on or concluded here). `mean_ns` is the
    /// device's mean latency now, `budget_fraction` the latency budget, a fraction of the
    /// mean; `interrupts` whether the device has an interrupt to wait on.
    pub(crate) fn load_wait(
        &mut self,
        now_ns: u64,
        mean_ns: u64,
        budget_fraction: f64,
        interrupts: bool,
    ) -> Option<LoadWait> {
        self.assert_invariants();
        let wait = self.next_wait(now_ns, mean_ns, budget_fraction, interrupts);
        self.assert_invariants();
        // One of the ways tried: the interrupt, or the longest batch halved at most
        // LEVELS - 1 times.
        debug_assert!(wait.is_none_or(|w| match w {
            LoadWait::Interrupt => interrupts,
            LoadWait::Batch(f) =>
                f <= ADAPTIVE_BATCH_FRACTION
                    && f >= ADAPTIVE_BATCH_FRACTION / f64::from(1u32 << (LEVELS - 1)),
        }));
        debug_assert_eq!(self.asked_ns, now_ns);
        wait
    }

    /// [`BatchTrial::load_wait`], its invariants aside.
    fn next_wait(
        &mut self,
        now_ns: u64,
        mean_ns: u64,
        budget_fraction: f64,
        interrupts: bool,
    ) -> Option<LoadWait> {
        let stale = now_ns > self.asked_ns.saturating_add(STALE_NS);
        self.asked_ns = now_ns;
        // A pause in the load does not end a hold: the same load on the same device most
        // likely comes back (a bursty client), and each trial costs a few hundred ms of
        // late batches or spinning.
        if let Some(until_ns) = self.held_until_ns {
            if now_ns < until_ns {
                return self.wait(interrupts);
            }
            // The device's load or state may have changed: from the first way again.
            self.held_until_ns = None;
            self.arm = None;
        }
        let arm = match self.arm {
            Some(arm) if !stale => arm,
            _ => {
                self.level = if interrupts { INTERRUPT_LEVEL } else { 1 };
                return self.start(now_ns, mean_ns, interrupts);
            }
        };
        let elapsed_ns = now_ns.saturating_sub(self.arm_start_ns);
        let over = (elapsed_ns >= self.arm_ns && self.current.ios >= ARM_IOS_MIN)
            || elapsed_ns >= ARM_GIVE_UP * self.arm_ns;
        if !over {
            return self.arm_wait(arm, interrupts);
        }
        if arm % 2 == 1 {
            let (tried, other) = if arm_tries(arm) {
                (self.current, self.first)
            } else {
                (self.first, self.current)
            };
            if let (Some(tried_ns), Some(other_ns)) = (tried.mean_ns(), other.mean_ns()) {
                self.worse += u32::from(tried_ns > other_ns * (1.0 + budget_fraction));
            }
        } else {
            self.first = self.current;
        }
        let next = arm + 1;
        if next < 2 * PAIRS {
            self.begin_arm(next, now_ns, mean_ns);
            return self.arm_wait(next, interrupts);
        }
        self.trials += 1;
        self.arm = None;
        // Pairs an arm of which saw too few completions are not counted either way: with
        // too little evidence, the way on trial stays.
        if self.worse >= WORSE_PAIRS {
            self.level += 1;
            if self.level < NO_LEVEL {
                return self.start(now_ns, mean_ns, interrupts);
            }
        }
        self.held_until_ns = Some(now_ns.saturating_add(HOLD_NS));
        self.wait(interrupts)
    }

    /// The way of waiting of the current level, if any; the interrupt only on a device that
    /// has one (a trial found it on another device of the reactor's).
    fn wait(&self, interrupts: bool) -> Option<LoadWait> {
        match self.level {
            INTERRUPT_LEVEL => interrupts.then_some(LoadWait::Interrupt),
            NO_LEVEL => None,
            batch => Some(LoadWait::Batch(
                ADAPTIVE_BATCH_FRACTION / f64::from(1u32 << (batch - 1)),
            )),
        }
    }

    /// How arm `arm` of a trial waits.
    fn arm_wait(&self, arm: u32, interrupts: bool) -> Option<LoadWait> {
        if arm_tries(arm) {
            self.wait(interrupts)
        } else {
            None
        }
    }

    /// A trial of the current level from `now_ns`.
    fn start(&mut self, now_ns: u64, mean_ns: u64, interrupts: bool) -> Option<LoadWait> {
        self.worse = 0;
        self.begin_arm(0, now_ns, mean_ns);
        self.arm_wait(0, interrupts)
    }

    /// The I/Os outstanding on the device now: an arm begun at a depth lasts long enough for
    /// as many completions as [`ARM_LATENCIES`] mean latencies give at depth 1, not
    /// `ARM_LATENCIES` mean latencies, each of which is `depth` completions there.
    pub(crate) fn set_depth(&mut self, outstanding: usize) {
        self.depth = outstanding as u64;
    }

    /// The length of an arm begun now, on a device whose mean latency is `mean_ns`, at the
    /// depth last told (see [`ARM_LATENCIES`]).
    fn arm_ns(&self, mean_ns: u64) -> u64 {
        let depth = self.depth.max(1);
        let evidence_ns = mean_ns.saturating_mul(ARM_LATENCIES) / depth;
        let settle_ns = mean_ns.saturating_mul(ARM_SETTLE_LATENCIES);
        let arm_ns = evidence_ns.max(settle_ns).clamp(ARM_NS_MIN, ARM_NS_MAX);
        // Never longer than at depth 1.
        debug_assert!(
            arm_ns
                <= mean_ns
                    .saturating_mul(ARM_LATENCIES)
                    .clamp(ARM_NS_MIN, ARM_NS_MAX)
        );
        arm_ns
    }

    /// Arm `arm` from `now_ns`, on a device whose mean latency is `mean_ns`.
    fn begin_arm(&mut self, arm: u32, now_ns: u64, mean_ns: u64) {
        debug_assert!(arm < 2 * PAIRS);
        self.arm = Some(arm);
        self.arm_start_ns = now_ns;
        self.arm_ns = self.arm_ns(mean_ns);
        self.count_from_ns = now_ns + self.arm_ns / 4;
        self.current = ArmTotal::default();
        debug_assert!((ARM_NS_MIN..=ARM_NS_MAX).contains(&self.arm_ns));
        debug_assert!(self.arm_start_ns < self.count_from_ns);
    }

    /// A completion seen `latency_ns` after its submission at `submit_ns`: it counts for the
    /// current arm if submitted after the arm's first quarter.
    pub(crate) fn record(&mut self, submit_ns: u64, latency_ns: u64) {
        if self.arm.is_some() && submit_ns >= self.count_from_ns {
            self.current.latency_sum_ns += latency_ns;
            self.current.ios += 1;
        }
    }

    /// The way of waiting held, once a trial has found it, on a device with an interrupt.
    pub(crate) fn held(&self) -> Option<LoadWait> {
        self.held_until_ns.and_then(|_| self.wait(true))
    }

    /// The batch length held, once a trial has found one.
    pub(crate) fn held_fraction(&self) -> Option<f64> {
        self.held().and_then(LoadWait::fraction)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: f64 = 0.025;
    /// A device fast enough for the shortest arms.
    const MEAN_NS: u64 = 50_000;

    impl BatchTrial {
        /// The batch length now on a device without an interrupt: the batch ladder alone.
        fn batch_fraction(&mut self, now_ns: u64, mean_ns: u64, budget: f64) -> Option<f64> {
            let wait = self.load_wait(now_ns, mean_ns, budget, false);
            assert_ne!(wait, Some(LoadWait::Interrupt));
            wait.and_then(LoadWait::fraction)
        }
    }

    /// Runs arms of 10 ms from `start_ns`, 100 completions each (75 counted), until
    /// `trials` more trials are over, on a device with (`interrupts`) or without an
    /// interrupt whose latency, for an arm that waits `wait` (or by its plan), is
    /// `latency_ns(wait, arm)`. Returns when it stopped and how each arm waited.
    fn run_waits(
        trial: &mut BatchTrial,
        start_ns: u64,
        trials: u64,
        interrupts: bool,
        latency_ns: impl Fn(Option<LoadWait>, u32) -> u64,
    ) -> (u64, Vec<Option<LoadWait>>) {
        let mut now_ns = start_ns;
        let mut arms = Vec::new();
        let until = trial.trials + trials;
        let mut wait = trial.load_wait(now_ns, MEAN_NS, BUDGET, interrupts);
        while trial.trials < until {
            assert!(arms.len() < 1000, "the trials should end");
            let arm = arms.len() as u32;
            arms.push(wait);
            for i in 0..100 {
                let submit_ns = now_ns + i * (ARM_NS_MIN / 100);
                trial.record(submit_ns, latency_ns(wait, arm));
                let asked = trial.load_wait(submit_ns + 1, MEAN_NS, BUDGET, interrupts);
                assert_eq!(asked, wait);
            }
            now_ns += ARM_NS_MIN;
            wait = trial.load_wait(now_ns, MEAN_NS, BUDGET, interrupts);
        }
        (now_ns, arms)
    }

    /// [`run_waits`] on a device without an interrupt, with the batch lengths alone.
    fn run(
        trial: &mut BatchTrial,
        start_ns: u64,
        trials: u64,
        latency_ns: impl Fn(Option<f64>, u32) -> u64,
    ) -> (u64, Vec<Option<f64>>) {
        let (end_ns, arms) = run_waits(trial, start_ns, trials, false, |wait, arm| {
            latency_ns(wait.and_then(LoadWait::fraction), arm)
        });
        (
            end_ns,
            arms.into_iter()
                .map(|w| w.and_then(LoadWait::fraction))
                .collect(),
        )
    }

    /// 88 us, or `batched_ns` in an arm that batches.
    fn batch_late(batched_ns: u64) -> impl Fn(Option<f64>, u32) -> u64 {
        move |fraction, _| {
            if fraction.is_some() {
                batched_ns
            } else {
                88_000
            }
        }
    }

    #[test]
    fn arms_alternate_batch_not_not_batch() {
        let mut trial = BatchTrial::default();
        let (_, arms) = run(&mut trial, 1_000, 1, batch_late(88_000));
        let expected: Vec<Option<f64>> = (0..2 * PAIRS)
            .map(|a| matches!(a % 4, 0 | 3).then_some(ADAPTIVE_BATCH_FRACTION))
            .collect();
        assert_eq!(arms, expected);
    }

    #[test]
    fn a_batch_late_in_every_pair_is_halved_then_dropped_and_that_holds() {
        let mut trial = BatchTrial::default();
        let (end_ns, arms) = run(&mut trial, 1_000, u64::from(LEVELS), batch_late(115_000));
        // One trial per length, each straight after the one before.
        assert_eq!(arms.len(), (2 * PAIRS * LEVELS) as usize);
        let lengths: Vec<f64> = arms.iter().flatten().copied().collect();
        assert_eq!(lengths[0], 0.75);
        assert_eq!(lengths[lengths.len() / 2], 0.375);
        assert_eq!(lengths[lengths.len() - 1], 0.1875);
        assert_eq!(trial.held_fraction(), None);
        assert!(trial.held_until_ns.is_some());
        // Held, asked about all along: no batching and no new trial until it has aged.
        for ask_ns in (end_ns..end_ns + HOLD_NS).step_by(500_000_000) {
            assert_eq!(trial.batch_fraction(ask_ns, MEAN_NS, BUDGET), None);
        }
        assert_eq!(trial.trials, u64::from(LEVELS));
        // Then the device is tried again, from the longest batch.
        let again_ns = end_ns + HOLD_NS;
        assert_eq!(trial.batch_fraction(again_ns, MEAN_NS, BUDGET), Some(0.75));
    }

    #[test]
    fn what_was_found_holds_through_a_pause_in_the_load() {
        let mut trial = BatchTrial::default();
        let (end_ns, _) = run(&mut trial, 1_000, u64::from(LEVELS), batch_late(115_000));
        // Two seconds without a question (the load went away), then back: still held.
        let back_ns = end_ns + 2 * STALE_NS;
        assert_eq!(trial.batch_fraction(back_ns, MEAN_NS, BUDGET), None);
        assert_eq!(trial.trials, u64::from(LEVELS));
        // Once it has aged, after a pause too, the device is tried again.
        let later_ns = end_ns + HOLD_NS + 2 * STALE_NS;
        assert_eq!(trial.batch_fraction(later_ns, MEAN_NS, BUDGET), Some(0.75));
    }

    #[test]
    fn a_shorter_batch_within_the_budget_is_kept() {
        let mut trial = BatchTrial::default();
        // The longest batch is 10 % late, half of it 2 % (within the budget).
        let latency = |fraction: Option<f64>, _| match fraction {
            Some(f) if f > 0.5 => 96_800,
            Some(_) => 89_760,
            None => 88_000,
        };
        run(&mut trial, 1_000, 2, latency);
        assert_eq!(trial.held_fraction(), Some(0.375));
    }

    #[test]
    fn a_batch_within_the_budget_stays() {
        let mut trial = BatchTrial::default();
        run(&mut trial, 1_000, 1, batch_late(89_000));
        assert_eq!(trial.held_fraction(), Some(0.75));
    }

    #[test]
    fn noise_alone_does_not_refuse_a_batch() {
        // Each arm's mean off by up to 15 % either way, the same device behind both: batching
        // loses some pairs past the budget, not nearly all.
        let mut trial = BatchTrial::default();
        let noise = |_, arm: u32| {
            (400_000.0 * (1.0 + 0.15 * (((arm * 7 + 3) % 5) as f64 - 2.0) / 2.0)) as u64
        };
        run(&mut trial, 1_000, 1, noise);
        assert!(trial.worse > 0, "the noise should cost batching some pairs");
        assert_eq!(trial.held_fraction(), Some(0.75));
    }

    #[test]
    fn only_completions_submitted_after_the_arms_first_quarter_count() {
        let mut trial = BatchTrial::default();
        assert!(trial.batch_fraction(0, MEAN_NS, BUDGET).is_some());
        // Submitted in the first quarter, while the device's queue settles: not counted.
        trial.record(ARM_NS_MIN / 4 - 1, 50_000);
        assert_eq!(trial.current.ios, 0);
        for _ in 0..ARM_IOS_MIN {
            trial.record(ARM_NS_MIN / 2, 50_000);
        }
        // Arm 1 (not batching) begins; the batching arm's queue drains into it, late.
        assert!(trial.batch_fraction(ARM_NS_MIN, MEAN_NS, BUDGET).is_none());
        for _ in 0..1000 {
            trial.record(ARM_NS_MIN - 1, 500_000);
        }
        assert_eq!(trial.current.ios, 0);
    }

    #[test]
    fn an_arm_lasts_128_mean_latencies_on_a_slow_device() {
        let mut trial = BatchTrial::default();
        // 500 us reads: 64 ms arms, counting from 16 ms.
        assert!(trial.batch_fraction(0, 500_000, BUDGET).is_some());
        trial.record(15_999_999, 500_000);
        assert_eq!(trial.current.ios, 0);
        for _ in 0..ARM_IOS_MIN {
            trial.record(16_000_000, 500_000);
        }
        assert!(trial.batch_fraction(63_999_999, 500_000, BUDGET).is_some());
        assert!(trial.batch_fraction(64_000_000, 500_000, BUDGET).is_none());
    }

    #[test]
    fn an_arm_at_depth_lasts_as_many_completions_as_one_at_depth_1() {
        // 800 us at depth 128 (a queueing disk): 128 completions per mean latency, so the
        // evidence of 128 mean latencies at depth 1 takes one mean latency; the settling
        // time, 8 of them (6.4 ms), is shorter than the shortest arm: 10 ms arms.
        let mut trial = BatchTrial::default();
        trial.set_depth(128);
        assert!(trial.batch_fraction(0, 800_000, BUDGET).is_some());
        for _ in 0..ARM_IOS_MIN {
            trial.record(ARM_NS_MIN / 4, 800_000);
        }
        assert!(trial
            .batch_fraction(ARM_NS_MIN - 1, 800_000, BUDGET)
            .is_some());
        assert!(trial.batch_fraction(ARM_NS_MIN, 800_000, BUDGET).is_none());
        // 5 ms at depth 64: 128 / 64 = 2 mean latencies of evidence, but 8 to settle.
        let mut trial = BatchTrial::default();
        trial.set_depth(64);
        assert!(trial.batch_fraction(0, 5_000_000, BUDGET).is_some());
        for _ in 0..ARM_IOS_MIN {
            trial.record(10_000_000, 5_000_000);
        }
        assert!(trial
            .batch_fraction(39_999_999, 5_000_000, BUDGET)
            .is_some());
        assert!(trial
            .batch_fraction(40_000_000, 5_000_000, BUDGET)
            .is_none());
    }

    #[test]
    fn an_arm_waits_for_enough_completions_then_gives_up() {
        let mut trial = BatchTrial::default();
        assert!(trial.batch_fraction(0, MEAN_NS, BUDGET).is_some());
        // 10 ms and only 3 completions: the arm goes on.
        for _ in 0..3 {
            trial.record(ARM_NS_MIN / 2, 2_000_000);
        }
        assert!(trial.batch_fraction(ARM_NS_MIN, MEAN_NS, BUDGET).is_some());
        assert!(trial
            .batch_fraction(ARM_NS_MIN * 3, MEAN_NS, BUDGET)
            .is_some());
        // At 4 times its length it ends anyway; the pair will not be counted (counted, its
        // batching arm, at 2 ms against 1 ms, would be late past the budget).
        let give_up_ns = ARM_GIVE_UP * ARM_NS_MIN;
        assert!(trial.batch_fraction(give_up_ns, MEAN_NS, BUDGET).is_none());
        for _ in 0..ARM_IOS_MIN {
            trial.record(give_up_ns + ARM_NS_MIN / 2, 1_000_000);
        }
        assert!(trial
            .batch_fraction(give_up_ns + ARM_NS_MIN, MEAN_NS, BUDGET)
            .is_none());
        assert_eq!(trial.worse, 0);
    }

    #[test]
    fn a_trial_left_unasked_starts_again() {
        let mut trial = BatchTrial::default();
        assert!(trial.batch_fraction(0, MEAN_NS, BUDGET).is_some());
        for _ in 0..ARM_IOS_MIN {
            trial.record(ARM_NS_MIN / 2, 50_000);
        }
        assert!(trial.batch_fraction(ARM_NS_MIN, MEAN_NS, BUDGET).is_none());
        // The load went away for a second: the next question starts a trial, batching.
        assert!(trial
            .batch_fraction(ARM_NS_MIN + STALE_NS + 1, MEAN_NS, BUDGET)
            .is_some());
        assert_eq!(trial.arm, Some(0));
    }

    /// 88 us, or `late_ns` in an arm that waits on the interrupt; a batch is always late.
    fn interrupt_late(late_ns: u64) -> impl Fn(Option<LoadWait>, u32) -> u64 {
        move |wait, _| match wait {
            Some(LoadWait::Interrupt) => late_ns,
            Some(LoadWait::Batch(_)) => 115_000,
            None => 88_000,
        }
    }

    #[test]
    fn on_a_device_with_an_interrupt_the_interrupt_is_tried_first_and_kept_if_not_late() {
        let mut trial = BatchTrial::default();
        let (end_ns, arms) = run_waits(&mut trial, 1_000, 1, true, interrupt_late(89_000));
        let expected: Vec<Option<LoadWait>> = (0..2 * PAIRS)
            .map(|a| matches!(a % 4, 0 | 3).then_some(LoadWait::Interrupt))
            .collect();
        assert_eq!(arms, expected);
        assert_eq!(trial.held(), Some(LoadWait::Interrupt));
        assert_eq!(trial.held_fraction(), None);
        // Held: every question under load is answered with the interrupt, and with nothing
        // on a device of the reactor's that has none.
        let ask_ns = end_ns + HOLD_NS / 2;
        assert_eq!(
            trial.load_wait(ask_ns, MEAN_NS, BUDGET, true),
            Some(LoadWait::Interrupt)
        );
        assert_eq!(trial.load_wait(ask_ns + 1, MEAN_NS, BUDGET, false), None);
        assert_eq!(trial.trials, 1);
    }

    #[test]
    fn an_interrupt_late_past_the_budget_gives_way_to_the_batches() {
        let mut trial = BatchTrial::default();
        // The interrupt's wake-up makes its arms 10 % late; the batches are later still.
        let (_, arms) = run_waits(
            &mut trial,
            1_000,
            1 + u64::from(LEVELS),
            true,
            interrupt_late(96_800),
        );
        assert_eq!(arms.len(), (2 * PAIRS * (1 + LEVELS)) as usize);
        let tried: Vec<LoadWait> = arms.iter().flatten().copied().collect();
        let per_level = PAIRS as usize;
        assert!(tried[..per_level].iter().all(|&w| w == LoadWait::Interrupt));
        assert_eq!(tried[per_level], LoadWait::Batch(0.75));
        assert_eq!(tried[tried.len() - 1], LoadWait::Batch(0.1875));
        assert_eq!(trial.held(), None);
        assert!(trial.held_until_ns.is_some());
    }
}
