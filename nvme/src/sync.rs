//! Blocking, one-command-at-a-time I/O on a queue pair, for tools, examples and tests (the
//! reactor is the way to drive a queue pair at speed). Buffers are owned [`IoBuf`]s, so the
//! helpers are safe: a command that never completes keeps its buffer (leaked) rather than
//! letting the device write into freed memory, and so does a command whose wait is cut
//! short by a panic (the buffer is held in `ManuallyDrop` until its completion is seen, so
//! unwinding leaks it instead of freeing it).
//!
//! Sizes are checked before anything is allocated: a transfer must be 1 to 65 536 blocks
//! and at most the namespace's maximum transfer size (MDTS), so a wild block count is an
//! error, not a multi-terabyte allocation.

use std::mem::ManuallyDrop;
use std::time::{Duration, Instant};

use crate::buf::IoBuf;
use crate::clock::VirtualClock;
use crate::emu::EmuQueuePair;
use crate::qpair::{Command, Completion, QueuePair, SubmitError, NLB_TOO_LARGE, ZERO_NLB};
use crate::spec::{Status, NLB_MAX};

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    #[error("not submitted: {0}")]
    Submit(#[from] SubmitError),
    #[error("device returned {0}")]
    Status(Status),
    #[error("no completion within {0:?}")]
    TimedOut(Duration),
    #[error("the queue pair has {0} commands outstanding; sync I/O needs it idle")]
    Busy(usize),
    /// A write's data must fill whole logical blocks; nothing was submitted.
    #[error("{len_bytes} bytes of data is not a whole number of {lba_bytes}-byte blocks")]
    NotBlockMultiple { len_bytes: usize, lba_bytes: u32 },
    /// One command cannot move more than the namespace's MDTS; nothing was submitted (split
    /// the transfer).
    #[error(
        "a transfer of {len_bytes} bytes is over the namespace's maximum of \
         {transfer_bytes_max} bytes per command (MDTS)"
    )]
    OverMaxTransfer {
        len_bytes: u64,
        transfer_bytes_max: u32,
    },
}

/// Runs commands one at a time on a queue pair, waiting for each.
pub struct SyncIo<'q> {
    qp: &'q mut (dyn QueuePair + 'static),
    /// With a virtual clock, waiting advances it to the device's next deadline.
    clock: Option<VirtualClock>,
    timeout: Duration,
    next_tag: u64,
}

