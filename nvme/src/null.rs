//! The `null` device: every command completes at once and no data moves. It measures the
//! framework's own cost per I/O, as SPDK's null bdev does.

use std::fmt;
use std::marker::PhantomData;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::config::size_text;
use crate::qpair::{
    Command, Completion, Controller, QueuePair, QueuePairError, SubmitError, QUEUE_DEPTH_MAX,
};
use crate::region::{MemoryRegion, RegionTable, RegisterError, UnregisterError};
use crate::spec::{NamespaceInfo, Opcode, Status};
use crate::sys::EventFd;

/// Shape of a null namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NullConfig {
    pub size_bytes: u64,
    pub lba_bytes: u32,
    pub mdts_bytes: u32,
    pub queues_max: u32,
}

impl Default for NullConfig {
    fn default() -> Self {
        NullConfig {
            size_bytes: 1 << 40,
            lba_bytes: 512,
            mdts_bytes: 128 << 10,
            queues_max: 64,
        }
    }
}

/// Keys `null` accepts.
pub const NULL_KEYS: &[&str] = &["size", "lba", "mdts", "queues"];

/// The canonical device string: `null` and every key that differs from its default
/// (`null,size=1G,lba=4096`).
impl fmt::Display for NullConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = NullConfig::default();
        write!(f, "null")?;
        if self.size_bytes != d.size_bytes {
            write!(f, ",size={}", size_text(self.size_bytes))?;
        }
        if self.lba_bytes != d.lba_bytes {
            write!(f, ",lba={}", self.lba_bytes)?;
        }
        if self.mdts_bytes != d.mdts_bytes {
            write!(f, ",mdts={}", size_text(u64::from(self.mdts_bytes)))?;
        }
        if self.queues_max != d.queues_max {
            write!(f, ",queues={}", self.queues_max)?;
        }
        Ok(())
    }
}

pub struct NullController {
    cfg: NullConfig,
    ns: NamespaceInfo,
    queues_max: u32,
    queues_live: Arc<AtomicU32>,
}

impl NullController {
    pub fn new(cfg: &NullConfig) -> NullController {
        NullController {
            cfg: cfg.clone(),
            ns: NamespaceInfo {
                nsid: 1,
                lba_size_bytes: cfg.lba_bytes,
                capacity_lbas: cfg.size_bytes / u64::from(cfg.lba_bytes),
                transfer_bytes_max: cfg.mdts_bytes,
            },
            queues_max: cfg.queues_max,
            queues_live: Arc::new(AtomicU32::new(0)),
        }
    }

    pub fn queue_pair(&self, depth: usize) -> Result<NullQueuePair, QueuePairError> {
        if depth == 0 || depth > QUEUE_DEPTH_MAX {
            return Err(QueuePairError::BadDepth {
                depth,
                max: QUEUE_DEPTH_MAX,
            });
        }
        let max = self.queues_max;
        self.queues_live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| QueuePairError::NoQueuesLeft { max: max as usize })?;
        let irq = match EventFd::new() {
            Ok(fd) => fd,
            Err(e) => {
                self.queues_live.fetch_sub(1, Ordering::AcqRel);
                return Err(e.into());
            }
        };
        Ok(NullQueuePair {
            ns: self.ns,
            done: vec![(0, Status::SUCCESS); depth].into_boxed_slice(),
            head: 0,
            len: 0,
            irq,
            irq_armed: false,
            queues_live: self.queues_live.clone(),
            regions: RegionTable::new(depth),
            _not_send: PhantomData,
        })
    }
}

impl Controller for NullController {
    fn describe(&self) -> String {
        self.cfg.to_string()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.ns
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        Ok(Box::new(self.queue_pair(depth)?))
    }

    /// No: a read moves no data.
    fn reads_fill_buffer(&self) -> bool {
        false
    }
}

