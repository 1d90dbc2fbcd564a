//! The reactor: one pinned thread's loop over messages, timers, pollers and queue pairs, and
//! what it does when none of them has work (ask the policy, or park).

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TrySendError};
use hypoll_nvme::sys::{monotonic_ns, EventFd, TimerFd};
use hypoll_nvme::{Clock, Command, Completion, QueuePair, Status, SubmitError};
use hypoll_policy::{
    Bucket, Decision, Direction, InFlight, Observation, PollContext, PollPolicy, Slept,
    StatsRecorder,
};
use slab::Slab;

use crate::io::{
    Device, DeviceId, DeviceOptions, IoCallback, IoDone, IoFailure, IoOp, IoRequest, RejectReason,
    Rejected,
};
use crate::stats::{Counters, ReactorStats, SharedStats, STATS_PUBLISH_NS};
use crate::sys::Epoll;
use crate::timer::{TimerFn, TimerId, Timers};

/// Most messages run per loop turn, so a flood of messages cannot starve I/O.
pub const MESSAGE_BATCH: usize = 32;
/// Most completions reaped from one queue pair per loop turn.
pub const COMPLETION_BATCH: usize = 64;
/// Most devices one reactor attaches.
pub const DEVICES_MAX: usize = 64;
/// One sleep in this many has its CPU cost measured (two thread-CPU-clock reads).
const SLEEP_CPU_SAMPLE_EVERY: u64 = 4;
/// How often a stopping reactor polls for its last completions.
const SHUTDOWN_POLL: Duration = Duration::from_micros(50);

const TOKEN_MAILBOX: u64 = 0;
const TOKEN_TIMER: u64 = 1;
const TOKEN_DEVICE_BASE: u64 = 1 << 16;
const TOKEN_POLLER_BASE: u64 = 1 << 32;

/// A closure run on a reactor.
pub type Message = Box<dyn FnOnce(&mut Reactor) + Send>;

/// Work a reactor polls every turn (a socket, a ring). Returns the work it did: 0 means it
/// found nothing. Pollers that can say when they have work give a `wake_fd`, so a parked
/// reactor wakes for them; one without an fd is polled only when the reactor is awake.
pub trait Poller {
    fn poll(&mut self, reactor: &mut Reactor) -> usize;

    fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
}

/// Identifies a poller for [`Reactor::remove_poller`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PollerId(u64);

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The reactor's mailbox is full: back-pressure, retry later.
    #[error("the reactor's mailbox is full")]
    Full,
    /// The reactor stopped, or died.
    #[error("the reactor has stopped")]
    Stopped,
}

/// Shared between a reactor and the handles to it.
pub(crate) struct Wake {
    eventfd: EventFd,
    /// The reactor is (about to be) blocked in epoll: senders must signal the eventfd.
    parked: AtomicBool,
    stop: AtomicBool,
}

/// A handle to a reactor, usable from any thread.
#[derive(Clone)]
pub struct ReactorHandle {
    index: usize,
    core: usize,
    tx: Sender<Message>,
    wake: Arc<Wake>,
    stats: Arc<SharedStats>,
}

impl ReactorHandle {
    /// Queues `f` to run on the reactor. A full mailbox is an error, never a wait.
    pub fn send(&self, f: impl FnOnce(&mut Reactor) + Send + 'static) -> Result<(), SendError> {
        if self.wake.stop.load(Ordering::Acquire) {
            return Err(SendError::Stopped);
        }
        match self.tx.try_send(Box::new(f)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(SendError::Full),
            Err(TrySendError::Disconnected(_)) => return Err(SendError::Stopped),
        }
        // Pairs with the fence in `Reactor::park`: either the reactor sees the message before
        // it blocks, or we see `parked` and wake it.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.wake.parked.load(Ordering::SeqCst) {
            let _ = self.wake.eventfd.signal();
        }
        Ok(())
    }

    /// Queues `f` to run on the reactor, waiting up to `timeout` for room in a full mailbox:
    /// back-pressure that slows the sender down instead of failing it at once. Never waits
    /// longer than `timeout` (then [`SendError::Full`]), never grows the mailbox. Meant for
    /// threads outside the reactors: a reactor sending to a full mailbox (its own included)
    /// should use [`ReactorHandle::send`] and retry from a timer, since while it waits it
    /// runs nothing else.
    pub fn send_timeout(
        &self,
        f: impl FnOnce(&mut Reactor) + Send + 'static,
        timeout: Duration,
    ) -> Result<(), SendError> {
        if self.wake.stop.load(Ordering::Acquire) {
            return Err(SendError::Stopped);
        }
        match self.tx.send_timeout(Box::new(f), timeout) {
            Ok(()) => {}
            Err(crossbeam_channel::SendTimeoutError::Timeout(_)) => return Err(SendError::Full),
            Err(crossbeam_channel::SendTimeoutError::Disconnected(_)) => {
                return Err(SendError::Stopped)
            }
        }
        // As in `send`: wake a parked reactor.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.wake.parked.load(Ordering::SeqCst) {
            let _ = self.wake.eventfd.signal();
        }
        Ok(())
    }

    /// Asks the reactor to stop: it finishes what is queued, drains or fails its I/O and
    /// exits. Idempotent.
    pub(crate) fn stop(&self) {
        self.wake.stop.store(true, Ordering::Release);
        let _ = self.wake.eventfd.signal();
    }

    /// The reactor's counters as last published (every 10 ms while it runs, and before it
    /// parks), with its CPU time read from the OS now.
    pub fn stats(&self) -> ReactorStats {
        self.stats.read(self.core)
    }

    /// The reactor thread's CPU time (user + system) from the OS; `None` before it started
    /// or after it exited.
    pub fn cpu_ns(&self) -> Option<u64> {
        self.stats.cpu_ns()
    }

    pub fn core(&self) -> usize {
        self.core
    }

    pub fn index(&self) -> usize {
        self.index
    }

    pub(crate) fn stats_cell(&self) -> &SharedStats {
        &self.stats
    }
}

/// Creates the mailbox of one reactor: the handle and what the reactor keeps.
pub(crate) fn mailbox(
    index: usize,
    core: usize,
    capacity: usize,
) -> std::io::Result<(ReactorHandle, Receiver<Message>)> {
    let (tx, rx) = crossbeam_channel::bounded(capacity);
    let wake = Arc::new(Wake {
        eventfd: EventFd::new()?,
        parked: AtomicBool::new(false),
        stop: AtomicBool::new(false),
    });
    let handle = ReactorHandle {
        index,
        core,
        tx,
        wake,
        stats: Arc::new(SharedStats::default()),
    };
    Ok((handle, rx))
}

/// A device attached to this reactor: its queue pair and this reactor's statistics for it.
struct Attached {
    qp: Box<dyn QueuePair>,
    recorder: StatsRecorder,
    lba_bytes: u32,
    has_irq: bool,
    /// `DeviceOptions`' timeouts, in ns.
    io_timeout_ns: Option<u64>,
    abort_timeout_ns: u64,
    reset_timeout_ns: u64,
    /// I/Os accepted while the queue pair was full, oldest first, at most `wait_capacity`.
    waiting: VecDeque<Waiter>,
    wait_capacity: usize,
    /// Abandoned I/Os of this device still holding a queue-pair slot.
    abandoned: usize,
}

/// An accepted I/O waiting for a free queue-pair slot.
struct Waiter {
    req: IoRequest,
    buf: Option<hypoll_nvme::IoBuf>,
    callback: IoCallback,
    accepted_ns: u64,
}

