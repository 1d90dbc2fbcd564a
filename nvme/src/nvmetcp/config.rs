//! What an `nvme-tcp:` device string says: where the target listens, the subsystem, and the
//! keys it accepts (`ns`, `digests`, `kato_ms`), and the canonical text a configuration
//! prints as.

use std::fmt;

use crate::config::ConfigError;
use crate::fabrics::{DISCOVERY_NQN, NQN_BYTES_MAX};
use crate::tcp::Digests;

/// Keys `nvme-tcp:` accepts.
pub const NVME_TCP_KEYS: &[&str] = &["ns", "digests", "kato_ms"];
/// The keep-alive timeout asked for unless configured: the host sends a Keep Alive every
/// third of it.
pub const KATO_MS_DEFAULT: u32 = 15_000;
/// Bounds of `kato_ms` (0: the host asks for no keep-alive timer).
pub const KATO_MS_MAX: u32 = 3_600_000;

/// A parsed `nvme-tcp:HOST:PORT/SUBNQN` device string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeTcpConfig {
    /// `HOST:PORT` as given (a name, an IPv4 address, or `[IPv6]`), resolved when opened.
    pub address: String,
    pub subnqn: String,
    /// The namespace the device reads and writes.
    pub nsid: u32,
    /// The digests asked for (the target may grant fewer).
    pub digests: Digests,
    pub kato_ms: u32,
}

impl NvmeTcpConfig {
    /// Parses what follows `nvme-tcp:` up to the first comma: `HOST:PORT/SUBNQN`.
    pub fn parse(target: &str) -> Result<NvmeTcpConfig, ConfigError> {
        let bad = |expected: &str| ConfigError::BadValue {
            key: "nvme-tcp".into(),
            value: target.to_string(),
            expected: expected.to_string(),
        };
        let (address, subnqn) = target.split_once('/').ok_or_else(|| {
            bad("HOST:PORT/SUBNQN, as in nvme-tcp:127.0.0.1:4420/nqn.2026-12.io.hypoll:serve")
        })?;
        let port = address.rsplit_once(':').map(|(_, p)| p);
        if address.is_empty() || port.is_none_or(|p| p.parse::<u16>().is_err()) {
            return Err(bad("a HOST:PORT before the / (a port is always given)"));
        }
        if subnqn.is_empty() || subnqn.len() > NQN_BYTES_MAX || subnqn == DISCOVERY_NQN {
            return Err(bad(
                "a subsystem NQN of 1 to 223 bytes after the / (not the discovery NQN)",
            ));
        }
        Ok(NvmeTcpConfig {
            address: address.to_string(),
            subnqn: subnqn.to_string(),
            nsid: 1,
            digests: Digests::default(),
            kato_ms: KATO_MS_DEFAULT,
        })
    }

    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let bad = |expected: &str| ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            expected: expected.to_string(),
        };
        match key {
            "ns" => {
                self.nsid = value
                    .parse::<u32>()
                    .ok()
                    .filter(|n| (1..0xffff_ffff).contains(n))
                    .ok_or_else(|| bad("a namespace ID from 1"))?
            }
            "digests" => {
                self.digests = match value {
                    "none" => Digests::default(),
                    "header" => Digests {
                        header: true,
                        data: false,
                    },
                    "data" => Digests {
                        header: false,
                        data: true,
                    },
                    "both" => Digests {
                        header: true,
                        data: true,
                    },
                    _ => return Err(bad("none, header, data or both")),
                }
            }
            "kato_ms" => {
                self.kato_ms = value
                    .parse::<u32>()
                    .ok()
                    .filter(|v| *v <= KATO_MS_MAX)
                    .ok_or_else(|| bad("milliseconds from 0 (none) to 3600000"))?
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    device: "nvme-tcp".into(),
                    key: key.into(),
                    accepted: NVME_TCP_KEYS.join(", "),
                })
            }
        }
        Ok(())
    }
}

/// `nvme-tcp:HOST:PORT/SUBNQN` and every key that differs from its default.
impl fmt::Display for NvmeTcpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "nvme-tcp:{}/{}", self.address, self.subnqn)?;
        if self.nsid != 1 {
            write!(f, ",ns={}", self.nsid)?;
        }
        let d = self.digests;
        if d != Digests::default() {
            let name = match (d.header, d.data) {
                (true, true) => "both",
                (true, false) => "header",
                _ => "data",
            };
            write!(f, ",digests={name}")?;
        }
        if self.kato_ms != KATO_MS_DEFAULT {
            write!(f, ",kato_ms={}", self.kato_ms)?;
        }
        Ok(())
    }
}
