//! What `adaptive` has learnt of the device, per statistics bucket: the latency
//! distribution plans are made from, the exact latencies that censored completions' stand-ins
//! are drawn from, and the service-time floor that tells queueing from service.

use std::ops::{Index, IndexMut};

use super::plan::PlanCache;
use super::reservoir::Reservoir;
use super::{ADAPTIVE_RESERVOIR, ADAPTIVE_SAMPLES_MIN};
use crate::stats::BUCKETS;

/// A bucket's sorted view (and its plans) is rebuilt once the reservoir has turned over:
/// sorting 256 samples costs microseconds, so it must not happen every few I/Os.
const LATENCY_REFRESH_EVERY: u32 = ADAPTIVE_RESERVOIR as u32;
/// Latencies of I/Os nobody slept through, kept per bucket: what a censored completion's
/// stand-in is drawn from. Sorted only when a draw needs it, and then at most once per
/// [`EXACT_REFRESH_EVERY`] new samples and as many draws: a policy that never sleeps never
/// sorts them, and under load, where a third of the completions are exact and one per
/// batch is drawn, a sort per 32 batches rather than one per 3 (sorting on every few draws
/// was a measurable share of a loaded reactor's CPU; see docs/lab/).
pub(super) const EXACT_SAMPLES: usize = 128;
pub(super) const EXACT_REFRESH_EVERY: u32 = 32;
/// The service-time floor rises by 1/64 per 100 ms without a lower sample, to follow drift
/// (only while at most one I/O is outstanding).
const FLOOR_DRIFT_NS: u64 = 100_000_000;

/// The learnt latency distribution of one bucket, and its service-time floor.
#[derive(Clone)]
pub(super) struct Distribution {
    pub(super) latencies: Reservoir<ADAPTIVE_RESERVOIR>,
    /// Exact latencies of I/Os not slept through (see [`EXACT_SAMPLES`]).
    pub(super) exact: Reservoir<EXACT_SAMPLES>,
    /// Stand-ins drawn since `exact` was last sorted.
    draws_since_sort: u32,
    /// Service-time estimate: the lowest latency seen, drifting up slowly.
    pub(super) floor_ns: u64,
    /// The wake-up times planned from these latencies.
    pub(super) plans: PlanCache,
}

impl Distribution {
    pub(super) const EMPTY: Distribution = Distribution {
        latencies: Reservoir::empty(LATENCY_REFRESH_EVERY),
        exact: Reservoir::empty(u32::MAX),
        draws_since_sort: 0,
        floor_ns: u64::MAX,
        plans: PlanCache::EMPTY,
    };

    /// Learns a latency; only an `exact` one (not a stand-in drawn from the learnt samples
    /// for a completion censored by a sleep) can lower the service-time floor.
    pub(super) fn add(&mut self, latency_ns: u64, exact: bool) {
        let floor_ns = self.floor_ns;
        self.latencies.add(latency_ns);
        if exact {
            self.floor_ns = self.floor_ns.min(latency_ns);
        }
        debug_assert!(self.floor_ns <= floor_ns, "a sample raised the floor");
        debug_assert!(!exact || self.floor_ns <= latency_ns);
    }

    /// Learns a completion's latency (as seen, or its stand-in when `drawn`); one that was
    /// `polled` for from its submission, with no sleep, is also an exact sample.
    pub(super) fn learn(&mut self, latency_ns: u64, polled: bool, drawn: bool) {
        debug_assert!(
            !(polled && drawn),
            "a stand-in for an I/O nobody slept through"
        );
        if polled {
            self.exact.add(latency_ns);
        }
        self.add(latency_ns, !drawn);
    }

    /// Samples in the sorted view, the one plans are made from.
    pub(super) fn planned_samples(&self) -> usize {
        self.latencies.sorted_len()
    }

    pub(super) fn mean_ns(&self) -> u64 {
        self.latencies.mean()
    }

    pub(super) fn median_ns(&self) -> u64 {
        self.latencies.quantile(0.5).unwrap_or(0)
    }

