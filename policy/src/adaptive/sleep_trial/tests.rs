use super::*;

/// Lone I/Os per window, and the latency budget, as a fraction of the mean.
const IOS: u32 = 512;
const BUDGET: f64 = 0.025;

/// Ends `windows` windows of `trial`, each with the mean latency `figure` gives for its
/// index and whether it sleeps (every I/O of a sleeping window slept when `sleeps_taken`,
/// none otherwise); returns how many of them slept.
fn run(
    trial: &mut SleepTrial,
    windows: u32,
    sleeps_taken: bool,
    mut figure: impl FnMut(u32, bool) -> f64,
) -> u32 {
    let mut sleeping = 0;
    for w in 0..windows {
        let sleeps = trial.window_sleeps();
        sleeping += u32::from(sleeps);
        let slept = if sleeps && sleeps_taken { IOS } else { 0 };
        trial.end_window(IOS, slept, figure(w, sleeps) * f64::from(IOS), BUDGET);
    }
    sleeping
}

/// Sleeping windows `cost` later than spinning ones, around 50 us.
fn costing(cost: f64) -> impl FnMut(u32, bool) -> f64 {
    move |_, sleeps| {
        if sleeps {
            50_000.0 * (1.0 + cost)
        } else {
            50_000.0
        }
    }
}

/// Which of the next `windows` windows of `trial` sleep, every I/O of a sleeping one
/// taking its sleep, at the latencies `costing(cost)` gives.
fn pattern(trial: &mut SleepTrial, windows: u32, cost: f64) -> Vec<bool> {
    let mut figure = costing(cost);
    (0..windows)
        .map(|w| {
            let sleeps = trial.window_sleeps();
            let slept = if sleeps { IOS } else { 0 };
            trial.end_window(IOS, slept, figure(w, sleeps) * f64::from(IOS), BUDGET);
            sleeps
        })
        .collect()
}

#[test]
fn while_sleeps_look_cheap_a_trial_sleeps_through_two_windows_in_three() {
    let mut trial = SleepTrial::new();
    assert_eq!(
        pattern(&mut trial, 6, 0.01),
        [true, false, true, true, false, true]
    );
    // Sleeps 3.5 % later, past the 2.5 % budget: a trial sleeping in two windows of three
    // spends two thirds of that, within it, so it goes on that way; the share it finds
    // pays for the rest.
    let mut trial = SleepTrial::new();
    let sleeping = pattern(&mut trial, TRIAL_WINDOWS, 0.035);
    assert_eq!(sleeping.iter().filter(|&&sleeps| sleeps).count(), 24);
    assert!(trial.share < 1.0, "share {}", trial.share);
}

#[test]
fn once_sleeps_look_dear_a_trial_sleeps_through_one_window_in_three() {
    // Sleeps 10 % later, four budgets. Once three triples have measured it, the rest of
    // the trial sleeps in the middle window of each triple only.
    let mut trial = SleepTrial::new();
    let twice = [true, false, true];
    let once = [false, true, false];
    assert_eq!(
        pattern(&mut trial, 12, 0.10),
        [twice, twice, twice, once].concat()
    );
    assert_eq!(
        pattern(&mut trial, TRIAL_WINDOWS - 12, 0.10)
            .iter()
            .filter(|&&sleeps| sleeps)
            .count(),
        usize::try_from(TRIPLES - 4).unwrap()
    );
    assert_eq!(trial.trials, 1);
    // The next trial starts that way, from what this one found, after the hold; sleeps
    // found cheap in its first three triples bring the two sleeping windows back.
    run(&mut trial, HOLD_WINDOWS, true, costing(0.10));
    assert_eq!(
        pattern(&mut trial, 12, 0.0),
        [once, once, once, twice].concat()
    );
}

#[test]
fn sleeps_within_the_budget_keep_every_window_sleeping() {
    let mut trial = SleepTrial::new();
    run(&mut trial, TRIAL_WINDOWS, true, costing(0.01));
    let cost = trial.cost.expect("a cost");
    assert!((cost - 0.01).abs() < 1e-9, "cost {cost}");
    assert_eq!(trial.share, 1.0);
    assert_eq!(trial.trials, 1);
    // Every window of the hold sleeps.
    assert_eq!(
        run(&mut trial, HOLD_WINDOWS, true, costing(0.01)),
        HOLD_WINDOWS
    );
}

