//! One I/O submission/completion queue pair on a VFIO controller, owned by one reactor.
//!
//! Command ids are slot numbers 0..depth; each slot owns a PRP list (or a Dataset Management
//! range) in a per-queue-pair list region and, while its command is outstanding, the bounce
//! pages it took from the pool. The queues hold depth + 1 entries, so at most `depth`
//! commands are ever outstanding and the submission queue can never overflow (NVMe queues
//! are full at entries - 1). Vectored PRP lists and registered regions are in
//! `queue/regions.rs`; submission, reaping and catching up with a reset stay together
//! because they share the slot table and the reset generation.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use super::dma::{DmaRegion, PagePool, PoolWindow};
use super::prp::{self, PAGE_BYTES};
use super::sys::Gate;
use super::{Inner, VfioError, TRANSFER_BYTES_MAX};
use crate::qpair::{
    Command, Completion, QueuePair, RecoveryError, Segment, SubmitError, SEGMENTS_MAX,
};
use crate::region::{MemoryRegion, RegionTable, RegisterError, UnregisterError, REGIONS_MAX};
use crate::spec::{
    CompletionEntry, DsmRange, NamespaceInfo, Opcode, Status, SubmissionEntry, CDW12_DEAC,
    CDW12_FUA, DSM_ATTR_DEALLOCATE,
};

/// Bounce pages one command may take: TRANSFER_BYTES_MAX of 4 KiB pages.
mod regions;

use regions::for_each_bounce_piece;

const PAGES_PER_COMMAND_MAX: usize = TRANSFER_BYTES_MAX as usize / PAGE_BYTES;
/// Bytes of PRP list per slot: one entry per page after the first (rounded to a power of
/// two so a slot's list never crosses a page).
const LIST_BYTES_PER_SLOT: usize = (PAGES_PER_COMMAND_MAX * 8).next_power_of_two();
const _: () = assert!(
    LIST_BYTES_PER_SLOT >= 16,
    "a slot's list also holds a DSM range"
);
const _: () = assert!(PAGE_BYTES.is_multiple_of(LIST_BYTES_PER_SLOT));

#[derive(Clone, Copy, Debug)]
struct Slot {
    busy: bool,
    tag: u64,
    pages: [u32; PAGES_PER_COMMAND_MAX],
    npages: u8,
    /// For a Read: where the data goes once the command completes.
    read_dst: *mut u8,
    read_len_bytes: usize,
    /// For a vectored Read through bounce pages: how many of the slot's `seg_lists`
    /// entries the data goes to (0: `read_dst`, if any).
    read_segs: u16,
}

const IDLE_SLOT: Slot = Slot {
    busy: false,
    tag: 0,
    pages: [0; PAGES_PER_COMMAND_MAX],
    npages: 0,
    read_dst: std::ptr::null_mut(),
    read_len_bytes: 0,
    read_segs: 0,
};

/// An NVMe I/O queue pair driven from user space.
#[derive(Debug)]
pub struct VfioQueuePair {
    ctrl: Arc<Inner>,
    qid: u16,
    entries: u16,
    depth: usize,
    sq: DmaRegion,
    cq: DmaRegion,
    lists: DmaRegion,
    bounce: DmaRegion,
    pool: PagePool,
    slots: Vec<Slot>,
    /// Vectored reads' destination segments, [`SEGMENTS_MAX`] per slot, for the copy out
    /// of the bounce pages on completion.
    seg_lists: Box<[Segment]>,
    free_cids: Vec<u16>,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    /// Commands the controller holds.
    in_device: usize,
    /// Completions made up by the driver (aborted by a reset, over the transfer limit),
    /// delivered on the next poll. Capacity `depth`: never reallocates.
    synthetic: VecDeque<Completion>,
    /// The controller's reset generation the queues were created in.
    generation: u64,
    /// Whether the controller has this queue pair's queues (false after a failed re-create).
    live: bool,
    vector: Option<u16>,
    /// The interrupt fd: an epoll over the vector's eventfd, interested only while armed.
    gate: Option<Gate>,
    armed: bool,
    ns: NamespaceInfo,
    /// Statistics a test can read.
    aborted_by_reset: u64,
    /// Reads and writes that went straight to a pinned-pool buffer or a registered region.
    zero_copy_ios: u64,
    /// Memory the application registered, and which of it each command id uses.
    regions: RegionTable,
    /// Each registered region's IOVA mapping, by region index. Fields drop after `drop`
    /// has deleted the queues (or stopped the controller), so the device lets go of a
    /// region before its mapping goes.
    windows: Vec<Option<PoolWindow>>,
    _not_send: PhantomData<*const ()>,
}

