//! The emulated controller's latency model.
//!
//! A command's service time is log-normal around a median that depends on direction and
//! transfer size: `median = base(direction) + (bytes beyond 4 KiB) / rate`, with the spread
//! set by the coefficient of variation `jitter` (sigma = sqrt(ln(1 + jitter^2))). A fraction
//! `tail_pct` of commands, of every kind, take a slow path with median `tail_us` instead
//! (garbage collection, a busy die). Internal units (`parallel`) are handled by each queue pair, not here.

use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal};
use rand_pcg::Pcg64Mcg;

use super::config::EmuConfig;

/// Transfers up to this size cost the base latency; larger ones add transfer time.
pub const BASE_TRANSFER_BYTES: u64 = 4096;

/// Which median a command draws from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LatencyClass {
    Read,
    /// Writes, flush, write zeroes and deallocate.
    Write,
}

#[derive(Clone, Debug)]
pub struct LatencyModel {
    read_median_ns: f64,
    write_median_ns: f64,
    tail_median_ns: f64,
    tail_fraction: f64,
    ns_per_byte: f64,
    /// Log-normal factor with median 1; `None` when jitter is 0.
    spread: Option<LogNormal<f64>>,
    rng: Pcg64Mcg,
}

impl LatencyModel {
    /// A model for one queue pair; `stream` separates the random streams of queue pairs that
    /// share a seed.
    pub fn new(cfg: &EmuConfig, stream: u64) -> LatencyModel {
        let sigma = (1.0 + cfg.jitter * cfg.jitter).ln().sqrt();
        let spread = (sigma > 0.0).then(|| LogNormal::new(0.0, sigma).expect("finite sigma"));
        // 1 MB/s = 1 byte/us = 1e-3 bytes/ns.
        let ns_per_byte = 1_000.0 / cfg.mbps;
        LatencyModel {
            read_median_ns: cfg.read_us * 1_000.0,
            write_median_ns: cfg.write_us * 1_000.0,
            tail_median_ns: cfg.tail_us * 1_000.0,
            tail_fraction: cfg.tail_pct / 100.0,
            ns_per_byte,
            spread,
            rng: Pcg64Mcg::seed_from_u64(mix(cfg.seed, stream)),
        }
    }

    /// The service time of one command moving `bytes`.
    pub fn sample_ns(&mut self, class: LatencyClass, bytes: u64) -> u64 {
        let base = if self.tail_fraction > 0.0 && self.rng.random::<f64>() < self.tail_fraction {
            self.tail_median_ns
        } else {
            match class {
                LatencyClass::Read => self.read_median_ns,
                LatencyClass::Write => self.write_median_ns,
            }
        };
        let transfer = bytes.saturating_sub(BASE_TRANSFER_BYTES) as f64 * self.ns_per_byte;
        let median = base + transfer;
        let factor = match &self.spread {
            Some(dist) => dist.sample(&mut self.rng),
            None => 1.0,
        };
        (median * factor) as u64
    }

    /// Draws `true` with probability `pct` percent (fault injection shares the stream).
    pub fn chance(&mut self, pct: f64) -> bool {
        pct > 0.0 && self.rng.random::<f64>() * 100.0 < pct
    }
}

/// SplitMix64's finaliser: turns (seed, stream) into well-separated generator seeds.
fn mix(seed: u64, stream: u64) -> u64 {
    let mut z = seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_grows_with_transfer_size() {
        let mut cfg = EmuConfig::profile("optane").unwrap();
        cfg.jitter = 0.0;
        cfg.tail_pct = 0.0;
        let mut model = LatencyModel::new(&cfg, 0);
        let small = model.sample_ns(LatencyClass::Read, 512);
        let base = model.sample_ns(LatencyClass::Read, 4096);
        let big = model.sample_ns(LatencyClass::Read, 128 << 10);
        assert_eq!(small, 9_000);
        assert_eq!(base, 9_000);
        // 124 KiB more at 2500 MB/s = 126976 bytes * 0.4 ns = 50.8 us more.
        assert_eq!(big, 9_000 + 50_790);
    }

    #[test]
    fn same_seed_same_stream_same_latencies() {
        let cfg = EmuConfig::profile("nand").unwrap();
        let draw = |stream| {
            let mut m = LatencyModel::new(&cfg, stream);
            (0..1000)
                .map(|_| m.sample_ns(LatencyClass::Read, 4096))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }
}
