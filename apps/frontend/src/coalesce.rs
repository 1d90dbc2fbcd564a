//! Request coalescing, like a network card's adaptive interrupt moderation: the decision,
//! from what trial windows gather, whether a reactor's clients pipeline deeply enough that
//! reading their sockets once per window pays. The turn that waits for a window's end is in
//! `turn.rs`.
//!
//! A client that keeps many requests in flight sends them one by one as replies reach it,
//! and a fast reactor would read, submit and reply to each alone: one wake-up or readiness
//! check, one read and one write per request, most of the CPU a request costs. While its
//! clients pipeline, the reactor instead reads its sockets at most once per window: after a
//! batch it sends the replies, sleeps until the window from that batch's read is over, and
//! takes what gathered meanwhile in one read. Whether clients pipeline is measured, never
//! guessed: a trial window every [`COALESCE_PROBE_EVERY_REQUESTS`] requests turns coalescing
//! on when it gathered at least [`COALESCE_BATCH_ON`] requests, and it stays on while windows
//! gather [`COALESCE_BATCH_OFF`] or more on average. A client at queue depth 1 sends nothing
//! while it waits for its reply, so its trial windows gather one request and it keeps its
//! latency.

/// Requests a trial window must gather to turn coalescing on. A client gathers about its
/// queue depth in a window, and it gets a batch of replies per window, so a shallow
/// pipeline spends most of each window waiting: clients at queue depth 4 and 8 lost much of
/// their IOPS to a window, while one at 16 lost none (see docs/lab/ for the measurements).
/// Only deep pipelines gain from gathering.
pub(crate) const COALESCE_BATCH_ON: f64 = 12.0;
/// Requests windows must gather on average for coalescing to stay on (below the threshold
/// to turn it on, so a client near it does not flap).
pub(crate) const COALESCE_BATCH_OFF: f64 = 8.0;
/// While not coalescing, one trial window per this many requests tells whether the clients
/// pipeline: a queue-depth-1 client pays a window's delay once in this many requests.
pub(crate) const COALESCE_PROBE_EVERY_REQUESTS: u64 = 1024;
/// After coalescing turned off, the next trial comes this many requests later.
pub(crate) const COALESCE_RETRY_REQUESTS: u64 = 64;
/// Weight of the newest batch in the batch averages: 1/8.
pub(crate) const BATCH_EWMA_WEIGHT: f64 = 8.0;

const _: () = assert!(COALESCE_BATCH_OFF < COALESCE_BATCH_ON);
const _: () = assert!(COALESCE_RETRY_REQUESTS <= COALESCE_PROBE_EVERY_REQUESTS);

/// One reactor's coalescing state.
pub(crate) struct Coalesce {
    /// The window (0: off).
    pub(crate) window_ns: u64,
    pub(crate) on: bool,
    /// Requests a window gathers, on average (weight 1/BATCH_EWMA_WEIGHT).
    batch_ewma: f64,
    /// When the sockets last gave requests.
    pub(crate) last_batch_ns: u64,
    /// With coalescing off, the next trial once the reactor's started requests reach this.
    pub(crate) probe_at_requests: u64,
    /// This turn waited for a window's end: its read ends the window.
    pub(crate) held: bool,
    /// Requests the last trial window gathered.
    last_trial_batch: f64,
    /// This turn slept until then before reading.
    pub(crate) slept_until_ns: Option<u64>,
}

impl Coalesce {
    pub(crate) fn new(window_ns: u64) -> Coalesce {
        Coalesce {
            window_ns,
            on: false,
            batch_ewma: 0.0,
            last_batch_ns: 0,
            probe_at_requests: COALESCE_PROBE_EVERY_REQUESTS,
            held: false,
            last_trial_batch: 0.0,
            slept_until_ns: None,
        }
    }

    /// What a window that gathered `batch` requests says about the clients.
    pub(crate) fn window_done(&mut self, batch: u64, requests_started: u64) {
        let batch = batch as f64;
        if self.on {
            self.batch_ewma += (batch - self.batch_ewma) / BATCH_EWMA_WEIGHT;
            if self.batch_ewma < COALESCE_BATCH_OFF {
                // Windows gathered little lately; whether the clients still pipeline, a
                // trial soon tells (until then they count as pipelining).
                self.on = false;
                self.probe_at_requests = requests_started + COALESCE_RETRY_REQUESTS;
            }
        } else {
            // A trial.
            self.last_trial_batch = batch;
            if batch >= COALESCE_BATCH_ON {
                self.on = true;
                self.batch_ewma = batch;
            } else {
                self.probe_at_requests = requests_started + COALESCE_PROBE_EVERY_REQUESTS;
            }
        }
        // On, windows gather enough on average; off, the next trial is still ahead.
        debug_assert!(!self.on || self.batch_ewma >= COALESCE_BATCH_OFF);
        debug_assert!(self.on || self.probe_at_requests > requests_started);
    }

    /// Whether the clients were seen to pipeline deeply: coalescing is on, or the last
    /// trial window gathered as many requests as keep it on. Shallow pipelines keep the
    /// wait for the next request: parking between their batches would add a wake-up to
    /// every batch, a large share of what a request costs them.
    pub(crate) fn pipelined(&self) -> bool {
        self.on || self.last_trial_batch >= COALESCE_BATCH_OFF
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::COALESCE_NS_DEFAULT;

    #[test]
    fn clients_that_wait_on_replies_never_turn_coalescing_on() {
        let mut c = Coalesce::new(COALESCE_NS_DEFAULT);
        let mut requests = 0;
        for _ in 0..100 {
            // Queue depth 1 or 2: a trial window gathers at most two requests.
            requests += COALESCE_PROBE_EVERY_REQUESTS;
            c.window_done(2, requests);
            assert!(!c.on);
            assert_eq!(
                c.probe_at_requests,
                requests + COALESCE_PROBE_EVERY_REQUESTS
            );
        }
        c.window_done(0, requests);
        assert!(!c.on && !c.pipelined());
    }

    #[test]
    fn coalescing_turns_on_for_pipelining_clients_and_off_when_they_stop() {
        let mut c = Coalesce::new(COALESCE_NS_DEFAULT);
        assert!(!c.pipelined());
        // A trial gathering what a queue depth 8 client sends: not worth a window.
        c.window_done(8, 1024);
        assert!(!c.on && c.pipelined());
        c.window_done(12, 2048);
        assert!(c.on && c.pipelined());
        // Windows gathering 8 keep it on (hysteresis) ...
        for _ in 0..50 {
            c.window_done(8, 2000);
            assert!(c.on);
        }
        // ... windows gathering one or none turn it off, and bring the next trial near;
        // until it, the clients still count as pipelining.
        let mut windows = 0;
        while c.on {
            c.window_done(1, 3000);
            windows += 1;
            assert!(windows < 20, "coalescing stays on for clients that stopped");
        }
        assert_eq!(c.probe_at_requests, 3000 + COALESCE_RETRY_REQUESTS);
        assert!(c.pipelined());
        // A trial that gathers one request: a client that waits on its replies.
        c.window_done(1, 3064);
        assert!(!c.on && !c.pipelined());
        assert_eq!(c.probe_at_requests, 3064 + COALESCE_PROBE_EVERY_REQUESTS);
        // One that gathers two: a shallow pipeline, neither coalesced nor counted as deep.
        c.window_done(2, 4096);
        assert!(!c.on && !c.pipelined());
        // One that gathers eight: deep enough to stop waiting for single requests, not to
        // coalesce.
        c.window_done(8, 5120);
        assert!(!c.on && c.pipelined());
    }
}
