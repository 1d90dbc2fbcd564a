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
mod error;

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use hypoll_reactor::{DeviceId, IoBuf, IoDone, IoFailure, IoOp, IoRequest, Reactor, RejectReason};

use crate::executor::{count, Core, RUN_BATCH};
use crate::task::LocalRef;
use crate::{HasExecutor, Local};
pub(crate) use cells::IoCells;
use cells::Waiter;
pub use error::{BufError, IoError, IoOutput};

impl<S: 'static> Core<S> {
    pub(crate) fn ios_in_flight(&self) -> usize {
        self.io.borrow().in_use()
    }

    /// An I/O of a future completed: its result goes to the cell (or, orphaned, is
    /// dropped), and the first future waiting for room on its device gets its turn.
    /// Wakes the future's task, or returns it to be polled at once when it is woken
    /// `alone` or awaits no other I/O, and may be (see `may_poll_alone`).
    #[inline(always)]
    fn complete_io(
        &self,
        key: usize,
        result: Result<(), IoFailure>,
        buf: Option<IoBuf>,
        device: DeviceId,
        alone: bool,
    ) -> Option<LocalRef> {
        let mut io = self.io.borrow_mut();
        let waiter = io.complete(key, result, buf);
        let room_waiting = io.room_waiting;
        drop(io);
        if room_waiting > 0 {
            self.pass_room(device);
        }
        match waiter? {
            Waiter::Task(task) if (alone || task.is_only()) && self.may_poll_alone() => {
                return Some(task)
            }
            Waiter::Task(task) => task.wake(),
            Waiter::Waker(waker) => waker.wake(),
        }
        None
    }

    /// A slot of `device`'s queue pair freed: the first future in line for room gets it.
    #[cold]
    #[inline(never)]
    fn pass_room(&self, device: DeviceId) {
        let next = self.io.borrow_mut().pop_in_line(device);
        if let Some(waker) = next {
            waker.wake();
        }
    }

    /// Wakes the first future in line on each device whose queue pair has room: for room
    /// freed by I/O that was not a future's (a callback's), whose completion wakes nobody.
    #[inline]
    pub(crate) fn wake_for_room(&self, reactor: &Reactor<S>) {
        if self.io.borrow().room_waiting > 0 {
            self.wake_lines_with_room(reactor);
        }
    }

    #[cold]
    #[inline(never)]
    fn wake_lines_with_room(&self, reactor: &Reactor<S>) {
        let devices = self.io.borrow().lines();
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

/// Every future's I/O completion: stores it for the future and wakes its task, in the
/// turn that reaped the completion. A task with no other I/O of its own in flight, or
/// woken alone (by the batch's only completion, or outside a batch), is polled at once,
/// as a callback would run, unless a task is being polled or waits in the run queue: it
/// costs no trip through the run queue, and its memory is touched once while it is
/// still in the cache from the completion. The tasks a batch wakes otherwise (one that
/// awaits several I/Os, which the batch may complete together) run together once the
/// batch has run its callbacks (one executor run for the batch, one poll for the task).
fn io_done<S: HasExecutor>(reactor: &mut Reactor<S>, state: &mut S, done: IoDone) {
    // Taken apart at once: moved whole, the completion is copied in wider pieces than the
    // reactor wrote it in, which the CPU cannot forward from its stores.
    let IoDone {
        device,
        result,
        buf,
        user,
        ..
    } = done;
    let alone = reactor.completions_left() == 0;
    let core = &*state.executor().local.core;
    if let Some(task) = core.complete_io(user as usize, result, buf, device, alone) {
        // Polled alone, the task ran with nothing queued before it; what it woke (or
        // spawned) is queued, and waits for the executor's next run as below.
        let core = state.executor().local.core.clone();
        core.poll_alone(reactor, state, task);
        if core.queue.len() == 0 {
            return;
        }
    }
    let core = &*state.executor().local.core;
    // Asked once per batch: the reactor runs `run_woken` after the batch's last callback.
    if core.queue.len() == 0 || core.run_asked.get() {
        return;
    }
    if reactor.after_completions(run_woken::<S>) {
        core.run_asked.set(true);
    } else {
        run_woken(reactor, state);
    }
}

/// Runs the tasks woken so far.
fn run_woken<S: HasExecutor>(reactor: &mut Reactor<S>, state: &mut S) {
    let core = state.executor().local.core.clone();
    core.run_asked.set(false);
    core.run(reactor, state, RUN_BATCH);
}

/// Where a future's I/O is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Not submitted yet.
    Start,
    /// In line for room on its queue pair.
    InLine {
        ticket: u32,
    },
    /// Out of line, with its turn to submit.
    Turn,
    /// Its cell's key (below `u32::MAX`, as `IoCells` keeps them): the stage is 8 bytes,
    /// and the future in the task smaller.
    InFlight {
        key: u32,
    },
    Finished,
}

