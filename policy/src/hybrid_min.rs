//! `hybrid-min[:adjust=<ns>]`: sleep at least the bucket's minimum completion time, less a
//! wake-up adjustment (the 2017 blk-mq proposal by Stephen Bates, `io_poll_hyb_use_min` and
//! `io_poll_hyb_adjust`, seed `001_719ea51357eb3cc1.txt`).

use crate::policy::{Decision, PollContext, PollPolicy};
use crate::stats::BucketStats;

/// The proposal's sleep with `io_poll_hyb_use_min = 1` and `io_poll_hyb_adjust = adjust_ns`:
/// `ret = max((mean + 1) / 2, min)`, then `ret - adjust` when `ret >= adjust`, else 0 (no
/// sleep). 0 while the bucket has no samples.
#[inline]
pub const fn sleep_ns(stats: &BucketStats, adjust_ns: u64) -> u64 {
    if !stats.has_samples() {
        return 0;
    }
    let half_mean_ns = crate::hybrid::sleep_ns(stats);
    let ns = if half_mean_ns > stats.min_ns {
        half_mean_ns
    } else {
        stats.min_ns
    };
    // `if (ret >= adjust) ret -= adjust; else return 0;`
    ns.saturating_sub(adjust_ns)
}

/// Hybrid polling that never wakes before the fastest completion seen, less an adjustment
/// for the operating system's wake-up time.
#[derive(Clone, Debug)]
pub struct HybridMin {
    adjust_ns: u64,
    name: String,
}

impl HybridMin {
    /// The policy's name, without parameters.
    pub const NAME: &'static str = "hybrid-min";

    /// Subtracts `adjust_ns` from every sleep (0: none).
    pub fn new(adjust_ns: u64) -> Self {
        let name = if adjust_ns == 0 {
            Self::NAME.to_owned()
        } else {
            format!("{}:adjust={adjust_ns}", Self::NAME)
        };
        Self { adjust_ns, name }
    }

    /// The wake-up adjustment.
    pub const fn adjust_ns(&self) -> u64 {
        self.adjust_ns
    }
}

impl PollPolicy for HybridMin {
    fn name(&self) -> &str {
        &self.name
    }

    #[inline]
    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
        match ctx.sleepable_bucket() {
            Some(stats) => Decision::sleep_ns(sleep_ns(stats, self.adjust_ns)),
            None => Decision::Spin,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{decide_with, sleep, stats};

    #[test]
    fn sleeps_the_larger_of_half_the_mean_and_the_minimum() {
        let mut policy = HybridMin::new(0);
        // mean 9001, min 8000: max(4501, 8000) = 8000.
        assert_eq!(
            decide_with(&mut policy, stats(9001, 8000), |_| {}),
            sleep(8000)
        );
        // mean 20000, min 8000: max(10000, 8000) = 10000 (half the mean rounded up).
        assert_eq!(
            decide_with(&mut policy, stats(20_000, 8000), |_| {}),
            sleep(10_000)
        );
        assert_eq!(
            decide_with(&mut policy, stats(19_999, 8000), |_| {}),
            sleep(10_000)
        );
    }

    #[test]
    fn subtracts_the_adjustment_or_does_not_sleep() {
        // mean 9001, min 8000: 8000 - 2000 = 6000.
        let mut policy = HybridMin::new(2000);
        assert_eq!(
            decide_with(&mut policy, stats(9001, 8000), |_| {}),
            sleep(6000)
        );
        // mean 20000, min 8000: 10000 - 2000 = 8000.
        assert_eq!(
            decide_with(&mut policy, stats(20_000, 8000), |_| {}),
            sleep(8000)
        );
        // adjust 7999 leaves 1 ns; adjust 8000 (equal) and 10000 (larger) leave no sleep.
        let mut policy = HybridMin::new(7999);
        assert_eq!(
            decide_with(&mut policy, stats(9001, 8000), |_| {}),
            sleep(1)
        );
        for adjust_ns in [8000, 10_000] {
            let mut policy = HybridMin::new(adjust_ns);
            let spin = decide_with(&mut policy, stats(9001, 8000), |_| {});
            assert_eq!(spin, Decision::Spin, "adjust {adjust_ns}");
        }
    }

    #[test]
    fn sleeps_once_per_io_only_with_samples_and_a_bucket() {
        let mut policy = HybridMin::new(0);
        let slept = decide_with(&mut policy, stats(9001, 8000), |c| c.oldest.slept = true);
        assert_eq!(slept, Decision::Spin);
        let empty = decide_with(&mut policy, BucketStats::EMPTY, |_| {});
        assert_eq!(empty, Decision::Spin);
        let flush = decide_with(&mut policy, stats(9001, 8000), |c| c.oldest.bucket = None);
        assert_eq!(flush, Decision::Spin);
    }

    #[test]
    fn names_itself_by_its_spec() {
        assert_eq!(HybridMin::new(0).name(), "hybrid-min");
        assert_eq!(HybridMin::new(2000).name(), "hybrid-min:adjust=2000");
    }
}
