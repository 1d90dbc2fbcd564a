//! Configuration of the emulated controller: named latency profiles and the parameters that
//! override them. This file holds the configuration itself, its checks and its canonical
//! device string; `profiles` the named profiles, `keys` the keys and their bounds.

mod keys;
mod profiles;
#[cfg(test)]
mod tests;

use std::fmt;
use std::path::PathBuf;

use crate::config::ConfigError;
use keys::{Key, KEYS};
use profiles::PROFILES;

pub use keys::{
    DRIFT_PCT_MAX, EMU_KEYS, JITTER_MAX, LATENCY_US_MAX, MDTS_BYTES_MAX, MDTS_BYTES_MIN,
    PARALLEL_MAX, QUEUES_MAX, RATE_MBPS_MAX, RATE_MBPS_MIN,
};
pub use profiles::{profile_descriptions, profile_names};

/// Where the emulated namespace keeps its data.
#[derive(Clone, Debug, PartialEq)]
pub enum Backing {
    /// Memory allocated for the whole namespace up front (the OS still commits pages only as
    /// they are written).
    Ram,
    /// Memory allocated per 1 MiB chunk on first write: a 64 GiB namespace costs nothing until
    /// written. Unwritten blocks read as zeroes.
    Sparse,
    /// A regular file. A missing one is created (mode 0600) at the namespace size; an
    /// existing one is used for its first `size_bytes` and never grown, so one smaller than
    /// the namespace is refused. A symbolic link at the path, or anything but a regular
    /// file, is refused (see [`super::file`]).
    File(PathBuf),
}

/// The latency model's parameters, and the namespace shape. Times in microseconds where the
/// device string uses them, to match how drives are specified.
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
    /// Percent of commands that take the slow path: every kind of command, reads and
    /// writes (and flush, write zeroes, deallocate) alike.
    pub tail_pct: f64,
    /// Median latency of the slow path.
    pub tail_us: f64,
    /// Internal units working in parallel, per queue pair: beyond this many commands in
    /// flight on one queue pair, its commands queue inside the device, so IOPS saturate as
    /// on a real drive. Each queue pair has its own units (no lock on the submit path,
    /// timing that does not depend on other reactors), so a controller with N queue pairs
    /// serves up to N x `parallel` commands at once. A reset frees them.
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
    /// Open a file backing without write access (a read-only export:
    /// [`DeviceConfig::read_only`]): a missing file is refused rather than created, and
    /// nothing through this process can change the file. Not a key of the device string.
    ///
    /// [`DeviceConfig::read_only`]: crate::DeviceConfig::read_only
    pub read_only: bool,
    /// Percent of commands that complete with a media error status.
    pub err_pct: f64,
    /// Percent of commands that never complete (until a reset aborts them).
    pub lost_pct: f64,
    /// Percent of lost commands that an Abort cannot reach either (a hung command): only a
    /// reset completes them. The other lost commands are completed by an Abort with "Command
    /// Abort Requested".
    pub stuck_pct: f64,
    /// Percent of commands whose submission triggers a reset of the queue pair, aborting
    /// every command outstanding on it.
    pub reset_pct: f64,
    /// Most I/O queue pairs the controller hands out.
    pub queues_max: u32,
    /// Percent by which every service time grows per second since the controller was
    /// created: a device whose latency drifts slowly (wear, heat, a filling cache).
    pub drift_pct: f64,
}

impl EmuConfig {
    /// A device that completes commands as soon as they are polled, whatever their size: the
    /// emulator's own cost. The `dram` profile with every latency at 0 and free transfers;
    /// it describes itself as
    /// `emu:dram,read_us=0,write_us=0,jitter=0,tail_pct=0,tail_us=0,mbps=1000000000000`.
    pub fn zero_latency() -> EmuConfig {
        EmuConfig {
            read_us: 0.0,
            write_us: 0.0,
            jitter: 0.0,
            tail_pct: 0.0,
            tail_us: 0.0,
            mbps: RATE_MBPS_MAX,
            ..EmuConfig::profile("dram").expect("built-in profile")
        }
    }

    /// Applies one `key=value` override. The value is checked as [`EmuConfig::validate`]
    /// checks it; a bad one leaves the configuration unchanged.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let Some(k) = Key::from_name(key) else {
            return Err(ConfigError::UnknownKey {
                device: "emu".to_string(),
                key: key.to_string(),
                accepted: EMU_KEYS.join(", "),
            });
        };
        let bad = || ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            expected: k.expected().to_string(),
        };
        let mut next = self.clone();
        next.assign(k, value).ok_or_else(bad)?;
        if !next.accepts(k) {
            return Err(bad());
        }
        *self = next;
        Ok(())
    }

    /// Checks every parameter, so a configuration built as a struct is held to the same
    /// bounds as one parsed from a device string: each key's range (as [`EmuConfig::set`]
    /// checks it), a known profile, and what no single key can check: the size against the
    /// block size and the backing, MDTS against the block size.
    /// [`EmuController::with_clock`](super::EmuController::with_clock) calls it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !PROFILES.iter().any(|p| p.name == self.profile) {
            return Err(ConfigError::UnknownProfile {
                name: self.profile.to_string(),
                accepted: profile_names().join(", "),
            });
        }
        for k in KEYS {
            if !self.accepts(k) {
                return Err(ConfigError::BadValue {
                    key: k.name().to_string(),
                    value: self.value_text(k),
                    expected: k.expected().to_string(),
                });
            }
        }
        if !self.size_bytes.is_multiple_of(u64::from(self.lba_bytes)) {
            return Err(ConfigError::BadValue {
                key: "size".to_string(),
                value: self.size_bytes.to_string(),
                expected: format!("a multiple of the block size ({} bytes)", self.lba_bytes),
            });
        }
        if self.mdts_bytes < self.lba_bytes {
            return Err(ConfigError::BadValue {
                key: "mdts".to_string(),
                value: self.mdts_bytes.to_string(),
                expected: format!("at least one block ({} bytes)", self.lba_bytes),
            });
        }
        if !matches!(self.backing, Backing::File(_)) && self.size_bytes > MEMORY_BACKED_BYTES_MAX {
            return Err(ConfigError::BadValue {
                key: "size".to_string(),
                value: self.size_bytes.to_string(),
                expected: format!(
                    "at most {} TiB for a memory backing; use backing=file:/path",
                    MEMORY_BACKED_BYTES_MAX >> 40
                ),
            });
        }
        Ok(())
    }
}

/// The canonical device string: `emu:<profile>` followed by every key whose value differs
/// from the profile's default, in [`EMU_KEYS`] order (`emu:nand,read_us=23,size=8G`).
/// Parsing it gives back an equal configuration. Controllers describe themselves with it.
impl fmt::Display for EmuConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "emu:{}", self.profile)?;
        // An unknown profile (a struct-built configuration that fails validation) has no
        // defaults: every key is written.
        let defaults = EmuConfig::profile(self.profile).ok();
        for k in KEYS {
            let text = self.value_text(k);
            if defaults.as_ref().is_none_or(|d| d.value_text(k) != text) {
                write!(f, ",{}={text}", k.name())?;
            }
        }
        Ok(())
    }
}

/// Largest namespace a RAM or sparse backing accepts (its chunk table grows with the size).
pub const MEMORY_BACKED_BYTES_MAX: u64 = 1 << 40;
