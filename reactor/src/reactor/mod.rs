//! The reactor: one pinned thread's loop over messages, timers, pollers and queue pairs, and
//! what it does when none of them has work (ask the policy, or park).
//!
//! The state lives here; each concern is one `impl Reactor` block in its own file:
//! - `handle`: the [`ReactorHandle`] other threads hold, and the mailbox behind it;
//! - `api`: what embedders call to attach devices, add timers and pollers, and look inside;
//! - `submit`: submitting an I/O, and the bounded wait queue of I/Os that found their queue
//!   pair full;
//! - `step`: the step API, for an embedder that drives a reactor from its own loop;
//! - `turn`: the loop, one turn of it (messages, timers, pollers, completions), and shutdown;
//! - `region`: memory the application registers with a device, and vectored I/O into it;
//! - `recovery`: timeouts, aborts, resets, and abandoning what a device never completes;
//! - `idle`: what a turn without work does: ask the policy, sleep, wait for an interrupt, or
//!   park; and the wake state that tells the policy how the last wait ended;
//! - `arrivals`: requests front ends report, and the idle stretch's spin the policy decides
//!   from them.

mod api;
mod arrivals;
pub use arrivals::IDLE_SPIN_NS_MAX;
mod handle;
mod idle;
mod recovery;
mod region;
mod step;
mod submit;
#[cfg(test)]
mod tests;
mod turn;
mod wait;

use std::collections::VecDeque;
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;
use hypoll_nvme::sys::{monotonic_ns, TimerFd};
use hypoll_nvme::{Clock, Completion, QueuePair};
use hypoll_policy::{ArrivalStats, Bucket, PollPolicy, Slept, StatsRecorder};
use slab::Slab;

use crate::io::IoCallback;
use crate::stats::{Counters, ReactorStats};
use crate::sys::Epoll;
use crate::timer::Timers;

pub(crate) use handle::mailbox;
pub use handle::{ReactorHandle, SendError};
use idle::WakeState;
use recovery::Recovery;
pub(crate) use step::build_policy;
pub use step::StandaloneConfig;
use submit::QueuedIo;

/// Most messages run per loop turn, so a flood of messages cannot starve I/O.
pub const MESSAGE_BATCH: usize = 32;
/// Most functions one batch of completions runs after its callbacks
/// ([`Reactor::after_completions`]).
pub const AFTER_BATCH_MAX: usize = 4;

/// A function run after a batch of completions ([`Reactor::after_completions`]).
pub type AfterBatch<S> = fn(&mut Reactor<S>, &mut S);

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

// A device's index is a `u16` (in `IoSlot`, `DeviceId`) and one bit of the `u64` sets a
// recovery scan keeps; its epoll token sits below the pollers'.
const _: () = assert!(DEVICES_MAX <= u64::BITS as usize);
const _: () = assert!(DEVICES_MAX <= u16::MAX as usize + 1);
const _: () = assert!(TOKEN_DEVICE_BASE + DEVICES_MAX as u64 <= TOKEN_POLLER_BASE);

/// A closure run on a reactor, given the reactor and its state.
pub type Message<S = ()> = Box<dyn FnOnce(&mut Reactor<S>, &mut S) + Send>;

/// Work a reactor polls every turn (a socket, a ring). Returns the work it did: 0 means it
/// found nothing. Pollers that can say when they have work give a `wake_fd`, so a parked
/// reactor wakes for them; one without an fd is polled only when the reactor is awake.
pub trait Poller<S = ()> {
    fn poll(&mut self, reactor: &mut Reactor<S>, state: &mut S) -> usize;

    fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    /// The reactor is about to block in epoll (to park, or to wait for an interrupt or the
    /// end of an interruptible sleep). A poller whose source stops signalling while it is
    /// polled (a virtqueue whose guest is told not to notify while the reactor spins on
    /// its ring) turns the signal back on here, then looks once more for work that arrived
    /// before it did: without that second look, a request posted just before the signal
    /// came back on would wait for the next one. Returns whether work is there already; the
    /// reactor then does not block. Called on every poller before each block, so it must
    /// be cheap. The default has nothing to arm.
    fn before_block(&mut self) -> bool {
        false
    }
}

/// Identifies a poller for [`Reactor::remove_poller`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PollerId(u64);

