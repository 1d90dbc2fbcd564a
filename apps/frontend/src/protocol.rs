//! The trait a front end implements to run on the shared machinery: its per-reactor state,
//! its per-connection state, its parser and its limits. Everything else (sockets, shards,
//! back-pressure, coalescing, metrics, stop) is the same for every protocol.

use hypoll_reactor::Reactor;

use crate::shard::Shard;

/// What a protocol adds to the shared shard: its per-reactor state (`Self`, e.g. the
/// exports and their device queues) and its per-connection state ([`Protocol::Conn`]).
pub trait Protocol: Sized + 'static {
    /// What one connection holds beyond its socket: its session, its requests in flight.
    type Conn;
    /// The protocol's name in log lines ("NBD").
    const NAME: &'static str;

    /// A new connection's state; `greeting` takes the bytes to send it first.
    fn connect(&mut self, greeting: &mut Vec<u8>) -> Self::Conn;
    /// Whether the connection finished its handshake (one that takes too long is closed).
    fn negotiated(conn: &Self::Conn) -> bool;
    /// Requests the connection has in flight (bounded by
    /// [`REQUESTS_INFLIGHT_MAX`](crate::REQUESTS_INFLIGHT_MAX)).
    fn requests_inflight(conn: &Self::Conn) -> usize;
    /// Bytes of the largest whole request, header included: a connection's input buffer
    /// holds one.
    fn request_bytes_max(&self) -> usize;
    /// Whether requests wait for room at a device.
    fn has_backlog(&self) -> bool;
    /// Runs the protocol over connection `key`'s input while [`Shard::can_parse`] allows:
    /// consumes what it parsed, queues replies, starts requests. Returns the work done.
    fn parse(shard: &mut Shard<Self>, r: &mut Reactor<Shard<Self>>, key: usize) -> usize;
    /// Submits what requests waiting for room at a device can now. Returns the work done.
    fn retry_backlog(shard: &mut Shard<Self>, r: &mut Reactor<Shard<Self>>) -> usize;
    /// What the connection's close line adds (e.g. requests refused and not logged); a
    /// non-empty note gets the close logged.
    fn close_note(conn: &Self::Conn) -> String;
}
