//! I/O futures with owned buffers: a future submits its I/O on its first poll, with a
//! capture-free completion callback that finds the future's cell by the request's `user`
//! number; the callback stores the completion there and wakes the task. No allocation per
//! I/O: the cells live in a slab that grows to the most I/Os ever in flight, and the
//! callback is a plain function.
//!
//! Dropped in flight, a future leaves its cell orphaned; the I/O goes on, its buffer stays
//! in the reactor's slot (where the device may still write into it) until the completion,
//! which then drops buffer and cell. A full queue pair is waited out: the future queues for
//! room on its device and a completion there wakes the first in line.

mod cells;

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use hypoll_reactor::{DeviceId, IoBuf, IoDone, IoFailure, IoRequest, Reactor, RejectReason};

use crate::executor::{count, Core, RUN_BATCH};
use crate::{HasExecutor, Local};
pub(crate) use cells::IoCells;
use cells::{Completed, Waiter};

/// Why an async I/O did not succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    /// The reactor refused it for a reason waiting does not cure (an unknown device, a
    /// request past the namespace, a reactor shutting down...): it never reached the
    /// device. (A full queue pair is not a refusal here: the future waits for room.)
    #[error("refused: {0}")]
    Refused(RejectReason),
    /// It reached the device, or waited for a slot, and failed.
    #[error("{0}")]
    Failed(IoFailure),
}

/// A failed read or write, with its buffer back when there is one to give back (not for
/// [`IoFailure::Abandoned`]: the device may still use it, so the reactor keeps it).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct BufError {
    pub error: IoError,
    pub buf: Option<IoBuf>,
}

/// What an [`IoFuture`] resolves to, made from the I/O's result and its buffer.
pub trait IoOutput: Sized {
    fn from_parts(result: Result<(), IoError>, buf: Option<IoBuf>) -> Self;

    /// From a completion: `from_parts` without the refusal (the usual path, made without
    /// the wider error in between).
    #[inline]
    fn from_done(result: Result<(), IoFailure>, buf: Option<IoBuf>) -> Self {
        Self::from_parts(result.map_err(IoError::Failed), buf)
    }
}

/// A read or write: the buffer back, or the error with it.
impl IoOutput for Result<IoBuf, BufError> {
    #[inline]
    fn from_parts(result: Result<(), IoError>, buf: Option<IoBuf>) -> Self {
        match (result, buf) {
            (Ok(()), Some(buf)) => Ok(buf),
            (Ok(()), None) => unreachable!("a read or write that succeeds returns its buffer"),
            (Err(error), buf) => Err(BufError { error, buf }),
        }
    }

    #[inline]
    fn from_done(result: Result<(), IoFailure>, buf: Option<IoBuf>) -> Self {
        match (result, buf) {
            (Ok(()), Some(buf)) => Ok(buf),
            (result, buf) => Self::from_parts(result.map_err(IoError::Failed), buf),
        }
    }
}

/// Flush, write zeroes, deallocate: no buffer.
impl IoOutput for Result<(), IoError> {
    #[inline]
    fn from_parts(result: Result<(), IoError>, _buf: Option<IoBuf>) -> Self {
        result
    }
}

/// Any I/O ([`Local::submit`]): the buffer, if it had one.
impl IoOutput for Result<Option<IoBuf>, BufError> {
    #[inline]
    fn from_parts(result: Result<(), IoError>, buf: Option<IoBuf>) -> Self {
        match result {
            Ok(()) => Ok(buf),
            Err(error) => Err(BufError { error, buf }),
        }
    }
}

