//! A fixed log-linear histogram of nanosecond values.
//!
//! Why not an HDR histogram (the `hdrhistogram` crate)? Recording sits on the reactor's hot
//! path, once per completion, and must stay far below 50 ns with no allocation. This layout is
//! a fixed array: recording is a leading-zeros count, a shift and three adds; merging two
//! histograms (at every window end) is an element-wise add of two arrays of the same shape,
//! with no configuration to reconcile; and it never resizes or allocates. The price is a fixed
//! precision: every power of two is split into [`SUB_BUCKETS`] equal sub-buckets, so a reported
//! percentile (the midpoint of its sub-bucket, clamped to the exact min and max) is within
//! 1/32 (3.1 %) of the true sample, where HDR with two significant digits would give 1 %.
//! The policies act on the mean and the minimum, which are kept exactly beside the counts;
//! percentiles are for reports and for the later `adaptive` policy, where 3 % is ample.
//!
//! Values below `2 * SUB_BUCKETS` ns are counted exactly. Values of [`VALUE_NS_LIMIT`] and
//! above (about 68.7 s) all land in the last bucket; min, max, sum and count stay exact.

/// Bits of linear resolution inside each power of two.
pub const SUB_BUCKET_BITS: u32 = 4;
/// Linear sub-buckets per power of two.
pub const SUB_BUCKETS: usize = 1 << SUB_BUCKET_BITS;
/// Values are resolved up to `2^VALUE_BITS` ns; larger ones share the last bucket.
pub const VALUE_BITS: u32 = 36;
/// The first value that no longer has a bucket of its own (2^36 ns, about 68.7 s).
pub const VALUE_NS_LIMIT: u64 = 1 << VALUE_BITS;
/// Number of counters in one histogram.
pub const HISTOGRAM_BUCKETS: usize = (VALUE_BITS - SUB_BUCKET_BITS + 1) as usize * SUB_BUCKETS;

/// Index of the counter that `value_ns` is recorded in.
#[inline]
pub const fn bucket_index(value_ns: u64) -> usize {
    if value_ns < SUB_BUCKETS as u64 {
        return value_ns as usize;
    }
    if value_ns >= VALUE_NS_LIMIT {
        return HISTOGRAM_BUCKETS - 1;
    }
    let exponent = 63 - value_ns.leading_zeros(); // >= SUB_BUCKET_BITS
    let shift = exponent - SUB_BUCKET_BITS;
    let sub = (value_ns >> shift) as usize & (SUB_BUCKETS - 1);
    (shift as usize + 1) * SUB_BUCKETS + sub
}

/// The values counted by counter `index`: `(lowest, width)`, i.e. `lowest..lowest + width`.
pub const fn bucket_range(index: usize) -> (u64, u64) {
    if index < SUB_BUCKETS {
        return (index as u64, 1);
    }
    let shift = (index / SUB_BUCKETS - 1) as u32;
    let sub = (index % SUB_BUCKETS) as u64;
    ((SUB_BUCKETS as u64 + sub) << shift, 1 << shift)
}

/// Count, mean, min, max and the three percentiles the policies and reports use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Number of values recorded.
    pub count: u64,
    /// Mean, rounded down (as blk-stat's `div_u64(batch, nr_samples)`).
    pub mean_ns: u64,
    /// Smallest value, exact.
    pub min_ns: u64,
    /// Largest value, exact.
    pub max_ns: u64,
    /// Median, within 1/32.
    pub p50_ns: u64,
    /// 90th percentile, within 1/32.
    pub p90_ns: u64,
    /// 99th percentile, within 1/32.
    pub p99_ns: u64,
}

/// A fixed log-linear histogram with exact count, sum, min and max. See the module docs.
#[derive(Clone, PartialEq, Eq)]
pub struct Histogram {
    counts: [u64; HISTOGRAM_BUCKETS],
    count: u64,
    sum_ns: u64,
    min_ns: u64,
    max_ns: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("summary", &self.summary())
            .finish_non_exhaustive()
    }
}

impl Histogram {
    /// An empty histogram.
    pub const fn new() -> Self {
        Self {
            counts: [0; HISTOGRAM_BUCKETS],
            count: 0,
            sum_ns: 0,
            min_ns: u64::MAX,
            max_ns: 0,
        }
    }

    /// Records one value. O(1), no allocation.
    #[inline]
    pub fn record(&mut self, value_ns: u64) {
        self.counts[bucket_index(value_ns)] += 1;
        self.count += 1;
        self.sum_ns = self.sum_ns.saturating_add(value_ns);
        self.min_ns = self.min_ns.min(value_ns);
        self.max_ns = self.max_ns.max(value_ns);
    }

