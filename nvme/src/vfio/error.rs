//! Why a VFIO device could not be opened or driven. Each message names the problem and
//! says what to do about it (bind the function, enable the IOMMU, raise RLIMIT_MEMLOCK...).

use std::path::PathBuf;

use super::ADMIN_TIMEOUT_MS;
use crate::spec::Status;

/// Why a VFIO device could not be opened or driven. Each message says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VfioError {
    #[error(
        "no PCI function {bdf} (nothing at {path}); list functions with `ls /sys/bus/pci/devices`"
    )]
    NoSuchDevice { bdf: String, path: PathBuf },
    #[error(
        "PCI function {bdf} is not bound to vfio-pci ({}); {}",
        match driver { Some(d) => format!("it is bound to {d}"), None => "it has no driver".into() },
        bind_hint(bdf, driver.as_deref())
    )]
    NotBoundToVfio { bdf: String, driver: Option<String> },
    #[error(
        "PCI function {bdf} has no IOMMU group: the kernel runs without an IOMMU; boot with \
         intel_iommu=on (or amd_iommu=on) and an IOMMU enabled in firmware or the VM"
    )]
    NoIommuGroup { bdf: String },
    #[error(
        "{path} is missing: load the VFIO modules (modprobe vfio-pci, which loads vfio and \
         vfio_iommu_type1) and check that /dev is devtmpfs"
    )]
    VfioMissing { path: PathBuf },
    #[error(
        "IOMMU group {group} of {bdf} is not viable: every function in the group must be bound \
         to vfio-pci or to no driver, and these are not: {}; unbind them (echo ADDR > \
         /sys/bus/pci/devices/ADDR/driver/unbind) or bind them to vfio-pci",
        if others.is_empty() { "(none found in sysfs)".to_string() } else { others.join(", ") }
    )]
    GroupNotViable {
        bdf: String,
        group: u32,
        others: Vec<String>,
    },
    #[error(
        "cannot pin {len_bytes} bytes of DMA memory ({source}); RLIMIT_MEMLOCK is {}: raise it \
         (ulimit -l, or LimitMEMLOCK= in a systemd unit) or run with CAP_IPC_LOCK",
        match memlock_limit_bytes { Some(b) => format!("{b} bytes"), None => "unlimited".into() }
    )]
    PinFailed {
        len_bytes: usize,
        memlock_limit_bytes: Option<u64>,
        source: std::io::Error,
    },
    #[error("the IOMMU address space is used up: no room for {len_bytes} more bytes")]
    IovaExhausted { len_bytes: usize },
    #[error("{what}: {source}")]
    Os {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("the controller {0}")]
    Controller(String),
    #[error("admin command {what} failed: {status}")]
    AdminStatus { what: &'static str, status: Status },
    #[error("admin command {what} got no completion within {ADMIN_TIMEOUT_MS} ms")]
    AdminTimeout { what: &'static str },
}

fn bind_hint(bdf: &str, driver: Option<&str>) -> String {
    let bind = format!(
        "bind it with `echo {bdf} > /sys/bus/pci/drivers/vfio-pci/bind` after `modprobe \
         vfio-pci` (if vfio-pci does not know the device, write its vendor and device ids, \
         from /sys/bus/pci/devices/{bdf}/vendor and device, to \
         /sys/bus/pci/drivers/vfio-pci/new_id)"
    );
    match driver {
        Some(d) => format!(
            "first unbind it from {d} with `echo {bdf} > /sys/bus/pci/devices/{bdf}/driver/unbind`, then {bind}"
        ),
        None => bind,
    }
}

impl From<VfioError> for std::io::Error {
    fn from(e: VfioError) -> std::io::Error {
        std::io::Error::other(e)
    }
}

pub(super) fn os(what: &'static str) -> impl FnOnce(std::io::Error) -> VfioError {
    move |source| VfioError::Os { what, source }
}
