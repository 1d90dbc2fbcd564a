//! Tests of the `adaptive` policy as a whole: decisions from learnt latencies, calibration,
//! probes, the lateness check, the interrupt's price and batching under load.

use super::distribution::{Distribution, EXACT_REFRESH_EVERY, EXACT_SAMPLES};
use super::interrupt_price::{IRQ_PROBE_EVERY, IRQ_PROBE_SAMPLES_MIN, OFFSET_ZERO_NS};
use super::lateness::{BUDGET_SCALE_MAX, BUDGET_SCALE_MIN, LATENESS_WINDOW, SLEEP_SHARE_MIN};
use super::probe::{PROBE_BURST, PROBE_EVERY, PROBE_SLEEP_NS_MAX, PROBE_WARMUP, SPIN_PROBE_EVERY};
use super::*;
use crate::policy::testing::{snapshot, stats, READ_4K};
use crate::{InFlight, OvershootStats, Snapshot};
use std::time::Duration;

fn observe(policy: &mut Adaptive, latency_ns: u64, censored: bool) {
    policy.on_completion(&Observation {
        bucket: Some(READ_4K),
        submit_ns: 0,
        latency_ns,
        slept: None,
        idle_polls: 1,
        censored,
        after_interrupt: false,
    });
}

/// The sleeps of the first burst's warm-up, which are not learnt (see [`PROBE_WARMUP`]).
fn warm_up(policy: &mut Adaptive) {
    for _ in 0..PROBE_WARMUP {
        policy.on_sleep(
            &Slept {
                requested_ns: 10_000,
                actual_ns: 40_000,
            },
            Some(30_000),
        );
    }
}

fn calibrate(policy: &mut Adaptive, overshoot_ns: u64, cpu_ns: u64) {
    for _ in 0..64 {
        policy.on_sleep(
            &Slept {
                requested_ns: 10_000,
                actual_ns: 10_000 + overshoot_ns,
            },
            Some(cpu_ns),
        );
    }
}

fn decide(policy: &mut Adaptive, submit_ns: u64, now_ns: u64, outstanding: usize) -> Decision {
    decide_on(policy, submit_ns, now_ns, outstanding, true)
}

/// A decision on a device with (`interrupts`) or without an interrupt line.
fn decide_on(
    policy: &mut Adaptive,
    submit_ns: u64,
    now_ns: u64,
    outstanding: usize,
    interrupts: bool,
) -> Decision {
    decide_slept(policy, submit_ns, now_ns, outstanding, interrupts, false)
}

/// A decision for an I/O that has (`slept`) or has not slept yet.
fn decide_slept(
    policy: &mut Adaptive,
    submit_ns: u64,
    now_ns: u64,
    outstanding: usize,
    interrupts: bool,
    slept: bool,
) -> Decision {
    let oldest = InFlight {
        bucket: Some(READ_4K),
        submit_ns,
        slept,
    };
    decide_ctx(
        policy,
        &Snapshot::EMPTY,
        oldest,
        now_ns,
        outstanding,
        interrupts,
    )
}

/// The one place the tests build a decision's context.
fn decide_ctx(
    policy: &mut Adaptive,
    stats: &Snapshot,
    oldest: InFlight,
    now_ns: u64,
    outstanding: usize,
    interrupts: bool,
) -> Decision {
    let overshoot = OvershootStats::new();
    policy.decide(&PollContext {
        now_ns,
        outstanding,
        oldest,
        stats,
        overshoot: &overshoot,
        interrupts,
        oracle_deadline_ns: None,
    })
}

/// A decision at queue depth `outstanding` on a device whose published statistics give
/// the I/O's bucket a mean latency of `mean_ns`.
fn decide_published(
    policy: &mut Adaptive,
    submit_ns: u64,
    now_ns: u64,
    outstanding: usize,
    mean_ns: u64,
) -> Decision {
    decide_published_on(policy, submit_ns, now_ns, outstanding, mean_ns, true)
}

/// [`decide_published`] on a device with (`interrupts`) or without an interrupt line.
fn decide_published_on(
    policy: &mut Adaptive,
    submit_ns: u64,
    now_ns: u64,
    outstanding: usize,
    mean_ns: u64,
    interrupts: bool,
) -> Decision {
    let oldest = InFlight {
        bucket: Some(READ_4K),
        submit_ns,
        slept: false,
    };
    let published = snapshot(stats(mean_ns, mean_ns / 2));
    decide_ctx(policy, &published, oldest, now_ns, outstanding, interrupts)
}

