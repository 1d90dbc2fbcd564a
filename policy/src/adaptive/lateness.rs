//! The lateness check: the lateness `adaptive`'s sleeps really cause, each censored
//! completion against its stand-in, over windows of [`LATENESS_WINDOW`] lone I/Os (queue
//! depth one). The budget the plan spends is scaled to meet the budget; where even the
//! smallest scale is too late, only a share of the I/Os sleep; where even the smallest share
//! stays too late, none do for a while (see [`FLOOR_LATE_WINDOWS`]). Its windows are also
//! the sleep trial's, which spins through some of them (nothing to judge there).

use super::sleep_trial::{SleepTrial, CLIP_MEANS};
use crate::policy::Observation;

/// The lateness check: over every this many I/Os decided for at queue depth 1, the
/// lateness the sleeps really caused (each censored completion against its stand-in) is
/// compared with the budget, and the budget the plan spends is scaled to meet it. The scale
/// moves by at most a factor of sqrt(2) per window and stays within these bounds.
pub(super) const LATENESS_WINDOW: u32 = 512;
pub(super) const BUDGET_SCALE_MIN: f64 = 0.125;
pub(super) const BUDGET_SCALE_MAX: f64 = 2.0;
/// Once the scale is at its floor and the sleeps are still too late, what makes them late is
/// the overshoot's tail (the plan leaves out its top tenth as machine noise): a wake-up far
/// past the plan makes an I/O late however early the plan wakes, short of not sleeping. The
/// check then lets only a share of the I/Os sleep (the others spin from submission), which
/// cuts the lateness in proportion; the share moves like the scale, and never below this.
pub(super) const SLEEP_SHARE_MIN: f64 = 0.25;
/// Where even the smallest share is too late, window after window, sleeping at queue depth 1
/// does not meet the budget on this machine at all: sparse sleeps can be later than dense
/// ones (a vCPU that rarely halts is woken slowly), so a smaller share need not help. After
/// this many windows in a row at both floors and late past the budget (harmless sleeps would
/// do that by chance once in 2^8 runs), the budgeted sleeps of lone I/Os stop for
/// [`SLEEP_HOLD_WINDOWS`] windows, then are tried again at the floors.
pub(super) const FLOOR_LATE_WINDOWS: u32 = 8;
pub(super) const SLEEP_HOLD_WINDOWS: u32 = 64;

/// The lateness check's state: the scale and share it sets, and the window in progress.
#[derive(Clone)]
pub(super) struct Lateness {
    /// The budget as a fraction of the mean: the lateness aimed at.
    target: f64,
    /// What the plan's budget is multiplied by (see [`LATENESS_WINDOW`]), and how often it
    /// changed (plans made with an older scale are stale).
    pub(super) budget_scale: f64,
    pub(super) budget_scale_changes: u64,
    /// The share of budgeted sleeps at queue depth 1 taken (see [`SLEEP_SHARE_MIN`]), and
    /// the credit that spreads them evenly among the I/Os.
    pub(super) sleep_share: f64,
    share_credit: f64,
    /// The current window: I/Os counted, those that slept, and the sum of their lateness
    /// as a fraction of their bucket's mean.
    window_ios: u32,
    window_slept: u32,
    window_late: f64,
    /// Windows in a row at both floors that were late past the budget, and the windows
    /// left in which no lone I/O's budgeted sleep is taken (see [`FLOOR_LATE_WINDOWS`]).
    pub(super) floor_late_windows: u32,
    pub(super) hold_windows: u32,
    /// The sum of the current window's latencies as seen, each clipped, for the trial.
    window_seen_ns: f64,
    /// Which windows take the budgeted sleeps, from what they cost by experiment.
    pub(super) trial: SleepTrial,
}

impl Lateness {
    /// A check against a budget of `budget_pct` percent of the mean, unscaled.
    pub(super) fn new(budget_pct: f64) -> Lateness {
        Lateness {
            target: budget_pct / 100.0,
            budget_scale: 1.0,
            budget_scale_changes: 0,
            sleep_share: 1.0,
            share_credit: 0.0,
            window_ios: 0,
            window_slept: 0,
            window_late: 0.0,
            floor_late_windows: 0,
            hold_windows: 0,
            window_seen_ns: 0.0,
            trial: SleepTrial::new(),
        }
    }

    fn assert_invariants(&self) {
        debug_assert!(
            (BUDGET_SCALE_MIN..=BUDGET_SCALE_MAX).contains(&self.budget_scale),
            "budget scale {}",
            self.budget_scale
        );
        debug_assert!(
            (SLEEP_SHARE_MIN..=1.0).contains(&self.sleep_share),
            "sleep share {}",
            self.sleep_share
        );
        debug_assert!((0.0..1.0).contains(&self.share_credit));
        debug_assert!(self.window_slept <= self.window_ios);
        debug_assert!(self.window_ios < LATENESS_WINDOW);
        debug_assert!(self.window_late >= 0.0);
        debug_assert!(self.floor_late_windows < FLOOR_LATE_WINDOWS);
        debug_assert!(self.hold_windows <= SLEEP_HOLD_WINDOWS);
    }

