//! The emulated NVMe controller, hypoll's default device.
//!
//! It keeps real ring mechanics: the host writes 64-byte submission entries into a
//! submission ring and rings the tail doorbell; the controller fetches them, and when the
//! latency model says a command is done it writes a 16-byte completion entry into the
//! completion ring with the current phase tag, flipping the phase on every wrap; the host
//! reaps entries whose phase matches the one it expects and rings the head doorbell.
//!
//! There is no device thread (on a 2-core machine it would steal the core being measured):
//! the controller does its work when the host touches it. Fetching happens on the doorbell
//! write, and posting happens when the host polls: every command whose deadline has passed
//! is posted before the host reads the completion ring, so a completion entry becomes
//! visible exactly when the model says the command is done, and never earlier. Data moves
//! at that moment too, as a device's DMA precedes its completion entry.
//!
//! Interrupts: a CLOCK_MONOTONIC timerfd armed at the earliest pending deadline, so a
//! thread can block on it as a driver blocks on an MSI-X eventfd.
//!
//! Aborts: [`EmuQueuePair::abort_command`] (NVMe Abort) completes one pending or lost command
//! with "Command Abort Requested"; `stuck_pct` makes some lost commands ignore it.
//!
//! Resets: [`EmuController::reset`] resets the whole controller, [`EmuQueuePair::reset`] one
//! queue pair. Either way every command outstanding on an affected queue pair completes with
//! "Command Aborted due to SQ Deletion". A controller reset reaches the queue pairs, which
//! belong to other threads, without a lock on the I/O path: it bumps a shared generation
//! counter, and each queue pair compares that counter with the last value it saw (one
//! relaxed load) whenever its owner submits, polls or arms the interrupt, resetting itself
//! before anything else when it changed. Queue pairs blocked on an armed interrupt are woken.

pub mod config;
pub mod latency;
pub mod store;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::marker::PhantomData;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

pub use config::{Backing, EmuConfig};
use latency::{LatencyClass, LatencyModel};
use store::Store;

use crate::clock::Clock;
use crate::qpair::{
    Command, Completion, Controller, QueuePair, QueuePairError, RecoveryError, SubmitError,
    QUEUE_DEPTH_MAX,
};
use crate::spec::{
    CompletionEntry, DsmRange, NamespaceInfo, Opcode, Status, SubmissionEntry, CDW12_FUA,
    DSM_ATTR_DEALLOCATE,
};
use crate::sys::TimerFd;

/// The only namespace an emulated controller has.
pub const NSID: u32 = 1;

/// Shared by every queue pair of one controller.
struct Shared {
    cfg: EmuConfig,
    ns: NamespaceInfo,
    store: Store,
    clock: Clock,
    /// When the controller was created, on its clock (the origin of `drift_pct`).
    created_ns: u64,
    /// Queue pairs created so far (qids are handed out from it, wrapping in 1..=65535).
    queues_created: AtomicU64,
    queues_live: AtomicU32,
    /// Controller resets so far. Each queue pair resets itself when it sees this change.
    reset_generation: AtomicU64,
    /// Interrupt lines of the live queue pairs (real clock only), so a controller reset can
    /// wake the ones blocked on an armed interrupt. Locked when a queue pair is created or
    /// dropped and by a controller reset: never on the submit or poll path.
    irq_lines: Mutex<Vec<Arc<IrqLine>>>,
}

impl Shared {
    /// Resets the controller: bumps the generation every queue pair watches and raises the
    /// interrupt of every queue pair that has it armed (the owner then sees the new
    /// generation when it polls). Returns the new generation.
    fn reset_controller(&self) -> u64 {
        // SeqCst pairs with `arm_interrupt`: either the owner, arming, sees the new
        // generation, or this sees the line armed.
        let generation = self.reset_generation.fetch_add(1, Ordering::SeqCst) + 1;
        for line in self.irq_lines.lock().iter() {
            if line.armed.load(Ordering::SeqCst) {
                // At worst (the owner disarmed meanwhile) a spurious wake-up: the owner
                // re-arms its timer before it blocks again.
                line.timer
                    .arm_at(1)
                    .expect("emulated controller: timerfd_settime on our own timer failed");
            }
        }
        generation
    }
}

/// A queue pair's interrupt: its timerfd, and whether its owner has it armed (mirrored here
/// for a controller reset on another thread).
#[derive(Debug)]
struct IrqLine {
    timer: TimerFd,
    armed: AtomicBool,
}

