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
//!
//! The parts: `bucket` (buckets and the published [`Snapshot`]), `overshoot`
//! ([`OvershootStats`]), `device` (the shared [`DeviceStats`] and its windows) and
//! `recorder` (each reactor's [`StatsRecorder`]).

mod bucket;
mod device;
mod overshoot;
mod recorder;
#[cfg(test)]
mod tests;

pub use bucket::{Bucket, BucketStats, Direction, Snapshot};
pub use device::{DeviceStats, StatsConfigError};
pub use overshoot::OvershootStats;
pub use recorder::StatsRecorder;

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
