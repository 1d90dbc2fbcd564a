//! A virtqueue owned by a reactor: a poller that takes the guest's requests off the avail
//! ring, submits each as one command on the export's queue pair (vectored into the guest's
//! registered memory for reads and writes), and, as completions come back through its
//! inbox, writes the status byte, pushes the used ring and signals the call eventfd as
//! virtio's event-index rules allow.
//!
//! Notifications follow the reactor's policy. A poll that finds requests turns the guest's
//! notifications off, so while the reactor spins it reads the ring with no kicks (no exits
//! in the guest, no eventfd to drain). Just before the reactor blocks, `before_block` turns
//! them on again and looks at the ring once more: a request posted before the guest could
//! see notifications were on is found there and keeps the reactor from blocking; one posted
//! after is kicked. The kick eventfd is the poller's wake fd. How long the reactor spins
//! before it blocks is the policy's: with I/O outstanding its usual decision, with none its
//! idle decision, from when the guest's requests come (each batch taken off the ring is
//! reported: `Reactor::note_arrivals`).
//!
//! With an inflight area (`inflight.rs`) the ring records each head it takes and answers,
//! and, started after a back end that died, first runs again what that one left in flight.
//!
//! A new memory map is taken only once nothing taken under the old one is in flight: until
//! then the ring takes no new chain, and answers what it has through the old map. A hold
//! (the front end's message that replaces or removes memory, waiting) stops it taking
//! chains too, and it tells the control connection once all it took is answered
//! (`quiesce.rs`, which also holds the stop).
//!
//! Limits: at most the queue's size in flight (a slot each; a full table stops the ring
//! being read), one request waiting for room at the device, the chain buffer and segment
//! list reserved at start. Nothing on the I/O path allocates.

use std::fs::File;
use std::io::{Read, Write};
use std::num::Wrapping;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hypoll_reactor::{IoOp, IoRequest, Poller, Reactor, ReactorHandle, RegionSlice, SEGMENTS_MAX};
use vm_memory::GuestAddress;

use crate::blk::{S_IOERR, S_OK};
use crate::host::{HostMemory, RingView};
use crate::inflight::InflightQueue;
use crate::memory::{ConnShared, Space};
use crate::request::{parse, Op, ParseError, Request};
use crate::shard::{completed, user, ShardExport, VhostState};
use crate::split::SplitRing;
use crate::walk::{walk_chain, Buffer, ChainLimits};

/// `RingShared::base` while the ring runs.
const RUNNING: u32 = u32::MAX;
/// `RingShared::base` of a ring that could not start, or broke before it stopped.
const FAILED: u32 = u32::MAX - 1;

/// What a control connection and the ring it started share.
pub struct RingShared {
    /// Asked to stop: take no new request, finish those in flight, publish the base.
    stop: AtomicBool,
    /// The next avail index once stopped ([`RUNNING`] before).
    base: AtomicU32,
    /// The last hold epoch for which the ring had answered all it took (0: none).
    quiet: AtomicU64,
    /// A call eventfd the front end set while the ring runs, for the ring to take.
    call: Mutex<Option<Option<File>>>,
    call_changed: AtomicBool,
}

impl RingShared {
    pub fn new() -> Arc<RingShared> {
        Arc::new(RingShared {
            stop: AtomicBool::new(false),
            base: AtomicU32::new(RUNNING),
            quiet: AtomicU64::new(0),
            call: Mutex::new(None),
            call_changed: AtomicBool::new(false),
        })
    }

    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// The ring's next avail index once it stopped, `Some(None)` if it failed.
    pub fn stopped(&self) -> Option<Option<u16>> {
        match self.base.load(Ordering::Acquire) {
            RUNNING => None,
            FAILED => Some(None),
            base => Some(Some(base as u16)),
        }
    }

    /// The last hold epoch for which the ring had nothing in flight.
    pub fn quiet(&self) -> u64 {
        self.quiet.load(Ordering::Acquire)
    }

    pub(crate) fn fail(&self) {
        self.base.store(FAILED, Ordering::Release);
    }

