//! Reads and writes the reactor makes itself (`inline=`): the data moves inside `submit`,
//! by `pread`/`pwrite` (one buffer, no flags) or `preadv2`/`pwritev2` on the queue pair's
//! file, and the completion waits in the local queue for the next poll, as an out-of-range
//! command's does. The command holds a slot until then, for its iovecs during the call and
//! for the registered regions it uses (charged to the slot, so that they cannot be
//! unregistered before its completion is delivered, as for a command in the kernel).
//! Nothing is pushed on a ring, and a later abort finds nothing to cancel. Where
//! `atime=coarse` applies, reads go through the file's second descriptor, which skips the
//! access time, but once a minute (`atime.rs`).

use std::os::fd::AsRawFd;

use super::super::command::status_for;
use super::super::{sys, URING_TRANSFER_BYTES_MAX};
use super::UringQueuePair;
use crate::qpair::{Command, Completion, SEGMENTS_MAX};
use crate::spec::Opcode;

impl UringQueuePair {
    /// Carries out a Read or Write of `len_bytes` (checked against the namespace and the
    /// transfer limit by the caller, as `regions`, the regions its memory lies in) in this
    /// thread, and queues its completion.
    pub(super) fn submit_inline(
        &mut self,
        cmd: &Command<'_>,
        tag: u64,
        len_bytes: u64,
        regions: u64,
    ) {
        debug_assert!(len_bytes <= u64::from(URING_TRANSFER_BYTES_MAX));
        let write = match cmd.opcode() {
            Opcode::Read => false,
            Opcode::Write => true,
            other => unreachable!("only reads and writes move data, not {other:?}"),
        };
        // The file: the second descriptor for a read that skips the access-time check.
        let fd = match (self.skips_atime(cmd.opcode()), &self.atime) {
            (true, Some(keeper)) => keeper.noatime_fd(),
            _ => self.file.as_raw_fd(),
        };
        // `submit` checked the depth: a slot is free.
        let slot = self
            .free_slots
            .pop()
            .expect("a free slot exists below the queue depth");
        let iov = &mut self.iovecs[slot as usize * SEGMENTS_MAX..][..SEGMENTS_MAX];
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
        // completion is delivered (QueuePair::submit's contract), which is after this call;
        // the transfer limit keeps the length far below i32::MAX.
        let result = unsafe { sys::transfer_inline(fd, write, &iov[..count], offset_bytes, flags) };
        if regions != 0 {
            self.regions.charge(slot as usize, regions);
        }
        let status = status_for(result, cmd.opcode(), len_bytes);
        self.local
            .push_back((Completion { tag, status }, Some(slot)));
    }
}