/// A full reservoir of latencies evenly spread over `from_ns..from_ns + width_ns`.
fn uniform(policy: &mut Adaptive, from_ns: u64, width_ns: u64) {
    for i in 0..ADAPTIVE_RESERVOIR as u64 {
        observe(
            policy,
            from_ns + (i * width_ns) / ADAPTIVE_RESERVOIR as u64,
            false,
        );
    }
}

/// Latencies 70..=90 us.
fn nand_like(policy: &mut Adaptive) {
    uniform(policy, 70_000, 20_000);
}

#[test]
fn wake_time_keeps_the_expected_lateness_within_budget() {
    let mut d = Distribution::EMPTY;
    for x in 1..=100u64 {
        d.add(x * 1_000, true);
    }
    d.latencies.refresh();
    // Waking at w = 10 us is late by sum_{x<10}(10 - x) / 100 = 45/100 us = 450 ns.
    assert_eq!(d.wake_within_budget(0, 450), Some(10_000));
    assert_eq!(d.wake_within_budget(0, 449), Some(9_000));
    // Past 95 us only 5 samples remain: too few to plan on.
    assert_eq!(d.wake_within_budget(95_000, 10_000), None);
    assert_eq!(d.median_remaining_ns(40_000), Some(31_000));
    assert_eq!(d.mean_ns(), 50_500);
    // The shortcut that skips the search agrees with it everywhere, past the largest
    // sample too (where the median of nothing exceeds nothing).
    for elapsed_ns in (0..=110_000).step_by(2_500) {
        for limit_ns in (0..=100_000).step_by(5_000) {
            let searched = d
                .median_remaining_ns(elapsed_ns)
                .is_some_and(|r| r > limit_ns);
            assert_eq!(
                d.median_remaining_exceeds(elapsed_ns, limit_ns),
                searched,
                "elapsed {elapsed_ns}, limit {limit_ns}"
            );
        }
    }
}

#[test]
fn spins_until_it_has_samples_then_probes_to_calibrate() {
    let mut p = Adaptive::default();
    assert_eq!(decide(&mut p, 0, 100, 1), Decision::Spin, "no samples");
    nand_like(&mut p);
    // Samples but no overshoot measured yet: a probe, half the room before the
    // fastest completion seen (70 us), capped at 10 us.
    assert_eq!(
        decide(&mut p, 0, 100, 1),
        Decision::sleep_ns(PROBE_SLEEP_NS_MAX)
    );
}

#[test]
fn sleeps_toward_the_budgeted_wake_time_minus_the_overshoot() {
    let mut p = Adaptive::with(ADAPTIVE_BUDGET_PCT, false);
    nand_like(&mut p);
    calibrate(&mut p, 5_000, 7_000);
    assert_eq!(p.overshoot_plan_ns(), Some(5_000));
    match decide(&mut p, 0, 1_000, 1) {
        Decision::Sleep(d) => {
            let d = d.as_nanos() as u64;
            // Budget: 2.5 % of 80 us = 2 us of expected lateness: a wake-up ~9 us into
            // the 70-90 us spread, minus elapsed (1 us) and the 5 us overshoot.
            assert!((71_000..=74_500).contains(&d), "slept {d}");
        }
        other => panic!("expected a sleep, got {other:?}"),
    }
    // One sleep per I/O: after it, spin.
    assert_eq!(decide(&mut p, 0, 75_000, 1), Decision::Spin);
    // The next I/O plans again.
    assert!(matches!(
        decide(&mut p, 80_000, 81_000, 1),
        Decision::Sleep(_)
    ));
}

/// Latencies 40..=100 us: a wide device.
fn wide(policy: &mut Adaptive) {
    uniform(policy, 40_000, 60_000);
}

/// Interrupt probes that measured a wake-up of `cost_ns`.
fn price_interrupt(policy: &mut Adaptive, cost_ns: u64) {
    for i in 0..IRQ_PROBE_SAMPLES_MIN as u64 {
        policy.irq.spun.add(OFFSET_ZERO_NS + i * 100);
        policy.irq.woken.add(OFFSET_ZERO_NS + i * 100 + cost_ns);
    }
}

