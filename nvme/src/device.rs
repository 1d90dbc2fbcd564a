//! Device spec strings, parsed in one place: `emu:optane`,
//! `emu:nand,read_us=23,jitter=0.3,seed=7`, `emu:optane,backing=file:/path,size=8G`, `null`,
//! `null,size=1T,lba=4096`, `vfio:0000:00:04.0`.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::clock::Clock;
use crate::emu::config::profile_names;
use crate::emu::{EmuConfig, EmuController};
use crate::null::{NullConfig, NullController, NULL_KEYS};
use crate::qpair::Controller;
use crate::uring::{UringConfig, UringController};
use crate::vfio::{VfioConfig, VfioController};

/// Device kinds a spec may name.
pub const DEVICE_KINDS: &[&str] = &["emu:<profile>", "null", "uring:/path", "vfio:<pci address>"];

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    #[error("empty device spec: expected one of {}", DEVICE_KINDS.join(", "))]
    Empty,
    #[error("unknown device {name:?}: expected one of {}", DEVICE_KINDS.join(", "))]
    UnknownDevice { name: String },
    #[error("unknown emulated profile {name:?}: accepted profiles are {accepted}")]
    UnknownProfile { name: String, accepted: String },
    #[error("unknown key {key:?} for device {device}: accepted keys are {accepted}")]
    UnknownKey {
        device: String,
        key: String,
        accepted: String,
    },
    #[error("bad value {value:?} for {key}: expected {expected}")]
    BadValue {
        key: String,
        value: String,
        expected: String,
    },
    #[error("{item:?} is not key=value")]
    NotKeyValue { item: String },
}

/// A parsed device spec.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceSpec {
    Emu(EmuConfig),
    Null(NullConfig),
    Uring(UringConfig),
    /// A PCI NVMe function bound to vfio-pci, driven from user space.
    Vfio(VfioConfig),
}

impl DeviceSpec {
    /// Opens the device on the real clock.
    pub fn open(&self) -> std::io::Result<Arc<dyn Controller>> {
        self.open_with_clock(Clock::Monotonic)
    }

    /// Opens the device; the emulated controller runs on `clock`.
    pub fn open_with_clock(&self, clock: Clock) -> std::io::Result<Arc<dyn Controller>> {
        Ok(match self {
            DeviceSpec::Emu(cfg) => Arc::new(EmuController::with_clock(cfg.clone(), clock)?),
            DeviceSpec::Null(cfg) => Arc::new(NullController::new(cfg)),
            DeviceSpec::Uring(cfg) => Arc::new(UringController::open(cfg)?),
            DeviceSpec::Vfio(cfg) => Arc::new(VfioController::open(cfg)?),
        })
    }
}

impl FromStr for DeviceSpec {
    type Err = SpecError;

    fn from_str(spec: &str) -> Result<DeviceSpec, SpecError> {
        let mut items = spec.trim().split(',');
        let head = items.next().unwrap_or_default();
        if head.is_empty() {
            return Err(SpecError::Empty);
        }
        let mut pairs = items.map(|item| {
            item.split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| SpecError::NotKeyValue {
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
            Ok(DeviceSpec::Emu(cfg))
        } else if head == "emu" {
            Err(SpecError::UnknownProfile {
                name: String::new(),
                accepted: profile_names().join(", "),
            })
        } else if let Some(path) = head.strip_prefix("uring:") {
            if path.is_empty() {
                return Err(SpecError::BadValue {
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
            Ok(DeviceSpec::Uring(cfg))
        } else if let Some(addr) = head.strip_prefix("vfio:") {
            let cfg = VfioConfig::parse(addr).map_err(|expected| SpecError::BadValue {
                key: "vfio".into(),
                value: addr.to_string(),
                expected,
            })?;
            if let Some(pair) = pairs.next() {
                let (k, _) = pair?;
                return Err(SpecError::UnknownKey {
                    device: "vfio".into(),
                    key: k.into(),
                    accepted: "(none: vfio takes only a PCI address)".into(),
                });
            }
            Ok(DeviceSpec::Vfio(cfg))
        } else if head == "null" {
            let mut cfg = NullConfig::default();
            for pair in pairs {
                let (k, v) = pair?;
                set_null(&mut cfg, k, v)?;
            }
            if !cfg.size_bytes.is_multiple_of(u64::from(cfg.lba_bytes)) {
                return Err(SpecError::BadValue {
                    key: "size".into(),
                    value: cfg.size_bytes.to_string(),
                    expected: format!("a multiple of the block size ({})", cfg.lba_bytes),
                });
            }
            Ok(DeviceSpec::Null(cfg))
        } else {
            Err(SpecError::UnknownDevice {
                name: head.to_string(),
            })
        }
    }
}

fn set_null(cfg: &mut NullConfig, key: &str, value: &str) -> Result<(), SpecError> {
    let bad = |expected: &str| SpecError::BadValue {
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
            return Err(SpecError::UnknownKey {
                device: "null".into(),
                key: key.into(),
                accepted: NULL_KEYS.join(", "),
            })
        }
    }
    Ok(())
}

/// The canonical spec string: the device and every key that differs from its default.
/// Parsing it gives back an equal spec.
impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Emu(cfg) => write!(f, "{cfg}"),
            DeviceSpec::Null(cfg) => write!(f, "{cfg}"),
            DeviceSpec::Uring(cfg) => write!(f, "{cfg}"),
            DeviceSpec::Vfio(cfg) => write!(f, "{cfg}"),
        }
    }
}

/// Writes a byte count as [`parse_size_bytes`] reads it, with the largest binary suffix that
/// divides it exactly: `64G`, `128K`, `1000`.
pub fn size_text(bytes: u64) -> String {
    for (shift, suffix) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Parses a byte count with an optional binary suffix: `4096`, `4k`, `512M`, `8G`, `1T`,
/// `8GiB`. Suffixes are powers of 1024, as storage tools (fio, qemu-img) read them.
pub fn parse_size_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(digits_end);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 4096, 4k, 512M, 8G)"))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("{text:?} has an unknown size suffix {suffix:?}")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emu::Backing;

