//! Configuration of the emulated controller: named latency profiles and the parameters that
//! override them.

use std::fmt;
use std::path::PathBuf;

use crate::config::{parse_size_bytes, size_text, ConfigError};

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

/// Keys `emu:` accepts, for error messages and documentation, in the order a spec string
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
pub const MAX_DRIFT_PCT: f64 = 1_000.0;
/// Longest median latency `read_us`, `write_us` and `tail_us` accept: 10 s. Deadlines are
/// nanosecond `u64`s; the controller's deadline arithmetic saturates as well.
pub const MAX_LATENCY_US: f64 = 10_000_000.0;
/// Largest `jitter` (coefficient of variation).
pub const MAX_JITTER: f64 = 10.0;
/// Most internal units (`parallel`) per queue pair.
pub const MAX_PARALLEL: u32 = 4096;
/// Slowest transfer rate (`mbps`): at 1 MB/s the largest transfer (2 MiB) takes about 2 s.
pub const MIN_RATE_MBPS: f64 = 1.0;
/// Fastest transfer rate (`mbps`): at 10^12 MB/s a 2 MiB transfer takes 0.002 ns, which
/// rounds to nothing: transfers are free ([`EmuConfig::zero_latency`] uses it).
pub const MAX_RATE_MBPS: f64 = 1e12;
/// Smallest and largest MDTS (`mdts`), powers of two.
pub const MIN_MDTS_BYTES: u32 = 4096;
pub const MAX_MDTS_BYTES: u32 = 2 << 20;
/// Most I/O queue pairs (`queues`) a controller hands out.
pub const MAX_QUEUES: u32 = 1024;

