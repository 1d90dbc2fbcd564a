use super::*;

const BUDGET: f64 = 0.025;
/// The load budget, the interrupt's.
const LOAD_BUDGET: f64 = 0.10;
const BUDGETS: Budgets = Budgets {
    batch_fraction: BUDGET,
    interrupt_fraction: LOAD_BUDGET,
};
/// A device fast enough for the shortest arms.
const MEAN_NS: u64 = 50_000;
/// What an arm of the per-I/O plan (neither batching nor waiting on the interrupt) sees.
const PLAN_NS: u64 = 88_000;

impl BatchTrial {
    /// The batch length now on a device without an interrupt: the batch ladder alone.
    fn batch_fraction(&mut self, now_ns: u64, mean_ns: u64, budget: f64) -> Option<f64> {
        let budgets = Budgets {
            batch_fraction: budget,
            interrupt_fraction: LOAD_BUDGET,
        };
        let wait = self.load_wait(now_ns, mean_ns, budgets, false);
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
    run_waits_within(trial, BUDGETS, start_ns, trials, interrupts, latency_ns)
}

/// [`run_waits`] with other budgets.
fn run_waits_within(
    trial: &mut BatchTrial,
    budgets: Budgets,
    start_ns: u64,
    trials: u64,
    interrupts: bool,
    latency_ns: impl Fn(Option<LoadWait>, u32) -> u64,
) -> (u64, Vec<Option<LoadWait>>) {
    let mut now_ns = start_ns;
    let mut arms = Vec::new();
    let until = trial.trials + trials;
    let mut wait = trial.load_wait(now_ns, MEAN_NS, budgets, interrupts);
    while trial.trials < until {
        assert!(arms.len() < 1000, "the trials should end");
        let arm = arms.len() as u32;
        arms.push(wait);
        for i in 0..100 {
            let submit_ns = now_ns + i * (ARM_NS_MIN / 100);
            trial.record(submit_ns, latency_ns(wait, arm));
            let asked = trial.load_wait(submit_ns + 1, MEAN_NS, budgets, interrupts);
            assert_eq!(asked, wait);
        }
        now_ns += ARM_NS_MIN;
        wait = trial.load_wait(now_ns, MEAN_NS, budgets, interrupts);
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

/// The plan's latency, or `batched_ns` in an arm that batches.
fn batch_late(batched_ns: u64) -> impl Fn(Option<f64>, u32) -> u64 {
    move |fraction, _| {
        if fraction.is_some() {
            batched_ns
        } else {
            PLAN_NS
        }
    }
}

#[test]
fn arms_alternate_batch_not_not_batch() {
    let mut trial = BatchTrial::default();
    let (_, arms) = run(&mut trial, 1_000, 1, batch_late(PLAN_NS));
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
        None => PLAN_NS,
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
    let noise =
        |_, arm: u32| (400_000.0 * (1.0 + 0.15 * (((arm * 7 + 3) % 5) as f64 - 2.0) / 2.0)) as u64;
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

/// The plan's arms' latency, later by `fraction` of it.
fn plan_late_by(fraction: f64) -> u64 {
    (PLAN_NS as f64 * (1.0 + fraction)) as u64
}

/// The plan's latency, or `late_ns` in an arm that waits on the interrupt; a batch is
/// always late.
fn interrupt_late(late_ns: u64) -> impl Fn(Option<LoadWait>, u32) -> u64 {
    move |wait, _| match wait {
        Some(LoadWait::Interrupt) => late_ns,
        Some(LoadWait::Batch(_)) => 115_000,
        None => PLAN_NS,
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
        trial.load_wait(ask_ns, MEAN_NS, BUDGETS, true),
        Some(LoadWait::Interrupt)
    );
    assert_eq!(trial.load_wait(ask_ns + 1, MEAN_NS, BUDGETS, false), None);
    assert_eq!(trial.trials, 1);
}

#[test]
fn an_interrupt_later_than_the_latency_budget_but_within_the_load_budget_is_kept() {
    // Late by more than the latency budget, less than the load budget. With a load budget
    // as tight as the latency budget, the same trial refuses it.
    let late_ns = plan_late_by((BUDGET + LOAD_BUDGET) / 2.0);
    let mut trial = BatchTrial::default();
    run_waits(&mut trial, 1_000, 1, true, interrupt_late(late_ns));
    assert_eq!(trial.held(), Some(LoadWait::Interrupt));
    let tight = Budgets {
        batch_fraction: BUDGET,
        interrupt_fraction: BUDGET,
    };
    let mut trial = BatchTrial::default();
    let (end_ns, arms) =
        run_waits_within(&mut trial, tight, 1_000, 1, true, interrupt_late(late_ns));
    assert_eq!(arms.len(), 2 * PAIRS as usize);
    assert_eq!(trial.arm, Some(0));
    assert_eq!(trial.held(), None);
    // The batches are on trial now.
    assert_eq!(
        trial.load_wait(end_ns + 1, MEAN_NS, tight, true),
        Some(LoadWait::Batch(0.75))
    );
}

#[test]
fn an_interrupt_late_past_the_load_budget_gives_way_to_the_batches() {
    let mut trial = BatchTrial::default();
    // The interrupt's wake-up makes its arms late by well past the load budget; the batches
    // are late past the latency budget.
    let (_, arms) = run_waits(
        &mut trial,
        1_000,
        1 + u64::from(LEVELS),
        true,
        interrupt_late(plan_late_by(3.0 * LOAD_BUDGET)),
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
