//! Completion statistics and the pluggable poll policies of hypoll.
//!
//! A reactor owns one [`StatsRecorder`] (made by the device's shared [`DeviceStats`]) and
//! one [`PollPolicy`] (made by [`build`] from a spec such as `hybrid-min:adjust=2000`):
//!
//! ```
//! use hypoll_policy::{build, Bucket, Decision, DeviceStats, Direction, InFlight, PollContext};
//!
//! let device = DeviceStats::new(); // 100 ms windows
//! let mut stats = device.recorder(0);
//! let mut policy = build("hybrid").unwrap();
//! let bucket = Bucket::new(Direction::Read, 4096);
//!
//! stats.record(bucket.unwrap(), 9001); // a 4 KiB read took 9001 ns
//! stats.tick(100_000_000); // the reactor's clock crosses the window's end: published
//!
//! let ctx = PollContext {
//!     now_ns: 100_000_500,
//!     outstanding: 1,
//!     oldest: InFlight { bucket, submit_ns: 100_000_000, slept: false },
//!     stats: stats.snapshot(),
//!     overshoot: stats.overshoot(),
//!     interrupts: true,
//!     oracle_deadline_ns: None,
//! };
//! assert_eq!(policy.decide(&ctx), Decision::sleep_ns(4501)); // (9001 + 1) / 2
//! ```
//!
//! See `docs/policies.md` for each policy's formula and origin.
#![warn(missing_docs)]

pub mod adaptive;
mod arrivals;
pub mod classic;
pub mod fixed;
pub mod histogram;
pub mod hybrid;
pub mod hybrid_min;
pub mod hybrid_three_quarters;
pub mod interrupt;
pub mod oracle;
mod policy;
mod registry;
pub mod stats;
pub mod uring_hybrid;

pub use adaptive::Adaptive;
pub use arrivals::{Arrival, ArrivalStats, IdleContext, ARRIVAL_GAP_MEAN_SHIFT};
pub use classic::Classic;
pub use fixed::Fixed;
pub use histogram::{Histogram, Summary};
pub use hybrid::Hybrid;
pub use hybrid_min::HybridMin;
pub use hybrid_three_quarters::HybridThreeQuarters;
pub use interrupt::Interrupt;
pub use oracle::Oracle;
pub use policy::{Decision, InFlight, Observation, PollContext, PollPolicy, Slept};
pub use registry::{build, list, PolicyInfo, PolicySpecError};
pub use stats::{
    Bucket, BucketStats, DeviceStats, Direction, OvershootStats, Snapshot, StatsConfigError,
    StatsRecorder, BUCKETS, DEFAULT_WINDOW_MS,
};
pub use uring_hybrid::UringHybrid;
