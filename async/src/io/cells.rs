//! Where an I/O future and its completion meet: a cell per I/O in flight, found by the
//! request's `user` number, in a slab that grows to the most I/Os ever in flight at once
//! and never again; and the lines of futures waiting for room on a full queue pair.

use std::collections::VecDeque;
use std::task::{Context, Poll, Waker};

use hypoll_reactor::{DeviceId, IoBuf, IoFailure};

use super::IoOutput;
use crate::executor::Core;
use crate::task::LocalRef;

/// Who awaits an I/O.
pub(super) enum Waiter {
    /// The task that polled its future, with that task's own waker: the completion queues
    /// it to run directly (no waker clone, no atomic).
    Task(LocalRef),
    /// Any other waker (a combinator's, say).
    Waker(Waker),
}

impl Waiter {
    /// The waiter for a future polled with `cx` in a task of `core`.
    #[inline(always)]
    pub(super) fn new<S>(core: &Core<S>, cx: &Context<'_>) -> Waiter {
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
}

/// What a cell holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not in use; `next` is the next free cell.
    Free,
    /// In flight; `waiter` awaits it.
    Waiting,
    /// Completed successfully, with `buf`; the future takes it on its next poll.
    Done,
    /// Completed and failed, with `result` and `buf`. Apart from `Done` so that a success
    /// writes and reads no result: written as bytes and read back as a wider word soon
    /// after, it would cost the CPU a store it cannot forward.
    Failed,
    /// Its future was dropped: the completion drops the buffer and frees the cell.
    Orphaned,
}

/// What a cell carries besides its state.
enum Payload {
    /// Waiting: who awaits the I/O.
    Waiter(Waiter),
    /// Done: the buffer the completion gave back (if any); `None` in every other state.
    Buf(Option<IoBuf>),
}

/// A cell's payload when it carries nothing.
const EMPTY: Payload = Payload::Buf(None);

/// One I/O's place between its future and its completion: 32 bytes, two to a cache line
/// (every I/O touches its cell twice, on completion and on its future's poll).
struct Cell {
    state: State,
    /// Failed: the I/O's result (the error).
    result: Result<(), IoFailure>,
    /// Free: the next free cell, or `NONE`.
    next: u32,
    payload: Payload,
}

// Two cells to a cache line, on the platforms built for (64-bit pointers).
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Cell>() == 32);

/// No free cell.
const NONE: u32 = u32::MAX;

/// The executor's I/O bookkeeping.
pub(crate) struct IoCells {
    cells: Vec<Cell>,
    /// The first free cell, or `NONE`.
    free: u32,
    in_use: usize,
    /// Per device index: futures waiting for room on its queue pair, oldest first, each by
    /// its ticket.
    room: Vec<VecDeque<(u32, Waker)>>,
    /// Futures waiting for room, on every device.
    pub(super) room_waiting: usize,
    /// Wraps: tickets are told apart only among those in line at once.
    next_ticket: u32,
}

impl Default for IoCells {
    fn default() -> Self {
        IoCells {
            cells: Vec::new(),
            free: NONE,
            in_use: 0,
            room: Vec::new(),
            room_waiting: 0,
            next_ticket: 0,
        }
    }
}

impl IoCells {
    /// I/Os in flight from futures, those of dropped futures included.
    pub(super) fn in_use(&self) -> usize {
        self.in_use
    }

    /// A cell for an I/O about to be submitted; returns its key.
    #[inline(always)]
    pub(super) fn insert(&mut self, waiter: Waiter) -> usize {
        self.in_use += 1;
        let key = self.free;
        if key == NONE {
            return self.push(waiter);
        }
        let cell = &mut self.cells[key as usize];
        debug_assert!(cell.state == State::Free && matches!(cell.payload, Payload::Buf(None)));
        self.free = cell.next;
        cell.state = State::Waiting;
        cell.payload = Payload::Waiter(waiter);
        key as usize
    }

