//! `hypoll serve`'s engine: exports (one device each) served over NBD by a set of reactors.
//!
//! [`Server::start`] checks the configuration, opens each export's device, and starts a
//! [`Service`] of the shared front-end machinery (`hypoll_frontend`: listener, per-reactor
//! shards, bounds, coalescing, metrics, graceful stop) whose reactors each carry NBD's state
//! (`shard.rs`) and run its requests (`pipeline.rs`).

use std::net::SocketAddr;
use std::sync::Arc;

use hypoll_frontend::{HasShard, Service, Shard};
use hypoll_nvme::Opcode;
use hypoll_reactor::{Device, InitError, Reactor, ReactorHandle};

use crate::metrics::nbd_metrics;
use crate::proto;
use crate::session::{ExportInfo, Limits};
use crate::shard::{Access, Nbd};

pub use crate::config::{
    ExportSpec, ServeError, ServerConfig, CLIENTS_KEY, READ_ONLY_ITEMS, REQUEST_BYTES_ALIGN,
    REQUEST_BYTES_MAX_RANGE,
};
use hypoll_frontend::client_name_ok;
pub use hypoll_frontend::{
    ListenAddr, ServiceConfig, ServiceConfigError, StopReport, COALESCE_NS_DEFAULT,
    COALESCE_NS_MAX, CONNECTIONS_MAX_DEFAULT, CONNECTION_BYTES_MAX_DEFAULT,
    CONNECTION_BYTES_MAX_RANGE, DRAIN_TIMEOUT, FLUSH_TIMEOUT, HANDSHAKE_TIMEOUT_DEFAULT,
    IDLE_SPIN_NS_DEFAULT, LARGE_INPUTS_PER_REACTOR, LINGER_MS, QUEUE_DEPTH_DEFAULT,
    READ_BYTES_PER_POLL, REQUESTS_INFLIGHT_MAX, REQUEST_STALL_TIMEOUT_DEFAULT,
    TLS_BUFFER_BYTES_MAX, UNIX_MODE_DEFAULT, UNIX_MODE_MAX,
};
pub use hypoll_frontend::{TlsConfig, TlsError, TlsMode, UnixOwner};

/// A running server. [`Server::stop`] stops it gracefully; dropping it stops it too.
pub struct Server<S: HasShard<Nbd> = Shard<Nbd>> {
    service: Service<Nbd, S>,
    exports: Arc<[ExportInfo]>,
    /// Each export's device as it describes itself, for the operator only.
    devices: Vec<String>,
}

/// Builds what clients see of an export from its device.
fn export_info(name: &str, device: &Device, read_only: bool) -> ExportInfo {
    let ns = device.ctrl.namespace();
    let mut info = ExportInfo {
        name: name.to_string(),
        // The device string can name paths and modes on the server's machine: clients see
        // the name only.
        description: name.to_string(),
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
        restricted: false,
    };
    if read_only {
        // Flush stays offered (harmless, and clients that flush before they close need not
        // be told no); nothing that writes is.
        info.flags &=
            !(proto::TFLAG_SEND_FUA | proto::TFLAG_SEND_TRIM | proto::TFLAG_SEND_WRITE_ZEROES);
        info.flags |= proto::TFLAG_READ_ONLY;
    }
    info
}

/// What each export's spec says beyond its device, in export order.
struct Exports {
    devices: Vec<Device>,
    infos: Vec<ExportInfo>,
    /// The clients each export is restricted to, if it is.
    clients: Vec<Option<Vec<String>>>,
}

/// Opens each export's device, in order, refusing bad and duplicate names; every export
/// is read-only where `read_only` says so; an export restricted to named clients needs
/// client certificates verified (`verify_peer`).
fn open_exports(
    exports: &[(String, String)],
    read_only: bool,
    verify_peer: bool,
) -> Result<Exports, ServeError> {
    let mut devices = Vec::new();
    let mut infos: Vec<ExportInfo> = Vec::new();
    let mut clients = Vec::new();
    for (name, spec) in exports {
        if !ServerConfig::export_name_ok(name) {
            return Err(ServeError::BadExportName(name.clone()));
        }
        if infos.iter().any(|i| &i.name == name) {
            return Err(ServeError::DuplicateExport(name.clone()));
        }
        let spec = ExportSpec::parse(spec);
        if let Some(names) = &spec.clients {
            if let Some(bad) = names.iter().find(|n| !client_name_ok(n)) {
                return Err(ServeError::BadClientName {
                    export: name.clone(),
                    name: bad.clone(),
                });
            }
            if !verify_peer {
                return Err(ServeError::ClientsWithoutVerify(name.clone()));
            }
        }
        let device = spec
            .open_device(read_only)
            .map_err(|source| ServeError::Device {
                name: name.clone(),
                source,
            })?;
        let mut info = export_info(name, &device, read_only || spec.read_only);
        info.restricted = spec.clients.is_some();
        infos.push(info);
        devices.push(device);
        clients.push(spec.clients);
    }
    assert_eq!(devices.len(), exports.len());
    assert_eq!(clients.len(), exports.len());
    Ok(Exports {
        devices,
        infos,
        clients,
    })
}

