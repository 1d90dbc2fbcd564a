//! One reactor turn of a shard: when to read the sockets and what to do meanwhile. The
//! pacing adapts to how clients behave: while devices are busy, sockets are checked at a
//! bounded rate; while clients pipeline deeply, reads are gathered into windows
//! (`coalesce.rs`); while clients wait on each reply, an idle reactor watches its sockets a
//! little before it parks, since parking would add a wake-up to the next request.

use hypoll_reactor::Reactor;

use crate::coalesce::{Coalesce, BATCH_EWMA_WEIGHT};
use crate::epoll::{HANGUP_BITS, READ_BITS, WRITE_BITS};
use crate::protocol::{HasShard, Protocol};
use crate::shard::Shard;

/// While I/O is at a device, the sockets are checked at most this often: the reactor turns
/// fast while it polls for completions, and a readiness check per turn would cost more than
/// the turn (a request arriving meanwhile waits at most this long).
const SOCKET_CHECK_BUSY_NS: u64 = 10_000;
/// Below this many requests per busy poll on average, clients wait on each reply and an
/// idle reactor watches its sockets before parking; above, it parks at once.
const SPIN_BATCH_MAX: f64 = 2.0;

/// A shard's pacing state.
pub(crate) struct Pace {
    /// How long an idle poll watches the sockets for a queue-depth-1 client's next request.
    idle_spin_ns: u64,
    /// Requests parsed so far, and per busy poll on average (weight 1/BATCH_EWMA_WEIGHT).
    pub(crate) requests_started: u64,
    batch_ewma: f64,
    coalesce: Coalesce,
    /// When the sockets were last checked for input.
    sockets_checked_ns: u64,
}

impl Pace {
    pub(crate) fn new(idle_spin_ns: u64, coalesce_ns: u64) -> Pace {
        Pace {
            idle_spin_ns,
            requests_started: 0,
            batch_ewma: 0.0,
            coalesce: Coalesce::new(coalesce_ns),
            sockets_checked_ns: 0,
        }
    }
}

impl<P: Protocol> Shard<P> {
    /// The shard poller's turn. Returns the work done.
    pub(crate) fn poll<S: HasShard<P>>(&mut self, r: &mut Reactor<S>) -> usize {
        let mut work = P::retry_backlog(self, r);
        if let Some(end_ns) = self.coalesce_window(r) {
            // Send what the last batch has ready; let the next batch gather.
            work += self.progress_dirty(r);
            self.pace.coalesce.held = true;
            hypoll_reactor::sleep_until_ns(end_ns);
            // What the window gathered is submitted now, not at the turn's start.
            r.refresh_now_ns();
            self.pace.coalesce.slept_until_ns = Some(end_ns);
        }
        let started_before = self.pace.requests_started;
        if r.outstanding() > 0 && r.now_ns() < self.pace.sockets_checked_ns + SOCKET_CHECK_BUSY_NS {
            // The reactor is turning fast for its devices: a readiness check every turn
            // would cost more than the turn. Send what completed; read a little later.
            return work + self.progress_dirty(r);
        }
        self.pace.sockets_checked_ns = r.now_ns();
        work += self.service_ready(r);
        if work == 0 && !self.pace.coalesce.pipelined() && self.should_wait_for_next_request(r) {
            // Clients wait on each reply: the next request comes within a round trip, and
            // parking now would add a wake-up to it. Watch the sockets for a while first.
            // Each look restamps the turn, so a request found late is not stamped (nor its
            // device latency measured) from the turn's start.
            let until_ns = r.refresh_now_ns() + self.pace.idle_spin_ns;
            while work == 0 && r.refresh_now_ns() < until_ns {
                std::hint::spin_loop();
                work += self.service_ready(r);
            }
        }
        let batch = self.pace.requests_started - started_before;
        let pace = &mut self.pace;
        let slept_until_ns = pace.coalesce.slept_until_ns.take();
        if batch > 0 {
            pace.batch_ewma += (batch as f64 - pace.batch_ewma) / BATCH_EWMA_WEIGHT;
            pace.coalesce.last_batch_ns = slept_until_ns.unwrap_or_else(|| r.now_ns());
        }
        if std::mem::take(&mut pace.coalesce.held) {
            pace.coalesce.window_done(batch, pace.requests_started);
            self.metrics.coalesce_windows.inc();
            self.metrics.coalesced_requests.inc_by(batch);
        }
        debug_assert!(self.pace.coalesce.slept_until_ns.is_none() && !self.pace.coalesce.held);
        work
    }

