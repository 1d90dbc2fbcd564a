//! Finding a PCI function's IOMMU group through sysfs, and checking what can be checked
//! before any VFIO call: the function exists, is bound to vfio-pci, has a group whose other
//! functions let it be viable, and /dev/vfio exists.

use std::path::Path;

use super::{SysPaths, VfioError};

/// Name of the last path component a symlink points at (`.../drivers/vfio-pci` -> vfio-pci).
pub(super) fn link_name(path: &Path) -> Option<String> {
    let target = std::fs::read_link(path).ok()?;
    Some(target.file_name()?.to_string_lossy().into_owned())
}

/// Finds the function's IOMMU group through sysfs and checks what can be checked before any
/// VFIO call: the function exists, is bound to vfio-pci, has a group, and /dev/vfio exists.
pub fn locate(bdf: &str, paths: &SysPaths) -> Result<u32, VfioError> {
    let dev = paths.sysfs.join("bus/pci/devices").join(bdf);
    if !dev.exists() {
        return Err(VfioError::NoSuchDevice {
            bdf: bdf.into(),
            path: dev,
        });
    }
    let driver = link_name(&dev.join("driver"));
    if driver.as_deref() != Some("vfio-pci") {
        return Err(VfioError::NotBoundToVfio {
            bdf: bdf.into(),
            driver,
        });
    }
    let group = link_name(&dev.join("iommu_group"))
        .and_then(|g| g.parse::<u32>().ok())
        .ok_or_else(|| VfioError::NoIommuGroup { bdf: bdf.into() })?;
    for node in [
        paths.dev.join("vfio/vfio"),
        paths.dev.join(format!("vfio/{group}")),
    ] {
        if !node.exists() {
            return Err(VfioError::VfioMissing { path: node });
        }
    }
    Ok(group)
}

/// Functions in `group` that keep it from being viable: bound to a driver other than
/// vfio-pci or pci-stub (bridges on pcieport are allowed). "ADDR (driver)" each.
pub fn group_offenders(group: u32, paths: &SysPaths) -> Vec<String> {
    let dir = paths
        .sysfs
        .join(format!("kernel/iommu_groups/{group}/devices"));
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let driver = link_name(&e.path().join("driver"))?;
            (!matches!(driver.as_str(), "vfio-pci" | "pci-stub" | "pcieport"))
                .then(|| format!("{name} ({driver})"))
        })
        .collect();
    out.sort();
    out
}
