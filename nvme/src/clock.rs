//! The time base of the emulated controller: the real monotonic clock, or a virtual clock a
//! test moves by hand so the latency model runs deterministically.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Nanoseconds on CLOCK_MONOTONIC (real) or on a test's virtual timeline.
#[derive(Clone, Debug, Default)]
pub enum Clock {
    /// CLOCK_MONOTONIC: deadlines can arm a timerfd.
    #[default]
    Monotonic,
    /// Time stands still until the test advances it.
    Virtual(VirtualClock),
}

impl Clock {
    #[inline]
    pub fn now_ns(&self) -> u64 {
        match self {
            Clock::Monotonic => crate::sys::monotonic_ns(),
            Clock::Virtual(v) => v.now_ns(),
        }
    }

    pub fn is_virtual(&self) -> bool {
        matches!(self, Clock::Virtual(_))
    }
}

/// A shared, manually advanced timeline. Cloning shares the same time.
#[derive(Clone, Debug, Default)]
pub struct VirtualClock {
    now_ns: Arc<AtomicU64>,
}

impl VirtualClock {
    pub fn new(start_ns: u64) -> VirtualClock {
        VirtualClock {
            now_ns: Arc::new(AtomicU64::new(start_ns)),
        }
    }

    pub fn now_ns(&self) -> u64 {
        self.now_ns.load(Ordering::Acquire)
    }

    /// Moves time forward to `t_ns`; never backwards.
    pub fn advance_to(&self, t_ns: u64) {
        self.now_ns.fetch_max(t_ns, Ordering::AcqRel);
    }

    pub fn advance_by(&self, d_ns: u64) {
        self.now_ns.fetch_add(d_ns, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_time_moves_only_forward_and_is_shared() {
        let v = VirtualClock::new(100);
        let clock = Clock::Virtual(v.clone());
        assert_eq!(clock.now_ns(), 100);
        v.advance_by(50);
        assert_eq!(clock.now_ns(), 150);
        v.advance_to(120);
        assert_eq!(clock.now_ns(), 150);
        v.advance_to(1_000);
        assert_eq!(clock.now_ns(), 1_000);
    }
}