/// An emulated NVMe controller with one namespace.
#[derive(Clone)]
pub struct EmuController {
    shared: Arc<Shared>,
}

impl EmuController {
    /// A controller on the real monotonic clock.
    pub fn new(cfg: EmuConfig) -> std::io::Result<EmuController> {
        EmuController::with_clock(cfg, Clock::Monotonic)
    }

    /// A controller on the given clock; a virtual clock makes the latency model
    /// deterministic and leaves the queue pairs without an interrupt fd.
    pub fn with_clock(cfg: EmuConfig, clock: Clock) -> std::io::Result<EmuController> {
        cfg.validate()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let ns = NamespaceInfo {
            nsid: NSID,
            lba_size_bytes: cfg.lba_bytes,
            capacity_lbas: cfg.size_bytes / u64::from(cfg.lba_bytes),
            transfer_bytes_max: cfg.mdts_bytes,
        };
        let store = Store::open(&cfg.backing, cfg.size_bytes)?;
        let queues_max = cfg.queues_max as usize;
        Ok(EmuController {
            shared: Arc::new(Shared {
                cfg,
                ns,
                store,
                created_ns: clock.now_ns(),
                clock,
                queues_created: AtomicU64::new(0),
                queues_live: AtomicU32::new(0),
                reset_generation: AtomicU64::new(0),
                irq_lines: Mutex::new(Vec::with_capacity(queues_max)),
            }),
        })
    }

    pub fn config(&self) -> &EmuConfig {
        &self.shared.cfg
    }

    /// Creates an I/O queue pair, as the concrete type (tests and benchmarks use its extra
    /// methods; reactors go through [`Controller::create_queue_pair`]).
    pub fn queue_pair(&self, depth: usize) -> Result<EmuQueuePair, QueuePairError> {
        if depth == 0 || depth > QUEUE_DEPTH_MAX {
            return Err(QueuePairError::BadDepth {
                depth,
                max: QUEUE_DEPTH_MAX,
            });
        }
        let max = self.shared.cfg.queues_max;
        self.shared
            .queues_live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| QueuePairError::NoQueuesLeft { max: max as usize })?;
        // Qid 0 is the admin queue: I/O queues take 1..=65535, wrapping.
        let created = self.shared.queues_created.fetch_add(1, Ordering::AcqRel);
        let qid = (created % u64::from(u16::MAX)) as u16 + 1;
        let irq = if self.shared.clock.is_virtual() {
            None
        } else {
            match TimerFd::new() {
                Ok(timer) => {
                    let line = Arc::new(IrqLine {
                        timer,
                        armed: AtomicBool::new(false),
                    });
                    self.shared.irq_lines.lock().push(line.clone());
                    Some(line)
                }
                Err(e) => {
                    self.shared.queues_live.fetch_sub(1, Ordering::AcqRel);
                    return Err(e.into());
                }
            }
        };
        Ok(EmuQueuePair::new(self.shared.clone(), qid, depth, irq))
    }

    /// Resets the controller, as a host does after a command timeout: every command
    /// outstanding on every live queue pair, pending or lost, completes with "Command
    /// Aborted due to SQ Deletion". Each queue pair carries out the reset the next time its
    /// owner submits, polls or arms its interrupt, before anything else, so the aborts are
    /// the first completions it reaps; a queue pair blocked on an armed interrupt is woken.
    /// Safe to call from any thread; the I/O path pays one relaxed atomic load for it.
    pub fn reset(&self) {
        self.shared.reset_controller();
    }

    /// Controller resets so far (asked for, or injected by `reset_pct`).
    pub fn resets(&self) -> u64 {
        self.shared.reset_generation.load(Ordering::Relaxed)
    }

    /// Times a file backing was made durable: once per Flush and per FUA write (0 for a
    /// memory backing).
    pub fn backing_syncs(&self) -> u64 {
        self.shared.store.syncs()
    }
}

impl Controller for EmuController {
    /// The configuration's canonical spec string (see `EmuConfig`'s `Display`).
    fn describe(&self) -> String {
        self.shared.cfg.to_string()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.shared.ns
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        Ok(Box::new(self.queue_pair(depth)?))
    }
}

/// Where a command is inside the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Fetched, waiting for its deadline.
    Pending,
    /// Fetched and dropped by fault injection: an Abort or a reset completes it.
    Lost,
    /// Lost, and deaf to Aborts as well (`stuck_pct`): only a reset completes it.
    Stuck,
}

