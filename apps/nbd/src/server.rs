//! `hypoll serve`'s engine: exports (one device each) served over NBD by a set of reactors.
//!
//! A listener thread accepts connections and hands each to a reactor, round-robin, with
//! [`ReactorHandle::send`]. A connection then lives on that reactor for good: the reactor's
//! NBD poller reads its socket, runs the bytes through its [`Session`], submits the
//! requests to the reactor's queue pair for the export (split into device-sized pieces), and
//! writes the replies when the device completes them. Sockets are non-blocking and sit in one
//! epoll set per reactor, whose fd is the poller's wake fd: a parked reactor wakes when a
//! client sends, and the policy that decides how the reactor waits for its device also
//! governs its sockets.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fmt;
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hypoll_nvme::{IoBuf, Opcode, Status, SubmitError};
use hypoll_reactor::{
    CoreList, Device, DeviceId, IoDone, IoFailure, IoOp, IoRequest, Poller, Reactor, ReactorConfig,
    ReactorSet, RejectReason,
};
use slab::Slab;

use crate::metrics::{ConnMetrics, Endpoint, IoMetrics, Metrics};
use crate::proto::{self, simple_reply};
use crate::session::{Close, ExportInfo, Limits, Op, Request, Session, Step};
use crate::sys::{Epoll, Interest, HANGUP_BITS, READ_BITS, WRITE_BITS};

/// Default most connections open at once (`--max-connections`).
pub const CONNECTIONS_MAX_DEFAULT: usize = 256;
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
/// Requests a trial window must gather to turn coalescing on. A client gathers about its
/// queue depth in a window, and it gets a batch of replies per window: one at queue depth 4
/// lost two thirds of its IOPS to a 200 us window (20 k against 65 k, fio over TCP, emulated
/// RAM), one at 8 nearly half (39 k against 72 k), one at 16 nothing (60 k against 58 k).
/// Only deep pipelines gain from gathering.
const COALESCE_BATCH_ON: f64 = 12.0;
/// Requests windows must gather on average for coalescing to stay on (below the threshold
/// to turn it on, so a client near it does not flap).
const COALESCE_BATCH_OFF: f64 = 8.0;
/// While not coalescing, one trial window per this many requests tells whether the clients
/// pipeline: a queue-depth-1 client pays a window's delay once in this many requests.
const COALESCE_PROBE_EVERY_REQUESTS: u64 = 1024;
/// After coalescing turned off, the next trial comes this many requests later.
const COALESCE_RETRY_REQUESTS: u64 = 64;
/// While I/O is at a device, the sockets are checked at most this often: the reactor turns
/// fast while it polls for completions, and a readiness check per turn would cost more than
/// the turn (a request arriving meanwhile waits at most this long).
const SOCKET_CHECK_BUSY_NS: u64 = 10_000;
/// How long a connection may take to finish its handshake before it is closed, so clients
/// that connect and say nothing cannot hold `--max-connections` slots forever.
pub const HANDSHAKE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
/// How often each reactor looks for handshakes past their time.
const HANDSHAKE_SWEEP_PERIOD: Duration = Duration::from_millis(250);
/// Below this many requests per busy poll on average, clients wait on each reply and an
/// idle reactor watches its sockets before parking; above, it parks at once.
const SPIN_BATCH_MAX: f64 = 2.0;
/// Weight of the newest batch in the average: 1/8.
const BATCH_EWMA_WEIGHT: f64 = 8.0;
/// Requests one connection may have in flight; beyond this its socket is not read.
pub const REQUESTS_INFLIGHT_MAX: usize = 256;
/// Default of [`ServerConfig::connection_bytes_max`].
pub const CONNECTION_BYTES_MAX_DEFAULT: usize = 64 << 20;
/// Bounds of [`ServerConfig::connection_bytes_max`].
pub const CONNECTION_BYTES_MAX_RANGE: std::ops::RangeInclusive<usize> = (64 << 10)..=(64 << 30);
/// What one queued reply costs beyond its bytes (its allocation and queue entry), counted
/// against the connection's byte bound so a flood of small refusals cannot hide behind
/// their 16 bytes.
const OUT_MSG_OVERHEAD_BYTES: usize = 128;
/// Bytes read from one socket per poll, so one busy client cannot starve the others.
pub const READ_BYTES_PER_POLL: usize = 1 << 20;
/// Input buffer a connection keeps between requests; a larger write grows it only while it
/// is being received.
const INBUF_KEEP_BYTES: usize = 1 << 20;
/// Bytes asked of the kernel per read.
const READ_CHUNK_BYTES: usize = 256 << 10;
/// Most buffers one writev hands the kernel.
const WRITEV_SLICES_MAX: usize = 64;
/// Bytes of idle I/O buffers a reactor keeps for reuse, and how many buffer sizes.
const BUF_CACHE_BYTES_MAX: usize = 8 << 20;
const BUF_CACHE_SIZES_MAX: usize = 8;
/// Refused requests logged per connection; the rest are counted in the close line.
const REFUSALS_LOGGED_MAX: u32 = 4;
/// How long a graceful stop waits for connections to finish what they have in flight.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a graceful stop waits for the final flush of each export.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the listener checks whether it should stop.
const ACCEPT_CHECK_MS: i32 = 50;
/// Most connections a reactor holds (the request key packs the connection in 16 bits).
const CONNECTIONS_PER_REACTOR_MAX: usize = 1 << 16;

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl std::str::FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<ListenAddr, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path, e.g. unix:/tmp/hypoll.sock".into());
            }
            return Ok(ListenAddr::Unix(path.into()));
        }
        s.parse()
            .map(ListenAddr::Tcp)
            .map_err(|_| format!("{s:?}: expected ADDR:PORT (127.0.0.1:10809) or unix:PATH"))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

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
    /// `OUT_MSG_OVERHEAD_BYTES` each) plus the payloads of its writes and the lengths of
    /// its reads in flight. Past it (by at most one request) the connection's requests
    /// wait unread, so a client that pipelines and never reads cannot grow the server.
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
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("no exports: give at least one --export NAME=DEVICE_SPEC")]
    NoExports,
    #[error("export {0:?} is given twice")]
    DuplicateExport(String),
    #[error("export name {0:?}: expected 1 to 4096 bytes")]
    BadExportName(String),
    #[error("export {name}: {message}")]
    Device { name: String, message: String },
    #[error("--max-request-bytes {0}: expected a multiple of 4096 from 4096 to 1 GiB")]
    RequestBytes(u32),
    #[error("--max-connections {0}: expected 1 to {CONNECTIONS_PER_REACTOR_MAX}")]
    Connections(usize),
    #[error("--max-connection-bytes {0}: expected 64K to 64G")]
    ConnectionBytes(usize),
    #[error("listening on {addr}: {error}")]
    Listen { addr: String, error: io::Error },
    #[error("metrics endpoint on {addr}: {error}")]
    Metrics { addr: SocketAddr, error: io::Error },
    #[error("starting reactors: {0}")]
    Reactors(#[from] hypoll_reactor::StartError),
    #[error("starting the listener thread: {0}")]
    Thread(io::Error),
}

/// What a graceful stop did.
#[derive(Debug, Default)]
pub struct StopReport {
    /// Connections still open when the drain timed out (closed by the reactor shutdown).
    pub connections_left: usize,
    /// Exports whose final flush failed or timed out, with why.
    pub flush_failures: Vec<String>,
    /// I/Os the reactor shutdown had to fail (0 after a clean drain).
    pub failed_ios: u64,
    /// Reactors that panicked.
    pub panics: Vec<String>,
}

/// A running server. [`Server::stop`] stops it gracefully; dropping it stops it too.
pub struct Server {
    set: Option<ReactorSet>,
    listener: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    local: ListenAddr,
    endpoint: Option<Endpoint>,
    open: Arc<AtomicUsize>,
    exports: Arc<[ExportInfo]>,
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A client's socket.
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Unix(s) => s.write_vectored(bufs),
        }
    }

    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
        }
    }
}