/// What a submission came to, when it is not in flight.
enum NotInFlight {
    /// In line for room (the queue pair was full).
    InLine,
    /// Refused for good; the buffer, if any, is still the future's.
    Refused(RejectReason),
}

/// The state machine every I/O future shares. Kept small (the request without its `user`,
/// which the cell's key fills in): it lives in the task, which every completion touches.
struct Submission<'a, S: 'static> {
    core: &'a Core<S>,
    slba: u64,
    nlb: u32,
    device: DeviceId,
    op: IoOp,
    /// The request's `fua` and `deallocate`, as bits (`FUA`, `DEALLOCATE`).
    flags: u8,
    stage: Stage,
}

const FUA: u8 = 1;
const DEALLOCATE: u8 = 2;

impl<'a, S: HasExecutor> Submission<'a, S> {
    #[inline(always)]
    fn new(local: &'a Local<S>, device: DeviceId, req: IoRequest) -> Self {
        Submission {
            core: &local.core,
            slba: req.slba,
            nlb: req.nlb,
            device,
            op: req.op,
            flags: if req.fua { FUA } else { 0 } | if req.deallocate { DEALLOCATE } else { 0 },
            stage: Stage::Start,
        }
    }

    /// The request, with its `user` set to cell `key` and its operation `op`.
    #[inline(always)]
    fn request(&self, op: IoOp, key: usize) -> IoRequest {
        IoRequest {
            op,
            slba: self.slba,
            nlb: self.nlb,
            fua: self.flags & FUA != 0,
            deallocate: self.flags & DEALLOCATE != 0,
            user: key as u64,
        }
    }

    /// Advances the I/O; ready with its completion's result and buffer, or with its
    /// refusal. `submit` hands the I/O to the reactor with cell `key` for its completion
    /// (see `request`), and says why it was refused.
    #[inline(always)]
    fn poll<B, R>(
        &mut self,
        cx: &mut Context<'_>,
        own: &mut B,
        submit: impl FnOnce(&mut B, &Self, usize) -> Result<(), RejectReason>,
        done: impl FnOnce(Result<(), IoFailure>, Option<IoBuf>) -> R,
        refused: impl FnOnce(&mut B, RejectReason) -> R,
    ) -> Poll<R> {
        let core = self.core;
        // The usual cases first: in flight, or starting with nobody in line for room.
        match self.stage {
            Stage::InFlight { key } => {
                let key = key as usize;
                let mut io = core.io.borrow_mut();
                let polled = io.take_done(key, done);
                if polled.is_ready() {
                    self.stage = Stage::Finished;
                } else {
                    io.rearm(key, core, cx);
                }
                return polled;
            }
            Stage::Start => {
                let mut io = core.io.borrow_mut();
                if io.room_waiting == 0 {
                    // The waiter goes in first: the completion cannot come before the
                    // submission returns, and a refusal (rare) just drops it again.
                    let key = io.insert(Waiter::new(core, cx));
                    drop(io);
                    return match self.submit(cx, key, own, submit) {
                        Ok(()) | Err(NotInFlight::InLine) => Poll::Pending,
                        Err(NotInFlight::Refused(reason)) => Poll::Ready(refused(own, reason)),
                    };
                }
            }
            _ => {}
        }
        match self.poll_in_line(cx) {
            Some(key) => match self.submit(cx, key, own, submit) {
                Ok(()) | Err(NotInFlight::InLine) => Poll::Pending,
                Err(NotInFlight::Refused(reason)) => Poll::Ready(refused(own, reason)),
            },
            None => Poll::Pending,
        }
    }

