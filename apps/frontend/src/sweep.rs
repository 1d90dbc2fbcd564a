//! What each reactor checks of its connections a few times a second, since no socket event
//! would bring it: a handshake past its time, a half-closed connection whose client never
//! ended its side.

use std::time::Duration;

use hypoll_reactor::Reactor;

use crate::protocol::Protocol;
use crate::shard::Shard;

/// How often each reactor sweeps its connections.
pub(crate) const SWEEP_PERIOD: Duration = Duration::from_millis(250);

impl<P: Protocol> Shard<P> {
    /// Closes connections past their time: a handshake not finished within the handshake
    /// timeout, a lingering connection past its linger.
    pub(crate) fn sweep(&mut self, r: &mut Reactor<Shard<P>>) {
        let now_ns = r.now_ns();
        let due: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                let late_handshake = !P::negotiated(&c.proto)
                    && c.closing.is_none()
                    && now_ns.saturating_sub(c.adopted_ns) > self.handshake_timeout_ns;
                let lingered = c.linger_until_ns.is_some_and(|until| now_ns >= until);
                late_handshake || lingered
            })
            .map(|(key, _)| key)
            .collect();
        for key in due {
            let conn = &mut self.conns[key];
            if conn.closing.is_none() {
                conn.failed = true;
                conn.closing = Some(format!(
                    "handshake not finished within {} ms",
                    self.handshake_timeout_ns / 1_000_000
                ));
            }
            self.progress(r, key);
        }
    }
}
