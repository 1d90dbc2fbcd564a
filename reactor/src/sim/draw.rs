//! The seed's generator, and the draws both runners share.

/// SplitMix64: a small, well-mixed generator, so a seed means the same run on every
/// platform and version of any crate.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0; the bias of the modulo is irrelevant here).
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub(super) fn pct(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

/// Draws how a device answers recovery: (can abort, can reset, in words).
pub(super) fn recovery_mode(rng: &mut Rng) -> (bool, bool, &'static str) {
    match rng.below(10) {
        0..=4 => (true, true, "abort+reset"),
        5..=6 => (false, true, "reset only"),
        7 => (true, false, "abort only"),
        _ => (false, false, "neither"),
    }
}

/// Folds `v` into the trace hash `h` (FNV-1a over the value's bytes): a run's trace is the
/// fold of its events in order, so two runs of one seed give one hash.
pub(super) fn mix(h: u64, v: u64) -> u64 {
    let mut h = if h == 0 { 0xcbf2_9ce4_8422_2325 } else { h };
    for byte in v.to_le_bytes() {
        h ^= u64::from(byte);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
