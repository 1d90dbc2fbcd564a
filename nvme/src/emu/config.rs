//! Configuration of the emulated controller: named latency profiles and the parameters that
//! override them.

use std::path::PathBuf;

use crate::device::{parse_size_bytes, SpecError};

/// Where the emulated namespace keeps its data.
#[derive(Clone, Debug, PartialEq)]
pub enum Backing {
    /// Memory allocated for the whole namespace up front (the OS still commits pages only as
    /// they are written).
    Ram,
    /// Memory allocated per 1 MiB chunk on first write: a 64 GiB namespace costs nothing until
    /// written. Unwritten blocks read as zeroes.
    Sparse,
    /// A regular file (created if missing, extended to the namespace size).
    File(PathBuf),
}

/// The latency model's parameters, and the namespace shape. Times in microseconds where the
/// spec string uses them, to match how drives are specified.
#[derive(Clone, Debug, PartialEq)]
pub struct EmuConfig {
    /// Profile the parameters started from.
    pub profile: &'static str,
    /// Median latency of a 4 KiB read.
    pub read_us: f64,
    /// Median latency of a 4 KiB write (and of flush, write zeroes, deallocate).
    pub write_us: f64,
    /// Coefficient of variation of the log-normal latency around the median.
    pub jitter: f64,
    /// Percent of commands that take the slow path.
    pub tail_pct: f64,
    /// Median latency of the slow path.
    pub tail_us: f64,
    /// Internal units working in parallel: beyond this many commands in flight, commands
    /// queue inside the device, so IOPS saturate as on a real drive.
    pub parallel: u32,
    /// Transfer rate for the bytes beyond the first 4 KiB, in MB/s: latency grows with size.
    pub mbps: f64,
    /// Seed of the latency and fault generators (each queue pair derives its own).
    pub seed: u64,
    /// Namespace size.
    pub size_bytes: u64,
    /// Logical block size: 512 or 4096.
    pub lba_bytes: u32,
    /// Maximum data transfer size of one command (MDTS).
    pub mdts_bytes: u32,
    pub backing: Backing,
    /// Percent of commands that complete with a media error status.
    pub err_pct: f64,
    /// Percent of commands that never complete (until a reset aborts them).
    pub lost_pct: f64,
    /// Percent of commands whose submission triggers a reset of the queue pair, aborting
    /// every command outstanding on it.
    pub reset_pct: f64,
    /// Most I/O queue pairs the controller hands out.
    pub max_queues: u32,
}

/// One named latency profile. Figures are medians of 4 KiB random I/O at queue depth 1 on
/// the drive class, from vendor data sheets and the published hybrid-polling measurements.
struct Profile {
    name: &'static str,
    read_us: f64,
    write_us: f64,
    jitter: f64,
    tail_pct: f64,
    tail_us: f64,
    parallel: u32,
    mbps: f64,
    what: &'static str,
}

