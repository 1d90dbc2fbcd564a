//! The emulated controller's side of a queue pair: it fetches each command when the host
//! rings the submission doorbell, checks it, decides its fate (latency, error, loss) and
//! its deadline on one of the queue pair's internal units, and when the host next polls
//! after that deadline moves the data and posts the completion entry (a zeroing command
//! in bounded steps over as many polls as it needs: see `zeroing`).

use std::cmp::Reverse;

use super::latency::LatencyClass;
use super::zeroing::{zero_steps, ZEROED_BYTES_PER_POLL_MAX};
use super::{EmuQueuePair, NSID};
use crate::qpair::{Segment, SEGMENTS_MAX};
use crate::spec::{
    CompletionEntry, DsmRange, Opcode, Status, SubmissionEntry, CDW12_FUA, DSM_ATTR_DEALLOCATE,
};

/// CDW0's PSDT field (bits 15:14, so bits 7:6 of the flags byte) saying the data pointer is
/// an SGL: how the host hands this controller a vectored command's segment list (PRP1 its
/// address, PRP2 its length in segments).
pub(super) const FLAGS_PSDT_SGL: u8 = 0x40;

/// Where a command is inside the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotState {
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
pub(super) struct DeviceSlot {
    pub(super) state: SlotState,
    pub(super) opcode: Option<Opcode>,
    pub(super) status: Status,
    pub(super) offset_bytes: u64,
    pub(super) len_bytes: u64,
    pub(super) buf_ptr: *mut u8,
    /// A vectored command's segment count (its list is the queue pair's `seg_lists` for
    /// this command id); 0 when `buf_ptr` is the one buffer.
    pub(super) segs: u16,
    pub(super) deadline_ns: u64,
    /// A write (or Write Zeroes) with Force Unit Access: durable before it completes.
    pub(super) fua: bool,
    /// Bytes of a Write Zeroes or Deallocate zeroed so far: it completes at `len_bytes`.
    pub(super) done_bytes: u64,
}

impl DeviceSlot {
    pub(super) const FREE: DeviceSlot = DeviceSlot {
        state: SlotState::Free,
        opcode: None,
        status: Status::SUCCESS,
        offset_bytes: 0,
        len_bytes: 0,
        buf_ptr: std::ptr::null_mut(),
        segs: 0,
        deadline_ns: 0,
        fua: false,
        done_bytes: 0,
    };
}

impl EmuQueuePair {
    /// Posts every command that is due, but for zeroing commands this poll's budget does
    /// not finish. A command already due at the last clock reading is posted without
    /// reading the clock again; the clock is read whenever a command is still pending after
    /// that, so everything due by that reading is posted, as if it had been read first. On a
    /// zero-latency device this saves a clock read per poll.
    #[inline]
    pub(super) fn post_due(&mut self) {
        let Some(&Reverse((earliest_ns, _))) = self.pending.peek() else {
            return;
        };
        // One budget for the whole poll, however many times it advances.
        let mut zero_budget_bytes = ZEROED_BYTES_PER_POLL_MAX;
        if earliest_ns <= self.last_clock_ns {
            self.advance(self.last_clock_ns, &mut zero_budget_bytes);
            if self.pending.is_empty() {
                return;
            }
        }
        let now_ns = self.read_clock_ns();
        self.advance(now_ns, &mut zero_budget_bytes);
    }

    /// The controller's reaction to a submission-queue tail doorbell write: fetch every new
    /// entry.
    pub(super) fn sq_doorbell(&mut self, now_ns: u64) {
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
            segs: 0,
            deadline_ns: now_ns,
            fua: matches!(opcode, Some(Opcode::Write | Opcode::WriteZeroes))
                && sqe.cdw12 & CDW12_FUA != 0,
            done_bytes: 0,
        };
        if sqe.flags & FLAGS_PSDT_SGL != 0 {
            let own_list = self.seg_lists[cid * SEGMENTS_MAX..].as_ptr();
            assert!(
                sqe.prp1 == own_list as u64 && (1..=SEGMENTS_MAX as u64).contains(&sqe.prp2),
                "emulated controller: an SGL must be its queue pair's segment list for \
                 command id {cid}, of 1 to {SEGMENTS_MAX} segments (host bug)"
            );
            slot.segs = sqe.prp2 as u16;
            slot.buf_ptr = std::ptr::null_mut();
        }
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

