//! Reads and writes the reactor makes itself (`inline=`): the data moves inside `submit`,
//! by `preadv2`/`pwritev2` on the queue pair's file, and the completion waits in the local
//! queue for the next poll, as an out-of-range command's does. The rest of the queue pair
//! (slots, rings, aborts) never sees them: no slot is taken, nothing is pushed on a ring,
//! and a later abort finds nothing to cancel.

use std::os::fd::AsRawFd;

use super::super::command::status_for;
use super::super::sys;
use super::UringQueuePair;
use crate::qpair::{Command, Segment, SEGMENTS_MAX};
use crate::spec::{Opcode, Status};

impl UringQueuePair {
    /// Carries out a Read or a Write of `len_bytes` (checked against the namespace and the
    /// transfer limit by the caller) in this thread and returns its status.
    pub(super) fn transfer_inline(&mut self, cmd: &Command<'_>, len_bytes: u64) -> Status {
        let write = match cmd.opcode() {
            Opcode::Read => false,
            Opcode::Write => true,
            other => unreachable!("only reads and writes move data, not {other:?}"),
        };
        let mut iov = [Segment::EMPTY.to_iovec(); SEGMENTS_MAX];
        let count = match cmd.segments() {
            Some(segs) => {
                // `check` bounded the count by SEGMENTS_MAX.
                for (v, s) in iov.iter_mut().zip(segs) {
                    *v = s.to_iovec();
                }
                segs.len()
            }
            None => {
                iov[0] = libc::iovec {
                    iov_base: cmd.buf_ptr().cast(),
                    iov_len: len_bytes as usize,
                };
                1
            }
        };
        let flags = if write && cmd.fua() {
            libc::RWF_DSYNC
        } else {
            0
        };
        let offset_bytes = cmd.slba() * u64::from(self.ns.lba_size_bytes);
        // SAFETY: the caller of `submit` keeps the command's buffers valid until its
        // completion is reaped (QueuePair::submit's contract), which is after this call; the
        // transfer limit (1 MiB) keeps the length far below i32::MAX.
        let result = unsafe {
            sys::transfer_inline(
                self.file.as_raw_fd(),
                write,
                &iov[..count],
                offset_bytes,
                flags,
            )
        };
        status_for(result, cmd.opcode(), len_bytes)
    }
}
