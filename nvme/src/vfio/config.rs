//! What a `vfio:` device string says: the PCI function's address, and where to look for
//! sysfs and the device nodes (tests point these at a fake tree).

use std::fmt;
use std::path::PathBuf;

/// Where the driver looks for sysfs and device nodes (tests point these at a fake tree).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SysPaths {
    pub sysfs: PathBuf,
    pub dev: PathBuf,
}

impl Default for SysPaths {
    fn default() -> Self {
        SysPaths {
            sysfs: PathBuf::from("/sys"),
            dev: PathBuf::from("/dev"),
        }
    }
}

/// A parsed `vfio:` device string: the PCI function's address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VfioConfig {
    /// Domain:bus:device.function, as sysfs writes it: `0000:00:04.0`.
    pub bdf: String,
    pub paths: SysPaths,
}

impl VfioConfig {
    /// Parses a PCI address `dddd:bb:dd.f` (or `bb:dd.f`, domain 0), hex, lower-cased. The
    /// error says what was expected (the caller names the bad value).
    pub fn parse(addr: &str) -> Result<VfioConfig, String> {
        let expected = "a PCI address such as 0000:00:04.0 (domain:bus:device.function, hex)";
        let full = if addr.matches(':').count() == 1 {
            format!("0000:{addr}")
        } else {
            addr.to_string()
        };
        let bad = || expected.to_string();
        let (dbd, func) = full.rsplit_once('.').ok_or_else(bad)?;
        let parts: Vec<&str> = dbd.split(':').collect();
        let [domain, bus, dev] = parts[..] else {
            return Err(bad());
        };
        let hex = |s: &str, len: usize, max: u32| {
            (s.len() == len && s.chars().all(|c| c.is_ascii_hexdigit()))
                .then(|| u32::from_str_radix(s, 16).ok())
                .flatten()
                .filter(|v| *v <= max)
        };
        let (Some(domain), Some(bus), Some(dev), Some(func)) = (
            hex(domain, 4, 0xffff),
            hex(bus, 2, 0xff),
            hex(dev, 2, 0x1f),
            hex(func, 1, 7),
        ) else {
            return Err(bad());
        };
        Ok(VfioConfig {
            bdf: format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"),
            paths: SysPaths::default(),
        })
    }
}

impl fmt::Display for VfioConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "vfio:{}", self.bdf)
    }
}