/// Why `Reactor::issue` did not put an I/O on its queue pair: the error, with what the
/// caller gave back.
type NotIssued = (
    hypoll_nvme::SubmitError,
    Option<hypoll_nvme::IoBuf>,
    IoCallback,
);

/// Where an outstanding I/O stands in timeout recovery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Recovery {
    /// Within its timeout.
    InTime,
    /// Timed out; an abort was sent (or the device cannot abort): escalate at the deadline.
    Aborting { deadline_ns: u64 },
    /// Its queue pair was reset: the device owes its completion by the deadline.
    /// `timed_out`: it had reached its own timeout (the reset was for it or another).
    Resetting { deadline_ns: u64, timed_out: bool },
    /// Failed locally with `IoFailure::Abandoned`; its buffer stays here (quarantined)
    /// until a late completion or the queue pair's deletion.
    Abandoned,
}

impl Recovery {
    /// Whether the I/O reached its timeout: an abort or reset status then becomes
    /// `IoFailure::TimedOut`.
    fn timed_out(self) -> bool {
        matches!(
            self,
            Recovery::Aborting { .. }
                | Recovery::Resetting {
                    timed_out: true,
                    ..
                }
        )
    }
}

/// The reactor's record of one outstanding I/O, in a slab keyed by the command's tag.
struct IoSlot {
    device: u16,
    bucket: Option<Bucket>,
    /// When it reached the queue pair (the device's latency counts from here).
    submit_ns: u64,
    /// When the reactor accepted it (its timeout and `IoDone::latency_ns` count from here:
    /// earlier than `submit_ns` if it waited for a slot).
    accepted_ns: u64,
    /// Submission order, to find the oldest outstanding I/O.
    seq: u64,
    slept: Option<Slept>,
    idle_polls_at_submit: u64,
    user: u64,
    buf: Option<hypoll_nvme::IoBuf>,
    /// `None` once it ran (an abandoned I/O).
    callback: Option<IoCallback>,
    recovery: Recovery,
}

/// Tunables of a reactor.
#[derive(Clone, Debug)]
pub struct ReactorTuning {
    /// With nothing outstanding and no work, spin this long before parking.
    pub idle_spin_ns: u64,
    /// How long shutdown waits for outstanding I/O before failing it.
    pub shutdown_timeout: Duration,
    /// A policy's sleep longer than this is a long sleep: the reactor waits on the device
    /// interrupts, bounded by the sleep's end, so a completion ends it early (without an
    /// interrupt line it sleeps this long, polls, and asks the policy again). Hybrid sleeps
    /// are sized for microsecond devices; a policy whose statistics ran away (one slow
    /// window can lift `hybrid-min`'s minimum for good: every later I/O sleeps at least that
    /// long, so no faster sample can bring it down) must not hold I/O for seconds.
    pub long_sleep_ns: u64,
}

impl Default for ReactorTuning {
    fn default() -> Self {
        ReactorTuning {
            idle_spin_ns: 50_000,
            shutdown_timeout: Duration::from_secs(5),
            long_sleep_ns: 1_000_000,
        }
    }
}

/// What a reactor reports when it exits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExitReport {
    pub core: usize,
    /// I/Os that completed while the reactor was stopping.
    pub drained_ios: u64,
    /// I/Os still outstanding at the shutdown timeout: each callback ran with
    /// [`IoFailure::Shutdown`].
    pub failed_ios: u64,
    pub stats: ReactorStats,
}

/// One reactor: owns its queue pairs, pollers, timers, policy and statistics. Lives on its
/// own thread; other threads reach it through a [`ReactorHandle`].
pub struct Reactor {
    index: usize,
    core: usize,
    // Field order matters for drop: queue pairs go before the slots that own I/O buffers,
    // so a device never touches a freed buffer.
    devices: Vec<Attached>,
    slots: Slab<IoSlot>,
    io_capacity: usize,
    order: VecDeque<(usize, u64)>,
    next_seq: u64,
    completions: Vec<(u16, Completion)>,
    policy: Box<dyn PollPolicy>,
    mailbox: Receiver<Message>,
    handles: Arc<[ReactorHandle]>,
    timers: Timers,
    timer_fd: TimerFd,
    timer_fd_armed_ns: Option<u64>,
    pollers: Vec<(PollerId, Box<dyn Poller>)>,
    poller_fds: Vec<(PollerId, RawFd)>,
    removed_pollers: Vec<PollerId>,
    next_poller: u64,
    epoll: Epoll,
    tuning: ReactorTuning,
    counters: Counters,
    start_ns: u64,
    now_ns: u64,
    last_publish_ns: u64,
    idle_since_ns: Option<u64>,
    /// When the reactor last went to sleep or blocked, and whether the current turn is the
    /// first after it woke: completions reaped then are censored (see `Observation`).
    slept_from_ns: u64,
    woke_this_turn: bool,
    woke_pending: bool,
    /// Likewise, whether that wait was on the device interrupts and ended before its
    /// deadline (see `Observation::after_interrupt`).
    interrupt_woke_this_turn: bool,
    interrupt_woke_pending: bool,
    stopping: bool,
    /// Where `now_ns` comes from: CLOCK_MONOTONIC, or a simulation's virtual clock.
    clock: Clock,
    /// Slots of abandoned I/Os (still in `slots`, quarantined).
    abandoned: usize,
    /// Keys of I/Os to abandon, collected during a recovery scan (preallocated).
    to_abandon: Vec<usize>,
    /// Waiters past their timeout, with their device, collected during a recovery scan
    /// (preallocated).
    expired: Vec<(usize, Waiter)>,
    /// When the next timeout or recovery step is due (ns); `u64::MAX`: none. Lowered by
    /// every submission on a device with a timeout, set by each recovery scan.
    recovery_due_ns: u64,
    /// I/Os waiting for a slot, on every device.
    waiters: usize,
}

impl Reactor {
    pub(crate) fn new(
        index: usize,
        mailbox: Receiver<Message>,
        handles: Arc<[ReactorHandle]>,
        policy: Box<dyn PollPolicy>,
        tuning: ReactorTuning,
    ) -> std::io::Result<Reactor> {
        let me = &handles[index];
        let epoll = Epoll::new()?;
        epoll.add(me.wake.eventfd.as_fd(), TOKEN_MAILBOX)?;
        let timer_fd = TimerFd::new()?;
        epoll.add(timer_fd.as_fd(), TOKEN_TIMER)?;
        let now_ns = monotonic_ns();
        Ok(Reactor {
            index,
            core: me.core,
            devices: Vec::new(),
            slots: Slab::new(),
            io_capacity: 0,
            order: VecDeque::new(),
            next_seq: 0,
            completions: Vec::new(),
            policy,
            mailbox,
            handles,
            timers: Timers::default(),
            timer_fd,
            timer_fd_armed_ns: None,
            pollers: Vec::new(),
            poller_fds: Vec::new(),
            removed_pollers: Vec::new(),
            next_poller: 0,
            epoll,
            tuning,
            counters: Counters::default(),
            start_ns: now_ns,
            now_ns,
            last_publish_ns: now_ns,
            idle_since_ns: None,
            slept_from_ns: 0,
            woke_this_turn: false,
            woke_pending: false,
            interrupt_woke_this_turn: false,
            interrupt_woke_pending: false,
            stopping: false,
            clock: Clock::Monotonic,
            abandoned: 0,
            to_abandon: Vec::new(),
            expired: Vec::new(),
            recovery_due_ns: u64::MAX,
            waiters: 0,
        })
    }