impl<'q> SyncIo<'q> {
    /// Waits on the real clock, up to `timeout` per command.
    pub fn new(qp: &'q mut (dyn QueuePair + 'static), timeout: Duration) -> SyncIo<'q> {
        SyncIo {
            qp,
            clock: None,
            timeout,
            next_tag: 0,
        }
    }

    /// Waits in virtual time: instead of spinning, it advances `clock` to the device's next
    /// completion deadline; a command with no deadline (lost) times out at once.
    pub fn virtual_time(qp: &'q mut (dyn QueuePair + 'static), clock: VirtualClock) -> SyncIo<'q> {
        SyncIo {
            qp,
            clock: Some(clock),
            timeout: Duration::ZERO,
            next_tag: 0,
        }
    }

    pub fn queue_pair(&mut self) -> &mut dyn QueuePair {
        self.qp
    }

    /// The bytes `nlb` blocks move, once they are known to fit one command: 1 to
    /// [`NLB_MAX`] blocks, at most the namespace's MDTS.
    fn transfer_bytes(&self, nlb: u32) -> Result<usize, IoError> {
        if nlb == 0 {
            return Err(SubmitError::InvalidField(ZERO_NLB).into());
        }
        if nlb > NLB_MAX {
            return Err(SubmitError::InvalidField(NLB_TOO_LARGE).into());
        }
        let ns = self.qp.namespace();
        let len_bytes = u64::from(nlb) * u64::from(ns.lba_size_bytes);
        if len_bytes > u64::from(ns.transfer_bytes_max) {
            return Err(IoError::OverMaxTransfer {
                len_bytes,
                transfer_bytes_max: ns.transfer_bytes_max,
            });
        }
        // At most MDTS, a u32: fits usize.
        Ok(len_bytes as usize)
    }

    /// Reads `nlb` blocks at `slba`.
    pub fn read(&mut self, slba: u64, nlb: u32) -> Result<IoBuf, IoError> {
        let len_bytes = self.transfer_bytes(nlb)?;
        // From here until the completion is seen, the device may write into `buf`: an
        // unwind must leak it, not free it.
        let mut buf = ManuallyDrop::new(IoBuf::zeroed(len_bytes));
        // SAFETY: `buf` is handed to `wait`, which keeps it until the command completes and
        // leaks it if it never does; on a submit error the device never saw it.
        let started = unsafe { self.start(&Command::read(slba, nlb, &mut buf)) };
        let tag = match started {
            Ok(tag) => tag,
            Err(e) => {
                drop(ManuallyDrop::into_inner(buf));
                return Err(e);
            }
        };
        self.wait(tag, Some(buf))
            .map(|buf| buf.expect("a read keeps its buffer"))
    }

    /// Writes `data` at `slba`. `data` must be a whole number of blocks, at most the
    /// namespace's MDTS.
    pub fn write(&mut self, slba: u64, data: &[u8]) -> Result<(), IoError> {
        let lba_bytes = self.qp.namespace().lba_size_bytes;
        if !data.len().is_multiple_of(lba_bytes as usize) {
            return Err(IoError::NotBlockMultiple {
                len_bytes: data.len(),
                lba_bytes,
            });
        }
        // A count past u32 is past NLB_MAX too, which `transfer_bytes` refuses.
        let nlb = u32::try_from(data.len() / lba_bytes as usize).unwrap_or(u32::MAX);
        self.transfer_bytes(nlb)?;
        let buf = ManuallyDrop::new(IoBuf::from_slice(data));
        // SAFETY: as in `read`.
        let started = unsafe { self.start(&Command::write(slba, nlb, &buf)) };
        let tag = match started {
            Ok(tag) => tag,
            Err(e) => {
                drop(ManuallyDrop::into_inner(buf));
                return Err(e);
            }
        };
        self.wait(tag, Some(buf)).map(drop)
    }

    pub fn write_zeroes(&mut self, slba: u64, nlb: u32) -> Result<(), IoError> {
        self.run_without_data(&Command::write_zeroes(slba, nlb))
    }

    /// Write Zeroes that allows the device to deallocate the blocks
    /// ([`Command::with_deallocate`]).
    pub fn write_zeroes_deallocating(&mut self, slba: u64, nlb: u32) -> Result<(), IoError> {
        self.run_without_data(&Command::write_zeroes(slba, nlb).with_deallocate(true))
    }

    pub fn deallocate(&mut self, slba: u64, nlb: u32) -> Result<(), IoError> {
        self.run_without_data(&Command::deallocate(slba, nlb))
    }

    pub fn flush(&mut self) -> Result<(), IoError> {
        self.run_without_data(&Command::flush())
    }

    fn run_without_data(&mut self, cmd: &Command<'_>) -> Result<(), IoError> {
        // SAFETY: the command carries no data buffer.
        let tag = unsafe { self.start(cmd) }?;
        self.wait(tag, None).map(drop)
    }

    /// Submits `cmd` on an idle queue pair and returns its tag.
    ///
    /// # Safety
    /// `cmd`'s buffer, if any, must be passed to [`SyncIo::wait`] for the returned tag, in a
    /// `ManuallyDrop` that nothing drops before then.
    unsafe fn start(&mut self, cmd: &Command<'_>) -> Result<u64, IoError> {
        let busy = self.qp.outstanding();
        if busy != 0 {
            return Err(IoError::Busy(busy));
        }
        let tag = self.next_tag;
        self.next_tag += 1;
        // SAFETY: our caller keeps the buffer alive through `wait`.
        unsafe { self.qp.submit(cmd, tag) }?;
        Ok(tag)
    }

    /// Waits for the completion of `tag`, keeping `owned` (the command's buffer) alive until
    /// then; gives the buffer back on success and frees it on an error status. If the
    /// command never completes, or a panic cuts the wait short, the buffer is leaked: the
    /// device may still write into it.
    fn wait(
        &mut self,
        tag: u64,
        owned: Option<ManuallyDrop<IoBuf>>,
    ) -> Result<Option<IoBuf>, IoError> {
        let started = Instant::now();
        let mut result: Option<Completion> = None;
        loop {
            self.qp.process_completions(1, &mut |c| result = Some(c));
            if let Some(done) = result {
                assert_eq!(done.tag, tag, "sync I/O: a completion for another command");
                // The device is done with the buffer: it may be freed again.
                let owned = owned.map(ManuallyDrop::into_inner);
                return if done.status.is_success() {
                    Ok(owned)
                } else {
                    Err(IoError::Status(done.status))
                };
            }
            let waited_out = match &self.clock {
                Some(clock) => match EmuQueuePair::downcast(self.qp)
                    .and_then(EmuQueuePair::oracle_next_deadline_ns)
                {
                    Some(deadline_ns) => {
                        clock.advance_to(deadline_ns);
                        false
                    }
                    None => true,
                },
                None => started.elapsed() >= self.timeout,
            };
            if waited_out {
                // `owned` stays in its ManuallyDrop: leaked, never freed under the device.
                return Err(IoError::TimedOut(self.timeout));
            }
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    //! Panic safety: a wait cut short by a panic must leak the buffer, not free it. A
    //! watching allocator (this test binary only) records whether the one address the test
    //! names is freed. Other tests running at once cannot free that address while the
    //! device holds it (it is live, or leaked), so process-wide flags suffice.

    use std::alloc::{GlobalAlloc, Layout, System};
    use std::os::fd::BorrowedFd;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;
    use crate::spec::NamespaceInfo;

    static WATCHED_ADDR: AtomicUsize = AtomicUsize::new(0);
    static WATCHED_FREED: AtomicBool = AtomicBool::new(false);

    struct WatchingAlloc;

    // SAFETY: forwards every call to the system allocator unchanged; it only compares the
    // freed address with an atomic (which never allocates).
    unsafe impl GlobalAlloc for WatchingAlloc {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            // SAFETY: same contract as ours.
            unsafe { System.alloc(layout) }
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            // SAFETY: same contract as ours.
            unsafe { System.alloc_zeroed(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            if WATCHED_ADDR.load(Ordering::Acquire) == ptr as usize {
                WATCHED_FREED.store(true, Ordering::Release);
            }
            // SAFETY: same contract as ours.
            unsafe { System.dealloc(ptr, layout) }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            // SAFETY: same contract as ours.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static ALLOC: WatchingAlloc = WatchingAlloc;

    /// A queue pair that remembers the buffer it was given and then either completes the
    /// command or panics while being polled.
    struct Scripted {
        panic_on_poll: bool,
        pending: Option<u64>,
    }

    impl QueuePair for Scripted {
        unsafe fn submit(&mut self, cmd: &Command<'_>, tag: u64) -> Result<(), SubmitError> {
            WATCHED_FREED.store(false, Ordering::Release);
            WATCHED_ADDR.store(cmd.buf_ptr() as usize, Ordering::Release);
            self.pending = Some(tag);
            Ok(())
        }

        fn process_completions(&mut self, _max: usize, out: &mut dyn FnMut(Completion)) -> usize {
            assert!(!self.panic_on_poll, "scripted device failure");
            match self.pending.take() {
                Some(tag) => {
                    out(Completion {
                        tag,
                        status: Status::SUCCESS,
                    });
                    1
                }
                None => 0,
            }
        }

        fn interrupt_fd(&self) -> Option<BorrowedFd<'_>> {
            None
        }

        fn arm_interrupt(&mut self) {}

        fn outstanding(&self) -> usize {
            usize::from(self.pending.is_some())
        }

        fn depth(&self) -> usize {
            1
        }

        fn namespace(&self) -> NamespaceInfo {
            NamespaceInfo {
                nsid: 1,
                lba_size_bytes: 512,
                capacity_lbas: 1 << 20,
                transfer_bytes_max: 128 << 10,
            }
        }
    }

    #[test]
    fn a_panic_while_waiting_leaks_the_buffer_instead_of_freeing_it() {
        for write in [false, true] {
            let mut qp = Scripted {
                panic_on_poll: true,
                pending: None,
            };
            let mut io = SyncIo::new(&mut qp, Duration::from_secs(1));
            let unwound = catch_unwind(AssertUnwindSafe(|| {
                if write {
                    io.write(0, &[1u8; 1024]).map(drop)
                } else {
                    io.read(0, 2).map(drop)
                }
            }));
            assert!(unwound.is_err(), "the scripted device panics");
            assert!(
                !WATCHED_FREED.load(Ordering::Acquire),
                "the buffer the device holds was freed by unwinding (write: {write})"
            );
        }
        // Control: when the completion is seen, the buffer is freed as usual.
        let mut qp = Scripted {
            panic_on_poll: false,
            pending: None,
        };
        let mut io = SyncIo::new(&mut qp, Duration::from_secs(1));
        drop(io.read(0, 2).unwrap());
        assert!(
            WATCHED_FREED.load(Ordering::Acquire),
            "the watcher sees frees"
        );
        io.write(0, &[1u8; 512]).unwrap();
        assert!(WATCHED_FREED.load(Ordering::Acquire));
    }
}
