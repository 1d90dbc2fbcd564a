//! The keys an `emu:` device string accepts: their names, the bounds of their values, and
//! how each is read into, checked on and written from its field of [`EmuConfig`].

use std::path::PathBuf;

use super::{Backing, EmuConfig};
use crate::config::{parse_size_bytes, size_text};

/// Keys `emu:` accepts, for error messages and documentation, in the order a device string
/// writes them.
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
    "drift_pct",
    "stuck_pct",
];

/// Largest `drift_pct`: latencies may grow by up to 10x per second.
pub const DRIFT_PCT_MAX: f64 = 1_000.0;
/// Longest median latency `read_us`, `write_us` and `tail_us` accept: 10 s. Deadlines are
/// nanosecond `u64`s; the controller's deadline arithmetic saturates as well.
pub const LATENCY_US_MAX: f64 = 10_000_000.0;
/// Largest `jitter` (coefficient of variation).
pub const JITTER_MAX: f64 = 10.0;
/// Most internal units (`parallel`) per queue pair.
pub const PARALLEL_MAX: u32 = 4096;
/// Slowest transfer rate (`mbps`): at 1 MB/s the largest transfer (2 MiB) takes about 2 s.
pub const RATE_MBPS_MIN: f64 = 1.0;
/// Fastest transfer rate (`mbps`): at 10^12 MB/s a 2 MiB transfer takes 0.002 ns, which
/// rounds to nothing: transfers are free ([`EmuConfig::zero_latency`] uses it).
pub const RATE_MBPS_MAX: f64 = 1e12;
/// Smallest MDTS (`mdts`), a power of two: one 4 KiB page.
pub const MDTS_BYTES_MIN: u32 = 4096;
/// Largest MDTS (`mdts`), a power of two.
pub const MDTS_BYTES_MAX: u32 = 2 << 20;
/// Most I/O queue pairs (`queues`) a controller hands out.
pub const QUEUES_MAX: u32 = 1024;

/// One `emu:` key, tied to its field of [`EmuConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Key {
    ReadUs,
    WriteUs,
    Jitter,
    TailPct,
    TailUs,
    Parallel,
    Mbps,
    Seed,
    Size,
    Lba,
    Mdts,
    Backing,
    ErrPct,
    LostPct,
    ResetPct,
    Queues,
    DriftPct,
    StuckPct,
}

/// Every key, in [`EMU_KEYS`] order.
pub(super) const KEYS: [Key; 18] = [
    Key::ReadUs,
    Key::WriteUs,
    Key::Jitter,
    Key::TailPct,
    Key::TailUs,
    Key::Parallel,
    Key::Mbps,
    Key::Seed,
    Key::Size,
    Key::Lba,
    Key::Mdts,
    Key::Backing,
    Key::ErrPct,
    Key::LostPct,
    Key::ResetPct,
    Key::Queues,
    Key::DriftPct,
    Key::StuckPct,
];

impl Key {
    pub(super) fn name(self) -> &'static str {
        EMU_KEYS[KEYS
            .iter()
            .position(|&k| k == self)
            .expect("every key is listed")]
    }

    pub(super) fn from_name(name: &str) -> Option<Key> {
        EMU_KEYS.iter().position(|&k| k == name).map(|i| KEYS[i])
    }

    /// What the key accepts, in words.
    pub(super) fn expected(self) -> &'static str {
        match self {
            Key::ReadUs | Key::WriteUs | Key::TailUs => {
                "a number of microseconds from 0 to 10000000 (10 s)"
            }
            Key::Jitter => "a coefficient of variation from 0 to 10",
            Key::TailPct | Key::ErrPct | Key::LostPct | Key::ResetPct | Key::StuckPct => {
                "a percentage from 0 to 100"
            }
            Key::Parallel => "an integer from 1 to 4096",
            Key::Mbps => "a transfer rate in MB/s from 1 to 1000000000000",
            Key::Seed => "an unsigned integer",
            Key::Size => "a size such as 4096, 512M, 8G, 1T",
            Key::Lba => "512 or 4096",
            Key::Mdts => "a power of two from 4K to 2M",
            Key::Backing => "ram, sparse or file:/path",
            Key::Queues => "an integer from 1 to 1024",
            Key::DriftPct => "a percentage of latency growth per second, from 0 to 1000",
        }
    }
}

