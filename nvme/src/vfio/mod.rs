//! A user-space NVMe driver over VFIO: device string `vfio:0000:00:04.0`.
//!
//! The PCI function must be bound to `vfio-pci` and its IOMMU group must be viable. Opening
//! it: the group joins a type-1 IOMMU container, BAR0 is mapped, bus mastering is enabled,
//! the controller is disabled, given an admin queue and enabled again, then Identify
//! Controller and Identify Namespace (namespace 1) tell the block size, capacity and MDTS.
//! Each [`VfioController::create_queue_pair`] creates one I/O completion/submission queue
//! pair on the controller, owned by the calling reactor; the reactor rings its doorbells and
//! reaps its completion queue by phase tag, with no kernel on the I/O path. MSI-X vector
//! `qid` is routed to an eventfd, the queue pair's [`QueuePair::interrupt_fd`].
//!
//! Data moves through bounce pages: each queue pair owns a pool of pinned 4 KiB pages mapped
//! for the device; a write is copied in before the doorbell, a read copied out when its
//! completion is reaped. PRP lists name the pages, so they need not be contiguous.
//!
//! [`VfioController::reset`] resets the controller (CC.EN 1 -> 0 -> 1) and rebuilds the
//! admin queue; each queue pair notices on its next call, completes every command the
//! controller had not completed with "Command Aborted due to SQ Deletion", and recreates
//! its I/O queues, after which new I/O works.
//!
//! Layout: `config` (the device string), `error` (what can go wrong, and what to do),
//! `sysfs` (finding the function and its IOMMU group), `open` (bringing the controller up),
//! `admin` (the admin queue, Identify, creating and deleting I/O queues), `reset` (enable,
//! disable, reset, shutdown), `queue` (the I/O queue pair), `sys` (ioctls, mmap: the kernel
//! interface), `dma` (IOVA allocator, DMA regions, page pool), `regs` (BAR0 registers and
//! doorbells), `prp` (PRP entries and lists). This file holds the controller and what its
//! queue pairs share with it. See docs/vfio.md for running it under QEMU.

mod admin;
mod config;
mod dma;
mod error;
mod open;
mod prp;
mod queue;
mod regs;
mod reset;
mod sys;
mod sysfs;

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::qpair::{Controller, QueuePair, QueuePairError, QUEUE_DEPTH_MAX};
use crate::spec::{NamespaceInfo, Opcode};
use crate::sys::EventFd;
use admin::AdminQueue;

pub use admin::{parse_identify_namespace, ControllerIdentity};
pub use config::{SysPaths, VfioConfig};
pub use dma::{IovaAllocator, PagePool, IOVA_BASE, IOVA_END};
pub use error::VfioError;
pub use prp::{build as build_prps, pages_spanned, PrpError, PAGE_BYTES};
pub use queue::VfioQueuePair;
pub use sysfs::{group_offenders, locate};

/// Entries of the admin submission and completion queues.
pub const ADMIN_QUEUE_ENTRIES: u16 = 32;
/// How long one admin command may take (generous: QEMU under software emulation is slow).
pub const ADMIN_TIMEOUT_MS: u64 = 10_000;
/// I/O queue pairs the driver asks the controller for (Set Features, Number of Queues).
pub const IO_QUEUES_MAX: u16 = 63;
/// The largest transfer one command may move: the bounce pages of one command, and so the
/// size of a slot's PRP list. The namespace reports min(MDTS, this).
pub const TRANSFER_BYTES_MAX: u32 = 128 << 10;
/// Bounce memory per queue pair is depth x TRANSFER_BYTES_MAX, capped at this: deep queues
/// of small I/O share the pool, and a command that finds too few free pages is back-pressure
/// ([`crate::SubmitError::QueueFull`]).
pub const BOUNCE_POOL_BYTES_MAX: usize = 8 << 20;

/// What queue pairs share with the controller.
#[derive(Debug)]
struct Inner {
    cfg: VfioConfig,
    bar: regs::Bar,
    cap: regs::Cap,
    admin: Mutex<AdminQueue>,
    /// Which I/O queue ids are in use (index = qid - 1).
    qids: Mutex<Vec<bool>>,
    /// Controller resets so far; each queue pair rebuilds its queues when it sees a change.
    generation: AtomicU64,
    ns: NamespaceInfo,
    identity: ControllerIdentity,
    /// One eventfd per MSI-X vector (vector 0: admin); empty without MSI-X.
    irqs: Vec<EventFd>,
    /// The pinned buffer pool mapped for the device (zero-copy I/O), or why not.
    pool: Result<dma::PoolWindow, String>,
    container: Arc<dma::Container>,
    device: OwnedFd,
    _group: OwnedFd,
}

/// An NVMe controller driven from user space through VFIO.
#[derive(Debug)]
pub struct VfioController {
    inner: Arc<Inner>,
}

impl VfioController {
    /// What Identify Controller said.
    pub fn identity(&self) -> &ControllerIdentity {
        &self.inner.identity
    }

    /// The NVMe version register, as (major, minor).
    pub fn version(&self) -> (u16, u8) {
        let vs = self.inner.bar.read32(regs::VS);
        ((vs >> 16) as u16, (vs >> 8) as u8)
    }

    /// Resets the controller: disables it (the controller drops every queue and every
    /// command in flight), rebuilds the admin queue and enables it again. Queue pairs finish
    /// their outstanding commands with "Command Aborted due to SQ Deletion" and recreate
    /// their queues on their next call.
    pub fn reset(&self) -> Result<(), VfioError> {
        self.inner.reset()
    }

    /// Controller resets so far.
    pub fn resets(&self) -> u64 {
        self.inner.generation.load(Ordering::Relaxed)
    }

    /// Creates an I/O queue pair (the concrete type; the trait method boxes it).
    pub fn queue_pair(&self, depth: usize) -> Result<VfioQueuePair, QueuePairError> {
        if depth == 0 || depth > QUEUE_DEPTH_MAX || depth + 1 > self.inner.cap.mqes_entries as usize
        {
            return Err(QueuePairError::BadDepth {
                depth,
                max: QUEUE_DEPTH_MAX.min(self.inner.cap.mqes_entries as usize - 1),
            });
        }
        let qid = {
            let mut qids = self.inner.qids.lock();
            let max = qids.len();
            let Some(i) = qids.iter().position(|used| !used) else {
                return Err(QueuePairError::NoQueuesLeft { max });
            };
            qids[i] = true;
            (i + 1) as u16
        };
        VfioQueuePair::new(self.inner.clone(), qid, depth).map_err(|e| {
            self.inner.qids.lock()[usize::from(qid) - 1] = false;
            QueuePairError::Os(e.into())
        })
    }
}

impl Controller for VfioController {
    fn describe(&self) -> String {
        match &self.inner.pool {
            Ok(w) => format!(
                "{} (zero-copy for buffers in the {} pinned pool, bounce pages otherwise)",
                self.inner.cfg,
                crate::config::size_text(w.len_bytes() as u64)
            ),
            Err(why) => format!("{} (bounce pages only: {why})", self.inner.cfg),
        }
    }

    fn namespace(&self) -> NamespaceInfo {
        self.inner.ns
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        Ok(Box::new(self.queue_pair(depth)?))
    }

    fn supports(&self, opcode: Opcode) -> bool {
        self.inner.identity.supports(opcode)
    }
}

#[cfg(test)]
mod tests;
