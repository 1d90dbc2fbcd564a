//! How to run an NBD server ([`ServerConfig`]), the checks it must pass before anything
//! starts, and why a server does not start ([`ServeError`]).

use std::io;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::time::Duration;

use hypoll_frontend::{
    ListenAddr, ServiceConfig, StartError, COALESCE_NS_DEFAULT, CONNECTIONS_MAX_DEFAULT,
    CONNECTIONS_PER_REACTOR_MAX, CONNECTION_BYTES_MAX_DEFAULT, CONNECTION_BYTES_MAX_RANGE,
    HANDSHAKE_TIMEOUT_DEFAULT, IDLE_SPIN_NS_DEFAULT, QUEUE_DEPTH_DEFAULT,
};
use hypoll_reactor::{CoreList, DeviceError};

use crate::proto;

/// Bounds of [`ServerConfig::request_bytes_max`] (a multiple of [`REQUEST_BYTES_ALIGN`]).
pub const REQUEST_BYTES_MAX_RANGE: RangeInclusive<u32> = 4096..=1 << 30;
/// What [`ServerConfig::request_bytes_max`] must be a multiple of.
pub const REQUEST_BYTES_ALIGN: u32 = 4096;

const _: () = assert!(crate::session::REQUEST_BYTES_MAX_DEFAULT <= *REQUEST_BYTES_MAX_RANGE.end());
const _: () =
    assert!(*REQUEST_BYTES_MAX_RANGE.start() <= crate::session::REQUEST_BYTES_MAX_DEFAULT);

/// How to run a server.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// (name, device string), in order; the first is the default export.
    pub exports: Vec<(String, String)>,
    pub listen: ListenAddr,
    pub cores: Option<CoreList>,
    pub policy: String,
    pub metrics: Option<SocketAddr>,
    pub connections_max: usize,
    pub request_bytes_max: u32,
    /// Data one connection may hold: replies queued for its socket (with
    /// [`OUT_MSG_OVERHEAD_BYTES`](hypoll_frontend::OUT_MSG_OVERHEAD_BYTES) each) plus the
    /// payloads of its writes and the lengths of its reads in flight. Past it (by at most
    /// one request) the connection's requests wait unread, so a client that pipelines and
    /// never reads cannot grow the server.
    pub connection_bytes_max: usize,
    pub queue_depth: usize,
    /// How long a reactor with nothing in flight watches its sockets before it parks, while
    /// its clients send one request at a time (parked, their next request costs a wake-up).
    pub idle_spin_ns: u64,
    /// A connection still negotiating after this long is closed.
    pub handshake_timeout: Duration,
    /// Request-gathering window under pipelined load (0: never gather).
    pub coalesce_ns: u64,
}

impl ServerConfig {
    pub fn new(exports: Vec<(String, String)>, listen: ListenAddr) -> ServerConfig {
        ServerConfig {
            exports,
            listen,
            cores: None,
            policy: "classic".into(),
            metrics: None,
            connections_max: CONNECTIONS_MAX_DEFAULT,
            request_bytes_max: crate::session::REQUEST_BYTES_MAX_DEFAULT,
            connection_bytes_max: CONNECTION_BYTES_MAX_DEFAULT,
            queue_depth: QUEUE_DEPTH_DEFAULT,
            idle_spin_ns: IDLE_SPIN_NS_DEFAULT,
            handshake_timeout: HANDSHAKE_TIMEOUT_DEFAULT,
            coalesce_ns: COALESCE_NS_DEFAULT,
        }
    }

    /// Refuses what cannot run, before anything opens or starts. Export names are checked
    /// as their devices open (`server.rs`).
    pub(crate) fn check(&self) -> Result<(), ServeError> {
        if self.exports.is_empty() {
            return Err(ServeError::NoExports);
        }
        let r = self.request_bytes_max;
        if !REQUEST_BYTES_MAX_RANGE.contains(&r) || !r.is_multiple_of(REQUEST_BYTES_ALIGN) {
            return Err(ServeError::RequestBytes(r));
        }
        if self.connections_max == 0 || self.connections_max > CONNECTIONS_PER_REACTOR_MAX {
            return Err(ServeError::Connections(self.connections_max));
        }
        if !CONNECTION_BYTES_MAX_RANGE.contains(&self.connection_bytes_max) {
            return Err(ServeError::ConnectionBytes(self.connection_bytes_max));
        }
        Ok(())
    }

    /// Whether `name` can name an export.
    pub(crate) fn export_name_ok(name: &str) -> bool {
        !name.is_empty() && name.len() <= proto::STRING_BYTES_MAX
    }

    /// What the shared front-end machinery needs of it.
    pub(crate) fn service(&self) -> ServiceConfig {
        ServiceConfig {
            listen: self.listen.clone(),
            cores: self.cores.clone(),
            policy: self.policy.clone(),
            metrics: self.metrics,
            connections_max: self.connections_max,
            connection_bytes_max: self.connection_bytes_max,
            idle_spin_ns: self.idle_spin_ns,
            handshake_timeout: self.handshake_timeout,
            coalesce_ns: self.coalesce_ns,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    #[error("exports: none given; a server needs at least one (name, device string)")]
    NoExports,
    #[error("export {0:?} is given twice")]
    DuplicateExport(String),
    #[error("export name {0:?}: expected 1 to 4096 bytes")]
    BadExportName(String),
    #[error("export {name}: {source}")]
    Device {
        name: String,
        #[source]
        source: DeviceError,
    },
    #[error("request_bytes_max {0}: expected a multiple of 4096 from 4096 to 1 GiB")]
    RequestBytes(u32),
    #[error("connections_max {0}: expected 1 to {CONNECTIONS_PER_REACTOR_MAX}")]
    Connections(usize),
    #[error("connection_bytes_max {0}: expected 64K to 64G")]
    ConnectionBytes(usize),
    #[error("listening on {addr}: {error}")]
    Listen {
        addr: String,
        #[source]
        error: io::Error,
    },
    #[error("metrics endpoint on {addr}: {error}")]
    Metrics {
        addr: SocketAddr,
        #[source]
        error: io::Error,
    },
    #[error("starting reactors: {0}")]
    Reactors(#[from] hypoll_reactor::StartError),
    #[error("starting the listener thread: {0}")]
    Thread(#[source] io::Error),
    /// A way the front-end service fails to start that has no variant of its own here.
    #[error("{0}")]
    Service(#[source] StartError),
}

impl ServeError {
    /// The [`ServerConfig`] field this error refuses, for errors that refuse one setting's
    /// value: a front end that took the value from a flag or a file names it as the user
    /// wrote it.
    pub fn setting(&self) -> Option<&'static str> {
        match self {
            ServeError::NoExports => Some("exports"),
            ServeError::RequestBytes(_) => Some("request_bytes_max"),
            ServeError::Connections(_) => Some("connections_max"),
            ServeError::ConnectionBytes(_) => Some("connection_bytes_max"),
            _ => None,
        }
    }
}

impl From<StartError> for ServeError {
    fn from(e: StartError) -> ServeError {
        match e {
            StartError::Listen { addr, error } => ServeError::Listen { addr, error },
            StartError::Metrics { addr, error } => ServeError::Metrics { addr, error },
            StartError::Reactors(e) => ServeError::Reactors(e),
            StartError::Thread(e) => ServeError::Thread(e),
            other => ServeError::Service(other),
        }
    }
}