impl<S: 'static> Core<S> {
    pub(crate) fn ios_in_flight(&self) -> usize {
        self.io.borrow().in_use()
    }

    /// An I/O of a future completed: its result goes to the cell (or, orphaned, is
    /// dropped), and the first future waiting for room on its device gets its turn.
    #[inline]
    fn complete_io(&self, done: IoDone) {
        let mut io = self.io.borrow_mut();
        let completed = io.complete(done.user as usize, done.result, done.buf);
        let next = io.next_in_line(done.device);
        drop(io);
        match completed {
            Completed::Waiting(waiter) => waiter.wake(),
            // Outside the borrow: the buffer of a dropped future goes back to its allocator.
            Completed::Orphaned(buf) => drop(buf),
        }
        if let Some(waker) = next {
            waker.wake();
        }
    }

    /// Wakes the first future in line on each device whose queue pair has room: for room
    /// freed by I/O that was not a future's (a callback's), whose completion wakes nobody.
    pub(crate) fn wake_for_room(&self, reactor: &Reactor<S>) {
        let devices = {
            let io = self.io.borrow();
            if io.room_waiting == 0 {
                return;
            }
            io.lines()
        };
        for d in 0..devices {
            let device = DeviceId::from_index(d as u16);
            let next = {
                let mut io = self.io.borrow_mut();
                if !io.has_line(d) || !reactor.has_room(device) {
                    continue;
                }
                io.next_in_line(device)
            };
            next.into_iter().for_each(Waker::wake);
        }
    }
}

/// Every future's I/O completion: stores it for the future and queues its task, which runs
/// in this same turn: once the batch of completions it came in has run its callbacks (one
/// executor run for the batch), or at once outside a batch (unless an executor run is what
/// completed it).
fn io_done<S: HasExecutor>(reactor: &mut Reactor<S>, state: &mut S, done: IoDone) {
    state.executor().local.core.complete_io(done);
    if !reactor.after_completions(run_woken::<S>) {
        run_woken(reactor, state);
    }
}

/// Runs the tasks woken so far.
fn run_woken<S: HasExecutor>(reactor: &mut Reactor<S>, state: &mut S) {
    let core = state.executor().local.core.clone();
    core.run(reactor, state, RUN_BATCH);
}

/// Where a future's I/O is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Not submitted yet.
    Start,
    /// In line for room on its queue pair.
    InLine {
        ticket: u64,
    },
    /// Out of line, with its turn to submit.
    Turn,
    InFlight {
        key: usize,
    },
    Finished,
}

/// How an I/O future's I/O ended.
enum Outcome {
    /// Completed (well or not), with the buffer the completion gave back.
    Done(Result<(), IoFailure>, Option<IoBuf>),
    /// Refused for good; the buffer, if any, is still the future's.
    Refused(RejectReason),
}

/// What a submission came to.
enum Submitted {
    /// In flight.
    Yes,
    /// In line for room (the queue pair was full).
    InLine,
    /// Refused for good.
    Refused(RejectReason),
}

/// The state machine every I/O future shares.
struct Submission<'a, S: 'static> {
    local: &'a Local<S>,
    device: DeviceId,
    req: IoRequest,
    stage: Stage,
}

impl<'a, S: HasExecutor> Submission<'a, S> {
    #[inline]
    fn new(local: &'a Local<S>, device: DeviceId, req: IoRequest) -> Self {
        Submission {
            local,
            device,
            req,
            stage: Stage::Start,
        }
    }

