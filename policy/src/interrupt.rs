//! `interrupt`: always wait for the device's interrupt (IRQ-driven completion), or, on a
//! device without one, sleep until the I/O is expected to complete.

use crate::policy::{Decision, PollContext, PollPolicy};

/// Blocks on the device's interrupt fd until a completion is posted: no core burnt, the
/// interrupt and wake-up latency paid on every I/O. Where a device has no interrupt line
/// ([`PollContext::interrupts`] false: an IOPOLL ring, the emulator in virtual time), a wait
/// would be a spin; it sleeps instead until the I/O's bucket's mean latency has passed since
/// submission, once, then spins: the nearest to waiting for the completion without an
/// interrupt.
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
    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
        if ctx.interrupts {
            return Decision::WaitInterrupt;
        }
        match ctx.sleepable_bucket() {
            Some(stats) if stats.has_samples() => {
                let elapsed_ns = ctx.now_ns.saturating_sub(ctx.oldest.submit_ns);
                Decision::sleep_ns(stats.mean_ns.saturating_sub(elapsed_ns))
            }
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

    #[test]
    fn without_an_interrupt_line_it_sleeps_to_the_expected_completion_then_spins() {
        let mut policy = Interrupt;
        let no_line = |c: &mut PollContext<'_>| c.interrupts = false;
        // Submitted at 0, asked at 1 us, a 9 us mean: 8 us to go.
        assert_eq!(
            decide_with(&mut policy, stats(9000, 8000), no_line),
            sleep(8000)
        );
        let slept = decide_with(&mut policy, stats(9000, 8000), |c| {
            no_line(c);
            c.oldest.slept = true;
        });
        assert_eq!(slept, Decision::Spin);
        let overdue = decide_with(&mut policy, stats(9000, 8000), |c| {
            no_line(c);
            c.now_ns = 12_000;
        });
        assert_eq!(overdue, Decision::Spin);
        assert_eq!(
            decide_with(&mut policy, BucketStats::EMPTY, no_line),
            Decision::Spin
        );
    }
}
