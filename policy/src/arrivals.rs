//! Requests arriving from a reactor's front ends (a guest's avail ring, a socket): what the
//! reactor keeps of them ([`ArrivalStats`]), what it tells its policy of each batch
//! ([`Arrival`]), and what the policy decides from when the reactor has nothing outstanding
//! and waits for the next request ([`IdleContext`]).
//!
//! A reactor waits on two streams: completions from its devices and requests from its front
//! ends. While I/O is outstanding the policy decides from the completions
//! ([`crate::PollContext`]); with none outstanding, and a front end that has reported
//! requests, it decides how long to spin for the next request before the reactor parks
//! ([`crate::PollPolicy::decide_idle`]).

/// What a reactor keeps of the requests its front ends reported: counts, the time of the
/// last batch, and a moving mean of the gaps between batches. Updated with a few integer
/// operations per batch: no allocation, no clock read (the time is the reactor's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ArrivalStats {
    /// Requests reported, in all.
    pub requests: u64,
    /// Batches reported: calls that reported at least one request.
    pub batches: u64,
    /// When the last batch was seen, on the reactor's clock (0 before the first).
    pub last_ns: u64,
    /// Mean gap between batches, as seen (an exponential moving mean weighing the newest gap
    /// [`ARRIVAL_GAP_MEAN_SHIFT`] bits: about the last 8); 0 before the second batch. A gap
    /// that spanned a wait of the reactor is counted as seen, up to a wake-up later than
    /// the requests came.
    pub gap_mean_ns: u64,
}

/// The moving mean of [`ArrivalStats::gap_mean_ns`] moves `1 / 2^shift` of the way to each
/// new gap.
pub const ARRIVAL_GAP_MEAN_SHIFT: u32 = 3;

impl ArrivalStats {
    /// Whether any front end reported a request yet.
    #[inline]
    pub const fn seen(&self) -> bool {
        self.batches > 0
    }

    /// Records a batch of `requests` (at least 1) seen at `now_ns`. Returns when the previous
    /// batch was seen, if there was one.
    #[inline]
    pub fn record(&mut self, now_ns: u64, requests: u64) -> Option<u64> {
        debug_assert!(requests > 0);
        let previous_ns = self.seen().then_some(self.last_ns);
        if let Some(previous_ns) = previous_ns {
            let gap_ns = now_ns.saturating_sub(previous_ns);
            self.gap_mean_ns = if self.batches == 1 {
                gap_ns
            } else if gap_ns >= self.gap_mean_ns {
                self.gap_mean_ns + ((gap_ns - self.gap_mean_ns) >> ARRIVAL_GAP_MEAN_SHIFT)
            } else {
                self.gap_mean_ns - ((self.gap_mean_ns - gap_ns) >> ARRIVAL_GAP_MEAN_SHIFT)
            };
        }
        self.requests = self.requests.saturating_add(requests);
        self.batches += 1;
        self.last_ns = now_ns;
        // The clock never runs backwards: the last batch is the latest.
        debug_assert!(previous_ns.is_none_or(|p| p <= now_ns));
        previous_ns
    }
}

/// A batch of requests a front end reported (one `Reactor::note_arrivals`), as the policy
/// is told of it ([`crate::PollPolicy::on_arrivals`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// When the reactor saw the batch: its timestamp of the poll that found it.
    pub now_ns: u64,
    /// Requests in the batch, at least 1.
    pub requests: u64,
    /// When the previous batch was seen (`None` for the first): `now_ns - previous_ns` is
    /// the gap between the two, as seen.
    pub previous_ns: Option<u64>,
    /// The reactor waited (parked, blocked on interrupts, or slept) after the previous batch,
    /// from this time, and this batch was found on the first turn after the wait: its
    /// requests came at some unknown time in between, so the gap is censored. It is at least
    /// `waited_from_ns - previous_ns` (the reactor was polling until then), and at most the
    /// gap seen; after a park or an interrupt wait, which the front end's signal ends, about
    /// one wake-up less than seen. `None`: the reactor polled all along, and the gap is
    /// exact to a loop turn.
    pub waited_from_ns: Option<u64>,
}

impl Arrival {
    /// The gap from the previous batch, as seen.
    #[inline]
    pub fn gap_ns(&self) -> Option<u64> {
        Some(self.now_ns.saturating_sub(self.previous_ns?))
    }
}

/// Everything a reactor tells its policy when it has nothing outstanding and nothing to run,
/// and a front end has reported requests: the policy decides how long to spin for the next
/// one before the reactor parks ([`crate::PollPolicy::decide_idle`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdleContext {
    /// The reactor's timestamp of the turn that found nothing: the spin counts from here.
    pub now_ns: u64,
    /// What the reactor kept of its front ends' requests.
    pub arrivals: ArrivalStats,
    /// What the reactor spins without a policy's decision (its tuning's `idle_spin_ns`):
    /// the default decision.
    pub idle_spin_ns: u64,
}

impl IdleContext {
    /// Time since the last request arrived.
    #[inline]
    pub fn since_last_ns(&self) -> u64 {
        self.now_ns.saturating_sub(self.arrivals.last_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stats_count_batches_and_follow_the_gaps() {
        let mut a = ArrivalStats::default();
        assert!(!a.seen());
        assert_eq!(a.record(1_000, 2), None);
        assert_eq!(
            (a.requests, a.batches, a.last_ns, a.gap_mean_ns),
            (2, 1, 1_000, 0)
        );
        assert_eq!(a.record(6_000, 1), Some(1_000));
        assert_eq!(a.gap_mean_ns, 5_000, "the first gap is the mean");
        // A long gap moves the mean an eighth of the way; a run of short ones brings it back.
        a.record(86_000, 1);
        assert_eq!(a.gap_mean_ns, 5_000 + 75_000 / 8);
        let mut now_ns = 86_000;
        for _ in 0..100 {
            now_ns += 5_000;
            a.record(now_ns, 1);
        }
        assert!(a.gap_mean_ns.abs_diff(5_000) < 100, "{}", a.gap_mean_ns);
        assert_eq!((a.requests, a.batches, a.last_ns), (104, 103, now_ns));
    }

    #[test]
    fn a_censored_arrival_reports_its_gap_as_seen() {
        let arrival = Arrival {
            now_ns: 50_000,
            requests: 1,
            previous_ns: Some(10_000),
            waited_from_ns: Some(20_000),
        };
        assert_eq!(arrival.gap_ns(), Some(40_000));
        let first = Arrival {
            previous_ns: None,
            waited_from_ns: None,
            ..arrival
        };
        assert_eq!(first.gap_ns(), None);
    }
}
