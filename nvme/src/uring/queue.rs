//! The `uring` queue pair: one io_uring ring per queue pair (and in polled modes a side ring
//! for what an IOPOLL ring refuses), commands in flight by slot, batched submission, reaping
//! both rings, Write Zeroes carried out in steps, aborts, and a drop that waits for the
//! kernel to let go of every buffer. Fixed buffers and registered memory are in
//! `queue/fixed.rs`, reaping and the drop in `queue/reap.rs`, waits inside the ring in
//! `queue/wait.rs`, reads and writes the reactor makes itself (`inline=`) in
//! `queue/inline.rs`. All share the slot table's rules (a slot is free only once the kernel
//! has let go of it), which this file keeps.

use std::collections::VecDeque;
use std::fs::File;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use io_uring::{opcode, squeue, IoUring};

use super::atime::AtimeKeeper;
use super::command::{data_entry, status_of, vectored_entry, InFlight, Zeroing};
use super::ring::{enter, entered, main_ring, transient, unentered, wait_for_room};
use super::{CompletionMode, SqPoll};
use crate::qpair::{
    Command, Completion, QueuePair, QueuePairError, RecoveryError, Segment, SubmitError,
    QUEUE_DEPTH_MAX, SEGMENTS_MAX,
};
use crate::region::{MemoryRegion, RegionTable, RegisterError, UnregisterError, REGIONS_MAX};
use crate::spec::{NamespaceInfo, Opcode, Status};
use crate::sys::EventFd;

mod fixed;
mod inline;
mod reap;
mod wait;

pub use wait::RingWake;
use wait::{WakePoll, WAKE_USER_DATA};

/// User data of an `ASYNC_CANCEL` request (an abort): never a slot index.
const CANCEL_USER_DATA: u64 = u64::MAX;

/// In polled modes, a second ring for what an IOPOLL ring refuses. The kernel fails
/// `fsync`, `fallocate` and `ASYNC_CANCEL` with EINVAL on a ring set up with IOPOLL, so
/// Flush, Write Zeroes, Deallocate and their aborts go to this one, on the same file,
/// without IOPOLL: the kernel's workers complete them as on any ring, and every poll of
/// the queue pair reaps both rings. Reads and writes stay on the polled ring.
pub(super) struct SideRing {
    ring: IoUring,
    /// Of the queue pair's `in_kernel`, the commands on this ring (Write Zeroes waiting for
    /// their next step included, as there).
    pub(super) in_kernel: usize,
    /// Entries pushed on this ring and not yet entered.
    unsubmitted: usize,
    /// Aborts on this ring, each with a completion of its own.
    cancels_in_kernel: usize,
}

