//! hypoll-reactor: per-core reactors, the heart of hypoll.
//!
//! A [`ReactorSet`] starts one pinned thread per core. Each [`Reactor`] owns its queue pairs
//! (one per attached device), its pollers, timers and poll policy; other threads reach it
//! with closures sent through a bounded mailbox ([`ReactorHandle::send`]). Every loop turn
//! runs messages, timers, pollers and completions; when none had work, the reactor asks its
//! policy (spin, sleep then spin, or wait for the interrupt) if I/O is outstanding, or spins
//! briefly and then parks in epoll if nothing is.
//!
//! ```no_run
//! use hypoll_reactor::{Device, ReactorConfig, ReactorSet};
//!
//! let device = Device::open("emu:optane")?;
//! let set = ReactorSet::start(ReactorConfig::default(), move |reactor| {
//!     reactor.attach(&device, 32).map(drop)
//! })?;
//! set.handles()[0].send(|reactor| println!("hello from core {}", reactor.core()))?;
//! let report = set.shutdown();
//! assert!(report.panics.is_empty());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! See `examples/embed.rs` for a whole storage-server skeleton.

pub mod cores;
pub mod io;
mod reactor;
mod set;
pub mod sim;
pub mod stats;
mod sys;
mod timer;

pub use cores::{CoreError, CoreList};
pub use io::{
    Device, DeviceError, DeviceId, DeviceOptions, IoCallback, IoDone, IoFailure, IoOp, IoRequest,
    RejectReason, Rejected, DEFAULT_ABORT_TIMEOUT, DEFAULT_IO_TIMEOUT, DEFAULT_RESET_TIMEOUT,
};
pub use reactor::{
    ExitReport, Message, Poller, PollerId, Reactor, ReactorHandle, ReactorTuning, SendError,
    COMPLETION_BATCH, DEVICES_MAX, MESSAGE_BATCH,
};
pub use set::{
    PolicyFactory, ReactorConfig, ReactorPanic, ReactorSet, ShutdownReport, StartError,
    MAILBOX_CAPACITY, REACTOR_TIMER_SLACK_NS,
};
pub use stats::{Counters, ReactorStats};
pub use sys::{
    allowed_cores, set_timer_slack_ns, sleep_until_ns, thread_cores, timer_slack_ns, ThreadCpuClock,
};
pub use timer::TimerId;
