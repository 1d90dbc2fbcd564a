//! hypoll-nbd: a block service over NBD (the network block device protocol) on hypoll
//! reactors, built on the shared front-end machinery of `hypoll_frontend`.
//!
//! - [`session`]: the protocol as a pure state machine over byte buffers (handshake and
//!   request parser), with no sockets, so tests and fuzzers drive it directly; [`proto`]:
//!   its wire constants.
//! - [`server`]: `hypoll serve`'s engine: [`Server::start`] opens the exports and starts
//!   the service; `config.rs` holds its configuration and checks.
//! - `shard.rs`: NBD's state on a reactor and the loop that runs a connection's input
//!   through its session; `pipeline.rs`: a request as device commands and its reply.
//! - [`metrics`]: the Prometheus metrics under NBD's names.
//! - [`client`]: client-side message builders for tests.

pub mod client;
mod config;
pub mod metrics;
mod pipeline;
pub mod proto;
pub mod server;
pub mod session;
mod shard;

pub use server::{
    ListenAddr, ServeError, Server, ServerConfig, ServiceConfig, ServiceConfigError, StopReport,
};
pub use session::{Close, ExportInfo, Limits, Op, Request, Session, Step};
pub use shard::{Nbd, NbdConn};
