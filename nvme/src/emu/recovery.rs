//! Aborts and resets of an emulated queue pair: NVMe Abort of one command, a reset of the
//! queue pair alone, and catching up with a controller reset made on another thread.

use std::cmp::Reverse;
use std::sync::atomic::Ordering;

use super::engine::SlotState;
use super::EmuQueuePair;
use crate::spec::Status;

impl EmuQueuePair {
    /// Resets this queue pair alone, as deleting and recreating its queues would: every
    /// command outstanding on it, pending or lost, completes with "Command Aborted due to SQ
    /// Deletion", and its internal units are idle again. Returns how many were aborted.
    /// Their completion entries are visible to the next poll; an armed interrupt fires.
    /// [`EmuController::reset`](super::EmuController::reset) resets every queue pair of the
    /// controller.
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
    pub(super) fn catch_up_with_controller_resets(&mut self, order: Ordering) {
        let generation = self.shared.reset_generation.load(order);
        if generation != self.reset_generation_seen {
            self.reset_generation_seen = generation;
            self.reset();
        }
    }
}