/// One io_uring ring as an NVMe queue pair (two in polled modes: see `SideRing`). Owned by
/// one thread (not `Send`): the ring is created with `IORING_SETUP_SINGLE_ISSUER` where the
/// kernel has it.
pub struct UringQueuePair {
    ring: IoUring,
    /// Polled modes only (and tests): the ring for everything but reads and writes.
    pub(super) side: Option<SideRing>,
    /// Keeps the registered file open for as long as the ring may use it; inline reads and
    /// writes use it directly.
    file: Arc<File>,
    mode: CompletionMode,
    ns: NamespaceInfo,
    depth: usize,
    /// In-flight commands by slot; the slot index is the io_uring user data.
    slots: Vec<Option<InFlight>>,
    free_slots: Vec<u32>,
    /// Commands handed to the ring (pushed), not yet reaped.
    in_kernel: usize,
    /// Of those, the ones still in the submission queue, not yet entered.
    unsubmitted: usize,
    /// Commands completed without the kernel (out-of-range LBAs, oversized transfers,
    /// inline reads and writes), each with the slot an inline one holds until its completion
    /// is delivered: its registered regions are charged to that slot meanwhile, as
    /// `unregister_memory`'s contract asks.
    local: VecDeque<(Completion, Option<u32>)>,
    /// Write Zeroes with a next step to submit: punch-hole after a refused zero-range,
    /// allocate after a punch-hole (see [`Zeroing`]).
    retry_zeroes: Vec<u32>,
    zero_range_unsupported: bool,
    /// Reads and writes a polled ring refused (`EOPNOTSUPP`: the disk cannot poll); the
    /// first is logged, as the NVMe status alone cannot say why.
    pub(super) polled_refusals: u64,
    /// The ring's registered eventfd, in interrupt mode.
    event_fd: Option<EventFd>,
    /// Task work waits for our `io_uring_enter` ([`super::config::TaskRun::Defer`]).
    pub(super) defer_taskrun: bool,
    /// The main ring has a submission thread (`sqpoll=on`): pushed entries are taken without
    /// an enter while it is awake, and completions are posted by it, never by our enters.
    sqpoll: bool,
    /// The pinned pool's region, registered as fixed buffer 0: (start address, length).
    fixed_region: Option<(usize, usize)>,
    /// Reads and writes that went through the fixed buffer.
    fixed_ios: u64,
    /// Abort (`ASYNC_CANCEL`) requests in the kernel; each posts one completion of its own.
    cancels_in_kernel: usize,
    /// Vectored commands' iovecs, [`SEGMENTS_MAX`] per slot: the kernel reads them when the
    /// entry is entered (later than `submit`, submissions are batched), and again if it
    /// retries the I/O from a worker, so they live until the completion is reaped.
    iovecs: Box<[libc::iovec]>,
    /// The file is open with O_DIRECT: every segment must be block-aligned.
    direct: bool,
    /// Memory the application registered, and which of it each slot's command uses.
    regions: RegionTable,
    /// The buffer table has a slot per region (index + 1): a sparse table.
    sparse_table: bool,
    /// Regions registered as fixed buffers, one bit per region index; the others go as
    /// plain buffers and iovecs.
    regions_fixed: u64,
    /// The ring's poll of a waker's eventfd, for waits inside the ring (`queue/wait.rs`).
    wake_poll: WakePoll,
    /// A reactor may wait inside the ring (`wait=ring`, the device string's default).
    pub(super) ring_wait: bool,
    /// The last `process_completions` left the pending entries for the reactor's wait
    /// (`queue/wait.rs`): the next one submits them.
    held: bool,
    /// Reads and writes are made by this thread at submission (`inline=`), their
    /// completions queued in `local`; nothing else changes.
    pub(super) inline: bool,
    /// Reads' choice of descriptor (inline) or fixed file (through the ring) for the access
    /// time (`atime=coarse`, where it applies); `None`: every read through `file`.
    atime: Option<AtimeKeeper>,
    _not_send: PhantomData<*const ()>,
}