/// The controller's record of one fetched command, indexed by command id.
#[derive(Clone, Copy, Debug)]
struct DeviceSlot {
    state: SlotState,
    opcode: Option<Opcode>,
    status: Status,
    offset_bytes: u64,
    len_bytes: u64,
    buf_ptr: *mut u8,
    deadline_ns: u64,
    /// A write (or Write Zeroes) with Force Unit Access: durable before it completes.
    fua: bool,
}

impl DeviceSlot {
    const FREE: DeviceSlot = DeviceSlot {
        state: SlotState::Free,
        opcode: None,
        status: Status::SUCCESS,
        offset_bytes: 0,
        len_bytes: 0,
        buf_ptr: std::ptr::null_mut(),
        deadline_ns: 0,
        fua: false,
    };
}

/// One I/O submission/completion queue pair of an emulated controller.
pub struct EmuQueuePair {
    shared: Arc<Shared>,
    qid: u16,
    depth: usize,

    // Memory shared by host and controller, as in a real queue pair.
    sq: Box<[SubmissionEntry]>,
    cq: Box<[CompletionEntry]>,
    /// Dataset Management range lists, one per command id, pointed to by PRP1.
    dsm_ranges: Box<[DsmRange]>,
    /// Doorbell registers: written by the host, read by the controller.
    sq_tail_doorbell: u16,
    cq_head_doorbell: u16,

    // Host (driver) state.
    host_sq_tail: u16,
    /// SQ head as last reported in a completion entry.
    host_sq_head: u16,
    host_cq_head: u16,
    host_cq_phase: bool,
    tags: Box<[u64]>,
    in_use: Box<[bool]>,
    free_cids: Vec<u16>,
    outstanding: usize,

    // Controller state.
    dev_sq_head: u16,
    dev_cq_tail: u16,
    dev_cq_phase: bool,
    slots: Box<[DeviceSlot]>,
    /// (deadline, cid) of every pending command, earliest first; capacity = depth, never
    /// grows.
    pending: BinaryHeap<Reverse<(u64, u16)>>,
    /// When each of this queue pair's `parallel` internal units is next free (ns), earliest
    /// first; never grows. Per queue pair, so the submit path takes no lock, two reactors
    /// never bounce a cache line over it, and each queue pair's timing is deterministic
    /// whatever the others do.
    units_free_at_ns: BinaryHeap<Reverse<u64>>,
    model: LatencyModel,
    irq: Option<Arc<IrqLine>>,
    /// `Some(deadline)` while interrupts are armed; `u64::MAX` when armed with nothing
    /// pending. `irq.armed` mirrors `is_some()`.
    irq_armed_at_ns: Option<u64>,
    /// Resets of this queue pair, of either kind.
    resets: u64,
    /// Aborts asked for, and aborts that completed a command.
    aborts_requested: u64,
    aborts_done: u64,
    /// The controller's reset generation as this queue pair last saw it.
    reset_generation_seen: u64,
    /// The clock as this queue pair last read it (ns).
    last_clock_ns: u64,

    /// Queue pairs belong to one thread: `*const ()` makes this type neither Send nor Sync.
    _not_send: PhantomData<*const ()>,
}

impl EmuQueuePair {
    fn new(shared: Arc<Shared>, qid: u16, depth: usize, irq: Option<Arc<IrqLine>>) -> EmuQueuePair {
        // An NVMe ring of N entries holds at most N - 1 commands.
        let ring = depth + 1;
        let model = LatencyModel::new(&shared.cfg, u64::from(qid));
        let units_free_at_ns = (0..shared.cfg.parallel).map(|_| Reverse(0)).collect();
        let reset_generation_seen = shared.reset_generation.load(Ordering::SeqCst);
        EmuQueuePair {
            shared,
            qid,
            depth,
            sq: vec![SubmissionEntry::default(); ring].into_boxed_slice(),
            cq: vec![CompletionEntry::default(); ring].into_boxed_slice(),
            dsm_ranges: vec![DsmRange::default(); depth].into_boxed_slice(),
            sq_tail_doorbell: 0,
            cq_head_doorbell: 0,
            host_sq_tail: 0,
            host_sq_head: 0,
            host_cq_head: 0,
            // The completion ring starts zeroed, so the first valid phase is 1.
            host_cq_phase: true,
            tags: vec![0; depth].into_boxed_slice(),
            in_use: vec![false; depth].into_boxed_slice(),
            free_cids: (0..depth as u16).rev().collect(),
            outstanding: 0,
            dev_sq_head: 0,
            dev_cq_tail: 0,
            dev_cq_phase: true,
            slots: vec![DeviceSlot::FREE; depth].into_boxed_slice(),
            pending: BinaryHeap::with_capacity(depth),
            units_free_at_ns,
            model,
            irq,
            irq_armed_at_ns: None,
            resets: 0,
            aborts_requested: 0,
            aborts_done: 0,
            reset_generation_seen,
            last_clock_ns: 0,
            _not_send: PhantomData,
        }
    }

