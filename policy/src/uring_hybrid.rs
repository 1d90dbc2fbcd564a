//! `uring-hybrid`: io_uring's `IORING_SETUP_HYBRID_IOPOLL` (Linux 6.13, 2024): sleep half of
//! the shortest runtime the ring has seen, once per I/O, then spin.

use crate::policy::{Decision, Observation, PollContext, PollPolicy};

/// The sleep `io_hybrid_iopoll_delay` computes from the ring's `hybrid_poll_time`: half of
/// it, or 0 (no sleep) before the first runtime is known (`LLONG_MAX`).
#[inline]
pub const fn sleep_ns(runtime_ns_min: Option<u64>) -> u64 {
    match runtime_ns_min {
        Some(ns) => ns / 2,
        None => 0,
    }
}

/// io_uring's hybrid I/O polling. One estimate per reactor (io_uring keeps one per ring),
/// across all sizes and directions: the minimum over completed I/Os of
/// `latency - requested sleep` (`io_uring_hybrid_poll`: `runtime = now - iopoll_start -
/// sleep_time`, the runtime "without scheduling time"). io_uring measures it at the end of
/// each poll pass, which on a single-queue ring spins until a completion arrives; a reactor
/// polls one-shot, so it is measured at completion. I/Os without data (no bucket) teach it
/// nothing: io_uring refuses them on a polled ring.
#[derive(Clone, Copy, Debug, Default)]
pub struct UringHybrid {
    runtime_ns_min: Option<u64>,
}

impl UringHybrid {
    /// The policy's spec.
    pub const NAME: &'static str = "uring-hybrid";

    /// A policy that has seen no I/O yet.
    pub const fn new() -> Self {
        Self {
            runtime_ns_min: None,
        }
    }

    /// The shortest runtime seen so far (`hybrid_poll_time`), if any.
    pub const fn runtime_ns_min(&self) -> Option<u64> {
        self.runtime_ns_min
    }
}

impl PollPolicy for UringHybrid {
    fn name(&self) -> &str {
        Self::NAME
    }

    #[inline]
    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
        if ctx.oldest.slept {
            return Decision::Spin;
        }
        Decision::sleep_ns(sleep_ns(self.runtime_ns_min))
    }

    #[inline]
    fn on_completion(&mut self, seen: &Observation) {
        if seen.bucket.is_none() {
            return;
        }
        let requested_ns = seen.slept.map_or(0, |slept| slept.requested_ns);
        let runtime_ns = seen.latency_ns.saturating_sub(requested_ns);
        self.runtime_ns_min = Some(match self.runtime_ns_min {
            Some(min_ns) => min_ns.min(runtime_ns),
            None => runtime_ns,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{decide_with, sleep, stats, READ_4K};
    use crate::policy::Slept;
    use crate::BucketStats;

    fn completed(latency_ns: u64, slept_ns: Option<u64>) -> Observation {
        Observation {
            bucket: Some(READ_4K),
            submit_ns: 0,
            latency_ns,
            slept: slept_ns.map(|requested_ns| Slept {
                requested_ns,
                actual_ns: requested_ns + 700,
            }),
            idle_polls: 3,
            censored: false,
            after_interrupt: false,
        }
    }

    #[test]
    fn no_sleep_before_the_first_completion() {
        let mut policy = UringHybrid::new();
        // Bucket statistics do not matter: only the ring's own runtimes do.
        assert_eq!(
            decide_with(&mut policy, stats(9001, 8000), |_| {}),
            Decision::Spin
        );
    }

    #[test]
    fn sleeps_half_the_minimum_runtime_net_of_the_requested_sleep() {
        let mut policy = UringHybrid::new();
        policy.on_completion(&completed(10_001, None));
        assert_eq!(policy.runtime_ns_min(), Some(10_001));
        // 10001 / 2 = 5000, for any bucket.
        assert_eq!(
            decide_with(&mut policy, BucketStats::EMPTY, |_| {}),
            sleep(5000)
        );
        // Slept 5000 and completed at 10001: runtime 5001, the new minimum.
        policy.on_completion(&completed(10_001, Some(5000)));
        assert_eq!(policy.runtime_ns_min(), Some(5001));
        assert_eq!(
            decide_with(&mut policy, BucketStats::EMPTY, |_| {}),
            sleep(2500)
        );
        // Slept 2500 and completed at 10001: runtime 7501, not a new minimum.
        policy.on_completion(&completed(10_001, Some(2500)));
        assert_eq!(policy.runtime_ns_min(), Some(5001));
        // A slower I/O does not raise it; a flush teaches nothing.
        policy.on_completion(&completed(50_000, None));
        policy.on_completion(&Observation {
            bucket: None,
            submit_ns: 0,
            ..completed(10, None)
        });
        assert_eq!(policy.runtime_ns_min(), Some(5001));
    }

    #[test]
    fn sleeps_once_per_io() {
        let mut policy = UringHybrid::new();
        policy.on_completion(&completed(8000, None));
        let slept = decide_with(&mut policy, stats(1, 1), |c| c.oldest.slept = true);
        assert_eq!(slept, Decision::Spin);
    }

    #[test]
    fn a_runtime_of_one_nanosecond_means_no_sleep() {
        let mut policy = UringHybrid::new();
        policy.on_completion(&completed(1, None));
        assert_eq!(
            decide_with(&mut policy, BucketStats::EMPTY, |_| {}),
            Decision::Spin
        );
    }
}