    pub fn set_call(&self, call: Option<File>) {
        *self.call.lock().expect("never poisoned") = Some(call);
        self.call_changed.store(true, Ordering::Release);
    }
}

/// Everything a reactor needs to run a ring (sent by the control connection).
pub struct RingStart {
    pub export: usize,
    pub conn: Arc<ConnShared>,
    pub shared: Arc<RingShared>,
    pub queue_size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub base: u16,
    pub event_idx: bool,
    pub indirect: bool,
    pub kick: File,
    pub call: Option<File>,
    pub err: Option<File>,
    /// This ring's region of the front end's inflight area, where one was negotiated.
    pub inflight: Option<InflightQueue>,
    /// Tells the control connection the ring has stopped, or has answered all it took
    /// under a hold (runs on the ring's reactor; the control looks at the ring's shared
    /// state on its own).
    pub tell_control: Box<dyn Fn() + Send>,
}

/// A request taken off the ring and not yet answered.
#[derive(Clone, Copy, Debug)]
struct Slot {
    head: u16,
    status: GuestAddress,
    written: u32,
}

/// The ring's poller.
pub(crate) struct Vring<S> {
    inbox: usize,
    space: usize,
    export: ShardExport,
    queue: SplitRing,
    limits: ChainLimits,
    memory: Option<Arc<HostMemory>>,
    generation: u64,
    conn: Arc<ConnShared>,
    shared: Arc<RingShared>,
    kick: File,
    call: Option<File>,
    err: Option<File>,
    tell_control: Box<dyn Fn() + Send>,
    /// The hold epoch the ring last told the control it was quiet for.
    quiet_told: u64,
    /// Since when (reactor time) the ring has waited for requests under an old map or a
    /// hold to be answered, and whether it has said so in the log.
    quiescing_since_ns: Option<u64>,
    quiesce_logged: bool,
    /// Whether the guest's notifications are on.
    notify: bool,
    broken: bool,
    /// Requests in flight, by slot; `free` holds the others.
    slots: Vec<Slot>,
    free: Vec<u16>,
    /// A request refused for a full queue pair, retried before the ring is read again
    /// (and whether it is one a predecessor took).
    waiting: Option<(u16, Request, bool)>,
    /// Where the ring records what it takes and answers, for a successor.
    inflight: Option<InflightQueue>,
    /// Whether the ring has read what a predecessor left in the inflight area (once, when
    /// the ring is first mapped).
    recovered: bool,
    /// Heads a predecessor took and never answered, to run before any new avail entry;
    /// the next last. At most the queue's size.
    resubmit: Vec<u16>,
    chain: Vec<Buffer>,
    segs: Vec<RegionSlice>,
    _state: std::marker::PhantomData<fn(S)>,
}

impl<S: VhostState> Vring<S> {
    pub(crate) fn new(start: RingStart, inbox: usize, space: usize, export: ShardExport) -> Self {
        let size = start.queue_size;
        let queue = SplitRing::new(
            size,
            start.desc,
            start.avail,
            start.used,
            start.base,
            start.event_idx,
        );
        if let Err(e) = crate::sys::set_nonblocking(&start.kick) {
            tracing::warn!("making a kick eventfd non-blocking failed: {e}");
        }
        Vring {
            inbox,
            space,
            export,
            queue,
            limits: ChainLimits {
                queue_size: size,
                indirect: start.indirect,
            },
            memory: None,
            generation: u64::MAX,
            conn: start.conn,
            shared: start.shared,
            kick: start.kick,
            call: start.call,
            err: start.err,
            tell_control: start.tell_control,
            quiet_told: 0,
            quiescing_since_ns: None,
            quiesce_logged: false,
            // The front end starts a ring with notifications on.
            notify: true,
            broken: false,
            slots: vec![
                Slot {
                    head: 0,
                    status: GuestAddress(0),
                    written: 0
                };
                usize::from(size)
            ],
            free: (0..size).rev().collect(),
            waiting: None,
            recovered: start.inflight.is_none(),
            inflight: start.inflight,
            resubmit: Vec::with_capacity(usize::from(size)),
            chain: Vec::with_capacity(usize::from(size)),
            segs: Vec::with_capacity(SEGMENTS_MAX),
            _state: std::marker::PhantomData,
        }
    }

    fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Answers slot `slot` with `status`: the status byte, the used ring. Returns whether
    /// the slot was in flight.
    fn answer(&mut self, slot: u16, status: u8) -> bool {
        let Some(s) = self.slots.get(usize::from(slot)).copied() else {
            return false;
        };
        debug_assert!(!self.free.contains(&slot));
        self.free.push(slot);
        let written = if status == S_OK { s.written } else { 0 };
        self.push_used(s.head, s.status, status, written);
        true
    }

    /// Writes `status` at `at` and returns `head` to the guest with `written` data bytes.
    fn push_used(&mut self, head: u16, at: GuestAddress, status: u8, written: u32) {
        let Some(mem) = self.memory.as_deref() else {
            return;
        };
        // A status outside memory was refused when the request was walked; one the guest
        // unmapped since is its own loss.
        let _ = mem.write(at.0, &[status]);
        if let Some(q) = &self.inflight {
            q.before_put(head);
        }
        if !self.queue.add_used(head, written + 1) {
            self.break_ring("pushing the used ring: not mapped");
        } else if let Some(q) = &self.inflight {
            q.after_put(head, self.queue.next_used());
        }
    }

    /// Signals the guest if it asked to be told of what was just pushed.
    fn signal(&mut self) {
        if self.queue.needs_notification() {
            if let Some(call) = &mut self.call {
                // A full counter (the guest has not read it) already signals.
                let _ = call.write(&1u64.to_ne_bytes());
            }
        }
    }

    /// The guest broke the ring: stop reading it and say so on the error eventfd.
    fn break_ring(&mut self, why: &str) {
        if !self.broken {
            tracing::warn!(export = %self.export.name, "a guest broke its virtqueue: {why}");
            self.broken = true;
            if let Some(err) = &mut self.err {
                let _ = err.write(&1u64.to_ne_bytes());
            }
        }
    }

    /// Takes the connection's latest memory map, registered here, if it changed and nothing
    /// the ring took under the one it has is in flight (those are answered through the map
    /// they were walked with). Returns whether the ring is on the latest map.
    fn refresh_memory(&mut self, r: &mut Reactor<S>, space: &mut Space) -> bool {
        if self.conn.generation() == self.generation {
            return true;
        }
        if self.memory.is_some() && self.in_flight() > 0 {
            self.note_quiescing(r);
            return false;
        }
        self.quiesced();
        self.memory = space.refresh(r).cloned();
        self.generation = space.generation();
        if let Err(e) = self.queue.map(self.memory.as_ref()) {
            self.break_ring(&e.to_string());
        }
        true
    }

    /// Takes the call eventfd the front end changed while the ring ran.
    fn take_call(&mut self) {
        if self.shared.call_changed.swap(false, Ordering::AcqRel) {
            if let Some(call) = self.shared.call.lock().expect("never poisoned").take() {
                self.call = call;
            }
        }
    }

