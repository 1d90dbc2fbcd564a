//! What an interrupt wake-up costs in latency (`sleep=interruptible` only), priced by
//! experiment: while sleeps pay, one I/O in [`IRQ_PROBE_EVERY`] at queue depth 1 is a probe,
//! alternately spun through or waited for on the interrupt; the price is the difference of
//! the two arms' median latencies.

use super::calibration::SLEEP_REFRESH_EVERY;
use super::distribution::Distribution;
use super::reservoir::Reservoir;
use crate::policy::Decision;

/// Pricing the interrupt: while budgeted sleeps pay, one I/O in this many decided for at
/// queue depth 1 is an A/B probe, alternately spun all the way or waited for on the
/// interrupt from the start. A waited-for probe costs its I/O one interrupt wake-up, so
/// 1/128 of the I/Os pay it: the mean latency rises by a wake-up over 128 mean latencies, a
/// small fraction of the budget. Where sleeping does not pay, nothing is probed and nothing
/// paid.
pub(super) const IRQ_PROBE_EVERY: u64 = 64;
/// Probe latencies kept per arm, and how many each needs before the price is trusted.
const IRQ_PROBE_SAMPLES: usize = 128;
pub(super) const IRQ_PROBE_SAMPLES_MIN: usize = 32;
/// Probe latencies are kept as offsets from their bucket's median (so reads and writes mix),
/// shifted by this (about 18 minutes, more than any latency) to fit an unsigned reservoir.
pub(super) const OFFSET_ZERO_NS: u64 = 1 << 40;

/// The interrupt probes: their latencies, arm by arm, and the probe in flight.
#[derive(Clone)]
pub(super) struct InterruptPrice {
    /// Probe I/Os spun all the way, and probe I/Os waited for on the interrupt (offsets
    /// from their bucket's median, see [`OFFSET_ZERO_NS`]).
    pub(super) spun: Reservoir<IRQ_PROBE_SAMPLES>,
    pub(super) woken: Reservoir<IRQ_PROBE_SAMPLES>,
    /// The probe in flight: its submission time and whether it waits on the interrupt.
    probe: Option<(u64, bool)>,
    /// Probes started: their parity picks the arm.
    probes: u64,
}

impl InterruptPrice {
    pub(super) fn new() -> InterruptPrice {
        InterruptPrice {
            spun: Reservoir::empty(SLEEP_REFRESH_EVERY),
            woken: Reservoir::empty(SLEEP_REFRESH_EVERY),
            probe: None,
            probes: 0,
        }
    }

    fn assert_invariants(&self) {
        // The arms alternate, the waited-for one second.
        debug_assert!(self
            .probe
            .is_none_or(|(_, woken)| woken == self.probes.is_multiple_of(2)));
    }

    /// What waiting on the interrupt adds to an I/O's latency, once measured: the median
    /// latency of probe I/Os waited for on the interrupt less that of probe I/Os spun all
    /// the way (each an offset from its bucket's median).
    pub(super) fn cost_ns(&self) -> Option<u64> {
        if self.spun.sorted_len() < IRQ_PROBE_SAMPLES_MIN
            || self.woken.sorted_len() < IRQ_PROBE_SAMPLES_MIN
        {
            return None;
        }
        Some(
            self.woken
                .quantile(0.5)?
                .saturating_sub(self.spun.quantile(0.5)?),
        )
    }

    /// Times either arm's view was rebuilt: plans capped by the price are stale after.
    pub(super) fn refreshes(&self) -> u64 {
        self.spun.refreshes() + self.woken.refreshes()
    }

    /// A new oldest I/O, the `ios_seen`-th decided for, submitted at `submit_ns`: a probe
    /// if it is its turn and the I/O is `eligible` (alone, on a device with an interrupt,
    /// while interruptible sleeps would pay, its bucket planned for).
    pub(super) fn on_new_io(&mut self, ios_seen: u64, eligible: bool, submit_ns: u64) {
        self.assert_invariants();
        if eligible && ios_seen.is_multiple_of(IRQ_PROBE_EVERY) {
            self.probes += 1;
            self.probe = Some((submit_ns, self.probes.is_multiple_of(2)));
        }
        self.assert_invariants();
    }

    /// The probe's decision for the I/O submitted at `submit_ns`, if it is the probe: wait
    /// on the interrupt, or spin all the way.
    pub(super) fn probe_decision(&self, submit_ns: u64) -> Option<Decision> {
        match self.probe {
            Some((probe_ns, true)) if probe_ns == submit_ns => Some(Decision::WaitInterrupt),
            Some((probe_ns, false)) if probe_ns == submit_ns => Some(Decision::Spin),
            _ => None,
        }
    }

    /// A completion of the I/O submitted at `submit_ns`, seen `latency_ns` after it, in a
    /// bucket whose learnt latencies are `dist`: learnt in its arm if it was the probe.
    /// Returns whether it was.
    pub(super) fn record(&mut self, submit_ns: u64, latency_ns: u64, dist: &Distribution) -> bool {
        self.assert_invariants();
        let Some((probe_ns, woken)) = self.probe else {
            return false;
        };
        if probe_ns != submit_ns {
            return false;
        }
        self.probe = None;
        let offset_ns = (latency_ns + OFFSET_ZERO_NS).saturating_sub(dist.median_ns());
        if woken {
            self.woken.add(offset_ns);
        } else {
            self.spun.add(offset_ns);
        }
        self.assert_invariants();
        true
    }
}
