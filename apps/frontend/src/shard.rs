//! A reactor's shard of a front end: the connections that reactor owns, in one epoll set
//! whose fd is the shard poller's wake fd, so the policy that decides how the reactor waits
//! for its devices also governs its sockets. This file holds the connections' life: adopted
//! from the listener, progressed (parse, write, re-arm the epoll interest), closed when
//! finished, drained on a graceful stop, and closed early when a handshake takes too long.
//! What a protocol adds (its parser, its requests) comes in through [`Protocol`]; the turn
//! that reads the sockets is in `turn.rs`.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use hypoll_reactor::{Poller, Reactor};
use slab::Slab;

use crate::bufcache::BufCache;
use crate::conn::{Conn, StartTlsError, READ_CHUNK_BYTES};
use crate::epoll::{Epoll, Interest};
use crate::loglimit::{suppressed_note, LogLimit};
use crate::metrics::ConnMetrics;
use crate::protocol::{HasShard, Protocol};
use crate::stream::Stream;
use crate::sweep::SWEEP_PERIOD;
use crate::turn::Pace;
use crate::{ServiceConfig, COALESCE_NS_MAX, CONNECTIONS_PER_REACTOR_MAX};

/// One reactor's connections for protocol `P`.
pub struct Shard<P: Protocol> {
    /// The reactor's index.
    pub index: usize,
    /// The protocol's state on this reactor.
    pub proto: P,
    /// Open connections, keyed as their epoll tokens.
    pub conns: Slab<Conn<P>>,
    /// Idle data buffers for the next requests.
    pub bufs: BufCache,
    pub metrics: ConnMetrics,
    pub(crate) epoll: Rc<Epoll>,
    /// Connections with replies to send or buffered input to parse.
    pub(crate) dirty: Vec<usize>,
    pub(crate) ready: Vec<(u64, u32)>,
    pub(crate) draining: bool,
    /// Connections open on the whole service (the listener's bound).
    open: Arc<AtomicUsize>,
    /// See [`ServiceConfig::connection_bytes_max`].
    pub(crate) connection_bytes_max: usize,
    /// A connection still negotiating after this long is closed.
    pub(crate) handshake_timeout_ns: u64,
    pub(crate) pace: Pace,
    /// A connection with nothing in flight that sends nothing for this long is closed.
    pub(crate) idle_timeout_ns: Option<u64>,
    /// A connection with part of a request in and nothing more for this long is closed.
    pub(crate) request_stall_timeout_ns: u64,
    /// Connections holding a slot for a large request (see `intake.rs`), and those waiting
    /// for one, oldest first.
    pub(crate) large_inputs: usize,
    pub(crate) large_waiters: VecDeque<usize>,
    /// This reactor's lines about its clients: a client looping through errors must not
    /// flood the log.
    log_limit: LogLimit,
    /// What every connection's TLS session is made from; `None` when TLS is off.
    tls: Option<Arc<rustls::ServerConfig>>,
}

/// Sets up a shard of `proto` on reactor `r`: its epoll set, its poller and the handshake
/// sweep. The shard is the reactor's state (what `init` returns): every message, timer and
/// I/O callback on that reactor is handed it.
pub(crate) fn build<P: Protocol, S: HasShard<P>>(
    r: &mut Reactor<S>,
    proto: P,
    cfg: &ServiceConfig,
    metrics: ConnMetrics,
    open: Arc<AtomicUsize>,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> Result<Shard<P>, String> {
    let epoll = Rc::new(Epoll::new().map_err(|e| format!("creating epoll: {e}"))?);
    let shard = Shard {
        index: r.index(),
        proto,
        conns: Slab::new(),
        bufs: BufCache::default(),
        metrics,
        epoll: epoll.clone(),
        dirty: Vec::new(),
        ready: Vec::new(),
        draining: false,
        open,
        connection_bytes_max: cfg.connection_bytes_max,
        handshake_timeout_ns: u64::try_from(cfg.handshake_timeout.as_nanos()).unwrap_or(u64::MAX),
        pace: Pace::new(cfg.idle_spin_ns, cfg.coalesce_ns.min(COALESCE_NS_MAX)),
        idle_timeout_ns: cfg
            .idle_timeout
            .map(|t| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)),
        request_stall_timeout_ns: u64::try_from(cfg.request_stall_timeout.as_nanos())
            .unwrap_or(u64::MAX),
        large_inputs: 0,
        large_waiters: VecDeque::new(),
        log_limit: LogLimit::default(),
        tls,
    };
    r.add_poller(Box::new(ShardPoller::<P> {
        epoll,
        protocol: std::marker::PhantomData,
    }))
    .map_err(|e| format!("adding the {} poller: {e}", P::NAME))?;
    r.every(SWEEP_PERIOD, |r, state: &mut S| state.shard().sweep(r));
    Ok(shard)
}

/// Polls the reactor's shard every turn; its wake fd is the shard's epoll set, so a parked
/// reactor wakes when a client sends.
struct ShardPoller<P> {
    epoll: Rc<Epoll>,
    protocol: std::marker::PhantomData<fn() -> P>,
}

