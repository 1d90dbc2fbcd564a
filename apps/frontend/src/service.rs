//! A running service of one protocol: its reactors, each with a shard; the listener thread
//! that hands them connections; the metrics endpoint. [`Service::start`] brings them up in
//! named steps; the graceful stop is in `stop.rs`.

use std::io;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use hypoll_reactor::{InitError, Reactor, ReactorConfig, ReactorHandle, ReactorSet, ReactorTuning};

use crate::endpoint::Endpoint;
use crate::fdlimit::{self, FdLimit, FDS_PER_REACTOR, FDS_SERVICE};
use crate::listen::{accept_loop, ListenAddr, Listener};
use crate::metrics::{ConnMetrics, Metrics};
use crate::protocol::{HasShard, Protocol};
use crate::shard::{self, Shard};
use crate::tls::{TlsError, TlsMode};
use crate::ServiceConfig;

/// Why a service did not start (after its configuration was checked).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
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
    #[error(transparent)]
    Tls(#[from] TlsError),
}

impl StartError {
    /// The [`ServiceConfig`] setting at fault, where one is.
    pub fn setting(&self) -> Option<&'static str> {
        match self {
            StartError::Tls(e) => Some(e.setting()),
            _ => None,
        }
    }
}

/// A running service of protocol `P` on reactors whose state is `S`: the protocol's shard
/// itself, or a state of several front ends' parts that holds it ([`HasShard`]).
/// [`Service::stop`] stops it gracefully; dropping it stops it too.
pub struct Service<P: Protocol, S: HasShard<P> = Shard<P>> {
    pub(crate) set: Option<ReactorSet<S>>,
    pub(crate) listener: Option<JoinHandle<()>>,
    pub(crate) stop: Arc<AtomicBool>,
    local: ListenAddr,
    pub(crate) endpoint: Option<Endpoint>,
    /// Connections open on all reactors.
    pub(crate) open: Arc<AtomicUsize>,
    /// The exports' names, in the order their devices are attached on every reactor.
    pub(crate) export_names: Vec<String>,
    protocol: PhantomData<fn() -> P>,
}

/// What builds a reactor's shard of the service, handed to a composed service's `init`
/// ([`Service::start_with`]) on each reactor.
pub struct ShardBuilder<P: Protocol> {
    cfg: ServiceConfig,
    metrics: ConnMetrics,
    open: Arc<AtomicUsize>,
    tls: Option<Arc<rustls::ServerConfig>>,
    protocol: PhantomData<fn() -> P>,
}

