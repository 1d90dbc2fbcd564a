//! Completion statistics: the numbers every policy decides from.
//!
//! * **Buckets.** A completion is filed under its direction (read, write) and its power-of-two
//!   size class, 16 buckets in all, exactly as blk-mq's `blk_mq_poll_stats_bkt` did:
//!   `bucket = direction + 2 * ilog2(bytes / 512)`, clamped to the last class (64 KiB and up).
//! * **Recording.** Each reactor owns a [`StatsRecorder`] and records into it with plain
//!   stores: no atomic, no lock, no allocation ([`StatsRecorder::record`]).
//! * **Windows.** Time is cut into windows of `window_ms` (100 ms by default, as blk-stat's
//!   poll callback), aligned to multiples of the window on the reactors' monotonic clock, so
//!   every reactor of a device agrees on the boundaries without talking. The reactor hands its
//!   timestamp to [`StatsRecorder::tick`] once per poll batch; the statistics never read a
//!   clock. When a reactor crosses a boundary it adds its finished window to the device's
//!   [`DeviceStats`] under a mutex (the only lock, once per window). The device publishes a
//!   window as soon as every recorder has finished it; if some recorder stays silent (its
//!   reactor does not tick), as soon as another one finishes the next window, one window late.
//!   Samples that arrive after their window was published count in the open one.
//! * **Publication.** As blk-mq's `blk_mq_poll_stats_fn`: every bucket that had samples in the
//!   window takes the window's count, mean, min, max and percentiles; a bucket without samples
//!   keeps its last published value. Each recorder keeps its own copy of the published
//!   [`Snapshot`], refreshed at window boundaries, so a decision reads no shared memory.
//! * **Overshoot.** Each recorder also keeps the distribution of its own wake-up overshoot
//!   (actual sleep minus requested sleep), [`OvershootStats`], for policies that calibrate.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::histogram::{Histogram, Summary};

/// Statistics window when none is configured (blk-stat's poll window).
pub const DEFAULT_WINDOW_MS: u64 = 100;
/// Shortest window accepted.
pub const WINDOW_MS_MIN: u64 = 1;
/// Longest window accepted (one minute).
pub const WINDOW_MS_MAX: u64 = 60_000;
/// Power-of-two size classes per direction: 512 B, 1 KiB, ..., 32 KiB, 64 KiB and up.
pub const SIZE_CLASSES: usize = 8;
/// Buckets in all: two directions times [`SIZE_CLASSES`] (Linux `BLK_MQ_POLL_STATS_BKTS`).
pub const BUCKETS: usize = 2 * SIZE_CLASSES;
/// Bytes per sector: size classes count in sectors, as blk-mq does.
const SECTOR_SHIFT: u32 = 9;
const NS_PER_MS: u64 = 1_000_000;

/// Data direction of an I/O, as Linux's `rq_data_dir`.
///
/// Commands that move no data have no bucket: give them 0 bytes and [`Bucket::new`] returns
/// `None`, as blk-mq's bucket function did for zero sectors. hypoll's reactor gives flush,
/// write zeroes and deallocate no bucket at all: their latency says nothing about a read or
/// write of the same length, and Linux never polled them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Data moves from the device to memory.
    Read = 0,
    /// Data moves from memory to the device (and range commands without data).
    Write = 1,
}

/// One of the [`BUCKETS`] statistics buckets: a direction and a size class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bucket(u8);

impl Bucket {
    /// The bucket of an I/O of `bytes` in `direction`; `None` below 512 bytes (no sectors),
    /// as `blk_mq_poll_stats_bkt`: `direction + 2 * ilog2(sectors)`, clamped to the largest
    /// class.
    #[inline]
    pub const fn new(direction: Direction, bytes: u64) -> Option<Bucket> {
        let sectors = bytes >> SECTOR_SHIFT;
        if sectors == 0 {
            return None;
        }
        let mut class = sectors.ilog2() as usize;
        if class >= SIZE_CLASSES {
            class = SIZE_CLASSES - 1;
        }
        Some(Bucket((direction as usize + 2 * class) as u8))
    }

