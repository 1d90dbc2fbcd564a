//! The sleep trial: what `adaptive`'s budgeted sleeps at queue depth 1 cost in latency, by
//! experiment, and the share of the lateness check's windows in which they are taken.
//!
//! The lateness check counts, for each read a sleep censored, the time from a stand-in to
//! when it was seen, and nothing for a read seen after the wake-up. Where a sleep slows the
//! read itself (a halted vCPU takes the completion's interrupt late, the task work that
//! posts it runs late) that count misses the cost: on a virtio disk the check has read
//! about its budget while the sleeps made the reads several times the budget later than
//! spinning (docs/lab/ has the campaign). Spun reads interleaved among sleeping ones did
//! not see it either: they were slowed with them.
//!
//! So the trial compares whole windows of the lateness check
//! ([`LATENESS_WINDOW`](super::lateness::LATENESS_WINDOW) lone I/Os each), in threes,
//! [`TRIPLES`] times: a window that takes the budgeted sleeps between two that spin through
//! them, or a spinning window between two sleeping ones. A window's figure is the mean
//! latency of its I/Os as seen (lateness included), each clipped at [`CLIP_MEANS`] times
//! its bucket's mean so that one stall of the machine does not decide a triple. Each triple
//! compares its middle window with the mean of the two around it, so a steady drift in the
//! device's latency weighs on both sides alike. Either shape measures the cost as precisely
//! (one window against the mean of two); they differ in what the trial itself costs: two
//! thirds of the cost, or one third. While the cost measured (the trial's own once
//! [`SHAPE_TRIPLES`] triples counted, before that the last a trial measured) puts two
//! thirds of it within the budget, a triple sleeps in two windows (sleeping is what pays);
//! past it, in one: on a device where sleeps are dear, a trial that slept in two windows of
//! three would spend more than the budget by itself, which matters most in a run no longer
//! than a few trials. The cost is the geometric mean, over the triples, of the sleeping
//! windows' figure over the spinning ones', less one; the share pays for it one and a
//! half standard errors higher ([`MARGIN_SES`]). Where that is within the budget every window
//! sleeps; otherwise only a share of the windows sleep (spread evenly), such that the
//! trial's own sleeping windows and the share's together cost the budget (none sleep where
//! the trial's alone spend it). The share holds for [`HOLD_WINDOWS`] windows, then a trial
//! starts again: the device and the machine change.
//!
//! A triple either of whose sleeping windows took few sleeps (the plan found none paying,
//! or is still warming up) says nothing: it is not counted, and the trial goes on until
//! [`TRIPLES`] are, for at most [`TRIPLES_MAX`] triples. Where that many in a row say
//! nothing, or fewer than half of [`TRIPLES`] counted, the trial gives up: every window
//! sleeps (the lateness check alone then judges the few sleeps) for [`TRIAL_WINDOWS`]
//! windows, and a trial starts again.
//!
//! No probe sleep is taken in a window that spins through its budgeted sleeps, the trial's
//! or the share's (see `probe`): a burst's first sleeps are the slow ones on a VM, and the
//! trial would read them as part of what spinning costs, while the share's spinning windows
//! would pay for them outside the budget. A burst due waits for a lone I/O the plan spins
//! in a sleeping window (or for a deeper queue); meanwhile the budgeted sleeps keep the
//! overshoot measured.

