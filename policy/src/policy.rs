//! The [`PollPolicy`] trait and what a reactor tells a policy.

use std::time::Duration;

use crate::arrivals::{Arrival, IdleContext};
use crate::stats::{Bucket, BucketStats, OvershootStats, Snapshot};

/// What the reactor does next while it has outstanding I/O and nothing else to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Poll the completion queue again now.
    Spin,
    /// Sleep this long, measured from the decision, then spin. Never zero: a policy that
    /// computes a zero sleep spins instead (as Linux skips a zero hybrid sleep). The reactor
    /// marks the I/O it decided for as having slept ([`InFlight::slept`]).
    Sleep(Duration),
    /// Block until the device's interrupt fd is readable.
    WaitInterrupt,
    /// Block until the device's interrupt fd is readable or this long has passed, measured
    /// from the decision, then spin: a hybrid sleep that a completion ends early, so waking
    /// late costs at most the interrupt's wake-up. Only a wait that lasted the whole time
    /// marks the I/O as having slept; one a completion ended leaves the next decision to the
    /// policy. Without an interrupt line ([`PollContext::interrupts`] false) the reactor
    /// sleeps as for [`Decision::Sleep`].
    SleepInterruptible(Duration),
}

impl Decision {
    /// `Sleep(sleep_ns)`, or `Spin` when `sleep_ns` is 0.
    #[inline]
    pub const fn sleep_ns(sleep_ns: u64) -> Decision {
        if sleep_ns == 0 {
            Decision::Spin
        } else {
            Decision::Sleep(Duration::from_nanos(sleep_ns))
        }
    }

    /// `SleepInterruptible(sleep_ns)`, or `Spin` when `sleep_ns` is 0.
    #[inline]
    pub const fn sleep_interruptible_ns(sleep_ns: u64) -> Decision {
        if sleep_ns == 0 {
            Decision::Spin
        } else {
            Decision::SleepInterruptible(Duration::from_nanos(sleep_ns))
        }
    }
}

/// The I/O a decision is for: the reactor's oldest outstanding I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlight {
    /// Its statistics bucket (`None` for commands without data, such as flush).
    pub bucket: Option<Bucket>,
    /// When it was submitted, on the reactor's clock.
    pub submit_ns: u64,
    /// Whether the reactor has already slept for it. Policies sleep at most once per I/O
    /// (Linux's `RQF_MQ_POLL_SLEPT`, io_uring's `REQ_F_IOPOLL_STATE`): when this is set they
    /// spin. The reactor keeps the flag in the I/O's slot and sets it when it carries out a
    /// [`Decision::Sleep`] for this I/O.
    pub slept: bool,
}

/// Everything a reactor knows cheaply when it asks its policy. Built on the stack per
/// decision; borrows the reactor's own copies, so deciding touches no shared memory.
#[derive(Clone, Copy, Debug)]
pub struct PollContext<'a> {
    /// The reactor's timestamp of this poll batch.
    pub now_ns: u64,
    /// I/Os submitted and not yet completed on this reactor (at least 1 when it asks).
    pub outstanding: usize,
    /// The I/O this decision is for: the oldest outstanding one.
    pub oldest: InFlight,
    /// The published per-bucket statistics (the reactor's [`crate::StatsRecorder::snapshot`]).
    pub stats: &'a Snapshot,
    /// The reactor's wake-up overshoot distribution.
    pub overshoot: &'a OvershootStats,
    /// Whether every device with I/O outstanding has an interrupt line, so that
    /// [`Decision::WaitInterrupt`] and [`Decision::SleepInterruptible`] block on it (the
    /// emulator in virtual time has none: the reactor polls or sleeps instead).
    pub interrupts: bool,
    /// The emulated device's true time of its next completion, when the device knows it.
    /// Only the benchmark's `oracle` policy may read it, to bound what any policy could
    /// achieve; every real policy ignores it (a real device cannot tell). A reactor fills it
    /// in only for the policy named `oracle`, on an emulated device: `None` otherwise.
    pub oracle_deadline_ns: Option<u64>,
}

impl<'a> PollContext<'a> {
    /// The published statistics of the oldest I/O's bucket, when that I/O may still sleep
    /// (it has not slept) and has a bucket. What the blk-mq hybrid policies start from.
    #[inline]
    pub fn sleepable_bucket(&self) -> Option<&'a BucketStats> {
        if self.oldest.slept {
            return None;
        }
        Some(self.stats.bucket(self.oldest.bucket?))
    }
}

/// A sleep the reactor carried out for an I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slept {
    /// What the policy asked for.
    pub requested_ns: u64,
    /// How long the reactor was actually away.
    pub actual_ns: u64,
}

impl Slept {
    /// How much later than asked the reactor woke (0 if it woke early).
    #[inline]
    pub const fn overshoot_ns(&self) -> u64 {
        self.actual_ns.saturating_sub(self.requested_ns)
    }
}

