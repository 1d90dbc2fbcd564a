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

use std::collections::VecDeque;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use hypoll_reactor::{DeviceId, IoBuf, IoDone, IoFailure, IoRequest, Reactor, RejectReason};
use slab::Slab;

use crate::executor::{count, Core, RUN_BATCH};
use crate::task::LocalRef;
use crate::{HasExecutor, Local};

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
}

/// Flush, write zeroes, deallocate: no buffer.
impl IoOutput for Result<(), IoError> {
    fn from_parts(result: Result<(), IoError>, _buf: Option<IoBuf>) -> Self {
        result
    }
}

/// Any I/O ([`Local::submit`]): the buffer, if it had one.
impl IoOutput for Result<Option<IoBuf>, BufError> {
    fn from_parts(result: Result<(), IoError>, buf: Option<IoBuf>) -> Self {
        match result {
            Ok(()) => Ok(buf),
            Err(error) => Err(BufError { error, buf }),
        }
    }
}

/// Who awaits an I/O.
enum Waiter {
    /// The task that polled its future, with that task's own waker: the completion queues
    /// it to run directly (no waker clone, no atomic).
    Task(LocalRef),
    /// Any other waker (a combinator's, say).
    Waker(Waker),
}

impl Waiter {
    /// The waiter for a future polled with `cx` in a task of `core`.
    #[inline]
    fn new<S>(core: &Core<S>, cx: &Context<'_>) -> Waiter {
        match core.current.local_ref(cx.waker()) {
            Some(task) => Waiter::Task(task),
            None => Waiter::Waker(cx.waker().clone()),
        }
    }

    #[inline]
    fn will_wake(&self, cx: &Context<'_>) -> bool {
        match self {
            Waiter::Task(task) => task.will_wake(cx.waker()),
            Waiter::Waker(waker) => waker.will_wake(cx.waker()),
        }
    }

    #[inline]
    fn wake(self) {
        match self {
            Waiter::Task(task) => task.wake(),
            Waiter::Waker(waker) => waker.wake(),
        }
    }
}

/// One I/O's place between its future and its completion.
enum IoCell {
    /// In flight; who awaits it.
    Waiting(Waiter),
    /// Completed, with its result and buffer; the future takes them on its next poll.
    Done(Result<(), IoFailure>, Option<IoBuf>),
    /// Its future was dropped: the completion drops the buffer and frees the cell.
    Orphaned,
}

/// The executor's I/O bookkeeping.
#[derive(Default)]
pub(crate) struct IoCells {
    /// One per I/O in flight from a future, keyed by the request's `user` number. Grows to
    /// the most I/Os ever in flight at once (bounded by the queue pairs' depths and wait
    /// queues), then never again.
    cells: Slab<IoCell>,
    /// Per device index: futures waiting for room on its queue pair, oldest first, each by
    /// its ticket.
    room: Vec<VecDeque<(u64, Waker)>>,
    /// Futures waiting for room, on every device.
    room_waiting: usize,
    next_ticket: u64,
}

impl IoCells {
    fn queue(&mut self, device: DeviceId) -> &mut VecDeque<(u64, Waker)> {
        let d = usize::from(device.index());
        if self.room.len() <= d {
            self.room.resize_with(d + 1, VecDeque::new);
        }
        &mut self.room[d]
    }

    /// Queues a future for room on `device`: at the back, or at the front for one whose
    /// turn came and found the queue pair full again.
    fn wait_for_room(&mut self, device: DeviceId, waker: &Waker, front: bool) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let queue = self.queue(device);
        if front {
            queue.push_front((ticket, waker.clone()));
        } else {
            queue.push_back((ticket, waker.clone()));
        }
        self.room_waiting += 1;
        ticket
    }

    /// Whether `ticket` is still in line; if so, it will be woken by `waker`.
    fn still_waiting(&mut self, device: DeviceId, ticket: u64, waker: &Waker) -> bool {
        let queue = self.queue(device);
        match queue.iter_mut().find(|(t, _)| *t == ticket) {
            Some((_, w)) => {
                if !w.will_wake(waker) {
                    *w = waker.clone();
                }
                true
            }
            None => false,
        }
    }

    /// Takes `ticket` out of line (its future was dropped); false if its turn had come.
    fn leave(&mut self, device: DeviceId, ticket: u64) -> bool {
        let queue = self.queue(device);
        let Some(at) = queue.iter().position(|(t, _)| *t == ticket) else {
            return false;
        };
        queue.remove(at);
        self.room_waiting -= 1;
        true
    }

    /// The first future in line for room on `device`, taken out of line.
    #[inline]
    fn next_in_line(&mut self, device: DeviceId) -> Option<Waker> {
        if self.room_waiting == 0 {
            return None;
        }
        self.pop_in_line(device)
    }

    #[cold]
    fn pop_in_line(&mut self, device: DeviceId) -> Option<Waker> {
        let (_, waker) = self.queue(device).pop_front()?;
        self.room_waiting -= 1;
        Some(waker)
    }

    #[inline]
    fn others_waiting(&mut self, device: DeviceId) -> bool {
        self.room_waiting > 0 && !self.queue(device).is_empty()
    }
}

