//! How much a reactor lets its connections read ahead of their parser. Every connection has
//! a standing input buffer of [`INBUF_KEEP_BYTES`]; a request larger than that (a large
//! write's payload) needs the buffer grown to hold it whole, and a connection may grow it
//! only while it holds one of its reactor's [`LARGE_INPUTS_PER_REACTOR`] slots. The others
//! wait, their sockets unread (the kernel's buffers hold what their clients send meanwhile),
//! and take a slot as one frees, first come first served. So partly received requests
//! hold at most that many large buffers per reactor, not one per connection: 16 clients that
//! each send most of a 32 MiB write and stop cannot make the server hold 512 MiB.
//!
//! A slot frees when its request has been parsed (its payload then counts against the
//! connection's byte bound while its command runs), or when the connection closes; a client
//! that stops sending mid-request is closed after the service's request stall timeout
//! ([`ServiceConfig::request_stall_timeout`](crate::ServiceConfig::request_stall_timeout)),
//! so a slot cannot be held forever.

use crate::conn::INBUF_KEEP_BYTES;
use crate::protocol::Protocol;
use crate::shard::Shard;

/// Connections of one reactor that may receive a request larger than the standing input
/// buffer (1 MiB) at once.
pub const LARGE_INPUTS_PER_REACTOR: usize = 4;

impl<P: Protocol> Shard<P> {
    /// The input buffer bound connection `key` reads under now: its standing buffer, or
    /// room for the largest request while it holds a slot.
    pub(crate) fn read_limit(&self, key: usize) -> usize {
        let whole = self.inbuf_limit();
        match self.conns.get(key) {
            Some(c) if c.large_input => whole,
            _ => whole.min(INBUF_KEEP_BYTES),
        }
    }

    /// After connection `key` parsed what it could: if its standing buffer is full of one
    /// request not yet whole, it takes a slot (and reads on) or queues for one (and stops
    /// reading); if it holds a slot and its large request is through, the slot goes to the
    /// next in the queue.
    pub(crate) fn settle_large_input(&mut self, key: usize, now_ns: u64) {
        let whole = self.inbuf_limit();
        let Some(c) = self.conns.get_mut(key) else {
            return;
        };
        if c.large_input {
            // Its large request is through once what is left of its input fits the
            // standing buffer again (a granted connection's buffer is still full).
            if c.input_len() < INBUF_KEEP_BYTES {
                c.shrink_input();
                c.large_input = false;
                self.large_inputs -= 1;
                self.grant_large_inputs(now_ns);
            }
        } else if !c.awaiting_large_input
            && whole > INBUF_KEEP_BYTES
            && c.input_len() >= INBUF_KEEP_BYTES
        {
            if self.large_inputs < LARGE_INPUTS_PER_REACTOR {
                c.large_input = true;
                self.large_inputs += 1;
                self.mark_dirty(key);
            } else {
                c.awaiting_large_input = true;
                self.large_waiters.push_back(key);
            }
        }
        debug_assert!(self.large_inputs <= LARGE_INPUTS_PER_REACTOR);
    }

    /// Gives free slots to waiting connections, oldest first.
    fn grant_large_inputs(&mut self, now_ns: u64) {
        while self.large_inputs < LARGE_INPUTS_PER_REACTOR {
            let Some(key) = self.large_waiters.pop_front() else {
                return;
            };
            let Some(c) = self.conns.get_mut(key) else {
                continue;
            };
            debug_assert!(c.awaiting_large_input && !c.large_input);
            c.awaiting_large_input = false;
            c.large_input = true;
            // Its wait was the server's doing: the stall clock starts again.
            c.last_input_ns = now_ns;
            self.large_inputs += 1;
            // Its socket holds the rest of its request: read it on the next turn.
            self.mark_dirty(key);
        }
    }

    /// Connection `key` is closing: its slot, or its place in the queue, goes.
    pub(crate) fn leave_large_input(&mut self, key: usize, now_ns: u64) {
        let Some(c) = self.conns.get_mut(key) else {
            return;
        };
        if c.large_input {
            c.large_input = false;
            self.large_inputs -= 1;
            self.grant_large_inputs(now_ns);
        } else if c.awaiting_large_input {
            c.awaiting_large_input = false;
            self.large_waiters.retain(|&k| k != key);
        }
    }
}
