//! hypoll-nbd: a block service over NBD (the network block device protocol) on hypoll
//! reactors.
//!
//! - [`session`]: the protocol as a pure state machine over byte buffers (handshake and
//!   request parser), with no sockets, so tests and fuzzers drive it directly.
//! - [`server`]: `hypoll serve`'s engine: a listener hands connections to reactors, each
//!   reactor polls its sockets and its queue pairs under one policy.
//! - [`metrics`]: the Prometheus endpoint.
//! - [`client`]: client-side message builders for tests.

pub mod client;
pub mod metrics;
pub mod proto;
pub mod server;
pub mod session;
mod sys;

pub use server::{ListenAddr, ServeError, Server, ServerConfig, StopReport};
pub use session::{Close, ExportInfo, Limits, Op, Request, Session, Step};
