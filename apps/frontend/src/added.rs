//! A second stream protocol on a composed service: its listener, against reactors another
//! protocol's [`Service`](crate::Service) started (the `listen` half of the composition
//! design, docs/lab/2026-12-front-end-composition.md). [`AddedProtocol::bind`] binds its
//! socket before the reactors start, so its address is known to their `init`, which builds
//! the protocol's shard on each reactor with [`AddedShards::builder`]; once the service
//! runs, [`AddedProtocol::serve`] starts the listener thread with the reactors' handles.
//! Its stop ([`AddedListener::stop`]) comes before the service's: stop accepting, let its
//! connections finish what they have in flight, close them.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use hypoll_reactor::ReactorHandle;

use crate::listen::{accept_loop, ListenAddr, Listener};
use crate::metrics::Metrics;
use crate::protocol::{HasShard, Protocol};
use crate::service::{bind, ShardBuilder, StartError};
use crate::{ServiceConfig, DRAIN_CHECK_PERIOD, DRAIN_TIMEOUT};

/// Protocol `Q`'s socket, bound, and what its shards are built from.
pub struct AddedProtocol<Q: Protocol> {
    listener: Listener,
    local: ListenAddr,
    cfg: ServiceConfig,
    metrics: Arc<Metrics>,
    open: Arc<AtomicUsize>,
    tls: Option<Arc<rustls::ServerConfig>>,
    protocol: PhantomData<fn() -> Q>,
}

/// What a reactor's `init` builds protocol `Q`'s shard with (cloned into `init`).
pub struct AddedShards<Q: Protocol> {
    cfg: ServiceConfig,
    metrics: Arc<Metrics>,
    open: Arc<AtomicUsize>,
    tls: Option<Arc<rustls::ServerConfig>>,
    protocol: PhantomData<fn() -> Q>,
}

impl<Q: Protocol> Clone for AddedShards<Q> {
    fn clone(&self) -> Self {
        AddedShards {
            cfg: self.cfg.clone(),
            metrics: self.metrics.clone(),
            open: self.open.clone(),
            tls: self.tls.clone(),
            protocol: PhantomData,
        }
    }
}

impl<Q: Protocol> AddedShards<Q> {
    /// The protocol's metrics (for its per-reactor handles).
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The builder of the shard on the reactor of index `reactor`.
    pub fn builder(&self, reactor: usize) -> ShardBuilder<Q> {
        ShardBuilder::new(
            self.cfg.clone(),
            self.metrics.conns(reactor),
            self.open.clone(),
            self.tls.clone(),
        )
    }
}

impl<Q: Protocol> AddedProtocol<Q> {
    /// Binds `cfg.listen` (with `cfg`'s bounds, TLS and pacing for `Q`'s connections; its
    /// cores and policy are the service's).
    pub fn bind(
        cfg: &ServiceConfig,
        metrics: Arc<Metrics>,
    ) -> Result<AddedProtocol<Q>, StartError> {
        let tls = cfg.tls.load()?;
        let listener = bind(cfg, cfg.tls.mode)?;
        let local = listener.local_addr().map_err(|error| StartError::Listen {
            addr: cfg.listen.to_string(),
            error,
        })?;
        Ok(AddedProtocol {
            listener,
            local,
            cfg: cfg.clone(),
            metrics,
            open: Arc::new(AtomicUsize::new(0)),
            tls,
            protocol: PhantomData,
        })
    }

    /// Where its clients connect (the real port when port 0 was asked for).
    pub fn local_addr(&self) -> &ListenAddr {
        &self.local
    }

    /// What each reactor's `init` builds the protocol's shard with.
    pub fn shards(&self) -> AddedShards<Q> {
        AddedShards {
            cfg: self.cfg.clone(),
            metrics: self.metrics.clone(),
            open: self.open.clone(),
            tls: self.tls.clone(),
            protocol: PhantomData,
        }
    }

    /// Starts accepting, handing each connection to the next of `handles`' reactors,
    /// whose state holds a shard of `Q` (built by `init` with [`AddedProtocol::shards`]).
    pub fn serve<S: HasShard<Q>>(
        self,
        handles: Arc<[ReactorHandle<S>]>,
    ) -> Result<AddedListener<S>, StartError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (thread_stop, open, max) = (stop.clone(), self.open.clone(), self.cfg.connections_max);
        let thread_handles = handles.clone();
        let listener = self.listener;
        let thread = std::thread::Builder::new()
            .name("hypoll-listen".into())
            .spawn(move || accept_loop::<Q, S>(listener, &thread_stop, &open, max, &thread_handles))
            .map_err(StartError::Thread)?;
        Ok(AddedListener {
            stop,
            thread: Some(thread),
            open: self.open,
            handles,
            drain: drain_shard::<Q, S>,
        })
    }
}

fn drain_shard<Q: Protocol, S: HasShard<Q>>(state: &mut S) {
    state.shard().drain();
}

/// An added protocol's listener, running. Stop it before the service that owns the
/// reactors; dropping it stops it too.
pub struct AddedListener<S: 'static> {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    open: Arc<AtomicUsize>,
    handles: Arc<[ReactorHandle<S>]>,
    drain: fn(&mut S),
}

impl<S: 'static> AddedListener<S> {
    /// Connections of this protocol open now.
    pub fn connections_open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Stops accepting, asks every reactor's shard of the protocol to read no more requests
    /// and close its connections as they finish, and waits for them up to
    /// [`DRAIN_TIMEOUT`]. Returns the connections still open.
    pub fn stop(mut self) -> usize {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> usize {
        let Some(thread) = self.thread.take() else {
            return self.connections_open();
        };
        self.stop.store(true, Ordering::Release);
        let _ = thread.join();
        for h in self.handles.iter() {
            let drain = self.drain;
            let _ = h.send(move |_, state| drain(state));
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while self.connections_open() > 0 && Instant::now() < deadline {
            std::thread::sleep(DRAIN_CHECK_PERIOD);
        }
        self.connections_open()
    }
}

impl<S: 'static> Drop for AddedListener<S> {
    fn drop(&mut self) {
        self.stop_inner();
    }
}
