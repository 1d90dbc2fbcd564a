//! `adaptive` at queue depth 1 over many I/Os: the spin probes that keep samples exact, the
//! lateness check and the share of I/Os that sleep, probe bursts, and long waits.

use super::super::sleep_trial::{SleepTrial, TRIPLES};
use super::*;

/// Decides for `count` new I/Os at queue depth 1, one every 200 us from `first_ns`, each
/// completing as `complete` says (given its submission time and the decision).
fn run_ios(
    p: &mut Adaptive,
    first_ns: u64,
    count: u64,
    mut complete: impl FnMut(u64, Decision) -> Observation,
) -> Vec<Decision> {
    (0..count)
        .map(|i| {
            let submit_ns = first_ns + i * 200_000;
            let d = decide(p, submit_ns, submit_ns + 1_000, 1);
            p.on_completion(&complete(submit_ns, d));
            d
        })
        .collect()
}

/// An I/O of nand_like that slept and was seen `latency_ns` after submission: censored
/// when it slept, exact otherwise.
fn seen_at(submit_ns: u64, d: Decision, latency_ns: u64) -> Observation {
    let slept = match d {
        Decision::Sleep(d) => Some(Slept {
            requested_ns: d.as_nanos() as u64,
            actual_ns: d.as_nanos() as u64 + 5_000,
        }),
        _ => None,
    };
    Observation {
        bucket: Some(READ_4K),
        submit_ns,
        latency_ns,
        slept,
        idle_polls: 1,
        censored: slept.is_some(),
        after_interrupt: false,
    }
}

/// As [`seen_at`], seen `slept_ns` after submission if it slept and `spun_ns` if not.
fn seen_as(submit_ns: u64, d: Decision, slept_ns: u64, spun_ns: u64) -> Observation {
    let seen_ns = if matches!(d, Decision::Sleep(_)) {
        slept_ns
    } else {
        spun_ns
    };
    seen_at(submit_ns, d, seen_ns)
}

/// The budgeted sleeps among `decisions` (the probe sleeps are shorter).
fn budgeted_sleeps(decisions: &[Decision]) -> u64 {
    decisions
        .iter()
        .filter(|d| matches!(d, Decision::Sleep(s) if s.as_nanos() as u64 > PROBE_SLEEP_NS_MAX))
        .count() as u64
}

#[test]
fn while_sleeps_pay_one_io_in_32_is_spun_through_for_exact_samples() {
    let mut p = Adaptive::default();
    nand_like(&mut p);
    calibrate(&mut p, 5_000, 7_000);
    let decisions = run_ios(&mut p, 0, 4 * SPIN_PROBE_EVERY, |submit_ns, d| {
        seen_at(submit_ns, d, 85_000)
    });
    let spun: Vec<usize> = (0..decisions.len())
        .filter(|&i| decisions[i] == Decision::Spin)
        .collect();
    // The I/O decided for n-th (from 1) is a probe when n % 32 == 16.
    assert_eq!(spun, vec![15, 47, 79, 111], "{decisions:?}");
    // Its exact latency joined the samples stand-ins are drawn from.
    assert_eq!(
        p.buckets[READ_4K.index()].exact.added(),
        ADAPTIVE_RESERVOIR as u64 + 4
    );
}

#[test]
fn the_budget_scales_to_the_lateness_the_sleeps_really_caused() {
    let mut p = Adaptive::default();
    nand_like(&mut p);
    calibrate(&mut p, 5_000, 7_000);
    // As a sleep trial that found the sleeps within the budget leaves it: every window
    // sleeps, and the check alone is at work.
    p.lateness.trial = SleepTrial::holding(1.0);
    let wake = |p: &mut Adaptive| p.planned_wake_ns(READ_4K.index(), 1, false);
    assert_eq!(p.lateness.budget_scale, 1.0);
    // Every sleep is censored and seen at 90 us: its stand-in (80-90 us) makes it ~5 us
    // late, 6 % of the mean against a 2.5 % budget. The scale falls, halfway (in log
    // terms) toward what would meet it, window after window, and the plan wakes earlier
    // than the unscaled budget would on the same samples.
    let ios = 4 * u64::from(LATENESS_WINDOW);
    run_ios(&mut p, 0, ios, |submit_ns, d| seen_at(submit_ns, d, 90_000));
    let scale = p.lateness.budget_scale;
    assert!(scale < 0.6, "scale {scale}");
    let scaled_ns = wake(&mut p);
    p.lateness.budget_scale = 1.0;
    p.lateness.budget_scale_changes += 1;
    let unscaled_ns = wake(&mut p);
    assert!(scaled_ns < unscaled_ns, "{scaled_ns} against {unscaled_ns}");
    p.lateness.budget_scale = scale;
    // Sleeps that finish before the completion are never late: the scale rises, to
    // its bound.
    run_ios(&mut p, ios * 200_000, 3 * ios, |submit_ns, d| {
        let mut seen = seen_at(submit_ns, d, 95_000);
        seen.censored = false;
        seen
    });
    assert_eq!(p.lateness.budget_scale, BUDGET_SCALE_MAX);
    // Windows without sleeps bring it back to 1.
    for _ in 0..8 * LATENESS_WINDOW {
        p.lateness.check(false, 0.0, 85_000);
    }
    assert!(
        (p.lateness.budget_scale - 1.0).abs() < 0.01,
        "scale {}",
        p.lateness.budget_scale
    );
}

