//! What each reactor checks of its connections a few times a second, since no socket event
//! would bring it: a handshake past its time, a request that stopped arriving, a connection
//! idle past the idle timeout, a half-closed connection whose client never ended its side.

use std::time::Duration;

use hypoll_reactor::Reactor;

use crate::conn::Conn;
use crate::protocol::{HasShard, Protocol};
use crate::shard::Shard;

/// How often each reactor sweeps its connections.
pub(crate) const SWEEP_PERIOD: Duration = Duration::from_millis(250);

/// Why the sweep ends a connection.
enum Overdue {
    Handshake,
    Stalled,
    Idle,
    /// Its linger is over: it closes now (its end was told when it half-closed).
    Lingered,
}

impl<P: Protocol> Shard<P> {
    /// Ends the connections past their time.
    pub(crate) fn sweep<S: HasShard<P>>(&mut self, r: &mut Reactor<S>) {
        let now_ns = r.now_ns();
        let due: Vec<(usize, Overdue)> = self
            .conns
            .iter()
            .filter_map(|(key, c)| self.overdue(c, now_ns).map(|why| (key, why)))
            .collect();
        for (key, why) in due {
            let conn = &mut self.conns[key];
            match why {
                Overdue::Handshake => {
                    conn.failed = true;
                    conn.closing = Some(format!(
                        "handshake not finished within {} ms",
                        self.handshake_timeout_ns / 1_000_000
                    ));
                }
                Overdue::Stalled => {
                    conn.failed = true;
                    conn.closing = Some(format!(
                        "no byte of its unfinished request for {} ms, the request stall \
                         timeout",
                        self.request_stall_timeout_ns / 1_000_000
                    ));
                }
                Overdue::Idle => {
                    let idle_ms = self.idle_timeout_ns.unwrap_or_default() / 1_000_000;
                    conn.closing = Some(format!("idle for {idle_ms} ms, the idle timeout"));
                }
                Overdue::Lingered => {}
            }
            self.progress(r, key);
        }
    }

    /// Whether, and why, connection `c` is past its time at `now_ns`.
    fn overdue(&self, c: &Conn<P>, now_ns: u64) -> Option<Overdue> {
        if c.lingering() {
            return c
                .linger_until_ns
                .is_some_and(|until| now_ns >= until)
                .then_some(Overdue::Lingered);
        }
        if c.closing.is_some() {
            return None;
        }
        if !P::negotiated(&c.proto) {
            let late = now_ns.saturating_sub(c.adopted_ns) > self.handshake_timeout_ns;
            return late.then_some(Overdue::Handshake);
        }
        let stall_ns = self.request_stall_timeout_ns;
        // Part of a request in, and the connection reading (not held back by its bounds,
        // not waiting for room for a large request): its client stopped sending.
        let reading = c.can_parse(self.draining, self.connection_bytes_max)
            && !c.awaiting_large_input
            && !c.eof;
        if reading && c.input_len() > 0 && now_ns.saturating_sub(c.last_input_ns) > stall_ns {
            return Some(Overdue::Stalled);
        }
        let idle = P::requests_inflight(&c.proto) == 0 && !c.has_output() && c.input_len() == 0;
        let idle_over = self
            .idle_timeout_ns
            .is_some_and(|t| now_ns.saturating_sub(c.last_active_ns) > t);
        (idle && idle_over).then_some(Overdue::Idle)
    }
}
