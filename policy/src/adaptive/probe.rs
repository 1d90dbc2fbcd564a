//! The I/Os `adaptive` decides for differently to keep its measurements true: short probe
//! sleeps, in bursts, that keep the overshoot and the cost of a sleep measured even while
//! sleeping does not pay; and I/Os spun through from submission, the only exact samples of
//! the latencies shorter than the wake-up.

use super::calibration::Calibration;
use super::distribution::Distribution;
use crate::policy::Decision;

/// Probe sleeps: shortest and longest, and I/Os per burst whose sleeps are learnt.
pub(super) const PROBE_SLEEP_NS: u64 = 1_000;
pub(super) const PROBE_SLEEP_NS_MAX: u64 = 10_000;
pub(super) const PROBE_BURST: u32 = 16;
/// A burst begins with this many more probes, whose sleeps are not learnt (neither their
/// overshoot nor their CPU): the first sleeps after a stretch of spinning measure the VM
/// waking up to a vCPU that halts again, a cost that a reactor sleeping for every I/O does
/// not pay. On the VMs measured, the first few sleeps of a burst overshot several times as
/// much as those from the tenth on, and sleeping one loop in 16 cost more overshoot and
/// more CPU per sleep than sleeping every loop (the figures, and the `sleep_regimes`
/// example of the reactor crate that measures them: see docs/lab/).
pub(super) const PROBE_WARMUP: u32 = 8;
/// A burst is due every this many I/Os.
pub(super) const PROBE_EVERY: u64 = 16_384;
/// A probe burst is also due when this long has passed since the last one: on a slow
/// device 16 384 I/Os take seconds, and a policy that stopped sleeping on a stretch of bad
/// overshoots would spin all that time, at a CPU cost well above what sleeping costs there.
const PROBE_EVERY_NS: u64 = 100_000_000;
/// While budgeted sleeps pay at queue depth 1, one I/O in this many is spun through from
/// its submission (no sleep): these are the only exact samples of the latencies shorter
/// than the wake-up, which every other I/O sleeps through. They cost a little CPU (see
/// docs/results.md for what `adaptive` spends).
pub(super) const SPIN_PROBE_EVERY: u64 = 32;

/// The state of the probes: the current burst of probe sleeps, and the I/O being spun
/// through.
#[derive(Clone)]
pub(super) struct Probes {
    /// Probes left in the current burst, warm-up included.
    burst_left: u32,
    /// When the last burst started (0: before the first question).
    burst_at_ns: u64,
    /// The I/O (its number among those decided for) that had the last probe.
    probed_io: u64,
    /// The I/O (its submission time) being spun through as a [`SPIN_PROBE_EVERY`] probe.
    spin_probe_ns: Option<u64>,
    /// Whether the latest budgeted decision was a sleep: the spin and interrupt probes are
    /// only worth their cost while sleeps pay.
    pub(super) budget_sleeps: bool,
}

impl Probes {
    /// The first burst is due at once (the reactor spins until its bucket has samples).
    pub(super) fn new() -> Probes {
        Probes {
            burst_left: PROBE_WARMUP + PROBE_BURST,
            burst_at_ns: 0,
            probed_io: 0,
            spin_probe_ns: None,
            budget_sleeps: false,
        }
    }

    fn assert_invariants(&self, ios_seen: u64) {
        debug_assert!(self.burst_left <= PROBE_WARMUP + PROBE_BURST);
        debug_assert!(
            self.probed_io <= ios_seen,
            "a probe for an I/O not seen yet"
        );
    }

    /// A new oldest I/O, the `ios_seen`-th decided for, submitted at `submit_ns` with
    /// `outstanding` I/Os in flight: whether it is spun through as a spin probe. Offset by
    /// half a period from the interrupt probes, which need the plan.
    pub(super) fn on_new_io(&mut self, ios_seen: u64, outstanding: usize, submit_ns: u64) {
        self.assert_invariants(ios_seen);
        self.spin_probe_ns = (self.budget_sleeps
            && outstanding == 1
            && ios_seen % SPIN_PROBE_EVERY == SPIN_PROBE_EVERY / 2)
            .then_some(submit_ns);
        self.assert_invariants(ios_seen);
    }

    /// Whether the I/O submitted at `submit_ns` is the spin probe: it never sleeps.
    pub(super) fn is_spin_probe(&self, submit_ns: u64) -> bool {
        self.spin_probe_ns == Some(submit_ns)
    }

