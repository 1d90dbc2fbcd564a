//! `classic`: always spin (Linux `io_poll_delay = -1`, the default poll mode since 4.10).

use crate::policy::{Decision, PollContext, PollPolicy};

/// Spins on the completion queue until the completion arrives: the lowest latency, a whole
/// core burnt.
#[derive(Clone, Copy, Debug, Default)]
pub struct Classic;

impl Classic {
    /// The policy's spec.
    pub const NAME: &'static str = "classic";
}

impl PollPolicy for Classic {
    fn name(&self) -> &str {
        Self::NAME
    }

    #[inline]
    fn decide(&mut self, _ctx: &PollContext<'_>) -> Decision {
        Decision::Spin
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{decide_with, stats};
    use crate::BucketStats;

    #[test]
    fn always_spins() {
        let mut policy = Classic;
        assert_eq!(
            decide_with(&mut policy, stats(9001, 8000), |_| {}),
            Decision::Spin
        );
        assert_eq!(
            decide_with(&mut policy, BucketStats::EMPTY, |_| {}),
            Decision::Spin
        );
        let spin = decide_with(&mut policy, stats(9001, 8000), |c| c.oldest.slept = true);
        assert_eq!(spin, Decision::Spin);
    }
}