impl UringQueuePair {
    pub(super) fn new(
        file: Arc<File>,
        ns: NamespaceInfo,
        mode: CompletionMode,
        defer_taskrun: bool,
        sqpoll: Option<SqPoll>,
        depth: usize,
        side_ring: bool,
    ) -> Result<UringQueuePair, QueuePairError> {
        if depth == 0 || depth > QUEUE_DEPTH_MAX {
            return Err(QueuePairError::BadDepth {
                depth,
                max: QUEUE_DEPTH_MAX,
            });
        }
        let entries = depth.next_power_of_two() as u32;
        let ring = main_ring(mode, defer_taskrun, sqpoll, entries)?;
        // Fixed file 1 is the same file until `keep_atime` puts the second descriptor there.
        ring.submitter().register_files(&[file.as_raw_fd(); 2])?;
        let direct = opened_direct(&file);
        // Register the pinned pool once: reads and writes into it skip the kernel's per-I/O
        // page pinning. The table is sparse, with room after the pool for the regions an
        // application registers later (`register_memory`); a kernel without sparse tables
        // (before 5.19) gets the pool alone, and registered regions go as plain iovecs.
        // Refused registration (RLIMIT_MEMLOCK for an unprivileged user) leaves plain reads
        // and writes.
        let sparse = ring
            .submitter()
            .register_buffers_sparse(1 + REGIONS_MAX as u32)
            .is_ok();
        let fixed_region = crate::buf::pinned_region().and_then(|(base, len)| {
            let iov = libc::iovec {
                iov_base: base.cast(),
                iov_len: len,
            };
            // SAFETY: the pinned pool's region is mapped for the life of the process and
            // never remapped, so the pages the kernel pins stay the ones at these addresses.
            let registered = unsafe {
                if sparse {
                    ring.submitter().register_buffers_update(0, &[iov], None)
                } else {
                    ring.submitter().register_buffers(&[iov])
                }
            };
            registered.ok().map(|()| (base as usize, len))
        });
        let side = if side_ring {
            let ring = IoUring::builder()
                .setup_single_issuer()
                .build(entries)
                .or_else(|_| IoUring::new(entries))?;
            ring.submitter().register_files(&[file.as_raw_fd()])?;
            Some(SideRing {
                ring,
                in_kernel: 0,
                unsubmitted: 0,
                cancels_in_kernel: 0,
            })
        } else {
            None
        };
        let event_fd = if mode == CompletionMode::Interrupt {
            let efd = EventFd::new()?;
            ring.submitter().register_eventfd(efd.as_fd().as_raw_fd())?;
            if let Some(side) = &side {
                side.ring
                    .submitter()
                    .register_eventfd(efd.as_fd().as_raw_fd())?;
            }
            Some(efd)
        } else {
            None
        };
        Ok(UringQueuePair {
            ring,
            side,
            file,
            mode,
            ns,
            depth,
            slots: vec![None; depth],
            free_slots: (0..depth as u32).rev().collect(),
            in_kernel: 0,
            unsubmitted: 0,
            local: VecDeque::with_capacity(depth),
            retry_zeroes: Vec::with_capacity(depth),
            zero_range_unsupported: false,
            polled_refusals: 0,
            event_fd,
            defer_taskrun,
            sqpoll: sqpoll.is_some(),
            fixed_region,
            fixed_ios: 0,
            cancels_in_kernel: 0,
            iovecs: vec![Segment::EMPTY.to_iovec(); depth * SEGMENTS_MAX].into_boxed_slice(),
            direct,
            regions: RegionTable::new(depth),
            sparse_table: sparse,
            regions_fixed: 0,
            wake_poll: WakePoll::Unarmed,
            ring_wait: true,
            held: false,
            inline: false,
            atime: None,
            _not_send: PhantomData,
        })
    }

    /// How this queue pair finds completions.
    pub fn mode(&self) -> CompletionMode {
        self.mode
    }

    /// Hands every pending submission entry to the kernel: one `io_uring_enter` per ring
    /// with entries.
    fn flush(&mut self) {
        enter(&mut self.ring, &mut self.unsubmitted);
        if let Some(side) = &mut self.side {
            enter(&mut side.ring, &mut side.unsubmitted);
        }
    }

    /// The main ring, or the side ring where there is one and `side` asks for it.
    fn ring_of(&mut self, side: bool) -> &mut IoUring {
        match (&mut self.side, side) {
            (Some(s), true) => &mut s.ring,
            _ => &mut self.ring,
        }
    }

    /// Pushes `entry` on its ring, entering a full submission queue first; false if it is
    /// still full.
    ///
    /// # Safety
    /// As [`io_uring::SubmissionQueue::push`]: whatever the entry points at must stay valid
    /// until its completion.
    unsafe fn push(&mut self, entry: &squeue::Entry, side: bool) -> bool {
        if self.ring_of(side).submission().is_full() {
            self.flush();
            // A submission thread empties the queue on its own time, once awake.
            if self.sqpoll && !side && self.ring.submission().is_full() {
                wait_for_room(&mut self.ring);
            }
        }
        // SAFETY: the caller's guarantee.
        if unsafe { self.ring_of(side).submission().push(entry) }.is_err() {
            return false;
        }
        match (&mut self.side, side) {
            (Some(s), true) => s.unsubmitted += 1,
            _ => self.unsubmitted += 1,
        }
        true
    }

