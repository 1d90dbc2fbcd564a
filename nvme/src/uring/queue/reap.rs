//! Reaping a `uring` queue pair's rings: completions taken from the completion queue in
//! batches, each matched to its slot (an abort's or a waker's poll's own completion aside,
//! a Write Zeroes with a next step kept in flight), and the drop that waits for every
//! command the kernel still holds.

use super::{
    status_of, transient, Completion, CompletionMode, InFlight, Opcode, UringQueuePair, WakePoll,
    Zeroing, CANCEL_USER_DATA, WAKE_USER_DATA,
};

/// Completions taken from a ring at a time, into a buffer on the stack.
const REAP_BATCH: usize = 32;

impl UringQueuePair {
    /// Reaps up to `max` completions from one ring (the side ring if `side`).
    /// One look at the completion queue per batch: a batch that comes back short emptied it,
    /// and the poll ends there without another look.
    pub(super) fn reap(
        &mut self,
        side: bool,
        max: usize,
        out: &mut dyn FnMut(Completion),
    ) -> usize {
        let mut done = 0;
        let mut batch = [(0u64, 0i32); REAP_BATCH];
        while done < max {
            let want = (max - done).min(REAP_BATCH);
            let mut n = 0;
            for cqe in self.ring_of(side).completion().take(want) {
                batch[n] = (cqe.user_data(), cqe.result());
                n += 1;
            }
            for &(user_data, result) in &batch[..n] {
                done += self.take_cqe(user_data, result, side, out);
            }
            if n < want {
                break;
            }
        }
        done
    }

    /// Accounts for one completion of a ring; returns 1 if it completed a command.
    fn take_cqe(
        &mut self,
        user_data: u64,
        result: i32,
        side: bool,
        out: &mut dyn FnMut(Completion),
    ) -> usize {
        if user_data == CANCEL_USER_DATA {
            // An abort's own completion; the aborted command completes by itself.
            match (&mut self.side, side) {
                (Some(s), true) => s.cancels_in_kernel -= 1,
                _ => self.cancels_in_kernel -= 1,
            }
            return 0;
        }
        if user_data == WAKE_USER_DATA {
            // The waker's eventfd was signalled: it is cleared before the poll is armed again.
            self.wake_poll = WakePoll::Fired;
            return 0;
        }
        let slot = user_data as u32;
        let mut flight = self.slots[slot as usize]
            .take()
            .unwrap_or_else(|| panic!("io_uring completion for idle slot {slot}"));
        let next = match (flight.opcode, flight.zeroing, result) {
            // The file system has no zero-range (tmpfs): punching a hole zeroes too.
            (Opcode::WriteZeroes, Zeroing::ZeroRange, r) if r == -libc::EOPNOTSUPP => {
                self.zero_range_unsupported = true;
                Some(Zeroing::PunchHole)
            }
            // Zeroed by deallocating: allocate again unless deallocation was allowed.
            (Opcode::WriteZeroes, Zeroing::PunchHole, 0) if !flight.may_deallocate => {
                Some(Zeroing::Allocate)
            }
            _ => None,
        };
        if let Some(next) = next {
            flight.zeroing = next;
            self.slots[slot as usize] = Some(flight);
            self.retry_zeroes.push(slot);
            return 0;
        }
        self.in_kernel -= 1;
        if flight.side {
            if let Some(s) = &mut self.side {
                s.in_kernel -= 1;
            }
        }
        self.free_slots.push(slot);
        if !self.regions.is_empty() {
            self.regions.release(slot as usize);
        }
        if result == -libc::EOPNOTSUPP && !flight.side && self.mode != CompletionMode::Interrupt {
            self.polled_refusal(&flight);
        }
        out(Completion {
            tag: flight.tag,
            status: status_of(result, &flight),
        });
        1
    }

    /// Counts a read or write the kernel refused to poll, and says why once: it completes
    /// with Invalid Command Opcode, which names no cause.
    fn polled_refusal(&mut self, flight: &InFlight) {
        self.polled_refusals += 1;
        if self.polled_refusals == 1 {
            tracing::error!(
                offset_bytes = flight.offset_bytes,
                "the kernel refused a polled {:?} (EOPNOTSUPP): the disk under this file \
                 cannot poll, so it and every like it complete with Invalid Command Opcode; \
                 open the device with iopoll=auto or iopoll=off",
                flight.opcode
            );
        }
    }
}

impl Drop for UringQueuePair {
    /// Waits for every command the kernel holds: their buffers belong to the caller and
    /// must not be written after the queue pair is gone. Block I/O always completes (the
    /// kernel's own timeouts fail it), so this ends.
    fn drop(&mut self) {
        loop {
            // Write Zeroes waiting to be resubmitted are not in the kernel: nothing to wait
            // for (a completion reaped below may add one).
            for slot in std::mem::take(&mut self.retry_zeroes) {
                let flight = self.slots[slot as usize].take();
                self.in_kernel -= 1;
                if let Some(side) = self
                    .side
                    .as_mut()
                    .filter(|_| flight.is_some_and(|f| f.side))
                {
                    side.in_kernel -= 1;
                }
            }
            if self.in_kernel_total() == 0 {
                return;
            }
            // Each ring is waited on for its own commands: the main ring's first.
            let on_main = self.main_in_kernel() + self.cancels_in_kernel > 0;
            match self.ring_of(!on_main).submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if transient(&e) => {}
                Err(e) => {
                    tracing::error!(
                        "io_uring queue pair cannot wait for its {} commands ({e}); \
                         aborting rather than let the kernel write freed memory",
                        self.in_kernel
                    );
                    std::process::abort();
                }
            }
            self.reap(false, usize::MAX, &mut |_| {});
            if self.side.is_some() {
                self.reap(true, usize::MAX, &mut |_| {});
            }
        }
    }
}
