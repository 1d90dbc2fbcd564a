//! Host-side tests of the VFIO driver: everything that needs no IOMMU (device-string
//! parsing, the sysfs checks and their messages on a fake sysfs tree, Identify decoding).
//! The driver against a real controller is tested in a QEMU guest by scripts/vfio-guest.

use std::os::unix::fs::symlink;
use std::path::Path;

use super::sysfs::link_name;
use super::*;

#[test]
fn pci_addresses_parse_and_normalise() {
    let c = VfioConfig::parse("0000:00:04.0").unwrap();
    assert_eq!(c.bdf, "0000:00:04.0");
    assert_eq!(c.to_string(), "vfio:0000:00:04.0");
    assert_eq!(VfioConfig::parse("00:1F.7").unwrap().bdf, "0000:00:1f.7");
    assert_eq!(
        VfioConfig::parse("abcd:ff:1f.7").unwrap().bdf,
        "abcd:ff:1f.7"
    );
    for bad in [
        "",
        "04.0",
        "0000:00:04",
        "0000:00:20.0",
        "0000:00:04.8",
        "00:0g.0",
        "1:2:3.4",
    ] {
        let e = VfioConfig::parse(bad).unwrap_err();
        assert!(
            e.contains("PCI address") && e.contains("0000:00:04.0"),
            "{bad}: {e}"
        );
    }
}

/// A fake sysfs and /dev: a function at `bdf` bound to `driver` in IOMMU group 7.
fn fake_tree(
    root: &Path,
    bdf: &str,
    driver: Option<&str>,
    group: bool,
    dev_vfio: bool,
) -> SysPaths {
    let sysfs = root.join("sys");
    let dev = root.join("dev");
    let devdir = sysfs.join("devices/pci0000:00").join(bdf);
    std::fs::create_dir_all(&devdir).unwrap();
    std::fs::create_dir_all(sysfs.join("bus/pci/devices")).unwrap();
    symlink(&devdir, sysfs.join("bus/pci/devices").join(bdf)).unwrap();
    if let Some(d) = driver {
        let drv = sysfs.join("bus/pci/drivers").join(d);
        std::fs::create_dir_all(&drv).unwrap();
        symlink(&drv, devdir.join("driver")).unwrap();
    }
    if group {
        let g = sysfs.join("kernel/iommu_groups/7");
        std::fs::create_dir_all(g.join("devices")).unwrap();
        symlink(&g, devdir.join("iommu_group")).unwrap();
        symlink(&devdir, g.join("devices").join(bdf)).unwrap();
    }
    std::fs::create_dir_all(&dev).unwrap();
    if dev_vfio {
        std::fs::create_dir_all(dev.join("vfio")).unwrap();
        std::fs::write(dev.join("vfio/vfio"), b"").unwrap();
        std::fs::write(dev.join("vfio/7"), b"").unwrap();
    }
    SysPaths { sysfs, dev }
}

#[test]
fn a_missing_function_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let paths = fake_tree(dir.path(), "0000:00:04.0", Some("vfio-pci"), true, true);
    let e = locate("0000:00:05.0", &paths).unwrap_err().to_string();
    assert!(
        e.contains("no PCI function 0000:00:05.0") && e.contains("ls /sys/bus/pci/devices"),
        "{e}"
    );
}

#[test]
fn a_function_bound_elsewhere_says_how_to_rebind() {
    let dir = tempfile::tempdir().unwrap();
    let paths = fake_tree(dir.path(), "0000:00:04.0", Some("nvme"), true, true);
    let e = locate("0000:00:04.0", &paths).unwrap_err();
    assert!(matches!(&e, VfioError::NotBoundToVfio { driver: Some(d), .. } if d == "nvme"));
    let e = e.to_string();
    assert!(
        e.contains("not bound to vfio-pci (it is bound to nvme)"),
        "{e}"
    );
    assert!(
        e.contains("/sys/bus/pci/devices/0000:00:04.0/driver/unbind"),
        "{e}"
    );
    assert!(e.contains("/sys/bus/pci/drivers/vfio-pci/bind"), "{e}");

    let dir = tempfile::tempdir().unwrap();
    let paths = fake_tree(dir.path(), "0000:00:04.0", None, true, true);
    let e = locate("0000:00:04.0", &paths).unwrap_err().to_string();
    assert!(
        e.contains("it has no driver") && e.contains("new_id"),
        "{e}"
    );
    assert!(!e.contains("unbind"), "nothing to unbind: {e}");
}

#[test]
fn no_iommu_group_asks_for_an_iommu() {
    let dir = tempfile::tempdir().unwrap();
    let paths = fake_tree(dir.path(), "0000:00:04.0", Some("vfio-pci"), false, true);
    let e = locate("0000:00:04.0", &paths).unwrap_err().to_string();
    assert!(
        e.contains("no IOMMU group") && e.contains("intel_iommu=on"),
        "{e}"
    );
}

#[test]
fn an_absent_dev_vfio_asks_for_the_modules() {
    let dir = tempfile::tempdir().unwrap();
    let paths = fake_tree(dir.path(), "0000:00:04.0", Some("vfio-pci"), true, false);
    let e = locate("0000:00:04.0", &paths).unwrap_err().to_string();
    assert!(
        e.contains("vfio/vfio is missing") && e.contains("modprobe vfio-pci"),
        "{e}"
    );
    // With everything in place, the group number comes back.
    let dir = tempfile::tempdir().unwrap();
    let paths = fake_tree(dir.path(), "0000:00:04.0", Some("vfio-pci"), true, true);
    assert_eq!(locate("0000:00:04.0", &paths).unwrap(), 7);
}

