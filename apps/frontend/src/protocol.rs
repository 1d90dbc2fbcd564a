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
    fn parse<S: HasShard<Self>>(shard: &mut Shard<Self>, r: &mut Reactor<S>, key: usize) -> usize;
    /// Submits what requests waiting for room at a device can now. Returns the work done.
    fn retry_backlog<S: HasShard<Self>>(shard: &mut Shard<Self>, r: &mut Reactor<S>) -> usize;
    /// What the connection's close line adds (e.g. requests refused and not logged); a
    /// non-empty note gets the close logged.
    fn close_note(conn: &Self::Conn) -> String;
}

/// A reactor's state that holds a shard of protocol `P`: the shard itself (a server of one
/// protocol), or a state of several front ends' parts (one set of reactors serving NBD and
/// vhost-user-blk, say), which says where its shard is. Everything the shared machinery
/// runs on a reactor (its poller, timers, the listener's hand-off, a protocol's I/O
/// callbacks) finds the shard through this, at no cost: a field of a known type.
pub trait HasShard<P: Protocol>: Sized + 'static {
    fn shard(&mut self) -> &mut Shard<P>;
}

impl<P: Protocol> HasShard<P> for Shard<P> {
    fn shard(&mut self) -> &mut Shard<P> {
        self
    }
}
