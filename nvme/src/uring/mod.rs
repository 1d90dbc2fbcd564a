//! The `uring` device: NVMe-shaped queue pairs over io_uring, on a regular file or a block
//! device. `uring:/path[,direct=0|1][,size=...][,lba=512|4096][,iopoll=auto|on|off|hybrid]
//! [,taskrun=defer|signal][,wait=ring|epoll][,sqpoll=off|on][,sqpoll_idle_ms=N][,sqpoll_cpu=N]
//! [,inline=auto|on|off][,atime=coarse|kernel]`.
//!
//! Each queue pair owns one ring, with the file registered (fixed file 0; fixed file 1 is
//! its second descriptor for reads under `atime`), and in polled modes a second one for the
//! commands an IOPOLL ring refuses (the side ring, in `queue`). Commands map to io_uring
//! operations: Read and Write (Write with FUA becomes a write with `RWF_DSYNC`), Flush to
//! `fdatasync`, Write Zeroes to `fallocate(ZERO_RANGE)` (where the file system lacks
//! zero-range, `PUNCH_HOLE`, then a plain `fallocate` to allocate the blocks again unless
//! the command allows deallocation), Deallocate to `fallocate(PUNCH_HOLE)`.
//!
//! How completions are found depends on the device, detected when it is opened:
//! - **poll** (`IORING_SETUP_IOPOLL`): only for O_DIRECT on a device with poll queues (an
//!   NVMe namespace with `nvme.poll_queues` set). The kernel polls the device whenever the
//!   reactor polls the queue pair; there is no interrupt to wait for.
//! - **hybrid poll** (`iopoll=hybrid`, `IORING_SETUP_HYBRID_IOPOLL`, Linux 6.13): as poll,
//!   but the kernel sleeps for half of the device's runtime first. It is io_uring's own
//!   hybrid polling, there for comparison with hypoll's policies.
//! - **interrupt** (everything else, e.g. virtio disks and most file systems): the device
//!   interrupts, the kernel posts the completion into the ring, and the reactor's policy
//!   chooses between spinning on the ring from user space, sleeping then spinning, and
//!   blocking on the ring's registered eventfd (the queue pair's interrupt fd). The kernel
//!   posts a read's completion by task work in the submitting thread; with
//!   `IORING_SETUP_DEFER_TASKRUN` (the default where the kernel has it, see [`TaskRun`])
//!   that work waits for the queue pair's next `io_uring_enter`, made when the ring's
//!   `IORING_SQ_TASKRUN` flag shows work pending, so a completion neither wakes a sleeping
//!   reactor early nor interrupts a spinning one.
//!
//! Submissions are batched: `submit` only writes the submission entry, and the next
//! `process_completions` (or `arm_interrupt`) hands every pending entry to the kernel with
//! one `io_uring_enter`, as SPDK rings a doorbell once per batch. With `sqpoll=on` the main
//! ring has a kernel thread of its own that takes entries as they are written, so that
//! hand-over makes no system call while the thread is awake (it sleeps after
//! `sqpoll_idle_ms` without entries, and the next hand-over wakes it); completions are then
//! posted by that thread, so deferred task work does not apply (see `ring`).
//!
//! With `inline` (by default where a buffered file lives in memory and io_uring would hand
//! every read to a worker thread, see [`InlineMode`]) reads and writes are made by the
//! reactor's thread when submitted, and only the other commands go through the ring. Reads
//! through the page cache skip the kernel's per-read access-time check but once a minute,
//! where `atime=coarse` applies (see [`AtimeMode`]).
//!
//! Layout: `config` (the device string's keys and their parsing), `open` (opening the file,
//! checking its size, probing io_uring), `atime` (the access time of reads through the page
//! cache), `iopoll` (choosing how completions are found), `queue` (the queue pair: its
//! rings, submission, reaping, aborts), `command` (an NVMe command as an io_uring
//! operation, an io_uring result as an NVMe status), `ring` (ring set-up and
//! `io_uring_enter`), `threads` (what io_uring's submission threads and workers cost),
//! `sys` (the raw system calls the io-uring crate does not wrap). This file holds the
//! controller.

mod atime;
mod command;
mod config;
mod iopoll;
mod open;
mod queue;
mod ring;
mod sys;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_inline;
#[cfg(test)]
mod tests_sqpoll;
mod threads;

use std::fmt;
use std::fs::File;
use std::sync::Arc;

use crate::qpair::{Controller, QueuePair, QueuePairError};
use crate::spec::NamespaceInfo;
use atime::AtimeKeeper;