    /// Commands in the kernel on the main ring.
    fn main_in_kernel(&self) -> usize {
        self.in_kernel - self.side.as_ref().map_or(0, |s| s.in_kernel)
    }

    /// In polled modes the kernel finds completions only when asked; with deferred task work,
    /// it posts them only when asked. Either way one `io_uring_enter` with GETEVENTS, and in
    /// interrupt mode only when the ring flags work pending (a shared-memory load; no
    /// syscall while the device is still busy). A ring with a submission thread needs
    /// neither: the thread polls the device and posts completions itself.
    fn poll_kernel(&mut self) {
        let asked = if self.sqpoll {
            false
        } else if self.mode == CompletionMode::Interrupt {
            self.defer_taskrun && self.ring.submission().taskrun()
        } else {
            self.main_in_kernel() > self.unsubmitted
        };
        if asked {
            // It submits whatever is pending too.
            match self.ring.submit_and_wait(0) {
                Ok(n) => {
                    entered(&self.ring, &mut self.unsubmitted, n);
                    // Nothing is held back any more: what a callback pushes next is new.
                    self.held = false;
                }
                Err(e) if transient(&e) => {}
                Err(e) => panic!("io_uring_enter (getevents) failed on a valid ring: {e}"),
            }
        }
    }

    /// Submits the next step of the Write Zeroes that have one (see [`Zeroing`]). One that
    /// finds the submission queue full waits for the next poll.
    fn resubmit_zeroes(&mut self) {
        while let Some(&slot) = self.retry_zeroes.last() {
            let flight = self.slots[slot as usize].expect("retried slot is in flight");
            let entry = flight.entry(slot);
            // SAFETY: fallocate carries no buffer.
            if !unsafe { self.push(&entry, flight.side) } {
                return;
            }
            self.retry_zeroes.pop();
        }
    }

    fn complete_locally(&mut self, tag: u64, status: Status) {
        self.local.push_back((Completion { tag, status }, None));
    }

    /// Commands handed to the ring and not yet reaped, for tests.
    #[cfg(test)]
    pub(super) fn in_kernel(&self) -> usize {
        self.in_kernel
    }

    /// Commands and aborts in the kernel on either ring.
    pub(super) fn in_kernel_total(&self) -> usize {
        self.in_kernel
            + self.cancels_in_kernel
            + self.side.as_ref().map_or(0, |s| s.cancels_in_kernel)
    }
}

/// Whether `file` was opened with O_DIRECT.
fn opened_direct(file: &File) -> bool {
    // SAFETY: F_GETFL on a descriptor we hold open reads its status flags, nothing else.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    flags >= 0 && flags & libc::O_DIRECT != 0
}