/// A device attached to this reactor: its queue pair and this reactor's statistics for it.
struct Attached<S> {
    qp: Box<dyn QueuePair>,
    recorder: StatsRecorder,
    lba_bytes: u32,
    has_irq: bool,
    /// `DeviceOptions`' timeouts, in ns.
    io_timeout_ns: Option<u64>,
    abort_timeout_ns: u64,
    reset_timeout_ns: u64,
    /// I/Os accepted while the queue pair was full, oldest first, at most `wait_capacity`.
    waiting: VecDeque<QueuedIo<S>>,
    /// At most [`crate::io::WAIT_QUEUE_MAX`].
    wait_capacity: usize,
    /// Abandoned I/Os of this device still holding a queue-pair slot.
    abandoned: usize,
    /// Regions registered with this queue pair, each at its table index
    /// (`MemoryRegion::index`, `hypoll_nvme::REGIONS_MAX` entries): a vectored I/O's
    /// segments must lie in them, and checking one is one look at its index.
    regions: Vec<Option<hypoll_nvme::MemoryRegion>>,
    /// Whether the policy is told the emulated device's true next deadline
    /// (`PollContext::oracle_deadline_ns`): only for the `oracle` policy on an emulated
    /// queue pair, so no other device or policy pays to ask.
    oracle: bool,
}

/// The reactor's record of one outstanding I/O, in a slab keyed by the command's tag.
struct IoSlot<S> {
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
    callback: Option<IoCallback<S>>,
    recovery: Recovery,
}

/// Tunables of a reactor.
#[derive(Clone, Debug)]
pub struct ReactorTuning {
    /// With nothing outstanding and no work, spin this long before parking; once front ends
    /// report requests ([`Reactor::note_arrivals`]), the policy decides (this is the
    /// default of its idle decision, `PollPolicy::decide_idle`).
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

/// What a reactor reports when it exits, with what its exit hook returned (see
/// [`ReactorSet::start_with_exit`](crate::ReactorSet::start_with_exit)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExitReport<X = ()> {
    pub core: usize,
    /// I/Os that completed while the reactor was stopping.
    pub drained_ios: u64,
    /// I/Os still outstanding at the shutdown timeout: each callback ran with
    /// [`IoFailure::Shutdown`](crate::io::IoFailure::Shutdown).
    pub failed_ios: u64,
    pub stats: ReactorStats,
    /// What the exit hook made of the reactor's state.
    pub output: X,
}

impl ExitReport {
    pub(crate) fn with_output<X>(self, output: X) -> ExitReport<X> {
        ExitReport {
            core: self.core,
            drained_ios: self.drained_ios,
            failed_ios: self.failed_ios,
            stats: self.stats,
            output,
        }
    }
}

/// One reactor: owns its queue pairs, pollers, timers, policy and statistics. Lives on its
/// own thread; other threads reach it through a [`ReactorHandle`].
pub struct Reactor<S = ()> {
    index: usize,
    core: usize,
    /// Dropped before everything else, whatever the order of the fields: see `Drop`.
    devices: Vec<Attached<S>>,
    slots: Slab<IoSlot<S>>,
    io_capacity: usize,
    order: VecDeque<(usize, u64)>,
    next_seq: u64,
    completions: Vec<(u16, Completion)>,
    /// Whether the callbacks of a batch of completions are running (see
    /// `Reactor::after_completions`).
    in_batch: bool,
    /// Completions of the batch being run whose callbacks have not run yet
    /// (`Reactor::completions_left`); 0 outside a batch.
    batch_left: usize,
    /// What runs once the batch's callbacks have (`Reactor::after_completions`).
    after_batch: [Option<AfterBatch<S>>; AFTER_BATCH_MAX],
    policy: Box<dyn PollPolicy>,
    mailbox: Receiver<Message<S>>,
    handles: Arc<[ReactorHandle<S>]>,
    timers: Timers<S>,
    timer_fd: TimerFd,
    timer_fd_armed_ns: Option<u64>,
    pollers: Vec<(PollerId, Box<dyn Poller<S>>)>,
    poller_fds: Vec<(PollerId, RawFd)>,
    removed_pollers: Vec<PollerId>,
    next_poller: u64,
    epoll: Epoll,
    tuning: ReactorTuning,
    counters: Counters,
    start_ns: u64,
    now_ns: u64,
    last_publish_ns: u64,
    /// When the current idle stretch (nothing outstanding, nothing to run) began.
    idle_since_ns: Option<u64>,
    /// How long that stretch spins before it parks (decided at its start).
    idle_spin_ns: u64,
    /// What front ends reported of the requests they took.
    arrivals: ArrivalStats,
    /// When the reactor last went to sleep or blocked.
    slept_from_ns: u64,
    /// Whether the current turn is the first after a wait, and how that wait ended:
    /// completions reaped then are censored (see `Observation`).
    wake_this_turn: WakeState,
    /// What the wait at the end of this turn (if any) makes of the next one.
    wake_next_turn: WakeState,
    stopping: bool,
    /// The last `poll` found no work and no `idle` followed it yet (the step API).
    idle_due: bool,
    /// Where `now_ns` comes from: CLOCK_MONOTONIC, or a simulation's virtual clock.
    clock: Clock,
    /// How the idle path blocks: the real thread, or a simulation's virtual time.
    waiter: wait::Waiter,
    /// Slots of abandoned I/Os (still in `slots`, quarantined).
    abandoned: usize,
    /// Keys of I/Os to abandon, collected during a recovery scan (preallocated).
    to_abandon: Vec<usize>,
    /// Waiters past their timeout, with their device, collected during a recovery scan
    /// (preallocated).
    expired: Vec<(usize, QueuedIo<S>)>,
    /// When the next timeout or recovery step is due (ns); `u64::MAX`: none. Lowered by
    /// every submission on a device with a timeout, set by each recovery scan.
    recovery_due_ns: u64,
    /// I/Os waiting for a slot, on every device.
    waiters: usize,
    /// A vectored I/O's segments as its command takes them, filled and emptied within one
    /// submission (preallocated for `hypoll_nvme::SEGMENTS_MAX`).
    read_segments: Vec<std::io::IoSliceMut<'static>>,
    write_segments: Vec<std::io::IoSlice<'static>>,
}

