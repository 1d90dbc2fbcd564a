//! How to run an NBD server ([`ServerConfig`]), the checks it must pass before anything
//! starts, and why a server does not start ([`ServeError`]).

use std::ops::RangeInclusive;

use hypoll_frontend::{
    ListenAddr, ServiceConfig, ServiceConfigError, StartError, QUEUE_DEPTH_DEFAULT,
};
use hypoll_nvme::DeviceConfig;
use hypoll_reactor::{Device, DeviceError};

use crate::proto;

/// Bounds of [`ServerConfig::request_bytes_max`] (a multiple of [`REQUEST_BYTES_ALIGN`]).
pub const REQUEST_BYTES_MAX_RANGE: RangeInclusive<u32> = 4096..=1 << 30;
/// What [`ServerConfig::request_bytes_max`] must be a multiple of.
pub const REQUEST_BYTES_ALIGN: u32 = 4096;

const _: () = assert!(crate::session::REQUEST_BYTES_MAX_DEFAULT <= *REQUEST_BYTES_MAX_RANGE.end());
const _: () =
    assert!(*REQUEST_BYTES_MAX_RANGE.start() <= crate::session::REQUEST_BYTES_MAX_DEFAULT);

/// Items of an export's spec that are the export's own, not its device's: either makes the
/// export read-only (`disk=uring:/img,ro`).
pub const READ_ONLY_ITEMS: [&str; 2] = ["ro", "readonly"];

/// The item of an export's spec that restricts it to named clients:
/// `clients=NAME+NAME`, each a DNS name the client's certificate must hold among its subject
/// alternative names (`secret=emu:dram,size=1G,clients=alice.example+bob.example`).
pub const CLIENTS_KEY: &str = "clients";

/// An export's spec, split into its device's string and the export's own settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSpec {
    /// What `Device::open` takes.
    pub device: String,
    /// Clients may read, never write, trim or zero.
    pub read_only: bool,
    /// Only clients whose certificate names one of these may use it (checked as the server
    /// starts: [`ServeError::BadClientName`]).
    pub clients: Option<Vec<String>>,
}

impl ExportSpec {
    /// Takes the export's own items ([`READ_ONLY_ITEMS`], [`CLIENTS_KEY`]) out of `spec`,
    /// wherever they stand after the device's kind; the rest is the device's.
    pub fn parse(spec: &str) -> ExportSpec {
        let mut items = spec.split(',');
        let mut device = items.next().unwrap_or_default().to_string();
        let mut read_only = false;
        let mut clients = None;
        for item in items {
            let clients_list = item
                .split_once('=')
                .filter(|(k, _)| k.trim() == CLIENTS_KEY)
                .map(|(_, v)| v.trim());
            if READ_ONLY_ITEMS.contains(&item.trim()) {
                read_only = true;
            } else if let Some(list) = clients_list {
                clients = Some(list.split('+').map(|n| n.trim().to_string()).collect());
            } else {
                device.push(',');
                device.push_str(item);
            }
        }
        ExportSpec {
            device,
            read_only,
            clients,
        }
    }

    /// Opens the export's device; a read-only export (this spec's `ro`, or the whole
    /// server's `server_read_only`) opens it without write access where the device is a
    /// file or block device ([`DeviceConfig::read_only`]), so a file the server may only
    /// read can be exported, and nothing can change it through the server.
    pub fn open_device(&self, server_read_only: bool) -> Result<Device, DeviceError> {
        let mut config: DeviceConfig = self.device.parse()?;
        if server_read_only || self.read_only {
            config = config.read_only();
        }
        let ctrl = config.open().map_err(|source| DeviceError::Open {
            spec: self.device.clone(),
            source,
        })?;
        Ok(Device::new(ctrl))
    }
}

/// How to run a server: its exports and NBD's own limits, beside the settings every front
/// end shares.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// (name, spec), in order; the first is the default export. A spec is a device string,
    /// with the export's own items among its own ([`ExportSpec`]).
    pub exports: Vec<(String, String)>,
    /// Every export is read-only, whatever its spec says.
    pub read_only: bool,
    pub request_bytes_max: u32,
    pub queue_depth: usize,
    /// Where to listen, the reactors, and the bounds on what clients may hold.
    pub service: ServiceConfig,
}

impl ServerConfig {
    pub fn new(exports: Vec<(String, String)>, listen: ListenAddr) -> ServerConfig {
        ServerConfig {
            exports,
            read_only: false,
            request_bytes_max: crate::session::REQUEST_BYTES_MAX_DEFAULT,
            queue_depth: QUEUE_DEPTH_DEFAULT,
            service: ServiceConfig::new(listen),
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
        self.service.check()?;
        self.service
            .tls
            .check()
            .map_err(|e| ServeError::Start(StartError::Tls(e)))?;
        Ok(())
    }

    /// Whether `name` can name an export.
    pub(crate) fn export_name_ok(name: &str) -> bool {
        !name.is_empty() && name.len() <= proto::STRING_BYTES_MAX
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
    #[error(
        "export {export}: client name {name:?}: expected a DNS name, as certificates hold them"
    )]
    BadClientName { export: String, name: String },
    #[error(
        "export {0}: restricted to named clients, which needs TLS with client certificates \
         verified (tls_verify_peer)"
    )]
    ClientsWithoutVerify(String),
    #[error("export {name}: {source}")]
    Device {
        name: String,
        #[source]
        source: DeviceError,
    },
    #[error("request_bytes_max {0}: expected a multiple of 4096 from 4096 to 1 GiB")]
    RequestBytes(u32),
    #[error(transparent)]
    Service(#[from] ServiceConfigError),
    #[error(transparent)]
    Start(#[from] StartError),
}

impl ServeError {
    /// The [`ServerConfig`] field this error refuses, for errors that refuse one setting's
    /// value: a front end that took the value from a flag or a file names it as the user
    /// wrote it.
    pub fn setting(&self) -> Option<&'static str> {
        match self {
            ServeError::NoExports => Some("exports"),
            ServeError::RequestBytes(_) => Some("request_bytes_max"),
            ServeError::Service(e) => Some(e.setting()),
            ServeError::Start(e) => e.setting(),
            _ => None,
        }
    }
}