impl Server {
    /// Opens the exports' devices, starts the reactors, the listener and the metrics
    /// endpoint. Returns once clients can connect.
    pub fn start(cfg: ServerConfig) -> Result<Server, ServeError> {
        Server::start_with(cfg, |_r, shard| Ok(shard))
    }
}

impl<S: HasShard<Nbd>> Server<S> {
    /// As [`Server::start`], on reactors whose state `S` holds NBD's shard beside other
    /// front ends' parts: `compose` makes each reactor's state from NBD's shard there,
    /// after the exports' devices are attached (export `i` is `DeviceId` `i` on every
    /// reactor, for the other parts to serve too).
    pub fn start_with(
        cfg: ServerConfig,
        compose: impl Fn(&mut Reactor<S>, Shard<Nbd>) -> Result<S, InitError> + Send + Sync + 'static,
    ) -> Result<Server<S>, ServeError> {
        cfg.check()?;
        let tls = &cfg.service.tls;
        let verify_peer = tls.verify_peer && tls.mode != TlsMode::Off;
        let Exports {
            devices,
            infos,
            clients,
        } = open_exports(&cfg.exports, cfg.read_only, verify_peer)?;
        let described = devices.iter().map(|d| d.ctrl.describe()).collect();
        let infos: Arc<[ExportInfo]> = infos.into();
        let limits = Limits {
            request_bytes_max: cfg.request_bytes_max,
            ..Limits::default()
        };
        let names = infos.iter().map(|i| i.name.clone()).collect();
        let queue_depth = cfg.queue_depth;
        let access = Access {
            tls: cfg.service.tls.mode,
            clients: clients.into(),
        };
        let shard_infos = infos.clone();
        let service = Service::start_with(
            &cfg.service,
            Arc::new(nbd_metrics()),
            names,
            move |r, metrics, builder| {
                let nbd = Nbd::attach(
                    r,
                    &devices,
                    &shard_infos,
                    limits,
                    access.clone(),
                    queue_depth,
                    metrics,
                )?;
                let shard = builder.build(r, nbd)?;
                compose(r, shard)
            },
        )?;
        Ok(Server {
            service,
            exports: infos,
            devices: described,
        })
    }

    /// Where clients connect (the real port when port 0 was asked for).
    pub fn local_addr(&self) -> &ListenAddr {
        self.service.local_addr()
    }

    /// Where the metrics endpoint listens, if it runs.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.service.metrics_addr()
    }

    pub fn exports(&self) -> &[ExportInfo] {
        &self.exports
    }

    /// Each export's device as it describes itself (its kind, and paths or I/O modes on
    /// this machine), in [`Server::exports`] order: for the operator, never sent to
    /// clients.
    pub fn export_devices(&self) -> &[String] {
        &self.devices
    }

    /// Connections open now.
    pub fn connections_open(&self) -> usize {
        self.service.connections_open()
    }

    /// The reactors' handles (for the other front ends of a composed server).
    pub fn handles(&self) -> Option<&Arc<[ReactorHandle<S>]>> {
        self.service.handles()
    }

    /// Stops gracefully: stops accepting, lets every connection finish the requests it has
    /// in flight and send their replies (reading no new ones), closes it, flushes every
    /// export, then stops the reactors.
    pub fn stop(self) -> StopReport {
        self.service.stop()
    }
}

#[cfg(test)]
mod tests {
    use hypoll_frontend::ServiceConfigError;
    use hypoll_nvme::ConfigError;
    use hypoll_reactor::DeviceError;

    use super::*;