    fn ring_len(&self) -> u16 {
        self.sq.len() as u16
    }

    /// The ring slot after `index`: compare and wrap, no division on the I/O path.
    #[inline]
    fn ring_next(&self, index: u16) -> u16 {
        let next = index + 1;
        if next == self.ring_len() {
            0
        } else {
            next
        }
    }

    /// Reads the controller's clock and remembers the value.
    #[inline]
    fn read_clock_ns(&mut self) -> u64 {
        let now_ns = self.shared.clock.now_ns();
        self.last_clock_ns = now_ns;
        now_ns
    }

    /// Posts every command that is due. A command already due at the last clock reading is
    /// posted without reading the clock again; the clock is read whenever a command is still
    /// pending after that, so everything due by that reading is posted, as if it had been
    /// read first. On a zero-latency device this saves a clock read per poll.
    #[inline]
    fn post_due(&mut self) {
        let Some(&Reverse((earliest_ns, _))) = self.pending.peek() else {
            return;
        };
        if earliest_ns <= self.last_clock_ns {
            self.advance(self.last_clock_ns);
            if self.pending.is_empty() {
                return;
            }
        }
        let now_ns = self.read_clock_ns();
        self.advance(now_ns);
    }

    /// This queue pair's id on the controller (1-based, as NVMe I/O queues are).
    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// The true deadline of the outstanding command submitted with `tag`, if it is pending
    /// (for benchmarks' oracle; a real policy must never use it).
    pub fn oracle_deadline_ns_of(&self, tag: u64) -> Option<u64> {
        (0..self.depth)
            .find(|&cid| self.in_use[cid] && self.tags[cid] == tag)
            .map(|cid| self.slots[cid])
            .filter(|slot| slot.state == SlotState::Pending)
            .map(|slot| slot.deadline_ns)
    }

    /// Resets this queue pair alone, as deleting and recreating its queues would: every
    /// command outstanding on it, pending or lost, completes with "Command Aborted due to SQ
    /// Deletion", and its internal units are idle again. Returns how many were aborted.
    /// Their completion entries are visible to the next poll; an armed interrupt fires.
    /// [`EmuController::reset`] resets every queue pair of the controller.
    pub fn reset(&mut self) -> usize {
        self.resets += 1;
        self.pending.clear();
        // Aborted commands give their units back: the next command starts at once.
        // (Within the heap's capacity: nothing is allocated.)
        let units = self.units_free_at_ns.len();
        self.units_free_at_ns.clear();
        self.units_free_at_ns
            .extend(std::iter::repeat_n(Reverse(0), units));
        let mut aborted = 0;
        for cid in 0..self.depth {
            if self.slots[cid].state != SlotState::Free {
                self.slots[cid].state = SlotState::Free;
                self.post(cid as u16, Status::ABORTED_SQ_DELETION);
                aborted += 1;
            }
        }
        if aborted > 0 && self.irq_armed_at_ns.is_some() {
            // The abort entries are posted now: an armed interrupt fires at once.
            self.set_irq_deadline(1);
        }
        aborted
    }