#[test]
fn past_the_scale_floor_only_a_share_of_the_ios_sleep() {
    let mut p = Adaptive::default();
    nand_like(&mut p);
    calibrate(&mut p, 5_000, 7_000);
    // As a sleep trial that found the sleeps within the budget leaves it: every window
    // sleeps, and the check alone is at work.
    p.lateness.trial = SleepTrial::holding(1.0);
    let window = u64::from(LATENESS_WINDOW);
    let sleeps = |ds: &[Decision]| {
        ds.iter()
            .filter(|d| matches!(d, Decision::Sleep(_)))
            .count() as f64
    };
    // The device takes 85 us (as the I/Os spun through see), but every sleep is seen at
    // 150 us, ~65 us after its stand-in: far past the budget however early the plan
    // wakes (an overshoot tail does this). The scale falls to its floor, then the share
    // of sleeping I/Os to its own.
    let late = |submit_ns, d| seen_as(submit_ns, d, 150_000, 85_000);
    let ds = run_ios(&mut p, 0, 16 * window, late);
    assert_eq!(p.lateness.budget_scale, BUDGET_SCALE_MIN);
    assert_eq!(p.lateness.sleep_share, SLEEP_SHARE_MIN);
    assert!(sleeps(&ds[..window as usize]) > 0.9 * window as f64);
    // One I/O in four sleeps now (the spin probes and a probe burst aside).
    let ds = run_ios(&mut p, 16 * window * 200_000, window, late);
    let share = sleeps(&ds) / window as f64;
    assert!((0.2..0.32).contains(&share), "share {share}");
    // On-time sleeps: the share comes back to 1 before the scale rises.
    let on_time = |submit_ns, d| {
        let mut seen = seen_at(submit_ns, d, 95_000);
        seen.censored = false;
        seen
    };
    run_ios(&mut p, 17 * window * 200_000, 2 * window, on_time);
    assert!(p.lateness.sleep_share > SLEEP_SHARE_MIN && p.lateness.sleep_share < 1.0);
    assert_eq!(p.lateness.budget_scale, BUDGET_SCALE_MIN);
    run_ios(&mut p, 19 * window * 200_000, 4 * window, on_time);
    assert_eq!(p.lateness.sleep_share, 1.0);
    assert!(p.lateness.budget_scale > BUDGET_SCALE_MIN);
}

