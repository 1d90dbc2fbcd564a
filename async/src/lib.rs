//! hypoll-async: `async`/`await` on hypoll's reactors.
//!
//! Each reactor gets a local executor ([`Executor`]) that lives in the reactor's state and
//! runs as one of its pollers: a task woken in a turn runs in that turn (the tasks a batch
//! of I/O completions woke run as soon as the batch's callbacks have; a task woken alone
//! runs at once, as a callback would), and a turn in which every task is blocked does no
//! work, so the reactor's poll policy decides how to wait (spin, sleep, the interrupt,
//! park) exactly as it does for callbacks. Tasks are `!Send`, may hold `Rc`,
//! and are polled without a lock; the task core is this crate's own, made so that an I/O
//! completion reaches its task's next poll with no atomic operation (`task/raw.rs` says
//! how).
//!
//! From a task, a [`Local`] handle submits I/O with owned buffers ([`Local::read`] returns
//! the buffer with the result, as glommio's `DmaFile` and tokio-uring do), sleeps, spawns,
//! and reaches the reactor and its state ([`Local::with`]). Other threads spawn through the
//! reactor's handle ([`SpawnExt::spawn`]); a [`JoinHandle`] is awaited from any reactor or
//! waited for from a plain thread.
//!
//! ```no_run
//! use hypoll_async::{Executor, HasExecutor, SpawnExt};
//! use hypoll_reactor::{Device, DeviceId, IoBuf, ReactorConfig, ReactorSet};
//!
//! /// Each reactor's state: its executor, and whatever else the application keeps there.
//! struct App {
//!     executor: Executor<App>,
//! }
//!
//! impl HasExecutor for App {
//!     fn executor(&self) -> &Executor<App> {
//!         &self.executor
//!     }
//! }
//!
//! let device = Device::open("emu:optane")?;
//! let set = ReactorSet::start(ReactorConfig::default(), move |reactor| {
//!     reactor.attach(&device, 32)?;
//!     Ok(App { executor: Executor::install(reactor)? })
//! })?;
//! let task = set.handles()[0].spawn(|io| async move {
//!     let buf = io.write(DeviceId::FIRST, 0, 8, IoBuf::from_slice(&[7; 4096])).await?;
//!     io.read(DeviceId::FIRST, 0, 8, buf).await
//! })?;
//! let buf = task.wait()??;
//! assert!(buf.iter().all(|&b| b == 7));
//! set.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! docs/reactor.md, "async", says how it is built and what it costs.

mod executor;
mod io;
mod join;
mod lend;
mod remote;
mod task;
mod time;

use std::future::Future;
use std::rc::Rc;
use std::time::Duration;

use hypoll_reactor::{DeviceId, IoBuf, IoOp, IoRequest, Reactor, RegionSlice};

use executor::Core;
pub use executor::{run_now, Executor, ExecutorConfig, DEFAULT_TASKS_MAX, RUN_BATCH};
pub use io::{BufError, IoError, IoFuture, IoOutput, VectoredFuture};
pub use join::{JoinError, JoinHandle};
pub use remote::SpawnExt;
pub use time::{yield_now, Elapsed, Sleep, Timeout, YieldNow};

/// A reactor state that holds its reactor's [`Executor`]: how I/O completions, timers and
/// messages from other threads find the executor.
pub trait HasExecutor: Sized + 'static {
    fn executor(&self) -> &Executor<Self>;
}

/// Why a task was not spawned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpawnError {
    /// The executor already runs its [`ExecutorConfig::tasks_max`] tasks.
    #[error("the reactor already runs its {max} tasks")]
    TooManyTasks { max: usize },
    /// The executor closed (its reactor is stopping).
    #[error("the executor closed")]
    Closed,
}

/// What an executor did so far ([`Executor::counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExecutorCounters {
    pub spawned: u64,
    /// Task polls.
    pub polls: u64,
    /// Tasks that panicked (each ended with [`JoinError::Panicked`]).
    pub panics: u64,
    /// I/Os futures handed to the reactor.
    pub ios: u64,
    /// I/Os whose future was dropped before they completed (the reactor dropped their
    /// buffers once the device was done).
    pub ios_orphaned: u64,
}

/// A task's handle to its reactor: I/O, timers, spawning, and the reactor and its state.
/// Cheap to clone (an `Rc`); it stays on its reactor's thread. Its futures must be awaited
/// by tasks of this reactor: polled anywhere else they panic.
pub struct Local<S: 'static> {
    pub(crate) core: Rc<Core<S>>,
}

impl<S: 'static> Clone for Local<S> {
    fn clone(&self) -> Self {
        Local {
            core: self.core.clone(),
        }
    }
}