#[test]
fn sleeps_past_the_budget_sleep_in_a_share_of_windows_that_meets_it_with_the_trial() {
    let mut trial = SleepTrial::new();
    run(&mut trial, TRIAL_WINDOWS, true, costing(0.10));
    let cost = trial.cost.expect("a cost");
    assert!((cost - 0.10).abs() < 1e-9, "cost {cost}");
    // Over the trial and the hold, its sleeping windows and the share's together cost the
    // budget: the budget over all windows, less what the trial's cost (two in each of its
    // first three triples, then one in each of the other nine), over the hold's.
    let trial_sleeping = 2 * 3 + (TRIPLES - 3);
    let expected = (0.025 * 360.0 - 0.10 * f64::from(trial_sleeping)) / (0.10 * 324.0);
    assert!(
        (trial.share - expected).abs() < 1e-9,
        "share {}",
        trial.share
    );
    // They are spread evenly: never two in a row.
    let mut last = false;
    let mut sleeping = 0;
    for _ in 0..HOLD_WINDOWS {
        let sleeps = trial.window_sleeps();
        assert!(!(sleeps && last), "two sleeping windows in a row");
        last = sleeps;
        sleeping += u32::from(sleeps);
        trial.end_window(IOS, IOS, 50_000.0 * f64::from(IOS), BUDGET);
    }
    // Within one window's cost of the budget (the credit spreading them starts empty).
    let windows = f64::from(TRIAL_WINDOWS + HOLD_WINDOWS);
    let cost_over_all = f64::from(trial_sleeping + sleeping) * 0.10 / windows;
    assert!(
        (cost_over_all - BUDGET).abs() <= 0.10 / windows + 1e-12,
        "{sleeping} of {HOLD_WINDOWS} windows slept: {cost_over_all} in all"
    );
    // Then a trial again, from a spinning window (the sleeps were dear); cheap sleeps now
    // bring the share back.
    assert!(!trial.window_sleeps());
    run(&mut trial, TRIAL_WINDOWS, true, costing(0.0));
    assert_eq!(trial.trials, 2);
    assert_eq!(trial.share, 1.0);
}

#[test]
fn where_the_trial_alone_spends_the_budget_no_window_of_the_hold_sleeps() {
    // Sleeps twice as long: the trial's 15 sleeping windows alone cost more than 2.5 % of
    // 360 windows.
    let mut trial = SleepTrial::new();
    run(&mut trial, TRIAL_WINDOWS, true, costing(1.0));
    assert_eq!(trial.share, 0.0);
    assert_eq!(run(&mut trial, HOLD_WINDOWS, true, costing(1.0)), 0);
    // The next trial still measures them, in one window of three.
    assert_eq!(run(&mut trial, TRIAL_WINDOWS, true, costing(1.0)), TRIPLES);
    assert_eq!(trial.trials, 2);
    assert!(trial.cost.is_some_and(|cost| (cost - 1.0).abs() < 1e-9));
}

#[test]
fn a_steady_drift_is_no_cost_in_either_shape() {
    // The device gets 1 % slower every window, and sleeping costs nothing: each spinning
    // window sits between two sleeping ones, so the drift weighs on both alike. (Compared
    // with the window before it alone, spinning would look 1 % faster every time.)
    let mut trial = SleepTrial::new();
    run(&mut trial, TRIAL_WINDOWS, true, |w, _| {
        50_000.0 * (1.0 + 0.01 * f64::from(w))
    });
    let cost = trial.cost.expect("a cost");
    assert!(cost.abs() < 1e-3, "cost {cost}");
    assert_eq!(trial.share, 1.0);
    // Sleeps 10 % later, on the same drift: the triples after the third have a sleeping
    // window between two spinning ones, and the drift cancels there too.
    let mut trial = SleepTrial::new();
    run(&mut trial, TRIAL_WINDOWS, true, |w, sleeps| {
        50_000.0 * (1.0 + 0.01 * f64::from(w)) * if sleeps { 1.10 } else { 1.0 }
    });
    let cost = trial.cost.expect("a cost");
    assert!((cost - 0.10).abs() < 1e-3, "cost {cost}");
}

#[test]
fn windows_that_took_few_sleeps_say_nothing() {
    // The plan found no sleep paying: the "sleeping" windows spun too, and however their
    // figures fall the trial learns no cost and leaves every window to the plan.
    let mut trial = SleepTrial::new();
    run(&mut trial, TRIAL_WINDOWS, false, costing(0.5));
    assert_eq!(trial.cost, None);
    assert_eq!(trial.share, 1.0);
    assert_eq!(trial.trials, 1);
    // The plan may have been warming up: a trial again after as many windows as one lasts,
    // not a whole hold, and this one, with the sleeps taken, finds their cost.
    assert_eq!(
        run(&mut trial, TRIAL_WINDOWS, false, costing(0.5)),
        TRIAL_WINDOWS
    );
    run(&mut trial, TRIAL_WINDOWS, true, costing(0.5));
    assert_eq!(trial.trials, 2);
    assert!(trial.cost.is_some());
}

#[test]
fn triples_that_say_nothing_do_not_end_a_trial() {
    // The plan takes no sleep for the first eleven triples (it is warming up), then
    // sleeps, 10 % later than spinning: the trial goes on until twelve triples count,
    // rather than ending with one counted and holding every window sleeping.
    let mut trial = SleepTrial::new();
    let warming = 3 * (TRIPLES - 1);
    run(&mut trial, warming, false, costing(0.10));
    run(&mut trial, TRIAL_WINDOWS - 1, true, costing(0.10));
    assert_eq!(trial.trials, 0);
    run(&mut trial, 1, true, costing(0.10));
    assert_eq!(trial.trials, 1);
    let cost = trial.cost.expect("a cost");
    assert!((cost - 0.10).abs() < 1e-9, "cost {cost}");
    assert!(trial.share < 1.0);
}

