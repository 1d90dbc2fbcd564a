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

    /// The change from `earlier` to `self`: rates over an interval.
    pub fn since(&self, earlier: &ReactorStats) -> ReactorStats {
        let (a, b) = (&self.counters, &earlier.counters);
        ReactorStats {
            core: self.core,
            counters: Counters {
                ios: a.ios - b.ios,
                io_errors: a.io_errors - b.io_errors,
                polls: a.polls - b.polls,
                idle_polls: a.idle_polls - b.idle_polls,
                sleeps: a.sleeps - b.sleeps,
                interrupt_waits: a.interrupt_waits - b.interrupt_waits,
                parks: a.parks - b.parks,
                messages: a.messages - b.messages,
                timers: a.timers - b.timers,
                busy_ns: a.busy_ns - b.busy_ns,
                idle_ns: a.idle_ns - b.idle_ns,
                slept_ns: a.slept_ns - b.slept_ns,
                overshoot_ns: a.overshoot_ns - b.overshoot_ns,
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

/// The published copy: locked by the reactor once per publication (every 10 ms), never
/// on the I/O path.
#[derive(Default)]
pub(crate) struct SharedStats {
    published: Mutex<(Counters, u64, u64)>,
    cpu_clock: OnceLock<ThreadCpuClock>,
}

impl SharedStats {
    pub fn set_cpu_clock(&self, clock: ThreadCpuClock) {
        let _ = self.cpu_clock.set(clock);
    }

    pub fn publish(&self, counters: &Counters, wall_ns: u64, outstanding: u64) {
        *self.published.lock() = (*counters, wall_ns, outstanding);
    }

    pub fn read(&self, core: usize) -> ReactorStats {
        let (counters, wall_ns, outstanding) = *self.published.lock();
        ReactorStats {
            core,
            counters,
            wall_ns,
            outstanding,
            cpu_ns: self.cpu_ns().unwrap_or(0),
        }
    }

    /// The reactor thread's CPU time from the OS; `None` before it started or after it
    /// exited.
    pub fn cpu_ns(&self) -> Option<u64> {
        self.cpu_clock.get().and_then(ThreadCpuClock::cpu_ns)
    }
}