    /// A new cell, for one more I/O in flight than ever before.
    #[cold]
    #[inline(never)]
    fn push(&mut self, waiter: Waiter) -> usize {
        let key = self.cells.len();
        assert!(key < NONE as usize, "more I/Os in flight than a u32 counts");
        self.cells.push(Cell {
            state: State::Waiting,
            result: Ok(()),
            next: NONE,
            payload: Payload::Waiter(waiter),
        });
        key
    }

    /// Cell `key`, emptied already, is free again.
    #[inline(always)]
    fn free(&mut self, key: usize) {
        let cell = &mut self.cells[key];
        debug_assert!(matches!(cell.payload, Payload::Buf(None)));
        cell.state = State::Free;
        cell.next = self.free;
        self.free = key as u32;
        self.in_use -= 1;
    }

    /// The I/O of cell `key` was refused: its cell goes.
    pub(super) fn remove(&mut self, key: usize) {
        let cell = &mut self.cells[key];
        debug_assert_eq!(cell.state, State::Waiting);
        let waiter = std::mem::replace(&mut cell.payload, EMPTY);
        self.free(key);
        drop(waiter);
    }

    /// The completion of cell `key`'s I/O: the cell keeps the result and buffer for its
    /// future, whose waiter is returned to be woken; the cell of a dropped future is freed,
    /// and the buffer dropped (the device is done with it now).
    #[inline(always)]
    pub(super) fn complete(
        &mut self,
        key: usize,
        result: Result<(), IoFailure>,
        buf: Option<IoBuf>,
    ) -> Option<Waiter> {
        let cell = &mut self.cells[key];
        if cell.state == State::Waiting {
            cell.state = State::Done;
            if result.is_err() {
                cell.state = State::Failed;
                cell.result = result;
            }
            return match std::mem::replace(&mut cell.payload, Payload::Buf(buf)) {
                Payload::Waiter(waiter) => Some(waiter),
                Payload::Buf(_) => unreachable!("a waiting cell holds its waiter"),
            };
        }
        self.complete_orphaned(key, buf);
        None
    }

    #[cold]
    #[inline(never)]
    fn complete_orphaned(&mut self, key: usize, buf: Option<IoBuf>) {
        let state = self.cells[key].state;
        assert_eq!(
            state,
            State::Orphaned,
            "an I/O completed twice, or for no future (cell {key})"
        );
        self.free(key);
        drop(buf);
    }

    /// Whether cell `key`'s I/O completed (its future may `take` it).
    #[inline(always)]
    pub(super) fn is_done(&self, key: usize) -> bool {
        matches!(self.cells[key].state, State::Done | State::Failed)
    }

    /// The output of cell `key`'s completed I/O (see `is_done`), made of its result and
    /// buffer; the cell is free again.
    #[inline(always)]
    pub(super) fn take<T: IoOutput>(&mut self, key: usize) -> T {
        let cell = &mut self.cells[key];
        if cell.state == State::Failed {
            return self.take_failed(key);
        }
        debug_assert_eq!(cell.state, State::Done);
        // Taken in place: the payload stays `Buf(None)`, as a free cell's is.
        let Payload::Buf(buf) = &mut cell.payload else {
            unreachable!("a done cell holds no waiter")
        };
        let buf = buf.take();
        self.free(key);
        T::from_ok(buf)
    }

    /// `take` for an I/O that failed: the one that reads the result.
    #[cold]
    #[inline(never)]
    fn take_failed<T: IoOutput>(&mut self, key: usize) -> T {
        let cell = &mut self.cells[key];
        let result = cell.result;
        let Payload::Buf(buf) = &mut cell.payload else {
            unreachable!("a done cell holds no waiter")
        };
        let buf = buf.take();
        self.free(key);
        T::from_done(result, buf)
    }

