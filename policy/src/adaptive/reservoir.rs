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

    pub(super) fn add(&mut self, x: u64) {
        self.assert_invariants();
        let added = self.added;
        self.ring[self.pos] = x;
        self.pos = (self.pos + 1) % N;
        self.len = (self.len + 1).min(N);
        self.added += 1;
        // Saturating: a reservoir sorted only on demand may go billions of samples unsorted.
        self.since_refresh = self.since_refresh.saturating_add(1);
        // While filling, refresh each time the sample count doubles (and when it fills up).
        let filling = self.sorted_len < N
            && (self.len >= 2 * self.sorted_len
                || self.len == N
                || self.sorted_len < N.min(ADAPTIVE_SAMPLES_MIN));
        if filling || self.since_refresh >= self.refresh_every {
            self.refresh();
        }
        self.assert_invariants();
        debug_assert_eq!(self.added, added + 1);
        // The sorted view keeps up while the ring fills: it holds the first samples all, and
        // more than half of the ring until the ring is full.
        debug_assert!(self.sorted_len >= self.len.min(ADAPTIVE_SAMPLES_MIN));
        debug_assert!(self.sorted_len == N || 2 * self.sorted_len > self.len);
    }

    /// Forgets the samples (the counts of samples added and of refreshes go on).
    pub(super) fn clear(&mut self) {
        self.assert_invariants();
        self.len = 0;
        self.pos = 0;
        self.since_refresh = 0;
        self.sorted_len = 0;
        self.assert_invariants();
    }

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