pub use atime::AtimeMode;
pub use config::{
    InlineMode, IopollMode, SqPoll, TaskRun, UringConfig, SQPOLL_CPU_LIMIT, SQPOLL_IDLE_MS_DEFAULT,
    SQPOLL_IDLE_MS_MAX, URING_FILE_LBA_BYTES, URING_KEYS,
};
pub use open::UringOpenError;
pub use queue::{RingWake, UringQueuePair};
pub use threads::io_uring_threads_cpu_ns;

/// Largest transfer one command may move: larger reads and writes complete with Invalid
/// Field, as on a controller with this MDTS. The kernel splits requests for the device.
pub const URING_TRANSFER_BYTES_MAX: u32 = 1 << 20;

/// How a queue pair finds its completions, decided when the device is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionMode {
    /// The device interrupts; completions land in the ring; the policy spins, sleeps or
    /// blocks on the eventfd.
    Interrupt,
    /// `IORING_SETUP_IOPOLL`: the kernel polls the device when the queue pair is polled.
    Poll,
    /// `IORING_SETUP_HYBRID_IOPOLL`: the kernel sleeps, then polls.
    HybridPoll,
}

impl fmt::Display for CompletionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CompletionMode::Interrupt => "interrupt",
            CompletionMode::Poll => "iopoll",
            CompletionMode::HybridPoll => "hybrid iopoll",
        })
    }
}

/// An opened `uring:` device. Every queue pair is a ring of its own on the shared file.
pub struct UringController {
    cfg: UringConfig,
    file: Arc<File>,
    ns: NamespaceInfo,
    mode: CompletionMode,
    /// Why the mode was chosen, for `describe`.
    mode_note: String,
    /// Whether the pinned pool registers as fixed buffers, for `describe`.
    fixed_note: String,
    /// Whether queue pairs defer task work to their `io_uring_enter` (interrupt mode with
    /// `taskrun=defer`, on a kernel that takes it), and why, for `describe`.
    defer_taskrun: bool,
    taskrun_note: String,
    /// Reads and writes made inline (`inline=`), and why, for `describe`.
    inline: bool,
    inline_note: String,
    /// The second descriptor reads go through, without access-time updates (`atime=coarse`,
    /// where it applies), and what `describe` says of it.
    noatime: Option<Arc<File>>,
    atime_note: String,
}

impl UringController {
    /// How this device's queue pairs find completions.
    pub fn mode(&self) -> CompletionMode {
        self.mode
    }

    /// Opens a queue pair of `depth` commands on its own ring.
    pub fn queue_pair(&self, depth: usize) -> Result<UringQueuePair, QueuePairError> {
        let mut qp = UringQueuePair::new(
            self.file.clone(),
            self.ns,
            self.mode,
            self.defer_taskrun,
            self.cfg.sqpoll(),
            depth,
            self.mode != CompletionMode::Interrupt,
        )?;
        qp.ring_wait = self.cfg.ring_wait;
        qp.inline = self.inline;
        if let Some(noatime) = &self.noatime {
            qp.keep_atime(AtimeKeeper::new(self.file.clone(), noatime.clone()));
        }
        Ok(qp)
    }
}

impl Controller for UringController {
    fn describe(&self) -> String {
        let taskrun = if self.taskrun_note.is_empty() {
            String::new()
        } else {
            format!("; {}", self.taskrun_note)
        };
        let sqpoll = match self.cfg.sqpoll() {
            None => String::new(),
            Some(sq) => format!(
                "; submissions taken by a kernel thread per ring (SQPOLL), asleep after {} ms \
                 idle, {}",
                sq.idle_ms,
                sq.cpu.map_or_else(
                    || "on its creator's CPUs".to_string(),
                    |cpu| format!("on CPU {cpu}")
                )
            ),
        };
        let inline = [&self.inline_note, &self.atime_note]
            .into_iter()
            .filter(|note| !note.is_empty())
            .fold(String::new(), |all, note| all + "; " + note);
        format!(
            "{} ({}, {} completions: {}{taskrun}{sqpoll}{inline}; {})",
            self.cfg,
            if self.cfg.direct {
                "O_DIRECT"
            } else {
                "page cache"
            },
            self.mode,
            self.mode_note,
            self.fixed_note
        )
    }

    fn namespace(&self) -> NamespaceInfo {
        self.ns
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        Ok(Box::new(self.queue_pair(depth)?))
    }
}
