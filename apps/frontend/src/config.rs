//! How a front end's service runs: the settings every protocol shares (where to listen, the
//! reactors and their policy, the bounds on what clients may hold, the pacing of socket
//! reads), their defaults, and the limits they must stay within.

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use hypoll_reactor::CoreList;

use crate::listen::ListenAddr;
use crate::metrics::Metrics;
use crate::tls::TlsConfig;

/// Default most connections open at once (`--max-connections`).
pub const CONNECTIONS_MAX_DEFAULT: usize = 256;
/// Most connections a reactor holds: a protocol may pack a connection's key into 16 bits of
/// a device command's `user` word.
pub const CONNECTIONS_PER_REACTOR_MAX: usize = 1 << 16;
/// Default queue depth of each reactor's queue pair per export (`--queue-depth`).
pub const QUEUE_DEPTH_DEFAULT: usize = 128;
/// Default time an idle reactor watches its sockets for a queue-depth-1 client's next
/// request before it parks (`--idle-spin-us`): a few loopback round trips on a busy machine.
pub const IDLE_SPIN_NS_DEFAULT: u64 = 200_000;
/// Default request-gathering window under pipelined load (`--coalesce-us`): a reactor whose
/// clients keep many requests in flight reads its sockets at most once per window, so one
/// read, one device batch and one write per connection carry several requests.
pub const COALESCE_NS_DEFAULT: u64 = 200_000;
/// Longest window `--coalesce-us` accepts: the reactor runs no messages or timers while it
/// waits for a window's end.
pub const COALESCE_NS_MAX: u64 = 1_000_000;
/// How long a connection may take to finish its handshake before it is closed, so clients
/// that connect and say nothing cannot hold `--max-connections` slots forever.
pub const HANDSHAKE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
/// Default of [`ServiceConfig::request_stall_timeout`]: a working client sends the rest of a
/// request in far less, even a 32 MiB write on a slow link (10 Mbit/s: 27 s in all).
pub const REQUEST_STALL_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// Requests one connection may have in flight; beyond this its socket is not read.
pub const REQUESTS_INFLIGHT_MAX: usize = 256;
/// Default of [`ServiceConfig::connection_bytes_max`].
pub const CONNECTION_BYTES_MAX_DEFAULT: usize = 64 << 20;
/// Bounds of [`ServiceConfig::connection_bytes_max`].
pub const CONNECTION_BYTES_MAX_RANGE: RangeInclusive<usize> = (64 << 10)..=(64 << 30);
/// Default permissions of a Unix socket's file: its owner only may connect.
pub const UNIX_MODE_DEFAULT: u32 = 0o600;
/// Largest [`ServiceConfig::unix_mode`]: permission bits only.
pub const UNIX_MODE_MAX: u32 = 0o777;
/// How long a graceful stop waits for connections to finish what they have in flight.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a graceful stop looks whether what it waits for has finished.
pub const DRAIN_CHECK_PERIOD: Duration = Duration::from_millis(5);
/// How long a graceful stop waits for the final flush of each export.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

const _: () = assert!(COALESCE_NS_DEFAULT <= COALESCE_NS_MAX);
const _: () = assert!(UNIX_MODE_DEFAULT <= UNIX_MODE_MAX);
const _: () = assert!(CONNECTIONS_MAX_DEFAULT <= CONNECTIONS_PER_REACTOR_MAX);
const _: () = assert!(*CONNECTION_BYTES_MAX_RANGE.start() <= CONNECTION_BYTES_MAX_DEFAULT);
const _: () = assert!(CONNECTION_BYTES_MAX_DEFAULT <= *CONNECTION_BYTES_MAX_RANGE.end());

/// Who owns a Unix socket's file (see [`ServiceConfig::unix_owner`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnixOwner {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