#[test]
fn sleeps_late_at_both_floors_stop_then_are_tried_again() {
    use super::super::lateness::{FLOOR_LATE_WINDOWS, SLEEP_HOLD_WINDOWS};
    let mut p = Adaptive::default();
    nand_like(&mut p);
    calibrate(&mut p, 5_000, 7_000);
    // As a sleep trial that found the sleeps within the budget leaves it: every window
    // sleeps, and the check alone is at work.
    p.lateness.trial = SleepTrial::holding(1.0);
    let window = u64::from(LATENESS_WINDOW);
    // As in the test above, every sleep is seen ~65 us after its stand-in, however early
    // the plan wakes: the scale, then the share, fall to their floors, and the windows at
    // the floors stay late.
    let late = |submit_ns, d| seen_as(submit_ns, d, 150_000, 85_000);
    run_ios(&mut p, 0, 16 * window, late);
    assert_eq!(p.lateness.budget_scale, BUDGET_SCALE_MIN);
    assert_eq!(p.lateness.sleep_share, SLEEP_SHARE_MIN);
    // At most FLOOR_LATE_WINDOWS more such windows, and the hold begins.
    let mut floors = 16;
    while p.lateness.hold_windows == 0 {
        assert!(floors < 16 + u64::from(FLOOR_LATE_WINDOWS), "no hold");
        run_ios(&mut p, floors * window * 200_000, window, late);
        floors += 1;
    }
    // Then no lone I/O takes a budgeted sleep for the hold, and the floors stay.
    // (The spin probes are not counted in a window: it takes a few more I/Os.)
    let hold = u64::from(SLEEP_HOLD_WINDOWS);
    let from_ns = floors * window * 200_000;
    let mut held = 0;
    while p.lateness.hold_windows > 0 {
        assert!(held < (hold + hold / 8) * window, "the hold does not end");
        let ds = run_ios(&mut p, from_ns + held * 200_000, 1, late);
        assert_eq!(
            budgeted_sleeps(&ds),
            0,
            "a budgeted sleep at I/O {held} of the hold"
        );
        held += 1;
    }
    assert!(held >= hold * window, "held for {held} I/Os");
    assert_eq!(p.lateness.budget_scale, BUDGET_SCALE_MIN);
    assert_eq!(p.lateness.sleep_share, SLEEP_SHARE_MIN);
    // After it, the share's sleeps are tried again.
    let ds = run_ios(&mut p, from_ns + held * 200_000, window, late);
    let share = budgeted_sleeps(&ds) as f64 / window as f64;
    assert!((0.2..0.32).contains(&share), "share {share}");
}

#[test]
fn sleeps_that_slow_the_io_itself_are_cut_to_the_budgets_share_of_windows() {
    let mut p = Adaptive::default();
    nand_like(&mut p);
    calibrate(&mut p, 5_000, 7_000);
    let window = u64::from(LATENESS_WINDOW);
    // Every read that slept is seen after the wake-up, while spinning, at 100 us; spun
    // through, 85 us: the sleep slows the read itself (a halted vCPU takes its completion
    // late). The lateness check counts such a read as on time and never stops the sleeps.
    // The trial finds them 100/85 as late: in its first three triples, whose middle window
    // spins, and in the others, whose middle window alone sleeps.
    let slowed = |submit_ns, d| {
        let mut seen = seen_as(submit_ns, d, 100_000, 85_000);
        seen.censored = false;
        seen
    };
    // (The spin probes are not counted in a window: the trial takes a few more I/Os.)
    let trial_windows = 3 * u64::from(TRIPLES);
    let mut ios = 0;
    let mut slept = 0;
    while p.lateness.trial.trials == 0 {
        assert!(ios < (trial_windows + 2) * window, "no trial concluded");
        slept += budgeted_sleeps(&run_ios(&mut p, ios * 200_000, 1, slowed));
        ios += 1;
    }
    // Fifteen windows of 36 took the sleeps (the spin probes aside).
    let slept_in_trial = slept as f64 / ios as f64;
    assert!((0.39..0.44).contains(&slept_in_trial), "{slept} of {ios}");
    let cost = p.lateness.trial.cost.expect("a cost");
    assert!((0.15..0.2).contains(&cost), "cost {cost}");
    // With the trial's own sleeping windows, the share that meets the 2.5 % budget: about
    // one window in eight sleeps now.
    let share = p.lateness.trial.share;
    assert!((0.09..0.15).contains(&share), "share {share}");
    let held = 72;
    let ds = run_ios(&mut p, ios * 200_000, held * window, slowed);
    let slept_share = budgeted_sleeps(&ds) as f64 / (held * window) as f64;
    assert!(
        (0.7 * share..1.1 * share).contains(&slept_share),
        "{slept_share} of the I/Os slept, against a share of {share}"
    );
    // Without the trial, the check alone lets every window sleep.
    let mut alone = Adaptive::default();
    nand_like(&mut alone);
    calibrate(&mut alone, 5_000, 7_000);
    alone.lateness.trial = SleepTrial::holding(1.0);
    let ds = run_ios(&mut alone, 0, held * window, slowed);
    assert!(
        budgeted_sleeps(&ds) > held * window * 3 / 4,
        "{}",
        budgeted_sleeps(&ds)
    );
}

