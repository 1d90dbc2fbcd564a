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

pub mod blk;
pub mod request;
pub mod walk;

pub use blk::Geometry;
pub use request::{parse, Op, ParseError, Request, RequestError};
pub use walk::{walk_chain, Buffer, ChainError, ChainLimits};
#[doc(hidden)]
pub mod testkit;