const PROFILES: &[Profile] = &[
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
        what: "TLC NAND data-centre SSD: read ~80 us, cached write ~20 us, 1% slow reads",
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

/// Keys `emu:` accepts, for error messages and documentation.
pub const EMU_KEYS: &[&str] = &[
    "read_us",
    "write_us",
    "jitter",
    "tail_pct",
    "tail_us",
    "parallel",
    "mbps",
    "seed",
    "size",
    "lba",
    "mdts",
    "backing",
    "err_pct",
    "lost_pct",
    "reset_pct",
    "queues",
];

impl EmuConfig {
    /// The named profile with default namespace settings: 64 GiB, 512-byte blocks, 128 KiB
    /// MDTS, sparse memory, faults off, seed 1.
    pub fn profile(name: &str) -> Result<EmuConfig, SpecError> {
        let p =
            PROFILES
                .iter()
                .find(|p| p.name == name)
                .ok_or_else(|| SpecError::UnknownProfile {
                    name: name.to_string(),
                    accepted: profile_names().join(", "),
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
            err_pct: 0.0,
            lost_pct: 0.0,
            reset_pct: 0.0,
            max_queues: 64,
        })
    }

    /// A device that completes commands as soon as they are polled: the emulator's own cost.
    pub fn zero_latency() -> EmuConfig {
        EmuConfig {
            read_us: 0.0,
            write_us: 0.0,
            jitter: 0.0,
            tail_pct: 0.0,
            tail_us: 0.0,
            ..EmuConfig::profile("dram").expect("built-in profile")
        }
    }

    /// Applies one `key=value` override.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), SpecError> {
        let bad = |expected: &str| SpecError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            expected: expected.to_string(),
        };
        let micros = || -> Result<f64, SpecError> {
            value
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| bad("a non-negative number of microseconds"))
        };
        let percent = || -> Result<f64, SpecError> {
            value
                .parse::<f64>()
                .ok()
                .filter(|v| (0.0..=100.0).contains(v))
                .ok_or_else(|| bad("a percentage from 0 to 100"))
        };
        match key {
            "read_us" => self.read_us = micros()?,
            "write_us" => self.write_us = micros()?,
            "tail_us" => self.tail_us = micros()?,
            "jitter" => {
                self.jitter = value
                    .parse::<f64>()
                    .ok()
                    .filter(|v| (0.0..=10.0).contains(v))
                    .ok_or_else(|| bad("a coefficient of variation from 0 to 10"))?
            }
            "tail_pct" => self.tail_pct = percent()?,
            "err_pct" => self.err_pct = percent()?,
            "lost_pct" => self.lost_pct = percent()?,
            "reset_pct" => self.reset_pct = percent()?,
            "parallel" => {
                self.parallel = value
                    .parse::<u32>()
                    .ok()
                    .filter(|v| (1..=4096).contains(v))
                    .ok_or_else(|| bad("an integer from 1 to 4096"))?
            }
            "mbps" => {
                self.mbps = value
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .ok_or_else(|| bad("a positive transfer rate in MB/s"))?
            }
            "seed" => self.seed = value.parse().map_err(|_| bad("an unsigned integer"))?,
            "size" => {
                self.size_bytes = parse_size_bytes(value)
                    .ok()
                    .filter(|v| *v > 0)
                    .ok_or_else(|| bad("a size such as 4096, 512M, 8G, 1T"))?
            }
            "lba" => {
                self.lba_bytes = match value {
                    "512" => 512,
                    "4096" | "4k" | "4K" => 4096,
                    _ => return Err(bad("512 or 4096")),
                }
            }
            "mdts" => {
                self.mdts_bytes = parse_size_bytes(value)
                    .ok()
                    .filter(|v| (4096..=(2 << 20)).contains(v) && v.is_power_of_two())
                    .ok_or_else(|| bad("a power of two from 4K to 2M"))?
                    as u32
            }
            "backing" => {
                self.backing = match value {
                    "ram" => Backing::Ram,
                    "sparse" => Backing::Sparse,
                    _ => match value.strip_prefix("file:") {
                        Some(path) if !path.is_empty() => Backing::File(PathBuf::from(path)),
                        _ => return Err(bad("ram, sparse or file:/path")),
                    },
                }
            }
            "queues" => {
                self.max_queues = value
                    .parse::<u32>()
                    .ok()
                    .filter(|v| (1..=1024).contains(v))
                    .ok_or_else(|| bad("an integer from 1 to 1024"))?
            }
            _ => {
                return Err(SpecError::UnknownKey {
                    device: "emu".to_string(),
                    key: key.to_string(),
                    accepted: EMU_KEYS.join(", "),
                })
            }
        }
        Ok(())
    }

    /// Checks what no single key can: the size against the block size and the backing.
    pub fn validate(&self) -> Result<(), SpecError> {
        if !self.size_bytes.is_multiple_of(u64::from(self.lba_bytes)) {
            return Err(SpecError::BadValue {
                key: "size".to_string(),
                value: self.size_bytes.to_string(),
                expected: format!("a multiple of the block size ({} bytes)", self.lba_bytes),
            });
        }
        if !matches!(self.backing, Backing::File(_)) && self.size_bytes > MAX_MEMORY_BACKED_BYTES {
            return Err(SpecError::BadValue {
                key: "size".to_string(),
                value: self.size_bytes.to_string(),
                expected: format!(
                    "at most {} TiB for a memory backing; use backing=file:/path",
                    MAX_MEMORY_BACKED_BYTES >> 40
                ),
            });
        }
        Ok(())
    }
}

/// Largest namespace a RAM or sparse backing accepts (its chunk table grows with the size).
pub const MAX_MEMORY_BACKED_BYTES: u64 = 1 << 40;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_profile_resolves_and_overrides_apply() {
        for name in profile_names() {
            let cfg = EmuConfig::profile(name).unwrap();
            assert!(cfg.read_us > 0.0 && cfg.parallel >= 1, "{name}");
            cfg.validate().unwrap();
        }
        let mut cfg = EmuConfig::profile("nand").unwrap();
        cfg.set("read_us", "23").unwrap();
        cfg.set("jitter", "0.3").unwrap();
        cfg.set("seed", "7").unwrap();
        cfg.set("size", "8G").unwrap();
        cfg.set("lba", "4096").unwrap();
        cfg.set("backing", "file:/tmp/x.img").unwrap();
        assert_eq!(cfg.read_us, 23.0);
        assert_eq!(cfg.jitter, 0.3);
        assert_eq!(cfg.seed, 7);
        assert_eq!(cfg.size_bytes, 8 << 30);
        assert_eq!(cfg.lba_bytes, 4096);
        assert_eq!(cfg.backing, Backing::File("/tmp/x.img".into()));
    }

    #[test]
    fn bad_values_name_the_key_and_what_is_accepted() {
        let mut cfg = EmuConfig::profile("optane").unwrap();
        let err = cfg.set("lba", "1024").unwrap_err().to_string();
        assert!(err.contains("lba") && err.contains("512 or 4096"), "{err}");
        let err = cfg.set("jitter", "-1").unwrap_err().to_string();
        assert!(err.contains("jitter"), "{err}");
        let err = cfg.set("err_pct", "101").unwrap_err().to_string();
        assert!(err.contains("err_pct") && err.contains("0 to 100"), "{err}");
        let err = cfg.set("colour", "red").unwrap_err().to_string();
        assert!(err.contains("colour") && err.contains("read_us"), "{err}");
        let err = EmuConfig::profile("floppy").unwrap_err().to_string();
        assert!(err.contains("floppy") && err.contains("optane"), "{err}");
        cfg.set("size", "1000").unwrap();
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("multiple of the block size"), "{err}");
    }
}
