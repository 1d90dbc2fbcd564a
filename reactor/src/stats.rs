//! Per-reactor statistics: counted by the reactor without atomics, published every
//! [`STATS_PUBLISH_NS`] to a shared cell that any thread can read.

use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::sys::ThreadCpuClock;

/// How often a running reactor publishes its counters.
pub const STATS_PUBLISH_NS: u64 = 10_000_000;

/// Counters a reactor keeps on its own thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// I/Os completed (with any status).
    pub ios: u64,
    /// I/Os completed with an error.
    pub io_errors: u64,
    /// Loop turns.
    pub polls: u64,
    /// Loop turns that found no work.
    pub idle_polls: u64,
    /// Sleeps carried out for a policy's `Sleep` decision.
    pub sleeps: u64,
    /// Blocks on device interrupts for a policy's `WaitInterrupt`.
    pub interrupt_waits: u64,
    /// A policy's `WaitInterrupt` carried out as one spin, because a device with I/O
    /// outstanding has no interrupt line to wait on (polled completions, virtual time): a
    /// policy that keeps asking is defeated, and the first is logged.
    pub interrupt_waits_spun: u64,
    /// Waits on the device interrupts carried out inside an io_uring device's ring
    /// (`io_uring_enter`) rather than in epoll: counted among `interrupt_waits` (or a
    /// sleep's early end) as well.
    pub ring_waits: u64,
    /// Parks with nothing outstanding.
    pub parks: u64,
    /// Messages run.
    pub messages: u64,
    /// Timer callbacks run.
    pub timers: u64,
    /// Time in turns that did work, and in turns that did not (including sleeps and parks).
    pub busy_ns: u64,
    pub idle_ns: u64,
    /// Sum of requested sleeps and of their overshoot (actual minus requested).
    pub slept_ns: u64,
    pub overshoot_ns: u64,
    /// I/Os that reached their device's I/O timeout.
    pub io_timeouts: u64,
    /// Aborts sent for timed-out I/Os (devices that cannot abort are not counted).
    pub aborts: u64,
    /// Queue-pair resets asked for (after an abort did not complete an I/O in time).
    pub resets: u64,
    /// Resets the device could not carry out.
    pub reset_failures: u64,
    /// I/Os failed locally with `IoFailure::Abandoned` (their buffers quarantined).
    pub abandoned_ios: u64,
    /// Completions that arrived for abandoned I/Os, and were dropped.
    pub late_completions: u64,
    /// Requests front ends reported arriving (`Reactor::note_arrivals`).
    pub arrivals: u64,
    /// Idle stretches whose spin the policy decided (`PollPolicy::decide_idle`).
    pub idle_decisions: u64,
}

/// What [`crate::ReactorHandle::stats`] returns: the counters as last published, the
/// reactor's wall time then, and its CPU time (user + system) read from the OS now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReactorStats {
    pub core: usize,
    pub counters: Counters,
    /// Wall time from the reactor's start to the publication.
    pub wall_ns: u64,
    /// The reactor thread's CPU time, from the OS.
    pub cpu_ns: u64,
    /// I/Os outstanding at the publication.
    pub outstanding: u64,
}

impl ReactorStats {
    /// Completed I/Os per second of wall time.
    pub fn iops(&self) -> f64 {
        per_second(self.counters.ios, self.wall_ns)
    }

    /// Share of wall time spent in turns that did work.
    pub fn busy_pct(&self) -> f64 {
        pct(
            self.counters.busy_ns,
            self.counters.busy_ns + self.counters.idle_ns,
        )
    }

    /// Share of one core the reactor thread used.
    pub fn cpu_pct(&self) -> f64 {
        pct(self.cpu_ns, self.wall_ns)
    }

    /// Mean wake-up overshoot of the sleeps so far.
    pub fn overshoot_mean_ns(&self) -> Option<u64> {
        (self.counters.sleeps > 0).then(|| self.counters.overshoot_ns / self.counters.sleeps)
    }