impl VfioQueuePair {
    pub(super) fn new(ctrl: Arc<Inner>, qid: u16, depth: usize) -> Result<Self, VfioError> {
        let entries = (depth + 1) as u16;
        let container = &ctrl.container;
        let sq = DmaRegion::new(container, usize::from(entries) * 64)?;
        let cq = DmaRegion::new(container, usize::from(entries) * 16)?;
        let lists = DmaRegion::new(container, depth * LIST_BYTES_PER_SLOT)?;
        let pool_bytes = (depth * TRANSFER_BYTES_MAX as usize)
            .min(super::BOUNCE_POOL_BYTES_MAX.max(TRANSFER_BYTES_MAX as usize));
        let bounce = DmaRegion::new(container, pool_bytes)?;
        let pages = (bounce.len_bytes() / PAGE_BYTES) as u32;
        let vector = (usize::from(qid) < ctrl.irqs.len()).then_some(qid);
        let gate = match vector {
            Some(v) => Some(
                Gate::new(ctrl.irqs[usize::from(v)].as_fd().as_raw_fd()).map_err(|source| {
                    VfioError::Os {
                        what: "creating the interrupt epoll",
                        source,
                    }
                })?,
            ),
            None => None,
        };
        let generation = ctrl.create_io_queues(qid, entries, cq.iova(), sq.iova(), vector)?;
        Ok(VfioQueuePair {
            ns: ctrl.ns,
            ctrl,
            qid,
            entries,
            depth,
            sq,
            cq,
            lists,
            bounce,
            pool: PagePool::new(pages),
            slots: vec![IDLE_SLOT; depth],
            seg_lists: vec![Segment::EMPTY; depth * SEGMENTS_MAX].into_boxed_slice(),
            free_cids: (0..depth as u16).rev().collect(),
            sq_tail: 0,
            cq_head: 0,
            phase: true,
            in_device: 0,
            synthetic: VecDeque::with_capacity(depth),
            generation,
            live: true,
            vector,
            gate,
            armed: false,
            aborted_by_reset: 0,
            zero_copy_ios: 0,
            regions: RegionTable::new(depth),
            windows: (0..REGIONS_MAX).map(|_| None).collect(),
            _not_send: PhantomData,
        })
    }

    /// The NVMe queue id of this pair.
    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Commands this queue pair completed with an abort status because of a controller reset.
    pub fn aborted_by_reset(&self) -> u64 {
        self.aborted_by_reset
    }

    /// Reads and writes so far that needed no bounce copy (their buffer was pinned).
    pub fn zero_copy_ios(&self) -> u64 {
        self.zero_copy_ios
    }

    /// Bounce pages free right now (of [`VfioQueuePair::bounce_pages`]).
    pub fn free_bounce_pages(&self) -> usize {
        self.pool.free_pages()
    }

    pub fn bounce_pages(&self) -> u32 {
        self.pool.total_pages()
    }

    fn cq_entry(&self) -> Option<CompletionEntry> {
        let off = usize::from(self.cq_head) * 16;
        let cqe: CompletionEntry = self.cq.read_volatile(off);
        if cqe.phase() != self.phase {
            return None;
        }
        // The phase bit says the entry is complete; read it again after the fence so no
        // field is older than the phase.
        fence(Ordering::Acquire);
        Some(self.cq.read_volatile(off))
    }

    /// Finishes the command in slot `cid`: copies a read's data out, frees its pages and id.
    fn finish(&mut self, cid: u16) -> u64 {
        let qid = self.qid;
        let slot = self
            .slots
            .get_mut(usize::from(cid))
            .filter(|s| s.busy)
            .unwrap_or_else(|| panic!("vfio queue {qid}: completion for idle command id {cid}"));
        let slot = std::mem::replace(slot, IDLE_SLOT);
        if slot.read_segs > 0 {
            let segs =
                &self.seg_lists[usize::from(cid) * SEGMENTS_MAX..][..usize::from(slot.read_segs)];
            let pages = &slot.pages[..usize::from(slot.npages)];
            for_each_bounce_piece(pages, segs, |offset, seg_ptr, n| {
                // SAFETY: each segment is the vectored Read's, which submit's contract keeps
                // valid and exclusive until this completion is delivered; the pieces stay
                // inside their segment.
                unsafe { self.bounce.read_to(offset, seg_ptr, n) }
            });
        } else if !slot.read_dst.is_null() {
            let mut copied = 0;
            for &page in &slot.pages[..usize::from(slot.npages)] {
                let n = (slot.read_len_bytes - copied).min(PAGE_BYTES);
                // SAFETY: `read_dst` is the Read's buffer of `read_len_bytes`, which submit's
                // contract keeps valid and exclusive until this completion is delivered.
                unsafe {
                    self.bounce
                        .read_to(page as usize * PAGE_BYTES, slot.read_dst.add(copied), n)
                };
                copied += n;
            }
        }
        self.pool.give(&slot.pages[..usize::from(slot.npages)]);
        self.free_cids.push(cid);
        if !self.regions.is_empty() {
            self.regions.release(usize::from(cid));
        }
        slot.tag
    }

