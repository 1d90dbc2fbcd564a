//! `interrupt`: always wait for the device's interrupt (IRQ-driven completion).

use crate::policy::{Decision, PollContext, PollPolicy};

/// Blocks on the device's interrupt fd until a completion is posted: no core burnt, the
/// interrupt and wake-up latency paid on every I/O.
#[derive(Clone, Copy, Debug, Default)]
pub struct Interrupt;

impl Interrupt {
    /// The policy's spec.
    pub const NAME: &'static str = "interrupt";
}

impl PollPolicy for Interrupt {
    fn name(&self) -> &str {
        Self::NAME
    }

    #[inline]
    fn decide(&mut self, _ctx: &PollContext<'_>) -> Decision {
        Decision::WaitInterrupt
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{decide_with, stats};
    use crate::BucketStats;

    #[test]
    fn always_waits_for_the_interrupt() {
        let mut policy = Interrupt;
        let wait = Decision::WaitInterrupt;
        assert_eq!(decide_with(&mut policy, stats(9001, 8000), |_| {}), wait);
        assert_eq!(decide_with(&mut policy, BucketStats::EMPTY, |_| {}), wait);
        assert_eq!(
            decide_with(&mut policy, stats(1, 1), |c| c.oldest.slept = true),
            wait
        );
    }
}
