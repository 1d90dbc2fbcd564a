//! What a target serves (its subsystem, namespaces and where it listens, for the discovery
//! log) and the limits on everything a host can make it hold.

use std::net::SocketAddr;

use hypoll_nvme::fabrics::{CONNECT_DATA_BYTES, DISCOVERY_NQN, NQN_BYTES_MAX};
use hypoll_nvme::tcp::{Digests, MAXH2CDATA_BYTES_MIN};
use thiserror::Error;

/// In-capsule data an admin queue accepts (a Connect's 1024 bytes and room): what Linux
/// hosts assume of every controller's admin queue.
pub const ADMIN_IN_CAPSULE_BYTES: u32 = 8192;
/// Memory page size the controller works in (CAP.MPSMIN = CAP.MPSMAX = 0): MDTS counts in
/// these.
pub const PAGE_BYTES: u32 = 4096;
/// Most namespaces a subsystem serves (the active namespace list holds 1024 IDs).
pub const NAMESPACES_MAX: usize = 1024;
/// Most entries of the discovery log.
pub const DISCOVERY_ENTRIES_MAX: usize = 64;

/// One namespace: an export's block device as the host sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NamespaceConfig {
    /// Logical block size: a power of two from 512 to 4096 bytes.
    pub block_bytes: u32,
    pub blocks: u64,
    pub read_only: bool,
    /// The device has a volatile write cache: Flush reaches it (otherwise it is answered
    /// at once).
    pub volatile_cache: bool,
    /// The device zeroes blocks without data (Write Zeroes is passed on).
    pub write_zeroes: bool,
    /// The device deallocates blocks (Dataset Management's deallocate is passed on;
    /// otherwise it is answered at once, as the hint it is).
    pub deallocate: bool,
    /// The namespace's UUID and NGUID: the same export must keep it across restarts, so a
    /// host's multipath code sees the same namespace.
    pub uuid: [u8; 16],
}

impl NamespaceConfig {
    /// A UUID (version 4 layout) that depends only on `name`: stable for an export's name.
    pub fn uuid_for(name: &str) -> [u8; 16] {
        let mut u = [0u8; 16];
        for (i, chunk) in u.chunks_mut(4).enumerate() {
            let salted = format!("{i}:{name}");
            chunk.copy_from_slice(
                &hypoll_nvme::tcp::digest::crc32c(salted.as_bytes()).to_le_bytes(),
            );
        }
        u[6] = (u[6] & 0x0f) | 0x40;
        u[8] = (u[8] & 0x3f) | 0x80;
        u
    }
}

/// Where the subsystem is served, for the discovery log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveryEntry {
    pub addr: SocketAddr,
    /// The NVM subsystem port's ID.
    pub portid: u16,
}

/// Bounds on what a host can make the target hold. Each is checked where the host could
/// pass it; a value in a structure a host reads (CAP, Identify) says the same bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Controllers (admin queues) alive at once; one more Connect is answered Controller
    /// Busy.
    pub controllers_max: u16,
    /// I/O queues per controller (Number of Queues grants at most this).
    pub io_queues_max: u16,
    /// Entries of any queue (CAP.MQES + 1, MAXCMD): a queue's commands in flight.
    pub queue_entries_max: u16,
    /// In-capsule data of an I/O command (Identify's IOCCSZ says it).
    pub in_capsule_bytes_max: u32,
    /// Data in one H2CData PDU (ICResp's MAXH2CDATA).
    pub maxh2cdata_bytes: u32,
    /// Data one command moves (MDTS): a power of two, at least a page.
    pub transfer_bytes_max: u32,
    /// Write data solicited by R2T and not yet completed, per connection: what the caller
    /// may hold for a connection's writes beyond their in-capsule data.
    pub r2t_bytes_max: u32,
    /// R2Ts whose data has not all arrived, per connection.
    pub r2ts_max: u16,
    /// Asynchronous Event Requests held per controller (AERL + 1).
    pub aers_max: u8,
}