    /// Reaps what the controller posted, without ringing the head doorbell.
    fn reap_posted(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        let mut n = 0;
        while n < max {
            let Some(cqe) = self.cq_entry() else { break };
            self.cq_head += 1;
            if self.cq_head == self.entries {
                self.cq_head = 0;
                self.phase = !self.phase;
            }
            let tag = self.finish(cqe.cid);
            self.in_device -= 1;
            out(Completion {
                tag,
                status: cqe.status(),
            });
            n += 1;
        }
        n
    }

    /// Carries out a controller reset this queue pair has not seen yet: completions the
    /// controller posted before it stopped are delivered as they are, every other command
    /// fails with "Command Aborted due to SQ Deletion", and the queues are created again.
    fn catch_up_with_reset(&mut self) {
        let generation = self.ctrl.generation.load(Ordering::SeqCst);
        if generation == self.generation {
            return;
        }
        self.generation = generation;
        // The reset path may allocate: it is not the I/O path.
        let mut reaped = Vec::new();
        self.reap_posted(usize::MAX, &mut |c| reaped.push(c));
        self.synthetic.extend(reaped);
        for cid in 0..self.depth as u16 {
            if self.slots[usize::from(cid)].busy {
                // The data never arrived: do not copy stale bounce bytes into a read buffer.
                self.slots[usize::from(cid)].read_dst = std::ptr::null_mut();
                self.slots[usize::from(cid)].read_segs = 0;
                let tag = self.finish(cid);
                self.synthetic.push_back(Completion {
                    tag,
                    status: Status::ABORTED_SQ_DELETION,
                });
                self.aborted_by_reset += 1;
            }
        }
        self.in_device = 0;
        self.sq.zero();
        self.cq.zero();
        self.sq_tail = 0;
        self.cq_head = 0;
        self.phase = true;
        match self.ctrl.create_io_queues(
            self.qid,
            self.entries,
            self.cq.iova(),
            self.sq.iova(),
            self.vector,
        ) {
            Ok(generation) => {
                // A second reset may have come before the queues were created: they live
                // on its controller.
                self.generation = generation;
                self.live = true;
            }
            Err(_) => self.live = false,
        }
    }

    fn post(&mut self, mut sqe: SubmissionEntry) {
        sqe.nsid = self.ns.nsid;
        self.sq.write_volatile(usize::from(self.sq_tail) * 64, sqe);
        self.sq_tail += 1;
        if self.sq_tail == self.entries {
            self.sq_tail = 0;
        }
        self.in_device += 1;
        self.ctrl.bar.ring_sq(self.qid, self.sq_tail);
    }
}