impl<P: Protocol, S: HasShard<P>> Poller<S> for ShardPoller<P> {
    fn poll(&mut self, reactor: &mut Reactor<S>, state: &mut S) -> usize {
        state.shard().poll(reactor)
    }

    fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.epoll.as_fd())
    }
}

impl<P: Protocol> Shard<P> {
    /// Logs a line about a client (a `tracing` warning), within this reactor's bound of
    /// [`LOG_LINES_PER_WINDOW_MAX`](crate::LOG_LINES_PER_WINDOW_MAX) lines a second; the
    /// next line logged says how many were not.
    pub fn log(&self, peer: &str, message: &str) {
        if let Some(suppressed) = self.log_limit.admit(std::time::Instant::now()) {
            let note = suppressed_note(suppressed);
            tracing::warn!("reactor {}: {peer}: {message}{note}", self.index);
        }
    }

    /// Whether connection `key` may take more requests now (it is open, within its bounds,
    /// and the service is not stopping).
    pub fn can_parse(&self, key: usize) -> bool {
        self.conns[key].can_parse(self.draining, self.connection_bytes_max)
    }

    /// Starts TLS on connection `key` once the replies queued so far are sent; refused
    /// when input is left after the request to start it (see [`StartTlsError`]), or when
    /// the service has no TLS.
    pub fn start_tls(&mut self, key: usize) -> Result<(), StartTlsError> {
        self.conns[key].start_tls(self.tls.as_ref())
    }

    /// Counts a request parsed and started (the pacing of socket reads follows the count).
    pub fn count_request(&mut self) {
        self.pace.requests_started += 1;
    }