    /// Submits request `req` in slot `slot`. Returns false if the queue pair was full (the
    /// request waits), true if it was submitted or answered.
    fn submit(&mut self, r: &mut Reactor<S>, space: &Space, slot: u16, req: &Request) -> bool {
        let g = &self.export.geometry;
        let slba = g.blocks(req.sector);
        let nlb = g.blocks(req.sectors) as u32;
        let user = user(self.inbox, slot);
        let dev = self.export.device;
        let submitted = match req.op {
            Op::Read | Op::Write => {
                self.segs.clear();
                let mapped = self.chain[req.data.clone()]
                    .iter()
                    .all(|b| space.slices(b, &mut self.segs, SEGMENTS_MAX));
                if !mapped {
                    tracing::debug!("a request into guest memory not registered with the device");
                    self.answer(slot, S_IOERR);
                    return true;
                }
                let op = if req.op == Op::Read {
                    IoOp::Read
                } else {
                    IoOp::Write
                };
                let io = IoRequest::new(op, slba, nlb).with_user(user);
                r.submit_vectored(dev, io, &self.segs, completed::<S>)
            }
            Op::Flush => r.submit(
                dev,
                IoRequest::new(IoOp::Flush, 0, 0).with_user(user),
                None,
                completed::<S>,
            ),
            Op::Discard => {
                let io = IoRequest::new(IoOp::Deallocate, slba, nlb).with_user(user);
                r.submit(dev, io, None, completed::<S>)
            }
            Op::WriteZeroes { unmap } => {
                let io = IoRequest::new(IoOp::WriteZeroes, slba, nlb)
                    .with_user(user)
                    .with_deallocate(unmap);
                r.submit(dev, io, None, completed::<S>)
            }
            Op::GetId => {
                let id = self.export.name.as_bytes();
                let b = self.chain[req.data.start];
                let mut bytes = [0u8; crate::blk::ID_BYTES as usize];
                let n = id.len().min(bytes.len());
                bytes[..n].copy_from_slice(&id[..n]);
                let wrote = self
                    .memory
                    .as_deref()
                    .is_some_and(|m| m.write(b.addr, &bytes[..req.written_bytes as usize]));
                self.answer(slot, if wrote { S_OK } else { S_IOERR });
                return true;
            }
        };
        match submitted {
            Ok(()) => true,
            Err(rejected) if rejected.reason.is_queue_full() => false,
            Err(rejected) => {
                tracing::debug!("the device refused a guest's request: {}", rejected.reason);
                self.answer(slot, S_IOERR);
                true
            }
        }
    }

    /// Takes requests off the avail ring (after those a predecessor left) while slots and
    /// the device have room. Returns how many it took.
    fn take_requests(&mut self, r: &mut Reactor<S>, space: &mut Space) -> usize {
        if self.memory.is_none() {
            self.refresh_memory(r, space);
            return 0;
        }
        if !self.recovered {
            self.recover();
        }
        let Some(avail) = self.queue.avail_idx() else {
            // Not mapped: broken when the map came, or no map yet.
            return 0;
        };
        let next = Wrapping(self.queue.next_avail());
        if self.resubmit.is_empty() && avail == next {
            return 0;
        }
        if (avail - next).0 > self.limits.queue_size {
            self.break_ring("the avail index runs more than a queue ahead");
            return 0;
        }
        // The memory map after the avail index: a region the front end added before it
        // posted a request into it is in the map read after the request was seen. A new
        // map waits for the old one's requests: no chain is taken meanwhile.
        if !self.refresh_memory(r, space) {
            return 0;
        }
        let Some(mem) = self.memory.clone() else {
            return 0;
        };
        let view = RingView::new(&mem, self.queue.desc_table(), self.queue.desc_span());
        if self.notify {
            // Requests are flowing: no kicks while the reactor polls.
            if self.queue.disable_notification() {
                self.notify = false;
            }
        }
        let mut taken = 0;
        while !self.broken {
            let Some(slot) = self.free.last().copied() else {
                break;
            };
            if !r.has_room(self.export.device) {
                break;
            }
            let Some((head, resubmitted)) = self.next_head(avail) else {
                break;
            };
            taken += 1;
            let desc = GuestAddress(self.queue.desc_table());
            if let Err(e) = walk_chain(&view, desc, self.limits, head, &mut self.chain) {
                self.break_ring(&e.to_string());
                break;
            }
            match parse(&view, &self.chain, &self.export.geometry) {
                Ok(req) => {
                    self.free.pop();
                    self.slots[usize::from(slot)] = Slot {
                        head,
                        status: req.status,
                        written: req.written_bytes,
                    };
                    if !self.submit(r, space, slot, &req) {
                        self.waiting = Some((slot, req, resubmitted));
                        break;
                    }
                }
                Err(ParseError::Refused { status, error }) => {
                    tracing::debug!(export = %self.export.name, "refused a guest's request: {error}");
                    self.push_used(head, status, error.status(), 0);
                }
                Err(ParseError::Chain(e)) => {
                    self.break_ring(&e.to_string());
                    break;
                }
            }
        }
        // The request stream, for the policy's idle decision: how long the reactor spins
        // for the guest's next request before it parks with notifications on.
        r.note_arrivals(taken);
        taken
    }
}