    #[test]
    fn null_spec_strings_round_trip() {
        for text in ["null", "null,size=1G,lba=4096", "null,mdts=4K,queues=2"] {
            let spec: DeviceSpec = text.parse().unwrap();
            assert_eq!(spec.to_string(), text);
            assert_eq!(spec.to_string().parse::<DeviceSpec>().unwrap(), spec);
        }
    }

    #[test]
    fn sizes_print_as_they_parse() {
        for bytes in [
            0,
            1,
            512,
            1000,
            4096,
            3 << 20,
            (5 << 30) + 512,
            1 << 40,
            u64::MAX,
        ] {
            let text = size_text(bytes);
            assert_eq!(parse_size_bytes(&text), Ok(bytes), "{text}");
        }
        assert_eq!(size_text(64 << 30), "64G");
        assert_eq!(size_text(128 << 10), "128K");
    }

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size_bytes("4096"), Ok(4096));
        assert_eq!(parse_size_bytes("4k"), Ok(4096));
        assert_eq!(parse_size_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_size_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size_bytes("1T"), Ok(1 << 40));
        assert!(parse_size_bytes("8X").is_err());
        assert!(parse_size_bytes("G").is_err());
        assert!(parse_size_bytes("99999999999T").is_err());
    }

    #[test]
    fn the_issue_examples_parse() {
        let DeviceSpec::Emu(cfg) = "emu:optane".parse().unwrap() else {
            panic!("emu")
        };
        assert_eq!(cfg, EmuConfig::profile("optane").unwrap());

        let DeviceSpec::Emu(cfg) = "emu:nand,read_us=23,jitter=0.3,seed=7".parse().unwrap() else {
            panic!("emu")
        };
        assert_eq!((cfg.read_us, cfg.jitter, cfg.seed), (23.0, 0.3, 7));
        assert_eq!(
            cfg.write_us, 20.0,
            "untouched keys keep the profile's value"
        );

        let DeviceSpec::Emu(cfg) = "emu:optane,backing=file:/path,size=8G".parse().unwrap() else {
            panic!("emu")
        };
        assert_eq!(cfg.backing, Backing::File("/path".into()));
        assert_eq!(cfg.size_bytes, 8 << 30);

        assert_eq!(
            "null".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Null(NullConfig::default())
        );
        let DeviceSpec::Null(cfg) = "null,size=1G,lba=4096".parse().unwrap() else {
            panic!("null")
        };
        assert_eq!((cfg.size_bytes, cfg.lba_bytes), (1 << 30, 4096));
    }

    #[test]
    fn errors_name_the_key_and_the_accepted_values() {
        let err = |s: &str| s.parse::<DeviceSpec>().unwrap_err().to_string();
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
        assert_eq!(err(""), SpecError::Empty.to_string());
    }

    #[test]
    fn vfio_specs_parse_and_print() {
        let spec: DeviceSpec = "vfio:0000:00:04.0".parse().unwrap();
        let DeviceSpec::Vfio(cfg) = &spec else {
            panic!("vfio")
        };
        assert_eq!(cfg.bdf, "0000:00:04.0");
        assert_eq!(spec.to_string(), "vfio:0000:00:04.0");
        assert_eq!("vfio:00:04.0".parse::<DeviceSpec>().unwrap(), spec);
        let err = |s: &str| s.parse::<DeviceSpec>().unwrap_err().to_string();
        let e = err("vfio:nvme0");
        assert!(e.contains("nvme0") && e.contains("PCI address"), "{e}");
        let e = err("vfio:0000:00:04.0,depth=4");
        assert!(e.contains("depth") && e.contains("vfio"), "{e}");
        assert!(err("nvme0n1").contains("vfio:<pci address>"));
    }

    #[test]
    fn opened_devices_report_their_namespace() {
        let ctrl = "emu:optane,size=1G,lba=4096"
            .parse::<DeviceSpec>()
            .unwrap()
            .open()
            .unwrap();
        let ns = ctrl.namespace();
        assert_eq!(ns.lba_size_bytes, 4096);
        assert_eq!(ns.capacity_lbas, (1 << 30) / 4096);
        assert_eq!(ctrl.describe(), "emu:optane,size=1G,lba=4096");
        let null = "null,lba=4096".parse::<DeviceSpec>().unwrap();
        assert_eq!(null.open().unwrap().describe(), "null,lba=4096");
        assert_eq!(
            "null"
                .parse::<DeviceSpec>()
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