/// Triples of windows counted per trial: enough, on a VM's disk whose windows scatter by
/// more than the budget, to tell a cost of a few budgets from one within it.
pub(super) const TRIPLES: u32 = 12;
/// Windows in a trial whose triples all count.
const TRIAL_WINDOWS: u32 = 3 * TRIPLES;
/// Triples a trial runs at most: where sleeps are taken in some windows and not others, it
/// concludes from those that counted if they are at least half of [`TRIPLES`].
const TRIPLES_MAX: u32 = 2 * TRIPLES;
/// Triples counted before their cost chooses the next triple's shape (one triple's ratio
/// scatters too much to say): until then the last cost a trial measured chooses.
const SHAPE_TRIPLES: u32 = 3;
/// Windows the share found holds for before the next trial: the trial takes about a tenth
/// of the time.
pub(super) const HOLD_WINDOWS: u32 = 9 * TRIAL_WINDOWS;
/// The share pays for the cost measured this many standard errors higher. A trial's
/// cost is an estimate, and its errors do not cancel over the trials: one measured low
/// lets more windows sleep than one measured as much too high takes away (the share goes
/// as the budget over the cost), and one measured under the budget lets every window sleep
/// at the whole of the real cost. Where the triples scatter as much as the cost (a VM's
/// disk), sharing by the estimate alone spends more than the budget on average, and half a
/// standard error more brings the estimate's own noise back within it. But there the cost
/// the trials measure has also come out lower than what the same sleeps cost against a
/// policy that never sleeps, taking turns with it in one run, for a reason not found
/// (docs/lab/ has the campaigns and a simulation of the share). The wider margin pays for
/// most of that gap, at the price of fewer sleeping windows where the cost is a few
/// budgets. Where the triples scatter little (an emulated device) the margin is small, and
/// a cost well within the budget still lets every window sleep.
const MARGIN_SES: f64 = 1.5;
// The standard error needs two triples or more; a trial concludes from half of TRIPLES.
const _: () = assert!(TRIPLES / 2 >= 2);
/// A latency counts in its window's figure up to this many times its bucket's mean.
pub(super) const CLIP_MEANS: u64 = 8;

/// The trial's state; see the module's documentation.
#[derive(Clone, Debug)]
pub(super) struct SleepTrial {
    /// The window in progress within the triple in progress (0..3), or `None` while a
    /// share holds.
    arm: Option<u32>,
    /// The triple in progress: whether it sleeps in two windows of three (the outer ones)
    /// or one (the middle one), and its figures so far (its sleeping windows that took too
    /// few sleeps as `None`).
    sleeps_twice: bool,
    figures: [Option<f64>; 3],
    /// Over the triples counted so far: how many, their sleeping windows, the log of the
    /// first one's ratio (the sleeping windows' mean figure over the spinning ones'), and
    /// the sums of each one's log ratio less the first's (and of its square). Summed from
    /// the first, triples that agree have no scatter at all, not a rounding's worth that
    /// the margin would multiply. The triples in a row that were not counted, and all the
    /// trial ran.
    triples_counted: u32,
    trial_sleeping: u32,
    log_ratio_first: f64,
    log_ratio_sum: f64,
    log_ratio_sq_sum: f64,
    triples_uncounted: u32,
    triples_run: u32,
    /// The share of windows that sleep while it holds, the credit that spreads them, the
    /// windows it still holds for, and whether the window in progress sleeps.
    pub(super) share: f64,
    credit: f64,
    hold_windows: u32,
    sleeps: bool,
    /// The cost the last trial measured, as a fraction of the spinning windows' mean, if
    /// its triples counted (the share pays for it [`MARGIN_SES`] higher); and how many
    /// trials ended.
    pub(super) cost: Option<f64>,
    pub(super) trials: u64,
    /// The last cost a trial measured (one that gave up since leaves it).
    last_cost: Option<f64>,
}

/// The share of a hold's windows that sleep where they cost `cost` (past `budget`, both
/// fractions of the mean), after a trial that counted `triples` triples and slept in
/// `trial_sleeping` of their windows: over those and the hold after them, the trial's
/// sleeping windows and the share's together cost the budget; none if the trial's alone
/// spend it.
fn share_for(cost: f64, budget: f64, triples: u32, trial_sleeping: u32) -> f64 {
    debug_assert!(cost > budget && budget > 0.0);
    debug_assert!((triples..=2 * triples).contains(&trial_sleeping));
    let all = f64::from(3 * triples + HOLD_WINDOWS);
    let share =
        (budget * all - cost * f64::from(trial_sleeping)) / (cost * f64::from(HOLD_WINDOWS));
    share.clamp(0.0, 1.0)
}

