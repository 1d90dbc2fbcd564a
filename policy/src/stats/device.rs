//! The shared per-device side of the statistics: where recorders hand in their windows,
//! and where a window is published once every recorder has finished it.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{
    BucketStats, Snapshot, StatsRecorder, BUCKETS, DEFAULT_WINDOW_MS, NS_PER_MS, WINDOW_MS_MAX,
    WINDOW_MS_MIN,
};
use crate::histogram::Histogram;

/// One window's samples: a histogram per bucket.
pub(super) type Window = [Histogram; BUCKETS];

pub(super) fn new_window() -> Box<Window> {
    Box::new(std::array::from_fn(|_| Histogram::new()))
}

/// An invalid statistics configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StatsConfigError {
    /// The window is outside `WINDOW_MS_MIN..=WINDOW_MS_MAX`.
    WindowOutOfRange {
        /// The window asked for.
        window_ms: u64,
    },
}

impl fmt::Display for StatsConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::WindowOutOfRange { window_ms } => write!(
                f,
                "statistics window of {window_ms} ms is out of range \
                 ({WINDOW_MS_MIN} to {WINDOW_MS_MAX} ms)"
            ),
        }
    }
}

impl std::error::Error for StatsConfigError {}

/// The shared per-device view: where recorders hand in their windows and where the published
/// [`Snapshot`] lives. Shared by `Arc`; locked once per window per recorder, never per I/O.
pub struct DeviceStats {
    window_ns: u64,
    /// Mirror of `Shared::published.generation`, so a recorder waiting for a publication can
    /// check for it without the lock (once per poll batch, only while it waits).
    generation: AtomicU64,
    shared: Mutex<Shared>,
}

/// The device's state behind its lock.
pub(super) struct Shared {
    /// Index of the window being gathered.
    pub(super) open_window: u64,
    open: Box<Window>,
    /// One slot per recorder: the window it is recording (it has finished every window
    /// before that); `None` once it has left. Grows only when a recorder is made.
    pub(super) recorders: Vec<Option<u64>>,
    pub(super) published: Snapshot,
    /// Every sample ever published, to check that none is lost or counted twice.
    #[cfg(test)]
    pub(super) published_samples: u64,
}

impl Shared {
    /// Recorder `slot` hands in the samples it recorded in window `window` and moves to
    /// window `next_window`, having finished every window before it. The open window is
    /// published when every recorder has finished it, or at once when these samples are
    /// already past it (whoever has not finished it was silent for a whole window). Samples
    /// of a window older than the open one are late and count in the open one.
    pub(super) fn hand_in(
        &mut self,
        slot: usize,
        window: u64,
        next_window: u64,
        samples: Option<&Window>,
    ) {
        if window > self.open_window {
            self.publish();
            self.open_window = window;
        }
        self.merge(samples);
        self.recorders[slot] = Some(next_window);
        self.publish_if_finished();
    }

    /// Recorder `slot` leaves; its unfinished window's samples count in the open window
    /// (the others may still be in it, so leaving never forces a publication).
    pub(super) fn leave(&mut self, slot: usize, samples: Option<&Window>) {
        self.merge(samples);
        self.recorders[slot] = None;
        self.publish_if_finished();
    }

    /// Publishes the open window if every live recorder has finished it, and opens the
    /// earliest window some recorder is still in.
    fn publish_if_finished(&mut self) {
        let earliest = self.recorders.iter().flatten().min().copied();
        match earliest {
            Some(window) if window <= self.open_window => {}
            _ => {
                self.publish();
                self.open_window = earliest.unwrap_or(self.open_window + 1);
            }
        }
    }

    fn merge(&mut self, samples: Option<&Window>) {
        if let Some(samples) = samples {
            for (open, theirs) in self.open.iter_mut().zip(samples.iter()) {
                open.merge(theirs);
            }
        }
    }

    /// Publishes the open window: every bucket with samples takes the window's values, the
    /// others keep theirs (blk_mq_poll_stats_fn).
    fn publish(&mut self) {
        let mut changed = false;
        for (published, gathered) in self.published.buckets.iter_mut().zip(self.open.iter_mut()) {
            if let Some(summary) = gathered.summary() {
                #[cfg(test)]
                {
                    self.published_samples += summary.count;
                }
                *published = BucketStats::from_summary(summary, self.open_window);
                gathered.clear();
                changed = true;
            }
        }
        if changed {
            self.published.generation += 1;
        }
    }
}

impl DeviceStats {
    /// Statistics with the default window ([`DEFAULT_WINDOW_MS`]).
    pub fn new() -> Arc<DeviceStats> {
        Self::build(DEFAULT_WINDOW_MS)
    }

    /// Statistics published every `window_ms` milliseconds.
    pub fn with_window_ms(window_ms: u64) -> Result<Arc<DeviceStats>, StatsConfigError> {
        if !(WINDOW_MS_MIN..=WINDOW_MS_MAX).contains(&window_ms) {
            return Err(StatsConfigError::WindowOutOfRange { window_ms });
        }
        Ok(Self::build(window_ms))
    }

    fn build(window_ms: u64) -> Arc<DeviceStats> {
        Arc::new(DeviceStats {
            window_ns: window_ms * NS_PER_MS,
            generation: AtomicU64::new(0),
            shared: Mutex::new(Shared {
                open_window: 0,
                open: new_window(),
                recorders: Vec::new(),
                published: Snapshot::EMPTY,
                #[cfg(test)]
                published_samples: 0,
            }),
        })
    }

    /// A recorder for one reactor, whose clock reads `now_ns`. Allocates (once): call it when
    /// the reactor starts, not per I/O.
    pub fn recorder(self: &Arc<Self>, now_ns: u64) -> StatsRecorder {
        let window = now_ns / self.window_ns;
        let (slot, snapshot) = {
            let mut shared = self.lock();
            if shared.recorders.iter().all(Option::is_none) {
                // The last one to leave published everything: start where this one starts.
                shared.open_window = window;
            }
            let slot = match shared.recorders.iter().position(Option::is_none) {
                Some(free) => free,
                None => {
                    shared.recorders.push(None);
                    shared.recorders.len() - 1
                }
            };
            shared.recorders[slot] = Some(window);
            (slot, shared.published.clone())
        };
        StatsRecorder::new(Arc::clone(self), slot, window, snapshot)
    }

    /// The generation of the published statistics, read without the lock: a recorder
    /// waiting for a publication checks it once per poll batch.
    pub(super) fn published_generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Length of a window in nanoseconds.
    pub const fn window_ns(&self) -> u64 {
        self.window_ns
    }

    /// A copy of the published statistics (takes the lock: for reports, not for decisions).
    pub fn snapshot(&self) -> Snapshot {
        self.lock().published.clone()
    }

    /// Runs `f` under the lock, then mirrors the published generation for lock-free checks.
    pub(super) fn with_shared<R>(&self, f: impl FnOnce(&mut Shared) -> R) -> R {
        let mut shared = self.lock();
        let result = f(&mut shared);
        let generation = shared.published.generation;
        self.generation.store(generation, Ordering::Relaxed);
        result
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Shared> {
        // A panic while holding the lock leaves whole windows behind, never a torn one that
        // matters for a decision: carry on with what is there.
        self.shared
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl fmt::Debug for DeviceStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceStats")
            .field("window_ns", &self.window_ns)
            .field("generation", &self.generation.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

pub(super) fn window_end_ns(window: u64, window_ns: u64) -> u64 {
    window.saturating_add(1).saturating_mul(window_ns)
}