    /// Advances the I/O; ready with its result and buffer (the completion's). `submit`
    /// hands the I/O to the reactor, given the request with its `user` set to the future's
    /// cell, and says why it was refused.
    #[inline]
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        submit: impl FnMut(&mut Reactor<S>, IoRequest) -> Result<(), RejectReason>,
    ) -> Poll<Outcome> {
        let core = &*self.local.core;
        // The usual cases first: in flight, or starting with nobody in line for room.
        if let Some(polled) = self.poll_in_flight(cx, Outcome::Done) {
            return polled;
        }
        if self.stage == Stage::Start {
            let mut io = core.io.borrow_mut();
            if io.room_waiting == 0 {
                // The waiter goes in first: the completion cannot come before the submission
                // returns, and a refusal (rare) just drops it again.
                let key = io.insert(Waiter::new(core, cx));
                drop(io);
                return match self.submit(core, cx, key, submit) {
                    Submitted::Yes | Submitted::InLine => Poll::Pending,
                    Submitted::Refused(reason) => Poll::Ready(Outcome::Refused(reason)),
                };
            }
        }
        self.poll_in_line(cx, submit)
    }

    /// In flight: `ready` made of its result and buffer once it completed.
    #[inline(always)]
    fn poll_in_flight<R>(
        &mut self,
        cx: &Context<'_>,
        ready: impl FnOnce(Result<(), IoFailure>, Option<IoBuf>) -> R,
    ) -> Option<Poll<R>> {
        let Stage::InFlight { key } = self.stage else {
            return None;
        };
        let core = &*self.local.core;
        let polled = core.io.borrow_mut().poll(key, core, cx, ready);
        if polled.is_ready() {
            self.stage = Stage::Finished;
        }
        Some(polled)
    }

    /// Submits with cell `key` for the completion; on a full queue pair, queues for room.
    #[inline(always)]
    fn submit(
        &mut self,
        core: &Core<S>,
        cx: &Context<'_>,
        key: usize,
        mut submit: impl FnMut(&mut Reactor<S>, IoRequest) -> Result<(), RejectReason>,
    ) -> Submitted {
        let req = self.req.with_user(key as u64);
        let submitted = core
            .lend
            .with(|reactor, _| submit(reactor, req))
            .expect("an I/O future was polled outside its reactor's executor");
        match submitted {
            Ok(()) => {
                count(&core.ios, 1);
                self.stage = Stage::InFlight { key };
                Submitted::Yes
            }
            Err(reason) => self.refused(core, cx, key, reason),
        }
    }

    #[cold]
    fn refused(
        &mut self,
        core: &Core<S>,
        cx: &Context<'_>,
        key: usize,
        reason: RejectReason,
    ) -> Submitted {
        let mut io = core.io.borrow_mut();
        io.remove(key);
        if reason.is_queue_full() {
            let front = self.stage == Stage::Turn;
            let ticket = io.wait_for_room(self.device, cx.waker(), front);
            self.stage = Stage::InLine { ticket };
            return Submitted::InLine;
        }
        self.stage = Stage::Finished;
        Submitted::Refused(reason)
    }

    /// The cases where futures wait for room on a full queue pair.
    #[cold]
    fn poll_in_line(
        &mut self,
        cx: &mut Context<'_>,
        submit: impl FnMut(&mut Reactor<S>, IoRequest) -> Result<(), RejectReason>,
    ) -> Poll<Outcome> {
        let core = &*self.local.core;
        match self.stage {
            Stage::Start => {
                let mut io = core.io.borrow_mut();
                // First come, first served: behind those already in line.
                if io.others_waiting(self.device) {
                    let ticket = io.wait_for_room(self.device, cx.waker(), false);
                    self.stage = Stage::InLine { ticket };
                    return Poll::Pending;
                }
            }
            Stage::InLine { ticket } => {
                let mut io = core.io.borrow_mut();
                if io.still_waiting(self.device, ticket, cx.waker()) {
                    return Poll::Pending;
                }
                self.stage = Stage::Turn;
            }
            Stage::Turn => {}
            Stage::InFlight { .. } => unreachable!("handled by `poll`"),
            Stage::Finished => panic!("an I/O future was polled after it completed"),
        }
        let key = core.io.borrow_mut().insert(Waiter::new(core, cx));
        match self.submit(core, cx, key, submit) {
            Submitted::Yes | Submitted::InLine => Poll::Pending,
            Submitted::Refused(reason) => Poll::Ready(Outcome::Refused(reason)),
        }
    }
}

impl<S: 'static> Drop for Submission<'_, S> {
    #[inline]
    fn drop(&mut self) {
        if !matches!(self.stage, Stage::Start | Stage::Finished) {
            self.drop_unfinished();
        }
    }
}

