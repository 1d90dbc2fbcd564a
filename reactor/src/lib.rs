//! hypoll-reactor: per-core reactors, the heart of hypoll.
//!
//! A [`ReactorSet`] starts one pinned thread per core. Each [`Reactor`] owns its queue pairs
//! (one per attached device), its pollers, timers and poll policy, and the application's
//! state for that core (an `S` its `init` returns, handed as `&mut S` to every message,
//! timer, poller and I/O callback on it); other threads reach it with closures sent through
//! a bounded mailbox ([`ReactorHandle::send`]). Every loop turn runs messages, timers,
//! pollers and completions; when none had work, the reactor asks its policy (spin, sleep
//! then spin, or wait for the interrupt) if I/O is outstanding, or spins briefly and then
//! parks in epoll if nothing is.
//!
//! An application with a loop of its own drives a reactor itself instead: it builds one with
//! [`Reactor::standalone`] and calls [`Reactor::poll`] (one turn) and [`Reactor::idle`] (what
//! a turn without work does) from its loop, then [`Reactor::shut_down`].
//!
//! ```no_run
//! use hypoll_reactor::{Device, ReactorConfig, ReactorSet};
//!
//! /// Each reactor's own state.
//! struct Counter {
//!     hellos: u64,
//! }
//!
//! let device = Device::open("emu:optane")?;
//! let set = ReactorSet::start(ReactorConfig::default(), move |reactor| {
//!     reactor.attach(&device, 32)?;
//!     Ok(Counter { hellos: 0 })
//! })?;
//! set.handles()[0].send(|reactor, counter| {
//!     counter.hellos += 1;
//!     println!("hello {} from core {}", counter.hellos, reactor.core());
//! })?;
//! let report = set.shutdown();
//! assert!(report.panics.is_empty());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The guide for embedders is `docs/reactor.md`.
//! See `examples/embed.rs` for a whole storage-server skeleton, and `examples/logstore/`
//! for a log store with group commit over registered memory.
//!
//! This crate is the one an embedder depends on: it re-exports what embedding takes from
//! the crates below it, the devices and buffers ([`DeviceConfig`], [`Controller`],
//! [`IoBuf`], [`Status`], [`NamespaceInfo`]) and the poll policy trait with what its
//! methods take ([`PollPolicy`], [`Decision`], [`PollContext`], [`Observation`],
//! [`Slept`]), and the crates themselves as [`nvme`] and [`policy`]. A policy of one's own,
//! with nothing but this crate:
//!
//! ```
//! use hypoll_reactor::{
//!     Decision, PolicyFactory, PollContext, PollPolicy, ReactorConfig, ReactorSet,
//! };
//!
//! /// Spins for 20 us after an I/O was submitted, then waits for the interrupt.
//! struct SpinThenWait;
//!
//! impl PollPolicy for SpinThenWait {
//!     fn name(&self) -> &str {
//!         "spin-then-wait"
//!     }
//!     fn decide(&mut self, ctx: &PollContext<'_>) -> Decision {
//!         if ctx.now_ns.saturating_sub(ctx.oldest.submit_ns) < 20_000 {
//!             Decision::Spin
//!         } else {
//!             Decision::WaitInterrupt
//!         }
//!     }
//! }
//!
//! let cfg = ReactorConfig {
//!     custom_policy: Some(PolicyFactory::new(|_reactor| Box::new(SpinThenWait))),
//!     ..ReactorConfig::default()
//! };
//! let set = ReactorSet::start(cfg, |_reactor| Ok(()))?;
//! assert!(set.shutdown().panics.is_empty());
//! # Ok::<(), hypoll_reactor::StartError>(())
//! ```

pub mod cores;
pub mod io;
mod reactor;
mod set;
/// The seeded fault simulation: behind the `sim` feature (off by default), so that its test
/// doubles stay out of an embedder's API.
#[cfg(any(test, feature = "sim"))]
pub mod sim;
pub mod stats;
mod sys;
mod timer;

pub use cores::{CoreError, CoreList};
pub use io::{
    AddressError, AttachError, Device, DeviceError, DeviceId, DeviceOptions, IoCallback, IoDone,
    IoFailure, IoOp, IoRequest, RegionSlice, RegionUseError, RejectReason, Rejected,
    DEFAULT_ABORT_TIMEOUT, DEFAULT_IO_TIMEOUT, DEFAULT_RESET_TIMEOUT,
};
pub use reactor::{
    AfterBatch, ExitReport, Message, Poller, PollerId, Reactor, ReactorHandle, ReactorTuning,
    SendError, StandaloneConfig, AFTER_BATCH_MAX, COMPLETION_BATCH, DEVICES_MAX, IDLE_SPIN_NS_MAX,
    MESSAGE_BATCH,
};
pub use set::{
    InitError, PolicyFactory, ReactorConfig, ReactorPanic, ReactorSet, ReactorStartError,
    ShutdownReport, StartError, MAILBOX_CAPACITY, REACTOR_TIMER_SLACK_NS,
};
pub use stats::{Counters, ReactorStats};
pub use sys::{
    allowed_cores, set_timer_slack_ns, sleep_until_ns, thread_cores, timer_slack_ns, ThreadCpuClock,
};
pub use timer::TimerId;

// One dependency for an embedder: what embedding takes from the crates below, at the root
// (devices, buffers and statuses; the poll policy trait and everything its methods take),
// and each whole crate for the rest (`hypoll_reactor::nvme::spec`,
// `hypoll_reactor::policy::build`).
pub use hypoll_nvme as nvme;
pub use hypoll_nvme::{
    ConfigError, Controller, DeviceConfig, IoBuf, MemoryRegion, NamespaceInfo, Opcode, QueuePair,
    QueuePairError, RegisterError, Status, SubmitError, UnregisterError, REGIONS_MAX,
    REGION_ALIGN_BYTES, SEGMENTS_MAX,
};
pub use hypoll_policy as policy;
pub use hypoll_policy::{
    Arrival, ArrivalStats, Bucket, BucketStats, Decision, DeviceStats, Direction, IdleContext,
    InFlight, Observation, OvershootStats, PolicySpecError, PollContext, PollPolicy, Slept,
    Snapshot, StatsConfigError,
};