impl<P: Protocol> ShardBuilder<P> {
    pub(crate) fn new(
        cfg: ServiceConfig,
        metrics: ConnMetrics,
        open: Arc<AtomicUsize>,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> ShardBuilder<P> {
        ShardBuilder {
            cfg,
            metrics,
            open,
            tls,
            protocol: PhantomData,
        }
    }

    /// The shard of `proto` on reactor `r`: its epoll set, its poller and its sweep timer
    /// join `r`, and find the shard through `S`.
    pub fn build<S: HasShard<P>>(
        self,
        r: &mut Reactor<S>,
        proto: P,
    ) -> Result<Shard<P>, InitError> {
        let shard = shard::build(r, proto, &self.cfg, self.metrics, self.open, self.tls)?;
        Ok(shard)
    }
}

impl<P: Protocol> Service<P> {
    /// Starts the reactors (running `init` on each to build the protocol's per-reactor
    /// state: `init` attaches the exports' devices in `export_names` order), the metrics
    /// endpoint and the listener. Returns once clients can connect.
    pub fn start(
        cfg: &ServiceConfig,
        metrics: Arc<Metrics>,
        export_names: Vec<String>,
        init: impl Fn(&mut Reactor<Shard<P>>, &Metrics) -> Result<P, InitError> + Send + Sync + 'static,
    ) -> Result<Service<P>, StartError> {
        Service::start_with(cfg, metrics, export_names, move |r, metrics, shard| {
            let proto = init(r, metrics)?;
            shard.build(r, proto)
        })
    }
}

impl<P: Protocol, S: HasShard<P>> Service<P, S> {
    /// Starts the service on reactors whose state is `S`, which holds this protocol's
    /// shard beside other front ends' parts: `init` builds each reactor's state, the
    /// protocol's shard with the [`ShardBuilder`] it is handed. The exports' devices are
    /// attached first, in `export_names` order (the final flush names them by position).
    pub fn start_with(
        cfg: &ServiceConfig,
        metrics: Arc<Metrics>,
        export_names: Vec<String>,
        init: impl Fn(&mut Reactor<S>, &Metrics, ShardBuilder<P>) -> Result<S, InitError>
            + Send
            + Sync
            + 'static,
    ) -> Result<Service<P, S>, StartError> {
        check_fds(cfg);
        let tls = cfg.tls.load()?;
        let listener = bind(cfg, cfg.tls.mode)?;
        let local = listener.local_addr().map_err(|error| StartError::Listen {
            addr: cfg.listen.to_string(),
            error,
        })?;
        let open = Arc::new(AtomicUsize::new(0));
        let set = start_reactors(cfg, metrics.clone(), open.clone(), tls, init)?;
        let endpoint = start_endpoint(cfg, metrics, &set)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = start_listener::<P, S>(listener, &stop, &open, cfg.connections_max, &set)?;
        Ok(Service {
            set: Some(set),
            listener: Some(thread),
            stop,
            local,
            endpoint,
            open,
            export_names,
            protocol: PhantomData,
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

    /// Connections open now.
    pub fn connections_open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// The reactors' handles, for a composed service's other parts.
    pub fn handles(&self) -> Option<&Arc<[ReactorHandle<S>]>> {
        self.set.as_ref().map(ReactorSet::handles)
    }
}

impl<P: Protocol, S: HasShard<P>> Drop for Service<P, S> {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

/// Step 0: enough open files for `connections_max` connections, raising the soft limit
/// toward the hard one where it is short, else a warning: past the limit, new connections
/// wait in the listen backlog until one closes.
fn check_fds(cfg: &ServiceConfig) {
    let reactors = cfg.cores.as_ref().map_or(1, |c| c.len().max(1)) as u64;
    let needed = cfg.connections_max as u64 + FDS_SERVICE + FDS_PER_REACTOR * reactors;
    match fdlimit::ensure(needed) {
        Ok(FdLimit::Enough) => {}
        Ok(FdLimit::Raised { from, to }) => {
            tracing::info!("open-file limit raised from {from} to {to}");
        }
        Ok(FdLimit::Short { soft, needed }) => tracing::warn!(
            setting = "connections_max",
            "the open-file limit is {soft} (its hard limit) but {} connections and the \
             server need about {needed}: past it, new clients wait until a connection \
             closes; raise the limit (ulimit -n) or allow fewer connections",
            cfg.connections_max
        ),
        Err(e) => tracing::warn!("reading or raising the open-file limit: {e}"),
    }
}

/// Step 1: the listening socket, with a warning when it is reachable on every interface
/// and clients need not use TLS.
pub(crate) fn bind(cfg: &ServiceConfig, tls: TlsMode) -> Result<Listener, StartError> {
    let addr = &cfg.listen;
    let listener = Listener::bind(addr, cfg.unix_mode, cfg.unix_owner).map_err(|error| {
        StartError::Listen {
            addr: addr.to_string(),
            error,
        }
    })?;
    if addr.is_wildcard() && tls != TlsMode::Require {
        tracing::warn!(
            "listening on every interface ({addr}) with no TLS and no client \
             authentication required: anyone who can reach this port can read and write \
             every export; require TLS (with client certificates), or listen on a \
             loopback or private address, or behind a firewall"
        );
    }
    Ok(listener)
}

/// Step 2: one reactor per core, each with the protocol's state (from `init`) in a shard.
fn start_reactors<P: Protocol, S: HasShard<P>>(
    cfg: &ServiceConfig,
    metrics: Arc<Metrics>,
    open: Arc<AtomicUsize>,
    tls: Option<Arc<rustls::ServerConfig>>,
    init: impl Fn(&mut Reactor<S>, &Metrics, ShardBuilder<P>) -> Result<S, InitError>
        + Send
        + Sync
        + 'static,
) -> Result<ReactorSet<S>, StartError> {
    let shard_cfg = cfg.clone();
    let set = ReactorSet::start(
        ReactorConfig {
            cores: cfg.cores.clone(),
            policy: cfg.policy.clone(),
            // The shard's turn decides when waiting for sockets pays (`turn.rs`); otherwise
            // an idle reactor parks at once.
            tuning: ReactorTuning {
                idle_spin_ns: 0,
                ..ReactorTuning::default()
            },
            ..ReactorConfig::default()
        },
        move |reactor| {
            let builder = ShardBuilder {
                cfg: shard_cfg.clone(),
                metrics: metrics.conns(reactor.index()),
                open: open.clone(),
                tls: tls.clone(),
                protocol: PhantomData,
            };
            init(reactor, &metrics, builder)
        },
    )?;
    Ok(set)
}

/// Step 3: the Prometheus endpoint, where one was asked for.
fn start_endpoint<S: 'static>(
    cfg: &ServiceConfig,
    metrics: Arc<Metrics>,
    set: &ReactorSet<S>,
) -> Result<Option<Endpoint>, StartError> {
    let Some(addr) = cfg.metrics else {
        return Ok(None);
    };
    let all = std::iter::once(metrics).chain(cfg.metrics_beside.iter().cloned());
    let endpoint = Endpoint::start(addr, all.collect(), set.handles().clone())
        .map_err(|error| StartError::Metrics { addr, error })?;
    Ok(Some(endpoint))
}

/// Step 4: the listener thread, handing connections to the reactors until `stop`.
fn start_listener<P: Protocol, S: HasShard<P>>(
    listener: Listener,
    stop: &Arc<AtomicBool>,
    open: &Arc<AtomicUsize>,
    connections_max: usize,
    set: &ReactorSet<S>,
) -> Result<JoinHandle<()>, StartError> {
    let stop = stop.clone();
    let open = open.clone();
    let handles = set.handles().clone();
    std::thread::Builder::new()
        .name("hypoll-listen".into())
        .spawn(move || accept_loop::<P, S>(listener, &stop, &open, connections_max, &handles))
        .map_err(StartError::Thread)
}
