//! Device strings, parsed in one place: `emu:optane`,
//! `emu:nand,read_us=23,jitter=0.3,seed=7`, `emu:optane,backing=file:/path,size=8G`, `null`,
//! `null,size=1T,lba=4096`, `vfio:0000:00:04.0`.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::clock::Clock;
pub use crate::config::{parse_size_bytes, size_text, ConfigError, DEVICE_KINDS};
use crate::emu::config::profile_names;
use crate::emu::{EmuConfig, EmuController};
use crate::null::{NullConfig, NullController, NULL_KEYS};
use crate::nvmetcp::{NvmeTcpConfig, NvmeTcpController};
use crate::qpair::Controller;
use crate::uring::{UringConfig, UringController};
use crate::vfio::{VfioConfig, VfioController};
use crate::vhost_user::{VhostUserConfig, VhostUserController};

/// A parsed device string.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceConfig {
    Emu(EmuConfig),
    Null(NullConfig),
    Uring(UringConfig),
    /// A PCI NVMe function bound to vfio-pci, driven from user space.
    Vfio(VfioConfig),
    /// A namespace of an NVMe/TCP target, over the network.
    NvmeTcp(NvmeTcpConfig),
    /// A vhost-user-blk back end, as a client (libblkio).
    VhostUser(VhostUserConfig),
}

impl DeviceConfig {
    /// Opens the device on the real clock.
    pub fn open(&self) -> std::io::Result<Arc<dyn Controller>> {
        self.open_with_clock(Clock::Monotonic)
    }

    /// The same device, opened without write access where it is a file or block device of
    /// this host (`uring:`, and `emu:` with `backing=file:`), for a read-only export:
    /// nothing can then change it through this process, and a file the process may only
    /// read can be exported. Other devices are unchanged; the front end refuses a
    /// read-only export's writes itself on every device.
    pub fn read_only(mut self) -> DeviceConfig {
        match &mut self {
            DeviceConfig::Uring(cfg) => cfg.read_only = true,
            DeviceConfig::Emu(cfg) => cfg.read_only = true,
            _ => {}
        }
        self
    }

    /// Opens the device; the emulated controller runs on `clock`.
    pub fn open_with_clock(&self, clock: Clock) -> std::io::Result<Arc<dyn Controller>> {
        Ok(match self {
            DeviceConfig::Emu(cfg) => Arc::new(EmuController::with_clock(cfg.clone(), clock)?),
            DeviceConfig::Null(cfg) => Arc::new(NullController::new(cfg)),
            DeviceConfig::Uring(cfg) => Arc::new(UringController::open(cfg)?),
            DeviceConfig::Vfio(cfg) => Arc::new(VfioController::open(cfg)?),
            DeviceConfig::NvmeTcp(cfg) => Arc::new(NvmeTcpController::open(cfg)?),
            DeviceConfig::VhostUser(cfg) => Arc::new(VhostUserController::open(cfg)?),
        })
    }
}

impl FromStr for DeviceConfig {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<DeviceConfig, ConfigError> {
        let mut items = text.trim().split(',');
        let head = items.next().unwrap_or_default();
        if head.is_empty() {
            return Err(ConfigError::Empty);
        }
        let mut pairs = items.map(|item| {
            item.split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| ConfigError::NotKeyValue {
                    item: item.to_string(),
                })
        });
        if let Some(profile) = head.strip_prefix("emu:") {
            let mut cfg = EmuConfig::profile(profile)?;
            for pair in pairs {
                let (k, v) = pair?;
                cfg.set(k, v)?;
            }
            cfg.validate()?;
            Ok(DeviceConfig::Emu(cfg))
        } else if head == "emu" {
            Err(ConfigError::UnknownProfile {
                name: String::new(),
                accepted: profile_names().join(", "),
            })
        } else if let Some(path) = head.strip_prefix("uring:") {
            if path.is_empty() {
                return Err(ConfigError::BadValue {
                    key: "path".into(),
                    value: String::new(),
                    expected: "a file or block device, as in uring:/path/disk.img".into(),
                });
            }
            let mut cfg = UringConfig::new(path);
            for pair in pairs {
                let (k, v) = pair?;
                cfg.set(k, v)?;
            }
            cfg.validate()?;
            Ok(DeviceConfig::Uring(cfg))
        } else if let Some(path) = head.strip_prefix("vhost-user:") {
            if path.is_empty() {
                return Err(ConfigError::BadValue {
                    key: "path".into(),
                    value: String::new(),
                    expected: "a vhost-user socket, as in vhost-user:/run/disk.sock".into(),
                });
            }
            let mut cfg = VhostUserConfig::new(path);
            for pair in pairs {
                let (k, v) = pair?;
                cfg.set(k, v)?;
            }
            Ok(DeviceConfig::VhostUser(cfg))
        } else if let Some(addr) = head.strip_prefix("vfio:") {
            let cfg = VfioConfig::parse(addr).map_err(|expected| ConfigError::BadValue {
                key: "vfio".into(),
                value: addr.to_string(),
                expected,
            })?;
            if let Some(pair) = pairs.next() {
                let (k, _) = pair?;
                return Err(ConfigError::UnknownKey {
                    device: "vfio".into(),
                    key: k.into(),
                    accepted: "(none: vfio takes only a PCI address)".into(),
                });
            }
            Ok(DeviceConfig::Vfio(cfg))
        } else if let Some(target) = head.strip_prefix("nvme-tcp:") {
            let mut cfg = NvmeTcpConfig::parse(target)?;
            for pair in pairs {
                let (k, v) = pair?;
                cfg.set(k, v)?;
            }
            Ok(DeviceConfig::NvmeTcp(cfg))
        } else if head == "null" {
            let mut cfg = NullConfig::default();
            for pair in pairs {
                let (k, v) = pair?;
                set_null(&mut cfg, k, v)?;
            }
            if !cfg.size_bytes.is_multiple_of(u64::from(cfg.lba_bytes)) {
                return Err(ConfigError::BadValue {
                    key: "size".into(),
                    value: cfg.size_bytes.to_string(),
                    expected: format!("a multiple of the block size ({})", cfg.lba_bytes),
                });
            }
            Ok(DeviceConfig::Null(cfg))
        } else {
            Err(ConfigError::UnknownDevice {
                name: head.to_string(),
            })
        }
    }
}

