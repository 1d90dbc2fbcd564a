//! One reactor's side of the statistics: recording without atomics or locks, and handing
//! each finished window to the device.

use std::fmt;
use std::sync::Arc;

use super::device::{new_window, window_end_ns, Shared, Window};
use super::{Bucket, DeviceStats, OvershootStats, Snapshot};

/// One reactor's side of the statistics: records completions and sleeps without atomics or
/// locks, hands its windows to the [`DeviceStats`] and keeps a copy of the published
/// [`Snapshot`]. Owned by one reactor (it is `Send`, so it can be built before the reactor
/// thread starts).
pub struct StatsRecorder {
    device: Arc<DeviceStats>,
    /// This recorder's slot in the device.
    slot: usize,
    window_ns: u64,
    /// Index of the window being recorded.
    window: u64,
    window_end_ns: u64,
    samples: Box<Window>,
    has_samples: bool,
    snapshot: Snapshot,
    /// Has finished a window that the device has not published yet.
    awaiting_publication: bool,
    overshoot: OvershootStats,
}

impl StatsRecorder {
    /// A recorder in slot `slot` of `device`, recording window `window`, starting from the
    /// published `snapshot`.
    pub(super) fn new(
        device: Arc<DeviceStats>,
        slot: usize,
        window: u64,
        snapshot: Snapshot,
    ) -> StatsRecorder {
        let window_ns = device.window_ns();
        StatsRecorder {
            device,
            slot,
            window_ns,
            window,
            window_end_ns: window_end_ns(window, window_ns),
            samples: new_window(),
            has_samples: false,
            snapshot,
            awaiting_publication: false,
            overshoot: OvershootStats::new(),
        }
    }

    /// Records one completion of `bucket` that took `latency_ns` (completion seen minus
    /// submission). Hot path: plain stores, O(1).
    #[inline]
    pub fn record(&mut self, bucket: Bucket, latency_ns: u64) {
        self.samples[bucket.index()].record(latency_ns);
        self.has_samples = true;
    }

    /// Records one sleep that asked for `requested_ns` and lasted `actual_ns` into the
    /// overshoot distribution; returns the overshoot. Call it when the reactor wakes.
    #[inline]
    pub fn record_sleep(&mut self, requested_ns: u64, actual_ns: u64) -> u64 {
        self.overshoot.record(requested_ns, actual_ns)
    }

    /// Advances the recorder's clock to `now_ns` (the reactor's timestamp of this poll
    /// batch). At a window boundary, hands the window to the device and refreshes the
    /// snapshot. Returns whether [`StatsRecorder::snapshot`] changed.
    #[inline]
    pub fn tick(&mut self, now_ns: u64) -> bool {
        if now_ns >= self.window_end_ns {
            return self.end_window(now_ns);
        }
        if self.awaiting_publication
            && self.device.published_generation() != self.snapshot.generation
        {
            return self.refresh();
        }
        false
    }

    /// The published statistics, as of the last refresh. Reads no shared memory.
    #[inline]
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// This reactor's wake-up overshoot distribution.
    #[inline]
    pub fn overshoot(&self) -> &OvershootStats {
        &self.overshoot
    }

    /// This reactor's wake-up overshoot distribution, to clear it.
    pub fn overshoot_mut(&mut self) -> &mut OvershootStats {
        &mut self.overshoot
    }

    /// Length of a window in nanoseconds.
    pub const fn window_ns(&self) -> u64 {
        self.window_ns
    }

    /// The device this recorder hands its windows to.
    pub fn device(&self) -> &Arc<DeviceStats> {
        &self.device
    }

    #[cold]
    fn end_window(&mut self, now_ns: u64) -> bool {
        let (slot, window) = (self.slot, self.window);
        let next_window = now_ns / self.window_ns;
        let samples = self.has_samples.then_some(&*self.samples);
        let snapshot = &mut self.snapshot;
        let (awaiting, changed) = self.device.with_shared(|shared| {
            shared.hand_in(slot, window, next_window, samples);
            (
                shared.open_window < next_window,
                copy_if_newer(snapshot, shared),
            )
        });
        self.awaiting_publication = awaiting;
        if self.has_samples {
            for histogram in self.samples.iter_mut() {
                histogram.clear();
            }
            self.has_samples = false;
        }
        self.window = next_window;
        self.window_end_ns = window_end_ns(next_window, self.window_ns);
        changed
    }

    #[cold]
    fn refresh(&mut self) -> bool {
        let window = self.window;
        let snapshot = &mut self.snapshot;
        let (awaiting, changed) = self
            .device
            .with_shared(|shared| (shared.open_window < window, copy_if_newer(snapshot, shared)));
        self.awaiting_publication = awaiting;
        changed
    }
}

fn copy_if_newer(snapshot: &mut Snapshot, shared: &Shared) -> bool {
    if shared.published.generation == snapshot.generation {
        return false;
    }
    snapshot.clone_from(&shared.published);
    true
}

impl Drop for StatsRecorder {
    /// Leaves the device, adding the partial window to the open one; the last recorder to
    /// leave publishes what is left, so the end of a run is not lost.
    fn drop(&mut self) {
        let slot = self.slot;
        let samples = self.has_samples.then_some(&*self.samples);
        self.device
            .with_shared(|shared| shared.leave(slot, samples));
    }
}

impl fmt::Debug for StatsRecorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatsRecorder")
            .field("window", &self.window)
            .field("window_end_ns", &self.window_end_ns)
            .field("generation", &self.snapshot.generation)
            .finish_non_exhaustive()
    }
}