    /// Whether a budgeted sleep of a lone I/O is taken: none in a window the sleep trial
    /// spins through; otherwise all while the share is whole, or the share of them, spread
    /// evenly (every fourth, every other, ...), and the rest spin.
    pub(super) fn admits_sleep(&mut self) -> bool {
        self.assert_invariants();
        if self.hold_windows > 0 || !self.trial.window_sleeps() {
            return false;
        }
        if self.sleep_share >= 1.0 {
            return true;
        }
        self.share_credit += self.sleep_share;
        let admitted = if self.share_credit >= 1.0 {
            self.share_credit -= 1.0;
            true
        } else {
            false
        };
        self.assert_invariants();
        admitted
    }

    /// Counts the completion `seen` of the current I/O, learnt as `learnt_ns` (its stand-in
    /// when `drawn`), in a bucket whose mean latency is `mean_ns`. It is late by the time
    /// from what it is learnt as to when it was seen: from its stand-in, if a sleep censored
    /// it; one interrupt wake-up, if it ended an interrupt wait. Nothing if it was polled for
    /// (a spinning reactor takes as long to see it).
    pub(super) fn observe(
        &mut self,
        seen: &Observation,
        learnt_ns: u64,
        drawn: bool,
        mean_ns: u64,
    ) {
        debug_assert!(mean_ns > 0);
        let seen_ns = seen.latency_ns.min(mean_ns.saturating_mul(CLIP_MEANS));
        let (slept, late_ns) = if drawn || seen.after_interrupt {
            (true, seen.latency_ns.saturating_sub(learnt_ns))
        } else {
            (seen.slept.is_some(), 0)
        };
        self.check(slept, late_ns as f64 / mean_ns as f64, seen_ns);
    }

    /// Counts one I/O decided for at queue depth 1 in the lateness check: whether it slept,
    /// the lateness its sleep caused as a fraction of its bucket's mean, and its latency as
    /// seen, clipped (for the sleep trial, which every window's end is told). At the end of a
    /// window with enough sleeps, the budget's scale moves toward the one that meets the
    /// budget (halfway, in log terms); once the scale is at its floor, the share of I/Os that
    /// sleep moves instead (down while too late, and back up to 1 before the scale rises
    /// again). A window with few sleeps brings both back toward 1, so a scale that stopped
    /// every sleep does not stick.
    pub(super) fn check(&mut self, slept: bool, late_fraction: f64, seen_ns: u64) {
        self.assert_invariants();
        debug_assert!(late_fraction >= 0.0);
        self.window_ios += 1;
        self.window_slept += u32::from(slept);
        self.window_late += late_fraction;
        self.window_seen_ns += seen_ns as f64;
        if self.window_ios < LATENESS_WINDOW {
            self.assert_invariants();
            return;
        }
        let trial_spun = !self.trial.window_sleeps();
        self.trial.end_window(
            self.window_ios,
            self.window_slept,
            self.window_seen_ns,
            self.target,
        );
        if self.hold_windows > 0 {
            // No budgeted sleep was taken: nothing to judge, and the floors stay for the
            // sleeps tried again after the hold.
            self.hold_windows -= 1;
            self.end_window();
            return;
        }
        if trial_spun {
            // The sleep trial spun through this window by design: nothing to judge either.
            self.end_window();
            return;
        }
        let target = self.target;
        let factor = if self.window_slept >= LATENESS_WINDOW / 8 {
            let late = self.window_late / f64::from(self.window_ios);
            (target / late.max(f64::MIN_POSITIVE))
                .clamp(0.5, 2.0)
                .sqrt()
        } else {
            (1.0 / self.budget_scale).clamp(0.5, 2.0).sqrt()
        };
        // (A product of factors can land a rounding error above the floor.)
        let at_floor = self.budget_scale <= BUDGET_SCALE_MIN * (1.0 + 1e-9);
        let at_floors = at_floor && self.sleep_share <= SLEEP_SHARE_MIN;
        if at_floors && factor < 1.0 && self.window_slept >= LATENESS_WINDOW / 8 {
            self.floor_late_windows += 1;
            if self.floor_late_windows == FLOOR_LATE_WINDOWS {
                self.floor_late_windows = 0;
                self.hold_windows = SLEEP_HOLD_WINDOWS;
            }
        } else {
            self.floor_late_windows = 0;
        }
        let share = if factor < 1.0 && at_floor {
            (self.sleep_share * factor).max(SLEEP_SHARE_MIN)
        } else {
            (self.sleep_share * factor.max(1.0)).min(1.0)
        };
        // The share takes the window's correction while it is below 1 or the scale cannot
        // fall further; the scale takes it otherwise.
        let factor = if share != self.sleep_share {
            self.sleep_share = share;
            1.0
        } else {
            factor
        };
        let scale = (self.budget_scale * factor).clamp(BUDGET_SCALE_MIN, BUDGET_SCALE_MAX);
        if scale != self.budget_scale {
            self.budget_scale = scale;
            self.budget_scale_changes += 1;
        }
        self.end_window();
    }

    /// A new window begins.
    fn end_window(&mut self) {
        self.window_ios = 0;
        self.window_slept = 0;
        self.window_late = 0.0;
        self.window_seen_ns = 0.0;
        self.assert_invariants();
    }
}
