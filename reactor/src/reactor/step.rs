//! The step API: a reactor without a thread of its own, for an embedder that runs its own
//! loop (its own thread, its own event loop) and drives the reactor one turn at a time, as
//! SPDK's `spdk_thread_poll` lets an application drive an SPDK thread. [`Reactor::poll`]
//! is one turn, [`Reactor::idle`] what a turn without work does, [`Reactor::shut_down`] the
//! end. A [`ReactorSet`](crate::ReactorSet) thread runs the same pieces in its own loop.

use std::sync::Arc;

use hypoll_policy::PollPolicy;

use super::{mailbox, ExitReport, Reactor, ReactorHandle, ReactorTuning, WakeState};
use crate::set::{PolicyFactory, ReactorStartError, MAILBOX_CAPACITY};
use crate::stats::STATS_PUBLISH_NS;

/// How to build a reactor that the caller drives itself ([`Reactor::standalone`]).
#[derive(Clone, Debug)]
pub struct StandaloneConfig {
    /// What the reactor reports as its core ([`Reactor::core`], [`ExitReport::core`]): a
    /// label only. The reactor runs on whatever thread drives it, pinned or not, as the
    /// embedder chose.
    pub core: usize,
    /// Poll policy spec (`classic`, `hybrid`, `hybrid-min:adjust=2000`).
    pub policy: String,
    /// A policy of the application's own, built with index 0; `policy` is then unused.
    pub custom_policy: Option<PolicyFactory>,
    pub mailbox_capacity: usize,
    pub tuning: ReactorTuning,
}

impl Default for StandaloneConfig {
    fn default() -> Self {
        StandaloneConfig {
            core: 0,
            policy: "classic".to_string(),
            custom_policy: None,
            mailbox_capacity: MAILBOX_CAPACITY,
            tuning: ReactorTuning::default(),
        }
    }
}

/// Builds a reactor's policy: the application's own if it gave a factory, else the spec's.
pub(crate) fn build_policy(
    spec: &str,
    custom: Option<&PolicyFactory>,
    index: usize,
) -> Result<Box<dyn PollPolicy>, ReactorStartError> {
    match custom {
        Some(factory) => Ok((factory.0)(index)),
        None => hypoll_policy::build(spec).map_err(ReactorStartError::Policy),
    }
}

