//! An NVMe/TCP server of its own: one [`Target`] whose namespaces are the exports, served
//! by a [`Service`] of the shared front-end machinery (listener, per-reactor shards,
//! bounds, coalescing, metrics, graceful stop) whose reactors each carry NVMe/TCP's state
//! (`shard.rs`) and run its commands (`pipeline.rs`).

use std::net::SocketAddr;
use std::sync::Arc;

use hypoll_frontend::metrics::Metrics;
use hypoll_frontend::{ListenAddr, Service, ServiceConfig, StopReport};
use hypoll_nvme::Opcode;
use hypoll_reactor::Device;

use crate::config::{ConfigError, DiscoveryEntry, Limits, NamespaceConfig, TargetConfig};
use crate::shard::Nvmf;
use crate::target::Target;

/// What every NVMe/TCP metric's name starts with (`hypoll_nvmf_requests_total`).
pub const METRICS_PREFIX: &str = "hypoll_nvmf";
/// The port NVMe/TCP hosts connect to unless told otherwise (IANA's for NVMe/TCP).
pub const PORT_DEFAULT: u16 = 4420;
/// The subsystem's NQN unless configured.
pub const SUBSYSTEM_NQN_DEFAULT: &str = "nqn.2026-12.io.hypoll:serve";

/// The metrics of an NVMe/TCP server.
pub fn nvmf_metrics() -> Metrics {
    Metrics::new(METRICS_PREFIX, "NVMe/TCP")
}

/// One export: a device served as a namespace.
#[derive(Clone)]
pub struct NvmfExport {
    pub name: String,
    pub device: Device,
    pub read_only: bool,
}

/// How to run a server.
#[derive(Clone)]
pub struct NvmfConfig {
    pub subsystem_nqn: String,
    /// The namespaces, in order: namespace ID `i + 1` is `exports[i]`.
    pub exports: Vec<NvmfExport>,
    pub queue_depth: usize,
    pub limits: Limits,
    pub service: ServiceConfig,
}

impl NvmfConfig {
    pub fn new(exports: Vec<NvmfExport>, listen: ListenAddr) -> NvmfConfig {
        NvmfConfig {
            subsystem_nqn: SUBSYSTEM_NQN_DEFAULT.into(),
            exports,
            queue_depth: hypoll_frontend::QUEUE_DEPTH_DEFAULT,
            limits: Limits::default(),
            service: ServiceConfig::new(listen),
        }
    }
}

/// Why a server did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NvmfError {
    #[error("exports: none given; a subsystem needs at least one namespace")]
    NoExports,
    #[error(
        "limit queue_entries_max {0}: at most {max}, the commands a connection may have in \
         flight",
        max = hypoll_frontend::REQUESTS_INFLIGHT_MAX
    )]
    QueueEntries(u16),
    #[error(transparent)]
    Target(#[from] ConfigError),
    #[error(transparent)]
    Service(#[from] hypoll_frontend::ServiceConfigError),
    #[error(transparent)]
    Start(#[from] hypoll_frontend::StartError),
}

/// A namespace's facts from its export's device.
pub fn namespace_of(export: &NvmfExport) -> NamespaceConfig {
    let ctrl = &export.device.ctrl;
    let ns = ctrl.namespace();
    NamespaceConfig {
        block_bytes: ns.lba_size_bytes,
        blocks: ns.capacity_lbas,
        read_only: export.read_only,
        // Every device takes a flush; one without a cache answers it at once.
        volatile_cache: true,
        write_zeroes: ctrl.supports(Opcode::WriteZeroes),
        deallocate: ctrl.supports(Opcode::DatasetManagement),
        uuid: NamespaceConfig::uuid_for(&export.name),
    }
}

/// The target a configuration serves, listed in its discovery log at `listen` (a TCP
/// address; a Unix socket is not listed).
pub fn target_of(cfg: &NvmfConfig, listen: &ListenAddr) -> Result<Arc<Target>, NvmfError> {
    if cfg.exports.is_empty() {
        return Err(NvmfError::NoExports);
    }
    if usize::from(cfg.limits.queue_entries_max) > hypoll_frontend::REQUESTS_INFLIGHT_MAX {
        return Err(NvmfError::QueueEntries(cfg.limits.queue_entries_max));
    }
    let mut t = TargetConfig::new(&cfg.subsystem_nqn);
    t.namespaces = cfg.exports.iter().map(namespace_of).collect();
    t.limits = cfg.limits;
    if let ListenAddr::Tcp(addr) = listen {
        t.discovery = vec![DiscoveryEntry {
            addr: *addr,
            portid: 1,
        }];
    }
    Ok(Target::new(t)?)
}

/// A running server. [`NvmfServer::stop`] stops it gracefully; dropping it stops it too.
pub struct NvmfServer {
    service: Service<Nvmf>,
    target: Arc<Target>,
}

impl NvmfServer {
    /// Builds the target, starts the reactors (each attaching every export's device), the
    /// listener and the metrics endpoint. Returns once hosts can connect.
    pub fn start(cfg: NvmfConfig) -> Result<NvmfServer, NvmfError> {
        cfg.service.check()?;
        let target = target_of(&cfg, &cfg.service.listen)?;
        let names: Vec<String> = cfg.exports.iter().map(|e| e.name.clone()).collect();
        let devices: Vec<Device> = cfg.exports.iter().map(|e| e.device.clone()).collect();
        let shard_target = target.clone();
        let shard_names = names.clone();
        let depth = cfg.queue_depth;
        let service = Service::start(
            &cfg.service,
            Arc::new(nvmf_metrics()),
            names,
            move |r, metrics| {
                Ok(Nvmf::attach(
                    r,
                    shard_target.clone(),
                    &devices,
                    &shard_names,
                    depth,
                    metrics,
                )?)
            },
        )?;
        Ok(NvmfServer { service, target })
    }

    /// Where hosts connect (the real port when port 0 was asked for).
    pub fn local_addr(&self) -> &ListenAddr {
        self.service.local_addr()
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.service.metrics_addr()
    }

    pub fn subsystem_nqn(&self) -> &str {
        self.target.subsystem_nqn()
    }

    pub fn target(&self) -> &Arc<Target> {
        &self.target
    }

    /// Connections open now.
    pub fn connections_open(&self) -> usize {
        self.service.connections_open()
    }

    /// Stops gracefully: stops accepting, lets every connection finish the commands it has
    /// at the devices and send their answers, closes it, flushes every export, then stops
    /// the reactors.
    pub fn stop(self) -> StopReport {
        self.service.stop()
    }
}