    /// Submits with cell `key` for the completion; on a full queue pair, queues for room.
    #[inline(always)]
    fn submit<B>(
        &mut self,
        cx: &Context<'_>,
        key: usize,
        own: &mut B,
        submit: impl FnOnce(&mut B, &Self, usize) -> Result<(), RejectReason>,
    ) -> Result<(), NotInFlight> {
        match submit(own, self, key) {
            Ok(()) => {
                count(&self.core.ios, 1);
                self.stage = Stage::InFlight { key: key as u32 };
                Ok(())
            }
            Err(reason) => Err(self.refused(cx, key, reason)),
        }
    }

    #[cold]
    #[inline(never)]
    fn refused(&mut self, cx: &Context<'_>, key: usize, reason: RejectReason) -> NotInFlight {
        let mut io = self.core.io.borrow_mut();
        io.remove(key);
        if reason.is_queue_full() {
            let front = self.stage == Stage::Turn;
            let ticket = io.wait_for_room(self.device, cx.waker(), front);
            self.stage = Stage::InLine { ticket };
            return NotInFlight::InLine;
        }
        self.stage = Stage::Finished;
        NotInFlight::Refused(reason)
    }

    /// The cases where futures wait for room on a full queue pair: the cell to submit
    /// with once its turn came, or `None` while it waits.
    #[cold]
    #[inline(never)]
    fn poll_in_line(&mut self, cx: &mut Context<'_>) -> Option<usize> {
        let core = self.core;
        match self.stage {
            Stage::Start => {
                let mut io = core.io.borrow_mut();
                // First come, first served: behind those already in line.
                if io.others_waiting(self.device) {
                    let ticket = io.wait_for_room(self.device, cx.waker(), false);
                    self.stage = Stage::InLine { ticket };
                    return None;
                }
            }
            Stage::InLine { ticket } => {
                let mut io = core.io.borrow_mut();
                if io.still_waiting(self.device, ticket, cx.waker()) {
                    return None;
                }
                self.stage = Stage::Turn;
            }
            Stage::Turn => {}
            Stage::InFlight { .. } => unreachable!("handled by `poll`"),
            Stage::Finished => panic!("an I/O future was polled after it completed"),
        }
        Some(core.io.borrow_mut().insert(Waiter::new(core, cx)))
    }
}

#[cold]
#[inline(never)]
fn not_lent() -> ! {
    panic!("an I/O future was polled outside its reactor's executor")
}

impl<S: 'static> Drop for Submission<'_, S> {
    #[inline(always)]
    fn drop(&mut self) {
        if !matches!(self.stage, Stage::Start | Stage::Finished) {
            self.drop_unfinished();
        }
    }
}