#[test]
fn a_trial_where_few_triples_count_ends_after_twice_its_length() {
    // The plan takes its sleeps in one triple of three (sleeps 10 % later): the trial
    // runs 24 triples, counts 8, and concludes from them, the share paying for the 8
    // triples' sleeping windows only (the others took too few sleeps to cost much).
    let mut trial = SleepTrial::new();
    let mut sleeping_counted = 0;
    for triple in 0..2 * TRIPLES {
        for _ in 0..3 {
            assert_eq!(trial.trials, 0);
            let sleeps = trial.window_sleeps();
            let taken = sleeps && triple % 3 == 0;
            sleeping_counted += u32::from(sleeps && triple % 3 == 0);
            let figure = if taken { 55_000.0 } else { 50_000.0 };
            let slept = if taken { IOS } else { 0 };
            trial.end_window(IOS, slept, figure * f64::from(IOS), BUDGET);
        }
    }
    assert_eq!(trial.trials, 1);
    let cost = trial.cost.expect("a cost from 8 triples");
    assert!((cost - 0.10).abs() < 1e-9, "cost {cost}");
    let expected = (0.025 * f64::from(3 * 8 + HOLD_WINDOWS) - 0.10 * f64::from(sleeping_counted))
        / (0.10 * f64::from(HOLD_WINDOWS));
    assert!(
        (trial.share - expected).abs() < 1e-9,
        "share {}",
        trial.share
    );
}

#[test]
fn a_trial_that_gives_up_leaves_the_next_ones_shape_to_the_last_cost() {
    // Sleeps 10 % later: one window in three sleeps from the fourth triple on, and
    // after the hold the next trial starts that way.
    let mut trial = SleepTrial::new();
    run(
        &mut trial,
        TRIAL_WINDOWS + HOLD_WINDOWS,
        true,
        costing(0.10),
    );
    assert!(!trial.window_sleeps());
    // Twelve triples in a row take no sleeps (a lateness-check hold, say): that trial
    // gives up, with no cost.
    run(&mut trial, TRIAL_WINDOWS, false, costing(0.10));
    assert_eq!(trial.trials, 2);
    assert_eq!(trial.cost, None);
    // After the windows every one sleeps in, the next trial still starts with one
    // sleeping window in three: the cost measured before is the last one known.
    run(&mut trial, TRIAL_WINDOWS, true, costing(0.10));
    assert_eq!(pattern(&mut trial, 3, 0.10), [false, true, false]);
}

/// Sleeping windows `cost` later than spinning ones, and `scatter` later or earlier than
/// that (in log terms) by turns, a triple of windows at a time.
fn scattering(cost: f64, scatter: f64) -> impl FnMut(u32, bool) -> f64 {
    move |w, sleeps| {
        let off = if (w / 3) % 2 == 0 { scatter } else { -scatter };
        if sleeps {
            50_000.0 * (1.0 + cost) * off.exp()
        } else {
            50_000.0
        }
    }
}

#[test]
fn a_trial_whose_triples_scatter_pays_for_its_cost_one_and_a_half_standard_errors_higher() {
    // Sleeps 10 % later, measured exactly, against the same cost measured by triples that
    // scatter: 5 % later and 5 % earlier than that, by turns (in log terms).
    let mut steady = SleepTrial::new();
    run(&mut steady, TRIAL_WINDOWS, true, costing(0.10));
    let scatter: f64 = 0.05;
    let mut scattered = SleepTrial::new();
    run(
        &mut scattered,
        TRIAL_WINDOWS,
        true,
        scattering(0.10, scatter),
    );
    // Both measure the same cost.
    let cost = scattered.cost.expect("a cost");
    assert!((cost - 0.10).abs() < 1e-9, "cost {cost}");
    // The scattered trial's share pays for it one and a half standard errors higher: the
    // triples' standard deviation (12 of them, half each way) over the square root of 12.
    let sd = scatter * (12.0_f64 / 11.0).sqrt();
    let paid = (1.10_f64.ln() + 1.5 * sd / 12.0_f64.sqrt()).exp() - 1.0;
    let trial_sleeping = 2 * 3 + (TRIPLES - 3);
    let expected = share_for(paid, BUDGET, TRIPLES, trial_sleeping);
    assert!(
        (scattered.share - expected).abs() < 1e-9,
        "share {} against {expected}",
        scattered.share
    );
    assert!(scattered.share < steady.share - 0.01);
    // A cost just within the budget, measured by triples that scatter, no longer lets
    // every window sleep.
    let mut near = SleepTrial::new();
    run(&mut near, TRIAL_WINDOWS, true, scattering(0.024, scatter));
    assert!(near.cost.is_some_and(|cost| cost < BUDGET));
    assert!(near.share < 1.0, "share {}", near.share);
}