#[test]
fn a_window_the_trial_spins_through_leaves_the_checks_scale_and_share() {
    let mut p = Adaptive::default();
    p.lateness.budget_scale = 0.5;
    p.lateness.sleep_share = 0.5;
    // The trial's second window spins: its I/Os take no sleep, which the check would
    // otherwise read as a window with few sleeps and bring both back toward 1.
    for _ in 0..LATENESS_WINDOW {
        assert!(p.lateness.trial.window_sleeps());
        p.lateness.check(true, 0.0, 85_000);
    }
    let after_first = (p.lateness.budget_scale, p.lateness.sleep_share);
    assert!(!p.lateness.trial.window_sleeps());
    for _ in 0..LATENESS_WINDOW {
        assert!(!p.lateness.admits_sleep());
        p.lateness.check(false, 0.0, 85_000);
    }
    assert_eq!(
        (p.lateness.budget_scale, p.lateness.sleep_share),
        after_first
    );
    // The next, sleeping again, is judged.
    assert!(p.lateness.trial.window_sleeps());
    for _ in 0..LATENESS_WINDOW {
        p.lateness.check(false, 0.0, 85_000);
    }
    assert_ne!(
        (p.lateness.budget_scale, p.lateness.sleep_share),
        after_first
    );
}

/// What `ios` lone I/Os, one every 200 us (a window, 102 ms, outlasts a burst's period,
/// 100 ms), each completing in 85 us, were decided: in the windows that spin through their
/// budgeted sleeps, the I/Os and the probe sleeps among them; in the others, the probe
/// sleeps and the other sleeps.
#[derive(Default)]
struct ByWindow {
    spun_windows_ios: u64,
    probes_spun: u32,
    probes_sleeping: u32,
    sleeps: u64,
}

fn decide_by_window(p: &mut Adaptive, ios: u64) -> ByWindow {
    let mut by = ByWindow::default();
    for i in 0..ios {
        let submit_ns = 1_000_000 + i * 200_000;
        let spun_window = !p.lateness.trial.window_sleeps();
        let d = decide(p, submit_ns, submit_ns + 1_000, 1);
        p.on_completion(&seen_at(submit_ns, d, 85_000));
        let probe = matches!(d, Decision::Sleep(s) if s.as_nanos() as u64 <= PROBE_SLEEP_NS_MAX);
        if spun_window {
            by.spun_windows_ios += 1;
            by.probes_spun += u32::from(probe);
        } else {
            by.probes_sleeping += u32::from(probe);
            by.sleeps += u64::from(matches!(d, Decision::Sleep(_)) && !probe);
        }
    }
    by
}

#[test]
fn no_probe_sleep_is_taken_in_a_window_the_trial_spins_through() {
    let mut p = Adaptive::default();
    nand_like(&mut p);
    calibrate(&mut p, 5_000, 7_000);
    // A trial from the start. The sleeping windows never ask for a probe (the plan sleeps
    // there), so the burst every policy starts with is still due in the first window the
    // trial spins through.
    let window = u64::from(LATENESS_WINDOW);
    let by = decide_by_window(&mut p, 12 * window);
    // The spinning windows are what the trial compares the sleeping ones with: a burst's
    // slow first sleeps there would count as what spinning costs.
    assert!(by.spun_windows_ios >= 3 * window, "{}", by.spun_windows_ios);
    assert_eq!(by.probes_spun, 0);
}

#[test]
fn no_probe_sleep_is_taken_in_a_window_the_share_spins_through() {
    let mut p = Adaptive::default();
    nand_like(&mut p);
    calibrate(&mut p, 5_000, 7_000);
    // A trial found sleeps dear: half the windows of the hold sleep, every other one,
    // from a spinning one; and the lateness check lets half the lone I/Os of a sleeping
    // window sleep, so the plan spins the others there. A burst is due in every window,
    // and the first at once.
    p.lateness.trial = SleepTrial::holding(0.5);
    p.lateness.sleep_share = 0.5;
    let window = u64::from(LATENESS_WINDOW);
    let by = decide_by_window(&mut p, 8 * window);
    // What the share's spinning windows cost is outside the budget the share pays for: a
    // burst's slow first sleeps there would spend more.
    assert!(by.spun_windows_ios >= 3 * window, "{}", by.spun_windows_ios);
    assert_eq!(by.probes_spun, 0);
    // The bursts due are taken in the sleeping windows, among the I/Os the plan spins.
    assert!(by.probes_sleeping >= PROBE_BURST, "{}", by.probes_sleeping);
    assert!(by.sleeps >= window, "{}", by.sleeps);
}