/// Builds what clients see of an export from its device.
fn export_info(name: &str, device: &Device) -> ExportInfo {
    let ns = device.ctrl.namespace();
    ExportInfo {
        name: name.to_string(),
        description: device.ctrl.describe(),
        size_bytes: ns.capacity_bytes(),
        // Every device has flush; trim and write zeroes only where the device carries out
        // Dataset Management and Write Zeroes (optional in NVMe: a `vfio` controller says in
        // ONCS). FUA is a write followed by a flush. A flush is device-wide (an NVMe flush
        // covers the namespace), so a flush on one connection covers writes completed on
        // all: MULTI_CONN holds.
        flags: proto::TFLAG_HAS_FLAGS
            | proto::TFLAG_SEND_FLUSH
            | proto::TFLAG_SEND_FUA
            | if device.ctrl.supports(Opcode::DatasetManagement) {
                proto::TFLAG_SEND_TRIM
            } else {
                0
            }
            | if device.ctrl.supports(Opcode::WriteZeroes) {
                proto::TFLAG_SEND_WRITE_ZEROES
            } else {
                0
            }
            | proto::TFLAG_CAN_MULTI_CONN,
        block_bytes: ns.lba_size_bytes,
        preferred_bytes: ns.lba_size_bytes.max(4096),
    }
}

impl Server {
    /// Opens the exports' devices, starts the reactors, the listener and the metrics
    /// endpoint. Returns once clients can connect.
    pub fn start(cfg: ServerConfig) -> Result<Server, ServeError> {
        if cfg.exports.is_empty() {
            return Err(ServeError::NoExports);
        }
        let r = cfg.request_bytes_max;
        if !(4096..=1 << 30).contains(&r) || !r.is_multiple_of(4096) {
            return Err(ServeError::RequestBytes(r));
        }
        if cfg.connections_max == 0 || cfg.connections_max > CONNECTIONS_PER_REACTOR_MAX {
            return Err(ServeError::Connections(cfg.connections_max));
        }
        if !CONNECTION_BYTES_MAX_RANGE.contains(&cfg.connection_bytes_max) {
            return Err(ServeError::ConnectionBytes(cfg.connection_bytes_max));
        }
        let mut devices = Vec::new();
        let mut infos = Vec::new();
        for (name, spec) in &cfg.exports {
            if name.is_empty() || name.len() > proto::STRING_BYTES_MAX {
                return Err(ServeError::BadExportName(name.clone()));
            }
            if infos.iter().any(|i: &ExportInfo| &i.name == name) {
                return Err(ServeError::DuplicateExport(name.clone()));
            }
            let device = Device::open(spec).map_err(|e| ServeError::Device {
                name: name.clone(),
                message: e.to_string(),
            })?;
            infos.push(export_info(name, &device));
            devices.push(device);
        }
        let infos: Arc<[ExportInfo]> = infos.into();
        let limits = Limits {
            request_bytes_max: cfg.request_bytes_max,
            ..Limits::default()
        };
        let listener = bind(&cfg.listen)?;
        let local = match &listener {
            Listener::Tcp(l) => {
                ListenAddr::Tcp(l.local_addr().map_err(|error| ServeError::Listen {
                    addr: cfg.listen.to_string(),
                    error,
                })?)
            }
            Listener::Unix(_, p) => ListenAddr::Unix(p.clone()),
        };
        let metrics = Arc::new(Metrics::new());
        let open = Arc::new(AtomicUsize::new(0));
        let shard_infos = infos.clone();
        let shard_metrics = metrics.clone();
        let shard_open = open.clone();
        let depth = cfg.queue_depth;
        let connection_bytes_max = cfg.connection_bytes_max;
        let idle_spin_ns = cfg.idle_spin_ns;
        let handshake_timeout = cfg.handshake_timeout;
        let coalesce_ns = cfg.coalesce_ns.min(COALESCE_NS_MAX);
        let set = ReactorSet::start(
            ReactorConfig {
                cores: cfg.cores.clone(),
                policy: cfg.policy.clone(),
                // The NBD poller decides when waiting for sockets pays (below); otherwise an
                // idle reactor parks at once.
                tuning: hypoll_reactor::ReactorTuning {
                    idle_spin_ns: 0,
                    ..hypoll_reactor::ReactorTuning::default()
                },
                ..ReactorConfig::default()
            },
            move |reactor| {
                let mut exports = Vec::new();
                for (device, info) in devices.iter().zip(shard_infos.iter()) {
                    let dev = reactor.attach(device, depth)?;
                    let ns = reactor.namespace(dev).expect("just attached");
                    let io = Op::ALL.map(|op| shard_metrics.io(reactor.index(), &info.name, op));
                    let connections = crate::metrics::export_connections(
                        &shard_metrics,
                        reactor.index(),
                        &info.name,
                    );
                    exports.push(ShardExport {
                        dev,
                        lba_bytes: ns.lba_size_bytes,
                        rw_piece_bytes: ns.transfer_bytes_max.max(ns.lba_size_bytes),
                        zero_piece_blocks: hypoll_nvme::spec::NLB_MAX,
                        reads_fill: device.ctrl.reads_fill_buffer(),
                        io,
                        connections,
                        backlog: VecDeque::new(),
                    });
                }
                let epoll = Rc::new(Epoll::new().map_err(|e| format!("creating epoll: {e}"))?);
                let shard = Rc::new(RefCell::new(Shard {
                    index: reactor.index(),
                    epoll: epoll.clone(),
                    exports,
                    infos: shard_infos.clone(),
                    limits,
                    connection_bytes_max,
                    conns: Slab::new(),
                    dirty: Vec::new(),
                    ready: Vec::new(),
                    draining: false,
                    open: shard_open.clone(),
                    conn_metrics: shard_metrics.conns(reactor.index()),
                    scratch: Vec::new(),
                    idle_spin_ns,
                    requests_started: 0,
                    batch_ewma: 0.0,
                    handshake_timeout_ns: u64::try_from(handshake_timeout.as_nanos())
                        .unwrap_or(u64::MAX),
                    coalesce: Coalesce::new(coalesce_ns),
                    sockets_checked_ns: 0,
                    bufs: BufCache::default(),
                }));
                SHARD.with(|s| *s.borrow_mut() = Some(shard.clone()));
                reactor
                    .add_poller(Box::new(NbdPoller { epoll, shard }))
                    .map_err(|e| format!("adding the NBD poller: {e}"))?;
                reactor.every(HANDSHAKE_SWEEP_PERIOD, |r| {
                    with_shard(|s| s.expire_handshakes(r));
                });
                Ok(())
            },
        )?;
        let endpoint = match cfg.metrics {
            Some(addr) => Some(
                Endpoint::start(addr, metrics.clone(), set.handles().clone())
                    .map_err(|error| ServeError::Metrics { addr, error })?,
            ),
            None => None,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            let open = open.clone();
            let handles = set.handles().clone();
            let max = cfg.connections_max;
            std::thread::Builder::new()
                .name("hypoll-listen".into())
                .spawn(move || accept_loop(listener, &stop, &open, max, &handles))
                .map_err(ServeError::Thread)?
        };
        Ok(Server {
            set: Some(set),
            listener: Some(thread),
            stop,
            local,
            endpoint,
            open,
            exports: infos,
        })
    }

    /// Where clients connect (the real port when port 0 was asked for).
    pub fn local_addr(&self) -> &ListenAddr {
        &self.local
    }