impl EmuConfig {
    /// Parses `value` into the field of `k`; `None` if it does not parse.
    pub(super) fn assign(&mut self, k: Key, value: &str) -> Option<()> {
        let float = || value.parse::<f64>().ok();
        match k {
            Key::ReadUs => self.read_us = float()?,
            Key::WriteUs => self.write_us = float()?,
            Key::Jitter => self.jitter = float()?,
            Key::TailPct => self.tail_pct = float()?,
            Key::TailUs => self.tail_us = float()?,
            Key::Parallel => self.parallel = value.parse().ok()?,
            Key::Mbps => self.mbps = float()?,
            Key::Seed => self.seed = value.parse().ok()?,
            Key::Size => self.size_bytes = parse_size_bytes(value).ok()?,
            Key::Lba => {
                self.lba_bytes = match value {
                    "512" => 512,
                    "4096" | "4k" | "4K" => 4096,
                    _ => return None,
                }
            }
            Key::Mdts => self.mdts_bytes = u32::try_from(parse_size_bytes(value).ok()?).ok()?,
            Key::Backing => {
                self.backing = match value {
                    "ram" => Backing::Ram,
                    "sparse" => Backing::Sparse,
                    _ => Backing::File(PathBuf::from(value.strip_prefix("file:")?)),
                }
            }
            Key::ErrPct => self.err_pct = float()?,
            Key::LostPct => self.lost_pct = float()?,
            Key::ResetPct => self.reset_pct = float()?,
            Key::Queues => self.queues_max = value.parse().ok()?,
            Key::DriftPct => self.drift_pct = float()?,
            Key::StuckPct => self.stuck_pct = float()?,
        }
        Some(())
    }

    /// Whether the field of `k` holds a value the key accepts (NaN never does).
    pub(super) fn accepts(&self, k: Key) -> bool {
        let percent = |v: f64| (0.0..=100.0).contains(&v);
        match k {
            Key::ReadUs => (0.0..=LATENCY_US_MAX).contains(&self.read_us),
            Key::WriteUs => (0.0..=LATENCY_US_MAX).contains(&self.write_us),
            Key::TailUs => (0.0..=LATENCY_US_MAX).contains(&self.tail_us),
            Key::Jitter => (0.0..=JITTER_MAX).contains(&self.jitter),
            Key::TailPct => percent(self.tail_pct),
            Key::ErrPct => percent(self.err_pct),
            Key::LostPct => percent(self.lost_pct),
            Key::ResetPct => percent(self.reset_pct),
            Key::StuckPct => percent(self.stuck_pct),
            Key::Parallel => (1..=PARALLEL_MAX).contains(&self.parallel),
            Key::Mbps => (RATE_MBPS_MIN..=RATE_MBPS_MAX).contains(&self.mbps),
            Key::Seed => true,
            Key::Size => self.size_bytes > 0,
            Key::Lba => matches!(self.lba_bytes, 512 | 4096),
            Key::Mdts => {
                self.mdts_bytes.is_power_of_two()
                    && (MDTS_BYTES_MIN..=MDTS_BYTES_MAX).contains(&self.mdts_bytes)
            }
            Key::Backing => match &self.backing {
                Backing::File(path) => !path.as_os_str().is_empty(),
                Backing::Ram | Backing::Sparse => true,
            },
            Key::Queues => (1..=QUEUES_MAX).contains(&self.queues_max),
            Key::DriftPct => (0.0..=DRIFT_PCT_MAX).contains(&self.drift_pct),
        }
    }

    /// The value of `k` as a device string writes it (parsing it back gives the same value).
    pub(super) fn value_text(&self, k: Key) -> String {
        match k {
            Key::ReadUs => self.read_us.to_string(),
            Key::WriteUs => self.write_us.to_string(),
            Key::Jitter => self.jitter.to_string(),
            Key::TailPct => self.tail_pct.to_string(),
            Key::TailUs => self.tail_us.to_string(),
            Key::Parallel => self.parallel.to_string(),
            Key::Mbps => self.mbps.to_string(),
            Key::Seed => self.seed.to_string(),
            Key::Size => size_text(self.size_bytes),
            Key::Lba => self.lba_bytes.to_string(),
            Key::Mdts => size_text(u64::from(self.mdts_bytes)),
            Key::Backing => match &self.backing {
                Backing::Ram => "ram".to_string(),
                Backing::Sparse => "sparse".to_string(),
                Backing::File(path) => format!("file:{}", path.display()),
            },
            Key::ErrPct => self.err_pct.to_string(),
            Key::LostPct => self.lost_pct.to_string(),
            Key::ResetPct => self.reset_pct.to_string(),
            Key::Queues => self.queues_max.to_string(),
            Key::DriftPct => self.drift_pct.to_string(),
            Key::StuckPct => self.stuck_pct.to_string(),
        }
    }
}
