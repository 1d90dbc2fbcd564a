//! Statistics buckets (a direction and a power-of-two size class) and the published
//! per-bucket statistics every policy reads.

use std::fmt;

use super::{BUCKETS, SECTOR_SHIFT, SIZE_CLASSES};
use crate::histogram::Summary;

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

    pub(super) fn from_summary(summary: Summary, window: u64) -> Self {
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
    pub(super) buckets: [BucketStats; BUCKETS],
    pub(super) generation: u64,
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