#[test]
fn it_prices_the_interrupt_with_alternating_probes() {
    let mut p = Adaptive::with(ADAPTIVE_BUDGET_PCT, true);
    wide(&mut p);
    calibrate(&mut p, 5_000, 7_000);
    assert_eq!(p.interrupt_cost_ns(), None);
    // A device of 50-54 us whose interrupt wakes the reactor 12 us after the completion.
    let (mut spun, mut woken) = (0, 0);
    for i in 0..2 * IRQ_PROBE_EVERY * IRQ_PROBE_SAMPLES_MIN as u64 + IRQ_PROBE_EVERY {
        let submit_ns = i * 1_000_000;
        let device_ns = 50_000 + (i * 7_919) % 4_000;
        let decision = decide(&mut p, submit_ns, submit_ns + 1_000, 1);
        let after_interrupt = decision == Decision::WaitInterrupt;
        if after_interrupt {
            woken += 1;
        } else if decision == Decision::Spin {
            spun += 1;
        }
        p.on_completion(&Observation {
            bucket: Some(READ_4K),
            submit_ns,
            latency_ns: device_ns + if after_interrupt { 12_000 } else { 0 },
            slept: None,
            idle_polls: 1,
            censored: after_interrupt,
            after_interrupt,
        });
    }
    // One I/O in 16 is a probe, the arms alternating.
    assert!(woken >= IRQ_PROBE_SAMPLES_MIN, "{woken} interrupt probes");
    assert!(spun >= IRQ_PROBE_SAMPLES_MIN, "{spun} spun");
    let cost = p.interrupt_cost_ns().expect("priced");
    assert!((11_000..=13_000).contains(&cost), "interrupt costs {cost}");
    // Timed sleeps (the default) never probe, nor does a policy whose sleeps cannot pay (a 10 us
    // device, where a sleep costs 9 us of CPU): nothing to price, nothing paid.
    let mut t = Adaptive::with(ADAPTIVE_BUDGET_PCT, false);
    wide(&mut t);
    calibrate(&mut t, 5_000, 7_000);
    let mut fast = Adaptive::with(ADAPTIVE_BUDGET_PCT, true);
    for i in 0..ADAPTIVE_RESERVOIR as u64 {
        observe(&mut fast, 9_500 + i % 500, false);
    }
    calibrate(&mut fast, 7_000, 9_000);
    for i in 0..4 * IRQ_PROBE_EVERY {
        let submit_ns = i * 1_000_000;
        assert_ne!(
            decide(&mut t, submit_ns, submit_ns + 1_000, 1),
            Decision::WaitInterrupt
        );
        // (It spins, but for the short sleeps that keep the overshoot measured.)
        assert!(matches!(
            decide(&mut fast, submit_ns, submit_ns + 1_000, 1),
            Decision::Spin | Decision::Sleep(_)
        ));
    }
}

#[test]
fn an_interruptible_sleep_is_late_by_one_wake_up_at_most_so_it_sleeps_longer() {
    let mut p = Adaptive::with(ADAPTIVE_BUDGET_PCT, true);
    wide(&mut p);
    calibrate(&mut p, 5_000, 7_000);
    // Until the interrupt is priced, its sleeps are timed ones.
    assert!(matches!(
        decide_on(&mut p, 0, 1_000, 1, true),
        Decision::Sleep(_)
    ));
    price_interrupt(&mut p, 5_000);
    // Budget 2.5 % of 70 us = 1.75 us. Timed, E[(w - T)+] = (w - 40)^2 / 120 us: w ~54.5
    // us. Interruptible, each completion before w is late by at most the 5 us wake-up:
    // (5 (w - 45) + 12.5) / 60 us, so w ~63.5 us.
    let timed = p.planned_wake_ns(READ_4K.index(), 1, false);
    let interruptible = p.planned_wake_ns(READ_4K.index(), 1, true);
    assert!((53_000..=55_500).contains(&timed), "timed {timed}");
    assert!(
        (62_000..=64_500).contains(&interruptible),
        "interruptible {interruptible}"
    );
    // Where the device can interrupt, it asks for an interruptible sleep to that plan,
    // less elapsed time and overshoot; where it cannot, a timed one to the timed plan.
    assert_eq!(
        decide_on(&mut p, 200_000, 201_000, 1, true),
        Decision::sleep_interruptible_ns(interruptible - 6_000)
    );
    // Something else ended that sleep 10 us in (the I/O has not slept): it sleeps again
    // for the time left. Once a sleep ran its course (it has slept), it spins.
    assert_eq!(
        decide_slept(&mut p, 200_000, 211_000, 1, true, false),
        Decision::sleep_interruptible_ns(interruptible - 16_000)
    );
    assert_eq!(
        decide_slept(&mut p, 200_000, 230_000, 1, true, true),
        Decision::Spin
    );
    assert_eq!(
        decide_on(&mut p, 300_000, 301_000, 1, false),
        Decision::sleep_ns(timed - 6_000)
    );
    // Timed sleeps (the default) never ask for an interruptible sleep.
    let mut t = Adaptive::default();
    assert_eq!(t.name(), "adaptive");
    assert_eq!(
        Adaptive::with(ADAPTIVE_BUDGET_PCT, true).name(),
        "adaptive:sleep=interruptible"
    );
    wide(&mut t);
    calibrate(&mut t, 5_000, 7_000);
    price_interrupt(&mut t, 5_000);
    assert_eq!(
        decide_on(&mut t, 0, 1_000, 1, true),
        Decision::sleep_ns(timed - 6_000)
    );
}

