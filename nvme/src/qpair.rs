//! The device-independent I/O interface: commands, completions, the [`QueuePair`] trait a
//! reactor polls, and the [`Controller`] that hands out one queue pair per reactor.

use std::any::Any;
use std::os::fd::BorrowedFd;

pub use crate::command::{Command, Segment, SegmentError, NLB_TOO_LARGE, SEGMENTS_MAX, ZERO_NLB};
use crate::region::{MemoryRegion, RegionError, RegisterError, UnregisterError};
use crate::spec::{NamespaceInfo, Opcode, Status};

/// Buffers handed to a device must be aligned to this many bytes: NVMe requires data pointers
/// to be dword aligned.
pub const BUFFER_ALIGN_BYTES: usize = 4;

/// Largest queue depth a queue pair may be created with (NVMe's MQES is 16 bits; real
/// controllers commonly cap queues at 1024 entries).
pub const QUEUE_DEPTH_MAX: usize = 1024;

/// Why a command was not accepted. The command never reached the device, and no completion
/// will be posted for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// Every slot of the queue pair is in use: back-pressure, retry after reaping.
    #[error("queue full: {depth} commands outstanding")]
    QueueFull { depth: usize },
    /// The command cannot be expressed as an NVMe command (NVMe's Invalid Field in Command,
    /// raised by the host because the field cannot even be encoded).
    #[error("invalid field in command: {0}")]
    InvalidField(&'static str),
    #[error("data buffer at {addr:#x} is not aligned to {align_bytes} bytes")]
    MisalignedBuffer { addr: usize, align_bytes: usize },
    #[error("data buffer holds {have_bytes} bytes, the command moves {need_bytes}")]
    BufferTooSmall { need_bytes: u64, have_bytes: u64 },
    /// The queue pair was shut down (for example by a controller reset that deleted it).
    #[error("queue pair is disabled")]
    Disabled,
    /// A vectored command's segments break a rule of the device.
    #[error("vectored command refused: {0}")]
    Segment(#[from] SegmentError),
    /// The command's memory lies partly in a registered region and partly outside it.
    #[error("registered memory: {0}")]
    Region(#[from] RegionError),
}

/// A command's completion, as the host sees it after reaping the completion queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The tag given to [`QueuePair::submit`].
    pub tag: u64,
    pub status: Status,
}

/// A submission/completion queue pair on one namespace, owned by one reactor.
///
/// Not `Send` by design: queue pairs belong to the thread that created them (SPDK's
/// one-thread-per-qpair rule made a type fact); implementations hold a non-`Send` marker.
///
/// # For implementors
/// [`QueuePair::submit`]'s contract lets a caller free a command's buffer once the queue pair
/// has been dropped, even if the command never completed. An implementation must therefore
/// guarantee that once its `drop` returns, the device reads and writes no buffer handed to
/// it: a real controller deletes its I/O queues (or is reset) and waits for that to finish
/// before `drop` returns; if it cannot be sure the device has stopped, it must leak the
/// memory the device may still touch rather than return. Every completion still pending at
/// drop time is discarded.
///
/// `Any` is a supertrait so that what one device alone offers is reached by downcasting,
/// not by a method every device carries: the emulator's true completion deadlines, for
/// benchmarks only, are [`crate::EmuQueuePair::downcast`] then
/// [`crate::EmuQueuePair::oracle_next_deadline_ns`].
pub trait QueuePair: Any {
    /// Places `cmd` on the submission queue and rings the doorbell. Never waits for a device
    /// and never allocates: a full queue is [`SubmitError::QueueFull`]. (A device that
    /// copies data itself does so here: `uring`'s `inline=` copies from or into the page
    /// cache, and `inline=on` on a file whose pages are not in memory waits for its disk.)
    ///
    /// # Safety
    /// For a Read or Write, the memory `cmd` points at must stay valid, and for a Read must not
    /// be read or written by anyone else, until the completion carrying `tag` has been
    /// delivered by [`QueuePair::process_completions`] (or the queue pair has been dropped:
    /// implementors guarantee the device touches no buffer after that, see the trait docs).
    /// The device writes into or reads from that memory at a time of its choosing. For a
    /// vectored command that is the memory of every segment; the segment list itself is read
    /// during the call only (implementors copy what they need of it).
    unsafe fn submit(&mut self, cmd: &Command<'_>, tag: u64) -> Result<(), SubmitError>;

    /// [`QueuePair::submit`] for a vectored Read or Write whose segments the caller has
    /// already placed, each inside one region registered with this queue pair: `regions`
    /// holds one bit per region they lie in (bit [`MemoryRegion::index`]). A queue pair that
    /// counts each region's commands in flight may take the mask as given rather than
    /// look every segment up again by address; the default ignores it and submits.
    ///
    /// # Safety
    /// As for [`QueuePair::submit`]; and every segment of `cmd` must lie wholly inside a
    /// region registered with this queue pair whose bit is in `regions`, with no other bit
    /// set: an implementation that trusts the mask would otherwise let a region in use be
    /// unregistered.
    unsafe fn submit_in_regions(
        &mut self,
        cmd: &Command<'_>,
        tag: u64,
        regions: u64,
    ) -> Result<(), SubmitError> {
        let _ = regions;
        // SAFETY: our caller keeps `submit`'s contract.
        unsafe { self.submit(cmd, tag) }
    }

    /// Reaps up to `max` completions, handing each to `out`, and returns how many it reaped:
    /// 0 means an idle poll. Callbacks that submit must do so after this returns.
    fn process_completions(&mut self, max: usize, out: &mut dyn FnMut(Completion)) -> usize;

    /// A file descriptor that becomes readable when a completion is posted while interrupts
    /// are armed (see [`QueuePair::arm_interrupt`]); `None` if the device cannot interrupt.
    fn interrupt_fd(&self) -> Option<BorrowedFd<'_>>;

    /// Asks the device to make [`QueuePair::interrupt_fd`] readable once the next completion
    /// is posted, or at once if one is already waiting. Interrupts are one-shot: reaping a
    /// completion disarms them. Polling paths never call this, so they pay no syscall.
    fn arm_interrupt(&mut self);

    /// Says no interrupt is wanted until the next [`QueuePair::arm_interrupt`]. The reactor
    /// calls it on an idle queue pair before it blocks on the others' interrupts, or parks:
    /// the interrupt fd stays in its epoll set, and must not be readable for completions
    /// already reaped. The default does nothing, which suits a device whose reaping disarms
    /// and clears its line. (An io_uring eventfd counts every completion, armed or not: the
    /// uring queue pair drains it.)
    fn disarm_interrupt(&mut self) {}

    /// Commands submitted and not yet reaped.
    fn outstanding(&self) -> usize;

    /// Most commands that can be outstanding at once.
    fn depth(&self) -> usize;

    /// The namespace this queue pair reads and writes.
    fn namespace(&self) -> NamespaceInfo;

    /// Asks the device to abort the outstanding command submitted with `tag`, as NVMe's
    /// Abort admin command does: the first step a host takes when a command times out.
    ///
    /// Best effort and asynchronous. `Ok` means the request reached the device, nothing
    /// more: the command's one completion still arrives through
    /// [`QueuePair::process_completions`], with [`Status::ABORT_REQUESTED`] if the device
    /// aborted it, or with its own status if it finished first. A tag that is not
    /// outstanding (it completed meanwhile) is `Ok` and does nothing. When the completion
    /// does not arrive in time the caller escalates to [`QueuePair::reset`].
    ///
    /// The default is [`RecoveryError::Unsupported`]: a reactor then goes straight to a
    /// reset. Never blocks for long; never allocates.
    fn abort(&mut self, tag: u64) -> Result<(), RecoveryError> {
        let _ = tag;
        Err(RecoveryError::Unsupported)
    }

    /// Resets this queue pair, as deleting and recreating its I/O queues does (or a
    /// controller reset, if that is all the device can do): the second step after a
    /// timeout.
    ///
    /// `Ok` promises that every command outstanding when `reset` was called has its one
    /// completion delivered by [`QueuePair::process_completions`] within a bounded time
    /// (at once on the emulated controller): its own status if the device finished it, or
    /// [`Status::ABORTED_SQ_DELETION`]; and that the device touches none of their buffers
    /// once that completion is delivered. The queue pair stays usable for new commands.
    ///
    /// The default is [`RecoveryError::Unsupported`]: a reactor then fails the timed-out
    /// command locally and quarantines it (its slot and buffer stay reserved until a late
    /// completion arrives or the queue pair is dropped, since the device may still use the
    /// buffer). Implementations must not call this from `process_completions`' callback.
    fn reset(&mut self) -> Result<(), RecoveryError> {
        Err(RecoveryError::Unsupported)
    }

    /// Registers `len_bytes` of the application's memory at `ptr`: reads and writes whose
    /// buffer or segments lie inside it then point straight into it (see
    /// [`crate::region`]). Start and length must be multiples of
    /// [`crate::region::REGION_ALIGN_BYTES`], at most
    /// [`crate::region::REGION_BYTES_MAX`] long, overlapping no region already registered;
    /// a queue pair holds at most [`crate::region::REGIONS_MAX`]. Not on the I/O path: it
    /// may make a system call.
    ///
    /// The default is [`RegisterError::Unsupported`].
    ///
    /// # Safety
    /// The memory must be valid for reads and writes for `len_bytes`, and stay mapped (not
    /// freed, unmapped or remapped) until [`QueuePair::unregister_memory`] returns `Ok` for
    /// it or the queue pair is dropped: a device may pin or map its pages now and use them
    /// for any command after.
    unsafe fn register_memory(
        &mut self,
        ptr: *mut u8,
        len_bytes: usize,
    ) -> Result<MemoryRegion, RegisterError> {
        let _ = (ptr, len_bytes);
        Err(RegisterError::Unsupported)
    }

    /// Unregisters `region`. Refused with [`UnregisterError::InUse`] while a command whose
    /// memory lies in it is outstanding (its completion not yet delivered): the region
    /// stays registered and the caller tries again after reaping. Once this returns `Ok`
    /// the device no longer uses the memory, and the application may free it.
    fn unregister_memory(&mut self, region: MemoryRegion) -> Result<(), UnregisterError> {
        let _ = region;
        Err(UnregisterError::Unknown)
    }
}

/// Why a queue pair could not carry out [`QueuePair::abort`] or [`QueuePair::reset`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecoveryError {
    /// The device (or this implementation) cannot do it: the caller escalates.
    #[error("not supported by this device")]
    Unsupported,
    /// The device was asked and failed (an admin command error, a controller that does not
    /// come back): the caller escalates.
    #[error("the device failed: {0}")]
    Failed(&'static str),
}

/// Why a controller could not hand out a queue pair.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueuePairError {
    #[error("queue depth {depth} is out of range: 1..={max}")]
    BadDepth { depth: usize, max: usize },
    #[error("the controller has no more I/O queues: all {max} are in use")]
    NoQueuesLeft { max: usize },
    #[error("{0}")]
    Os(#[from] std::io::Error),
}

/// A controller with one namespace: shared by every reactor (hence `Send + Sync`), it hands
/// out one queue pair per reactor.
pub trait Controller: Send + Sync {
    /// A short description, as a device string would name it (`emu:optane`, `null`).
    fn describe(&self) -> String;

    fn namespace(&self) -> NamespaceInfo;

    /// Creates an I/O queue pair of `depth` entries for the calling thread.
    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError>;

    /// Whether a successful Read writes every byte of its buffer: true for every device that
    /// stores data. The `null` device moves none, so a caller that recycles buffers must
    /// zero a read's buffer for it, or the reply would carry the buffer's old bytes.
    fn reads_fill_buffer(&self) -> bool {
        true
    }

    /// Whether the device carries out `opcode`. Read, Write and Flush are mandatory in
    /// NVMe; Write Zeroes and Dataset Management are not (a controller says which it has in
    /// ONCS). Every device here but a `vfio` controller without them has all five.
    fn supports(&self, _opcode: Opcode) -> bool {
        true
    }
}