    /// When to read the sockets next, if this turn should let requests gather first: only
    /// while coalescing is on (or a trial is due), within a window of the last batch, with
    /// nothing at the devices (a sleep would hold their completions), no request waiting for
    /// room at a device, and no stop under way.
    fn coalesce_window<S>(&self, r: &Reactor<S>) -> Option<u64> {
        let c = &self.pace.coalesce;
        if c.window_ns == 0 || self.draining || r.outstanding() > 0 {
            return None;
        }
        if !c.on && self.pace.requests_started < c.probe_at_requests {
            return None;
        }
        let end_ns = c.last_batch_ns.saturating_add(c.window_ns);
        if r.now_ns() >= end_ns || self.proto.has_backlog() {
            return None;
        }
        Some(end_ns)
    }

    /// Whether an idle poll should keep watching the sockets instead of letting the reactor
    /// park: only with nothing at all in flight on this reactor, and only while requests
    /// arrive one or two at a time (a client at queue depth 1, whose latency a wake-up would
    /// add to). Under load, batches are larger and parking costs nothing that matters. (The
    /// caller also skips it once a coalescing window showed the clients pipelining: a fast
    /// reactor sees small batches even then.)
    fn should_wait_for_next_request<S>(&self, r: &Reactor<S>) -> bool {
        self.pace.idle_spin_ns > 0
            && !self.conns.is_empty()
            && !self.draining
            && r.outstanding() == 0
            && self.dirty.is_empty()
            && self.pace.batch_ewma < SPIN_BATCH_MAX
            && self
                .conns
                .iter()
                .all(|(_, c)| P::requests_inflight(&c.proto) == 0)
    }

    /// Reads ready sockets, parses, submits, writes replies. Returns the work done.
    fn service_ready<S: HasShard<P>>(&mut self, r: &mut Reactor<S>) -> usize {
        let mut work = 0;
        let mut ready = std::mem::take(&mut self.ready);
        if let Err(e) = self.epoll.ready(&mut ready) {
            tracing::warn!("reactor {}: epoll_wait failed: {e}", self.index);
        }
        let bytes_max = self.connection_bytes_max;
        for &(token, events) in &ready {
            let key = token as usize;
            let limit = self.read_limit(key);
            let Some(conn) = self.conns.get_mut(key) else {
                continue;
            };
            work += 1;
            if events & WRITE_BITS != 0 {
                conn.write_blocked = false;
            }
            if events & READ_BITS != 0
                && conn.can_parse(self.draining, bytes_max)
                && !conn.eof
                && !conn.awaiting_large_input
            {
                if conn.read_in(limit) > 0 {
                    conn.last_input_ns = r.now_ns();
                    conn.last_active_ns = conn.last_input_ns;
                }
            } else if events & HANGUP_BITS != 0 && !conn.gone {
                // Hung up while we were not reading: nobody will take the replies.
                conn.gone = true;
                if conn.closing.is_none() {
                    conn.closing = Some("the client hung up".into());
                }
            }
            self.mark_dirty(key);
        }
        self.ready = ready;
        work + self.progress_dirty(r)
    }

    /// Parses, submits and writes for the connections marked dirty. Returns the work done.
    pub(crate) fn progress_dirty<S: HasShard<P>>(&mut self, r: &mut Reactor<S>) -> usize {
        let mut work = 0;
        let dirty = std::mem::take(&mut self.dirty);
        for &key in &dirty {
            work += self.progress(r, key);
        }
        let mut dirty = dirty;
        dirty.clear();
        // Connections marked while progressing wait for the next poll.
        dirty.append(&mut self.dirty);
        self.dirty = dirty;
        work
    }
}
