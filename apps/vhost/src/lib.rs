//! hypoll-vhost: a vhost-user-blk back end on hypoll reactors.
//!
//! A virtual machine's disk, served from the guest's own memory: QEMU (or any vhost-user
//! front end) hands the back end a guest's virtio-blk queues over a unix socket, and the
//! back end reads requests straight out of the guest's rings and does their I/O by
//! vectored commands into the guest's memory, registered with the device.
//!
//! - `blk.rs`: what the device offers (features, config space, the limits on a request);
//! - `walk.rs`: walking one descriptor chain as a hostile guest may have written it;
//! - `request.rs`: from a walked chain to a typed request, or a typed refusal;
//! - `host.rs`: the guest's memory through host pointers, resolved once per memory map
//!   (the one module with pointer arithmetic); `split.rs`: the avail and used rings on it;
//! - `memory.rs`: the guest's memory, mapped from the front end's memfds, published to the
//!   rings, and registered with the device on each reactor that owns a ring;
//! - `ring.rs`: a virtqueue owned by a reactor: requests off the avail ring into vectored
//!   I/O, completions onto the used ring, notifications on and off as the reactor spins
//!   or blocks;
//! - `shard.rs`: a reactor's share of the back end ([`VhostShard`], inside any state that
//!   implements [`VhostState`]);
//! - `control.rs`: the vhost-user messages of one front end (the `vhost` crate's backend
//!   request handler); `conn.rs`: the listening sockets and control connections, polled on
//!   a reactor; `server.rs`: a server of its own ([`VhostServer`]); `stop.rs`: the
//!   graceful stop's wait for the guests' requests in flight ([`drain`]);
//! - `sys.rs`: the two system calls std lacks.
//!
//! No thread of its own: the `vhost` crate's request handler is driven by a poller when its
//! socket has a message, and the `vhost-user-backend` crate (whose worker threads would
//! own the rings) is not used.

pub mod blk;
mod conn;
pub mod control;
pub mod host;
pub mod inflight;
pub mod memory;
pub mod request;
mod ring;
mod server;
mod shard;
mod split;
mod stop;
mod sys;
pub mod walk;

pub use blk::Geometry;
pub use conn::CONTROL_IO_TIMEOUT;
pub use request::{parse, Op, ParseError, Request, RequestError};
pub use server::{
    bind_socket, Standalone, VhostConfig, VhostExport, VhostServer, QUEUE_DEPTH_DEFAULT,
};
pub use shard::{ShardExport, VhostShard, VhostState};
pub use stop::{drain, VHOST_DRAIN_TIMEOUT};
pub use walk::{walk_chain, Buffer, ChainError, ChainLimits, GuestView};
#[doc(hidden)]
pub mod testkit;