    /// Carries out an Abort of the command submitted with `tag`, as the controller would on
    /// receiving NVMe's Abort admin command for this queue's id and that command's id: a
    /// command still inside the device (pending, or lost but not stuck) completes at once
    /// with "Command Abort Requested", without moving data; a stuck one ignores it; one
    /// already completed (or an unknown tag) is left alone. Returns whether it aborted one.
    /// The completion entry is visible to the next poll; an armed interrupt fires.
    pub fn abort_command(&mut self, tag: u64) -> bool {
        self.catch_up_with_controller_resets(Ordering::Relaxed);
        self.aborts_requested += 1;
        let Some(cid) = (0..self.depth).find(|&cid| self.in_use[cid] && self.tags[cid] == tag)
        else {
            return false;
        };
        match self.slots[cid].state {
            SlotState::Free | SlotState::Stuck => return false,
            SlotState::Pending => {
                // Within the heap's capacity: nothing is allocated.
                self.pending.retain(|&Reverse((_, c))| c as usize != cid);
            }
            SlotState::Lost => {}
        }
        self.slots[cid].state = SlotState::Free;
        self.post(cid as u16, Status::ABORT_REQUESTED);
        self.aborts_done += 1;
        if self.irq_armed_at_ns.is_some() {
            self.set_irq_deadline(1);
        }
        true
    }

    /// Aborts asked for on this queue pair, and how many of them aborted a command.
    pub fn aborts(&self) -> (u64, u64) {
        (self.aborts_requested, self.aborts_done)
    }

    /// Resets of this queue pair so far: its own, and controller resets it has carried out.
    pub fn resets(&self) -> u64 {
        self.resets
    }

    /// Carries out a controller reset this queue pair has not seen yet, if any: one relaxed
    /// load on the I/O path.
    #[inline]
    fn catch_up_with_controller_resets(&mut self, order: Ordering) {
        let generation = self.shared.reset_generation.load(order);
        if generation != self.reset_generation_seen {
            self.reset_generation_seen = generation;
            self.reset();
        }
    }

    // ---- controller side ----

    /// The controller's reaction to a submission-queue tail doorbell write: fetch every new
    /// entry.
    fn sq_doorbell(&mut self, now_ns: u64) {
        while self.dev_sq_head != self.sq_tail_doorbell {
            let sqe = self.sq[self.dev_sq_head as usize];
            self.dev_sq_head = self.ring_next(self.dev_sq_head);
            self.fetch(&sqe, now_ns);
        }
    }

