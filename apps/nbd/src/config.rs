//! How to run an NBD server ([`ServerConfig`]), the checks it must pass before anything
//! starts, and why a server does not start ([`ServeError`]).

use std::ops::RangeInclusive;

use hypoll_frontend::{
    ListenAddr, ServiceConfig, ServiceConfigError, StartError, QUEUE_DEPTH_DEFAULT,
};
use hypoll_reactor::DeviceError;

use crate::proto;

/// Bounds of [`ServerConfig::request_bytes_max`] (a multiple of [`REQUEST_BYTES_ALIGN`]).
pub const REQUEST_BYTES_MAX_RANGE: RangeInclusive<u32> = 4096..=1 << 30;
/// What [`ServerConfig::request_bytes_max`] must be a multiple of.
pub const REQUEST_BYTES_ALIGN: u32 = 4096;

const _: () = assert!(crate::session::REQUEST_BYTES_MAX_DEFAULT <= *REQUEST_BYTES_MAX_RANGE.end());
const _: () =
    assert!(*REQUEST_BYTES_MAX_RANGE.start() <= crate::session::REQUEST_BYTES_MAX_DEFAULT);

/// How to run a server: its exports and NBD's own limits, beside the settings every front
/// end shares.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// (name, device string), in order; the first is the default export.
    pub exports: Vec<(String, String)>,
    pub request_bytes_max: u32,
    pub queue_depth: usize,
    /// Where to listen, the reactors, and the bounds on what clients may hold.
    pub service: ServiceConfig,
}

impl ServerConfig {
    pub fn new(exports: Vec<(String, String)>, listen: ListenAddr) -> ServerConfig {
        ServerConfig {
            exports,
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
            _ => None,
        }
    }
}
