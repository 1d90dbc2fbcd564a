//! `oracle`: a benchmark-only policy that knows when the device will complete.
//!
//! It reads the emulated device's true next completion deadline
//! ([`PollContext::oracle_deadline_ns`]) and sleeps once per I/O until that deadline minus
//! this reactor's measured wake-up overshoot, then spins. No real device can tell a host its
//! deadlines, so this is not a policy to run: it marks the physical limit of sleeping on
//! this machine (the least CPU any sleep-then-spin policy can spend without adding latency),
//! and every benchmark table shows it next to the real policies.

use crate::policy::{Decision, PollContext, PollPolicy};

/// Wake-up overshoot assumed until this many sleeps have been measured.
pub const ORACLE_BOOTSTRAP_SAMPLES: u64 = 16;
/// Overshoot assumed before it is measured: the order seen on virtual machines with 1 ns
/// timer slack.
pub const ORACLE_BOOTSTRAP_OVERSHOOT_NS: u64 = 5_000;
/// Which overshoot percentile the oracle plans for: waking late costs latency, so it
/// budgets for a high percentile rather than the mean.
pub const ORACLE_OVERSHOOT_PERCENTILE: f64 = 90.0;
/// Sleeps shorter than this are not worth a wake-up: spin instead.
pub const ORACLE_SLEEP_NS_MIN: u64 = 1_000;
/// The overshoot percentile is recomputed after this many new sleep samples.
const REFRESH_SAMPLES: u64 = 64;

/// Sleeps until the device's true deadline minus the reactor's overshoot.
#[derive(Clone, Copy, Debug)]
pub struct Oracle {
    overshoot_ns: u64,
    samples_at_refresh: u64,
}

impl Oracle {
    /// The policy's spec.
    pub const NAME: &'static str = "oracle";

    /// An oracle that has measured no overshoot yet.
    pub const fn new() -> Self {
        Self {
            overshoot_ns: ORACLE_BOOTSTRAP_OVERSHOOT_NS,
            samples_at_refresh: 0,
        }
    }

    /// The overshoot it currently plans for.
    pub const fn overshoot_ns(&self) -> u64 {
        self.overshoot_ns
    }
}

impl Default for Oracle {
    fn default() -> Self {
        Self::new()
    }
}

impl PollPolicy for Oracle {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
        let samples = ctx.overshoot.count();
        if samples >= ORACLE_BOOTSTRAP_SAMPLES
            && samples >= self.samples_at_refresh + REFRESH_SAMPLES
        {
            if let Some(p) = ctx.overshoot.percentile_ns(ORACLE_OVERSHOOT_PERCENTILE) {
                self.overshoot_ns = p;
            }
            self.samples_at_refresh = samples;
        }
        if ctx.oldest.slept {
            return Decision::Spin;
        }
        let Some(deadline_ns) = ctx.oracle_deadline_ns else {
            return Decision::Spin;
        };
        let sleep_ns = deadline_ns
            .saturating_sub(ctx.now_ns)
            .saturating_sub(self.overshoot_ns);
        if sleep_ns < ORACLE_SLEEP_NS_MIN {
            Decision::Spin
        } else {
            Decision::sleep_ns(sleep_ns)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{decide_with, sleep, stats};

    #[test]
    fn sleeps_until_the_deadline_minus_the_overshoot() {
        let mut oracle = Oracle::new();
        let d = decide_with(&mut oracle, stats(9_000, 8_000), |c| {
            c.oracle_deadline_ns = Some(c.now_ns + 20_000);
        });
        assert_eq!(d, sleep(20_000 - ORACLE_BOOTSTRAP_OVERSHOOT_NS));
        // Already slept for this I/O, no deadline (a real device), or too close: spin.
        let d = decide_with(&mut oracle, stats(9_000, 8_000), |c| {
            c.oracle_deadline_ns = Some(c.now_ns + 20_000);
            c.oldest.slept = true;
        });
        assert_eq!(d, Decision::Spin);
        let d = decide_with(&mut oracle, stats(9_000, 8_000), |c| {
            c.oracle_deadline_ns = None
        });
        assert_eq!(d, Decision::Spin);
        let d = decide_with(&mut oracle, stats(9_000, 8_000), |c| {
            c.oracle_deadline_ns = Some(c.now_ns + ORACLE_BOOTSTRAP_OVERSHOOT_NS + 500);
        });
        assert_eq!(d, Decision::Spin);
    }

    #[test]
    fn plans_for_the_measured_overshoot_once_it_has_samples() {
        let mut overshoot = crate::OvershootStats::new();
        for _ in 0..100 {
            overshoot.record(10_000, 12_000); // 2 us late every time
        }
        let mut oracle = Oracle::new();
        let snapshot = crate::Snapshot::EMPTY;
        let ctx = PollContext {
            now_ns: 1_000_000,
            outstanding: 1,
            oldest: crate::InFlight {
                bucket: None,
                submit_ns: 990_000,
                slept: false,
            },
            stats: &snapshot,
            overshoot: &overshoot,
            interrupts: true,
            oracle_deadline_ns: Some(1_010_000),
        };
        match oracle.decide(&ctx) {
            Decision::Sleep(d) => {
                let planned = oracle.overshoot_ns();
                assert!(
                    (1_900..=2_100).contains(&planned),
                    "planned overshoot {planned}"
                );
                assert_eq!(d.as_nanos() as u64, 10_000 - planned);
            }
            other => panic!("expected a sleep, got {other:?}"),
        }
    }
}