/// The settings of a service that every protocol shares.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    pub listen: ListenAddr,
    pub cores: Option<CoreList>,
    pub policy: String,
    /// Where the Prometheus endpoint listens, if it runs.
    pub metrics: Option<SocketAddr>,
    /// Other front ends' metrics, served on the same endpoint after this service's own
    /// (`hypoll serve --nvme-tcp` serves NVMe/TCP's beside NBD's).
    pub metrics_beside: Vec<Arc<Metrics>>,
    /// Most connections open at once; more are closed as they arrive.
    pub connections_max: usize,
    /// Data one connection may hold: replies queued for its socket (with a fixed cost
    /// each) plus the payloads of its writes and the lengths of its reads in flight. Past
    /// it (by at most one request) the connection's requests wait unread, so a client that
    /// pipelines and never reads cannot grow the server.
    pub connection_bytes_max: usize,
    /// How long a reactor with nothing in flight watches its sockets before it parks, while
    /// its clients send one request at a time (parked, their next request costs a wake-up).
    pub idle_spin_ns: u64,
    /// A connection still negotiating after this long is closed.
    pub handshake_timeout: Duration,
    /// A connection with nothing in flight that sends nothing for this long is closed;
    /// `None`: never. Off by default: clients such as the kernel's hold a connection open
    /// through long quiet spells by design.
    pub idle_timeout: Option<Duration>,
    /// A connection that has sent part of a request and then nothing for this long is
    /// closed: a client that starts a request and stops (slowloris) cannot hold its input
    /// buffer, or one of its reactor's slots for large requests, forever.
    pub request_stall_timeout: Duration,
    /// Request-gathering window under pipelined load (0: never gather; at most
    /// [`COALESCE_NS_MAX`]).
    pub coalesce_ns: u64,
    /// Permissions of a Unix socket's file (at most [`UNIX_MODE_MAX`]), set whatever the
    /// umask: connecting needs write permission.
    pub unix_mode: u32,
    /// Owner and group given to a Unix socket's file (as `chown` takes them: `None` leaves
    /// one as it is); `None`: the server's own. Changing them takes privilege (root).
    pub unix_owner: Option<UnixOwner>,
    /// Whether clients may or must speak TLS, with which certificates, and whether they
    /// must show one of their own.
    pub tls: TlsConfig,
}

impl ServiceConfig {
    /// The defaults, listening on `listen`.
    pub fn new(listen: ListenAddr) -> ServiceConfig {
        ServiceConfig {
            listen,
            cores: None,
            policy: "classic".into(),
            metrics: None,
            metrics_beside: Vec::new(),
            connections_max: CONNECTIONS_MAX_DEFAULT,
            connection_bytes_max: CONNECTION_BYTES_MAX_DEFAULT,
            idle_spin_ns: IDLE_SPIN_NS_DEFAULT,
            handshake_timeout: HANDSHAKE_TIMEOUT_DEFAULT,
            idle_timeout: None,
            request_stall_timeout: REQUEST_STALL_TIMEOUT_DEFAULT,
            coalesce_ns: COALESCE_NS_DEFAULT,
            unix_mode: UNIX_MODE_DEFAULT,
            unix_owner: None,
            tls: TlsConfig::default(),
        }
    }

    /// Refuses bounds the service cannot keep, before anything starts.
    pub fn check(&self) -> Result<(), ServiceConfigError> {
        if self.connections_max == 0 || self.connections_max > CONNECTIONS_PER_REACTOR_MAX {
            return Err(ServiceConfigError::Connections(self.connections_max));
        }
        if !CONNECTION_BYTES_MAX_RANGE.contains(&self.connection_bytes_max) {
            return Err(ServiceConfigError::ConnectionBytes(
                self.connection_bytes_max,
            ));
        }
        if self.unix_mode > UNIX_MODE_MAX {
            return Err(ServiceConfigError::UnixMode(self.unix_mode));
        }
        Ok(())
    }
}

/// A [`ServiceConfig`] setting out of its bounds, named by its field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceConfigError {
    #[error("connections_max {0}: expected 1 to {CONNECTIONS_PER_REACTOR_MAX}")]
    Connections(usize),
    #[error("connection_bytes_max {0}: expected 64K to 64G")]
    ConnectionBytes(usize),
    #[error("unix_mode {0:o}: expected permission bits, 0 to 777 (octal)")]
    UnixMode(u32),
}

impl ServiceConfigError {
    /// The [`ServiceConfig`] field refused, so a front end that took the value from a flag
    /// or a file can name it as the user wrote it.
    pub fn setting(&self) -> &'static str {
        match self {
            ServiceConfigError::Connections(_) => "connections_max",
            ServiceConfigError::ConnectionBytes(_) => "connection_bytes_max",
            ServiceConfigError::UnixMode(_) => "unix_mode",
        }
    }
}