/// A queue pair whose commands are complete the moment they are submitted.
pub struct NullQueuePair {
    ns: NamespaceInfo,
    /// Completed (tag, status) in a ring of `depth` entries.
    done: Box<[(u64, Status)]>,
    head: usize,
    len: usize,
    irq: EventFd,
    irq_armed: bool,
    queues_live: Arc<AtomicU32>,
    /// Memory the application registered, and which of it each ring entry's command uses:
    /// the null device moves no data, so this is bookkeeping only.
    regions: RegionTable,
    _not_send: PhantomData<*const ()>,
}

impl NullQueuePair {
    /// Takes `cmd`; `placed` is the mask of the regions its segments lie in when the caller
    /// found them already ([`QueuePair::submit_in_regions`]), `None` to look them up here.
    #[inline(always)]
    fn take(
        &mut self,
        cmd: &Command<'_>,
        tag: u64,
        placed: Option<u64>,
    ) -> Result<(), SubmitError> {
        let depth = self.done.len();
        if self.len == depth {
            return Err(SubmitError::QueueFull { depth });
        }
        cmd.check(self.ns.lba_size_bytes)?;
        let data_op = matches!(cmd.opcode(), Opcode::Read | Opcode::Write);
        let regions = if self.regions.is_empty() || !data_op {
            0
        } else {
            let data_bytes = cmd.nlb() as usize * self.ns.lba_size_bytes as usize;
            match placed {
                Some(mask) => {
                    debug_assert_eq!(
                        self.regions.command_mask(cmd, data_bytes),
                        Ok(mask),
                        "the caller's regions are the command's"
                    );
                    mask
                }
                None => self.regions.command_mask(cmd, data_bytes)?,
            }
        };
        let in_range = matches!(cmd.opcode(), Opcode::Flush)
            || cmd
                .slba()
                .checked_add(u64::from(cmd.nlb()))
                .is_some_and(|end| end <= self.ns.capacity_lbas);
        let bytes = u64::from(cmd.nlb()) * u64::from(self.ns.lba_size_bytes);
        let status = if !in_range {
            Status::LBA_OUT_OF_RANGE
        } else if data_op && bytes > u64::from(self.ns.transfer_bytes_max) {
            Status::INVALID_FIELD
        } else {
            Status::SUCCESS
        };
        // (head + len) modulo depth, both below depth: compare and wrap, no division.
        let slot = match self.head + self.len {
            at if at >= depth => at - depth,
            at => at,
        };
        self.done[slot] = (tag, status);
        if regions != 0 {
            self.regions.charge(slot, regions);
        }
        self.len += 1;
        if self.irq_armed {
            self.irq
                .signal()
                .expect("null device: eventfd write on our own eventfd failed");
        }
        Ok(())
    }
}

impl QueuePair for NullQueuePair {
    unsafe fn submit(&mut self, cmd: &Command<'_>, tag: u64) -> Result<(), SubmitError> {
        self.take(cmd, tag, None)
    }

    /// Takes the caller's mask: the null device moves no data, so the regions are only
    /// counted, and the caller found them already.
    unsafe fn submit_in_regions(
        &mut self,
        cmd: &Command<'_>,
        tag: u64,
        regions: u64,
    ) -> Result<(), SubmitError> {
        let placed = cmd.segments().is_some().then_some(regions);
        self.take(cmd, tag, placed)
    }

    fn process_completions(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        let n = max.min(self.len);
        let depth = self.done.len();
        let charged = !self.regions.is_empty();
        for _ in 0..n {
            let (tag, status) = self.done[self.head];
            if charged {
                self.regions.release(self.head);
            }
            self.head = if self.head + 1 == depth {
                0
            } else {
                self.head + 1
            };
            self.len -= 1;
            out(Completion { tag, status });
        }
        if n > 0 && self.irq_armed {
            self.irq_armed = false;
            self.irq.drain();
        }
        n
    }

    fn interrupt_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.irq.as_fd())
    }

    fn arm_interrupt(&mut self) {
        self.irq_armed = true;
        if self.len > 0 {
            self.irq
                .signal()
                .expect("null device: eventfd write on our own eventfd failed");
        }
    }

    fn outstanding(&self) -> usize {
        self.len
    }

    fn depth(&self) -> usize {
        self.done.len()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.ns
    }

    /// Bookkeeping only: the null device moves no data.
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
}

