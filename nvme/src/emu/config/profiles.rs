//! The emulated controller's named latency profiles (`emu:optane`, `emu:nand`, ...): the
//! drive class each one models, and the configuration it starts from.

use super::{Backing, EmuConfig};
use crate::config::ConfigError;

/// One named latency profile. Figures are medians of 4 KiB random I/O at queue depth 1 on
/// the drive class, from vendor data sheets and the published hybrid-polling measurements.
pub(super) struct Profile {
    pub(super) name: &'static str,
    read_us: f64,
    write_us: f64,
    jitter: f64,
    tail_pct: f64,
    tail_us: f64,
    parallel: u32,
    mbps: f64,
    what: &'static str,
}

pub(super) const PROFILES: &[Profile] = &[
    Profile {
        name: "optane",
        read_us: 9.0,
        write_us: 10.0,
        jitter: 0.08,
        tail_pct: 0.05,
        tail_us: 30.0,
        parallel: 6,
        mbps: 2500.0,
        what: "Intel Optane P4800X class: 4 KiB read ~9 us, p99 ~11 us, ~600K IOPS",
    },
    Profile {
        name: "p5800x",
        read_us: 5.5,
        write_us: 6.5,
        jitter: 0.08,
        tail_pct: 0.05,
        tail_us: 20.0,
        parallel: 8,
        mbps: 7000.0,
        what: "Intel Optane P5800X class: 4 KiB read ~5.5 us, ~1.4M IOPS",
    },
    Profile {
        name: "zssd",
        read_us: 15.0,
        write_us: 16.0,
        jitter: 0.10,
        tail_pct: 0.1,
        tail_us: 60.0,
        parallel: 12,
        mbps: 3200.0,
        what: "Samsung Z-SSD class: 4 KiB read ~15 us, ~750K IOPS",
    },
    Profile {
        name: "nand",
        read_us: 80.0,
        write_us: 20.0,
        jitter: 0.25,
        tail_pct: 1.0,
        tail_us: 400.0,
        parallel: 64,
        mbps: 3000.0,
        what: "TLC NAND data-centre SSD: read ~80 us, cached write ~20 us, 1% of commands ~400 us",
    },
    Profile {
        name: "dram",
        read_us: 3.0,
        write_us: 3.0,
        jitter: 0.05,
        tail_pct: 0.01,
        tail_us: 10.0,
        parallel: 8,
        mbps: 6000.0,
        what: "DRAM-backed NVMe device: ~3 us",
    },
];

/// Names of the built-in profiles.
pub fn profile_names() -> Vec<&'static str> {
    PROFILES.iter().map(|p| p.name).collect()
}

/// Each profile with a one-line description.
pub fn profile_descriptions() -> Vec<(&'static str, &'static str)> {
    PROFILES.iter().map(|p| (p.name, p.what)).collect()
}

impl EmuConfig {
    /// The named profile with default namespace settings: 64 GiB, 512-byte blocks, 128 KiB
    /// MDTS, sparse memory, faults off, seed 1.
    pub fn profile(name: &str) -> Result<EmuConfig, ConfigError> {
        let p = PROFILES.iter().find(|p| p.name == name).ok_or_else(|| {
            ConfigError::UnknownProfile {
                name: name.to_string(),
                accepted: profile_names().join(", "),
            }
        })?;
        Ok(EmuConfig {
            profile: p.name,
            read_us: p.read_us,
            write_us: p.write_us,
            jitter: p.jitter,
            tail_pct: p.tail_pct,
            tail_us: p.tail_us,
            parallel: p.parallel,
            mbps: p.mbps,
            seed: 1,
            size_bytes: 64 << 30,
            lba_bytes: 512,
            mdts_bytes: 128 << 10,
            backing: Backing::Sparse,
            read_only: false,
            err_pct: 0.0,
            lost_pct: 0.0,
            reset_pct: 0.0,
            stuck_pct: 0.0,
            drift_pct: 0.0,
            queues_max: 64,
        })
    }
}
