//! One I/O queue pair of the emulated controller, as its host (driver) side sees it: the
//! rings in memory shared with the controller, command ids and tags, submission and reaping,
//! and the interrupt. What the controller does with a command once the doorbell rings is in
//! `engine`; aborts and resets in `recovery`.

use std::any::Any;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::marker::PhantomData;
use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::engine::FLAGS_PSDT_SGL;
use super::engine::{DeviceSlot, SlotState};
use super::latency::LatencyModel;
use super::{IrqLine, Shared, NSID};
use crate::qpair::{
    Command, Completion, QueuePair, RecoveryError, Segment, SubmitError, SEGMENTS_MAX,
};
use crate::region::{MemoryRegion, RegionTable, RegisterError, UnregisterError};
use crate::spec::{
    CompletionEntry, DsmRange, NamespaceInfo, Opcode, SubmissionEntry, CDW12_FUA,
    DSM_ATTR_DEALLOCATE,
};

/// One I/O submission/completion queue pair of an emulated controller.
pub struct EmuQueuePair {
    pub(super) shared: Arc<Shared>,
    pub(super) qid: u16,
    pub(super) depth: usize,

    // Memory shared by host and controller, as in a real queue pair.
    pub(super) sq: Box<[SubmissionEntry]>,
    pub(super) cq: Box<[CompletionEntry]>,
    /// Dataset Management range lists, one per command id, pointed to by PRP1.
    pub(super) dsm_ranges: Box<[DsmRange]>,
    /// Segment lists of vectored commands, [`SEGMENTS_MAX`] per command id, pointed to by
    /// PRP1 (an SGL in NVMe terms): the host copies a command's segments here, so the
    /// caller's list need not outlive `submit`.
    pub(super) seg_lists: Box<[Segment]>,
    /// Doorbell registers: written by the host, read by the controller.
    pub(super) sq_tail_doorbell: u16,
    pub(super) cq_head_doorbell: u16,

    // Host (driver) state.
    pub(super) host_sq_tail: u16,
    /// SQ head as last reported in a completion entry.
    pub(super) host_sq_head: u16,
    pub(super) host_cq_head: u16,
    pub(super) host_cq_phase: bool,
    pub(super) tags: Box<[u64]>,
    pub(super) in_use: Box<[bool]>,
    pub(super) free_cids: Vec<u16>,
    pub(super) outstanding: usize,

    // Controller state.
    pub(super) dev_sq_head: u16,
    pub(super) dev_cq_tail: u16,
    pub(super) dev_cq_phase: bool,
    pub(super) slots: Box<[DeviceSlot]>,
    /// (deadline, cid) of every pending command, earliest first; capacity = depth, never
    /// grows.
    pub(super) pending: BinaryHeap<Reverse<(u64, u16)>>,
    /// (deadline, cid) of the due zeroing commands a poll has not finished, set aside while
    /// it posts the others (see `zeroing`); empty between polls. Capacity = depth, never
    /// grows.
    pub(super) unfinished: Vec<(u64, u16)>,
    /// Bytes this queue pair's Write Zeroes and Deallocate commands have zeroed so far.
    pub(super) zeroed_bytes: u64,
    /// When each of this queue pair's `parallel` internal units is next free (ns), earliest
    /// first; never grows. Per queue pair, so the submit path takes no lock, two reactors
    /// never bounce a cache line over it, and each queue pair's timing is deterministic
    /// whatever the others do.
    pub(super) units_free_at_ns: BinaryHeap<Reverse<u64>>,
    pub(super) model: LatencyModel,
    pub(super) irq: Option<Arc<IrqLine>>,
    /// `Some(deadline)` while interrupts are armed; `u64::MAX` when armed with nothing
    /// pending. `irq.armed` mirrors `is_some()`.
    pub(super) irq_armed_at_ns: Option<u64>,
    /// Resets of this queue pair, of either kind.
    pub(super) resets: u64,
    /// Aborts asked for, and aborts that completed a command.
    pub(super) aborts_requested: u64,
    pub(super) aborts_done: u64,
    /// The controller's reset generation as this queue pair last saw it.
    pub(super) reset_generation_seen: u64,
    /// The clock as this queue pair last read it (ns).
    pub(super) last_clock_ns: u64,
    /// Memory the application registered, and which of it each command id uses. The
    /// emulated controller reads and writes host memory directly, so registering maps
    /// nothing: it keeps the bookkeeping that refuses unregistering memory in use.
    pub(super) regions: RegionTable,

    /// Queue pairs belong to one thread: `*const ()` makes this type neither Send nor Sync.
    pub(super) _not_send: PhantomData<*const ()>,
}