    /// Has connection `key` progressed (parse, write) on this turn or the next.
    pub fn mark_dirty(&mut self, key: usize) {
        if let Some(c) = self.conns.get_mut(key) {
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(key);
            }
        }
    }

    /// Input buffer bound of a connection: one whole request and a read's worth beyond.
    pub(crate) fn inbuf_limit(&self) -> usize {
        self.proto.request_bytes_max() + READ_CHUNK_BYTES
    }

    /// Gives back one connection of the service's count.
    fn open_dec(&self) {
        let before = self.open.fetch_sub(1, Ordering::AcqRel);
        assert!(before > 0, "more connections closed than were counted open");
    }

    /// A new connection from the listener (counted open by it).
    pub(crate) fn adopt<S: HasShard<P>>(
        &mut self,
        r: &mut Reactor<S>,
        stream: Stream,
        peer: String,
    ) {
        if self.draining || self.conns.len() >= CONNECTIONS_PER_REACTOR_MAX {
            self.open_dec();
            self.log(
                &peer,
                "refused: the server is stopping or this reactor is full",
            );
            return;
        }
        let mut greeting = Vec::new();
        let proto = self.proto.connect(&mut greeting);
        let entry = self.conns.vacant_entry();
        let key = entry.key();
        let interest = Interest {
            read: true,
            write: false,
        };
        if let Err(e) = self.epoll.add(stream.fd(), interest, key as u64) {
            self.open_dec();
            self.log(&peer, &format!("dropped: watching its socket: {e}"));
            return;
        }
        // Seen under `hypoll serve --verbose` only (INFO), as nbdkit's -v shows each client.
        tracing::info!(
            "reactor {}: {peer}: {} client connected",
            self.index,
            P::NAME
        );
        let mut conn = Conn::new(stream, peer, proto, interest, r.now_ns());
        conn.push_bytes(greeting);
        entry.insert(conn);
        self.metrics.accepted.inc();
        self.metrics.open.inc();
        self.mark_dirty(key);
        assert!(key < CONNECTIONS_PER_REACTOR_MAX);
        assert!(self.conns.len() <= CONNECTIONS_PER_REACTOR_MAX);
    }

    /// Stop reading requests everywhere; connections close as they finish.
    pub(crate) fn drain(&mut self) {
        self.draining = true;
        let keys: Vec<usize> = self.conns.iter().map(|(k, _)| k).collect();
        for k in keys {
            self.mark_dirty(k);
        }
    }

    /// Parses buffered input, sends replies, closes a finished connection, and watches the
    /// socket for what the connection waits for. Returns the work done.
    pub(crate) fn progress<S: HasShard<P>>(&mut self, r: &mut Reactor<S>, key: usize) -> usize {
        let Some(conn) = self.conns.get_mut(key) else {
            return 0;
        };
        conn.dirty = false;
        if conn.lingering() {
            if conn.discard_input(r.now_ns()) {
                self.close(key, r.now_ns());
            }
            return 1;
        }
        if conn.can_parse(self.draining, self.connection_bytes_max)
            && !conn.eof
            && !conn.awaiting_large_input
            && conn.tls_input_waiting()
        {
            // Decrypted input left in the TLS session when the last read stopped: the
            // socket may hold nothing more, so no readiness event would bring it.
            let limit = self.read_limit(key);
            self.conns[key].read_in(limit);
        }
        let mut work = P::parse(self, r, key);
        let draining = self.draining;
        let bytes_max = self.connection_bytes_max;
        let Some(conn) = self.conns.get_mut(key) else {
            return work;
        };
        if !conn.gone && conn.has_output() && !conn.write_blocked {
            let held_back = !conn.can_parse(draining, bytes_max) && conn.in_start < conn.in_end;
            match conn.write_out(&mut self.bufs) {
                Ok(n) => {
                    if n > 0 {
                        conn.last_active_ns = r.now_ns();
                    }
                    work += usize::from(n > 0);
                }
                Err(e) => {
                    conn.gone = true;
                    conn.failed = true;
                    conn.closing = Some(format!("writing the socket: {e}"));
                }
            }
            if held_back && conn.can_parse(draining, bytes_max) {
                // The replies sent made room for requests already read off the socket: no
                // socket event will come for them, so parse them now. What that queues
                // without a device command (a refusal, a handshake reply) has no
                // completion to send it: the next turn does, and parses on if the bound
                // holds them again.
                let parsed = P::parse(self, r, key);
                if parsed > 0 {
                    self.mark_dirty(key);
                }
                work += parsed;
            }
        }
        self.settle_large_input(key, r.now_ns());
        let Some(conn) = self.conns.get_mut(key) else {
            return work;
        };
        if conn.eof && conn.closing.is_none() && conn.can_parse(draining, bytes_max) {
            // Parsing stopped for want of input, not for a limit: every whole request the
            // client sent has started. Close once they finish.
            conn.closing = Some("the client closed the connection".into());
        }
        if draining && conn.closing.is_none() {
            conn.closing = Some("the server is stopping".into());
        }
        let finished = conn.closing.is_some()
            && P::requests_inflight(&conn.proto) == 0
            && (conn.gone || !conn.has_output());
        if finished && conn.should_linger() && conn.half_close(r.now_ns()).is_ok() {
            // Replies are out and the server's side is ended; from here the connection only
            // discards what its client still sends, then closes. It ended now: say so now.
            let want = Interest {
                read: true,
                write: false,
            };
            if want != conn.interest
                && self
                    .epoll
                    .modify(conn.stream.fd(), want, key as u64)
                    .is_ok()
            {
                conn.interest = want;
            }
            self.report_end(key);
            // It reads no more requests: a slot for a large one goes to the next in line.
            self.leave_large_input(key, r.now_ns());
            return work + 1;
        }
        if finished {
            self.close(key, r.now_ns());
            return work + 1;
        }
        let want = Interest {
            read: conn.can_parse(draining, bytes_max) && !conn.eof && !conn.awaiting_large_input,
            write: conn.write_blocked,
        };
        if want.read && conn.tls_input_waiting() {
            // As above: read it on the next turn, not on a socket event that may not come.
            self.mark_dirty(key);
            work += 1;
        }
        let Some(conn) = self.conns.get_mut(key) else {
            return work;
        };
        let result = if conn.gone && conn.registered {
            // Nothing more to read or write: stop hearing about it.
            conn.registered = false;
            self.epoll.remove(conn.stream.fd())
        } else if !conn.gone && want != conn.interest {
            // Kept only once the kernel has it: a failed change is tried again on the next
            // turn that progresses the connection.
            let changed = self.epoll.modify(conn.stream.fd(), want, key as u64);
            if changed.is_ok() {
                conn.interest = want;
            }
            changed
        } else {
            Ok(())
        };
        if let Err(e) = result {
            let peer = conn.peer.clone();
            self.log(&peer, &format!("updating its epoll interest: {e}"));
        }
        work
    }

    /// Removes a finished connection: out of the epoll set, out of the counts, logged if it
    /// failed or has something to say.
    fn close(&mut self, key: usize, now_ns: u64) {
        self.leave_large_input(key, now_ns);
        let mut conn = self.conns.remove(key);
        if !conn.gone && !conn.lingering() {
            conn.close_tls();
        }
        conn.assert_closed_clean();
        if conn.registered {
            let _ = self.epoll.remove(conn.stream.fd());
        }
        self.open_dec();
        self.metrics.open.dec();
        if !conn.lingering() {
            self.report_conn_end(&conn);
        }
    }

    /// Counts and logs the end of connection `key` (once: at its half-close if it lingers,
    /// else as it closes).
    fn report_end(&self, key: usize) {
        self.report_conn_end(&self.conns[key]);
    }

    fn report_conn_end(&self, conn: &Conn<P>) {
        if conn.failed {
            self.metrics.closed_on_error.inc();
        }
        let note = P::close_note(&conn.proto);
        let why = conn.closing.as_deref().unwrap_or_default();
        if conn.failed || !note.is_empty() {
            self.log(&conn.peer, &format!("closed: {why}{note}"));
        } else {
            let sep = if why.is_empty() { "" } else { ": " };
            tracing::info!(
                "reactor {}: {}: {} client left{sep}{why}",
                self.index,
                conn.peer,
                P::NAME
            );
        }
    }
}