#[test]
fn this_host_gets_the_error_its_setup_calls_for() {
    // Opening through the device string on the real /sys and /dev: the build machines have no
    // IOMMU, so this fails, with the message for the first thing missing here.
    let bdf = "0000:00:04.0";
    let device: crate::DeviceConfig = format!("vfio:{bdf}").parse().unwrap();
    let dev = Path::new("/sys/bus/pci/devices").join(bdf);
    let driver = link_name(&dev.join("driver"));
    let expected = if !dev.exists() {
        "no PCI function 0000:00:04.0"
    } else if driver.as_deref() != Some("vfio-pci") {
        "is not bound to vfio-pci"
    } else if !dev.join("iommu_group").exists() {
        "has no IOMMU group"
    } else if !Path::new("/dev/vfio/vfio").exists() {
        "/dev/vfio/vfio is missing"
    } else {
        // A machine where the function is ready for VFIO: opening may succeed.
        return;
    };
    let e = device.open().err().expect("cannot open").to_string();
    assert!(e.contains(expected), "expected {expected:?} in: {e}");
}

#[test]
fn group_offenders_lists_functions_bound_to_other_drivers() {
    let dir = tempfile::tempdir().unwrap();
    let paths = fake_tree(dir.path(), "0000:01:01.0", Some("vfio-pci"), true, true);
    let other = paths.sysfs.join("devices/pci0000:00/0000:01:02.0");
    std::fs::create_dir_all(&other).unwrap();
    let drv = paths.sysfs.join("bus/pci/drivers/serial");
    std::fs::create_dir_all(&drv).unwrap();
    symlink(&drv, other.join("driver")).unwrap();
    symlink(
        &other,
        paths
            .sysfs
            .join("kernel/iommu_groups/7/devices/0000:01:02.0"),
    )
    .unwrap();
    assert_eq!(
        group_offenders(7, &paths),
        vec!["0000:01:02.0 (serial)".to_string()]
    );
    let e = VfioError::GroupNotViable {
        bdf: "0000:01:01.0".into(),
        group: 7,
        others: group_offenders(7, &paths),
    }
    .to_string();
    assert!(
        e.contains("group 7") && e.contains("not viable") && e.contains("0000:01:02.0 (serial)"),
        "{e}"
    );
}

#[test]
fn pin_failures_name_the_memlock_limit() {
    let e = VfioError::PinFailed {
        len_bytes: 1 << 20,
        memlock_limit_bytes: Some(65536),
        source: std::io::Error::from_raw_os_error(libc::ENOMEM),
    }
    .to_string();
    assert!(
        e.contains("cannot pin 1048576 bytes") && e.contains("65536 bytes"),
        "{e}"
    );
    assert!(e.contains("ulimit -l") && e.contains("CAP_IPC_LOCK"), "{e}");
}

#[test]
fn identify_data_decodes() {
    let mut ctrl = vec![0u8; 4096];
    ctrl[4..12].copy_from_slice(b"hypoll0 ");
    ctrl[24..36].copy_from_slice(b"QEMU NVMe Ct");
    ctrl[64..72].copy_from_slice(b"7.2.22  ");
    ctrl[77] = 7;
    ctrl[516..520].copy_from_slice(&256u32.to_le_bytes());
    let id = ControllerIdentity::parse(&ctrl, 4096);
    assert_eq!(id.serial, "hypoll0");
    assert_eq!(id.model, "QEMU NVMe Ct");
    assert_eq!(id.firmware, "7.2.22");
    assert_eq!(id.mdts_bytes, Some(512 << 10));
    assert_eq!(id.namespaces, 256);
    // ONCS 0: neither Dataset Management nor Write Zeroes.
    assert!(!id.supports(Opcode::WriteZeroes) && !id.supports(Opcode::DatasetManagement));
    assert!(id.supports(Opcode::Flush));
    ctrl[520] = 1 << 3;
    let id = ControllerIdentity::parse(&ctrl, 4096);
    assert!(id.supports(Opcode::WriteZeroes) && !id.supports(Opcode::DatasetManagement));
    ctrl[520] = 1 << 2;
    assert!(ControllerIdentity::parse(&ctrl, 4096).supports(Opcode::DatasetManagement));
    ctrl[77] = 0;
    assert_eq!(ControllerIdentity::parse(&ctrl, 4096).mdts_bytes, None);

    let mut ns = vec![0u8; 4096];
    ns[0..8].copy_from_slice(&131072u64.to_le_bytes());
    ns[25] = 1; // two formats
    ns[26] = 1; // using format 1
    ns[128..132].copy_from_slice(&(9u32 << 16).to_le_bytes());
    ns[132..136].copy_from_slice(&(12u32 << 16).to_le_bytes());
    assert_eq!(parse_identify_namespace(&ns), Ok((131072, 4096)));
    ns[26] = 0;
    assert_eq!(parse_identify_namespace(&ns), Ok((131072, 512)));
    ns[128..132].copy_from_slice(&((9u32 << 16) | 8).to_le_bytes());
    assert!(parse_identify_namespace(&ns)
        .unwrap_err()
        .contains("metadata"));
    ns[26] = 3;
    assert!(parse_identify_namespace(&ns).unwrap_err().contains("NLBAF"));
}
