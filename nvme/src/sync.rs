//! Blocking, one-command-at-a-time I/O on a queue pair, for tools, examples and tests (the
//! reactor is the way to drive a queue pair at speed). Buffers are owned [`IoBuf`]s, so the
//! helpers are safe: a command that never completes keeps its buffer (leaked) rather than
//! letting the device write into freed memory.

use std::time::{Duration, Instant};

use crate::buf::IoBuf;
use crate::clock::VirtualClock;
use crate::qpair::{Command, Completion, QueuePair, SubmitError};
use crate::spec::Status;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum IoError {
    #[error("not submitted: {0}")]
    Submit(#[from] SubmitError),
    #[error("device returned {0}")]
    Status(Status),
    #[error("no completion within {0:?}")]
    TimedOut(Duration),
    #[error("the queue pair has {0} commands outstanding; sync I/O needs it idle")]
    Busy(usize),
}

/// Runs commands one at a time on a queue pair, waiting for each.
pub struct SyncIo<'q> {
    qp: &'q mut dyn QueuePair,
    /// With a virtual clock, waiting advances it to the device's next deadline.
    clock: Option<VirtualClock>,
    timeout: Duration,
    next_tag: u64,
}

impl<'q> SyncIo<'q> {
    /// Waits on the real clock, up to `timeout` per command.
    pub fn new(qp: &'q mut dyn QueuePair, timeout: Duration) -> SyncIo<'q> {
        SyncIo {
            qp,
            clock: None,
            timeout,
            next_tag: 0,
        }
    }

    /// Waits in virtual time: instead of spinning, it advances `clock` to the device's next
    /// completion deadline; a command with no deadline (lost) times out at once.
    pub fn virtual_time(qp: &'q mut dyn QueuePair, clock: VirtualClock) -> SyncIo<'q> {
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

    fn lba_bytes(&self) -> usize {
        self.qp.namespace().lba_size_bytes as usize
    }

    /// Reads `nlb` blocks at `slba`.
    pub fn read(&mut self, slba: u64, nlb: u32) -> Result<IoBuf, IoError> {
        let mut buf = IoBuf::zeroed(nlb as usize * self.lba_bytes());
        // SAFETY: `buf` is handed to `wait`, which keeps it until the command completes.
        let tag = unsafe { self.start(&Command::read(slba, nlb, &mut buf)) }?;
        self.wait(tag, Some(buf))
            .map(|buf| buf.expect("a read keeps its buffer"))
    }

    /// Writes `data` (a whole number of blocks) at `slba`.
    pub fn write(&mut self, slba: u64, data: &[u8]) -> Result<(), IoError> {
        let nlb = (data.len() / self.lba_bytes()) as u32;
        let buf = IoBuf::from_slice(data);
        // SAFETY: `buf` is handed to `wait`, which keeps it until the command completes.
        let tag = unsafe { self.start(&Command::write(slba, nlb, &buf)) }?;
        self.wait(tag, Some(buf)).map(drop)
    }

    pub fn write_zeroes(&mut self, slba: u64, nlb: u32) -> Result<(), IoError> {
        self.run_without_data(&Command::write_zeroes(slba, nlb))
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
    /// `cmd`'s buffer, if any, must be passed to [`SyncIo::wait`] for the returned tag.
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
    /// then; gives the buffer back on success. If the command never completes, the buffer
    /// is leaked: the device may still write into it.
    fn wait(&mut self, tag: u64, owned: Option<IoBuf>) -> Result<Option<IoBuf>, IoError> {
        let started = Instant::now();
        let mut result: Option<Completion> = None;
        loop {
            self.qp.process_completions(1, &mut |c| result = Some(c));
            if let Some(done) = result {
                assert_eq!(done.tag, tag, "sync I/O: a completion for another command");
                return if done.status.is_success() {
                    Ok(owned)
                } else {
                    Err(IoError::Status(done.status))
                };
            }
            let waited_out = match &self.clock {
                Some(clock) => match self.qp.oracle_next_deadline_ns() {
                    Some(deadline_ns) => {
                        clock.advance_to(deadline_ns);
                        false
                    }
                    None => true,
                },
                None => started.elapsed() >= self.timeout,
            };
            if waited_out {
                std::mem::forget(owned);
                return Err(IoError::TimedOut(self.timeout));
            }
            std::hint::spin_loop();
        }
    }
}