#[test]
fn a_probe_burst_after_spinning_measures_the_overshoot_afresh() {
    let mut p = Adaptive::default();
    // A 9 us device, and 64 sleeps that overshot by 60 us (a host that had stopped
    // polling the vCPU): nothing pays but spinning, with a probe burst now and then.
    uniform(&mut p, 8_000, 2_000);
    calibrate(&mut p, 60_000, 7_000);
    assert_eq!(p.overshoot_plan_ns(), Some(60_000));
    let mut probes = 0;
    let mut unlearnt = 0;
    let first_burst = PROBE_WARMUP + PROBE_BURST;
    // One I/O every 200 us: the next burst is due after 100 ms (500 I/Os), long before
    // 16 384 I/Os.
    for i in 0..=PROBE_EVERY {
        let submit_ns = 1_000_000 + i * 200_000;
        if let Decision::Sleep(d) = decide(&mut p, submit_ns, submit_ns + 100, 1) {
            probes += 1;
            if probes <= first_burst {
                continue;
            }
            assert!((500..=540).contains(&i), "burst at I/O {i}");
            // The burst's first sleeps wake 30 us late, the VM adapting to a halting
            // vCPU again: not learnt. The one after them (7 us) starts afresh: all the
            // plan now goes by, not one sample against 64 stale ones.
            let warming_up = probes <= first_burst + PROBE_WARMUP;
            let requested_ns = d.as_nanos() as u64;
            let overshoot_ns = if warming_up { 30_000 } else { 7_000 };
            p.on_sleep(
                &Slept {
                    requested_ns,
                    actual_ns: requested_ns + overshoot_ns,
                },
                Some(20_000),
            );
            if warming_up {
                unlearnt += 1;
                assert_eq!(p.overshoot_plan_ns(), Some(60_000));
                assert_eq!(p.sleep_cpu_ns(), Some(7_000));
            } else {
                // (The first few sleeps of a burst are the slow ones on a VM.)
                assert!(unlearnt >= 4, "{unlearnt} sleeps left out");
                assert_eq!(p.overshoot_plan_ns(), Some(7_000));
                assert_eq!(p.sleep_cpu_ns(), Some(7_000));
                return;
            }
        }
    }
    panic!("no probe burst after {probes} probes");
}

#[test]
fn under_load_an_io_past_every_sample_still_gets_its_probe() {
    // A 9 us device; the I/O decided for has waited 40 us behind 31 others, past every
    // sample. Sleeping does not pay (a 60 us overshoot); the burst at the start probes.
    let setup = || {
        let mut p = Adaptive::default();
        uniform(&mut p, 8_000, 2_000);
        calibrate(&mut p, 60_000, 7_000);
        p
    };
    let mut loaded = setup();
    assert_eq!(
        decide_published(&mut loaded, 0, 40_000, 32, 9_000),
        Decision::sleep_ns(PROBE_SLEEP_NS_MAX)
    );
    // Alone, the same I/O may complete at any moment: no probe.
    let mut alone = setup();
    assert_eq!(
        decide_published(&mut alone, 0, 40_000, 1, 9_000),
        Decision::Spin
    );
}

#[test]
fn long_waits_block_on_the_interrupt() {
    let mut p = Adaptive::default();
    for i in 0..ADAPTIVE_RESERVOIR as u64 {
        observe(&mut p, 1_000_000 + i * 1_000, false); // ~1.1 ms
    }
    calibrate(&mut p, 5_000, 7_000);
    // ~1.1 ms to go, more than 33 overshoots: block on the interrupt.
    assert_eq!(decide(&mut p, 0, 1_000, 1), Decision::WaitInterrupt);
    // 100 us to go is under 33 overshoots: not worth an interrupt's wake-up.
    assert_ne!(decide(&mut p, 0, 1_030_000, 1), Decision::WaitInterrupt);
}

#[test]
fn long_waits_without_an_interrupt_line_sleep_instead() {
    let mut p = Adaptive::default();
    for i in 0..ADAPTIVE_RESERVOIR as u64 {
        observe(&mut p, 1_000_000 + i * 1_000, false); // ~1.1 ms
    }
    calibrate(&mut p, 5_000, 7_000);
    // The same ~1.1 ms to go, on a device that cannot interrupt: a wait would be a spin.
    match decide_on(&mut p, 0, 1_000, 1, false) {
        Decision::Sleep(d) => assert!(d.as_nanos() > 500_000, "{d:?}"),
        other => panic!("expected a long sleep, got {other:?}"),
    }
}