    #[test]
    fn exports_advertise_what_every_device_does() {
        let device = Device::open("emu:dram,size=64M,lba=4096").unwrap();
        let info = export_info("mem", &device, false);
        assert_eq!(info.size_bytes, 64 << 20);
        assert_eq!(info.description, "mem", "the name, never the device string");
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

    #[test]
    fn a_read_only_export_says_so_and_offers_flush_but_nothing_that_writes() {
        let device = Device::open("emu:dram,size=64M").unwrap();
        let flags = export_info("ro", &device, true).flags;
        assert_ne!(flags & proto::TFLAG_READ_ONLY, 0);
        assert_ne!(flags & proto::TFLAG_SEND_FLUSH, 0);
        for writes in [
            proto::TFLAG_SEND_FUA,
            proto::TFLAG_SEND_TRIM,
            proto::TFLAG_SEND_WRITE_ZEROES,
        ] {
            assert_eq!(flags & writes, 0, "{writes:#x}");
        }
    }

    #[test]
    fn an_exports_own_items_are_taken_out_of_its_device_string() {
        let spec = ExportSpec::parse("emu:dram,ro,size=4M");
        assert_eq!(
            (spec.device.as_str(), spec.read_only),
            ("emu:dram,size=4M", true)
        );
        let spec = ExportSpec::parse("uring:/img, readonly");
        assert_eq!((spec.device.as_str(), spec.read_only), ("uring:/img", true));
        let spec = ExportSpec::parse("emu:dram,size=4M");
        assert_eq!(
            (spec.device.as_str(), spec.read_only),
            ("emu:dram,size=4M", false)
        );
        // The device's kind is never taken for an item.
        assert_eq!(ExportSpec::parse("ro").device, "ro");
        let spec = ExportSpec::parse("null,clients=a.test+b.test,ro");
        assert_eq!(spec.device, "null");
        assert_eq!(spec.clients, Some(vec!["a.test".into(), "b.test".into()]));
        assert_eq!(ExportSpec::parse("null").clients, None);
    }

    /// Without verified client certificates nobody could be named: refused at start, as is
    /// a name no certificate can hold.
    #[test]
    fn an_export_restricted_to_named_clients_needs_verified_certificates_and_good_names() {
        let listen: ListenAddr = "127.0.0.1:0".parse().unwrap();
        let one = |spec: &str| vec![("s".to_string(), spec.to_string())];
        let cfg = ServerConfig::new(one("null,clients=alice.test"), listen.clone());
        assert!(matches!(
            Server::start(cfg),
            Err(ServeError::ClientsWithoutVerify(_))
        ));
        let cfg = ServerConfig::new(one("null,clients=alice.test+not a name"), listen);
        let e = Server::start(cfg).err().unwrap();
        assert!(
            matches!(&e, ServeError::BadClientName { name, .. } if name == "not a name"),
            "{e}"
        );
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
        let info = export_info("bare", &device, false);
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
        // The device string's own error, kept as the source.
        let e = Server::start(cfg(vec![("a", "nonsense")])).err().unwrap();
        assert!(
            matches!(
                &e,
                ServeError::Device {
                    source: DeviceError::Config(ConfigError::UnknownDevice { .. }),
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(std::error::Error::source(&e).is_some());
        let mut c = cfg(vec![("a", "null")]);
        c.request_bytes_max = 1000;
        assert!(matches!(
            Server::start(c),
            Err(ServeError::RequestBytes(1000))
        ));
        let mut c = cfg(vec![("a", "null")]);
        c.service.connection_bytes_max = 4096;
        assert!(matches!(
            Server::start(c),
            Err(ServeError::Service(ServiceConfigError::ConnectionBytes(
                4096
            )))
        ));
        let mut c = cfg(vec![("a", "null")]);
        c.service.connections_max = 0;
        assert!(matches!(
            Server::start(c),
            Err(ServeError::Service(ServiceConfigError::Connections(0)))
        ));
    }

    /// A library error names the setting, never a flag of some front end: the binary maps
    /// the one to the other.
    #[test]
    fn a_refused_setting_is_named_by_its_field() {
        let listen: ListenAddr = "127.0.0.1:0".parse().unwrap();
        let null = vec![("a".to_string(), "null".to_string())];
        let mut cases = Vec::new();
        cases.push((ServerConfig::new(Vec::new(), listen.clone()), "exports"));
        let mut c = ServerConfig::new(null.clone(), listen.clone());
        c.request_bytes_max = 1000;
        cases.push((c, "request_bytes_max"));
        let mut c = ServerConfig::new(null.clone(), listen.clone());
        c.service.connections_max = 0;
        cases.push((c, "connections_max"));
        let mut c = ServerConfig::new(null, listen);
        c.service.connection_bytes_max = 4096;
        cases.push((c, "connection_bytes_max"));
        for (c, field) in cases {
            let e = Server::start(c).err().unwrap();
            assert_eq!(e.setting(), Some(field), "{e}");
            let text = e.to_string();
            assert!(text.contains(field) && !text.contains("--"), "{text}");
        }
    }
}