    /// Makes the reactor read `clock` instead of CLOCK_MONOTONIC (simulations step a
    /// reactor by hand on a virtual clock; see `crate::sim`).
    pub(crate) fn set_clock(&mut self, clock: Clock) {
        self.now_ns = clock.now_ns();
        self.start_ns = self.now_ns;
        self.last_publish_ns = self.now_ns;
        self.clock = clock;
    }

    fn me(&self) -> &ReactorHandle {
        &self.handles[self.index]
    }

    // ---- what embedders call ----

    /// The core this reactor is pinned to.
    pub fn core(&self) -> usize {
        self.core
    }

    /// This reactor's position in its set.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Handles to every reactor of the set, this one included, for cross-core messages.
    pub fn handles(&self) -> &Arc<[ReactorHandle]> {
        &self.handles
    }

    /// The timestamp of the current poll batch (CLOCK_MONOTONIC ns): one clock read per
    /// batch, not per I/O.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// Reads the clock again and makes it the current timestamp: for a poller that waited
    /// inside its poll (a timed sleep, a watch for input), so the I/Os it submits next are
    /// stamped with the time they are made, not with the turn's start.
    pub fn refresh_now_ns(&mut self) -> u64 {
        self.now_ns = self.clock.now_ns();
        self.now_ns
    }

    /// The policy's name, as its spec.
    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// I/Os accepted by this reactor whose callback has not run yet: on a queue pair, or
    /// waiting for a slot.
    pub fn outstanding(&self) -> usize {
        self.live() + self.waiters
    }

    /// I/Os on a queue pair that the reactor still waits for (abandoned ones excluded).
    fn live(&self) -> usize {
        self.slots.len() - self.abandoned
    }

    /// Abandoned I/Os whose buffers are still quarantined (see [`IoFailure::Abandoned`]).
    pub fn quarantined(&self) -> usize {
        self.abandoned
    }

    /// The counters so far (the published copy lags by up to 10 ms).
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Creates a queue pair of `depth` on `device` for this reactor, with the default
    /// timeouts ([`DeviceOptions::new`]).
    pub fn attach(&mut self, device: &Device, depth: usize) -> Result<DeviceId, String> {
        self.attach_with(device, DeviceOptions::new(depth))
    }

    /// Creates a queue pair on `device` for this reactor, as `options` say.
    pub fn attach_with(
        &mut self,
        device: &Device,
        options: DeviceOptions,
    ) -> Result<DeviceId, String> {
        let depth = options.depth;
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        if options.io_timeout.is_some_and(|t| t.is_zero()) {
            return Err("io_timeout must be more than 0 (or None: never)".to_string());
        }
        if options.wait_queue > crate::io::WAIT_QUEUE_MAX {
            return Err(format!(
                "wait_queue {} is over the limit of {}",
                options.wait_queue,
                crate::io::WAIT_QUEUE_MAX
            ));
        }
        if self.devices.len() >= DEVICES_MAX {
            return Err(format!("a reactor attaches at most {DEVICES_MAX} devices"));
        }
        let qp = device
            .ctrl
            .create_queue_pair(depth)
            .map_err(|e| format!("{}: {e}", device.ctrl.describe()))?;
        let id = self.devices.len() as u16;
        let has_irq = match qp.interrupt_fd() {
            Some(fd) => {
                self.epoll
                    .add(fd, TOKEN_DEVICE_BASE + u64::from(id))
                    .map_err(|e| format!("watching the interrupt fd: {e}"))?;
                true
            }
            None => false,
        };
        self.io_capacity += qp.depth();
        // Preallocate everything the I/O path touches, so it never allocates.
        self.slots.reserve(self.io_capacity - self.slots.len());
        self.order
            .reserve(2 * self.io_capacity - self.order.len().min(2 * self.io_capacity));
        self.completions
            .reserve(COMPLETION_BATCH * (self.devices.len() + 1) - self.completions.len());
        self.to_abandon
            .reserve(self.io_capacity - self.to_abandon.len());
        // Room for every device's waiters at once: capacity grows by this device's share.
        self.expired
            .reserve(self.expired.capacity() - self.expired.len() + options.wait_queue);
        self.devices.push(Attached {
            lba_bytes: qp.namespace().lba_size_bytes,
            qp,
            recorder: device.stats.recorder(self.now_ns),
            has_irq,
            io_timeout_ns: options.io_timeout.map(ns),
            abort_timeout_ns: ns(options.abort_timeout),
            reset_timeout_ns: ns(options.reset_timeout),
            waiting: VecDeque::with_capacity(options.wait_queue),
            wait_capacity: options.wait_queue,
            abandoned: 0,
        });
        Ok(DeviceId(id))
    }

    /// The namespace of an attached device.
    pub fn namespace(&self, device: DeviceId) -> Option<hypoll_nvme::NamespaceInfo> {
        self.devices
            .get(device.0 as usize)
            .map(|d| d.qp.namespace())
    }

    /// Whether a submission to `device` now would not be refused for a full queue (it may
    /// still be refused for another reason, which `submit` reports: an unknown device, a
    /// queue pair whose every slot holds an abandoned command). Callers that hold work back
    /// under back-pressure check this before building the next I/O (its buffer, its
    /// callback) instead of building it only to have it refused.
    pub fn has_room(&self, device: DeviceId) -> bool {
        self.devices.get(device.0 as usize).is_none_or(|dev| {
            let depth = dev.qp.depth();
            let quarantined = dev.abandoned > 0 && dev.abandoned >= depth;
            quarantined || (dev.waiting.is_empty() && dev.qp.outstanding() < depth)
        })
    }

    /// Submits one I/O. `buf` is required for reads and writes (at least `nlb` blocks) and
    /// must be `None` otherwise; it comes back in the completion, or in the rejection.
    pub fn submit(
        &mut self,
        device: DeviceId,
        req: IoRequest,
        buf: Option<hypoll_nvme::IoBuf>,
        callback: impl FnOnce(&mut Reactor, IoDone) + 'static,
    ) -> Result<(), Rejected> {
        let reject = |reason, buf| Err(Rejected { reason, buf });
        if self.stopping {
            return reject(RejectReason::ShuttingDown, buf);
        }
        let d = device.0 as usize;
        let Some(dev) = self.devices.get(d) else {
            return reject(RejectReason::UnknownDevice, buf);
        };
        let data_op = matches!(req.op, IoOp::Read | IoOp::Write);
        if data_op != buf.is_some() {
            return reject(RejectReason::Buffer, buf);
        }
        let callback: IoCallback = Box::new(callback);
        if !dev.waiting.is_empty() {
            return self.wait_behind(d, req, buf, callback);
        }
        match self.issue(d, req, buf, callback, self.now_ns) {
            Ok(()) => Ok(()),
            Err(not_issued) => self.not_issued(d, req, not_issued),
        }
    }

    /// A queue pair refused an I/O: it waits for a slot if the device has a wait queue
    /// with room, or is refused.
    #[cold]
    #[inline(never)]
    fn not_issued(
        &mut self,
        d: usize,
        req: IoRequest,
        (error, buf, callback): NotIssued,
    ) -> Result<(), Rejected> {
        let SubmitError::QueueFull { depth } = error else {
            return Err(Rejected {
                reason: RejectReason::Submit(error),
                buf,
            });
        };
        let reason = self.full(d, depth);
        let dev = &self.devices[d];
        if dev.waiting.len() >= dev.wait_capacity
            || matches!(reason, RejectReason::Quarantined { .. })
        {
            return Err(Rejected { reason, buf });
        }
        self.push_waiter(d, req, buf, callback);
        Ok(())
    }

