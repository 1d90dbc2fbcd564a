//! Write Zeroes and Deallocate, carried out in bounded steps.
//!
//! Reads and writes are bounded by MDTS (at most 2 MiB a command). Nothing bounds a zeroing
//! command that way: no data crosses the queue, Write Zeroes names up to 65536 blocks (256
//! MiB of 4 KiB blocks) and a Deallocate range up to 2^32 blocks. The controller has no
//! thread of its own, so whatever it does runs on the thread that polls the queue pair, the
//! reactor's; zeroing a whole command at once would stall everything else on that reactor
//! for as long as the backing takes to zero it all, which on a file grows with the range.
//!
//! So a zeroing command whose deadline has passed is carried out in steps, at most
//! [`ZEROED_BYTES_PER_POLL_MAX`] a poll of its queue pair, all such commands together. No
//! step crosses a chunk boundary of the namespace ([`CHUNK_BYTES`]-aligned), so a memory
//! store still frees whole chunks a Deallocate covers. A command that is not finished stays
//! due, first in line at the next poll, while the commands due behind it are posted as
//! usual, not held behind it; it completes, once, after its last step (and, with FUA, after
//! the sync). A zeroing command of N MiB thus takes N polls; a poll that only took a step
//! returns no completion. An Abort or a reset may catch it part done, as on a drive: the
//! blocks it covers are then each either zeroed or as they were.

use super::engine::DeviceSlot;
use super::store::{Store, CHUNK_BYTES};

/// The most one poll of a queue pair zeroes for its Write Zeroes and Deallocate commands:
/// one store chunk, no more than the largest read or write (MDTS up to 2 MiB) moves.
pub const ZEROED_BYTES_PER_POLL_MAX: u64 = CHUNK_BYTES;

/// Takes the steps of `slot` (a due Write Zeroes or Deallocate) that `budget_bytes` allows,
/// each within one chunk, and takes what they zeroed from it. Returns whether the command is
/// finished, having zeroed its whole range.
pub(super) fn zero_steps(
    store: &Store,
    slot: &mut DeviceSlot,
    deallocate: bool,
    budget_bytes: &mut u64,
) -> std::io::Result<bool> {
    assert!(slot.done_bytes <= slot.len_bytes && *budget_bytes <= ZEROED_BYTES_PER_POLL_MAX);
    loop {
        let at = slot.offset_bytes + slot.done_bytes;
        let left = slot.len_bytes - slot.done_bytes;
        if left == 0 {
            return Ok(true);
        }
        let step = left.min(CHUNK_BYTES - at % CHUNK_BYTES);
        if step > *budget_bytes {
            // The poll's budget is spent: the next poll starts with a whole chunk's worth,
            // enough for any one step.
            return Ok(false);
        }
        store.zero(at, step, deallocate)?;
        slot.done_bytes += step;
        *budget_bytes -= step;
    }
}

#[cfg(test)]
mod tests;