    /// Where the metrics endpoint listens, if it runs.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.endpoint.as_ref().map(Endpoint::addr)
    }

    pub fn exports(&self) -> &[ExportInfo] {
        &self.exports
    }

    /// Connections open now.
    pub fn connections_open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Stops gracefully: stops accepting, lets every connection finish the requests it has
    /// in flight and send their replies (reading no new ones), closes it, flushes every
    /// export, then stops the reactors.
    pub fn stop(mut self) -> StopReport {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> StopReport {
        let mut report = StopReport::default();
        let Some(set) = self.set.take() else {
            return report;
        };
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.listener.take() {
            let _ = t.join();
        }
        for h in set.handles().iter() {
            let _ = h.send(|_| {
                with_shard(|s| s.drain());
            });
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while self.open.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        report.connections_left = self.open.load(Ordering::Acquire);
        let (tx, rx) = mpsc::channel();
        for (i, info) in self.exports.iter().enumerate() {
            let tx = tx.clone();
            let name = info.name.clone();
            let sent = set.handles()[0].send(move |r| {
                let dev = DeviceId::from_index(i as u16);
                let name2 = name.clone();
                let tx2 = tx.clone();
                let submitted = r.flush(dev, move |_, done: IoDone| {
                    let _ = tx2.send(done.result.map_err(|e| format!("{name2}: flush: {e}")));
                });
                if let Err(e) = submitted {
                    let _ = tx.send(Err(format!("{name}: flush refused: {e}")));
                }
            });
            if let Err(e) = sent {
                report
                    .flush_failures
                    .push(format!("{}: could not ask for a flush: {e}", info.name));
            }
        }
        drop(tx);
        let deadline = Instant::now() + FLUSH_TIMEOUT;
        let mut answered = report.flush_failures.len();
        while answered < self.exports.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(Ok(())) => answered += 1,
                Ok(Err(e)) => {
                    report.flush_failures.push(e);
                    answered += 1;
                }
                Err(_) => {
                    report
                        .flush_failures
                        .push("the final flush did not finish in time".into());
                    break;
                }
            }
        }
        self.endpoint = None;
        let shutdown = set.shutdown();
        report.failed_ios = shutdown.exits.iter().map(|e| e.failed_ios).sum();
        report.panics = shutdown.panics.iter().map(|p| p.to_string()).collect();
        report
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

fn bind(addr: &ListenAddr) -> Result<Listener, ServeError> {
    let err = |error| ServeError::Listen {
        addr: addr.to_string(),
        error,
    };
    let l = match addr {
        ListenAddr::Tcp(a) => {
            let l = TcpListener::bind(a).map_err(err)?;
            l.set_nonblocking(true).map_err(err)?;
            Listener::Tcp(l)
        }
        ListenAddr::Unix(p) => {
            let l = UnixListener::bind(p).map_err(err)?;
            l.set_nonblocking(true).map_err(err)?;
            Listener::Unix(l, p.clone())
        }
    };
    Ok(l)
}

fn accept_loop(
    listener: Listener,
    stop: &AtomicBool,
    open: &AtomicUsize,
    max: usize,
    handles: &[hypoll_reactor::ReactorHandle],
) {
    let mut next = 0usize;
    while !stop.load(Ordering::Acquire) {
        let fd = match &listener {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix(l, _) => l.as_fd(),
        };
        match hypoll_nvme::wait_readable(fd, ACCEPT_CHECK_MS) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                eprintln!("hypoll serve: waiting for connections: {e}; no longer accepting");
                return;
            }
        }
        let accepted = match &listener {
            Listener::Tcp(l) => l.accept().and_then(|(s, peer)| {
                s.set_nonblocking(true)?;
                s.set_nodelay(true)?;
                Ok((Stream::Tcp(s), peer.to_string()))
            }),
            Listener::Unix(l, _) => l.accept().and_then(|(s, _)| {
                s.set_nonblocking(true)?;
                Ok((Stream::Unix(s), "unix client".to_string()))
            }),
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                eprintln!("hypoll serve: accept failed: {e}");
                continue;
            }
        };
        if open.load(Ordering::Acquire) >= max {
            eprintln!(
                "hypoll serve: {peer}: refused: {max} connections are open (--max-connections)"
            );
            continue;
        }
        open.fetch_add(1, Ordering::AcqRel);
        let h = &handles[next % handles.len()];
        next = next.wrapping_add(1);
        let index = h.index();
        // The stream travels in an Option so a refused send can still close it here.
        let sent = h.send(move |r| {
            if with_shard(|s| s.adopt(r, stream, peer)).is_none() {
                eprintln!("hypoll serve: reactor {index} has no NBD state; connection dropped");
            }
        });
        if let Err(e) = sent {
            open.fetch_sub(1, Ordering::AcqRel);
            eprintln!("hypoll serve: connection dropped: reactor {index}: {e}");
        }
    }
}

thread_local! {
    /// The NBD state of the reactor running on this thread.
    static SHARD: RefCell<Option<Rc<RefCell<Shard>>>> = const { RefCell::new(None) };
}

fn with_shard<R>(f: impl FnOnce(&mut Shard) -> R) -> Option<R> {
    let shard = SHARD.with(|s| s.borrow().clone())?;
    let mut s = shard.borrow_mut();
    Some(f(&mut s))
}

struct NbdPoller {
    epoll: Rc<Epoll>,
    shard: Rc<RefCell<Shard>>,
}

impl Poller for NbdPoller {
    fn poll(&mut self, reactor: &mut Reactor) -> usize {
        self.shard.borrow_mut().poll(reactor)
    }

    fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.epoll.as_fd())
    }
}

/// One export as a reactor sees it.
struct ShardExport {
    dev: DeviceId,
    lba_bytes: u32,
    /// Largest read or write per device command (the device's MDTS).
    rw_piece_bytes: u32,
    /// Most blocks per write zeroes or deallocate command.
    zero_piece_blocks: u32,
    /// Whether the device writes all of a read's buffer (`Controller::reads_fill_buffer`):
    /// if not, a recycled buffer is zeroed first, or the reply would carry what another
    /// request left in it.
    reads_fill: bool,
    io: [IoMetrics; 5],
    /// Connections that chose this export.
    connections: prometheus_client::metrics::counter::Counter,
    /// Requests with pieces waiting for room in the queue pair: (connection, request).
    backlog: VecDeque<(usize, usize)>,
}

/// One reactor's connections and exports.
struct Shard {
    index: usize,
    epoll: Rc<Epoll>,
    exports: Vec<ShardExport>,
    infos: Arc<[ExportInfo]>,
    limits: Limits,
    /// [`ServerConfig::connection_bytes_max`].
    connection_bytes_max: usize,
    conns: Slab<Conn>,
    /// Connections with replies to send or buffered input to parse.
    dirty: Vec<usize>,
    ready: Vec<(u64, u32)>,
    draining: bool,
    open: Arc<AtomicUsize>,
    conn_metrics: ConnMetrics,
    scratch: Vec<u8>,
    /// How long an idle poll watches the sockets for a queue-depth-1 client's next request.
    idle_spin_ns: u64,
    /// Requests parsed so far, and per busy poll on average (weight 1/BATCH_EWMA_WEIGHT).
    requests_started: u64,
    batch_ewma: f64,
    /// A connection still negotiating after this long is closed.
    handshake_timeout_ns: u64,
    coalesce: Coalesce,
    /// When the sockets were last checked for input.
    sockets_checked_ns: u64,
    bufs: BufCache,
}

/// Request coalescing, like a network card's adaptive interrupt moderation. A client that
/// keeps many requests in flight sends them one by one as replies reach it, and a fast
/// reactor would read, submit and reply to each alone: one wake-up or readiness check, one
/// read and one write per request, most of the CPU a request costs. While its clients
/// pipeline, the reactor instead reads its sockets at most once per window: after a batch it
/// sends the replies, sleeps until the window from that batch's read is over, and takes what
/// gathered meanwhile in one read. Whether clients pipeline is measured, never guessed: a
/// trial window every [`COALESCE_PROBE_EVERY_REQUESTS`] requests turns coalescing on when it
/// gathered at least [`COALESCE_BATCH_ON`] requests, and it stays on while windows gather
/// [`COALESCE_BATCH_OFF`] or more on average. A client at queue depth 1 sends nothing while
/// it waits for its reply, so its trial windows gather one request and it keeps its latency.
struct Coalesce {
    /// The window (0: off).
    window_ns: u64,
    on: bool,
    /// Requests a window gathers, on average (weight 1/BATCH_EWMA_WEIGHT).
    batch_ewma: f64,
    /// When the sockets last gave requests.
    last_batch_ns: u64,
    /// With coalescing off, the next trial once `requests_started` reaches this.
    probe_at_requests: u64,
    /// This turn waited for a window's end: its read ends the window.
    held: bool,
    /// Requests the last trial window gathered.
    last_trial_batch: f64,
    /// This turn slept until then before reading.
    slept_until_ns: Option<u64>,
}

