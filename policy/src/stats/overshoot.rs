//! One reactor's wake-up overshoot: how much later than requested its sleeps ended.

use crate::histogram::{Histogram, Summary};

/// The distribution of one reactor's wake-up overshoot: how much later than requested its
/// sleeps ended (`actual - requested`, 0 for an early wake-up). Cumulative until cleared.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OvershootStats {
    overshoot: Histogram,
    early_wakeups: u64,
}

impl OvershootStats {
    /// No sleeps recorded.
    pub const fn new() -> Self {
        Self {
            overshoot: Histogram::new(),
            early_wakeups: 0,
        }
    }

    /// Records one sleep that asked for `requested_ns` and lasted `actual_ns`; returns its
    /// overshoot (saturating at 0). O(1), no allocation.
    #[inline]
    pub fn record(&mut self, requested_ns: u64, actual_ns: u64) -> u64 {
        if actual_ns < requested_ns {
            self.early_wakeups += 1;
        }
        let overshoot_ns = actual_ns.saturating_sub(requested_ns);
        self.overshoot.record(overshoot_ns);
        overshoot_ns
    }

    /// Sleeps recorded.
    pub const fn count(&self) -> u64 {
        self.overshoot.count()
    }

    /// Sleeps that ended before the requested time (recorded as 0 overshoot).
    pub const fn early_wakeups(&self) -> u64 {
        self.early_wakeups
    }

    /// Mean overshoot, rounded down; `None` before the first sleep.
    pub const fn mean_ns(&self) -> Option<u64> {
        self.overshoot.mean_ns()
    }

    /// Smallest overshoot; `None` before the first sleep.
    pub const fn min_ns(&self) -> Option<u64> {
        self.overshoot.min_ns()
    }

    /// Largest overshoot; `None` before the first sleep.
    pub const fn max_ns(&self) -> Option<u64> {
        self.overshoot.max_ns()
    }

    /// Overshoot at `percentile` (0 to 100), within 1/32. O(histogram buckets): cache it.
    pub fn percentile_ns(&self, percentile: f64) -> Option<u64> {
        self.overshoot.percentile_ns(percentile)
    }

    /// Count, mean, min, max, p50, p90, p99. O(histogram buckets): cache it.
    pub fn summary(&self) -> Option<Summary> {
        self.overshoot.summary()
    }

    /// The whole distribution.
    pub const fn histogram(&self) -> &Histogram {
        &self.overshoot
    }

    /// Forgets every sleep (for instance after a calibration phase).
    pub fn clear(&mut self) {
        *self = Self::new();
    }
}