impl EmuQueuePair {
    pub(super) fn new(
        shared: Arc<Shared>,
        qid: u16,
        depth: usize,
        irq: Option<Arc<IrqLine>>,
    ) -> EmuQueuePair {
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
            seg_lists: vec![Segment::EMPTY; depth * SEGMENTS_MAX].into_boxed_slice(),
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
            unfinished: Vec::with_capacity(depth),
            zeroed_bytes: 0,
            units_free_at_ns,
            model,
            irq,
            irq_armed_at_ns: None,
            resets: 0,
            aborts_requested: 0,
            aborts_done: 0,
            regions: RegionTable::new(depth),
            reset_generation_seen,
            last_clock_ns: 0,
            _not_send: PhantomData,
        }
    }

    pub(super) fn ring_len(&self) -> u16 {
        self.sq.len() as u16
    }

    /// The ring slot after `index`: compare and wrap, no division on the I/O path.
    #[inline]
    pub(super) fn ring_next(&self, index: u16) -> u16 {
        let next = index + 1;
        if next == self.ring_len() {
            0
        } else {
            next
        }
    }

    /// Reads the controller's clock and remembers the value.
    #[inline]
    pub(super) fn read_clock_ns(&mut self) -> u64 {
        let now_ns = self.shared.clock.now_ns();
        self.last_clock_ns = now_ns;
        now_ns
    }

    /// Bytes this queue pair's Write Zeroes and Deallocate commands have zeroed so far, in
    /// steps of at most [`ZEROED_BYTES_PER_POLL_MAX`](super::ZEROED_BYTES_PER_POLL_MAX) a
    /// poll.
    pub fn zeroed_bytes(&self) -> u64 {
        self.zeroed_bytes
    }

    /// This queue pair's id on the controller (1-based, as NVMe I/O queues are).
    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// The emulated queue pair behind `qp`, if that is what it is: how benchmark-only
    /// knowledge (the deadlines below) is reached from a `dyn QueuePair` without the trait
    /// carrying it for every device.
    pub fn downcast<'q>(qp: &'q (dyn QueuePair + 'static)) -> Option<&'q EmuQueuePair> {
        (qp as &dyn Any).downcast_ref()
    }

    /// The true completion deadline (ns on the controller's clock) of the outstanding
    /// command that will complete first. For benchmarks' `oracle` policy, which marks the
    /// physical limit of sleeping, and for waiting in virtual time; no real device can tell
    /// it, so it is the emulator's own, not [`QueuePair`]'s, and a real policy must never
    /// use it.
    pub fn oracle_next_deadline_ns(&self) -> Option<u64> {
        self.pending
            .peek()
            .map(|&Reverse((deadline_ns, _))| deadline_ns)
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

    /// Whether the completion entry at the host's head is new: its phase tag is the one the
    /// host expects.
    pub(super) fn cq_entry_ready(&self) -> bool {
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
        let regions =
            if self.regions.is_empty() || !matches!(cmd.opcode(), Opcode::Read | Opcode::Write) {
                0
            } else {
                let data_bytes = cmd.nlb() as usize * self.shared.ns.lba_size_bytes as usize;
                self.regions.command_mask(cmd, data_bytes)?
            };
        let cid = self.free_cids.pop().expect("a free command id below depth");
        if regions != 0 {
            self.regions.charge(usize::from(cid), regions);
        }
        self.tags[cid as usize] = tag;
        self.in_use[cid as usize] = true;
        let mut sqe = SubmissionEntry {
            opcode: cmd.opcode() as u8,
            cid,
            nsid: NSID,
            prp1: cmd.buf_ptr() as u64,
            ..SubmissionEntry::default()
        };
        if let Some(segs) = cmd.segments() {
            // `check` bounded the count by SEGMENTS_MAX.
            let list = &mut self.seg_lists[cid as usize * SEGMENTS_MAX..][..segs.len()];
            list.copy_from_slice(segs);
            sqe.flags = FLAGS_PSDT_SGL;
            sqe.prp1 = list.as_ptr() as u64;
            sqe.prp2 = segs.len() as u64;
        }
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
        // Nothing registered, nothing charged: one test per poll, not per completion.
        let charged = !self.regions.is_empty();
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
            if charged {
                self.regions.release(cid);
            }
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

    /// Bookkeeping only: the emulated controller copies to and from host memory at the
    /// moment a command completes, wherever that memory lies.
    unsafe fn register_memory(
        &mut self,
        ptr: *mut u8,
        len_bytes: usize,
    ) -> Result<MemoryRegion, RegisterError> {
        self.regions.add(ptr, len_bytes)
    }

    fn unregister_memory(&mut self, region: MemoryRegion) -> Result<(), UnregisterError> {
        self.regions.unregister(&region)
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