impl Coalesce {
    fn new(window_ns: u64) -> Coalesce {
        Coalesce {
            window_ns,
            on: false,
            batch_ewma: 0.0,
            last_batch_ns: 0,
            probe_at_requests: COALESCE_PROBE_EVERY_REQUESTS,
            held: false,
            last_trial_batch: 0.0,
            slept_until_ns: None,
        }
    }

    /// What a window that gathered `batch` requests says about the clients.
    fn window_done(&mut self, batch: u64, requests_started: u64) {
        let batch = batch as f64;
        if self.on {
            self.batch_ewma += (batch - self.batch_ewma) / BATCH_EWMA_WEIGHT;
            if self.batch_ewma < COALESCE_BATCH_OFF {
                // Windows gathered little lately; whether the clients still pipeline, a
                // trial soon tells (until then they count as pipelining).
                self.on = false;
                self.probe_at_requests = requests_started + COALESCE_RETRY_REQUESTS;
            }
        } else {
            // A trial.
            self.last_trial_batch = batch;
            if batch >= COALESCE_BATCH_ON {
                self.on = true;
                self.batch_ewma = batch;
            } else {
                self.probe_at_requests = requests_started + COALESCE_PROBE_EVERY_REQUESTS;
            }
        }
    }

    /// Whether the clients were seen to pipeline deeply: coalescing is on, or the last
    /// trial window gathered as many requests as keep it on. Shallow pipelines (queue depth
    /// 2 to 7) keep the wait for the next request: parking between their batches cost a
    /// queue-depth-4 client a quarter of its IOPS.
    fn pipelined(&self) -> bool {
        self.on || self.last_trial_batch >= COALESCE_BATCH_OFF
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Data,
    /// A flush after the data: the request had FUA, or is a flush.
    Flush,
}

/// A request in flight.
struct Pending {
    op: Op,
    cookie: u64,
    export: usize,
    offset: u64,
    length: u32,
    fua: bool,
    /// Write Zeroes may leave a hole (the client did not send `NO_HOLE`).
    may_deallocate: bool,
    stage: Stage,
    /// Bytes of the data stage submitted so far.
    submitted: u64,
    flush_submitted: bool,
    /// Device commands in flight.
    pieces_out: u32,
    /// The NBD error of the reply (0: success).
    error: u32,
    /// A write's payload, one buffer per piece, taken as pieces are submitted.
    write_bufs: VecDeque<IoBuf>,
    /// A read's data, one buffer per piece, filled as pieces complete.
    read_bufs: Vec<Option<IoBuf>>,
    start_ns: u64,
}

/// Idle I/O buffers from the pinned pool, kept by size for the next request: taking one
/// from the pool zeroes it and takes the pool's lock, and a reactor at queue depth 32 takes
/// tens of thousands a second. A recycled buffer keeps old bytes, which is safe because
/// every use overwrites it whole: a write's payload is copied in, a read's data only goes
/// out when the device filled all of it (a short read is an error). A device that fills
/// nothing (`null`) gets its read buffers zeroed (`ShardExport::reads_fill`).
#[derive(Default)]
struct BufCache {
    /// (buffer length, idle buffers of that length).
    sizes: Vec<(usize, Vec<IoBuf>)>,
    bytes: usize,
}

impl BufCache {
    /// A buffer of `len_bytes` whose contents the caller overwrites.
    fn take(&mut self, len_bytes: usize) -> IoBuf {
        if let Some((_, bufs)) = self.sizes.iter_mut().find(|(len, _)| *len == len_bytes) {
            if let Some(buf) = bufs.pop() {
                self.bytes -= len_bytes;
                return buf;
            }
        }
        IoBuf::pinned(len_bytes)
    }

    /// Keeps `buf` for reuse, within the cache's bounds; drops it otherwise.
    fn give(&mut self, buf: IoBuf) {
        let len_bytes = buf.len();
        if !buf.is_pinned() || self.bytes + len_bytes > BUF_CACHE_BYTES_MAX {
            return;
        }
        let i = match self.sizes.iter().position(|(len, _)| *len == len_bytes) {
            Some(i) => i,
            None if self.sizes.len() < BUF_CACHE_SIZES_MAX => {
                self.sizes.push((len_bytes, Vec::new()));
                self.sizes.len() - 1
            }
            None => return,
        };
        self.sizes[i].1.push(buf);
        self.bytes += len_bytes;
    }
}

/// The first bytes of a queued message: a reply header, held inline (no allocation per
/// request), or handshake bytes.
enum Head {
    Reply([u8; proto::REPLY_HEADER_BYTES]),
    Bytes(Vec<u8>),
}

impl std::ops::Deref for Head {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Head::Reply(h) => h,
            Head::Bytes(b) => b,
        }
    }
}

/// A reply queued for the socket: its header, then a read's data.
struct OutMsg {
    head: Head,
    data: Vec<IoBuf>,
}

impl OutMsg {
    fn len(&self) -> usize {
        self.head.len() + self.data.iter().map(|b| b.len()).sum::<usize>()
    }
}

struct Conn {
    stream: Stream,
    peer: String,
    session: Session,
    /// Received bytes not yet consumed: `inbuf[in_start..in_end]`.
    inbuf: Vec<u8>,
    in_start: usize,
    in_end: usize,
    out: VecDeque<OutMsg>,
    /// Bytes of the front message already sent.
    out_sent: usize,
    out_bytes: usize,
    /// Data held for requests in flight: write payloads and read lengths. With `out_bytes`
    /// it is bounded by [`ServerConfig::connection_bytes_max`] (plus one request), so a
    /// client that pipelines large requests and never reads its socket cannot grow the
    /// server's memory.
    inflight_bytes: usize,
    write_blocked: bool,
    inflight: Slab<Pending>,
    /// No more requests are read; the connection closes once its requests finish.
    closing: Option<String>,
    /// The client shut down its side (a read returned end of stream): what it sent before
    /// is still parsed and answered, then the connection closes.
    eof: bool,
    /// The client is gone (end of stream or a socket error): replies are dropped.
    gone: bool,
    /// Closed for an error (logged and counted).
    failed: bool,
    interest: Interest,
    /// The socket is in the reactor's epoll set.
    registered: bool,
    dirty: bool,
    refusals: u32,
    /// When the reactor adopted it: the handshake's clock starts here.
    adopted_ns: u64,
}

/// Bytes of data a request in flight holds: its write payload or its read's length.
fn held_bytes(p: &Pending) -> usize {
    match p.op {
        Op::Read | Op::Write => p.length as usize,
        _ => 0,
    }
}

impl Conn {
    fn can_parse(&self, draining: bool, bytes_max: usize) -> bool {
        self.closing.is_none()
            && !self.gone
            && !draining
            && self.inflight.len() < REQUESTS_INFLIGHT_MAX
            && self.out_bytes + self.inflight_bytes < bytes_max
    }

    fn push_out(&mut self, msg: OutMsg) {
        self.out_bytes += msg.len() + OUT_MSG_OVERHEAD_BYTES;
        self.out.push_back(msg);
    }

    /// Writes queued replies until done or the socket is full.
    fn write_out(&mut self, bufs: &mut BufCache) -> io::Result<usize> {
        let mut written = 0;
        self.write_blocked = false;
        while !self.out.is_empty() {
            let mut slices = [IoSlice::new(&[]); WRITEV_SLICES_MAX];
            let mut count = 0;
            let mut skip = self.out_sent;
            'fill: for msg in &self.out {
                for part in std::iter::once(&msg.head[..]).chain(msg.data.iter().map(|b| &b[..])) {
                    if skip >= part.len() {
                        skip -= part.len();
                        continue;
                    }
                    slices[count] = IoSlice::new(&part[skip..]);
                    count += 1;
                    skip = 0;
                    if count == WRITEV_SLICES_MAX {
                        break 'fill;
                    }
                }
            }
            let n = match self.stream.write_vectored(&slices[..count]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.write_blocked = true;
                    return Ok(written);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            written += n;
            self.out_bytes -= n;
            let mut left = self.out_sent + n;
            while let Some(front) = self.out.front() {
                let len = front.len();
                if left < len {
                    break;
                }
                left -= len;
                if let Some(msg) = self.out.pop_front() {
                    msg.data.into_iter().for_each(|b| bufs.give(b));
                }
                self.out_bytes -= OUT_MSG_OVERHEAD_BYTES;
            }
            self.out_sent = left;
        }
        Ok(written)
    }