impl QueuePair for VfioQueuePair {
    unsafe fn submit(&mut self, cmd: &Command<'_>, tag: u64) -> Result<(), SubmitError> {
        self.catch_up_with_reset();
        if !self.live {
            return Err(SubmitError::Disabled);
        }
        if self.in_device + self.synthetic.len() >= self.depth {
            return Err(SubmitError::QueueFull { depth: self.depth });
        }
        cmd.check(self.ns.lba_size_bytes)?;
        let segs = cmd.segments();
        if let Some(segs) = segs {
            // Checked whatever memory the segments lie in, bounced or not, so a command
            // this driver takes does not depend on where its buffers were allocated.
            prp::check_segments(segs.iter().map(|s| (s.ptr() as u64, s.len_bytes())))?;
        }
        let opcode = cmd.opcode();
        let data_bytes = match opcode {
            Opcode::Read | Opcode::Write => cmd.nlb() as usize * self.ns.lba_size_bytes as usize,
            _ => 0,
        };
        let regions = if self.regions.is_empty() || data_bytes == 0 {
            0
        } else {
            self.regions.command_mask(cmd, data_bytes)?
        };
        let cid = *self
            .free_cids
            .last()
            .expect("a free command id below depth");
        if data_bytes > self.ns.transfer_bytes_max as usize {
            // What the controller answers a transfer over MDTS with; the bounce pages of one
            // command cannot hold it either.
            self.free_cids.pop();
            self.slots[usize::from(cid)] = Slot {
                busy: true,
                tag,
                ..IDLE_SLOT
            };
            self.finish(cid);
            self.synthetic.push_back(Completion {
                tag,
                status: Status::INVALID_FIELD,
            });
            return Ok(());
        }
        let mut slot = Slot {
            busy: true,
            tag,
            ..IDLE_SLOT
        };
        let mut sqe = SubmissionEntry {
            opcode: opcode as u8,
            cid,
            ..Default::default()
        };
        let list_off = usize::from(cid) * LIST_BYTES_PER_SLOT;
        let list_iova = self.lists.iova() + list_off as u64;
        match opcode {
            Opcode::Read | Opcode::Write if segs.is_some() => {
                let segs = segs.expect("matched");
                let (prp1, prp2) = self.vectored_prps(cid, &mut slot, opcode, segs, data_bytes)?;
                sqe.prp1 = prp1;
                sqe.prp2 = prp2;
                sqe.set_slba(cmd.slba());
                sqe.cdw12 = (cmd.nlb() - 1) | if cmd.fua() { CDW12_FUA } else { 0 };
            }
            Opcode::Read | Opcode::Write => {
                let npages = prp::pages_spanned(0, data_bytes);
                let mut iovas = [0u64; PAGES_PER_COMMAND_MAX];
                let direct = self
                    .ctrl
                    .pool
                    .as_ref()
                    .ok()
                    .and_then(|w| w.iova_of(cmd.buf_ptr(), data_bytes))
                    .or_else(|| self.region_iova(cmd.buf_ptr(), data_bytes, true));
                if let Some(iova) = direct {
                    // Zero-copy: the controller reads or writes the caller's pinned buffer,
                    // which submit's contract keeps valid until the completion is reaped.
                    for (i, v) in iovas[..npages].iter_mut().enumerate() {
                        *v = iova + (i * PAGE_BYTES) as u64;
                    }
                    self.zero_copy_ios += 1;
                } else if !self.pool.take(&mut slot.pages[..npages]) {
                    return Err(SubmitError::QueueFull { depth: self.depth });
                } else {
                    slot.npages = npages as u8;
                    for (i, &p) in slot.pages[..npages].iter().enumerate() {
                        iovas[i] = self.bounce.iova() + (p as usize * PAGE_BYTES) as u64;
                    }
                }
                if direct.is_some() {
                    // Nothing to copy in or out.
                } else if opcode == Opcode::Write {
                    let mut copied = 0;
                    for &p in &slot.pages[..npages] {
                        let n = (data_bytes - copied).min(PAGE_BYTES);
                        // SAFETY: submit's contract keeps the write buffer valid for
                        // `buf_len_bytes` >= data_bytes (checked by `check`).
                        let src = unsafe {
                            std::slice::from_raw_parts(cmd.buf_ptr().add(copied).cast_const(), n)
                        };
                        self.bounce.write_bytes(p as usize * PAGE_BYTES, src);
                        copied += n;
                    }
                } else {
                    slot.read_dst = cmd.buf_ptr();
                    slot.read_len_bytes = data_bytes;
                }
                let mut list = [0u64; PAGES_PER_COMMAND_MAX];
                let (prp1, prp2) =
                    prp::build(&iovas[..npages], 0, data_bytes, &mut list, list_iova)
                        .expect("page-aligned pool or bounce pages always make valid PRPs");
                if npages > 2 {
                    for (i, &entry) in list[..npages - 1].iter().enumerate() {
                        self.lists.write_volatile(list_off + 8 * i, entry);
                    }
                }
                sqe.prp1 = prp1;
                sqe.prp2 = prp2;
                sqe.set_slba(cmd.slba());
                sqe.cdw12 = (cmd.nlb() - 1) | if cmd.fua() { CDW12_FUA } else { 0 };
            }
            Opcode::WriteZeroes => {
                sqe.set_slba(cmd.slba());
                sqe.cdw12 = (cmd.nlb() - 1)
                    | if cmd.fua() { CDW12_FUA } else { 0 }
                    | if cmd.may_deallocate() { CDW12_DEAC } else { 0 };
            }
            Opcode::DatasetManagement => {
                self.lists.write_volatile(
                    list_off,
                    DsmRange {
                        context_attributes: 0,
                        nlb: cmd.nlb(),
                        slba: cmd.slba(),
                    },
                );
                sqe.prp1 = list_iova;
                // One range (NR is 0-based), attribute Deallocate.
                sqe.cdw10 = 0;
                sqe.cdw11 = DSM_ATTR_DEALLOCATE;
            }
            Opcode::Flush => {}
        }
        self.free_cids.pop();
        self.slots[usize::from(cid)] = slot;
        if regions != 0 {
            self.regions.charge(usize::from(cid), regions);
        }
        self.post(sqe);
        Ok(())
    }