    /// The latest wake-up time `w` (ns since submission) such that, over the samples above
    /// `elapsed_ns`, the expected lateness E[(w - T)+] is at most `budget_ns`; `None` when
    /// fewer than [`ADAPTIVE_SAMPLES_MIN`] samples lie above `elapsed_ns`.
    pub(super) fn wake_within_budget(&self, elapsed_ns: u64, budget_ns: u64) -> Option<u64> {
        let r = &self.latencies;
        let xs = r.samples();
        let first = xs.partition_point(|&x| x <= elapsed_ns);
        let m = (xs.len() - first) as u64;
        if m < ADAPTIVE_SAMPLES_MIN as u64 {
            return None;
        }
        // Waking at xs[j] is late, on average, by sum_{first <= i < j} (xs[j] - xs[i]) / m,
        // which grows with j: binary search the last j within budget.
        let lateness = |j: usize| {
            let below = (j - first) as u64;
            let sum = r.sum_below(j) - r.sum_below(first);
            below.saturating_mul(xs[j]).saturating_sub(sum) / m
        };
        let (mut lo, mut hi) = (first, xs.len() - 1);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if lateness(mid) <= budget_ns {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        // A sample the I/O has not outlived yet, and within the budget (waking at the first
        // of them is late for none).
        debug_assert!(xs[lo] > elapsed_ns);
        debug_assert!(lateness(lo) <= budget_ns);
        Some(xs[lo])
    }

    /// A stand-in for a censored latency, known only to lie in `(lo_ns, hi_ns]`: one of the
    /// exact samples (I/Os not slept through) in that interval, picked by `draw` (a counter,
    /// so successive draws take the samples in turn); failing that one of all the learnt
    /// samples there; failing that the middle of the interval. Drawing from the distribution
    /// conditioned on the interval keeps its shape below the wake-up. The middle of a sleep
    /// lies far below every real completion when the sleep is long (a sleep through most of
    /// a read puts it near half the read's latency), and such low samples make the plan wake
    /// earlier and spin longer than its budget needs. The exact samples come first because
    /// the learnt ones below the wake-up are mostly earlier stand-ins: drawn from themselves,
    /// they would never learn anything new.
    pub(super) fn impute_ns(&mut self, lo_ns: u64, hi_ns: u64, draw: u64) -> u64 {
        debug_assert!(lo_ns <= hi_ns, "an empty interval ({lo_ns}, {hi_ns}]");
        self.draws_since_sort = self.draws_since_sort.saturating_add(1);
        if self.exact.since_refresh() >= EXACT_REFRESH_EVERY
            && self.draws_since_sort >= EXACT_REFRESH_EVERY
        {
            self.exact.refresh();
            self.draws_since_sort = 0;
        }
        for xs in [self.exact.samples(), self.latencies.samples()] {
            let first = xs.partition_point(|&x| x <= lo_ns);
            let end = xs.partition_point(|&x| x <= hi_ns);
            if first < end {
                // In 32 bits: a 64-bit division costs as much as the rest of the draw, and
                // the turn only needs to wrap (at most 256 samples).
                let x = xs[first + (draw as u32 % (end - first) as u32) as usize];
                debug_assert!(lo_ns < x && x <= hi_ns);
                return x;
            }
        }
        lo_ns + (hi_ns - lo_ns) / 2
    }

    /// Whether the median of the samples above `elapsed_ns`, minus `elapsed_ns`, exceeds
    /// `limit_ns`. No search when even the largest sample is within the limit: the usual
    /// answer, asked for every new I/O.
    pub(super) fn median_remaining_exceeds(&self, elapsed_ns: u64, limit_ns: u64) -> bool {
        let xs = self.latencies.samples();
        xs.last()
            .is_some_and(|&max| max.saturating_sub(elapsed_ns) > limit_ns)
            && self
                .median_remaining_ns(elapsed_ns)
                .is_some_and(|r| r > limit_ns)
    }

    /// The median of the samples above `elapsed_ns`, minus `elapsed_ns`.
    pub(super) fn median_remaining_ns(&self, elapsed_ns: u64) -> Option<u64> {
        let xs = self.latencies.samples();
        let first = xs.partition_point(|&x| x <= elapsed_ns);
        (first < xs.len()).then(|| xs[(first + xs.len()) / 2] - elapsed_ns)
    }
}

/// Every bucket's [`Distribution`], with what they share: the turn that picks stand-ins and
/// the clock of the floors' drift. Indexed by [`crate::Bucket::index`].
#[derive(Clone)]
pub(super) struct Buckets {
    dists: Box<[Distribution; BUCKETS]>,
    /// Censored latencies stood in for: picks the stand-in among the samples in its
    /// interval, in turn (deterministic, and every sample gets its share).
    draws: u64,
    /// When the floors last drifted up.
    floor_drift_at_ns: u64,
}

impl Buckets {
    pub(super) fn new() -> Buckets {
        Buckets {
            dists: Box::new([const { Distribution::EMPTY }; BUCKETS]),
            draws: 0,
            floor_drift_at_ns: 0,
        }
    }

    /// Lets every known floor rise by 1/64 once per [`FLOOR_DRIFT_NS`], so it follows a
    /// drifting device. Only while the load is low: under a deep queue no completion shows
    /// the service time, and a rising floor would hide the queueing that batching relies on.
    pub(super) fn drift_floors(&mut self, now_ns: u64, outstanding: usize) {
        if outstanding <= 1 && now_ns >= self.floor_drift_at_ns + FLOOR_DRIFT_NS {
            self.floor_drift_at_ns = now_ns;
            for dist in self.dists.iter_mut() {
                if dist.floor_ns != u64::MAX {
                    dist.floor_ns += dist.floor_ns / 64;
                }
            }
        }
        debug_assert!(outstanding > 1 || now_ns < self.floor_drift_at_ns + FLOOR_DRIFT_NS);
    }

    /// A stand-in, from bucket `bucket`'s samples, for a latency censored into
    /// `(lo_ns, hi_ns]` (see [`Distribution::impute_ns`]); the next draw takes the next turn.
    pub(super) fn stand_in(&mut self, bucket: usize, lo_ns: u64, hi_ns: u64) -> u64 {
        self.draws += 1;
        self.dists[bucket].impute_ns(lo_ns, hi_ns, self.draws)
    }
}

impl Index<usize> for Buckets {
    type Output = Distribution;

    fn index(&self, bucket: usize) -> &Distribution {
        &self.dists[bucket]
    }
}

impl IndexMut<usize> for Buckets {
    fn index_mut(&mut self, bucket: usize) -> &mut Distribution {
        &mut self.dists[bucket]
    }
}