    /// Reads what the socket has, up to the per-poll budget. Returns bytes read; an end of
    /// stream or an error marks the client gone.
    fn read_in(&mut self, limit_bytes: usize) -> usize {
        let mut total = 0;
        while total < READ_BYTES_PER_POLL {
            if self.in_start == self.in_end {
                self.in_start = 0;
                self.in_end = 0;
                if self.inbuf.len() > INBUF_KEEP_BYTES {
                    // A large write passed: give its room back.
                    self.inbuf.truncate(INBUF_KEEP_BYTES);
                    self.inbuf.shrink_to(INBUF_KEEP_BYTES);
                }
            } else if self.in_start > 0 && self.inbuf.len() - self.in_end < READ_CHUNK_BYTES {
                self.inbuf.copy_within(self.in_start..self.in_end, 0);
                self.in_end -= self.in_start;
                self.in_start = 0;
            }
            if self.inbuf.len() - self.in_end < READ_CHUNK_BYTES && self.inbuf.len() < limit_bytes {
                let grown = (self.in_end + READ_CHUNK_BYTES).min(limit_bytes);
                self.inbuf.resize(grown, 0);
            }
            if self.in_end == self.inbuf.len() {
                // Full: the parser must consume first.
                break;
            }
            match self.stream.read(&mut self.inbuf[self.in_end..]) {
                Ok(0) => {
                    // The client sent all it will: what it sent is still served and its
                    // replies go out (see `Shard::progress`).
                    self.eof = true;
                    break;
                }
                Ok(n) => {
                    let asked = self.inbuf.len() - self.in_end;
                    self.in_end += n;
                    total += n;
                    if n < asked {
                        // The socket is drained: another read would only say EAGAIN.
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.gone = true;
                    self.failed = true;
                    self.closing = Some(format!("reading the socket: {e}"));
                    break;
                }
            }
        }
        total
    }
}

/// Packs a piece's identity into `IoRequest::user`: connection, request, piece index.
fn pack(conn: usize, req: usize, piece: u32) -> u64 {
    ((conn as u64) << 48) | ((req as u64) << 32) | u64::from(piece)
}

fn unpack(user: u64) -> (usize, usize, u32) {
    (
        (user >> 48) as usize,
        ((user >> 32) & 0xffff) as usize,
        user as u32,
    )
}

/// The NBD error a failed device command is answered with: `ENOSPC` when the device is out
/// of space (the protocol asks for it on a write that fails so), `EIO` otherwise.
fn nbd_error_of(failure: &IoFailure) -> u32 {
    match failure {
        IoFailure::Device(Status::CAPACITY_EXCEEDED) => proto::ENOSPC,
        _ => proto::EIO,
    }
}

/// Runs on the reactor when a device command of a request completes.
fn piece_done(r: &mut Reactor, done: IoDone) {
    let (conn, req, piece) = unpack(done.user);
    with_shard(|s| s.piece_done(r, conn, req, piece, done));
}

impl Shard {
    /// Closes connections that have not finished their handshake in time.
    fn expire_handshakes(&mut self, r: &mut Reactor) {
        let now_ns = r.now_ns();
        let late: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                c.session.export().is_none()
                    && c.closing.is_none()
                    && now_ns.saturating_sub(c.adopted_ns) > self.handshake_timeout_ns
            })
            .map(|(key, _)| key)
            .collect();
        for key in late {
            let conn = &mut self.conns[key];
            conn.failed = true;
            conn.closing = Some(format!(
                "handshake not finished within {} ms",
                self.handshake_timeout_ns / 1_000_000
            ));
            self.progress(r, key);
        }
    }

    fn log(&self, peer: &str, message: &str) {
        eprintln!("hypoll serve: reactor {}: {peer}: {message}", self.index);
    }

    fn poll(&mut self, r: &mut Reactor) -> usize {
        let mut work = 0;
        for e in 0..self.exports.len() {
            work += self.retry_backlog(r, e);
        }
        if let Some(end_ns) = self.coalesce_window(r) {
            // Send what the last batch has ready; let the next batch gather.
            work += self.progress_dirty(r);
            self.coalesce.held = true;
            hypoll_reactor::sleep_until_ns(end_ns);
            // What the window gathered is submitted now, not at the turn's start.
            r.refresh_now_ns();
            self.coalesce.slept_until_ns = Some(end_ns);
        }
        let started_before = self.requests_started;
        if r.outstanding() > 0 && r.now_ns() < self.sockets_checked_ns + SOCKET_CHECK_BUSY_NS {
            // The reactor is turning fast for its devices: a readiness check every turn
            // would cost more than the turn. Send what completed; read a little later.
            return work + self.progress_dirty(r);
        }
        self.sockets_checked_ns = r.now_ns();
        work += self.service_ready(r);
        if work == 0 && !self.coalesce.pipelined() && self.should_wait_for_next_request(r) {
            // Clients wait on each reply: the next request comes within a round trip, and
            // parking now would add a wake-up to it. Watch the sockets for a while first.
            // Each look restamps the turn, so a request found late is not stamped (nor its
            // device latency measured) from the turn's start.
            let until_ns = r.refresh_now_ns() + self.idle_spin_ns;
            while work == 0 && r.refresh_now_ns() < until_ns {
                std::hint::spin_loop();
                work += self.service_ready(r);
            }
        }
        let batch = self.requests_started - started_before;
        let slept_until_ns = self.coalesce.slept_until_ns.take();
        if batch > 0 {
            self.batch_ewma += (batch as f64 - self.batch_ewma) / BATCH_EWMA_WEIGHT;
            self.coalesce.last_batch_ns = slept_until_ns.unwrap_or_else(|| r.now_ns());
        }
        if std::mem::take(&mut self.coalesce.held) {
            self.coalesce.window_done(batch, self.requests_started);
            self.conn_metrics.coalesce_windows.inc();
            self.conn_metrics.coalesced_requests.inc_by(batch);
        }
        work
    }

    /// When to read the sockets next, if this turn should let requests gather first: only
    /// while coalescing is on (or a trial is due), within a window of the last batch, with
    /// nothing at the devices (a sleep would hold their completions), no request waiting for
    /// room at a device, and no stop under way.
    fn coalesce_window(&self, r: &Reactor) -> Option<u64> {
        let c = &self.coalesce;
        if c.window_ns == 0 || self.draining || r.outstanding() > 0 {
            return None;
        }
        if !c.on && self.requests_started < c.probe_at_requests {
            return None;
        }
        let end_ns = c.last_batch_ns.saturating_add(c.window_ns);
        if r.now_ns() >= end_ns || self.exports.iter().any(|e| !e.backlog.is_empty()) {
            return None;
        }
        Some(end_ns)
    }

    /// Whether an idle poll should keep watching the sockets instead of letting the reactor
    /// park: only with nothing at all in flight on this reactor, and only while requests
    /// arrive one or two at a time (a client at queue depth 1, whose latency a wake-up would
    /// add to). Under load, batches are larger and parking costs nothing that matters. (The
    /// caller also skips it once a coalescing window showed the clients pipelining: a fast
    /// reactor sees small batches even then.)
    fn should_wait_for_next_request(&self, r: &Reactor) -> bool {
        self.idle_spin_ns > 0
            && !self.conns.is_empty()
            && !self.draining
            && r.outstanding() == 0
            && self.dirty.is_empty()
            && self.batch_ewma < SPIN_BATCH_MAX
            && self.conns.iter().all(|(_, c)| c.inflight.is_empty())
    }

    /// Reads ready sockets, parses, submits, writes replies. Returns the work done.
    fn service_ready(&mut self, r: &mut Reactor) -> usize {
        let mut work = 0;
        let mut ready = std::mem::take(&mut self.ready);
        if let Err(e) = self.epoll.ready(&mut ready) {
            eprintln!(
                "hypoll serve: reactor {}: epoll_wait failed: {e}",
                self.index
            );
        }
        let bytes_max = self.connection_bytes_max;
        for &(token, events) in &ready {
            let key = token as usize;
            let limit = self.inbuf_limit();
            let Some(conn) = self.conns.get_mut(key) else {
                continue;
            };
            work += 1;
            if events & WRITE_BITS != 0 {
                conn.write_blocked = false;
            }
            if events & READ_BITS != 0 && conn.can_parse(self.draining, bytes_max) && !conn.eof {
                conn.read_in(limit);
            } else if events & HANGUP_BITS != 0 && !conn.gone {
                // Hung up while we were not reading: nobody will take the replies.
                conn.gone = true;
                if conn.closing.is_none() {
                    conn.closing = Some("the client hung up".into());
                }
            }
            self.mark_dirty(key);
        }
        self.ready = ready;
        work + self.progress_dirty(r)
    }

    /// Parses, submits and writes for the connections marked dirty. Returns the work done.
    fn progress_dirty(&mut self, r: &mut Reactor) -> usize {
        let mut work = 0;
        let dirty = std::mem::take(&mut self.dirty);
        for &key in &dirty {
            work += self.progress(r, key);
        }
        let mut dirty = dirty;
        dirty.clear();
        // Connections marked while progressing wait for the next poll.
        dirty.append(&mut self.dirty);
        self.dirty = dirty;
        work
    }

    fn inbuf_limit(&self) -> usize {
        proto::REQUEST_HEADER_BYTES + self.limits.request_bytes_max as usize + READ_CHUNK_BYTES
    }

    fn mark_dirty(&mut self, key: usize) {
        if let Some(c) = self.conns.get_mut(key) {
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(key);
            }
        }
    }

    /// A new connection from the listener.
    fn adopt(&mut self, r: &mut Reactor, stream: Stream, peer: String) {
        if self.draining || self.conns.len() >= CONNECTIONS_PER_REACTOR_MAX {
            self.open.fetch_sub(1, Ordering::AcqRel);
            self.log(
                &peer,
                "refused: the server is stopping or this reactor is full",
            );
            return;
        }
        let mut greeting = Vec::new();
        let session = Session::new(self.infos.clone(), self.limits, &mut greeting);
        let entry = self.conns.vacant_entry();
        let key = entry.key();
        let interest = Interest {
            read: true,
            write: false,
        };
        if let Err(e) = self.epoll.add(stream.fd(), interest, key as u64) {
            self.open.fetch_sub(1, Ordering::AcqRel);
            self.log(&peer, &format!("dropped: watching its socket: {e}"));
            return;
        }
        let mut conn = Conn {
            adopted_ns: r.now_ns(),
            stream,
            peer,
            session,
            inbuf: Vec::new(),
            in_start: 0,
            in_end: 0,
            out: VecDeque::new(),
            out_sent: 0,
            out_bytes: 0,
            inflight_bytes: 0,
            write_blocked: false,
            inflight: Slab::new(),
            closing: None,
            eof: false,
            gone: false,
            failed: false,
            interest,
            registered: true,
            dirty: false,
            refusals: 0,
        };
        conn.push_out(OutMsg {
            head: Head::Bytes(greeting),
            data: Vec::new(),
        });
        entry.insert(conn);
        self.conn_metrics.accepted.inc();
        self.conn_metrics.open.inc();
        self.mark_dirty(key);
    }

    /// Stop reading requests everywhere; connections close as they finish.
    fn drain(&mut self) {
        self.draining = true;
        let keys: Vec<usize> = self.conns.iter().map(|(k, _)| k).collect();
        for k in keys {
            self.mark_dirty(k);
        }
    }

    /// Parses buffered input, sends replies, closes a finished connection, and watches the
    /// socket for what the connection waits for. Returns the work done.
    fn progress(&mut self, r: &mut Reactor, key: usize) -> usize {
        let Some(conn) = self.conns.get_mut(key) else {
            return 0;
        };
        conn.dirty = false;
        let mut work = self.parse(r, key);
        let draining = self.draining;
        let bytes_max = self.connection_bytes_max;
        let Some(conn) = self.conns.get_mut(key) else {
            return work;
        };
        if !conn.gone && !conn.out.is_empty() && !conn.write_blocked {
            let held_back = !conn.can_parse(draining, bytes_max) && conn.in_start < conn.in_end;
            match conn.write_out(&mut self.bufs) {
                Ok(n) => work += usize::from(n > 0),
                Err(e) => {
                    conn.gone = true;
                    conn.failed = true;
                    conn.closing = Some(format!("writing the socket: {e}"));
                }
            }
            if held_back && conn.can_parse(draining, bytes_max) {
                // The replies sent made room for requests already read off the socket: no
                // socket event will come for them, so parse them now. What that queues
                // without a device command (a refusal, a handshake reply) has no
                // completion to send it: the next turn does, and parses on if the bound
                // holds them again.
                let parsed = self.parse(r, key);
                if parsed > 0 {
                    self.mark_dirty(key);
                }
                work += parsed;
            }
        }
        let Some(conn) = self.conns.get_mut(key) else {
            return work;
        };
        if conn.eof && conn.closing.is_none() && conn.can_parse(draining, bytes_max) {
            // Parsing stopped for want of input, not for a limit: every whole request the
            // client sent has started. Close once they finish.
            conn.closing = Some("the client closed the connection".into());
        }
        if draining && conn.closing.is_none() {
            conn.closing = Some("the server is stopping".into());
        }
        let finished = conn.closing.is_some()
            && conn.inflight.is_empty()
            && (conn.gone || conn.out.is_empty());
        if finished {
            self.close(key);
            return work + 1;
        }
        let want = Interest {
            read: conn.can_parse(draining, bytes_max) && !conn.eof,
            write: conn.write_blocked,
        };
        let result = if conn.gone && conn.registered {
            // Nothing more to read or write: stop hearing about it.
            conn.registered = false;
            self.epoll.remove(conn.stream.fd())
        } else if !conn.gone && want != conn.interest {
            // Kept only once the kernel has it: a failed change is tried again on the next
            // turn that progresses the connection.
            let changed = self.epoll.modify(conn.stream.fd(), want, key as u64);
            if changed.is_ok() {
                conn.interest = want;
            }
            changed
        } else {
            Ok(())
        };
        if let Err(e) = result {
            let peer = conn.peer.clone();
            self.log(&peer, &format!("updating its epoll interest: {e}"));
        }
        work
    }

    fn close(&mut self, key: usize) {
        let conn = self.conns.remove(key);
        if conn.registered {
            let _ = self.epoll.remove(conn.stream.fd());
        }
        self.open.fetch_sub(1, Ordering::AcqRel);
        self.conn_metrics.open.dec();
        if conn.failed {
            self.conn_metrics.closed_on_error.inc();
        }
        let why = conn.closing.unwrap_or_default();
        let refused = if conn.refusals > REFUSALS_LOGGED_MAX {
            format!(
                " ({} requests refused, {} not logged)",
                conn.refusals,
                conn.refusals - REFUSALS_LOGGED_MAX
            )
        } else {
            String::new()
        };
        if conn.failed || !refused.is_empty() {
            self.log(&conn.peer, &format!("closed: {why}{refused}"));
        }
    }

    /// Runs the session over the buffered input while the connection may take requests.
    fn parse(&mut self, r: &mut Reactor, key: usize) -> usize {
        let draining = self.draining;
        let bytes_max = self.connection_bytes_max;
        let mut work = 0;
        let mut out = std::mem::take(&mut self.scratch);
        loop {
            let conn = &mut self.conns[key];
            if !conn.can_parse(draining, bytes_max) || conn.in_start == conn.in_end {
                break;
            }
            out.clear();
            let input = &conn.inbuf[conn.in_start..conn.in_end];
            let (used, step) = conn.session.step(input, &mut out);
            if !out.is_empty() {
                conn.push_out(OutMsg {
                    head: Head::Bytes(out.clone()),
                    data: Vec::new(),
                });
            }
            match step {
                Step::NeedMore => break,
                Step::Negotiating => {}
                Step::Ready { export } => {
                    self.exports[export].connections.inc();
                }
                Step::Request(req) => {
                    self.requests_started += 1;
                    let export = conn
                        .session
                        .export()
                        .expect("requests follow the handshake");
                    let payload_at = conn.in_start;
                    self.start(r, key, export, req, payload_at);
                }
                Step::Refused { why, error, .. } => {
                    conn.refusals += 1;
                    self.conn_metrics.refused.inc();
                    if conn.refusals <= REFUSALS_LOGGED_MAX {
                        let peer = conn.peer.clone();
                        self.log(&peer, &format!("request refused with error {error}: {why}"));
                    }
                }
                Step::Close(close) => {
                    let why = match close {
                        Close::Abort => "the client aborted the handshake".to_string(),
                        Close::Disconnect => "the client disconnected".to_string(),
                        Close::Protocol(why) => {
                            conn.failed = true;
                            format!("protocol error: {why}")
                        }
                    };
                    conn.closing = Some(why);
                }
            }
            let conn = &mut self.conns[key];
            conn.in_start += used;
            work += 1;
        }
        self.scratch = out;
        work
    }

    /// Starts a valid request: splits it into device commands and submits what fits.
    fn start(&mut self, r: &mut Reactor, key: usize, export: usize, req: Request, at: usize) {
        let ex = &self.exports[export];
        let conn = &mut self.conns[key];
        let mut write_bufs = VecDeque::new();
        if req.op == Op::Write {
            let payload = &conn.inbuf[at + req.payload.start..at + req.payload.end];
            for chunk in payload.chunks(ex.rw_piece_bytes as usize) {
                // From the pinned pool: a uring device then skips per-I/O page pinning.
                let mut buf = self.bufs.take(chunk.len());
                buf.copy_from_slice(chunk);
                write_bufs.push_back(buf);
            }
        }
        let read_pieces = if req.op == Op::Read {
            (req.length as usize).div_ceil(ex.rw_piece_bytes as usize)
        } else {
            0
        };
        let pending = Pending {
            op: req.op,
            cookie: req.cookie,
            export,
            offset: req.offset,
            length: req.length,
            fua: req.fua,
            may_deallocate: !req.no_hole,
            stage: if req.op == Op::Flush {
                Stage::Flush
            } else {
                Stage::Data
            },
            submitted: 0,
            flush_submitted: false,
            pieces_out: 0,
            error: 0,
            write_bufs,
            read_bufs: (0..read_pieces).map(|_| None).collect(),
            start_ns: r.now_ns(),
        };
        conn.inflight_bytes += held_bytes(&pending);
        let rk = conn.inflight.insert(pending);
        if self.exports[export].backlog.is_empty() && self.pump(r, key, rk) {
            self.maybe_finish(r, key, rk);
        } else {
            self.exports[export].backlog.push_back((key, rk));
        }
    }

    /// Submits the request's next device commands until all are submitted (true) or the
    /// queue pair is full (false).
    fn pump(&mut self, r: &mut Reactor, ck: usize, rk: usize) -> bool {
        let p = &mut self.conns[ck].inflight[rk];
        let ex = &self.exports[p.export];
        let lba = u64::from(ex.lba_bytes);
        loop {
            let data_left = u64::from(p.length) - p.submitted;
            let more = match p.stage {
                Stage::Data => data_left > 0,
                Stage::Flush => !p.flush_submitted,
            };
            if more && !r.has_room(ex.dev) {
                // Full: retried from the backlog, without building a buffer to be refused.
                return false;
            }
            let (req, buf, piece_bytes) = match p.stage {
                Stage::Data if data_left > 0 => {
                    let at = p.offset + p.submitted;
                    let piece = (p.submitted / u64::from(ex.rw_piece_bytes)) as u32;
                    match p.op {
                        Op::Read | Op::Write => {
                            let n = data_left.min(u64::from(ex.rw_piece_bytes));
                            let (op, buf) = if p.op == Op::Read {
                                let mut buf = self.bufs.take(n as usize);
                                if !ex.reads_fill {
                                    buf.fill(0);
                                }
                                (IoOp::Read, buf)
                            } else {
                                let buf = p.write_bufs.pop_front().expect("one buffer a piece");
                                (IoOp::Write, buf)
                            };
                            let req = IoRequest::new(op, at / lba, (n / lba) as u32)
                                .with_user(pack(ck, rk, piece));
                            (req, Some(buf), n)
                        }
                        Op::Trim | Op::WriteZeroes => {
                            let n = data_left.min(u64::from(ex.zero_piece_blocks) * lba);
                            let op = if p.op == Op::Trim {
                                IoOp::Deallocate
                            } else {
                                IoOp::WriteZeroes
                            };
                            let req = IoRequest::new(op, at / lba, (n / lba) as u32)
                                .with_deallocate(p.may_deallocate)
                                .with_user(pack(ck, rk, 0));
                            (req, None, n)
                        }
                        Op::Flush => unreachable!("a flush has no data stage"),
                    }
                }
                Stage::Flush if !p.flush_submitted => {
                    let req = IoRequest::new(IoOp::Flush, 0, 0).with_user(pack(ck, rk, 0));
                    (req, None, 0)
                }
                _ => return true,
            };
            match r.submit(ex.dev, req, buf, piece_done) {
                Ok(()) => {
                    p.pieces_out += 1;
                    if p.stage == Stage::Flush {
                        p.flush_submitted = true;
                    } else {
                        p.submitted += piece_bytes;
                    }
                }
                Err(rejected) => {
                    if let RejectReason::Submit(SubmitError::QueueFull { .. }) = rejected.reason {
                        if let (Op::Write, Some(buf)) = (p.op, rejected.buf) {
                            p.write_bufs.push_front(buf);
                        }
                        return false;
                    }
                    // Anything else will not get better: fail the rest of the request.
                    if p.error == 0 {
                        p.error = match rejected.reason {
                            RejectReason::ShuttingDown => proto::ESHUTDOWN,
                            _ => proto::EIO,
                        };
                    }
                    p.submitted = u64::from(p.length);
                    p.flush_submitted = true;
                    p.write_bufs.clear();
                    return true;
                }
            }
        }
    }

    fn retry_backlog(&mut self, r: &mut Reactor, export: usize) -> usize {
        let mut work = 0;
        while let Some(&(ck, rk)) = self.exports[export].backlog.front() {
            if !self.pump(r, ck, rk) {
                break;
            }
            self.exports[export].backlog.pop_front();
            work += 1;
            self.maybe_finish(r, ck, rk);
        }
        work
    }

    fn piece_done(&mut self, r: &mut Reactor, ck: usize, rk: usize, piece: u32, done: IoDone) {
        let Some(p) = self.conns.get_mut(ck).and_then(|c| c.inflight.get_mut(rk)) else {
            // Cannot happen: a connection and its requests stay until every piece is back.
            eprintln!("hypoll serve: completion for a request that is gone ({ck}/{rk})");
            return;
        };
        p.pieces_out -= 1;
        match done.result {
            Ok(()) => {
                if p.op == Op::Read && p.stage == Stage::Data {
                    p.read_bufs[piece as usize] = done.buf;
                } else if let Some(buf) = done.buf {
                    // A written piece's payload: its buffer serves the next request.
                    self.bufs.give(buf);
                }
            }
            Err(e) => {
                if p.error == 0 {
                    let error = nbd_error_of(&e);
                    p.error = error;
                    let name = if error == proto::ENOSPC {
                        "ENOSPC"
                    } else {
                        "EIO"
                    };
                    let peer = self.conns[ck].peer.clone();
                    self.log(&peer, &format!("device error, replying {name}: {e}"));
                }
            }
        }
        self.maybe_finish(r, ck, rk);
    }

    /// Once every command of a request is back: a flush for FUA, or the reply.
    fn maybe_finish(&mut self, r: &mut Reactor, ck: usize, rk: usize) {
        loop {
            let p = &mut self.conns[ck].inflight[rk];
            let all_submitted = match p.stage {
                Stage::Data => p.submitted == u64::from(p.length),
                Stage::Flush => p.flush_submitted,
            };
            if !all_submitted || p.pieces_out > 0 {
                return;
            }
            if p.stage == Stage::Data && p.fua && p.error == 0 {
                p.stage = Stage::Flush;
                let export = p.export;
                if !self.exports[export].backlog.is_empty() || !self.pump(r, ck, rk) {
                    self.exports[export].backlog.push_back((ck, rk));
                    return;
                }
                continue;
            }
            break;
        }
        let conn = &mut self.conns[ck];
        let p = conn.inflight.remove(rk);
        conn.inflight_bytes -= held_bytes(&p);
        let m = &self.exports[p.export].io[p.op as usize];
        m.requests.inc();
        if p.error == 0 {
            m.bytes.inc_by(u64::from(p.length));
        } else {
            m.errors.inc();
        }
        m.latency
            .observe(r.now_ns().saturating_sub(p.start_ns) as f64 / 1e9);
        if !conn.gone {
            let data = if p.op == Op::Read && p.error == 0 {
                p.read_bufs
                    .into_iter()
                    .map(|b| b.expect("every piece of a successful read is back"))
                    .collect()
            } else {
                Vec::new()
            };
            conn.push_out(OutMsg {
                head: Head::Reply(simple_reply(p.cookie, p.error)),
                data,
            });
        }
        self.mark_dirty(ck);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_that_wait_on_replies_never_turn_coalescing_on() {
        let mut c = Coalesce::new(COALESCE_NS_DEFAULT);
        let mut requests = 0;
        for _ in 0..100 {
            // Queue depth 1 or 2: a trial window gathers at most two requests.
            requests += COALESCE_PROBE_EVERY_REQUESTS;
            c.window_done(2, requests);
            assert!(!c.on);
            assert_eq!(
                c.probe_at_requests,
                requests + COALESCE_PROBE_EVERY_REQUESTS
            );
        }
        c.window_done(0, requests);
        assert!(!c.on && !c.pipelined());
    }

    #[test]
    fn coalescing_turns_on_for_pipelining_clients_and_off_when_they_stop() {
        let mut c = Coalesce::new(COALESCE_NS_DEFAULT);
        assert!(!c.pipelined());
        // A trial gathering what a queue depth 8 client sends: not worth a window.
        c.window_done(8, 1024);
        assert!(!c.on && c.pipelined());
        c.window_done(12, 2048);
        assert!(c.on && c.pipelined());
        // Windows gathering 8 keep it on (hysteresis) ...
        for _ in 0..50 {
            c.window_done(8, 2000);
            assert!(c.on);
        }
        // ... windows gathering one or none turn it off, and bring the next trial near;
        // until it, the clients still count as pipelining.
        let mut windows = 0;
        while c.on {
            c.window_done(1, 3000);
            windows += 1;
            assert!(windows < 20, "coalescing stays on for clients that stopped");
        }
        assert_eq!(c.probe_at_requests, 3000 + COALESCE_RETRY_REQUESTS);
        assert!(c.pipelined());
        // A trial that gathers one request: a client that waits on its replies.
        c.window_done(1, 3064);
        assert!(!c.on && !c.pipelined());
        assert_eq!(c.probe_at_requests, 3064 + COALESCE_PROBE_EVERY_REQUESTS);
        // One that gathers two: a shallow pipeline, neither coalesced nor counted as deep.
        c.window_done(2, 4096);
        assert!(!c.on && !c.pipelined());
        // One that gathers eight: deep enough to stop waiting for single requests, not to
        // coalesce.
        c.window_done(8, 5120);
        assert!(!c.on && c.pipelined());
    }

    #[test]
    fn listen_addresses_parse() {
        assert_eq!(
            "127.0.0.1:10809".parse::<ListenAddr>(),
            Ok(ListenAddr::Tcp("127.0.0.1:10809".parse().unwrap()))
        );
        assert_eq!(
            "unix:/tmp/x.sock".parse::<ListenAddr>(),
            Ok(ListenAddr::Unix("/tmp/x.sock".into()))
        );
        assert!("unix:".parse::<ListenAddr>().is_err());
        assert!("localhost".parse::<ListenAddr>().is_err());
        assert_eq!(
            ListenAddr::Unix("/a".into()).to_string(),
            "unix:/a".to_string()
        );
    }

    #[test]
    fn a_device_out_of_space_is_answered_enospc_and_other_failures_eio() {
        let enospc = IoFailure::Device(Status::CAPACITY_EXCEEDED);
        assert_eq!(nbd_error_of(&enospc), proto::ENOSPC);
        for other in [
            IoFailure::Device(Status::WRITE_FAULT),
            IoFailure::Device(Status::UNRECOVERED_READ_ERROR),
            IoFailure::TimedOut,
            IoFailure::Shutdown,
        ] {
            assert_eq!(nbd_error_of(&other), proto::EIO, "{other}");
        }
    }

    #[test]
    fn a_piece_identity_survives_the_user_word() {
        for (c, r, p) in [(0, 0, 0), (65535, 65535, u32::MAX), (7, 300, 8191)] {
            assert_eq!(unpack(pack(c, r, p)), (c, r, p));
        }
    }

    #[test]
    fn exports_advertise_what_every_device_does() {
        let device = Device::open("emu:dram,size=64M,lba=4096").unwrap();
        let info = export_info("mem", &device);
        assert_eq!(info.size_bytes, 64 << 20);
        assert_eq!((info.block_bytes, info.preferred_bytes), (4096, 4096));
        for flag in [
            proto::TFLAG_HAS_FLAGS,
            proto::TFLAG_SEND_FLUSH,
            proto::TFLAG_SEND_FUA,
            proto::TFLAG_SEND_TRIM,
            proto::TFLAG_SEND_WRITE_ZEROES,
            proto::TFLAG_CAN_MULTI_CONN,
        ] {
            assert_ne!(info.flags & flag, 0, "{flag:#x}");
        }
        assert_eq!(info.flags & proto::TFLAG_READ_ONLY, 0);
    }

    /// A controller with neither Dataset Management nor Write Zeroes, as a `vfio` one
    /// reports in ONCS.
    struct NoOptionalCommands(Arc<dyn hypoll_nvme::Controller>);

    impl hypoll_nvme::Controller for NoOptionalCommands {
        fn describe(&self) -> String {
            "no optional commands".into()
        }
        fn namespace(&self) -> hypoll_nvme::NamespaceInfo {
            self.0.namespace()
        }
        fn create_queue_pair(
            &self,
            depth: usize,
        ) -> Result<Box<dyn hypoll_nvme::QueuePair>, hypoll_nvme::QueuePairError> {
            self.0.create_queue_pair(depth)
        }
        fn supports(&self, opcode: Opcode) -> bool {
            !matches!(opcode, Opcode::DatasetManagement | Opcode::WriteZeroes)
        }
    }

    #[test]
    fn trim_and_write_zeroes_are_advertised_only_where_the_device_has_them() {
        let inner = Device::open("null").unwrap().ctrl;
        let device = Device::new(Arc::new(NoOptionalCommands(inner)));
        let info = export_info("bare", &device);
        assert_eq!(info.flags & proto::TFLAG_SEND_TRIM, 0);
        assert_eq!(info.flags & proto::TFLAG_SEND_WRITE_ZEROES, 0);
        assert_ne!(info.flags & proto::TFLAG_SEND_FLUSH, 0);
    }

    #[test]
    fn bad_configurations_are_refused_before_anything_starts() {
        let listen: ListenAddr = "127.0.0.1:0".parse().unwrap();
        let cfg = |exports: Vec<(&str, &str)>| {
            ServerConfig::new(
                exports
                    .into_iter()
                    .map(|(n, s)| (n.to_string(), s.to_string()))
                    .collect(),
                listen.clone(),
            )
        };
        assert!(matches!(
            Server::start(cfg(vec![])),
            Err(ServeError::NoExports)
        ));
        assert!(matches!(
            Server::start(cfg(vec![("a", "null"), ("a", "null")])),
            Err(ServeError::DuplicateExport(_))
        ));
        assert!(matches!(
            Server::start(cfg(vec![("a", "nonsense")])),
            Err(ServeError::Device { .. })
        ));
        let mut c = cfg(vec![("a", "null")]);
        c.request_bytes_max = 1000;
        assert!(matches!(
            Server::start(c),
            Err(ServeError::RequestBytes(1000))
        ));
        let mut c = cfg(vec![("a", "null")]);
        c.connection_bytes_max = 4096;
        assert!(matches!(
            Server::start(c),
            Err(ServeError::ConnectionBytes(4096))
        ));
    }
}