    /// Validates one command, decides its fate and schedules its completion.
    fn fetch(&mut self, sqe: &SubmissionEntry, now_ns: u64) {
        let cid = sqe.cid as usize;
        assert!(
            cid < self.depth && self.slots[cid].state == SlotState::Free,
            "emulated controller: command id {cid} is not free (host bug)"
        );
        let ns = self.shared.ns;
        let lba_bytes = u64::from(ns.lba_size_bytes);
        let opcode = Opcode::from_u8(sqe.opcode);
        let mut slot = DeviceSlot {
            state: SlotState::Pending,
            opcode,
            status: Status::SUCCESS,
            offset_bytes: 0,
            len_bytes: 0,
            buf_ptr: sqe.prp1 as *mut u8,
            deadline_ns: now_ns,
            fua: matches!(opcode, Some(Opcode::Write | Opcode::WriteZeroes))
                && sqe.cdw12 & CDW12_FUA != 0,
        };
        let range = |slba: u64, count: u64| -> Result<(u64, u64), Status> {
            match slba.checked_add(count) {
                Some(end) if end <= ns.capacity_lbas => Ok((slba * lba_bytes, count * lba_bytes)),
                _ => Err(Status::LBA_OUT_OF_RANGE),
            }
        };
        let checked: Result<(u64, u64), Status> = if sqe.nsid != NSID {
            Err(Status::INVALID_NAMESPACE)
        } else {
            match opcode {
                None => Err(Status::INVALID_OPCODE),
                Some(Opcode::Flush) => Ok((0, 0)),
                Some(Opcode::Read | Opcode::Write) => {
                    range(sqe.slba(), u64::from(sqe.block_count())).and_then(|(off, len)| {
                        if len > u64::from(ns.transfer_bytes_max) {
                            Err(Status::INVALID_FIELD)
                        } else {
                            Ok((off, len))
                        }
                    })
                }
                Some(Opcode::WriteZeroes) => range(sqe.slba(), u64::from(sqe.block_count())),
                Some(Opcode::DatasetManagement) => {
                    if sqe.cdw10 & 0xff != 0 || sqe.cdw11 & DSM_ATTR_DEALLOCATE == 0 {
                        // One range, deallocate: all hypoll's host side ever sends.
                        Err(Status::INVALID_FIELD)
                    } else {
                        let own_range: *const DsmRange = &self.dsm_ranges[cid];
                        assert_eq!(
                            sqe.prp1, own_range as u64,
                            "emulated controller: a Dataset Management command's PRP1 must \
                             point at its queue pair's range list for command id {cid} \
                             (host bug)"
                        );
                        // SAFETY: PRP1 was just checked to be this queue pair's own
                        // `dsm_ranges` entry for this command id (written in `submit`): a
                        // live, aligned, initialised `DsmRange` owned by `self`.
                        let r = unsafe { std::ptr::read(own_range) };
                        range(r.slba, u64::from(r.nlb))
                    }
                }
            }
        };
        match checked {
            Err(status) => slot.status = status,
            Ok((offset, len)) => {
                slot.offset_bytes = offset;
                slot.len_bytes = len;
                let cfg = &self.shared.cfg;
                let (err_pct, lost_pct) = (cfg.err_pct, cfg.lost_pct);
                let opcode = opcode.expect("validated");
                if self.model.chance(lost_pct) {
                    slot.state = if self.model.chance(cfg.stuck_pct) {
                        SlotState::Stuck
                    } else {
                        SlotState::Lost
                    };
                } else if self.model.chance(err_pct) {
                    slot.status = match opcode {
                        Opcode::Read => Status::UNRECOVERED_READ_ERROR,
                        Opcode::Write | Opcode::WriteZeroes => Status::WRITE_FAULT,
                        _ => Status::INTERNAL_ERROR,
                    };
                }
                if slot.state == SlotState::Pending {
                    let class = match opcode {
                        Opcode::Read => LatencyClass::Read,
                        _ => LatencyClass::Write,
                    };
                    let moved = if matches!(opcode, Opcode::Read | Opcode::Write) {
                        len
                    } else {
                        0
                    };
                    let mut service_ns = self.model.sample_ns(class, moved);
                    let drift_pct = self.shared.cfg.drift_pct;
                    if drift_pct > 0.0 {
                        let age_s = now_ns.saturating_sub(self.shared.created_ns) as f64 / 1e9;
                        service_ns = (service_ns as f64 * (1.0 + drift_pct / 100.0 * age_s)) as u64;
                    }
                    slot.deadline_ns = self.start_on_a_unit(now_ns, service_ns);
                }
            }
        }
        self.slots[cid] = slot;
        if slot.state == SlotState::Pending {
            self.pending.push(Reverse((slot.deadline_ns, cid as u16)));
            if let Some(armed) = self.irq_armed_at_ns {
                if slot.deadline_ns < armed {
                    self.set_irq_deadline(slot.deadline_ns);
                }
            }
        }
        let reset_pct = self.shared.cfg.reset_pct;
        if self.model.chance(reset_pct) {
            // An injected fault resets the whole controller: this queue pair at once, the
            // others when their owners next touch them.
            self.reset_generation_seen = self.shared.reset_controller();
            self.reset();
        }
    }

    /// Takes the earliest free internal unit and returns when the command will be done.
    fn start_on_a_unit(&mut self, now_ns: u64, service_ns: u64) -> u64 {
        let mut earliest = self
            .units_free_at_ns
            .peek_mut()
            .expect("at least one unit (parallel >= 1)");
        let start_ns = earliest.0.max(now_ns);
        let done_ns = start_ns.saturating_add(service_ns);
        earliest.0 = done_ns;
        done_ns
    }

    /// Posts every command whose deadline has passed. Returns how many it posted.
    fn advance(&mut self, now_ns: u64) -> usize {
        let mut posted = 0;
        while let Some(&Reverse((deadline_ns, cid))) = self.pending.peek() {
            if deadline_ns > now_ns {
                break;
            }
            self.pending.pop();
            let slot = &mut self.slots[cid as usize];
            slot.state = SlotState::Free;
            let slot = *slot;
            let status = if slot.status.is_success() {
                self.execute(&slot)
            } else {
                slot.status
            };
            self.post(cid, status);
            posted += 1;
        }
        posted
    }

