//! `hybrid`: sleep `(mean + 1) / 2` of the I/O's bucket once, then spin (Linux
//! `io_poll_delay = 0`, `blk_mq_poll_nsecs`, 2016).

use crate::policy::{Decision, PollContext, PollPolicy};
use crate::stats::BucketStats;

/// The sleep `blk_mq_poll_nsecs` computes: half the bucket's mean, rounded up
/// (`(mean + 1) / 2`), or 0 (no sleep) while the bucket has no samples.
#[inline]
pub const fn sleep_ns(stats: &BucketStats) -> u64 {
    if !stats.has_samples() {
        return 0;
    }
    stats.mean_ns.saturating_add(1) / 2
}

/// Linux's hybrid polling: sleep for half of the mean completion time of the I/O's bucket,
/// once per I/O, then spin.
#[derive(Clone, Copy, Debug, Default)]
pub struct Hybrid;

impl Hybrid {
    /// The policy's spec.
    pub const NAME: &'static str = "hybrid";
}

impl PollPolicy for Hybrid {
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
    fn sleeps_half_the_mean_rounded_up() {
        let mut policy = Hybrid;
        // (9001 + 1) / 2 = 4501; (9000 + 1) / 2 = 4500; (1 + 1) / 2 = 1.
        assert_eq!(
            decide_with(&mut policy, stats(9001, 8000), |_| {}),
            sleep(4501)
        );
        assert_eq!(
            decide_with(&mut policy, stats(9000, 8000), |_| {}),
            sleep(4500)
        );
        assert_eq!(decide_with(&mut policy, stats(1, 1), |_| {}), sleep(1));
        // (0 + 1) / 2 = 0: no sleep.
        assert_eq!(
            decide_with(&mut policy, stats(0, 0), |_| {}),
            Decision::Spin
        );
    }

    #[test]
    fn the_sleep_is_from_now_not_from_submission() {
        // Linux sleeps the full value at the first poll, however long ago the I/O was issued.
        let mut policy = Hybrid;
        let late = decide_with(&mut policy, stats(9001, 8000), |c| c.now_ns = 4_000);
        assert_eq!(late, sleep(4501));
    }

    #[test]
    fn sleeps_once_per_io_only_with_samples_and_a_bucket() {
        let mut policy = Hybrid;
        let slept = decide_with(&mut policy, stats(9001, 8000), |c| c.oldest.slept = true);
        assert_eq!(slept, Decision::Spin);
        let empty = decide_with(&mut policy, BucketStats::EMPTY, |_| {});
        assert_eq!(empty, Decision::Spin);
        let flush = decide_with(&mut policy, stats(9001, 8000), |c| c.oldest.bucket = None);
        assert_eq!(flush, Decision::Spin);
    }
}