    /// Others already wait for a slot on device `d`: first come, first served, a new I/O
    /// waits behind them, or is refused if the wait queue is full (or no slot will ever
    /// free: every one holds an abandoned command).
    #[cold]
    #[inline(never)]
    fn wait_behind(
        &mut self,
        d: usize,
        req: IoRequest,
        buf: Option<hypoll_nvme::IoBuf>,
        callback: IoCallback,
    ) -> Result<(), Rejected> {
        let dev = &self.devices[d];
        let has_room = dev.waiting.len() < dev.wait_capacity;
        let lba_bytes = dev.lba_bytes;
        let reason = self.full(d, dev.qp.depth());
        if !has_room || matches!(reason, RejectReason::Quarantined { .. }) {
            return Err(Rejected { reason, buf });
        }
        let mut buf = buf;
        if let Err(e) = command(&req, buf.as_mut()).check(lba_bytes) {
            return Err(Rejected {
                reason: RejectReason::Submit(e),
                buf,
            });
        }
        self.push_waiter(d, req, buf, callback);
        Ok(())
    }

    fn push_waiter(
        &mut self,
        d: usize,
        req: IoRequest,
        buf: Option<hypoll_nvme::IoBuf>,
        callback: IoCallback,
    ) {
        let dev = &mut self.devices[d];
        dev.waiting.push_back(Waiter {
            req,
            buf,
            callback,
            accepted_ns: self.now_ns,
        });
        self.waiters += 1;
        if let Some(timeout_ns) = dev.io_timeout_ns {
            self.recovery_due_ns = self
                .recovery_due_ns
                .min(self.now_ns.saturating_add(timeout_ns));
        }
    }

    /// Why a full queue pair refuses an I/O: back-pressure, or a device whose every slot
    /// holds an abandoned command (retrying will not help until it recovers).
    fn full(&self, d: usize, depth: usize) -> RejectReason {
        let dev = &self.devices[d];
        if dev.abandoned > 0 && dev.abandoned >= dev.qp.depth() {
            RejectReason::Quarantined {
                abandoned: dev.abandoned,
            }
        } else {
            RejectReason::Submit(SubmitError::QueueFull { depth })
        }
    }

    /// Puts an I/O on device `d`'s queue pair and records it in a slot. Inlined: it is the
    /// body of every submission.
    #[inline(always)]
    fn issue(
        &mut self,
        d: usize,
        req: IoRequest,
        buf: Option<hypoll_nvme::IoBuf>,
        callback: IoCallback,
        accepted_ns: u64,
    ) -> Result<(), NotIssued> {
        let dev = &mut self.devices[d];
        let mut buf = buf;
        let key = self.slots.vacant_key();
        let submitted = {
            let cmd = command(&req, buf.as_mut());
            // SAFETY: the buffer moves into the slot below (moving an IoBuf does not move
            // its memory) and stays there until the completion for `key` is reaped, or
            // until the queue pair is dropped (shutdown drops queue pairs before slots);
            // an abandoned I/O's buffer stays in its slot too (quarantine).
            unsafe { dev.qp.submit(&cmd, key as u64) }
        };
        if let Err(e) = submitted {
            return Err((e, buf, callback));
        }
        let bucket = match req.op {
            IoOp::Read => Bucket::new(
                Direction::Read,
                u64::from(req.nlb) * u64::from(dev.lba_bytes),
            ),
            IoOp::Write => Bucket::new(
                Direction::Write,
                u64::from(req.nlb) * u64::from(dev.lba_bytes),
            ),
            _ => None,
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let inserted = self.slots.insert(IoSlot {
            device: d as u16,
            bucket,
            submit_ns: self.now_ns,
            accepted_ns,
            seq,
            slept: None,
            idle_polls_at_submit: self.counters.idle_polls,
            user: req.user,
            buf,
            callback: Some(callback),
            recovery: Recovery::InTime,
        });
        debug_assert_eq!(inserted, key);
        if let Some(timeout_ns) = self.devices[d].io_timeout_ns {
            self.recovery_due_ns = self
                .recovery_due_ns
                .min(accepted_ns.saturating_add(timeout_ns));
        }
        // Drop completed I/Os from the front of the order (amortized O(1): in-order
        // completions never let it grow); compact it when a slow I/O holds the front.
        let slots = &self.slots;
        let live = |&(k, s): &(usize, u64)| slots.get(k).is_some_and(|slot| slot.seq == s);
        while self.order.front().is_some_and(|e| !live(e)) {
            self.order.pop_front();
        }
        if self.order.len() == self.order.capacity() {
            self.order.retain(live);
        }
        self.order.push_back((key, seq));
        Ok(())
    }

    /// Puts waiting I/Os on their queue pairs while there is room, oldest first. Returns
    /// how many it started (or failed: a queue pair that refuses one for another reason
    /// than being full fails it with `IoFailure::Refused`).
    fn start_waiters(&mut self) -> usize {
        if self.waiters == 0 {
            return 0;
        }
        let mut started = 0;
        for d in 0..self.devices.len() {
            while let Some(w) = self.devices[d].waiting.pop_front() {
                self.waiters -= 1;
                let (req, accepted_ns) = (w.req, w.accepted_ns);
                match self.issue(d, req, w.buf, w.callback, accepted_ns) {
                    Ok(()) => started += 1,
                    Err((SubmitError::QueueFull { .. }, buf, callback)) => {
                        self.devices[d].waiting.push_front(Waiter {
                            req,
                            buf,
                            callback,
                            accepted_ns,
                        });
                        self.waiters += 1;
                        break;
                    }
                    Err((e, buf, callback)) => {
                        started += 1;
                        let waiter = Waiter {
                            req,
                            buf,
                            callback,
                            accepted_ns,
                        };
                        tracing::warn!(
                            core = self.core,
                            device = d,
                            error = %e,
                            "the queue pair refused an I/O that waited for a slot"
                        );
                        self.fail_waiter(d, waiter, IoFailure::Refused);
                    }
                }
            }
        }
        started
    }

    /// Runs the callback of an I/O that never reached its queue pair, buffer handed back.
    fn fail_waiter(&mut self, d: usize, w: Waiter, failure: IoFailure) {
        self.counters.ios += 1;
        self.counters.io_errors += 1;
        let done = IoDone {
            device: DeviceId(d as u16),
            result: Err(failure),
            buf: w.buf,
            user: w.req.user,
            latency_ns: self.now_ns.saturating_sub(w.accepted_ns),
        };
        (w.callback)(self, done);
    }

    /// Runs `f` on this reactor after `delay`.
    pub fn after(&mut self, delay: Duration, f: impl FnOnce(&mut Reactor) + 'static) -> TimerId {
        let deadline_ns = self
            .now_ns
            .saturating_add(u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX));
        self.timers.add(deadline_ns, 0, TimerFn::Once(Box::new(f)))
    }

    /// Runs `f` on this reactor every `period` (missed periods are skipped, not bunched).
    pub fn every(&mut self, period: Duration, f: impl FnMut(&mut Reactor) + 'static) -> TimerId {
        let period_ns = (period.as_nanos() as u64).max(1);
        self.timers.add(
            self.now_ns + period_ns,
            period_ns,
            TimerFn::Every(Box::new(f)),
        )
    }

    /// Cancels a timer; returns whether it was still pending.
    pub fn cancel_timer(&mut self, id: TimerId) -> bool {
        self.timers.cancel(id)
    }