impl<S: 'static> Local<S> {
    /// Spawns a task on this reactor. It first runs in this reactor turn if the reactor
    /// is in its turn (from a task, a callback or a message), and at the latest in the next.
    /// Dropping the handle detaches the task.
    pub fn spawn_local<F>(&self, future: F) -> Result<JoinHandle<F::Output>, SpawnError>
    where
        F: Future + 'static,
        F::Output: 'static,
    {
        self.core.spawn(future)
    }

    /// Runs `f` with the reactor and its state: from a task, to reach what a callback
    /// would (submit with a callback, add a poller, read the state). Panics outside a task
    /// of this reactor, and inside another `with`; [`Local::try_with`] does not.
    pub fn with<R>(&self, f: impl FnOnce(&mut Reactor<S>, &mut S) -> R) -> R {
        self.try_with(f)
            .expect("Local::with outside a task of its reactor, or inside another with")
    }

    /// [`Local::with`], or `None` where the reactor is not at hand.
    pub fn try_with<R>(&self, f: impl FnOnce(&mut Reactor<S>, &mut S) -> R) -> Option<R> {
        self.core.lend.with(f)
    }

    /// Tasks alive on this reactor.
    pub fn tasks(&self) -> usize {
        self.core.tasks()
    }

    /// What this executor did so far.
    pub fn counters(&self) -> ExecutorCounters {
        self.core.counters()
    }

    /// I/Os submitted by futures and not completed yet, those of dropped futures included
    /// (their buffers are still with the reactor).
    pub fn ios_in_flight(&self) -> usize {
        self.core.ios_in_flight()
    }
}

/// I/O. Where and how much are in blocks of the device, as for the reactor's own calls
/// ([`Reactor::lba_bytes`]). Each future submits on its first poll and resolves when the
/// device completes; on a full queue pair it waits for room, first come first served,
/// instead of failing. Dropping one does not cancel its I/O: the reactor keeps the buffer
/// until the device is done with it, then drops it.
impl<S: HasExecutor> Local<S> {
    /// Reads `nlb` blocks from block `slba` into `buf`; resolves to the buffer.
    pub fn read(
        &self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        buf: IoBuf,
    ) -> IoFuture<'_, S, Result<IoBuf, BufError>> {
        IoFuture::new(
            self,
            device,
            IoRequest::new(IoOp::Read, slba, nlb),
            Some(buf),
        )
    }

    /// Writes `nlb` blocks from `buf` at block `slba`; resolves to the buffer.
    pub fn write(
        &self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        buf: IoBuf,
    ) -> IoFuture<'_, S, Result<IoBuf, BufError>> {
        IoFuture::new(
            self,
            device,
            IoRequest::new(IoOp::Write, slba, nlb),
            Some(buf),
        )
    }

    pub fn flush(&self, device: DeviceId) -> IoFuture<'_, S, Result<(), IoError>> {
        IoFuture::new(self, device, IoRequest::new(IoOp::Flush, 0, 0), None)
    }

    pub fn write_zeroes(
        &self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
    ) -> IoFuture<'_, S, Result<(), IoError>> {
        let req = IoRequest::new(IoOp::WriteZeroes, slba, nlb);
        IoFuture::new(self, device, req, None)
    }

    pub fn deallocate(
        &self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
    ) -> IoFuture<'_, S, Result<(), IoError>> {
        let req = IoRequest::new(IoOp::Deallocate, slba, nlb);
        IoFuture::new(self, device, req, None)
    }

    /// Any I/O as a request (FUA, deallocate bits), with a buffer for reads and writes;
    /// resolves to the buffer it had. The request's `user` is the future's own.
    pub fn submit(
        &self,
        device: DeviceId,
        req: IoRequest,
        buf: Option<IoBuf>,
    ) -> IoFuture<'_, S, Result<Option<IoBuf>, BufError>> {
        IoFuture::new(self, device, req, buf)
    }

    /// Reads `nlb` blocks from block `slba` into `segments` of memory registered with the
    /// device ([`Reactor::register_memory`], from [`Local::with`]), as
    /// [`Reactor::readv`] does. The segments are kept until the I/O is submitted.
    /// Dropped in flight, the read still lands in the regions: the registration's contract
    /// covers that memory until the completion.
    pub fn readv<V: AsRef<[RegionSlice]> + Unpin>(
        &self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        segments: V,
    ) -> VectoredFuture<'_, S, V> {
        VectoredFuture::new(
            self,
            device,
            IoRequest::new(IoOp::Read, slba, nlb),
            segments,
        )
    }

    /// Writes `nlb` blocks at block `slba` from `segments` (see [`Local::readv`]).
    pub fn writev<V: AsRef<[RegionSlice]> + Unpin>(
        &self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        segments: V,
    ) -> VectoredFuture<'_, S, V> {
        let req = IoRequest::new(IoOp::Write, slba, nlb);
        VectoredFuture::new(self, device, req, segments)
    }

    /// A vectored read or write as a request (`req.op`; FUA kept).
    pub fn submit_vectored<V: AsRef<[RegionSlice]> + Unpin>(
        &self,
        device: DeviceId,
        req: IoRequest,
        segments: V,
    ) -> VectoredFuture<'_, S, V> {
        VectoredFuture::new(self, device, req, segments)
    }

    /// Waits for `duration`, counted from the first poll, on the reactor's timers (the
    /// reactor parks or its policy waits meanwhile, as for any timer). Each sleep costs one
    /// small allocation (its timer's closure).
    pub fn sleep(&self, duration: Duration) -> Sleep<'_, S> {
        Sleep::new(self, duration)
    }

    /// Runs `future` for at most `limit`: its output, or [`Elapsed`] after dropping it.
    /// An I/O the future had in flight is not cancelled under the device (no NVMe command
    /// is aborted for it): it completes in its own time, within the device's I/O timeout,
    /// and the reactor then drops its buffer. A timed-out write may or may not reach the
    /// media; read the blocks back, or write them again, to know.
    pub fn timeout<F: Future>(&self, limit: Duration, future: F) -> Timeout<'_, S, F> {
        Timeout::new(self, limit, future)
    }
}