    /// A completion of the I/O submitted at `submit_ns`: whether it was the spin probe
    /// (which is then over).
    pub(super) fn spin_probe_completed(&mut self, submit_ns: u64) -> bool {
        let spin_probe = self.is_spin_probe(submit_ns);
        if spin_probe {
            self.spin_probe_ns = None;
        }
        debug_assert!(!self.is_spin_probe(submit_ns));
        spin_probe
    }

    /// A probe sleep for the current I/O (the `ios_seen`-th, `elapsed_ns` in flight, with
    /// `outstanding` in flight, of a bucket whose learnt latencies are `dist`), when one is
    /// due and the I/O leaves room for it: a short sleep, now and then, while the I/O is
    /// unlikely to complete during it. A burst that starts here restarts `calibration`'s.
    pub(super) fn probe_sleep(
        &mut self,
        now_ns: u64,
        ios_seen: u64,
        outstanding: usize,
        elapsed_ns: u64,
        dist: &Distribution,
        calibration: &mut Calibration,
    ) -> Option<Decision> {
        self.assert_invariants(ios_seen);
        if !self.may_be_due(now_ns, ios_seen) {
            return None;
        }
        // Under load, an I/O decided for has usually outlived most samples (it waited its
        // turn), and too few lie above it to say when it will complete; the probe then takes
        // the longest length: it delays a batch, not one I/O. Without probes there, a
        // reactor that stopped batching on a bad stretch of overshoots would never measure
        // them again.
        let unknown_room_ns = if outstanding >= 2 {
            elapsed_ns + 2 * PROBE_SLEEP_NS_MAX
        } else {
            elapsed_ns
        };
        let room = dist
            .wake_within_budget(elapsed_ns, 0)
            .unwrap_or(unknown_room_ns);
        // Half the room before the fastest completion seen, at least 1 us, at most
        // 10 us: a probe as long as the sleeps it calibrates (very short sleeps behave
        // differently on a VM), and short of the I/O's earliest completion.
        let probe_ns =
            ((room - elapsed_ns.min(room)) / 2).clamp(PROBE_SLEEP_NS, PROBE_SLEEP_NS_MAX);
        if room >= elapsed_ns + 2 * PROBE_SLEEP_NS && self.due(now_ns, ios_seen, calibration) {
            // It ends in the first half of the room before the earliest completion.
            debug_assert!(elapsed_ns + 2 * probe_ns <= room);
            debug_assert_eq!(self.probed_io, ios_seen);
            self.assert_invariants(ios_seen);
            return Some(Decision::sleep_ns(probe_ns));
        }
        self.assert_invariants(ios_seen);
        None
    }

    /// Whether [`Probes::due`] could answer yes for this I/O: a cheap test that spares the
    /// search for a probe's room on every other I/O.
    fn may_be_due(&mut self, now_ns: u64, ios_seen: u64) -> bool {
        if self.probed_io == ios_seen {
            return false;
        }
        if self.burst_at_ns == 0 {
            self.burst_at_ns = now_ns;
        }
        self.burst_left > 0
            || ios_seen.is_multiple_of(PROBE_EVERY)
            || now_ns >= self.burst_at_ns + PROBE_EVERY_NS
    }

    /// Whether this I/O gets a probe sleep. Probes come in bursts of [`PROBE_WARMUP`] +
    /// [`PROBE_BURST`] consecutive I/Os, one burst at the start and one every
    /// [`PROBE_EVERY`] I/Os or [`PROBE_EVERY_NS`], whichever comes first: on a VM, a sleep
    /// after a long stretch of spinning wakes far later (most likely the host no longer
    /// polls a vCPU that rarely halts) than sleeps that follow each other, so lone probes
    /// would measure a cost that sleeping regularly does not have, and a burst's first
    /// sleeps are not learnt.
    ///
    /// A burst that starts after the policy stopped sleeping also replaces the overshoots
    /// measured before (see [`Calibration::begin_burst`]).
    fn due(&mut self, now_ns: u64, ios_seen: u64, calibration: &mut Calibration) -> bool {
        if !self.may_be_due(now_ns, ios_seen) {
            return false;
        }
        // Not in a burst, yet due: a new burst starts.
        if self.burst_left == 0 {
            self.burst_left = PROBE_WARMUP + PROBE_BURST;
            self.burst_at_ns = now_ns;
            calibration.begin_burst();
        }
        self.burst_left -= 1;
        self.probed_io = ios_seen;
        true
    }
}