    /// `ready` made of the result and buffer of cell `key`'s I/O if it completed (the cell
    /// is free again); pending otherwise.
    #[inline(always)]
    pub(super) fn take_done<R>(
        &mut self,
        key: usize,
        ready: impl FnOnce(Result<(), IoFailure>, Option<IoBuf>) -> R,
    ) -> Poll<R> {
        let cell = &mut self.cells[key];
        let result = match cell.state {
            State::Done => Ok(()),
            State::Failed => cell.result,
            _ => return Poll::Pending,
        };
        // Taken in place: the payload stays `Buf(None)`, as a free cell's is.
        let Payload::Buf(buf) = &mut cell.payload else {
            unreachable!("a done cell holds no waiter")
        };
        let buf = buf.take();
        self.free(key);
        // Spelled out for the usual case, so that it carries no failure to unpack.
        if result.is_ok() {
            return Poll::Ready(ready(Ok(()), buf));
        }
        Poll::Ready(ready(result, buf))
    }

    /// The future of cell `key` was polled again before its I/O completed: `cx`'s task
    /// is the one to wake.
    #[inline]
    pub(super) fn rearm<S>(&mut self, key: usize, core: &Core<S>, cx: &Context<'_>) {
        let Payload::Waiter(waiter) = &mut self.cells[key].payload else {
            unreachable!("a live future's cell, not done, is waiting")
        };
        if !waiter.will_wake(cx) {
            *waiter = Waiter::new(core, cx);
        }
    }

    /// The future of cell `key` was dropped: a completion that came already is returned
    /// (for the caller to drop outside the borrow); otherwise the cell waits for it,
    /// orphaned.
    pub(super) fn orphan(&mut self, key: usize) -> Option<Option<IoBuf>> {
        let cell = &mut self.cells[key];
        let payload = std::mem::replace(&mut cell.payload, EMPTY);
        match cell.state {
            State::Done | State::Failed => {
                self.free(key);
                match payload {
                    Payload::Buf(buf) => Some(buf),
                    Payload::Waiter(_) => unreachable!("a done cell holds no waiter"),
                }
            }
            State::Waiting => {
                // The waiter goes now (it may hold the task), the cell when the I/O ends.
                cell.state = State::Orphaned;
                drop(payload);
                None
            }
            State::Free | State::Orphaned => {
                unreachable!("a live future's cell is in use and not orphaned")
            }
        }
    }

    fn queue(&mut self, device: DeviceId) -> &mut VecDeque<(u32, Waker)> {
        let d = usize::from(device.index());
        if self.room.len() <= d {
            self.room.resize_with(d + 1, VecDeque::new);
        }
        &mut self.room[d]
    }

    /// Queues a future for room on `device`: at the back, or at the front for one whose
    /// turn came and found the queue pair full again.
    pub(super) fn wait_for_room(&mut self, device: DeviceId, waker: &Waker, front: bool) -> u32 {
        let ticket = self.next_ticket;
        self.next_ticket = self.next_ticket.wrapping_add(1);
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
    pub(super) fn still_waiting(&mut self, device: DeviceId, ticket: u32, waker: &Waker) -> bool {
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
    pub(super) fn leave(&mut self, device: DeviceId, ticket: u32) -> bool {
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
    pub(super) fn next_in_line(&mut self, device: DeviceId) -> Option<Waker> {
        if self.room_waiting == 0 {
            return None;
        }
        self.pop_in_line(device)
    }

    #[cold]
    pub(super) fn pop_in_line(&mut self, device: DeviceId) -> Option<Waker> {
        let (_, waker) = self.queue(device).pop_front()?;
        self.room_waiting -= 1;
        Some(waker)
    }

    #[inline]
    pub(super) fn others_waiting(&mut self, device: DeviceId) -> bool {
        self.room_waiting > 0 && !self.queue(device).is_empty()
    }

    /// Devices with a line, for `Core::wake_for_room`.
    pub(super) fn lines(&self) -> usize {
        self.room.len()
    }

    pub(super) fn has_line(&self, d: usize) -> bool {
        self.room.get(d).is_some_and(|queue| !queue.is_empty())
    }
}