    fn process_completions(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize {
        self.catch_up_with_reset();
        let mut n = 0;
        while n < max {
            let Some(c) = self.synthetic.pop_front() else {
                break;
            };
            out(c);
            n += 1;
        }
        let reaped = self.reap_posted(max - n, out);
        if reaped > 0 {
            self.ctrl.bar.ring_cq(self.qid, self.cq_head);
        }
        if self.armed && n + reaped > 0 {
            // One-shot: the interrupt path pays this syscall, polling never arms.
            self.armed = false;
            if let Some(gate) = &self.gate {
                gate.close()
                    .expect("vfio: epoll_ctl on our own interrupt epoll failed");
            }
        }
        n + reaped
    }

    fn interrupt_fd(&self) -> Option<BorrowedFd<'_>> {
        self.gate.as_ref().map(Gate::as_fd)
    }

    fn arm_interrupt(&mut self) {
        let Some(v) = self.vector else { return };
        // Forget interrupts of completions reaped while polling, then look: a completion
        // posted after the look raises MSI-X, which makes the eventfd readable again. The
        // drain comes before catching up with a controller reset, which signals this eventfd
        // after it bumps the generation: a reset after the drain is either caught up here or
        // leaves the eventfd readable (drained after the catch-up, its signal was lost).
        self.ctrl.irqs[usize::from(v)].drain();
        self.catch_up_with_reset();
        let irq = &self.ctrl.irqs[usize::from(v)];
        if !self.armed {
            self.armed = true;
            self.gate
                .as_ref()
                .expect("a vector has a gate")
                .open()
                .expect("vfio: epoll_ctl on our own interrupt epoll failed");
        }
        if !self.synthetic.is_empty() || self.cq_entry().is_some() {
            irq.signal()
                .expect("vfio: eventfd write on our own interrupt eventfd failed");
        }
    }

    fn outstanding(&self) -> usize {
        self.in_device + self.synthetic.len()
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn namespace(&self) -> NamespaceInfo {
        self.ns
    }

    /// Maps the region for the device at an IOVA range of its own (see `queue/regions.rs`).
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

    /// A controller reset (NVMe has no per-queue reset short of deleting and recreating the
    /// queues through the same admin queue, and a command stuck in the controller is best
    /// cleared by disabling it): the controller stops (CC.EN = 0), so it touches no buffer
    /// after that; what it had not finished completes here with "Command Aborted due to SQ
    /// Deletion" at once, and the queues are created again. Other queue pairs on the
    /// controller do the same the next time they are touched. `abort` keeps the default
    /// (Unsupported): a reactor goes straight to this.
    fn reset(&mut self) -> Result<(), RecoveryError> {
        self.ctrl
            .reset()
            .map_err(|_| RecoveryError::Failed("the controller did not come back from reset"))?;
        self.catch_up_with_reset();
        if self.live {
            Ok(())
        } else {
            Err(RecoveryError::Failed(
                "the I/O queues could not be created again after the reset",
            ))
        }
    }
}

impl Drop for VfioQueuePair {
    fn drop(&mut self) {
        let reset_since = self.ctrl.generation.load(Ordering::SeqCst) != self.generation;
        // A reset since the queues were (re)created deleted them already: the controller
        // stopped touching this memory when it was disabled.
        let stopped = reset_since || !self.live || self.ctrl.delete_io_queues(self.qid).is_ok();
        if !stopped && self.in_device > 0 && self.zero_copy_ios > 0 {
            // Commands may still be using the callers' own pinned buffers, which this queue
            // pair cannot keep: stop the whole controller, or stop the process.
            if self.ctrl.disable().is_err() {
                tracing::error!(
                    "vfio {}: neither deleting queue {} nor disabling the controller \
                     worked; aborting rather than let it write freed memory",
                    self.ctrl.cfg,
                    self.qid
                );
                std::process::abort();
            }
        }
        if !stopped {
            // The controller may still read or write these pages: keep them forever.
            self.sq.leak();
            self.cq.leak();
            self.lists.leak();
            self.bounce.leak();
        }
        self.ctrl.qids.lock()[usize::from(self.qid) - 1] = false;
    }
}