    /// Adds a poller, polled every loop turn; its wake fd (if any) wakes a parked reactor.
    pub fn add_poller(&mut self, poller: Box<dyn Poller>) -> std::io::Result<PollerId> {
        let id = PollerId(self.next_poller);
        self.next_poller += 1;
        if let Some(fd) = poller.wake_fd() {
            self.epoll.add(fd, TOKEN_POLLER_BASE + id.0)?;
            self.poller_fds.push((id, fd.as_raw_fd()));
        }
        self.pollers.push((id, poller));
        Ok(id)
    }

    /// Removes a poller (also from inside a `poll`).
    pub fn remove_poller(&mut self, id: PollerId) {
        self.pollers.retain(|(p, _)| *p != id);
        // While pollers run they are out of `self.pollers`: remember the removal.
        self.removed_pollers.push(id);
        if let Some(pos) = self.poller_fds.iter().position(|(p, _)| *p == id) {
            let (_, fd) = self.poller_fds.swap_remove(pos);
            let _ = self.epoll.remove(fd);
        }
    }

    // ---- the loop ----

    /// Runs until stopped, then drains or fails outstanding I/O. Returns the exit report.
    pub(crate) fn run(mut self) -> ExitReport {
        let mut turn_start_ns = monotonic_ns();
        while !self.me().wake.stop.load(Ordering::Acquire) {
            self.now_ns = turn_start_ns;
            self.woke_this_turn = std::mem::take(&mut self.woke_pending);
            self.interrupt_woke_this_turn = std::mem::take(&mut self.interrupt_woke_pending);
            let work = self.turn();
            if self.now_ns - self.last_publish_ns >= STATS_PUBLISH_NS {
                self.publish();
            }
            if work == 0 {
                self.when_idle();
            } else {
                self.idle_since_ns = None;
            }
            // One clock read per turn: this turn's end is the next one's start. A turn that
            // did work is busy; one that found none (its spin, sleep or park included) idle.
            let next_ns = monotonic_ns();
            let elapsed_ns = next_ns.saturating_sub(turn_start_ns);
            if work > 0 {
                self.counters.busy_ns += elapsed_ns;
            } else {
                self.counters.idle_ns += elapsed_ns;
            }
            turn_start_ns = next_ns;
        }
        self.shut_down()
    }

    /// One loop turn at the clock's current time, for a simulation that steps reactors by
    /// hand (it never spins, sleeps or parks). Returns the work done.
    pub(crate) fn sim_turn(&mut self) -> usize {
        self.now_ns = self.clock.now_ns();
        self.turn()
    }

    /// One loop turn: messages, timers, pollers, completions, timeouts. Returns the work
    /// done.
    fn turn(&mut self) -> usize {
        self.counters.polls += 1;
        let mut work = self.run_messages(MESSAGE_BATCH);
        work += self.run_timers();
        work += self.run_pollers();
        work += self.reap();
        work += self.start_waiters();
        work += self.check_timeouts();
        for dev in &mut self.devices {
            dev.recorder.tick(self.now_ns);
        }
        if work == 0 {
            self.counters.idle_polls += 1;
        }
        work
    }

    fn run_messages(&mut self, max: usize) -> usize {
        let mut ran = 0;
        while ran < max {
            let Ok(message) = self.mailbox.try_recv() else {
                break;
            };
            message(self);
            ran += 1;
        }
        self.counters.messages += ran as u64;
        ran
    }

    fn run_timers(&mut self) -> usize {
        let mut ran = 0;
        while let Some((id, callback)) = self.timers.pop_due(self.now_ns) {
            match callback {
                TimerFn::Once(f) => f(self),
                TimerFn::Every(mut f) => {
                    f(self);
                    self.timers.finish(id, TimerFn::Every(f), self.now_ns);
                }
            }
            ran += 1;
        }
        self.counters.timers += ran as u64;
        ran
    }

    fn run_pollers(&mut self) -> usize {
        if self.pollers.is_empty() {
            return 0;
        }
        let mut pollers = std::mem::take(&mut self.pollers);
        let mut work = 0;
        for (id, poller) in pollers.iter_mut() {
            if self.removed_pollers.contains(id) {
                continue;
            }
            let did = poller.poll(self);
            if did > 0 {
                work += did;
                // Submissions after this poller's work are stamped with a fresh time.
                self.now_ns = self.clock.now_ns();
            }
        }
        // Pollers added during the turn were pushed onto the (taken) list: keep them.
        pollers.append(&mut self.pollers);
        if !self.removed_pollers.is_empty() {
            let removed = std::mem::take(&mut self.removed_pollers);
            pollers.retain(|(id, _)| !removed.contains(id));
        }
        self.pollers = pollers;
        work
    }

    /// Reaps every queue pair, then runs the callbacks: completions are collected first so a
    /// callback that submits or frees never re-enters a poll.
    fn reap(&mut self) -> usize {
        let mut reaped = 0;
        let completions = &mut self.completions;
        for (i, dev) in self.devices.iter_mut().enumerate() {
            if dev.qp.outstanding() == 0 {
                continue;
            }
            reaped += dev
                .qp
                .process_completions(COMPLETION_BATCH, &mut |c| completions.push((i as u16, c)));
        }
        if reaped == 0 {
            return 0;
        }
        // One timestamp for the whole batch.
        self.now_ns = self.clock.now_ns();
        let mut batch = std::mem::take(&mut self.completions);
        for (dev, completion) in batch.drain(..) {
            self.complete(dev, completion);
        }
        self.completions = batch;
        reaped
    }

    fn complete(&mut self, dev: u16, completion: Completion) {
        let slot = self
            .slots
            .try_remove(completion.tag as usize)
            .unwrap_or_else(|| {
                panic!(
                    "reactor {}: completion for tag {} that is not outstanding",
                    self.core, completion.tag
                )
            });
        assert_eq!(
            slot.device, dev,
            "reactor {}: device {dev} completed tag {} of device {}",
            self.core, completion.tag, slot.device
        );
        if slot.recovery == Recovery::Abandoned {
            // Its callback ran when it was abandoned: the device is done with the buffer
            // now, so it leaves quarantine (dropped with `slot`).
            self.abandoned -= 1;
            self.devices[dev as usize].abandoned -= 1;
            self.counters.late_completions += 1;
            tracing::info!(
                core = self.core,
                device = dev,
                tag = completion.tag,
                status = %completion.status,
                "late completion of an abandoned I/O: its buffer leaves quarantine"
            );
            return;
        }
        let latency_ns = self.now_ns.saturating_sub(slot.submit_ns);
        let ok = completion.status.is_success();
        if ok {
            if let Some(bucket) = slot.bucket {
                self.devices[dev as usize]
                    .recorder
                    .record(bucket, latency_ns);
            }
        } else {
            self.counters.io_errors += 1;
        }
        self.counters.ios += 1;
        let censored = self.woke_this_turn && slot.submit_ns <= self.slept_from_ns;
        self.policy.on_completion(&Observation {
            bucket: slot.bucket,
            submit_ns: slot.submit_ns,
            latency_ns,
            slept: slot.slept,
            idle_polls: self.counters.idle_polls - slot.idle_polls_at_submit,
            censored,
            after_interrupt: censored && self.interrupt_woke_this_turn,
        });
        let result = if ok {
            Ok(())
        } else if slot.recovery.timed_out()
            && matches!(
                completion.status,
                Status::ABORT_REQUESTED | Status::ABORTED_SQ_DELETION
            )
        {
            Err(IoFailure::TimedOut)
        } else {
            Err(IoFailure::Device(completion.status))
        };
        let done = IoDone {
            device: DeviceId(dev),
            result,
            buf: slot.buf,
            user: slot.user,
            latency_ns: self.now_ns.saturating_sub(slot.accepted_ns),
        };
        let callback = slot
            .callback
            .expect("only abandoned I/Os have run their callback");
        callback(self, done);
    }

