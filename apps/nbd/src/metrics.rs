//! NBD's Prometheus metrics: the front end's shared families (`hypoll_frontend::metrics`)
//! under the `hypoll_nbd` prefix, and each reactor's handles for every export and NBD op.

pub use hypoll_frontend::metrics::{
    ConnMetrics, ExportLabels, IoLabels, IoMetrics, Metrics, ReactorLabels,
};
pub use hypoll_frontend::Endpoint;

use crate::session::Op;

/// What every NBD metric's name starts with (`hypoll_nbd_requests_total`).
pub const PREFIX: &str = "hypoll_nbd";

/// The metrics of an NBD server.
pub fn nbd_metrics() -> Metrics {
    Metrics::new(PREFIX, "NBD")
}

/// One reactor's handles for each NBD op on `export`, indexed by `Op as usize`.
pub fn io_per_op(m: &Metrics, reactor: usize, export: &str) -> [IoMetrics; Op::ALL.len()] {
    Op::ALL.map(|op| m.io(reactor, export, op.name()))
}