impl<S: 'static> Submission<'_, S> {
    #[cold]
    fn drop_unfinished(&mut self) {
        let core = &self.local.core;
        let mut io = core.io.borrow_mut();
        let pass_turn = match self.stage {
            Stage::InFlight { key } => {
                if let Some(buf) = io.orphan(key) {
                    // Completed, never taken: the completion (and its buffer) goes now.
                    drop(io);
                    drop(buf);
                    return;
                }
                count(&core.ios_orphaned, 1);
                false
            }
            Stage::InLine { ticket } => !io.leave(self.device, ticket),
            Stage::Turn => true,
            Stage::Start | Stage::Finished => unreachable!("checked by `drop`"),
        };
        // Its turn for room came and it will not use it: the next in line gets it.
        let next = if pass_turn {
            io.next_in_line(self.device)
        } else {
            None
        };
        drop(io);
        if let Some(waker) = next {
            waker.wake();
        }
    }
}

/// A read, write or other I/O with an owned buffer (or none), in flight or about to be;
/// resolves to `T` (see [`IoOutput`]). Submits on its first poll; waits for room on a full
/// queue pair. Dropping it does not cancel the I/O: the reactor keeps the buffer until the
/// device completes it, then drops it.
#[must_use = "an I/O future does nothing until awaited"]
pub struct IoFuture<'a, S: 'static, T> {
    submission: Submission<'a, S>,
    buf: Option<IoBuf>,
    _output: PhantomData<fn() -> T>,
}

impl<'a, S: HasExecutor, T: IoOutput> IoFuture<'a, S, T> {
    pub(crate) fn new(
        local: &'a Local<S>,
        device: DeviceId,
        req: IoRequest,
        buf: Option<IoBuf>,
    ) -> Self {
        IoFuture {
            submission: Submission::new(local, device, req),
            buf,
            _output: PhantomData,
        }
    }
}

impl<S: HasExecutor, T: IoOutput> Future for IoFuture<'_, S, T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = self.get_mut();
        // In flight: the output made straight from the completion, into the return value.
        if let Stage::InFlight { key } = this.submission.stage {
            let core = &*this.submission.local.core;
            let polled = core.io.borrow_mut().poll(key, core, cx, T::from_done);
            if polled.is_ready() {
                this.submission.stage = Stage::Finished;
            }
            return polled;
        }
        let buf = &mut this.buf;
        let device = this.submission.device;
        let submit = |reactor: &mut Reactor<S>, req| {
            reactor
                .submit(device, req, buf.take(), io_done::<S>)
                .map_err(|rejected| {
                    *buf = rejected.buf;
                    rejected.reason
                })
        };
        match this.submission.poll(cx, submit) {
            Poll::Ready(Outcome::Done(result, buf)) => Poll::Ready(T::from_done(result, buf)),
            // A refused I/O's buffer is still here.
            Poll::Ready(Outcome::Refused(reason)) => Poll::Ready(T::from_parts(
                Err(IoError::Refused(reason)),
                this.buf.take(),
            )),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// A vectored read or write into registered memory (see [`Local::readv`]). Resolves to
/// its result; the data is in the regions.
#[must_use = "an I/O future does nothing until awaited"]
pub struct VectoredFuture<'a, S: 'static, V> {
    submission: Submission<'a, S>,
    segments: V,
}

impl<'a, S: HasExecutor, V> VectoredFuture<'a, S, V> {
    pub(crate) fn new(local: &'a Local<S>, device: DeviceId, req: IoRequest, segments: V) -> Self {
        VectoredFuture {
            submission: Submission::new(local, device, req),
            segments,
        }
    }
}

impl<S: HasExecutor, V: AsRef<[hypoll_reactor::RegionSlice]> + Unpin> Future
    for VectoredFuture<'_, S, V>
{
    type Output = Result<(), IoError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let segments = this.segments.as_ref();
        let device = this.submission.device;
        let submit = |reactor: &mut Reactor<S>, req| {
            reactor
                .submit_vectored(device, req, segments, io_done::<S>)
                .map_err(|rejected| rejected.reason)
        };
        this.submission
            .poll(cx, submit)
            .map(|outcome| match outcome {
                Outcome::Done(result, _) => result.map_err(IoError::Failed),
                Outcome::Refused(reason) => Err(IoError::Refused(reason)),
            })
    }
}

/// Shorthand for a [`IoFailure`] as the futures report it.
impl From<IoFailure> for IoError {
    fn from(failure: IoFailure) -> Self {
        IoError::Failed(failure)
    }
}