#[test]
fn a_completion_that_ended_an_interrupt_wait_is_learnt_one_wake_up_earlier() {
    let mut p = Adaptive::with(ADAPTIVE_BUDGET_PCT, true);
    calibrate(&mut p, 5_000, 7_000);
    price_interrupt(&mut p, 5_000);
    let seen = |after_interrupt| Observation {
        bucket: Some(READ_4K),
        submit_ns: 0,
        latency_ns: 50_000,
        slept: None,
        idle_polls: 0,
        censored: true,
        after_interrupt,
    };
    // Censored behind another I/O's wait: nothing learnt.
    p.on_completion(&seen(false));
    assert_eq!(p.buckets[READ_4K.index()].floor_ns, u64::MAX);
    // Its interrupt woke the reactor: learnt at 50 us less the 5 us wake-up.
    p.on_completion(&seen(true));
    assert_eq!(p.buckets[READ_4K.index()].floor_ns, 45_000);
}

#[test]
fn the_overshoot_spread_counts_against_the_budget() {
    // Same device, same median overshoot (5 us), but a spread around it: the plan wakes
    // earlier, since late wake-ups now eat the budget too.
    let plan = |spread_ns: u64| {
        let mut p = Adaptive::default();
        nand_like(&mut p);
        warm_up(&mut p);
        for i in 0..63u64 {
            let ov = 5_000 + (i % 3) * spread_ns - spread_ns;
            p.on_sleep(
                &Slept {
                    requested_ns: 10_000,
                    actual_ns: 10_000 + ov,
                },
                Some(7_000),
            );
        }
        p.planned_wake_ns(READ_4K.index(), 1, false)
    };
    assert!(plan(4_000) < plan(0), "{} vs {}", plan(4_000), plan(0));
}

#[test]
fn wakes_before_the_fastest_latency_when_the_overshoot_spread_requires_it() {
    // A device with a floor: every read takes 40-44 us. Overshoots of 1, 7 and 22 us in
    // equal shares (the top 10 % left out: 21, 21 and 15 of them), so the median is
    // 7 us and a third of wake-ups come 15 us past the plan. Waking at 40 us is then
    // late by 15/57 * 13 us = 3.4 us on average, past the 1.05 us budget (2.5 % of
    // 42 us), yet waking ~31 us into the read is within it: late only on the +15 us
    // wake-ups, by (15/57) * E[(46 - T)+] = (15/57) * 4 us = 1.05 us. A plan that
    // searched only among the latencies seen would give up and spin.
    let mut p = Adaptive::default();
    for i in 0..ADAPTIVE_RESERVOIR as u64 {
        observe(&mut p, 40_000 + (i % 64) * 62, false);
    }
    warm_up(&mut p);
    for i in 0..63u64 {
        let ov = [1_000, 7_000, 22_000][(i % 3) as usize];
        p.on_sleep(
            &Slept {
                requested_ns: 20_000,
                actual_ns: 20_000 + ov,
            },
            Some(5_000),
        );
    }
    let wake_ns = p.planned_wake_ns(READ_4K.index(), 1, false);
    assert!((29_000..33_000).contains(&wake_ns), "{wake_ns}");
    // A new I/O sleeps toward it, less the median overshoot.
    match decide(&mut p, 1_000_000, 1_000_000, 1) {
        Decision::Sleep(d) => {
            assert_eq!(d.as_nanos() as u64, wake_ns - 7_000, "{d:?} for {wake_ns}")
        }
        other => panic!("expected a sleep, got {other:?}"),
    }
}