    /// The change from `earlier` to `self`: rates over an interval. (Counters only grow;
    /// an `earlier` that is not earlier gives zeroes, not a panic.)
    pub fn since(&self, earlier: &ReactorStats) -> ReactorStats {
        let (a, b) = (&self.counters, &earlier.counters);
        ReactorStats {
            core: self.core,
            counters: Counters {
                ios: a.ios.saturating_sub(b.ios),
                io_errors: a.io_errors.saturating_sub(b.io_errors),
                polls: a.polls.saturating_sub(b.polls),
                idle_polls: a.idle_polls.saturating_sub(b.idle_polls),
                sleeps: a.sleeps.saturating_sub(b.sleeps),
                interrupt_waits: a.interrupt_waits.saturating_sub(b.interrupt_waits),
                interrupt_waits_spun: a
                    .interrupt_waits_spun
                    .saturating_sub(b.interrupt_waits_spun),
                ring_waits: a.ring_waits.saturating_sub(b.ring_waits),
                parks: a.parks.saturating_sub(b.parks),
                messages: a.messages.saturating_sub(b.messages),
                timers: a.timers.saturating_sub(b.timers),
                busy_ns: a.busy_ns.saturating_sub(b.busy_ns),
                idle_ns: a.idle_ns.saturating_sub(b.idle_ns),
                slept_ns: a.slept_ns.saturating_sub(b.slept_ns),
                overshoot_ns: a.overshoot_ns.saturating_sub(b.overshoot_ns),
                io_timeouts: a.io_timeouts.saturating_sub(b.io_timeouts),
                aborts: a.aborts.saturating_sub(b.aborts),
                resets: a.resets.saturating_sub(b.resets),
                reset_failures: a.reset_failures.saturating_sub(b.reset_failures),
                abandoned_ios: a.abandoned_ios.saturating_sub(b.abandoned_ios),
                late_completions: a.late_completions.saturating_sub(b.late_completions),
                arrivals: a.arrivals.saturating_sub(b.arrivals),
                idle_decisions: a.idle_decisions.saturating_sub(b.idle_decisions),
            },
            wall_ns: self.wall_ns.saturating_sub(earlier.wall_ns),
            cpu_ns: self.cpu_ns.saturating_sub(earlier.cpu_ns),
            outstanding: self.outstanding,
        }
    }
}

fn per_second(count: u64, ns: u64) -> f64 {
    if ns == 0 {
        0.0
    } else {
        count as f64 * 1e9 / ns as f64
    }
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// What a reactor last published.
#[derive(Clone, Copy, Default)]
struct Published {
    counters: Counters,
    start_ns: u64,
    at_ns: u64,
    outstanding: u64,
    parked: bool,
}

/// The published copy: locked by the reactor once per publication (every 10 ms, and around
/// parking), never on the I/O path.
#[derive(Default)]
pub(crate) struct SharedStats {
    published: Mutex<Published>,
    cpu_clock: OnceLock<ThreadCpuClock>,
    /// The thread's CPU time when it exited: its clock id may be reused after that.
    final_cpu_ns: OnceLock<u64>,
}

impl SharedStats {
    pub fn set_cpu_clock(&self, clock: ThreadCpuClock) {
        let _ = self.cpu_clock.set(clock);
    }

    /// Called on the reactor thread as it exits (normally or by panic).
    pub fn freeze_cpu(&self) {
        if let Some(cpu_ns) = self.cpu_clock.get().and_then(ThreadCpuClock::cpu_ns) {
            let _ = self.final_cpu_ns.set(cpu_ns);
        }
    }

    pub fn publish(
        &self,
        counters: &Counters,
        start_ns: u64,
        at_ns: u64,
        outstanding: u64,
        parked: bool,
    ) {
        *self.published.lock() = Published {
            counters: *counters,
            start_ns,
            at_ns,
            outstanding,
            parked,
        };
    }

    /// The last publication; for a parked reactor, brought up to now (the time since it
    /// parked is idle).
    pub fn read(&self, core: usize) -> ReactorStats {
        let p = *self.published.lock();
        let mut counters = p.counters;
        let mut at_ns = p.at_ns;
        if p.parked {
            let now_ns = hypoll_nvme::monotonic_ns().max(p.at_ns);
            counters.idle_ns += now_ns - p.at_ns;
            at_ns = now_ns;
        }
        ReactorStats {
            core,
            counters,
            wall_ns: at_ns.saturating_sub(p.start_ns),
            outstanding: p.outstanding,
            cpu_ns: self.cpu_ns().unwrap_or(0),
        }
    }

    /// The reactor thread's CPU time from the OS (frozen once it exited); `None` before it
    /// started.
    pub fn cpu_ns(&self) -> Option<u64> {
        if let Some(&cpu_ns) = self.final_cpu_ns.get() {
            return Some(cpu_ns);
        }
        self.cpu_clock.get().and_then(ThreadCpuClock::cpu_ns)
    }
}