/// One `emu:` key, tied to its field of [`EmuConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
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
const KEYS: [Key; 18] = [
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
    fn name(self) -> &'static str {
        EMU_KEYS[KEYS
            .iter()
            .position(|&k| k == self)
            .expect("every key is listed")]
    }

    fn from_name(name: &str) -> Option<Key> {
        EMU_KEYS.iter().position(|&k| k == name).map(|i| KEYS[i])
    }

    /// What the key accepts, in words.
    fn expected(self) -> &'static str {
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
            err_pct: 0.0,
            lost_pct: 0.0,
            reset_pct: 0.0,
            stuck_pct: 0.0,
            drift_pct: 0.0,
            queues_max: 64,
        })
    }

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
            mbps: MAX_RATE_MBPS,
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

    /// Parses `value` into the field of `k`; `None` if it does not parse.
    fn assign(&mut self, k: Key, value: &str) -> Option<()> {
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
    fn accepts(&self, k: Key) -> bool {
        let percent = |v: f64| (0.0..=100.0).contains(&v);
        match k {
            Key::ReadUs => (0.0..=MAX_LATENCY_US).contains(&self.read_us),
            Key::WriteUs => (0.0..=MAX_LATENCY_US).contains(&self.write_us),
            Key::TailUs => (0.0..=MAX_LATENCY_US).contains(&self.tail_us),
            Key::Jitter => (0.0..=MAX_JITTER).contains(&self.jitter),
            Key::TailPct => percent(self.tail_pct),
            Key::ErrPct => percent(self.err_pct),
            Key::LostPct => percent(self.lost_pct),
            Key::ResetPct => percent(self.reset_pct),
            Key::StuckPct => percent(self.stuck_pct),
            Key::Parallel => (1..=MAX_PARALLEL).contains(&self.parallel),
            Key::Mbps => (MIN_RATE_MBPS..=MAX_RATE_MBPS).contains(&self.mbps),
            Key::Seed => true,
            Key::Size => self.size_bytes > 0,
            Key::Lba => matches!(self.lba_bytes, 512 | 4096),
            Key::Mdts => {
                self.mdts_bytes.is_power_of_two()
                    && (MIN_MDTS_BYTES..=MAX_MDTS_BYTES).contains(&self.mdts_bytes)
            }
            Key::Backing => match &self.backing {
                Backing::File(path) => !path.as_os_str().is_empty(),
                Backing::Ram | Backing::Sparse => true,
            },
            Key::Queues => (1..=MAX_QUEUES).contains(&self.queues_max),
            Key::DriftPct => (0.0..=MAX_DRIFT_PCT).contains(&self.drift_pct),
        }
    }

    /// The value of `k` as a spec string writes it (parsing it back gives the same value).
    fn value_text(&self, k: Key) -> String {
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

    /// Checks every parameter, so a configuration built as a struct is held to the same
    /// bounds as one parsed from a spec string: each key's range (as [`EmuConfig::set`]
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
        if !matches!(self.backing, Backing::File(_)) && self.size_bytes > MAX_MEMORY_BACKED_BYTES {
            return Err(ConfigError::BadValue {
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

/// The canonical spec string: `emu:<profile>` followed by every key whose value differs
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

    fn parse(spec: &str) -> EmuConfig {
        match spec.parse::<crate::DeviceConfig>().unwrap() {
            crate::DeviceConfig::Emu(cfg) => cfg,
            other => panic!("not emu: {other:?}"),
        }
    }

    #[test]
    fn spec_strings_name_the_profile_and_what_differs_from_it() {
        assert_eq!(
            EmuConfig::profile("optane").unwrap().to_string(),
            "emu:optane"
        );
        let mut cfg = EmuConfig::profile("nand").unwrap();
        cfg.read_us = 23.0;
        cfg.size_bytes = 8 << 30;
        assert_eq!(cfg.to_string(), "emu:nand,read_us=23,size=8G");
        assert_eq!(
            EmuConfig::zero_latency().to_string(),
            "emu:dram,read_us=0,write_us=0,jitter=0,tail_pct=0,tail_us=0,mbps=1000000000000"
        );
    }

    #[test]
    fn spec_strings_round_trip() {
        let mut odd = EmuConfig::profile("zssd").unwrap();
        odd.read_us = 0.1 + 0.2; // not exactly 0.3: the text must carry every bit
        odd.jitter = 1.0 / 3.0;
        odd.mbps = 1234.5678;
        odd.size_bytes = 3 * 512 + (5 << 20);
        odd.mdts_bytes = 4096;
        odd.seed = u64::MAX;
        for cfg in [
            EmuConfig::profile("optane").unwrap(),
            EmuConfig::zero_latency(),
            parse("emu:nand,read_us=23,jitter=0.3,seed=7"),
            parse("emu:p5800x,size=1G,lba=4096,mdts=2M,backing=ram,queues=3,parallel=1"),
            parse("emu:dram,err_pct=1.5,lost_pct=0.25,reset_pct=0.001,tail_us=7.75"),
            parse("emu:optane,lost_pct=5,stuck_pct=50"),
            parse("emu:optane,backing=file:/tmp/ns.img,size=8G"),
            odd,
        ] {
            cfg.validate().unwrap();
            let text = cfg.to_string();
            assert_eq!(parse(&text), cfg, "{text}");
            assert_eq!(
                crate::DeviceConfig::Emu(cfg.clone()).to_string(),
                text,
                "DeviceConfig says the same"
            );
        }
    }

    #[test]
    fn zero_latency_makes_transfers_free_too() {
        let mut model = super::super::latency::LatencyModel::new(&EmuConfig::zero_latency(), 0);
        for bytes in [512, 4096, 128 << 10, 2 << 20] {
            assert_eq!(
                model.sample_ns(super::super::latency::LatencyClass::Read, bytes),
                0,
                "{bytes} bytes"
            );
        }
    }

    #[test]
    fn keys_and_their_names_agree() {
        for (i, k) in KEYS.iter().enumerate() {
            assert_eq!(k.name(), EMU_KEYS[i]);
            assert_eq!(Key::from_name(EMU_KEYS[i]), Some(*k));
        }
        assert_eq!(Key::from_name("colour"), None);
    }

    /// Each bound, as a spec string meets it and as a struct-built configuration meets it:
    /// `set` refuses the value (and leaves the configuration unchanged), `validate` names
    /// the key.
    #[test]
    fn every_key_is_bounded_in_set_and_in_validate() {
        type Poke = fn(&mut EmuConfig);
        let cases: &[(&str, &str, Poke)] = &[
            ("read_us", "1e300", |c| c.read_us = 1e300),
            ("read_us", "10000000.5", |c| c.read_us = 10_000_000.5),
            ("write_us", "-1", |c| c.write_us = -1.0),
            ("tail_us", "NaN", |c| c.tail_us = f64::NAN),
            ("tail_us", "inf", |c| c.tail_us = f64::INFINITY),
            ("jitter", "10.01", |c| c.jitter = 10.01),
            ("jitter", "NaN", |c| c.jitter = f64::NAN),
            ("tail_pct", "100.1", |c| c.tail_pct = 100.1),
            ("err_pct", "-0.5", |c| c.err_pct = -0.5),
            ("lost_pct", "NaN", |c| c.lost_pct = f64::NAN),
            ("reset_pct", "200", |c| c.reset_pct = 200.0),
            ("stuck_pct", "100.5", |c| c.stuck_pct = 100.5),
            ("parallel", "0", |c| c.parallel = 0),
            ("parallel", "4097", |c| c.parallel = 4097),
            ("mbps", "0", |c| c.mbps = 0.0),
            ("mbps", "0.5", |c| c.mbps = 0.5),
            ("mbps", "inf", |c| c.mbps = f64::INFINITY),
            ("mbps", "NaN", |c| c.mbps = f64::NAN),
            ("mbps", "2e12", |c| c.mbps = 2e12),
            ("size", "0", |c| c.size_bytes = 0),
            ("lba", "1024", |c| c.lba_bytes = 1024),
            ("mdts", "3000", |c| c.mdts_bytes = 3000),
            ("mdts", "2048", |c| c.mdts_bytes = 2048),
            ("mdts", "4M", |c| c.mdts_bytes = 4 << 20),
            ("backing", "file:", |c| {
                c.backing = Backing::File(PathBuf::new())
            }),
            ("queues", "0", |c| c.queues_max = 0),
            ("queues", "1025", |c| c.queues_max = 1025),
        ];
        for &(key, text, poke) in cases {
            let good = EmuConfig::profile("nand").unwrap();
            let mut cfg = good.clone();
            let err = cfg.set(key, text).unwrap_err().to_string();
            assert!(
                err.contains(key) && err.contains("expected"),
                "{key}={text}: {err}"
            );
            assert_eq!(cfg, good, "a refused value changes nothing ({key}={text})");
            poke(&mut cfg);
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains(key), "validate on {key}={text}: {err}");
            let err = crate::EmuController::new(cfg).err().expect("refused");
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{key}={text}");
        }
        // The edges themselves are accepted.
        let mut cfg = EmuConfig::profile("nand").unwrap();
        for (key, text) in [
            ("read_us", "10000000"),
            ("write_us", "0"),
            ("jitter", "10"),
            ("tail_pct", "100"),
            ("parallel", "4096"),
            ("mbps", "1"),
            ("mbps", "1000000000000"),
            ("mdts", "2M"),
            ("queues", "1024"),
        ] {
            cfg.set(key, text)
                .unwrap_or_else(|e| panic!("{key}={text}: {e}"));
        }
        cfg.validate().unwrap();
        // Cross-field and profile checks.
        let mut cfg = EmuConfig::profile("nand").unwrap();
        cfg.lba_bytes = 4096;
        cfg.size_bytes = 4096 * 3 + 512;
        assert!(cfg.validate().is_err());
        let cfg = EmuConfig {
            profile: "floppy",
            ..EmuConfig::profile("nand").unwrap()
        };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("floppy"), "{err}");
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
