//! hypoll-frontend: what every block-service front end on hypoll reactors shares, so a
//! protocol crate (NBD today) brings only its socket-free state machine and how its requests
//! become device commands.
//!
//! A listener thread accepts connections and hands each to a reactor, round-robin. A
//! connection then lives on that reactor for good, in the reactor's [`Shard`]: the shard's
//! poller reads its socket, runs the bytes through the [`Protocol`], and writes the replies
//! the protocol queues. Sockets are non-blocking and sit in one epoll set per reactor, whose
//! fd is the poller's wake fd: a parked reactor wakes when a client sends, and the policy
//! that decides how the reactor waits for its device also governs its sockets.
//!
//! - `config.rs`: [`ServiceConfig`], its defaults and limits.
//! - `service.rs`: [`Service::start`], in steps (bind, reactors, metrics endpoint,
//!   listener); `stop.rs`: the graceful stop and its [`StopReport`]; `added.rs`: a second
//!   stream protocol's listener on reactors a service started ([`AddedProtocol`]).
//! - `listen.rs`: [`ListenAddr`], the listening socket and the hand-off of accepted sockets.
//! - `shard.rs`: [`Protocol`] and [`Shard`]: a reactor's connections, adopted, progressed
//!   and closed, and the poller that drives them; the shard is its reactor's state (see
//!   [`ShardReactor`]), so messages and completions are handed it; `turn.rs`: one poller turn and its pacing; `coalesce.rs`: the adaptive
//!   gathering of requests under pipelined load.
//! - `conn.rs`: [`Conn`], one connection's buffers and the accounting that bounds its memory.
//! - `bufcache.rs`: [`BufCache`], idle I/O buffers kept for reuse.
//! - `tls.rs`: [`TlsConfig`], the TLS settings and their certificates, loaded at start;
//!   `tlsio.rs`: a connection's TLS session, driven without blocking by its reads and
//!   writes.
//! - `metrics.rs` and `endpoint.rs`: the Prometheus metrics and their HTTP endpoint.
//! - `loglimit.rs`: the bound on how fast one source (the listener, a reactor's clients)
//!   may log.
//! - `epoll.rs`: the epoll set, the one system interface needed beyond std; `fdlimit.rs`:
//!   the open-file limit, checked (and raised) against the connections allowed.

mod added;
mod bufcache;
mod coalesce;
mod config;
mod conn;
mod endpoint;
mod epoll;
mod fdlimit;
#[cfg(feature = "fuzz")]
pub mod fuzz;
mod intake;
mod linger;
mod listen;
mod loglimit;
pub mod metrics;
mod protocol;
mod service;
mod shard;
mod stop;
mod stream;
mod sweep;
mod tls;
mod tlsio;
mod turn;

pub use added::{AddedListener, AddedProtocol, AddedShards};
pub use bufcache::BufCache;
pub use config::{
    ServiceConfig, ServiceConfigError, UnixOwner, COALESCE_NS_DEFAULT, COALESCE_NS_MAX,
    CONNECTIONS_MAX_DEFAULT, CONNECTIONS_PER_REACTOR_MAX, CONNECTION_BYTES_MAX_DEFAULT,
    CONNECTION_BYTES_MAX_RANGE, DRAIN_CHECK_PERIOD, DRAIN_TIMEOUT, FLUSH_TIMEOUT,
    HANDSHAKE_TIMEOUT_DEFAULT, IDLE_SPIN_NS_DEFAULT, QUEUE_DEPTH_DEFAULT, REQUESTS_INFLIGHT_MAX,
    REQUEST_STALL_TIMEOUT_DEFAULT, UNIX_MODE_DEFAULT, UNIX_MODE_MAX,
};
pub use conn::{
    Conn, StartTlsError, HEAD_INLINE_BYTES_MAX, OUT_MSG_OVERHEAD_BYTES, READ_BYTES_PER_POLL,
};
pub use endpoint::Endpoint;
pub use fdlimit::{FDS_PER_REACTOR, FDS_SERVICE};
pub use intake::LARGE_INPUTS_PER_REACTOR;
pub use linger::LINGER_MS;
pub use listen::{remove_stale_socket, ListenAddr};
pub use loglimit::{LOG_LINES_PER_WINDOW_MAX, LOG_WINDOW_MS};
pub use protocol::{HasShard, Protocol};
pub use service::{Service, ShardBuilder, StartError};
pub use shard::Shard;

/// A reactor serving protocol `P`: its state is its shard of the service.
pub type ShardReactor<P> = hypoll_reactor::Reactor<Shard<P>>;
pub use stop::StopReport;
pub use tls::{
    certificate_names, client_name_ok, TlsConfig, TlsError, TlsMode, CA_CERT_FILE,
    SERVER_CERT_FILE, SERVER_KEY_FILE,
};
pub use tlsio::{TLS_BUFFER_BYTES_MAX, TLS_SEND_BYTES_MAX};