    /// Moves the data of a successful command, and makes a FUA write durable before it
    /// completes (on a file backing: `sync_data`); an I/O error of a file backing becomes
    /// Internal Error.
    fn execute(&self, slot: &DeviceSlot) -> Status {
        let store = &self.shared.store;
        let len = slot.len_bytes as usize;
        let result = match slot.opcode.expect("validated") {
            Opcode::Read => {
                // SAFETY: the host's submit contract keeps the buffer valid and unaliased
                // until this command's completion is reaped; `Command::check` verified it
                // holds at least `len` bytes (nlb * block size, checked against the range).
                let buf = unsafe { std::slice::from_raw_parts_mut(slot.buf_ptr, len) };
                store.read(slot.offset_bytes, buf)
            }
            Opcode::Write => {
                // SAFETY: as for Read; the device only reads a write's buffer.
                let buf = unsafe { std::slice::from_raw_parts(slot.buf_ptr, len) };
                store.write(slot.offset_bytes, buf)
            }
            Opcode::WriteZeroes => store.zero(slot.offset_bytes, slot.len_bytes, false),
            Opcode::DatasetManagement => store.zero(slot.offset_bytes, slot.len_bytes, true),
            Opcode::Flush => store.flush(),
        };
        let result = result.and_then(|()| if slot.fua { store.flush() } else { Ok(()) });
        match result {
            Ok(()) => Status::SUCCESS,
            Err(_) => Status::INTERNAL_ERROR,
        }
    }

    /// Writes one completion entry at the tail with the current phase.
    fn post(&mut self, cid: u16, status: Status) {
        let next_tail = self.ring_next(self.dev_cq_tail);
        assert!(
            next_tail != self.cq_head_doorbell,
            "emulated controller: completion queue overflow (qid {})",
            self.qid
        );
        self.cq[self.dev_cq_tail as usize] = CompletionEntry {
            dw0: 0,
            dw1: 0,
            sq_head: self.dev_sq_head,
            sq_id: self.qid,
            cid,
            status_phase: CompletionEntry::pack_status(status, self.dev_cq_phase),
        };
        self.dev_cq_tail = next_tail;
        if next_tail == 0 {
            self.dev_cq_phase = !self.dev_cq_phase;
        }
    }

    fn set_irq_deadline(&mut self, deadline_ns: u64) {
        if let Some(irq) = &self.irq {
            irq.timer
                .arm_at(deadline_ns)
                .expect("emulated controller: timerfd_settime on our own timer failed");
            self.irq_armed_at_ns = Some(deadline_ns);
        }
    }

    // ---- host side ----

    fn cq_entry_ready(&self) -> bool {
        self.cq[self.host_cq_head as usize].phase() == self.host_cq_phase
    }
}

impl QueuePair for EmuQueuePair {
    unsafe fn submit(&mut self, cmd: &Command<'_>, tag: u64) -> Result<(), SubmitError> {
        self.catch_up_with_controller_resets(Ordering::Relaxed);
        if self.outstanding == self.depth {
            return Err(SubmitError::QueueFull { depth: self.depth });
        }
        cmd.check(self.shared.ns.lba_size_bytes)?;
        // Free submission slots: (head - tail - 1) modulo the ring length, without a division.
        let (head, tail) = (self.host_sq_head, self.host_sq_tail);
        let sq_free = if head > tail {
            head - tail - 1
        } else {
            self.ring_len() - (tail - head) - 1
        };
        if sq_free == 0 {
            return Err(SubmitError::QueueFull { depth: self.depth });
        }
        let cid = self.free_cids.pop().expect("a free command id below depth");
        self.tags[cid as usize] = tag;
        self.in_use[cid as usize] = true;
        let mut sqe = SubmissionEntry {
            opcode: cmd.opcode() as u8,
            cid,
            nsid: NSID,
            prp1: cmd.buf_ptr() as u64,
            ..SubmissionEntry::default()
        };
        match cmd.opcode() {
            Opcode::Read | Opcode::Write | Opcode::WriteZeroes => {
                sqe.set_slba(cmd.slba());
                sqe.cdw12 = (cmd.nlb() - 1) | if cmd.fua() { CDW12_FUA } else { 0 };
            }
            Opcode::DatasetManagement => {
                self.dsm_ranges[cid as usize] = DsmRange {
                    context_attributes: 0,
                    nlb: cmd.nlb(),
                    slba: cmd.slba(),
                };
                sqe.prp1 = &self.dsm_ranges[cid as usize] as *const DsmRange as u64;
                sqe.cdw10 = 0; // one range (0-based)
                sqe.cdw11 = DSM_ATTR_DEALLOCATE;
            }
            Opcode::Flush => {}
        }
        self.sq[self.host_sq_tail as usize] = sqe;
        self.host_sq_tail = self.ring_next(self.host_sq_tail);
        self.outstanding += 1;
        // Ring the doorbell: the controller fetches at once.
        self.sq_tail_doorbell = self.host_sq_tail;
        let now_ns = self.read_clock_ns();
        self.sq_doorbell(now_ns);
        Ok(())
    }