    /// Posts every command whose deadline has passed, but for zeroing commands that
    /// `zero_budget_bytes` (this poll's, shared by its calls) does not finish: those stay
    /// due, with their deadlines. Returns how many it posted.
    pub(super) fn advance(&mut self, now_ns: u64, zero_budget_bytes: &mut u64) -> usize {
        assert!(self.unfinished.is_empty());
        let mut posted = 0;
        while let Some(&Reverse((deadline_ns, cid))) = self.pending.peek() {
            if deadline_ns > now_ns {
                break;
            }
            self.pending.pop();
            let c = usize::from(cid);
            let status = if self.slots[c].status.is_success() {
                match self.execute(c, zero_budget_bytes) {
                    Some(status) => status,
                    None => {
                        // Within its capacity (depth): nothing is allocated.
                        self.unfinished.push((deadline_ns, cid));
                        continue;
                    }
                }
            } else {
                self.slots[c].status
            };
            self.slots[c].state = SlotState::Free;
            self.post(cid, status);
            posted += 1;
        }
        // Back in the heap they came from (within its capacity), still due.
        while let Some(entry) = self.unfinished.pop() {
            self.pending.push(Reverse(entry));
        }
        posted
    }

    /// Moves the data of a successful command, and makes a FUA write durable before it
    /// completes (on a file backing: `sync_data`); an I/O error of a file backing becomes
    /// Internal Error. `None`: a zeroing command that `zero_budget_bytes` did not finish.
    fn execute(&mut self, cid: usize, zero_budget_bytes: &mut u64) -> Option<Status> {
        let slot = self.slots[cid];
        let opcode = slot.opcode.expect("validated");
        let result = if let Opcode::WriteZeroes | Opcode::DatasetManagement = opcode {
            let deallocate = opcode == Opcode::DatasetManagement;
            let progress = &mut self.slots[cid];
            let stepped = zero_steps(&self.shared.store, progress, deallocate, zero_budget_bytes);
            self.zeroed_bytes += progress.done_bytes - slot.done_bytes;
            match stepped {
                Ok(false) => return None,
                Ok(true) => Ok(()),
                Err(e) => Err(e),
            }
        } else if slot.segs > 0 {
            let segs = &self.seg_lists[cid * SEGMENTS_MAX..][..usize::from(slot.segs)];
            debug_assert_eq!(
                segs.iter().map(|s| s.len_bytes() as u64).sum::<u64>(),
                slot.len_bytes,
                "the host checked that the segments hold the command's length"
            );
            self.execute_vectored(opcode, slot.offset_bytes, segs)
        } else {
            self.execute_one(opcode, &slot)
        };
        let store = &self.shared.store;
        let result = result.and_then(|()| if slot.fua { store.flush() } else { Ok(()) });
        Some(match result {
            Ok(()) => Status::SUCCESS,
            Err(_) => Status::INTERNAL_ERROR,
        })
    }

    /// Moves a vectored command's data segment by segment, each at its own byte offset in
    /// the namespace: a segment boundary may fall inside a block.
    fn execute_vectored(
        &self,
        opcode: Opcode,
        offset_bytes: u64,
        segs: &[Segment],
    ) -> std::io::Result<()> {
        let store = &self.shared.store;
        let mut at = offset_bytes;
        for seg in segs {
            let n = seg.len_bytes();
            match opcode {
                Opcode::Read => {
                    // SAFETY: the host's submit contract keeps every segment valid and
                    // unaliased until this command's completion is reaped; `Command::check`
                    // verified the segments hold exactly the command's length.
                    let buf = unsafe { std::slice::from_raw_parts_mut(seg.ptr(), n) };
                    store.read(at, buf)?;
                }
                Opcode::Write => {
                    // SAFETY: as for Read; the device only reads a write's segments.
                    let buf = unsafe { std::slice::from_raw_parts(seg.ptr().cast_const(), n) };
                    store.write(at, buf)?;
                }
                _ => unreachable!("only reads and writes carry segments"),
            }
            at += n as u64;
        }
        Ok(())
    }

    fn execute_one(&self, opcode: Opcode, slot: &DeviceSlot) -> std::io::Result<()> {
        let store = &self.shared.store;
        let len = slot.len_bytes as usize;
        match opcode {
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
            Opcode::WriteZeroes | Opcode::DatasetManagement => {
                unreachable!("zeroing commands go through zero_steps")
            }
            Opcode::Flush => store.flush(),
        }
    }

    /// Writes one completion entry at the tail with the current phase.
    pub(super) fn post(&mut self, cid: u16, status: Status) {
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

    pub(super) fn set_irq_deadline(&mut self, deadline_ns: u64) {
        if let Some(irq) = &self.irq {
            irq.timer
                .arm_at(deadline_ns)
                .expect("emulated controller: timerfd_settime on our own timer failed");
            self.irq_armed_at_ns = Some(deadline_ns);
        }
    }
}
