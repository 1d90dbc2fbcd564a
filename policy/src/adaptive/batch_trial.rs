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
//! A way of waiting is refused when it was later than the other arm by more than its
//! budget in at least [`WORSE_PAIRS`] of the pairs; the next is then tried at once:
//! the interrupt (where the device has one), then [`LEVELS`] batch lengths, each half the
//! one before, past which the reactor neither batches nor waits on the interrupt under load.
//! A batch's budget is the latency budget; the interrupt's is the wider load budget: the
//! arm it is compared with mostly spins, so under load it buys its lead with most of a
//! core, and where a wake-up per burst keeps the device nearly as busy the core is worth
//! more than the last few per cent of throughput (docs/policies.md, step 2).
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
/// Pairs in which the way on trial must be late past its budget for it to be refused.
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

/// How much later than the per-I/O plan (which under load mostly spins) each way of waiting
/// may be, as fractions of the plan's mean latency, before a trial refuses it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Budgets {
    /// For a batch: the latency budget.
    pub(crate) batch_fraction: f64,
    /// For the interrupt: the load budget.
    pub(crate) interrupt_fraction: f64,
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
    /// Pairs so far in which the way on trial was late past its budget.
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
    /// device's mean latency now, `budgets` what each way may cost against spinning;
    /// `interrupts` whether the device has an interrupt to wait on.
    pub(crate) fn load_wait(
        &mut self,
        now_ns: u64,
        mean_ns: u64,
        budgets: Budgets,
        interrupts: bool,
    ) -> Option<LoadWait> {
        self.assert_invariants();
        debug_assert!(budgets.batch_fraction > 0.0 && budgets.interrupt_fraction > 0.0);
        let wait = self.next_wait(now_ns, mean_ns, budgets, interrupts);
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
        budgets: Budgets,
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
            let budget_fraction = if self.level == INTERRUPT_LEVEL {
                budgets.interrupt_fraction
            } else {
                budgets.batch_fraction
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
mod tests;