    /// Runs timeout recovery if a step is due (one comparison when none is). Returns the
    /// steps taken.
    fn check_timeouts(&mut self) -> usize {
        if self.now_ns < self.recovery_due_ns {
            return 0;
        }
        self.recover()
    }

    /// One recovery scan, oldest I/O first (the reactor's submission order, which is
    /// timeout order on each device): fails waiters past their timeout, aborts I/Os past
    /// theirs, resets a queue pair when an abort did not complete its I/O in time (or the
    /// device cannot abort), and abandons what a reset did not complete in time (or what
    /// timed out on a device that cannot reset). Sets when the next step is due.
    fn recover(&mut self) -> usize {
        let now_ns = self.now_ns;
        let core = self.core;
        let Reactor {
            devices,
            slots,
            order,
            counters,
            to_abandon,
            expired,
            ..
        } = self;
        let bit = |d: usize| 1u64 << d;
        let mut next_due_ns = u64::MAX;
        let mut steps = 0;
        // Devices whose first I/O within its timeout has been seen (the rest of theirs are
        // younger), and devices to reset. `DEVICES_MAX` is 64: one bit each.
        let mut settled = 0u64;
        let mut escalate = 0u64;
        to_abandon.clear();
        for (d, dev) in devices.iter_mut().enumerate() {
            let Some(timeout_ns) = dev.io_timeout_ns else {
                settled |= bit(d);
                continue;
            };
            // Waiters past their timeout never reached the device: they fail as timed out.
            while let Some(w) = dev.waiting.front() {
                let due_ns = w.accepted_ns.saturating_add(timeout_ns);
                if now_ns < due_ns {
                    next_due_ns = next_due_ns.min(due_ns);
                    break;
                }
                expired.extend(dev.waiting.pop_front().map(|w| (d, w)));
            }
        }
        let all = if devices.len() == 64 {
            u64::MAX
        } else {
            bit(devices.len()) - 1
        };
        let mut i = 0;
        while i < order.len() && settled != all {
            let (key, seq) = order[i];
            let live = slots
                .get_mut(key)
                .filter(|s| s.seq == seq && s.recovery != Recovery::Abandoned);
            let Some(slot) = live else {
                if i == 0 {
                    order.pop_front();
                } else {
                    i += 1;
                }
                continue;
            };
            i += 1;
            let d = slot.device as usize;
            if settled & bit(d) != 0 {
                continue;
            }
            let dev = &mut devices[d];
            match slot.recovery {
                Recovery::InTime => {
                    let timeout_ns = dev.io_timeout_ns.expect("unsettled devices time out");
                    let due_ns = slot.accepted_ns.saturating_add(timeout_ns);
                    if now_ns < due_ns {
                        // This device's later I/Os are younger.
                        settled |= bit(d);
                        next_due_ns = next_due_ns.min(due_ns);
                        continue;
                    }
                    counters.io_timeouts += 1;
                    steps += 1;
                    let abort = dev.qp.abort(key as u64);
                    tracing::warn!(
                        core,
                        device = d,
                        tag = key,
                        waited_ns = now_ns.saturating_sub(slot.accepted_ns),
                        abort = ?abort,
                        "I/O timed out; aborting it"
                    );
                    match abort {
                        Ok(()) => {
                            counters.aborts += 1;
                            let deadline_ns = now_ns.saturating_add(dev.abort_timeout_ns);
                            slot.recovery = Recovery::Aborting { deadline_ns };
                            next_due_ns = next_due_ns.min(deadline_ns);
                        }
                        Err(_) => {
                            slot.recovery = Recovery::Aborting {
                                deadline_ns: now_ns,
                            };
                            escalate |= bit(d);
                        }
                    }
                }
                Recovery::Aborting { deadline_ns } => {
                    if now_ns >= deadline_ns {
                        escalate |= bit(d);
                    } else {
                        next_due_ns = next_due_ns.min(deadline_ns);
                    }
                }
                Recovery::Resetting { deadline_ns, .. } => {
                    if now_ns >= deadline_ns {
                        to_abandon.push(key);
                    } else {
                        next_due_ns = next_due_ns.min(deadline_ns);
                    }
                }
                Recovery::Abandoned => unreachable!("filtered above"),
            }
        }
        for (d, dev) in devices.iter_mut().enumerate() {
            if escalate & bit(d) == 0 {
                continue;
            }
            steps += 1;
            counters.resets += 1;
            let reset = dev.qp.reset();
            if reset.is_err() {
                counters.reset_failures += 1;
            }
            tracing::warn!(
                core,
                device = d,
                outstanding = dev.qp.outstanding(),
                reset = ?reset,
                "an abort did not complete a timed-out I/O in time; resetting the queue pair"
            );
            let deadline_ns = now_ns.saturating_add(dev.reset_timeout_ns);
            for &(key, seq) in order.iter() {
                let Some(slot) = slots.get_mut(key).filter(|s| {
                    s.seq == seq && s.device as usize == d && s.recovery != Recovery::Abandoned
                }) else {
                    continue;
                };
                match (&reset, slot.recovery) {
                    // The device owes every outstanding command a completion.
                    (Ok(()), Recovery::InTime | Recovery::Aborting { .. }) => {
                        let timed_out = slot.recovery.timed_out();
                        slot.recovery = Recovery::Resetting {
                            deadline_ns,
                            timed_out,
                        };
                        next_due_ns = next_due_ns.min(deadline_ns);
                    }
                    // No reset: give up on the timed-out I/Os whose abort is overdue (or
                    // could not be sent); leave the others be.
                    (Err(_), Recovery::Aborting { deadline_ns }) if deadline_ns <= now_ns => {
                        to_abandon.push(key)
                    }
                    _ => {}
                }
            }
        }
        self.recovery_due_ns = next_due_ns;
        // Callbacks last: they may submit (which only lowers `recovery_due_ns`).
        let mut expired = std::mem::take(&mut self.expired);
        self.waiters -= expired.len();
        self.counters.io_timeouts += expired.len() as u64;
        for (d, w) in expired.drain(..) {
            steps += 1;
            self.fail_waiter(d, w, IoFailure::TimedOut);
        }
        self.expired = expired;
        let mut abandon = std::mem::take(&mut self.to_abandon);
        for &key in &abandon {
            self.abandon(key);
            steps += 1;
        }
        abandon.clear();
        self.to_abandon = abandon;
        steps
    }

    /// Fails one I/O locally with `IoFailure::Abandoned`, keeping its slot (and buffer) in
    /// quarantine: the device may still use the buffer until it completes the command or
    /// the queue pair is deleted.
    fn abandon(&mut self, key: usize) {
        let slot = &mut self.slots[key];
        if slot.recovery == Recovery::Abandoned {
            return;
        }
        slot.recovery = Recovery::Abandoned;
        let callback = slot.callback.take().expect("not abandoned before");
        let done = IoDone {
            device: DeviceId(slot.device),
            result: Err(IoFailure::Abandoned),
            buf: None,
            user: slot.user,
            latency_ns: self.now_ns.saturating_sub(slot.accepted_ns),
        };
        tracing::error!(
            core = self.core,
            device = slot.device,
            tag = key,
            waited_ns = done.latency_ns,
            "I/O abandoned: the device neither completed, aborted nor reset it in time; its \
             buffer stays quarantined until the device completes it or shutdown"
        );
        self.devices[slot.device as usize].abandoned += 1;
        self.abandoned += 1;
        self.counters.abandoned_ios += 1;
        self.counters.ios += 1;
        self.counters.io_errors += 1;
        callback(self, done);
    }