#[test]
fn does_not_sleep_when_the_sleep_costs_more_cpu_than_it_saves() {
    let mut p = Adaptive::default();
    // A 9 us device: with a 5 us overshoot and 9 us of CPU per sleep, nothing pays
    // (a 3.7 us sleep keeps the thread off the core for 8.7 us, less than it costs).
    for i in 0..ADAPTIVE_RESERVOIR as u64 {
        observe(&mut p, 8_500 + i * 4, false);
    }
    calibrate(&mut p, 5_000, 9_000);
    for now in [100, 500, 1_000] {
        // Spin, or at most a probe: half the room before the fastest completion.
        let d = decide(&mut p, 0, now, 1);
        let probe_max = Duration::from_nanos((8_600 - now) / 2);
        assert!(
            matches!(d, Decision::Spin) || matches!(d, Decision::Sleep(x) if x <= probe_max),
            "{d:?}"
        );
    }
}

#[test]
fn the_exact_samples_are_sorted_once_per_32_draws_and_32_new_samples() {
    let mut d = Distribution::EMPTY;
    for x in 1..=EXACT_SAMPLES as u64 {
        d.exact.add(x * 1_000);
    }
    let sorted = d.exact.refreshes();
    // New samples but no draws: nothing sorts them.
    for x in 0..100 {
        d.exact.add(200_000 + x);
    }
    assert_eq!(d.exact.refreshes(), sorted);
    // 31 draws see the old order (a stand-in for (150, 250] us falls back to the
    // midpoint: no sorted sample lies there yet); the 32nd sorts, and draws from the
    // new samples.
    for _ in 0..EXACT_REFRESH_EVERY - 1 {
        assert_eq!(d.impute_ns(150_000, 250_000, 0), 200_000);
    }
    assert_eq!(d.exact.refreshes(), sorted);
    let drawn = d.impute_ns(150_000, 250_000, 0);
    assert_eq!(d.exact.refreshes(), sorted + 1);
    assert!((200_000..200_100).contains(&drawn), "{drawn}");
    // Many draws and no new samples: no further sort.
    for _ in 0..100 {
        d.impute_ns(150_000, 250_000, 0);
    }
    assert_eq!(d.exact.refreshes(), sorted + 1);
}

#[test]
fn censored_completions_are_not_learnt_as_seen() {
    let mut p = Adaptive::default();
    nand_like(&mut p);
    let mean_before = p.buckets[READ_4K.index()].mean_ns();
    // Outstanding while the reactor slept for another I/O: ignored.
    for _ in 0..1_000 {
        observe(&mut p, 500_000, true);
    }
    assert_eq!(p.buckets[READ_4K.index()].mean_ns(), mean_before);
    // Slept for 60 us, found on waking 90 us after submission: it completed in
    // (30, 90] us. Exact latencies measured in that interval stand in for it (the last
    // 128 of nand_like's, 80-90 us), not the middle of the sleep (60 us), which lies
    // below every real completion.
    let slept_for = |p: &mut Adaptive, latency_ns: u64| {
        p.on_completion(&Observation {
            bucket: Some(READ_4K),
            submit_ns: 0,
            latency_ns,
            slept: Some(Slept {
                requested_ns: 55_000,
                actual_ns: 60_000,
            }),
            idle_polls: 1,
            censored: true,
            after_interrupt: false,
        })
    };
    for _ in 0..2 * ADAPTIVE_RESERVOIR {
        slept_for(&mut p, 90_000);
    }
    let dist = &p.buckets[READ_4K.index()];
    let xs = dist.latencies.samples();
    assert!(xs.iter().all(|x| (80_000..=90_000).contains(x)), "{xs:?}");
    assert!(
        (83_000..=87_000).contains(&dist.mean_ns()),
        "{}",
        dist.mean_ns()
    );
    // Stand-ins are spread over the exact samples, not one value repeated.
    assert!(xs[xs.len() - 1] - xs[0] > 5_000, "{xs:?}");
    // Stand-ins never lower the service-time floor.
    assert_eq!(dist.floor_ns, 70_000);
    // No latency measured in the interval: its middle.
    for _ in 0..2 * ADAPTIVE_RESERVOIR {
        slept_for(&mut p, 65_000);
    }
    assert_eq!(p.buckets[READ_4K.index()].mean_ns(), 35_000);
}

mod lateness;
mod load;