fn set_null(cfg: &mut NullConfig, key: &str, value: &str) -> Result<(), ConfigError> {
    let bad = |expected: &str| ConfigError::BadValue {
        key: key.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    };
    match key {
        "size" => {
            cfg.size_bytes = parse_size_bytes(value)
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| bad("a size such as 512M, 8G, 1T"))?
        }
        "lba" => {
            cfg.lba_bytes = match value {
                "512" => 512,
                "4096" | "4k" | "4K" => 4096,
                _ => return Err(bad("512 or 4096")),
            }
        }
        "mdts" => {
            cfg.mdts_bytes = parse_size_bytes(value)
                .ok()
                .filter(|v| (4096..=(2 << 20)).contains(v) && v.is_power_of_two())
                .ok_or_else(|| bad("a power of two from 4K to 2M"))?
                as u32
        }
        "queues" => {
            cfg.queues_max = value
                .parse::<u32>()
                .ok()
                .filter(|v| (1..=1024).contains(v))
                .ok_or_else(|| bad("an integer from 1 to 1024"))?
        }
        _ => {
            return Err(ConfigError::UnknownKey {
                device: "null".into(),
                key: key.into(),
                accepted: NULL_KEYS.join(", "),
            })
        }
    }
    Ok(())
}

/// The canonical device string: the device and every key that differs from its default.
/// Parsing it gives back an equal configuration.
impl fmt::Display for DeviceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceConfig::Emu(cfg) => write!(f, "{cfg}"),
            DeviceConfig::Null(cfg) => write!(f, "{cfg}"),
            DeviceConfig::Uring(cfg) => write!(f, "{cfg}"),
            DeviceConfig::Vfio(cfg) => write!(f, "{cfg}"),
            DeviceConfig::NvmeTcp(cfg) => write!(f, "{cfg}"),
            DeviceConfig::VhostUser(cfg) => write!(f, "{cfg}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emu::Backing;

    #[test]
    fn nvme_tcp_device_strings_round_trip_and_bad_ones_say_why() {
        for text in [
            "nvme-tcp:127.0.0.1:4420/nqn.2026-12.io.hypoll:serve",
            "nvme-tcp:[::1]:4420/nqn.2026-12.io.hypoll:serve,ns=2,digests=both,kato_ms=0",
            "nvme-tcp:storage.example:4420/nqn.2014-08.org.example:disk,digests=header",
        ] {
            let device: DeviceConfig = text.parse().unwrap();
            assert_eq!(device.to_string(), text);
        }
        let DeviceConfig::NvmeTcp(cfg) = "nvme-tcp:10.0.0.1:4420/nqn.a:b".parse().unwrap() else {
            panic!("nvme-tcp")
        };
        assert_eq!(
            (cfg.address.as_str(), cfg.subnqn.as_str()),
            ("10.0.0.1:4420", "nqn.a:b")
        );
        assert_eq!(cfg.nsid, 1);
        for bad in [
            "nvme-tcp:127.0.0.1:4420",
            "nvme-tcp:127.0.0.1/nqn.a:b",
            "nvme-tcp:127.0.0.1:4420/",
            "nvme-tcp:127.0.0.1:4420/nqn.2014-08.org.nvmexpress.discovery",
            "nvme-tcp:127.0.0.1:4420/nqn.a:b,ns=0",
            "nvme-tcp:127.0.0.1:4420/nqn.a:b,digests=crc",
        ] {
            assert!(
                matches!(
                    bad.parse::<DeviceConfig>(),
                    Err(ConfigError::BadValue { .. })
                ),
                "{bad}"
            );
        }
        assert!(matches!(
            "nvme-tcp:127.0.0.1:4420/nqn.a:b,depth=4".parse::<DeviceConfig>(),
            Err(ConfigError::UnknownKey { .. })
        ));
    }

    #[test]
    fn null_device_strings_round_trip() {
        for text in ["null", "null,size=1G,lba=4096", "null,mdts=4K,queues=2"] {
            let device: DeviceConfig = text.parse().unwrap();
            assert_eq!(device.to_string(), text);
            assert_eq!(device.to_string().parse::<DeviceConfig>().unwrap(), device);
        }
    }

    #[test]
    fn the_documented_examples_parse() {
        let DeviceConfig::Emu(cfg) = "emu:optane".parse().unwrap() else {
            panic!("emu")
        };
        assert_eq!(cfg, EmuConfig::profile("optane").unwrap());

        let DeviceConfig::Emu(cfg) = "emu:nand,read_us=23,jitter=0.3,seed=7".parse().unwrap()
        else {
            panic!("emu")
        };
        assert_eq!((cfg.read_us, cfg.jitter, cfg.seed), (23.0, 0.3, 7));
        assert_eq!(
            cfg.write_us, 20.0,
            "untouched keys keep the profile's value"
        );

        let DeviceConfig::Emu(cfg) = "emu:optane,backing=file:/path,size=8G".parse().unwrap()
        else {
            panic!("emu")
        };
        assert_eq!(cfg.backing, Backing::File("/path".into()));
        assert_eq!(cfg.size_bytes, 8 << 30);

        assert_eq!(
            "null".parse::<DeviceConfig>().unwrap(),
            DeviceConfig::Null(NullConfig::default())
        );
        let DeviceConfig::Null(cfg) = "null,size=1G,lba=4096".parse().unwrap() else {
            panic!("null")
        };
        assert_eq!((cfg.size_bytes, cfg.lba_bytes), (1 << 30, 4096));
    }

    #[test]
    fn errors_name_the_key_and_the_accepted_values() {
        let err = |s: &str| s.parse::<DeviceConfig>().unwrap_err().to_string();
        let e = err("emu:optane,turbo=1");
        assert!(
            e.contains("\"turbo\"") && e.contains("read_us") && e.contains("seed"),
            "{e}"
        );
        let e = err("emu:optane,jitter=lots");
        assert!(
            e.contains("jitter") && e.contains("lots") && e.contains("coefficient"),
            "{e}"
        );
        let e = err("emu:hdd");
        assert!(e.contains("hdd") && e.contains("nand"), "{e}");
        let e = err("emu");
        assert!(e.contains("optane"), "{e}");
        let e = err("nvme0n1");
        assert!(e.contains("nvme0n1") && e.contains("null"), "{e}");
        let e = err("null,lba=520");
        assert!(e.contains("lba") && e.contains("512 or 4096"), "{e}");
        let e = err("null,colour=blue");
        assert!(e.contains("colour") && e.contains("size"), "{e}");
        let e = err("emu:optane,seed");
        assert!(e.contains("key=value"), "{e}");
        assert_eq!(err(""), ConfigError::Empty.to_string());
    }

    #[test]
    fn vfio_device_strings_parse_and_print() {
        let device: DeviceConfig = "vfio:0000:00:04.0".parse().unwrap();
        let DeviceConfig::Vfio(cfg) = &device else {
            panic!("vfio")
        };
        assert_eq!(cfg.bdf, "0000:00:04.0");
        assert_eq!(device.to_string(), "vfio:0000:00:04.0");
        assert_eq!("vfio:00:04.0".parse::<DeviceConfig>().unwrap(), device);
        let err = |s: &str| s.parse::<DeviceConfig>().unwrap_err().to_string();
        let e = err("vfio:nvme0");
        assert!(e.contains("nvme0") && e.contains("PCI address"), "{e}");
        let e = err("vfio:0000:00:04.0,depth=4");
        assert!(e.contains("depth") && e.contains("vfio"), "{e}");
        assert!(err("nvme0n1").contains("vfio:<pci address>"));
    }

    #[test]
    fn opened_devices_report_their_namespace() {
        let ctrl = "emu:optane,size=1G,lba=4096"
            .parse::<DeviceConfig>()
            .unwrap()
            .open()
            .unwrap();
        let ns = ctrl.namespace();
        assert_eq!(ns.lba_size_bytes, 4096);
        assert_eq!(ns.capacity_lbas, (1 << 30) / 4096);
        assert_eq!(ctrl.describe(), "emu:optane,size=1G,lba=4096");
        let null = "null,lba=4096".parse::<DeviceConfig>().unwrap();
        assert_eq!(null.open().unwrap().describe(), "null,lba=4096");
        assert_eq!(
            "null"
                .parse::<DeviceConfig>()
                .unwrap()
                .open()
                .unwrap()
                .describe(),
            "null"
        );
        let qp = ctrl.create_queue_pair(32).unwrap();
        assert_eq!(qp.depth(), 32);
    }
}