impl<S> Reactor<S> {
    /// A reactor with no thread of its own, and the handle other threads reach it through.
    /// The caller drives it: [`Reactor::poll`] for a turn, [`Reactor::idle`] after a turn
    /// that found nothing, [`Reactor::shut_down`] to stop. Build it on the thread that will
    /// drive it: its CPU time ([`ReactorStats::cpu_ns`](crate::ReactorStats::cpu_ns)) is that
    /// thread's. Nothing about the thread is changed: no pinning, no timer slack (see
    /// [`set_timer_slack_ns`](crate::set_timer_slack_ns) for why a reactor's thread wants
    /// 1 ns).
    pub fn standalone(
        cfg: StandaloneConfig,
    ) -> Result<(Reactor<S>, ReactorHandle<S>), ReactorStartError> {
        if cfg.mailbox_capacity == 0 {
            return Err(ReactorStartError::Mailbox(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "mailbox capacity must be at least 1",
            )));
        }
        let policy = build_policy(&cfg.policy, cfg.custom_policy.as_ref(), 0)?;
        let (handle, rx) =
            mailbox(0, cfg.core, cfg.mailbox_capacity).map_err(ReactorStartError::Mailbox)?;
        let cpu = crate::sys::ThreadCpuClock::current().map_err(ReactorStartError::CpuClock)?;
        handle.stats_cell().set_cpu_clock(cpu);
        let handles: Arc<[ReactorHandle<S>]> = Arc::new([handle.clone()]);
        let reactor =
            Reactor::new(0, rx, handles, policy, cfg.tuning).map_err(ReactorStartError::Setup)?;
        Ok((reactor, handle))
    }

    /// One loop turn at the clock's current time: at most [`MESSAGE_BATCH`](super::MESSAGE_BATCH)
    /// messages, the due timers, the pollers, at most [`COMPLETION_BATCH`](super::COMPLETION_BATCH)
    /// completions per device, I/Os waiting for a slot, timeouts. Returns the work done: 0
    /// means nothing had any, and the caller should call [`Reactor::idle`] next (or do
    /// something else of its own; the reactor keeps no time while it is not called).
    /// Never blocks. A reactor shut down does nothing and returns 0.
    pub fn poll(&mut self, state: &mut S) -> usize {
        if self.stopping {
            return 0;
        }
        let start_ns = self.clock.now_ns();
        let work = self.step(state, start_ns);
        // The turn's own time, busy or idle; the caller's time between calls is neither.
        let elapsed_ns = self.clock.now_ns().saturating_sub(start_ns);
        if work > 0 {
            self.counters.busy_ns += elapsed_ns;
        } else {
            self.counters.idle_ns += elapsed_ns;
        }
        self.idle_due = work == 0;
        work
    }

    /// What a turn that found nothing does: with I/O outstanding, what the policy decides
    /// (spin, sleep, or wait for a device interrupt); with none, spin for
    /// [`ReactorTuning::idle_spin_ns`] (or what the policy's idle decision says, once front
    /// ends report requests: [`Reactor::note_arrivals`]) and then park until a message, a
    /// timer, a poller's fd or a timeout wakes it. No wait lasts past the next timer, nor an I/O's timeout, and a
    /// message sent through the handle ends a park at once. Call it right after a
    /// [`Reactor::poll`] that returned 0: at any other time it does nothing and returns at
    /// once, so a wait is never decided from a stale turn.
    pub fn idle(&mut self) {
        if !self.idle_due || self.stopping {
            return;
        }
        self.idle_due = false;
        // The policy decides at the time it is asked, not at the turn's start: the caller
        // may have done its own work in between.
        self.now_ns = self.clock.now_ns();
        let from_ns = self.now_ns;
        self.when_idle();
        self.counters.idle_ns += self.clock.now_ns().saturating_sub(from_ns);
    }

    /// Stops the reactor: refuses further messages ([`SendError::Stopped`](super::SendError::Stopped)),
    /// runs those already queued, lets outstanding I/O complete for up to
    /// [`ReactorTuning::shutdown_timeout`] and fails the rest with
    /// [`IoFailure::Shutdown`](crate::IoFailure::Shutdown), deleting the queue pairs. The
    /// reactor stays for the caller to look inside (its counters, an exit hook of its own);
    /// `poll` and `idle` do nothing from now on. A second call reports again and changes
    /// nothing.
    pub fn shut_down(&mut self, state: &mut S) -> ExitReport {
        self.me().stop();
        if self.stopping {
            return ExitReport {
                core: self.core,
                stats: self.me().stats(),
                ..ExitReport::default()
            };
        }
        let report = self.stop_and_drain(state);
        // The driving thread's CPU clock may be reused by another thread once it exits.
        self.me().stats_cell().freeze_cpu();
        report
    }

    /// One turn from `start_ns`, with what precedes and follows any turn: how the last
    /// wait ended, statistics published on time. Returns the work done.
    pub(super) fn step(&mut self, state: &mut S, start_ns: u64) -> usize {
        self.now_ns = start_ns;
        // What the last turn's wait (if any) makes of this one; none yet for the next.
        self.wake_this_turn = std::mem::take(&mut self.wake_next_turn);
        let work = self.turn(state);
        if self.now_ns - self.last_publish_ns >= STATS_PUBLISH_NS {
            self.publish();
        }
        if work > 0 {
            self.idle_since_ns = None;
        }
        debug_assert_eq!(self.wake_next_turn, WakeState::Awake);
        work
    }
}