/// What the reactor saw when an I/O completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observation {
    /// The I/O's statistics bucket.
    pub bucket: Option<Bucket>,
    /// When it was submitted, on the reactor's clock ([`InFlight::submit_ns`] while it was
    /// outstanding).
    pub submit_ns: u64,
    /// Completion seen by the reactor minus submission.
    pub latency_ns: u64,
    /// The sleep taken for this I/O, if any (the last one, for a policy that sleeps more
    /// than once per I/O).
    pub slept: Option<Slept>,
    /// Polls that found nothing while this I/O was outstanding.
    pub idle_polls: u64,
    /// The reactor was asleep or blocked while this I/O was outstanding and found its
    /// completion on the first poll after waking: the completion happened at some unknown
    /// time before, so `latency_ns` is only an upper bound of the device's time. Learning
    /// from such samples is what makes hybrid sleeps "shelve" upwards.
    pub censored: bool,
    /// Censored, and the reactor had been blocked on the device interrupts (a
    /// [`Decision::WaitInterrupt`], or a [`Decision::SleepInterruptible`] that a completion
    /// ended): the completion happened about one interrupt wake-up before it was seen.
    pub after_interrupt: bool,
}

/// A poll policy: asked what to do whenever its reactor has outstanding I/O and nothing else
/// to run, and told of every completion; asked too how long an idle reactor spins for its
/// front ends' next request, and told of their requests. One instance per reactor, so it keeps its state
/// without synchronisation. `decide` and `on_completion` are on the hot path: no allocation,
/// no lock, no atomic, no clock read (the time is in the context).
pub trait PollPolicy: Send {
    /// The policy's spec, as [`crate::build`] accepts it (`hybrid-min:adjust=2000`).
    fn name(&self) -> &str;

    /// What to do for `ctx.oldest` now.
    fn decide(&mut self, ctx: &PollContext<'_>) -> Decision;

    /// An I/O completed. The statistics are recorded by the reactor's
    /// [`crate::StatsRecorder`]; this is for policies with state of their own.
    fn on_completion(&mut self, seen: &Observation) {
        let _ = seen;
    }

    /// The reactor carried out a [`Decision::Sleep`]: what was asked, how long it really
    /// took, and (sampled, when the reactor measured it) the CPU time the sleep itself cost
    /// the thread, read from the OS. For policies that calibrate.
    fn on_sleep(&mut self, slept: &Slept, cpu_ns: Option<u64>) {
        let _ = (slept, cpu_ns);
    }

    /// A front end reported a batch of requests that arrived (a guest's avail ring, a
    /// socket): the request stream, as [`PollPolicy::on_completion`] is the completion
    /// stream. For policies that learn when requests come. On the hot path, as
    /// `on_completion` is.
    fn on_arrivals(&mut self, arrival: &Arrival) {
        let _ = arrival;
    }

    /// The reactor has nothing outstanding and nothing to run, and a front end has reported
    /// requests: how long to spin for the next one (counted from `ctx.now_ns`) before it
    /// parks, until a message, a timer, a poller's fd (a guest's kick) or a timeout wakes it.
    /// Zero parks at once. Asked once per idle stretch, at its first turn; a park that wakes
    /// with nothing to do parks again without asking. The default spins what the reactor
    /// would without a policy, `ctx.idle_spin_ns`: a reactor whose front ends report nothing
    /// does not ask at all, and spins that too.
    fn decide_idle(&mut self, ctx: &IdleContext) -> Duration {
        Duration::from_nanos(ctx.idle_spin_ns)
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! Contexts for the policies' tests.
    use super::*;
    use crate::stats::Direction;

    /// Bucket of a 4 KiB read.
    pub const READ_4K: Bucket = match Bucket::new(Direction::Read, 4096) {
        Some(bucket) => bucket,
        None => unreachable!(),
    };

    /// Published statistics with the given mean and minimum, 100 samples.
    pub fn stats(mean_ns: u64, min_ns: u64) -> BucketStats {
        BucketStats {
            count: 100,
            mean_ns,
            min_ns,
            max_ns: mean_ns.saturating_mul(2),
            p50_ns: mean_ns,
            p90_ns: mean_ns,
            p99_ns: mean_ns,
            window: 1,
        }
    }

    /// A snapshot where only `READ_4K` has `stats`.
    pub fn snapshot(stats: BucketStats) -> Snapshot {
        Snapshot::EMPTY.with_bucket(READ_4K, stats)
    }

    /// A context for a 4 KiB read submitted at 0, asked at 1 µs.
    pub fn context<'a>(stats: &'a Snapshot, overshoot: &'a OvershootStats) -> PollContext<'a> {
        PollContext {
            now_ns: 1_000,
            outstanding: 1,
            oldest: InFlight {
                bucket: Some(READ_4K),
                submit_ns: 0,
                slept: false,
            },
            stats,
            overshoot,
            interrupts: true,
            oracle_deadline_ns: None,
        }
    }

    /// Asks `policy` with the context built by `context` and altered by `edit`.
    pub fn decide_with(
        policy: &mut dyn PollPolicy,
        stats: BucketStats,
        edit: impl FnOnce(&mut PollContext<'_>),
    ) -> Decision {
        let snapshot = snapshot(stats);
        let overshoot = OvershootStats::new();
        let mut ctx = context(&snapshot, &overshoot);
        edit(&mut ctx);
        policy.decide(&ctx)
    }

    /// `Decision::Sleep` of `ns`.
    pub fn sleep(ns: u64) -> Decision {
        Decision::Sleep(Duration::from_nanos(ns))
    }
}