    /// The bucket with this index (`0..BUCKETS`), if any.
    pub const fn from_index(index: usize) -> Option<Bucket> {
        if index < BUCKETS {
            Some(Bucket(index as u8))
        } else {
            None
        }
    }

    /// This bucket's index, in `0..BUCKETS`: `direction + 2 * size_class`.
    #[inline]
    pub const fn index(self) -> usize {
        self.0 as usize
    }

    /// The direction of the I/Os in this bucket.
    pub const fn direction(self) -> Direction {
        if self.0 & 1 == 0 {
            Direction::Read
        } else {
            Direction::Write
        }
    }

    /// Size class, in `0..SIZE_CLASSES`: I/Os of `512 << class` bytes up to twice that (the
    /// last class has no upper bound).
    pub const fn size_class(self) -> usize {
        self.0 as usize / 2
    }

    /// Smallest I/O size in this bucket, in bytes.
    pub const fn bytes_min(self) -> u64 {
        1 << (SECTOR_SHIFT as usize + self.size_class())
    }

    /// Every bucket, in index order.
    pub fn all() -> impl Iterator<Item = Bucket> {
        (0..BUCKETS as u8).map(Bucket)
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let direction = match self.direction() {
            Direction::Read => "read",
            Direction::Write => "write",
        };
        let kib = self.bytes_min() / 1024;
        let last = if self.size_class() == SIZE_CLASSES - 1 {
            "+"
        } else {
            ""
        };
        if kib == 0 {
            write!(f, "{direction} {}B{last}", self.bytes_min())
        } else {
            write!(f, "{direction} {kib}KiB{last}")
        }
    }
}

/// Published statistics of one bucket: those of the last window in which it had samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BucketStats {
    /// Samples in that window; 0 until the bucket's first window with samples is published.
    pub count: u64,
    /// Mean latency, rounded down.
    pub mean_ns: u64,
    /// Smallest latency.
    pub min_ns: u64,
    /// Largest latency.
    pub max_ns: u64,
    /// Median latency (within 1/32, see [`crate::histogram`]).
    pub p50_ns: u64,
    /// 90th percentile latency (within 1/32).
    pub p90_ns: u64,
    /// 99th percentile latency (within 1/32).
    pub p99_ns: u64,
    /// Index of the window the values come from (window start = `window * window_ns`).
    pub window: u64,
}

impl BucketStats {
    /// A bucket that has never had samples.
    pub const EMPTY: BucketStats = BucketStats {
        count: 0,
        mean_ns: 0,
        min_ns: 0,
        max_ns: 0,
        p50_ns: 0,
        p90_ns: 0,
        p99_ns: 0,
        window: 0,
    };

    /// Whether any window with samples has been published for this bucket (Linux's
    /// `poll_stat[bucket].nr_samples != 0`).
    #[inline]
    pub const fn has_samples(&self) -> bool {
        self.count != 0
    }

    fn from_summary(summary: Summary, window: u64) -> Self {
        Self {
            count: summary.count,
            mean_ns: summary.mean_ns,
            min_ns: summary.min_ns,
            max_ns: summary.max_ns,
            p50_ns: summary.p50_ns,
            p90_ns: summary.p90_ns,
            p99_ns: summary.p99_ns,
            window,
        }
    }
}

/// The published per-device statistics: one [`BucketStats`] per bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    buckets: [BucketStats; BUCKETS],
    generation: u64,
}

impl Default for Snapshot {
    fn default() -> Self {
        Self::EMPTY
    }
}

impl Snapshot {
    /// No bucket has samples.
    pub const EMPTY: Snapshot = Snapshot {
        buckets: [BucketStats::EMPTY; BUCKETS],
        generation: 0,
    };

    /// The published statistics of `bucket`.
    #[inline]
    pub fn bucket(&self, bucket: Bucket) -> &BucketStats {
        &self.buckets[bucket.index()]
    }

    /// This snapshot with `bucket` set to `stats`: for tests, benchmarks and tools that need
    /// a snapshot without running windows.
    #[must_use]
    pub fn with_bucket(mut self, bucket: Bucket, stats: BucketStats) -> Self {
        self.buckets[bucket.index()] = stats;
        self
    }