    /// Adds every value of `other` to `self`.
    pub fn merge(&mut self, other: &Histogram) {
        if other.count == 0 {
            return;
        }
        for (mine, theirs) in self.counts.iter_mut().zip(other.counts.iter()) {
            *mine += theirs;
        }
        self.count += other.count;
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
        self.min_ns = self.min_ns.min(other.min_ns);
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    /// Forgets every value.
    pub fn clear(&mut self) {
        if self.count != 0 {
            *self = Self::new();
        }
    }

    /// Number of values recorded.
    pub const fn count(&self) -> u64 {
        self.count
    }

    /// Sum of the values (saturating).
    pub const fn sum_ns(&self) -> u64 {
        self.sum_ns
    }

    /// Smallest value, exact; `None` when empty.
    pub const fn min_ns(&self) -> Option<u64> {
        if self.count == 0 {
            None
        } else {
            Some(self.min_ns)
        }
    }

    /// Largest value, exact; `None` when empty.
    pub const fn max_ns(&self) -> Option<u64> {
        if self.count == 0 {
            None
        } else {
            Some(self.max_ns)
        }
    }

    /// Mean rounded down; `None` when empty.
    pub const fn mean_ns(&self) -> Option<u64> {
        self.sum_ns.checked_div(self.count)
    }

    /// The value at `percentile` (0 to 100): the smallest recorded value with at least
    /// `ceil(percentile / 100 * count)` values at or below it, reported as the midpoint of its
    /// sub-bucket clamped to `[min, max]`, hence within 1/32 of that value (exact below
    /// 32 ns and for the first and last ranks, unbounded only above [`VALUE_NS_LIMIT`]).
    /// `None` when empty. O(buckets).
    pub fn percentile_ns(&self, percentile: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        // Multiply before dividing: exact for whole percentiles (99 * count / 100).
        let percentile = percentile.clamp(0.0, 100.0);
        let rank = ((percentile * self.count as f64 / 100.0).ceil() as u64).clamp(1, self.count);
        // The extreme ranks are known exactly.
        if rank == 1 {
            return Some(self.min_ns);
        }
        if rank == self.count {
            return Some(self.max_ns);
        }
        let mut seen = 0;
        for (index, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let (lowest, width) = bucket_range(index);
                let midpoint = lowest + (width - 1) / 2;
                return Some(midpoint.clamp(self.min_ns, self.max_ns));
            }
        }
        unreachable!("histogram counters sum to less than its count")
    }

    /// Count, mean, min, max, p50, p90, p99; `None` when empty. O(buckets).
    pub fn summary(&self) -> Option<Summary> {
        Some(Summary {
            count: self.count,
            mean_ns: self.mean_ns()?,
            min_ns: self.min_ns,
            max_ns: self.max_ns,
            p50_ns: self.percentile_ns(50.0)?,
            p90_ns: self.percentile_ns(90.0)?,
            p99_ns: self.percentile_ns(99.0)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn buckets_tile_the_value_range_without_gaps() {
        let mut next = 0;
        for index in 0..HISTOGRAM_BUCKETS {
            let (lowest, width) = bucket_range(index);
            assert_eq!(lowest, next, "gap before bucket {index}");
            assert_eq!(bucket_index(lowest), index);
            assert_eq!(bucket_index(lowest + width - 1), index);
            next = lowest + width;
        }
        assert_eq!(next, VALUE_NS_LIMIT);
        assert_eq!(bucket_index(VALUE_NS_LIMIT), HISTOGRAM_BUCKETS - 1);
        assert_eq!(bucket_index(u64::MAX), HISTOGRAM_BUCKETS - 1);
    }

    #[test]
    fn small_values_are_exact() {
        for value in 0..2 * SUB_BUCKETS as u64 {
            assert_eq!(bucket_range(bucket_index(value)), (value, 1));
        }
    }

    #[test]
    fn summary_of_known_values() {
        let mut h = Histogram::new();
        assert_eq!(h.summary(), None);
        for value in 1..=100u64 {
            h.record(value * 1000);
        }
        let s = h.summary().unwrap();
        assert_eq!(
            (s.count, s.mean_ns, s.min_ns, s.max_ns),
            (100, 50_500, 1000, 100_000)
        );
        // Exact: p50 = 50 000, p90 = 90 000, p99 = 99 000; within 1/32.
        for (got, exact) in [(s.p50_ns, 50_000), (s.p90_ns, 90_000), (s.p99_ns, 99_000)] {
            assert!(got.abs_diff(exact) <= exact / 32, "{got} vs {exact}");
        }
        assert_eq!(h.percentile_ns(100.0), Some(100_000));
        assert_eq!(h.percentile_ns(0.0), Some(1000));
        // Whole percentiles take exact ranks: p90 of 10 values is the 9th, not the 10th.
        let mut ten = Histogram::new();
        for value in 1..=10u64 {
            ten.record(value);
        }
        assert_eq!(ten.percentile_ns(90.0), Some(9));
        assert_eq!(ten.percentile_ns(91.0), Some(10));
    }

    #[test]
    fn merge_equals_recording_everything_in_one() {
        let (mut a, mut b, mut both) = (Histogram::new(), Histogram::new(), Histogram::new());
        for v in [5u64, 700, 9001, 1 << 20] {
            a.record(v);
            both.record(v);
        }
        for v in [3u64, 12_345, 1 << 40] {
            b.record(v);
            both.record(v);
        }
        a.merge(&b);
        assert_eq!(a, both);
        a.merge(&Histogram::new());
        assert_eq!(a, both);
        a.clear();
        assert_eq!(a, Histogram::new());
    }

    proptest! {
        /// Every percentile is within the sub-bucket error of the exact one (same rank rule).
        #[test]
        fn percentiles_are_within_one_thirty_second(
            mut values in prop::collection::vec(0u64..VALUE_NS_LIMIT, 1..400),
            percentile in 0.0f64..=100.0,
        ) {
            let mut h = Histogram::new();
            for &v in &values {
                h.record(v);
            }
            values.sort_unstable();
            let n = values.len() as u64;
            let rank = ((percentile * n as f64 / 100.0).ceil() as u64).clamp(1, n);
            let exact = values[rank as usize - 1];
            let got = h.percentile_ns(percentile).unwrap();
            prop_assert!(got.abs_diff(exact) <= exact / 32, "p{percentile}: {got} vs exact {exact}");
            prop_assert_eq!(h.min_ns(), Some(values[0]));
            prop_assert_eq!(h.max_ns(), Some(values[values.len() - 1]));
            prop_assert_eq!(h.mean_ns(), Some(values.iter().sum::<u64>() / n));
        }
    }
}
