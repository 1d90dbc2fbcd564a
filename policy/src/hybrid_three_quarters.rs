//! `hybrid-3/4`: sleep `(mean + 1) * 3 / 4` of the I/O's bucket once, then spin (the 2020
//! blk-mq proposal "modify hybrid sleep time to aggressive", seed `000_9111c9e468eab9bc.txt`).

use crate::policy::{Decision, PollContext, PollPolicy};
use crate::stats::BucketStats;

/// The proposal's sleep: `(mean + 1) * 3 / 4` in integer arithmetic, or 0 while the bucket
/// has no samples.
#[inline]
pub const fn sleep_ns(stats: &BucketStats) -> u64 {
    if !stats.has_samples() {
        return 0;
    }
    ((stats.mean_ns as u128 + 1) * 3 / 4) as u64
}

/// Hybrid polling that sleeps three quarters of the mean: less CPU, a little latency.
#[derive(Clone, Copy, Debug, Default)]
pub struct HybridThreeQuarters;

impl HybridThreeQuarters {
    /// The policy's spec.
    pub const NAME: &'static str = "hybrid-3/4";
}

impl PollPolicy for HybridThreeQuarters {
    fn name(&self) -> &str {
        Self::NAME
    }

    #[inline]
    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
        match ctx.sleepable_bucket() {
            Some(stats) => Decision::sleep_ns(sleep_ns(stats)),
            None => Decision::Spin,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{decide_with, sleep, stats};

    #[test]
    fn sleeps_three_quarters_of_the_mean() {
        let mut policy = HybridThreeQuarters;
        // (9001 + 1) * 3 / 4 = 27006 / 4 = 6751 (6751.5 rounded down).
        assert_eq!(
            decide_with(&mut policy, stats(9001, 8000), |_| {}),
            sleep(6751)
        );
        // (9999 + 1) * 3 / 4 = 7500; (0 + 1) * 3 / 4 = 0: no sleep.
        assert_eq!(
            decide_with(&mut policy, stats(9999, 100), |_| {}),
            sleep(7500)
        );
        assert_eq!(
            decide_with(&mut policy, stats(0, 0), |_| {}),
            Decision::Spin
        );
        // No overflow: (2^64 - 1 + 1) * 3 / 4 = 3 * 2^62.
        assert_eq!(sleep_ns(&stats(u64::MAX, 0)), 3 << 62);
    }

    #[test]
    fn sleeps_once_per_io_only_with_samples_and_a_bucket() {
        let mut policy = HybridThreeQuarters;
        let slept = decide_with(&mut policy, stats(9001, 8000), |c| c.oldest.slept = true);
        assert_eq!(slept, Decision::Spin);
        let empty = decide_with(&mut policy, BucketStats::EMPTY, |_| {});
        assert_eq!(empty, Decision::Spin);
        let flush = decide_with(&mut policy, stats(9001, 8000), |c| c.oldest.bucket = None);
        assert_eq!(flush, Decision::Spin);
    }
}
