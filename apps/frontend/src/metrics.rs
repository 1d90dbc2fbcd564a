//! What a front end exports to Prometheus: per-reactor and per-export counters of
//! requests, bytes, errors and connections, request latency histograms, and each reactor's
//! own counters (I/Os, CPU time) read at scrape time. Names carry the protocol's prefix
//! (`hypoll_nbd_requests_total`); the HTTP endpoint that serves them is in `endpoint.rs`.
//!
//! Each reactor takes its metric handles once, when it starts (one per export and op), so
//! a request costs a few uncontended atomic adds and one histogram observation, never a map
//! lookup.

use std::sync::atomic::AtomicU64;

use hypoll_reactor::ReactorHandle;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Latency buckets: 1 us doubling up to about 8 s.
const LATENCY_BUCKET_FIRST_S: f64 = 1e-6;
const LATENCY_BUCKETS: u16 = 24;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IoLabels {
    pub reactor: String,
    pub export: String,
    pub op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ExportLabels {
    pub reactor: String,
    pub export: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReactorLabels {
    pub reactor: String,
}

#[derive(Clone)]
struct LatencyHistogram;

impl MetricConstructor<Histogram> for LatencyHistogram {
    fn new_metric(&self) -> Histogram {
        Histogram::new(exponential_buckets(
            LATENCY_BUCKET_FIRST_S,
            2.0,
            LATENCY_BUCKETS,
        ))
    }
}

/// Every metric a service exports.
pub struct Metrics {
    requests: Family<IoLabels, Counter>,
    bytes: Family<IoLabels, Counter>,
    errors: Family<IoLabels, Counter>,
    latency: Family<IoLabels, Histogram, LatencyHistogram>,
    connections: Family<ReactorLabels, Counter>,
    export_connections: Family<ExportLabels, Counter>,
    connections_open: Family<ReactorLabels, Gauge>,
    closed_on_error: Family<ReactorLabels, Counter>,
    refused: Family<ReactorLabels, Counter>,
    coalesce_windows: Family<ReactorLabels, Counter>,
    coalesced_requests: Family<ReactorLabels, Counter>,
    reactor_ios: Family<ReactorLabels, Gauge>,
    reactor_io_errors: Family<ReactorLabels, Gauge>,
    reactor_cpu: Family<ReactorLabels, Gauge<f64, AtomicU64>>,
    reactor_busy: Family<ReactorLabels, Gauge<f64, AtomicU64>>,
    registry: Registry,
}

/// One reactor's handles for one export and op.
#[derive(Clone)]
pub struct IoMetrics {
    pub requests: Counter,
    pub bytes: Counter,
    pub errors: Counter,
    pub latency: Histogram,
}

/// One reactor's connection metrics.
#[derive(Clone)]
pub struct ConnMetrics {
    pub accepted: Counter,
    pub open: Gauge,
    pub closed_on_error: Counter,
    /// Requests refused with an error reply (bad range, alignment, flags).
    pub refused: Counter,
    /// Coalescing windows the reactor waited, and the requests they gathered.
    pub coalesce_windows: Counter,
    pub coalesced_requests: Counter,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// The metrics of a service speaking `protocol` ("NBD"), named `{prefix}_...`.
    pub fn new(prefix: &str, protocol: &str) -> Metrics {
        let mut m = Metrics {
            requests: Family::default(),
            bytes: Family::default(),
            errors: Family::default(),
            latency: Family::new_with_constructor(LatencyHistogram),
            connections: Family::default(),
            export_connections: Family::default(),
            connections_open: Family::default(),
            closed_on_error: Family::default(),
            refused: Family::default(),
            coalesce_windows: Family::default(),
            coalesced_requests: Family::default(),
            reactor_ios: Family::default(),
            reactor_io_errors: Family::default(),
            reactor_cpu: Family::default(),
            reactor_busy: Family::default(),
            registry: Registry::with_prefix(prefix),
        };
        let r = &mut m.registry;
        r.register(
            "requests",
            format!("{protocol} requests completed"),
            m.requests.clone(),
        );
        r.register("bytes", "Bytes read or written", m.bytes.clone());
        r.register(
            "errors",
            "Requests answered with an error after the device failed them",
            m.errors.clone(),
        );
        r.register(
            "request_latency_seconds",
            "Request parsed to reply queued, seconds",
            m.latency.clone(),
        );
        r.register("connections", "Connections accepted", m.connections.clone());
        r.register(
            "export_connections",
            "Connections that chose this export",
            m.export_connections.clone(),
        );
        r.register(
            "connections_open",
            "Connections open now",
            m.connections_open.clone(),
        );
        r.register(
            "connections_closed_on_error",
            "Connections closed for a protocol error or a socket error",
            m.closed_on_error.clone(),
        );
        r.register(
            "requests_refused",
            "Requests refused with an error reply before reaching the device",
            m.refused.clone(),
        );
        r.register(
            "coalesce_windows",
            "Windows the reactor let requests gather in before reading its sockets",
            m.coalesce_windows.clone(),
        );
        r.register(
            "coalesced_requests",
            "Requests read at the end of a coalescing window",
            m.coalesced_requests.clone(),
        );
        r.register(
            "reactor_ios",
            "I/Os the reactor completed",
            m.reactor_ios.clone(),
        );
        r.register(
            "reactor_io_errors",
            "I/Os the reactor completed with an error",
            m.reactor_io_errors.clone(),
        );
        r.register(
            "reactor_cpu_seconds",
            "CPU time of the reactor thread, from the OS",
            m.reactor_cpu.clone(),
        );
        r.register(
            "reactor_busy_ratio",
            "Share of wall time in loop turns that did work",
            m.reactor_busy.clone(),
        );
        m
    }

    /// One reactor's handles for requests of kind `op` on `export`.
    pub fn io(&self, reactor: usize, export: &str, op: &str) -> IoMetrics {
        let labels = IoLabels {
            reactor: reactor.to_string(),
            export: export.to_string(),
            op: op.to_string(),
        };
        IoMetrics {
            requests: self.requests.get_or_create(&labels).clone(),
            bytes: self.bytes.get_or_create(&labels).clone(),
            errors: self.errors.get_or_create(&labels).clone(),
            latency: self.latency.get_or_create(&labels).clone(),
        }
    }

    /// One reactor's handle counting the connections that chose an export.
    pub fn export_connections(&self, reactor: usize, export: &str) -> Counter {
        self.export_connections
            .get_or_create(&ExportLabels {
                reactor: reactor.to_string(),
                export: export.to_string(),
            })
            .clone()
    }

    /// One reactor's connection handles.
    pub fn conns(&self, reactor: usize) -> ConnMetrics {
        let labels = ReactorLabels {
            reactor: reactor.to_string(),
        };
        ConnMetrics {
            accepted: self.connections.get_or_create(&labels).clone(),
            open: self.connections_open.get_or_create(&labels).clone(),
            closed_on_error: self.closed_on_error.get_or_create(&labels).clone(),
            refused: self.refused.get_or_create(&labels).clone(),
            coalesce_windows: self.coalesce_windows.get_or_create(&labels).clone(),
            coalesced_requests: self.coalesced_requests.get_or_create(&labels).clone(),
        }
    }

    /// The text a scrape returns, with the reactors' own counters read now.
    pub fn encode<S>(&self, reactors: &[ReactorHandle<S>]) -> String {
        for h in reactors {
            let labels = ReactorLabels {
                reactor: h.index().to_string(),
            };
            let s = h.stats();
            self.reactor_ios
                .get_or_create(&labels)
                .set(s.counters.ios as i64);
            self.reactor_io_errors
                .get_or_create(&labels)
                .set(s.counters.io_errors as i64);
            self.reactor_cpu
                .get_or_create(&labels)
                .set(s.cpu_ns as f64 / 1e9);
            self.reactor_busy
                .get_or_create(&labels)
                .set(s.busy_pct() / 100.0);
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }
}