    fn process_completions(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        // A controller reset's aborts are posted before anything is reaped.
        self.catch_up_with_controller_resets(Ordering::Relaxed);
        self.post_due();
        let mut reaped = 0;
        while reaped < max && self.cq_entry_ready() {
            let cqe = self.cq[self.host_cq_head as usize];
            let cid = cqe.cid as usize;
            assert!(
                cid < self.depth && self.in_use[cid],
                "emulated queue pair {}: completion for command id {cid}, which is not \
                 outstanding",
                self.qid
            );
            self.in_use[cid] = false;
            self.free_cids.push(cid as u16);
            self.host_sq_head = cqe.sq_head;
            self.outstanding -= 1;
            self.host_cq_head = self.ring_next(self.host_cq_head);
            if self.host_cq_head == 0 {
                self.host_cq_phase = !self.host_cq_phase;
            }
            reaped += 1;
            out(Completion {
                tag: self.tags[cid],
                status: cqe.status(),
            });
        }
        if reaped > 0 {
            self.cq_head_doorbell = self.host_cq_head;
            if self.irq_armed_at_ns.take().is_some() {
                if let Some(irq) = &self.irq {
                    irq.armed.store(false, Ordering::SeqCst);
                    irq.timer
                        .disarm()
                        .expect("emulated controller: timerfd_settime on our own timer failed");
                }
            }
        }
        reaped
    }

    fn interrupt_fd(&self) -> Option<BorrowedFd<'_>> {
        self.irq.as_ref().map(|irq| irq.timer.as_fd())
    }

    fn arm_interrupt(&mut self) {
        let Some(irq) = &self.irq else {
            return;
        };
        // Announce the armed state before looking for a controller reset (both SeqCst, as in
        // `reset_controller`): a reset this misses is one that sees the line armed and fires
        // it.
        irq.armed.store(true, Ordering::SeqCst);
        self.catch_up_with_controller_resets(Ordering::SeqCst);
        // Every arm programs the timer, even at an unchanged deadline: that also clears an
        // expiry a controller reset on another thread may have left after this queue pair
        // disarmed (see `reset_controller`), so such a race costs one spurious wake-up at
        // most, never a fd that stays readable.
        let deadline_ns = if self.cq_entry_ready() {
            // A completion is already waiting: interrupt at once.
            1
        } else {
            match self.pending.peek() {
                Some(&Reverse((deadline_ns, _))) => deadline_ns,
                None => {
                    // Nothing pending (only lost commands, or nothing at all): stay armed
                    // with the timer stopped; the next submission sets the deadline.
                    if let Some(irq) = &self.irq {
                        irq.timer
                            .disarm()
                            .expect("emulated controller: timerfd_settime on our own timer failed");
                    }
                    self.irq_armed_at_ns = Some(u64::MAX);
                    return;
                }
            }
        };
        self.set_irq_deadline(deadline_ns);
    }

    fn outstanding(&self) -> usize {
        self.outstanding
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn namespace(&self) -> NamespaceInfo {
        self.shared.ns
    }

    fn oracle_next_deadline_ns(&self) -> Option<u64> {
        self.pending
            .peek()
            .map(|&Reverse((deadline_ns, _))| deadline_ns)
    }

    /// See [`EmuQueuePair::abort_command`]: synchronous, so an aborted command's completion
    /// is reaped by the next poll.
    fn abort(&mut self, tag: u64) -> Result<(), RecoveryError> {
        self.abort_command(tag);
        Ok(())
    }

    /// See [`EmuQueuePair::reset`]: every outstanding command's completion is posted at once.
    fn reset(&mut self) -> Result<(), RecoveryError> {
        self.catch_up_with_controller_resets(Ordering::Relaxed);
        EmuQueuePair::reset(self);
        Ok(())
    }
}

/// Dropping a queue pair deletes its queues: the controller works only when the host
/// touches the queue pair, and all of its state (rings, pending commands and their buffer
/// pointers) lives inside it, so after `drop` the device touches no buffer, as
/// [`QueuePair`]'s implementor rule requires. Commands still outstanding are discarded.
impl Drop for EmuQueuePair {
    fn drop(&mut self) {
        if let Some(irq) = &self.irq {
            self.shared
                .irq_lines
                .lock()
                .retain(|line| !Arc::ptr_eq(line, irq));
        }
        self.shared.queues_live.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests;