/// Queue pairs go before the buffers they point into, whatever the order of the fields: a
/// reactor dropped with I/O in flight (a panic unwinding its thread, a simulation's
/// reactor) deletes its queue pairs first, and a dropped queue pair guarantees that its
/// device touches no buffer handed to it (see `QueuePair`'s contract); I/Os waiting for a
/// slot, which no device saw, go with their devices. Only then do the slots go, with the
/// buffers and callbacks of the I/Os still in flight (the callbacks do not run: no reactor
/// is left to run them on).
impl<S> Drop for Reactor<S> {
    fn drop(&mut self) {
        self.devices.clear();
    }
}

impl<S> Reactor<S> {
    pub(crate) fn new(
        index: usize,
        mailbox: Receiver<Message<S>>,
        handles: Arc<[ReactorHandle<S>]>,
        policy: Box<dyn PollPolicy>,
        tuning: ReactorTuning,
    ) -> std::io::Result<Reactor<S>> {
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
            in_batch: false,
            batch_left: 0,
            after_batch: [None; AFTER_BATCH_MAX],
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
            idle_spin_ns: 0,
            arrivals: ArrivalStats::default(),
            slept_from_ns: 0,
            wake_this_turn: WakeState::Awake,
            wake_next_turn: WakeState::Awake,
            stopping: false,
            idle_due: false,
            clock: Clock::Monotonic,
            waiter: wait::Waiter::Real,
            abandoned: 0,
            to_abandon: Vec::new(),
            expired: Vec::new(),
            recovery_due_ns: u64::MAX,
            waiters: 0,
            read_segments: Vec::with_capacity(hypoll_nvme::SEGMENTS_MAX),
            write_segments: Vec::with_capacity(hypoll_nvme::SEGMENTS_MAX),
        })
    }

    #[cfg(any(test, feature = "sim"))]
    /// Makes the reactor read `clock` instead of CLOCK_MONOTONIC (simulations step a
    /// reactor by hand on a virtual clock; see `crate::sim`).
    pub(crate) fn set_clock(&mut self, clock: Clock) {
        self.now_ns = clock.now_ns();
        self.start_ns = self.now_ns;
        self.last_publish_ns = self.now_ns;
        self.clock = clock;
    }

    fn me(&self) -> &ReactorHandle<S> {
        &self.handles[self.index]
    }

    /// I/Os on a queue pair that the reactor still waits for (abandoned ones excluded).
    fn live(&self) -> usize {
        self.slots.len() - self.abandoned
    }

    /// What holds of abandoned I/Os between any two steps of the reactor: each device's are
    /// counted in the reactor's, and each still holds its slot.
    fn abandoned_hold(&self) -> bool {
        let abandoned: usize = self.devices.iter().map(|dev| dev.abandoned).sum();
        abandoned == self.abandoned && self.abandoned <= self.slots.len()
    }

    /// No more I/Os in flight than the queue pairs' depths together (what `attach` reserved
    /// slots for). Not within a batch of completions: the batch's completions not yet
    /// processed keep their slots while earlier callbacks refill the queue pair.
    fn in_flight_within_depths(&self) -> bool {
        self.slots.len() <= self.io_capacity
    }
}
