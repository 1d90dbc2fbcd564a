//! The sample store every part of `adaptive` learns into: the most recent samples in a ring,
//! and a sorted copy with prefix sums that quantiles and plans are read from.

use super::ADAPTIVE_SAMPLES_MIN;

/// The most recent `N` samples and a sorted copy with prefix sums, rebuilt every
/// `refresh_every` samples (and on every sample while it is still filling). Fixed arrays: no
/// allocation. Quantiles rather than means: wake-up overshoot on a VM has a heavy tail (a
/// descheduled vCPU wakes far later than any usual wake-up), and one outlier must not move
/// the plan.
#[derive(Clone)]
pub(super) struct Reservoir<const N: usize> {
    ring: [u64; N],
    len: usize,
    pos: usize,
    since_refresh: u32,
    /// Samples to add before the next refresh (at least 1): what `add` would otherwise
    /// work out from the counts on every sample, worked out once per refresh.
    refresh_in: u32,
    sorted: [u64; N],
    /// `prefix[i]` = sum of `sorted[..=i]`.
    prefix: [u64; N],
    sorted_len: usize,
    added: u64,
    refreshes: u64,
    refresh_every: u32,
}

impl<const N: usize> Reservoir<N> {
    /// A ring needs a slot to write to.
    const CAPACITY_NONZERO: () = assert!(N > 0);

    pub(super) const fn empty(refresh_every: u32) -> Self {
        let () = Self::CAPACITY_NONZERO;
        Reservoir {
            ring: [0; N],
            len: 0,
            pos: 0,
            since_refresh: 0,
            refresh_in: 1,
            sorted: [0; N],
            prefix: [0; N],
            sorted_len: 0,
            added: 0,
            refreshes: 0,
            refresh_every,
        }
    }

    /// What holds between any two calls: the ring never holds more than its capacity, the
    /// sorted view never more than the ring, and the ring never more than was ever added.
    fn assert_invariants(&self) {
        debug_assert!(self.len <= N, "{} samples in a reservoir of {N}", self.len);
        debug_assert!(self.pos < N);
        debug_assert!(self.sorted_len <= self.len);
        debug_assert!(self.len as u64 <= self.added);
    }

    #[inline]
    pub(super) fn add(&mut self, x: u64) {
        self.assert_invariants();
        let added = self.added;
        self.ring[self.pos] = x;
        self.pos = (self.pos + 1) % N;
        self.len = (self.len + 1).min(N);
        self.added += 1;
        // Saturating: a reservoir sorted only on demand may go billions of samples unsorted.
        self.since_refresh = self.since_refresh.saturating_add(1);
        self.refresh_in -= 1;
        debug_assert_eq!(self.refresh_in == 0, self.refresh_due());
        if self.refresh_in == 0 {
            self.refresh();
        }
        self.assert_invariants();
        debug_assert_eq!(self.added, added + 1);
        // The sorted view keeps up while the ring fills: it holds the first samples all, and
        // more than half of the ring until the ring is full.
        debug_assert!(self.sorted_len >= self.len.min(ADAPTIVE_SAMPLES_MIN));
        debug_assert!(self.sorted_len == N || 2 * self.sorted_len > self.len);
    }

    /// Whether the sorted view is due to be rebuilt: every `refresh_every` samples, and while
    /// filling each time the sample count doubles (and when it fills up).
    fn refresh_due(&self) -> bool {
        let filling = self.sorted_len < N
            && (self.len >= 2 * self.sorted_len
                || self.len == N
                || self.sorted_len < N.min(ADAPTIVE_SAMPLES_MIN));
        filling || self.since_refresh >= self.refresh_every
    }

    /// Samples from now (the view just rebuilt or cleared) until [`Self::refresh_due`]: the
    /// first that fills a small view, doubles a larger one or fills the ring, or the
    /// `refresh_every`-th, whichever comes first.
    fn samples_to_refresh(&self) -> u32 {
        debug_assert_eq!((self.sorted_len, self.since_refresh), (self.len, 0));
        let n = self.len;
        let filling = if n < N.min(ADAPTIVE_SAMPLES_MIN) {
            1
        } else if n < N {
            n.min(N - n)
        } else {
            usize::MAX
        };
        let every = self.refresh_every.max(1);
        u32::try_from(filling).map_or(every, |f| f.min(every))
    }