pub const CONTROLLERS_MAX_DEFAULT: u16 = 64;
pub const IO_QUEUES_MAX_DEFAULT: u16 = 64;
pub const QUEUE_ENTRIES_MAX_DEFAULT: u16 = 128;
pub const IN_CAPSULE_BYTES_MAX_DEFAULT: u32 = 8192;
pub const MAXH2CDATA_BYTES_DEFAULT: u32 = 128 << 10;
pub const TRANSFER_BYTES_MAX_DEFAULT: u32 = 128 << 10;
pub const R2T_BYTES_MAX_DEFAULT: u32 = 4 << 20;
pub const R2TS_MAX_DEFAULT: u16 = 32;
pub const AERS_MAX_DEFAULT: u8 = 4;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            controllers_max: CONTROLLERS_MAX_DEFAULT,
            io_queues_max: IO_QUEUES_MAX_DEFAULT,
            queue_entries_max: QUEUE_ENTRIES_MAX_DEFAULT,
            in_capsule_bytes_max: IN_CAPSULE_BYTES_MAX_DEFAULT,
            maxh2cdata_bytes: MAXH2CDATA_BYTES_DEFAULT,
            transfer_bytes_max: TRANSFER_BYTES_MAX_DEFAULT,
            r2t_bytes_max: R2T_BYTES_MAX_DEFAULT,
            r2ts_max: R2TS_MAX_DEFAULT,
            aers_max: AERS_MAX_DEFAULT,
        }
    }
}

/// Everything a target serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetConfig {
    pub subsystem_nqn: String,
    /// Identify's serial number (ASCII, at most 20 bytes).
    pub serial: String,
    /// Identify's model number (ASCII, at most 40 bytes).
    pub model: String,
    /// Namespace IDs are 1-based positions in this list.
    pub namespaces: Vec<NamespaceConfig>,
    /// Where the subsystem is served, as the discovery log lists it.
    pub discovery: Vec<DiscoveryEntry>,
    /// The digests a host may turn on.
    pub digests_allowed: Digests,
    pub limits: Limits,
}

/// Why a configuration cannot be served.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ConfigError {
    #[error("subsystem NQN {0:?}: an NQN is 1 to 223 bytes, not the discovery NQN")]
    SubsystemNqn(String),
    #[error("{field} {value:?} is longer than {max} bytes or not printable ASCII")]
    Text {
        field: &'static str,
        value: String,
        max: usize,
    },
    #[error("{0} namespaces, at most {NAMESPACES_MAX}")]
    Namespaces(usize),
    #[error("namespace {nsid}: {why}")]
    Namespace { nsid: u32, why: &'static str },
    #[error("{0} discovery entries, at most {DISCOVERY_ENTRIES_MAX}")]
    Discovery(usize),
    #[error("limit {field}: {why}")]
    Limit {
        field: &'static str,
        why: &'static str,
    },
}

fn text(field: &'static str, value: &str, max: usize) -> Result<(), ConfigError> {
    if value.len() > max || !value.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(ConfigError::Text {
            field,
            value: value.into(),
            max,
        });
    }
    Ok(())
}

impl TargetConfig {
    /// A target for `subsystem_nqn` with the default limits, no namespaces and no discovery
    /// entries yet.
    pub fn new(subsystem_nqn: &str) -> TargetConfig {
        TargetConfig {
            subsystem_nqn: subsystem_nqn.into(),
            serial: "hypoll".into(),
            model: "hypoll NVMe/TCP".into(),
            namespaces: Vec::new(),
            discovery: Vec::new(),
            digests_allowed: Digests {
                header: true,
                data: true,
            },
            limits: Limits::default(),
        }
    }