/// Whether triples that sleep in two windows of three, at a cost of `cost` per sleeping
/// window, keep the trial itself within `budget` (both fractions of the mean).
fn twice_fits(cost: f64, budget: f64) -> bool {
    2.0 * cost <= 3.0 * budget
}

/// Whether window `arm` of a triple takes the budgeted sleeps, in a triple that sleeps in
/// two windows of three (the outer ones) or in one (the middle one).
fn arm_sleeps(arm: u32, sleeps_twice: bool) -> bool {
    (arm != 1) == sleeps_twice
}

impl SleepTrial {
    /// A trial from the first window.
    pub(super) fn new() -> SleepTrial {
        SleepTrial {
            arm: Some(0),
            sleeps_twice: true,
            figures: [None; 3],
            triples_counted: 0,
            trial_sleeping: 0,
            log_ratio_first: 0.0,
            log_ratio_sum: 0.0,
            log_ratio_sq_sum: 0.0,
            triples_uncounted: 0,
            triples_run: 0,
            share: 1.0,
            credit: 0.0,
            hold_windows: 0,
            sleeps: arm_sleeps(0, true),
            cost: None,
            trials: 0,
            last_cost: None,
        }
    }

    fn assert_invariants(&self) {
        debug_assert!(self.arm.is_none_or(|arm| arm < 3));
        debug_assert!(self.arm.is_none() || self.hold_windows == 0);
        debug_assert!(self.triples_counted < TRIPLES || self.arm.is_none());
        debug_assert!(self.triples_uncounted < TRIPLES || self.arm.is_none());
        debug_assert!(self.triples_run < TRIPLES_MAX || self.arm.is_none());
        debug_assert!(self.triples_counted + self.triples_uncounted <= self.triples_run);
        debug_assert!(
            (self.triples_counted..=2 * self.triples_counted).contains(&self.trial_sleeping)
        );
        debug_assert!((0.0..=1.0).contains(&self.share));
        debug_assert!((0.0..1.0).contains(&self.credit));
        debug_assert!(self.hold_windows <= HOLD_WINDOWS);
        debug_assert!(self
            .arm
            .is_none_or(|arm| self.sleeps == arm_sleeps(arm, self.sleeps_twice)));
    }

    /// Whether the budgeted sleeps of the window in progress are taken.
    pub(super) fn window_sleeps(&self) -> bool {
        self.sleeps
    }

    /// The window in progress is over: `ios` lone I/Os, `slept` of which took a budgeted
    /// sleep, whose latencies as seen (clipped, see [`CLIP_MEANS`]) sum to `seen_sum_ns`,
    /// against a budget of `budget` (a fraction of the mean). Decides whether the next
    /// window sleeps.
    pub(super) fn end_window(&mut self, ios: u32, slept: u32, seen_sum_ns: f64, budget: f64) {
        self.assert_invariants();
        debug_assert!(ios > 0 && slept <= ios && budget > 0.0);
        match self.arm {
            Some(arm) => self.end_arm(arm, ios, slept, seen_sum_ns, budget),
            None if self.hold_windows > 1 => {
                self.hold_windows -= 1;
                self.sleeps = self.next_shared();
            }
            None => self.begin_trial(budget),
        }
        self.assert_invariants();
    }