    /// How many publications changed the device's statistics before this copy was taken.
    pub const fn generation(&self) -> u64 {
        self.generation
    }

    /// Every bucket with its statistics, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (Bucket, &BucketStats)> {
        Bucket::all().zip(self.buckets.iter())
    }
}

/// The distribution of one reactor's wake-up overshoot: how much later than requested its
/// sleeps ended (`actual - requested`, 0 for an early wake-up). Cumulative until cleared.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OvershootStats {
    overshoot: Histogram,
    early_wakeups: u64,
}

impl OvershootStats {
    /// No sleeps recorded.
    pub const fn new() -> Self {
        Self {
            overshoot: Histogram::new(),
            early_wakeups: 0,
        }
    }

    /// Records one sleep that asked for `requested_ns` and lasted `actual_ns`; returns its
    /// overshoot (saturating at 0). O(1), no allocation.
    #[inline]
    pub fn record(&mut self, requested_ns: u64, actual_ns: u64) -> u64 {
        if actual_ns < requested_ns {
            self.early_wakeups += 1;
        }
        let overshoot_ns = actual_ns.saturating_sub(requested_ns);
        self.overshoot.record(overshoot_ns);
        overshoot_ns
    }

    /// Sleeps recorded.
    pub const fn count(&self) -> u64 {
        self.overshoot.count()
    }

    /// Sleeps that ended before the requested time (recorded as 0 overshoot).
    pub const fn early_wakeups(&self) -> u64 {
        self.early_wakeups
    }

    /// Mean overshoot, rounded down; `None` before the first sleep.
    pub const fn mean_ns(&self) -> Option<u64> {
        self.overshoot.mean_ns()
    }

    /// Smallest overshoot; `None` before the first sleep.
    pub const fn min_ns(&self) -> Option<u64> {
        self.overshoot.min_ns()
    }

    /// Largest overshoot; `None` before the first sleep.
    pub const fn max_ns(&self) -> Option<u64> {
        self.overshoot.max_ns()
    }

    /// Overshoot at `percentile` (0 to 100), within 1/32. O(histogram buckets): cache it.
    pub fn percentile_ns(&self, percentile: f64) -> Option<u64> {
        self.overshoot.percentile_ns(percentile)
    }

    /// Count, mean, min, max, p50, p90, p99. O(histogram buckets): cache it.
    pub fn summary(&self) -> Option<Summary> {
        self.overshoot.summary()
    }

    /// The whole distribution.
    pub const fn histogram(&self) -> &Histogram {
        &self.overshoot
    }

    /// Forgets every sleep (for instance after a calibration phase).
    pub fn clear(&mut self) {
        *self = Self::new();
    }
}

/// One window's samples: a histogram per bucket.
type Window = [Histogram; BUCKETS];

fn new_window() -> Box<Window> {
    Box::new(std::array::from_fn(|_| Histogram::new()))
}

/// An invalid statistics configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
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

struct Shared {
    /// Index of the window being gathered.
    open_window: u64,
    open: Box<Window>,
    /// One slot per recorder: the window it is recording (it has finished every window
    /// before that); `None` once it has left. Grows only when a recorder is made.
    recorders: Vec<Option<u64>>,
    published: Snapshot,
    /// Every sample ever published, to check that none is lost or counted twice.
    #[cfg(test)]
    published_samples: u64,
}

