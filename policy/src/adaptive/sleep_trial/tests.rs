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

#[test]
fn a_trial_sleeps_through_two_windows_in_three() {
    let mut trial = SleepTrial::new();
    let sleeping: Vec<bool> = (0..6)
        .map(|_| {
            let sleeps = trial.window_sleeps();
            trial.end_window(IOS, IOS, 50_000.0 * f64::from(IOS), BUDGET);
            sleeps
        })
        .collect();
    assert_eq!(sleeping, [true, false, true, true, false, true]);
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
    // budget: the budget over all windows, less what the trial's cost, over the hold's.
    let expected = (0.025 * 360.0 - 0.10 * 24.0) / (0.10 * 324.0);
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
    let cost_over_all = f64::from(2 * TRIPLES + sleeping) * 0.10 / windows;
    assert!(
        (cost_over_all - BUDGET).abs() <= 0.10 / windows + 1e-12,
        "{sleeping} of {HOLD_WINDOWS} windows slept: {cost_over_all} in all"
    );
    // Then a trial again, from a sleeping window; cheap sleeps now bring the share back.
    assert!(trial.window_sleeps());
    run(&mut trial, TRIAL_WINDOWS, true, costing(0.0));
    assert_eq!(trial.trials, 2);
    assert_eq!(trial.share, 1.0);
}

#[test]
fn where_the_trial_alone_spends_the_budget_no_window_of_the_hold_sleeps() {
    // Sleeps 50 % later: the trial's 24 sleeping windows alone cost more than 2.5 % of
    // 360 windows.
    let mut trial = SleepTrial::new();
    run(&mut trial, TRIAL_WINDOWS, true, costing(0.5));
    assert_eq!(trial.share, 0.0);
    assert_eq!(run(&mut trial, HOLD_WINDOWS, true, costing(0.5)), 0);
    // The next trial still measures them.
    assert!(trial.window_sleeps());
    run(&mut trial, TRIAL_WINDOWS, true, costing(0.5));
    assert_eq!(trial.trials, 2);
}

#[test]
fn a_steady_drift_is_no_cost() {
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