impl QueuePair for UringQueuePair {
    unsafe fn submit(&mut self, cmd: &Command<'_>, tag: u64) -> Result<(), SubmitError> {
        if self.in_kernel + self.local.len() >= self.depth {
            return Err(SubmitError::QueueFull { depth: self.depth });
        }
        let lba_bytes = self.ns.lba_size_bytes;
        cmd.check(lba_bytes)?;
        let segs = cmd.segments();
        if let Some(segs) = segs.filter(|_| self.direct) {
            self.check_direct(segs)?;
        }
        let moves_data = matches!(cmd.opcode(), Opcode::Read | Opcode::Write);
        let regions = if self.regions.is_empty() || !moves_data {
            0
        } else {
            let data_bytes = cmd.nlb() as usize * lba_bytes as usize;
            self.regions.command_mask(cmd, data_bytes)?
        };
        let in_range = match cmd.opcode() {
            Opcode::Flush => true,
            _ => cmd
                .slba()
                .checked_add(u64::from(cmd.nlb()))
                .is_some_and(|end| end <= self.ns.capacity_lbas),
        };
        if !in_range {
            self.complete_locally(tag, Status::LBA_OUT_OF_RANGE);
            return Ok(());
        }
        let len_bytes = u64::from(cmd.nlb()) * u64::from(lba_bytes);
        if moves_data && len_bytes > u64::from(self.ns.transfer_bytes_max) {
            self.complete_locally(tag, Status::INVALID_FIELD);
            return Ok(());
        }
        if moves_data && self.inline {
            self.submit_inline(cmd, tag, len_bytes, regions);
            return Ok(());
        }
        let slot = self
            .free_slots
            .pop()
            .expect("a free slot exists below the queue depth");
        let flight = InFlight {
            tag,
            opcode: cmd.opcode(),
            len_bytes,
            offset_bytes: cmd.slba() * u64::from(lba_bytes),
            may_deallocate: cmd.may_deallocate(),
            zeroing: if self.zero_range_unsupported {
                Zeroing::PunchHole
            } else {
                Zeroing::ZeroRange
            },
            side: !moves_data && self.side.is_some(),
        };
        let entry = match segs {
            // One segment is one buffer: a plain (or fixed) read or write, as without segments.
            Some(&[one]) => self.one_buffer_entry(cmd, one.ptr(), &flight, slot),
            Some(segs) => {
                let file = self.data_file(flight.opcode);
                // `check` bounded the count by SEGMENTS_MAX.
                let iov = &mut self.iovecs[slot as usize * SEGMENTS_MAX..][..segs.len()];
                for (v, s) in iov.iter_mut().zip(segs) {
                    *v = s.to_iovec();
                }
                vectored_entry(cmd, iov.as_ptr(), segs.len() as u32, &flight, slot, file)
            }
            None if moves_data => self.one_buffer_entry(cmd, cmd.buf_ptr(), &flight, slot),
            None => flight.entry(slot),
        };
        // SAFETY: the caller of `submit` guarantees the command's buffer stays valid and
        // untouched until its completion is reaped (QueuePair::submit's contract), and Drop
        // waits for every command in the kernel before the ring goes away.
        if !unsafe { self.push(&entry, flight.side) } {
            self.free_slots.push(slot);
            if let Some(keeper) = self
                .atime
                .as_mut()
                .filter(|_| flight.opcode == Opcode::Read)
            {
                // The read may have been this minute's checked one: check the next instead.
                keeper.check_next_read();
            }
            return Err(SubmitError::QueueFull { depth: self.depth });
        }
        self.slots[slot as usize] = Some(flight);
        if regions != 0 {
            self.regions.charge(slot as usize, regions);
        }
        self.in_kernel += 1;
        if let Some(side) = self.side.as_mut().filter(|_| flight.side) {
            side.in_kernel += 1;
        }
        Ok(())
    }

    fn process_completions(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        if !self.retry_zeroes.is_empty() {
            self.resubmit_zeroes();
        }
        self.flush_unless_held();
        let mut done = 0;
        while done < max {
            let Some((c, slot)) = self.local.pop_front() else {
                break;
            };
            if let Some(slot) = slot {
                self.regions.release(slot as usize);
                self.free_slots.push(slot);
            }
            out(c);
            done += 1;
        }
        // An armed poll of a waker's eventfd may have completed: reaped here too, so that the
        // next wait clears the eventfd and arms it again.
        let poll_armed = matches!(self.wake_poll, WakePoll::Armed(_));
        if done == max || (self.in_kernel_total() == 0 && !poll_armed) {
            return done;
        }
        self.poll_kernel();
        done += self.reap(false, max - done, out);
        if self.side.is_some() {
            done += self.reap(true, max - done, out);
        }
        self.resubmit_zeroes();
        done
    }