impl Drop for NullQueuePair {
    fn drop(&mut self) {
        self.queues_live.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::wait_readable;

    #[test]
    fn completes_at_once_in_order_and_respects_depth() {
        let ctrl = NullController::new(&NullConfig::default());
        let mut qp = ctrl.queue_pair(4).unwrap();
        for tag in 0..4 {
            // SAFETY: write zeroes carries no buffer.
            unsafe { qp.submit(&Command::write_zeroes(tag, 1), tag) }.unwrap();
        }
        // SAFETY: as above.
        let full = unsafe { qp.submit(&Command::write_zeroes(9, 1), 9) };
        assert_eq!(full, Err(SubmitError::QueueFull { depth: 4 }));
        let mut seen = Vec::new();
        assert_eq!(qp.process_completions(3, &mut |c| seen.push(c.tag)), 3);
        assert_eq!(qp.process_completions(8, &mut |c| seen.push(c.tag)), 1);
        assert_eq!(qp.process_completions(8, &mut |c| seen.push(c.tag)), 0);
        assert_eq!(seen, vec![0, 1, 2, 3]);
    }

    #[test]
    fn bad_input_gets_the_controller_status() {
        let ctrl = NullController::new(&NullConfig {
            size_bytes: 1 << 20,
            ..NullConfig::default()
        });
        let mut qp = ctrl.queue_pair(4).unwrap();
        let mut big = vec![0u8; 256 << 10];
        // SAFETY: `big` outlives the queue pair's use of it (reaped below).
        unsafe {
            qp.submit(&Command::write_zeroes(2048, 1), 1).unwrap();
            qp.submit(&Command::read(0, 512, &mut big), 2).unwrap();
        }
        let mut statuses = Vec::new();
        qp.process_completions(8, &mut |c| statuses.push((c.tag, c.status)));
        assert_eq!(
            statuses,
            vec![(1, Status::LBA_OUT_OF_RANGE), (2, Status::INVALID_FIELD)]
        );
    }

    #[test]
    fn interrupt_fd_is_readable_only_while_armed_with_work() {
        let ctrl = NullController::new(&NullConfig::default());
        let mut qp = ctrl.queue_pair(4).unwrap();
        let fd_ready = |qp: &NullQueuePair| wait_readable(qp.interrupt_fd().unwrap(), 0).unwrap();
        // SAFETY: flush carries no buffer.
        unsafe { qp.submit(&Command::flush(), 1) }.unwrap();
        assert!(!fd_ready(&qp), "not armed yet");
        qp.arm_interrupt();
        assert!(fd_ready(&qp));
        qp.process_completions(8, &mut |_| {});
        assert!(!fd_ready(&qp), "reaping disarms");
        qp.arm_interrupt();
        assert!(!fd_ready(&qp), "armed with nothing to report");
        // SAFETY: flush carries no buffer.
        unsafe { qp.submit(&Command::flush(), 2) }.unwrap();
        assert!(fd_ready(&qp));
    }

    #[test]
    fn regions_handed_in_count_as_in_use_until_reaped() {
        let ctrl = NullController::new(&NullConfig::default());
        let mut qp = ctrl.queue_pair(4).unwrap();
        let mut memory = crate::IoBuf::zeroed(16 << 10);
        // SAFETY: `memory` outlives the queue pair (dropped after it).
        let region = unsafe { qp.register_memory(memory.as_mut_ptr(), memory.len()) }.unwrap();
        let mut segs = [std::io::IoSliceMut::new(&mut memory[4096..8192])];
        let cmd = Command::readv(0, 8, &mut segs);
        // SAFETY: the segment lies in `region`, and `memory` outlives the command.
        unsafe { qp.submit_in_regions(&cmd, 7, 1 << region.index()) }.unwrap();
        assert_eq!(
            qp.unregister_memory(region),
            Err(UnregisterError::InUse { commands: 1 })
        );
        assert_eq!(qp.process_completions(8, &mut |c| assert_eq!(c.tag, 7)), 1);
        qp.unregister_memory(region).unwrap();
        drop(qp);
        drop(memory);
    }
}
