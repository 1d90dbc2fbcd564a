//! What a simulation run takes ([`SimConfig`]) and gives back: a [`SimReport`] of what it
//! did, or the [`SimFailure`] that replays it.

use std::fmt;
use std::time::Duration;

use super::mail::MailSeen;
use super::waiter::WaitsSeen;
use crate::stats::Counters;

/// The shape of a run. The seed draws the rest: the device profile, namespace size, queue
/// depth, how far time moves per step, a factor on every fault rate (from 0.5 to 4), and
/// whether the device can abort and reset.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub reactors: usize,
    /// I/Os each reactor submits (attempts; a full queue retries later).
    pub ios_per_reactor: usize,
    /// Messages sent to each reactor through its handle (the deterministic runner's; some
    /// arm or cancel timers).
    pub messages_per_reactor: usize,
    /// Fault rates before the seed's factor.
    pub err_pct: f64,
    pub lost_pct: f64,
    pub stuck_pct: f64,
    pub reset_pct: f64,
    /// Per-device timeouts, in virtual time.
    pub io_timeout: Duration,
    pub abort_timeout: Duration,
    pub reset_timeout: Duration,
    /// The poll policy every reactor runs (a spec, as `hypoll policies` lists them).
    pub policy: String,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            reactors: 3,
            ios_per_reactor: 300,
            messages_per_reactor: 100,
            err_pct: 2.0,
            lost_pct: 2.0,
            stuck_pct: 30.0,
            reset_pct: 0.3,
            io_timeout: Duration::from_micros(300),
            abort_timeout: Duration::from_micros(100),
            reset_timeout: Duration::from_micros(100),
            policy: "classic".to_owned(),
        }
    }
}

/// What a passing run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimReport {
    pub seed: u64,
    /// What the seed drew: device string, queue depth, step, recovery support.
    pub shape: String,
    pub ios: u64,
    pub io_errors: u64,
    pub queue_full: u64,
    pub io_timeouts: u64,
    pub aborts: u64,
    pub resets: u64,
    pub abandoned: u64,
    pub late_completions: u64,
    pub controller_resets: u64,
    pub reads_checked: u64,
    /// Longest time an I/O waited for its callback (virtual ns).
    pub latency_ns_max: u64,
    /// The policy the reactors ran.
    pub policy: String,
    /// What the reactors' virtual waiters carried out, together.
    pub waits: WaitsSeen,
    /// What the messages and timers did, on every reactor together.
    pub mail: MailSeen,
    /// A hash of the run's events in order (steps, their work and time, every wait): the
    /// same seed and policy give the same hash.
    pub trace_hash: u64,
}

/// A failed run: the seed that replays it and what went wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimFailure {
    pub seed: u64,
    /// The policy it ran (the deterministic runner's; the threaded one draws its own).
    pub policy: String,
    pub message: String,
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "simulation seed {} failed: {} (replay: hypoll sim --seed {} --policy {})",
            self.seed, self.message, self.seed, self.policy
        )
    }
}

impl std::error::Error for SimFailure {}

impl SimReport {
    pub(super) fn add(&mut self, c: &Counters) {
        self.ios += c.ios;
        self.io_errors += c.io_errors;
        self.io_timeouts += c.io_timeouts;
        self.aborts += c.aborts;
        self.resets += c.resets;
        self.abandoned += c.abandoned_ios;
        self.late_completions += c.late_completions;
    }
}