impl Shared {
    /// Recorder `slot` hands in the samples it recorded in window `window` and moves to
    /// window `next_window`, having finished every window before it. The open window is
    /// published when every recorder has finished it, or at once when these samples are
    /// already past it (whoever has not finished it was silent for a whole window). Samples
    /// of a window older than the open one are late and count in the open one.
    fn hand_in(&mut self, slot: usize, window: u64, next_window: u64, samples: Option<&Window>) {
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
    fn leave(&mut self, slot: usize, samples: Option<&Window>) {
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
        StatsRecorder {
            device: Arc::clone(self),
            slot,
            window_ns: self.window_ns,
            window,
            window_end_ns: window_end_ns(window, self.window_ns),
            samples: new_window(),
            has_samples: false,
            snapshot,
            awaiting_publication: false,
            overshoot: OvershootStats::new(),
        }
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
    fn with_shared<R>(&self, f: impl FnOnce(&mut Shared) -> R) -> R {
        let mut shared = self.lock();
        let result = f(&mut shared);
        let generation = shared.published.generation;
        self.generation.store(generation, Ordering::Relaxed);
        result
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
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

fn window_end_ns(window: u64, window_ns: u64) -> u64 {
    window.saturating_add(1).saturating_mul(window_ns)
}

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
            && self.device.generation.load(Ordering::Relaxed) != self.snapshot.generation
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const WINDOW_NS: u64 = DEFAULT_WINDOW_MS * NS_PER_MS;

    fn bucket(direction: Direction, bytes: u64) -> Bucket {
        Bucket::new(direction, bytes).unwrap()
    }

    #[test]
    fn buckets_are_direction_plus_twice_the_size_class() {
        use Direction::{Read, Write};
        for (direction, bytes, index) in [
            (Read, 512, 0),
            (Write, 512, 1),
            (Read, 1023, 0), // one sector
            (Read, 1024, 2),
            (Write, 2048, 5),
            (Read, 4096, 6),
            (Write, 4096, 7),
            (Read, 8191, 6),
            (Read, 32 * 1024, 12),
            (Read, 64 * 1024, 14),
            (Write, 64 * 1024, 15),
            (Read, 1 << 20, 14), // clamped to the last class
            (Write, u64::MAX, 15),
        ] {
            let b = bucket(direction, bytes);
            assert_eq!(b.index(), index, "{direction:?} {bytes}");
            assert_eq!(b.direction(), direction);
        }
        assert_eq!(Bucket::new(Read, 511), None);
        assert_eq!(Bucket::new(Write, 0), None); // flush
        assert_eq!(Bucket::all().count(), BUCKETS);
        assert_eq!(Bucket::from_index(BUCKETS), None);
        assert_eq!(bucket(Read, 4096).bytes_min(), 4096);
        assert_eq!(bucket(Read, 4096).to_string(), "read 4KiB");
        assert_eq!(bucket(Write, 512).to_string(), "write 512B");
        assert_eq!(bucket(Write, 1 << 20).to_string(), "write 64KiB+");
    }

    #[test]
    fn a_window_is_published_at_its_end_not_before() {
        let device = DeviceStats::new();
        let mut recorder = device.recorder(5);
        let read_4k = bucket(Direction::Read, 4096);
        for latency_ns in [8000, 9000, 10_003] {
            recorder.record(read_4k, latency_ns);
        }
        assert!(!recorder.tick(WINDOW_NS - 1));
        assert!(!recorder.snapshot().bucket(read_4k).has_samples());
        assert!(!device.snapshot().bucket(read_4k).has_samples());

        assert!(recorder.tick(WINDOW_NS));
        let stats = *recorder.snapshot().bucket(read_4k);
        // Hand-computed: mean (8000 + 9000 + 10003) / 3 = 9001, min 8000, max 10003.
        assert_eq!(
            (
                stats.count,
                stats.mean_ns,
                stats.min_ns,
                stats.max_ns,
                stats.window
            ),
            (3, 9001, 8000, 10_003, 0)
        );
        assert!(stats.p50_ns.abs_diff(9000) <= 9000 / 32, "{stats:?}");
        assert_eq!(stats.p99_ns, 10_003); // clamped to the max
        assert_eq!(device.snapshot(), *recorder.snapshot());
        assert_eq!(recorder.snapshot().generation(), 1);
        // The other buckets are untouched.
        let others = recorder.snapshot().iter().filter(|(b, _)| *b != read_4k);
        assert!(others.into_iter().all(|(_, s)| *s == BucketStats::EMPTY));
    }

    #[test]
    fn the_mean_rounds_down_like_blk_stat() {
        let device = DeviceStats::new();
        let mut recorder = device.recorder(0);
        let b = bucket(Direction::Write, 512);
        recorder.record(b, 1);
        recorder.record(b, 2);
        recorder.tick(WINDOW_NS);
        assert_eq!(recorder.snapshot().bucket(b).mean_ns, 1);
    }

    #[test]
    fn a_bucket_without_samples_keeps_its_last_published_value() {
        let device = DeviceStats::new();
        let mut recorder = device.recorder(0);
        let (read, write) = (
            bucket(Direction::Read, 4096),
            bucket(Direction::Write, 4096),
        );
        recorder.record(read, 9001);
        recorder.record(write, 20_000);
        recorder.tick(WINDOW_NS);
        let first_read = *recorder.snapshot().bucket(read);

        // Window 1: only writes.
        recorder.record(write, 30_000);
        assert!(recorder.tick(2 * WINDOW_NS));
        assert_eq!(*recorder.snapshot().bucket(read), first_read);
        assert_eq!(recorder.snapshot().bucket(write).mean_ns, 30_000);
        assert_eq!(recorder.snapshot().bucket(write).window, 1);

        // Window 2: nothing at all. Nothing changes, not even the generation.
        let before = recorder.snapshot().clone();
        assert!(!recorder.tick(3 * WINDOW_NS));
        assert_eq!(*recorder.snapshot(), before);
        // Windows 3 to 9 skipped (an idle reactor): still nothing changes.
        assert!(!recorder.tick(10 * WINDOW_NS + 7));
        assert_eq!(*recorder.snapshot(), before);
        // Window 10 has a read again.
        recorder.record(read, 7000);
        assert!(recorder.tick(11 * WINDOW_NS));
        let read_stats = recorder.snapshot().bucket(read);
        assert_eq!((read_stats.mean_ns, read_stats.window), (7000, 10));
        assert_eq!(recorder.snapshot().bucket(write).mean_ns, 30_000);
    }

    #[test]
    fn windows_are_aligned_and_configurable() {
        assert_eq!(
            DeviceStats::with_window_ms(0).unwrap_err(),
            StatsConfigError::WindowOutOfRange { window_ms: 0 }
        );
        assert!(DeviceStats::with_window_ms(WINDOW_MS_MAX + 1).is_err());
        let device = DeviceStats::with_window_ms(10).unwrap();
        assert_eq!(device.window_ns(), 10 * NS_PER_MS);
        // A recorder made at 25 ms records window 2, which ends at 30 ms.
        let mut recorder = device.recorder(25 * NS_PER_MS);
        let b = bucket(Direction::Read, 512);
        recorder.record(b, 100);
        assert!(!recorder.tick(30 * NS_PER_MS - 1));
        assert!(recorder.tick(30 * NS_PER_MS));
        assert_eq!(recorder.snapshot().bucket(b).window, 2);
    }

    #[test]
    fn a_window_is_published_when_every_recorder_has_handed_it_in() {
        let device = DeviceStats::new();
        let (mut a, mut b) = (device.recorder(0), device.recorder(0));
        let read = bucket(Direction::Read, 4096);
        a.record(read, 1000);
        b.record(read, 3000);
        b.record(read, 5000);

        // `a` crosses first: nothing is published yet.
        assert!(!a.tick(WINDOW_NS + 10));
        assert!(!a.snapshot().bucket(read).has_samples());
        assert!(!a.tick(WINDOW_NS + 20));
        // `b` crosses: the merged window is published...
        assert!(b.tick(WINDOW_NS + 30));
        let merged = *b.snapshot().bucket(read);
        assert_eq!(
            (merged.count, merged.mean_ns, merged.min_ns, merged.max_ns),
            (3, 3000, 1000, 5000)
        );
        // ...and `a`, which was waiting for it, picks it up at its next tick.
        assert!(a.tick(WINDOW_NS + 40));
        assert_eq!(a.snapshot(), b.snapshot());
        assert!(!a.tick(WINDOW_NS + 50));
    }

    #[test]
    fn a_silent_recorder_delays_publication_by_one_window_only() {
        let device = DeviceStats::new();
        let (mut a, mut silent) = (device.recorder(0), device.recorder(0));
        let read = bucket(Direction::Read, 4096);
        a.record(read, 1000);
        assert!(!a.tick(WINDOW_NS)); // hands in window 0; `silent` never does
        a.record(read, 2000);
        // `a` hands in window 1: window 0 is published as it is, window 1 waits.
        assert!(a.tick(2 * WINDOW_NS));
        let stats = *a.snapshot().bucket(read);
        assert_eq!((stats.count, stats.mean_ns, stats.window), (1, 1000, 0));

        // `silent` wakes with samples from window 0: they are late and count in window 1,
        // and it has finished window 1 too, so window 1 is published.
        silent.record(read, 4000);
        assert!(silent.tick(2 * WINDOW_NS + 5));
        let stats = *silent.snapshot().bucket(read);
        assert_eq!((stats.count, stats.mean_ns, stats.window), (2, 3000, 1));
        assert!(a.tick(2 * WINDOW_NS + 6));
        assert_eq!(a.snapshot(), silent.snapshot());
    }

    #[test]
    fn the_last_recorder_to_leave_publishes_the_rest() {
        let device = DeviceStats::new();
        let (mut a, mut b) = (device.recorder(0), device.recorder(0));
        let read = bucket(Direction::Read, 4096);
        a.record(read, 1000);
        a.tick(WINDOW_NS); // handed in, waits for `b`
        drop(a); // leaves: `b` alone decides now
        b.record(read, 3000);
        assert!(b.tick(WINDOW_NS + 1));
        assert_eq!(b.snapshot().bucket(read).mean_ns, 2000);
        b.record(read, 8000); // window 1, never ended
        drop(b);
        let stats = *device.snapshot().bucket(read);
        assert_eq!((stats.count, stats.mean_ns), (1, 8000));
        // A newcomer starts from the published statistics.
        let c = device.recorder(5 * WINDOW_NS);
        assert_eq!(c.snapshot().bucket(read).mean_ns, 8000);
    }

    #[test]
    fn overshoot_is_kept_as_a_distribution() {
        let mut overshoot = OvershootStats::new();
        assert_eq!((overshoot.count(), overshoot.mean_ns()), (0, None));
        assert_eq!(overshoot.record(5000, 5700), 700);
        assert_eq!(overshoot.record(5000, 4000), 0); // early: counted as 0
        assert_eq!(overshoot.record(2000, 4300), 2300);
        assert_eq!(overshoot.record(1000, 1000), 0);
        assert_eq!(overshoot.count(), 4);
        assert_eq!(overshoot.early_wakeups(), 1);
        // Overshoots 0, 0, 700, 2300: mean 750, min 0, max 2300, p50 0 (rank 2), p99 2300.
        assert_eq!(overshoot.mean_ns(), Some(750));
        assert_eq!(
            (overshoot.min_ns(), overshoot.max_ns()),
            (Some(0), Some(2300))
        );
        let summary = overshoot.summary().unwrap();
        assert_eq!((summary.p50_ns, summary.p99_ns), (0, 2300));
        assert!(summary.p90_ns == 2300, "{summary:?}");
        overshoot.clear();
        assert_eq!((overshoot.count(), overshoot.early_wakeups()), (0, 0));
    }

    #[test]
    fn a_recorder_keeps_its_reactors_overshoot() {
        let device = DeviceStats::new();
        let (mut a, b) = (device.recorder(0), device.recorder(0));
        assert_eq!(a.record_sleep(4501, 9800), 5299);
        assert_eq!(a.overshoot().max_ns(), Some(5299));
        assert_eq!(b.overshoot().count(), 0); // per reactor
        a.tick(WINDOW_NS); // windows do not touch it
        assert_eq!(a.overshoot().count(), 1);
        a.overshoot_mut().clear();
        assert_eq!(a.overshoot().count(), 0);
    }

    #[test]
    fn recorders_and_devices_can_move_to_their_reactor_threads() {
        fn send<T: Send>() {}
        send::<StatsRecorder>();
        send::<Arc<DeviceStats>>();
        send::<Box<dyn crate::PollPolicy>>();
    }

    #[test]
    fn leaving_after_a_silent_window_loses_nothing() {
        let device = DeviceStats::new();
        let (mut a, mut b) = (device.recorder(0), device.recorder(0));
        let read = bucket(Direction::Read, 4096);
        a.record(read, 1000);
        a.tick(2 * WINDOW_NS + 1); // finished windows 0 and 1; `b` is silent in window 0
        b.record(read, 2000);
        b.tick(2 * WINDOW_NS + 2); // window 0 and (with `a`) window 1 are published
        a.record(read, 3000);
        drop(a);
        b.record(read, 4000);
        drop(b);
        assert_eq!(device.lock().published_samples, 4);
        assert_eq!(device.lock().recorders, [None, None]);
    }

    #[derive(Clone, Debug)]
    enum Step {
        Record(usize, u64),
        Tick(usize),
        Advance(u64),
        Replace(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0usize..3, 1u64..100_000).prop_map(|(who, ns)| Step::Record(who, ns)),
            (0usize..3).prop_map(Step::Tick),
            (0..3 * WINDOW_NS).prop_map(Step::Advance),
            (0usize..3).prop_map(Step::Replace),
        ]
    }

    proptest! {
        /// Whatever reactors record, however they tick, fall silent, leave and join, every
        /// sample is published exactly once, and a reactor that ticks after everyone has
        /// finished a window sees that window.
        #[test]
        fn no_sample_is_lost_or_counted_twice(steps in prop::collection::vec(step(), 1..120)) {
            let device = DeviceStats::with_window_ms(DEFAULT_WINDOW_MS).unwrap();
            let mut now_ns = 0;
            let mut recorders: Vec<_> = (0..3).map(|_| device.recorder(now_ns)).collect();
            let mut recorded = 0;
            let b = bucket(Direction::Write, 4096);
            for step in steps {
                match step {
                    Step::Record(who, ns) => {
                        recorders[who].record(b, ns);
                        recorded += 1;
                    }
                    Step::Tick(who) => {
                        recorders[who].tick(now_ns);
                    }
                    Step::Advance(ns) => now_ns += ns,
                    Step::Replace(who) => recorders[who] = device.recorder(now_ns),
                }
            }
            // Everyone moves on by a window: everything recorded so far is published.
            now_ns += WINDOW_NS;
            for recorder in &mut recorders {
                recorder.tick(now_ns);
            }
            prop_assert_eq!(device.lock().published_samples, recorded);
            let published = device.snapshot();
            for recorder in &mut recorders {
                recorder.tick(now_ns);
                prop_assert_eq!(recorder.snapshot(), &published);
            }
        }

        /// Whatever the samples and however they are spread over recorders, one window's
        /// publication has the exact count, sum-derived mean, min and max of all of them.
        #[test]
        fn publication_merges_every_recorder_exactly(
            samples in prop::collection::vec((0usize..3, 0u64..10_000_000), 1..200),
        ) {
            let device = DeviceStats::new();
            let mut recorders: Vec<_> = (0..3).map(|_| device.recorder(0)).collect();
            let b = bucket(Direction::Read, 4096);
            for &(who, latency_ns) in &samples {
                recorders[who].record(b, latency_ns);
            }
            for (i, recorder) in recorders.iter_mut().enumerate() {
                recorder.tick(WINDOW_NS + i as u64);
            }
            let values: Vec<u64> = samples.iter().map(|&(_, v)| v).collect();
            let stats = *device.snapshot().bucket(b);
            prop_assert_eq!(stats.count, values.len() as u64);
            prop_assert_eq!(stats.mean_ns, values.iter().sum::<u64>() / values.len() as u64);
            prop_assert_eq!(stats.min_ns, *values.iter().min().unwrap());
            prop_assert_eq!(stats.max_ns, *values.iter().max().unwrap());
            for recorder in &mut recorders {
                recorder.tick(WINDOW_NS + 10);
                prop_assert_eq!(recorder.snapshot().bucket(b), &stats);
            }
        }
    }
}