    pub fn check(&self) -> Result<(), ConfigError> {
        let nqn = &self.subsystem_nqn;
        if nqn.is_empty() || nqn.len() > NQN_BYTES_MAX || nqn == DISCOVERY_NQN || nqn.contains('\0')
        {
            return Err(ConfigError::SubsystemNqn(nqn.clone()));
        }
        text("serial", &self.serial, 20)?;
        text("model", &self.model, 40)?;
        if self.namespaces.len() > NAMESPACES_MAX {
            return Err(ConfigError::Namespaces(self.namespaces.len()));
        }
        for (i, ns) in self.namespaces.iter().enumerate() {
            let nsid = i as u32 + 1;
            let bad = |why| Err(ConfigError::Namespace { nsid, why });
            if !ns.block_bytes.is_power_of_two() || !(512..=PAGE_BYTES).contains(&ns.block_bytes) {
                return bad("the block size is a power of two from 512 to 4096 bytes");
            }
            if ns.blocks == 0 || ns.blocks.checked_mul(u64::from(ns.block_bytes)).is_none() {
                return bad("the size is at least one block and fits 64 bits of bytes");
            }
        }
        if self.discovery.len() > DISCOVERY_ENTRIES_MAX {
            return Err(ConfigError::Discovery(self.discovery.len()));
        }
        let l = &self.limits;
        let bad = |field, why| Err(ConfigError::Limit { field, why });
        if l.controllers_max == 0 || l.controllers_max > 0xffef {
            return bad(
                "controllers_max",
                "1 to 65519 (controller IDs above are reserved)",
            );
        }
        if l.io_queues_max == 0 || l.io_queues_max == u16::MAX {
            return bad("io_queues_max", "1 to 65534");
        }
        if l.queue_entries_max < 2 {
            return bad("queue_entries_max", "at least 2 (MQES is 0's based)");
        }
        let icd = l.in_capsule_bytes_max;
        if !(CONNECT_DATA_BYTES as u32..=1 << 20).contains(&icd) || !icd.is_multiple_of(16) {
            // A host sends an I/O queue's Connect data in the capsule when it fits the
            // I/O queues' capsules (Linux does), and the target takes it only so.
            return bad(
                "in_capsule_bytes_max",
                "a multiple of 16 bytes from 1 KiB (a Connect's data) to 1 MiB",
            );
        }
        if l.maxh2cdata_bytes < MAXH2CDATA_BYTES_MIN || !l.maxh2cdata_bytes.is_multiple_of(4) {
            return bad("maxh2cdata_bytes", "a multiple of 4, at least 4096");
        }
        if !l.transfer_bytes_max.is_power_of_two() || l.transfer_bytes_max < PAGE_BYTES {
            return bad("transfer_bytes_max", "a power of two, at least 4096");
        }
        if l.r2t_bytes_max < l.transfer_bytes_max {
            return bad(
                "r2t_bytes_max",
                "at least transfer_bytes_max, or a write could never start",
            );
        }
        if l.r2ts_max == 0 {
            return bad("r2ts_max", "at least 1");
        }
        if l.aers_max == 0 {
            return bad("aers_max", "at least 1 (AERL is 0's based)");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> NamespaceConfig {
        NamespaceConfig {
            block_bytes: 4096,
            blocks: 16,
            read_only: false,
            volatile_cache: false,
            write_zeroes: false,
            deallocate: false,
            uuid: NamespaceConfig::uuid_for("a"),
        }
    }

    type Change = dyn Fn(&mut TargetConfig);

    #[test]
    fn configurations_are_checked() {
        let mut c = TargetConfig::new("nqn.2026-12.io.hypoll:a");
        c.namespaces = vec![ns()];
        assert_eq!(c.check(), Ok(()));
        let refused = |f: &Change| {
            let mut c = c.clone();
            f(&mut c);
            c.check().unwrap_err()
        };
        assert!(matches!(
            refused(&|c| c.subsystem_nqn = DISCOVERY_NQN.into()),
            ConfigError::SubsystemNqn(_)
        ));
        assert!(matches!(
            refused(&|c| c.serial = "x".repeat(21)),
            ConfigError::Text { .. }
        ));
        assert!(matches!(
            refused(&|c| c.namespaces[0].block_bytes = 1000),
            ConfigError::Namespace { nsid: 1, .. }
        ));
        assert!(matches!(
            refused(&|c| c.namespaces[0].blocks = u64::MAX),
            ConfigError::Namespace { .. }
        ));
        let limits: [(&str, &Change); 6] = [
            ("in_capsule_bytes_max", &|c| {
                c.limits.in_capsule_bytes_max = 512
            }),
            ("maxh2cdata_bytes", &|c| c.limits.maxh2cdata_bytes = 4094),
            ("transfer_bytes_max", &|c| {
                c.limits.transfer_bytes_max = 3 << 12
            }),
            ("r2t_bytes_max", &|c| c.limits.r2t_bytes_max = 4096),
            ("queue_entries_max", &|c| c.limits.queue_entries_max = 1),
            ("aers_max", &|c| c.limits.aers_max = 0),
        ];
        for (field, f) in limits {
            assert!(
                matches!(refused(f), ConfigError::Limit { field: got, .. } if got == field),
                "{field}"
            );
        }
    }

    #[test]
    fn uuids_depend_on_the_name_only() {
        let a = NamespaceConfig::uuid_for("a");
        assert_eq!(a, NamespaceConfig::uuid_for("a"));
        assert_ne!(a, NamespaceConfig::uuid_for("b"));
        assert_eq!(a[6] >> 4, 4, "version 4 layout");
        assert_eq!(a[8] >> 6, 0b10, "RFC 4122 variant");
    }
}
