//! `fixed:<us>`: sleep a fixed time once per I/O, then spin (Linux `io_poll_delay > 0`).

use crate::policy::{Decision, PollContext, PollPolicy};

/// Longest fixed sleep accepted, in microseconds (one second).
pub const FIXED_SLEEP_US_MAX: u64 = 1_000_000;
const NS_PER_US: u64 = 1_000;

/// Sleeps `io_poll_delay` microseconds once per I/O, whatever the statistics' values.
///
/// Linux (`blk_mq_poll_hybrid_sleep` takes `poll_nsec` when it is positive) never looks at
/// the statistics for this delay. hypoll's contract adds one rule to every policy, this one
/// included: no sleep before the I/O's bucket has samples. So `fixed` spins for an I/O whose
/// bucket is still empty, or that has no bucket (flush), and otherwise sleeps exactly the
/// configured time, as Linux does.
#[derive(Clone, Debug)]
pub struct Fixed {
    sleep_ns: u64,
    name: String,
}

impl Fixed {
    /// The policy's name, without parameters.
    pub const NAME: &'static str = "fixed";

    /// Sleeps `sleep_us` microseconds, `1..=FIXED_SLEEP_US_MAX` (0 is not a fixed sleep:
    /// `io_poll_delay = 0` means hybrid).
    ///
    /// # Panics
    /// If `sleep_us` is out of range; [`crate::build`] checks it and returns an error.
    pub fn from_us(sleep_us: u64) -> Self {
        assert!(
            (1..=FIXED_SLEEP_US_MAX).contains(&sleep_us),
            "fixed sleep of {sleep_us} us is outside 1..={FIXED_SLEEP_US_MAX}"
        );
        Self {
            sleep_ns: sleep_us * NS_PER_US,
            name: format!("{}:{sleep_us}", Self::NAME),
        }
    }

    /// The sleep, in nanoseconds.
    pub const fn sleep_ns(&self) -> u64 {
        self.sleep_ns
    }
}

impl PollPolicy for Fixed {
    fn name(&self) -> &str {
        &self.name
    }

    #[inline]
    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
        match ctx.sleepable_bucket() {
            Some(stats) if stats.has_samples() => Decision::sleep_ns(self.sleep_ns),
            _ => Decision::Spin,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{decide_with, sleep, stats};
    use crate::BucketStats;

    #[test]
    fn sleeps_the_given_microseconds_once_per_io() {
        let mut policy = Fixed::from_us(5);
        assert_eq!(policy.name(), "fixed:5");
        assert_eq!(
            decide_with(&mut policy, stats(9001, 8000), |_| {}),
            sleep(5000)
        );
        let slept = decide_with(&mut policy, stats(9001, 8000), |c| c.oldest.slept = true);
        assert_eq!(slept, Decision::Spin);
    }

    #[test]
    fn no_sleep_before_the_bucket_has_samples() {
        let mut policy = Fixed::from_us(9);
        assert_eq!(
            decide_with(&mut policy, BucketStats::EMPTY, |_| {}),
            Decision::Spin
        );
        let flush = decide_with(&mut policy, stats(1, 1), |c| c.oldest.bucket = None);
        assert_eq!(flush, Decision::Spin);
        // Once there are samples, their values do not matter: the sleep is fixed.
        assert_eq!(decide_with(&mut policy, stats(1, 1), |_| {}), sleep(9000));
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn zero_is_not_a_fixed_sleep() {
        let _ = Fixed::from_us(0);
    }
}