    /// Forgets the samples (the counts of samples added and of refreshes go on).
    pub(super) fn clear(&mut self) {
        self.assert_invariants();
        self.len = 0;
        self.pos = 0;
        self.since_refresh = 0;
        self.sorted_len = 0;
        self.refresh_in = self.samples_to_refresh();
        self.assert_invariants();
    }

    /// Rebuilds the sorted view (out of line: `add` is on every completion's path, this
    /// once in many).
    #[inline(never)]
    pub(super) fn refresh(&mut self) {
        self.assert_invariants();
        self.since_refresh = 0;
        self.refreshes += 1;
        let n = self.len;
        self.sorted[..n].copy_from_slice(&self.ring[..n]);
        self.sorted[..n].sort_unstable();
        let mut sum = 0u64;
        for i in 0..n {
            sum = sum.saturating_add(self.sorted[i]);
            self.prefix[i] = sum;
        }
        self.sorted_len = n;
        self.refresh_in = self.samples_to_refresh();
        self.assert_invariants();
        debug_assert_eq!(self.sorted_len, self.len);
        debug_assert!(self.samples().is_sorted());
    }

    /// The sorted view: the samples as of the last refresh, ascending.
    pub(super) fn samples(&self) -> &[u64] {
        &self.sorted[..self.sorted_len]
    }

    /// Samples in the sorted view.
    pub(super) fn sorted_len(&self) -> usize {
        self.sorted_len
    }

    /// Samples added since the reservoir was made (clearing does not reset it).
    pub(super) fn added(&self) -> u64 {
        self.added
    }

    /// Times the sorted view was rebuilt: a version for what is computed from it.
    pub(super) fn refreshes(&self) -> u64 {
        self.refreshes
    }

    /// Samples added since the sorted view was last rebuilt.
    pub(super) fn since_refresh(&self) -> u32 {
        self.since_refresh
    }

    /// Sum of `sorted[..k]`.
    pub(super) fn sum_below(&self, k: usize) -> u64 {
        debug_assert!(k <= self.sorted_len);
        if k == 0 {
            0
        } else {
            self.prefix[k - 1]
        }
    }

    pub(super) fn mean(&self) -> u64 {
        self.sum_below(self.sorted_len) / self.sorted_len.max(1) as u64
    }

    /// The `q` quantile (0..=1) of the samples, at the nearest rank; `None` while empty.
    /// Rounded by adding a half and truncating (the index is never negative): `f64::round`
    /// is a libm call, and this runs on every poll.
    pub(super) fn quantile(&self, q: f64) -> Option<u64> {
        debug_assert!((0.0..=1.0).contains(&q), "quantile {q}");
        let xs = self.samples();
        (!xs.is_empty()).then(|| xs[((xs.len() - 1) as f64 * q + 0.5) as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift): the tests need spread, not quality.
    fn values(seed: u64, n: usize, mask: u64, base: u64) -> Vec<u64> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                base.wrapping_add(x & mask)
            })
            .collect()
    }

    #[test]
    fn a_refresh_comes_when_the_counts_say_it_is_due() {
        // `add` counts down to the next refresh; `refresh_due` is the rule it stands for,
        // checked on every sample (debug builds), over filling, turning over, clearing and
        // refreshes from outside.
        for every in [1u32, 16, 64, 256, u32::MAX] {
            let mut r = Reservoir::<256>::empty(every);
            let mut refreshes = Vec::new();
            for (i, x) in values(9, 2000, 0xffff, 0).into_iter().enumerate() {
                let before = r.refreshes();
                r.add(x);
                if r.refreshes() != before {
                    refreshes.push(i);
                }
                if i == 700 {
                    r.clear();
                }
                if i == 900 {
                    r.refresh();
                }
            }
            // Filling: the 1st to 16th samples, then at 32, 64, 128 and 256.
            let filling: Vec<usize> = (0..16).chain([31, 63, 127, 255]).collect();
            let every_n = every as usize;
            let expect_fill: Vec<usize> = filling
                .iter()
                .copied()
                .filter(|&i| i < every_n || every == 1)
                .collect();
            for i in expect_fill {
                assert!(refreshes.contains(&i), "every {every}: sample {i}");
            }
            if every == 256 {
                assert!(refreshes.contains(&(255 + 256)), "turned over once");
                assert!(refreshes.contains(&701), "the first sample after a clear");
            }
        }
    }
}