impl<S: VhostState> Poller<S> for Vring<S> {
    fn poll(&mut self, r: &mut Reactor<S>, state: &mut S) -> usize {
        self.take_call();
        let (inbox, _) = state.vhost().ring_parts(self.inbox, self.space);
        let mut done = std::mem::take(&mut inbox.done);
        let mut work = 0;
        // Through the map the requests were walked with: a new one waits for them.
        for (slot, ok) in done.drain(..) {
            work += usize::from(self.answer(slot, if ok { S_OK } else { S_IOERR }));
        }
        let (inbox, space) = state.vhost().ring_parts(self.inbox, self.space);
        inbox.done = done;
        if work > 0 {
            // Completions may have freed a region the guest gave up.
            space.tidy(r);
        }
        let stopping = self.shared.stop.load(Ordering::Acquire);
        if !stopping {
            let hold = self.conn.hold();
            if hold != 0 || self.conn.generation() != self.generation {
                // A request refused for room was walked with the map now going: it is
                // taken again, and walked again, under the new one.
                self.give_back_waiting();
            }
            if hold != 0 {
                self.hold(r, hold);
            } else if !self.broken {
                self.refresh_memory(r, space);
                if let Some((slot, req, resubmitted)) = self.waiting.take() {
                    if self.submit(r, space, slot, &req) {
                        work += 1;
                    } else {
                        self.waiting = Some((slot, req, resubmitted));
                    }
                }
                if self.waiting.is_none() {
                    work += self.take_requests(r, space);
                }
            }
        }
        if work > 0 {
            self.signal();
        }
        if stopping {
            work += self.finish_stop(r, state);
        }
        work
    }

    fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.kick.as_fd())
    }

    fn before_block(&mut self) -> bool {
        // The kick read first: one that comes after the notifications are on wakes the
        // reactor.
        let mut count = [0u8; 8];
        let _ = self.kick.read(&mut count);
        if self.broken || self.shared.stop.load(Ordering::Acquire) {
            return false;
        }
        if self.memory.is_none() {
            return false;
        }
        if self.conn.hold() != 0 {
            // Held: the chains wait; the control's message lifting the hold wakes the
            // reactor.
            return false;
        }
        if self.conn.generation() != self.generation {
            // Waiting for the old map's requests (a completion wakes the reactor), or, with
            // none, about to take the new map: the next poll does, before the rings are
            // touched again (turning notifications on writes to the used ring).
            return self.in_flight() == 0;
        }
        if self.waiting.is_some() || self.free.is_empty() {
            // Waiting for room, not for the guest: a completion wakes the reactor.
            return false;
        }
        if !self.notify {
            match self.queue.enable_notification() {
                Some(more) => {
                    self.notify = true;
                    return more;
                }
                None => {
                    self.break_ring("turning notifications on: not mapped");
                    return false;
                }
            }
        }
        self.queue
            .avail_idx()
            .is_some_and(|idx| idx.0 != self.queue.next_avail())
    }
}

/// Sends `f` to `handle`, for the control side; a full mailbox is logged (the reactor is
/// overwhelmed, and the ring is left as it was).
pub(crate) fn send<S: 'static>(
    handle: &ReactorHandle<S>,
    f: impl FnOnce(&mut Reactor<S>, &mut S) + Send + 'static,
) -> bool {
    match handle.send(f) {
        Ok(()) => true,
        // Stopping: its rings stop with it.
        Err(hypoll_reactor::SendError::Stopped) => false,
        Err(e) => {
            tracing::error!("a reactor's mailbox refused a vhost-user message: {e}");
            false
        }
    }
}

mod quiesce;
mod resume;
#[cfg(test)]
mod tests;