impl<S: 'static> Submission<'_, S> {
    #[cold]
    #[inline(never)]
    fn drop_unfinished(&mut self) {
        let core = self.core;
        let mut io = core.io.borrow_mut();
        let pass_turn = match self.stage {
            Stage::InFlight { key } => {
                if let Some(buf) = io.orphan(key as usize) {
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

    /// The two usual polls, spelled out so that the result goes from the cell to the
    /// output in one move and the request to the reactor in registers: in flight (done
    /// or not yet), and the first poll with nobody in line for room. The rest goes
    /// through `Submission::poll`.
    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = self.get_mut();
        let core = this.submission.core;
        match this.submission.stage {
            Stage::InFlight { key } => {
                let key = key as usize;
                let mut io = core.io.borrow_mut();
                if !io.is_done(key) {
                    io.rearm(key, core, cx);
                    return Poll::Pending;
                }
                this.submission.stage = Stage::Finished;
                return Poll::Ready(io.take(key));
            }
            Stage::Start => {
                let mut io = core.io.borrow_mut();
                if io.room_waiting == 0 {
                    let key = io.insert(Waiter::new(core, cx));
                    drop(io);
                    let sub = &mut this.submission;
                    if submit_buffered(sub, key, &mut this.buf) {
                        count(&core.ios, 1);
                        sub.stage = Stage::InFlight { key: key as u32 };
                        return Poll::Pending;
                    }
                    return this.refused_at_start(cx, key);
                }
            }
            _ => {}
        }
        this.poll_slow(cx)
    }
}

impl<S: HasExecutor, T: IoOutput> IoFuture<'_, S, T> {
    /// The first submission was refused (`submit_buffered` said why in the core).
    #[cold]
    #[inline(never)]
    fn refused_at_start(&mut self, cx: &Context<'_>, key: usize) -> Poll<T> {
        let reason = self
            .submission
            .core
            .refusal
            .take()
            .expect("a refusal says why");
        match self.submission.refused(cx, key, reason) {
            NotInFlight::InLine => Poll::Pending,
            NotInFlight::Refused(reason) => Poll::Ready(T::from_parts(
                Err(IoError::Refused(reason)),
                self.buf.take(),
            )),
        }
    }

    /// Every other case: waiting for room on a full queue pair, or starting behind others
    /// who do.
    #[cold]
    #[inline(never)]
    fn poll_slow(&mut self, cx: &mut Context<'_>) -> Poll<T> {
        let this = self;
        let submit = |buf: &mut Option<IoBuf>, sub: &Submission<'_, S>, key: usize| {
            if submit_buffered(sub, key, buf) {
                Ok(())
            } else {
                Err(sub.core.refusal.take().expect("a refusal says why"))
            }
        };
        // A refused I/O's buffer is back here (put back by `submit`).
        let refused = |buf: &mut Option<IoBuf>, reason| {
            T::from_parts(Err(IoError::Refused(reason)), buf.take())
        };
        this.submission
            .poll(cx, &mut this.buf, submit, T::from_done, refused)
    }
}

/// Hands an I/O with its buffer (if any) to the reactor, with cell `key` for its
/// completion; true if accepted. A refusal puts the buffer back and leaves its reason in
/// the core (`Core::refusal`): the usual answer is one register wide. Not inlined: the
/// reactor's submission is large, and as a call of its own it takes its arguments in
/// registers.
#[inline(never)]
fn submit_buffered<S: HasExecutor>(
    sub: &Submission<'_, S>,
    key: usize,
    buf: &mut Option<IoBuf>,
) -> bool {
    let core = sub.core;
    let req = |op| sub.request(op, key);
    let device = sub.device;
    let submitted = core.lend.with(|reactor, _| {
        // The two operations with a buffer spelled out: with the operation known at
        // compile time, the reactor builds the command and picks the latency bucket
        // without a branch.
        match sub.op {
            IoOp::Read => reactor.submit(device, req(IoOp::Read), buf.take(), io_done::<S>),
            IoOp::Write => reactor.submit(device, req(IoOp::Write), buf.take(), io_done::<S>),
            op => reactor.submit(device, req(op), buf.take(), io_done::<S>),
        }
    });
    match submitted {
        Some(Ok(())) => true,
        Some(Err(rejected)) => {
            *buf = rejected.buf;
            core.refusal.set(Some(rejected.reason));
            false
        }
        None => not_lent(),
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
        let device = this.submission.device;
        let submit = |segments: &mut V, sub: &Submission<'_, S>, key| {
            let req = sub.request(sub.op, key);
            sub.core
                .lend
                .with(|reactor, _| {
                    reactor
                        .submit_vectored(device, req, segments.as_ref(), io_done::<S>)
                        .map_err(|rejected| rejected.reason)
                })
                .unwrap_or_else(|| not_lent())
        };
        this.submission.poll(
            cx,
            &mut this.segments,
            submit,
            |result, _| result.map_err(IoError::Failed),
            |_, reason| Err(IoError::Refused(reason)),
        )
    }
}