    fn interrupt_fd(&self) -> Option<BorrowedFd<'_>> {
        self.event_fd.as_ref().map(EventFd::as_fd)
    }

    fn arm_interrupt(&mut self) {
        self.flush();
        let Some(efd) = &self.event_fd else {
            return;
        };
        // The eventfd counts every completion posted since it was last drained: clear it,
        // then make it readable again if completions already wait in the ring, so a reactor
        // blocking on it cannot miss them.
        efd.drain();
        // Deferred task work pending: the kernel signalled the eventfd for it (possibly before
        // the drain); the completion is posted once the reactor polls. Entries a transient
        // `io_uring_enter` failure left unsubmitted, and Write Zeroes with a next step, wait
        // for the reactor's next poll too: nothing in the kernel would signal for them.
        let ready = !self.local.is_empty()
            || !self.ring.completion().is_empty()
            || (self.defer_taskrun && self.ring.submission().taskrun())
            || self.unsubmitted > 0
            || !self.retry_zeroes.is_empty()
            || self
                .side
                .as_mut()
                .is_some_and(|s| !s.ring.completion().is_empty() || s.unsubmitted > 0);
        if ready {
            efd.signal().expect("signalling our own eventfd");
        }
    }

    /// Drains the eventfd, which the kernel bumped for every completion polled for since it
    /// was last armed.
    fn disarm_interrupt(&mut self) {
        if let Some(efd) = &self.event_fd {
            efd.drain();
        }
    }

    fn outstanding(&self) -> usize {
        self.in_kernel + self.local.len()
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn namespace(&self) -> NamespaceInfo {
        self.ns
    }

    /// Asks the kernel to cancel the command (`IORING_OP_ASYNC_CANCEL`). A request still
    /// queued in the kernel (an `fsync` or `fallocate` waiting for a worker) completes with
    /// Abort Requested; one already at the device cannot be pulled back and completes with
    /// its own status when the device (or the block layer's own timeout) finishes it.
    ///
    /// In polled modes a read or write is not asked about: an IOPOLL ring refuses
    /// `ASYNC_CANCEL`, and the command is at the device, to complete by itself. The other
    /// commands, on the side ring, are asked about there.
    fn abort(&mut self, tag: u64) -> Result<(), RecoveryError> {
        let Some((slot, flight)) = self
            .slots
            .iter()
            .enumerate()
            .find_map(|(i, f)| f.filter(|f| f.tag == tag).map(|f| (i, f)))
        else {
            return Ok(()); // completed meanwhile, or completed locally
        };
        if self.mode != CompletionMode::Interrupt && !flight.side {
            return Ok(());
        }
        let cancels = match (&self.side, flight.side) {
            (Some(s), true) => s.cancels_in_kernel,
            _ => self.cancels_in_kernel,
        };
        if cancels >= self.depth {
            return Err(RecoveryError::Failed("too many aborts in flight"));
        }
        let cancel = opcode::AsyncCancel::new(slot as u64)
            .build()
            .user_data(CANCEL_USER_DATA);
        // SAFETY: a cancel request carries no buffer.
        if !unsafe { self.push(&cancel, flight.side) } {
            return Err(RecoveryError::Failed("submission queue full"));
        }
        match (&mut self.side, flight.side) {
            (Some(s), true) => s.cancels_in_kernel += 1,
            _ => self.cancels_in_kernel += 1,
        }
        self.flush();
        Ok(())
    }

    /// Registers the region as a fixed buffer where the kernel allows (see `fixed.rs`).
    unsafe fn register_memory(
        &mut self,
        ptr: *mut u8,
        len_bytes: usize,
    ) -> Result<MemoryRegion, RegisterError> {
        // SAFETY: the caller keeps `register_memory`'s contract, which is the same.
        unsafe { self.register_region(ptr, len_bytes) }
    }

    fn unregister_memory(&mut self, region: MemoryRegion) -> Result<(), UnregisterError> {
        self.unregister_region(region)
    }

    // `reset` keeps the default (Unsupported): io_uring cannot take back a command the
    // device holds, so no reset could promise that its buffer is left alone. The reactor
    // quarantines such a command until its completion arrives; the kernel's own block-layer
    // timeout (30 s for NVMe and SCSI) guarantees that it does.
}