impl<S: 'static> Core<S> {
    pub(crate) fn ios_in_flight(&self) -> usize {
        self.io.borrow().cells.len()
    }

    /// An I/O of a future completed: its result goes to the cell (or, orphaned, is
    /// dropped), and the first future waiting for room on its device gets its turn.
    fn complete_io(&self, done: IoDone) {
        let key = done.user as usize;
        let device = done.device;
        let mut io = self.io.borrow_mut();
        let (waiter, dropped) = match io.cells.get_mut(key) {
            Some(cell @ IoCell::Waiting(_)) => {
                let IoCell::Waiting(waiter) =
                    std::mem::replace(cell, IoCell::Done(done.result, done.buf))
                else {
                    unreachable!("matched just above")
                };
                (Some(waiter), None)
            }
            Some(IoCell::Orphaned) => (None, Some((io.cells.remove(key), done))),
            Some(IoCell::Done(..)) | None => {
                panic!("an I/O completed twice, or for no future (cell {key})")
            }
        };
        let next = io.next_in_line(device);
        drop(io);
        // Outside the borrow: the buffer of a dropped future goes back to its allocator.
        drop(dropped);
        if let Some(waiter) = waiter {
            waiter.wake();
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
            io.room.len()
        };
        for d in 0..devices {
            let device = DeviceId::from_index(d as u16);
            let next = {
                let mut io = self.io.borrow_mut();
                let waiting = io.room.get(d).is_some_and(|queue| !queue.is_empty());
                if !waiting || !reactor.has_room(device) {
                    continue;
                }
                io.next_in_line(device)
            };
            next.into_iter().for_each(Waker::wake);
        }
    }
}

/// Every future's I/O completion: stores it for the future, then runs the tasks it woke in
/// this same turn (unless an executor run is what completed it).
fn io_done<S: HasExecutor>(reactor: &mut Reactor<S>, state: &mut S, done: IoDone) {
    let core = state.executor().local().core;
    core.complete_io(done);
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

/// The state machine every I/O future shares.
struct Submission<'a, S: 'static> {
    local: &'a Local<S>,
    device: DeviceId,
    req: IoRequest,
    stage: Stage,
}

impl<'a, S: HasExecutor> Submission<'a, S> {
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
        mut submit: impl FnMut(&mut Reactor<S>, IoRequest) -> Result<(), RejectReason>,
    ) -> Poll<(Result<(), IoError>, Option<IoBuf>)> {
        let core = &self.local.core;
        loop {
            match self.stage {
                Stage::Start | Stage::Turn => {
                    let mut io = core.io.borrow_mut();
                    // First come, first served: behind those already in line.
                    if self.stage == Stage::Start && io.others_waiting(self.device) {
                        let ticket = io.wait_for_room(self.device, cx.waker(), false);
                        self.stage = Stage::InLine { ticket };
                        return Poll::Pending;
                    }
                    // The waker goes in first: the completion cannot come before the
                    // submission returns, and a refusal (rare) just drops it again.
                    let key = io.cells.insert(IoCell::Waiting(Waiter::new(core, cx)));
                    drop(io);
                    let req = self.req.with_user(key as u64);
                    let submitted = core
                        .lend
                        .with(|reactor, _| submit(reactor, req))
                        .expect("an I/O future was polled outside its reactor's executor");
                    match submitted {
                        Ok(()) => {
                            count(&core.ios, 1);
                            self.stage = Stage::InFlight { key };
                            return Poll::Pending;
                        }
                        Err(reason) => {
                            let mut io = core.io.borrow_mut();
                            io.cells.remove(key);
                            if reason.is_queue_full() {
                                let front = self.stage == Stage::Turn;
                                let ticket = io.wait_for_room(self.device, cx.waker(), front);
                                self.stage = Stage::InLine { ticket };
                                return Poll::Pending;
                            }
                            self.stage = Stage::Finished;
                            return Poll::Ready((Err(IoError::Refused(reason)), None));
                        }
                    }
                }
                Stage::InLine { ticket } => {
                    if core
                        .io
                        .borrow_mut()
                        .still_waiting(self.device, ticket, cx.waker())
                    {
                        return Poll::Pending;
                    }
                    self.stage = Stage::Turn;
                }
                Stage::InFlight { key } => {
                    let mut io = core.io.borrow_mut();
                    match &mut io.cells[key] {
                        IoCell::Waiting(waiter) => {
                            if !waiter.will_wake(cx) {
                                *waiter = Waiter::new(core, cx);
                            }
                            return Poll::Pending;
                        }
                        IoCell::Done(..) => {
                            let IoCell::Done(result, buf) = io.cells.remove(key) else {
                                unreachable!("matched just above")
                            };
                            self.stage = Stage::Finished;
                            return Poll::Ready((result.map_err(IoError::Failed), buf));
                        }
                        IoCell::Orphaned => unreachable!("a live future's cell is not orphaned"),
                    }
                }
                Stage::Finished => panic!("an I/O future was polled after it completed"),
            }
        }
    }
}

impl<S: 'static> Drop for Submission<'_, S> {
    fn drop(&mut self) {
        if matches!(self.stage, Stage::Start | Stage::Finished) {
            return;
        }
        let core = &self.local.core;
        let mut io = core.io.borrow_mut();
        let pass_turn = match self.stage {
            Stage::InFlight { key } => {
                if let IoCell::Done(..) = io.cells[key] {
                    // Completed, never taken: the completion (and its buffer) goes now.
                    let cell = io.cells.remove(key);
                    drop(io);
                    drop(cell);
                    return;
                }
                io.cells[key] = IoCell::Orphaned;
                count(&core.ios_orphaned, 1);
                false
            }
            Stage::InLine { ticket } => !io.leave(self.device, ticket),
            Stage::Turn => true,
            Stage::Start | Stage::Finished => unreachable!("returned above"),
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
            Poll::Ready((result, done_buf)) => {
                // A refused I/O's buffer is still here; a completed one's came back.
                Poll::Ready(T::from_parts(result, done_buf.or(this.buf.take())))
            }
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
        this.submission.poll(cx, submit).map(|(result, _)| result)
    }
}

/// Shorthand for a [`IoFailure`] as the futures report it.
impl From<IoFailure> for IoError {
    fn from(failure: IoFailure) -> Self {
        IoError::Failed(failure)
    }
}