    /// When the next timeout recovery step of any device is due.
    fn recovery_due_ns(&self) -> Option<u64> {
        Some(self.recovery_due_ns).filter(|&t| t != u64::MAX)
    }

    /// The oldest outstanding I/O's slot key.
    fn oldest(&mut self) -> Option<usize> {
        while let Some(&(key, seq)) = self.order.front() {
            if self
                .slots
                .get(key)
                .is_some_and(|s| s.seq == seq && s.recovery != Recovery::Abandoned)
            {
                return Some(key);
            }
            self.order.pop_front();
        }
        None
    }

    /// Nothing had work this turn.
    fn when_idle(&mut self) {
        // Abandoned I/Os are not waited for: their completions may never come. (Nor are
        // I/Os waiting for a slot when nothing live is outstanding: every slot is
        // quarantined; their timeout wakes a parked reactor.)
        if self.live() == 0 {
            let since = *self.idle_since_ns.get_or_insert(self.now_ns);
            if self.now_ns - since >= self.tuning.idle_spin_ns {
                self.arm_interrupts();
                self.park(false, None);
            } else {
                std::hint::spin_loop();
            }
            return;
        }
        self.idle_since_ns = None;
        let key = self.oldest().expect("outstanding I/O has an oldest");
        let slot = &self.slots[key];
        let dev = &self.devices[slot.device as usize];
        let interrupts = self.interrupts_armable();
        let ctx = PollContext {
            now_ns: self.now_ns,
            outstanding: self.live(),
            oldest: InFlight {
                bucket: slot.bucket,
                submit_ns: slot.submit_ns,
                slept: slot.slept.is_some(),
            },
            stats: dev.recorder.snapshot(),
            overshoot: dev.recorder.overshoot(),
            interrupts,
            oracle_deadline_ns: dev.qp.oracle_next_deadline_ns(),
        };
        match self.policy.decide(&ctx) {
            Decision::Spin => std::hint::spin_loop(),
            Decision::Sleep(duration) => self.sleep_for(key, duration, false),
            Decision::SleepInterruptible(duration) => self.sleep_for(key, duration, true),
            Decision::WaitInterrupt => {
                if interrupts {
                    self.counters.interrupt_waits += 1;
                    self.arm_interrupts();
                    self.park(true, None);
                    self.interrupt_woke_pending = true;
                } else {
                    // A device without an interrupt line (virtual time): poll instead.
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// Whether every device with I/O outstanding has an interrupt line to block on.
    fn interrupts_armable(&self) -> bool {
        self.devices
            .iter()
            .all(|d| d.has_irq || d.qp.outstanding() == 0)
    }

    /// Readies every interrupt line before the reactor blocks. Devices with commands
    /// outstanding are armed, so that a completion wakes it (abandoned commands included:
    /// their slots come back when they complete). Idle ones are disarmed: a line left
    /// readable by completions that were polled for (an io_uring eventfd counts every
    /// completion, armed or not) is in the reactor's epoll set, and would end every park at
    /// once, leaving an idle reactor spinning.
    fn arm_interrupts(&mut self) {
        for dev in &mut self.devices {
            if !dev.has_irq {
                continue;
            }
            if dev.qp.outstanding() > 0 {
                dev.qp.arm_interrupt();
            } else {
                dev.qp.disarm_interrupt();
            }
        }
    }

    /// Sleeps for the I/O in `key`, once, until `duration` after the decision's timestamp,
    /// and records how far the wake-up overshot. An `interruptible` sleep, and any sleep past
    /// [`ReactorTuning::long_sleep_ns`], blocks on the device interrupts as well: a
    /// completion ends it early, and then it is an interrupt wait, not the I/O's one sleep
    /// (the policy decides again). Without interrupt lines an interruptible sleep is a timed
    /// one, and a long sleep lasts `long_sleep_ns`, after which the policy decides again.
    fn sleep_for(&mut self, key: usize, duration: Duration, interruptible: bool) {
        let requested_ns = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let decided_ns = self.now_ns;
        let long = requested_ns > self.tuning.long_sleep_ns;
        let on_interrupts = (interruptible || long) && self.interrupts_armable();
        if long && !on_interrupts {
            // No interrupt to end it early: sleep a bounded piece, then poll.
            crate::sys::sleep_until_ns(decided_ns.saturating_add(self.tuning.long_sleep_ns));
            self.slept_from_ns = decided_ns;
            self.woke_pending = true;
            return;
        }
        // Measure what a sleep costs the thread in CPU, from the OS, on a sample of sleeps:
        // the reading itself is a syscall.
        let sample_cpu = self.counters.sleeps.is_multiple_of(SLEEP_CPU_SAMPLE_EVERY);
        let cpu_before_ns = if sample_cpu {
            self.me().stats.cpu_ns()
        } else {
            None
        };
        let until_ns = decided_ns.saturating_add(requested_ns);
        if on_interrupts {
            self.arm_interrupts();
            self.park(true, Some(until_ns));
        } else {
            crate::sys::sleep_until_ns(until_ns);
            self.slept_from_ns = decided_ns;
            self.woke_pending = true;
        }
        let actual_ns = monotonic_ns().saturating_sub(decided_ns);
        if actual_ns < requested_ns && on_interrupts {
            // A completion (or a message) ended it: an interrupt wait.
            self.counters.interrupt_waits += 1;
            self.interrupt_woke_pending = true;
            return;
        }
        let cpu_ns =
            cpu_before_ns.and_then(|before| Some(self.me().stats.cpu_ns()?.saturating_sub(before)));
        let slept = Slept {
            requested_ns,
            actual_ns,
        };
        let slot = &mut self.slots[key];
        slot.slept = Some(slept);
        let dev = slot.device as usize;
        self.devices[dev]
            .recorder
            .record_sleep(requested_ns, actual_ns);
        self.counters.sleeps += 1;
        self.counters.slept_ns += requested_ns;
        self.counters.overshoot_ns += slept.overshoot_ns();
        self.policy.on_sleep(&slept, cpu_ns);
    }

    /// Blocks in epoll on the mailbox, the next timer, pollers' fds and (when `for_io`) the
    /// armed device interrupts; with `until_ns`, no later than then.
    fn park(&mut self, for_io: bool, until_ns: Option<u64>) {
        let mut next_timer_ns = self.timers.next_deadline_ns();
        // A lost command never interrupts, and an I/O waiting behind quarantined slots has
        // nothing to wake it: wake for the next timeout.
        if let Some(due_ns) = self.recovery_due_ns() {
            next_timer_ns = Some(next_timer_ns.map_or(due_ns, |t| t.min(due_ns)));
        }
        if next_timer_ns != self.timer_fd_armed_ns {
            let armed = match next_timer_ns {
                Some(deadline_ns) => self.timer_fd.arm_at(deadline_ns),
                None => self.timer_fd.disarm(),
            };
            armed.expect("reactor: setting its own timerfd failed");
            self.timer_fd_armed_ns = next_timer_ns;
        }
        if !for_io {
            self.counters.parks += 1;
            self.publish_parked(true);
        }
        self.slept_from_ns = self.now_ns;
        self.woke_pending = true;
        let wake = &self.handles[self.index].wake;
        wake.parked.store(true, Ordering::SeqCst);
        // Pairs with the fence in `ReactorHandle::send`.
        std::sync::atomic::fence(Ordering::SeqCst);
        let mut mailbox_signalled = false;
        if self.mailbox.is_empty() && !wake.stop.load(Ordering::SeqCst) {
            // A deadline before the timerfd's is epoll's own timeout: no timerfd to set for
            // a short sleep, nor to disarm after it.
            let timeout = until_ns
                .filter(|&u| self.timer_fd_armed_ns.is_none_or(|t| u < t))
                .map(|u| Duration::from_nanos(u.saturating_sub(monotonic_ns())));
            match self.epoll.wait(timeout) {
                Ok(mut tokens) => mailbox_signalled = tokens.any(|t| t == TOKEN_MAILBOX),
                Err(e) => panic!("reactor {}: epoll_wait failed: {e}", self.core),
            }
        }
        wake.parked.store(false, Ordering::SeqCst);
        if mailbox_signalled {
            wake.eventfd.drain();
        }
        if self.timer_fd_armed_ns.is_some_and(|t| t <= monotonic_ns()) {
            // It fired: a fired timerfd stays readable until set again.
            self.timer_fd_armed_ns = None;
            self.timer_fd
                .disarm()
                .expect("reactor: disarming its own timerfd failed");
        }
        if !for_io {
            self.publish_parked(false);
        }
    }

    fn publish(&mut self) {
        self.last_publish_ns = self.now_ns;
        self.me().stats.publish(
            &self.counters,
            self.start_ns,
            self.now_ns,
            self.outstanding() as u64,
            false,
        );
    }

    /// Publishes before parking (readers then count the parked time as idle, up to now) and
    /// after waking.
    fn publish_parked(&mut self, parked: bool) {
        let now_ns = monotonic_ns();
        self.last_publish_ns = now_ns;
        self.me().stats.publish(
            &self.counters,
            self.start_ns,
            now_ns,
            self.outstanding() as u64,
            parked,
        );
    }

    /// Stops: runs what is queued, stops timers and pollers, lets outstanding I/O complete
    /// for up to the shutdown timeout, then deletes the queue pairs and fails the rest.
    fn shut_down(mut self) -> ExitReport {
        self.stopping = true;
        while self.run_messages(MESSAGE_BATCH) > 0 {}
        self.pollers.clear();
        self.timers = Timers::default();
        // I/Os still waiting for a slot never reached a device: they fail now.
        self.now_ns = monotonic_ns();
        let mut waiting_failed = 0;
        for d in 0..self.devices.len() {
            while let Some(w) = self.devices[d].waiting.pop_front() {
                self.waiters -= 1;
                waiting_failed += 1;
                self.fail_waiter(d, w, IoFailure::Shutdown);
            }
        }
        let ios_before = self.counters.ios;
        let deadline_ns = monotonic_ns() + self.tuning.shutdown_timeout.as_nanos() as u64;
        while self.live() > 0 && monotonic_ns() < deadline_ns {
            self.now_ns = monotonic_ns();
            if self.reap() + self.check_timeouts() == 0 {
                // Stopping is not latency-critical: poll every 50 us rather than spin.
                std::thread::sleep(SHUTDOWN_POLL);
            }
        }
        let drained_ios = self.counters.ios - ios_before;
        // Delete the queue pairs first: after this no device touches an I/O buffer.
        self.devices.clear();
        // Abandoned I/Os already ran their callbacks: their buffers leave quarantine here.
        let failed: Vec<IoSlot> = self
            .slots
            .drain()
            .filter(|s| s.recovery != Recovery::Abandoned)
            .collect();
        self.abandoned = 0;
        let failed_ios = failed.len() as u64 + waiting_failed;
        if failed_ios > 0 {
            tracing::warn!(
                core = self.core,
                failed_ios,
                shutdown_timeout_ms = self.tuning.shutdown_timeout.as_millis() as u64,
                "reactor stopping: I/O still outstanding fails with Shutdown"
            );
        }
        self.now_ns = monotonic_ns();
        for slot in failed {
            let callback = slot.callback.expect("not abandoned");
            let done = IoDone {
                device: DeviceId(slot.device),
                result: Err(IoFailure::Shutdown),
                buf: slot.buf,
                user: slot.user,
                latency_ns: self.now_ns.saturating_sub(slot.accepted_ns),
            };
            self.counters.ios += 1;
            self.counters.io_errors += 1;
            callback(&mut self, done);
        }
        self.publish();
        ExitReport {
            core: self.core,
            drained_ios,
            failed_ios,
            stats: self.me().stats(),
        }
    }
}

/// The command for `req`, on `buf` (which `Reactor::submit` checked is there exactly for
/// reads and writes).
#[inline]
fn command<'b>(req: &IoRequest, buf: Option<&'b mut hypoll_nvme::IoBuf>) -> Command<'b> {
    match (req.op, buf) {
        (IoOp::Read, Some(b)) => Command::read(req.slba, req.nlb, b),
        (IoOp::Write, Some(b)) => Command::write(req.slba, req.nlb, b),
        (IoOp::Flush, None) => Command::flush(),
        (IoOp::WriteZeroes, None) => Command::write_zeroes(req.slba, req.nlb),
        (IoOp::Deallocate, None) => Command::deallocate(req.slba, req.nlb),
        _ => unreachable!("Reactor::submit checks the buffer against the operation"),
    }
    .with_fua(req.fua)
    .with_deallocate(req.deallocate)
}

/// Convenience wrappers over [`Reactor::submit`].
impl Reactor {
    pub fn read(
        &mut self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        buf: hypoll_nvme::IoBuf,
        callback: impl FnOnce(&mut Reactor, IoDone) + 'static,
    ) -> Result<(), Rejected> {
        self.submit(
            device,
            IoRequest::new(IoOp::Read, slba, nlb),
            Some(buf),
            callback,
        )
    }

    pub fn write(
        &mut self,
        device: DeviceId,
        slba: u64,
        buf: hypoll_nvme::IoBuf,
        callback: impl FnOnce(&mut Reactor, IoDone) + 'static,
    ) -> Result<(), Rejected> {
        let lba = self
            .devices
            .get(device.0 as usize)
            .map_or(1, |d| d.lba_bytes as usize);
        let nlb = (buf.len() / lba) as u32;
        self.submit(
            device,
            IoRequest::new(IoOp::Write, slba, nlb),
            Some(buf),
            callback,
        )
    }

    pub fn flush(
        &mut self,
        device: DeviceId,
        callback: impl FnOnce(&mut Reactor, IoDone) + 'static,
    ) -> Result<(), Rejected> {
        self.submit(device, IoRequest::new(IoOp::Flush, 0, 0), None, callback)
    }

    pub fn write_zeroes(
        &mut self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        callback: impl FnOnce(&mut Reactor, IoDone) + 'static,
    ) -> Result<(), Rejected> {
        self.submit(
            device,
            IoRequest::new(IoOp::WriteZeroes, slba, nlb),
            None,
            callback,
        )
    }

    pub fn deallocate(
        &mut self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        callback: impl FnOnce(&mut Reactor, IoDone) + 'static,
    ) -> Result<(), Rejected> {
        self.submit(
            device,
            IoRequest::new(IoOp::Deallocate, slba, nlb),
            None,
            callback,
        )
    }
}