    /// Window `arm` of the triple in progress is over (see [`SleepTrial::end_window`]).
    fn end_arm(&mut self, arm: u32, ios: u32, slept: u32, seen_sum_ns: f64, budget: f64) {
        let figure = seen_sum_ns / f64::from(ios);
        // A sleeping window counts if a good part of its I/Os slept; a spinning one always.
        let counts = !self.sleeps || slept >= ios / 8;
        self.figures[arm as usize] = (counts && figure > 0.0).then_some(figure);
        if arm < 2 {
            self.arm = Some(arm + 1);
            self.sleeps = arm_sleeps(arm + 1, self.sleeps_twice);
            return;
        }
        if let [Some(first), Some(middle), Some(last)] = self.figures {
            let outer = (first + last) / 2.0;
            let ratio = if self.sleeps_twice {
                outer / middle
            } else {
                middle / outer
            };
            let log_ratio = ratio.ln();
            if self.triples_counted == 0 {
                self.log_ratio_first = log_ratio;
            }
            self.triples_counted += 1;
            self.trial_sleeping += if self.sleeps_twice { 2 } else { 1 };
            let off_first = log_ratio - self.log_ratio_first;
            self.log_ratio_sum += off_first;
            self.log_ratio_sq_sum += off_first * off_first;
            self.triples_uncounted = 0;
        } else {
            self.triples_uncounted += 1;
        }
        self.triples_run += 1;
        self.figures = [None; 3];
        if self.triples_counted == TRIPLES
            || self.triples_uncounted == TRIPLES
            || self.triples_run == TRIPLES_MAX
        {
            self.conclude(budget);
            return;
        }
        // The next triple's shape, from the cost so far once it says something.
        if self.triples_counted >= SHAPE_TRIPLES {
            self.sleeps_twice = twice_fits(self.cost_measured(0.0), budget);
        }
        self.arm = Some(0);
        self.sleeps = arm_sleeps(0, self.sleeps_twice);
    }

    /// The trial is over (its triples counted, too many in a row not, or too many run):
    /// the share from the cost it measured, if at least half of [`TRIPLES`] counted, held.
    fn conclude(&mut self, budget: f64) {
        self.trials += 1;
        self.arm = None;
        let concludes = self.triples_counted >= TRIPLES / 2;
        self.cost = concludes.then(|| self.cost_measured(0.0));
        self.last_cost = self.cost.or(self.last_cost);
        let cost_paid = concludes.then(|| self.cost_measured(MARGIN_SES));
        self.share = match cost_paid {
            Some(cost) if cost > budget => {
                share_for(cost, budget, self.triples_counted, self.trial_sleeping)
            }
            _ => 1.0,
        };
        self.credit = 0.0;
        self.hold_windows = if self.cost.is_some() {
            HOLD_WINDOWS
        } else {
            TRIAL_WINDOWS
        };
        self.sleeps = self.next_shared();
    }

    /// The cost the triples counted so far measure, `ses` standard errors higher (the
    /// triples' scatter over the square root of their count; none for the estimate
    /// itself, [`MARGIN_SES`] for the one the share pays for).
    fn cost_measured(&self, ses: f64) -> f64 {
        let n = f64::from(self.triples_counted);
        debug_assert!(n >= 1.0 && (ses == 0.0 || n >= 2.0));
        let mean_off_first = self.log_ratio_sum / n;
        let se = if ses == 0.0 {
            0.0
        } else {
            let squares = self.log_ratio_sq_sum - n * mean_off_first * mean_off_first;
            ((squares / (n - 1.0)).max(0.0) / n).sqrt()
        };
        (self.log_ratio_first + mean_off_first + ses * se).exp() - 1.0
    }

    /// A share of `share` held from now, as a trial that found it would leave it.
    #[cfg(test)]
    pub(super) fn holding(share: f64) -> SleepTrial {
        let mut trial = SleepTrial::new();
        trial.arm = None;
        trial.share = share;
        trial.hold_windows = HOLD_WINDOWS;
        trial.sleeps = trial.next_shared();
        trial.assert_invariants();
        trial
    }

    /// A trial from the next window: its first triples sleep in two windows unless the
    /// last cost measured says that does not fit the budget.
    fn begin_trial(&mut self, budget: f64) {
        self.arm = Some(0);
        self.hold_windows = 0;
        self.sleeps_twice = self.last_cost.is_none_or(|cost| twice_fits(cost, budget));
        self.figures = [None; 3];
        self.triples_counted = 0;
        self.trial_sleeping = 0;
        self.log_ratio_first = 0.0;
        self.log_ratio_sum = 0.0;
        self.log_ratio_sq_sum = 0.0;
        self.triples_uncounted = 0;
        self.triples_run = 0;
        self.sleeps = arm_sleeps(0, self.sleeps_twice);
    }

    /// Whether the next window sleeps while the share holds: the share of them, evenly.
    fn next_shared(&mut self) -> bool {
        self.credit += self.share;
        if self.credit >= 1.0 {
            self.credit -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests;
