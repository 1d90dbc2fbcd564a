//! The emulated NVMe controller, hypoll's default device.
//!
//! It keeps real ring mechanics: the host writes 64-byte submission entries into a
//! submission ring and rings the tail doorbell; the controller fetches them, and when the
//! latency model says a command is done it writes a 16-byte completion entry into the
//! completion ring with the current phase tag, flipping the phase on every wrap; the host
//! reaps entries whose phase matches the one it expects and rings the head doorbell.
//!
//! There is no device thread (it would compete with the reactors for the cores being
//! measured): the controller does its work when the host touches it. Fetching happens on
//! the doorbell write, and posting happens when the host polls: every command whose
//! deadline has passed is posted before the host reads the completion ring, so a completion
//! entry becomes visible exactly when the model says the command is done, and never
//! earlier. Data moves at that moment too, as a device's DMA precedes its completion entry.
//!
//! Interrupts: a CLOCK_MONOTONIC timerfd armed at the earliest pending deadline, so a
//! thread can block on it as a driver blocks on an MSI-X eventfd.
//!
//! Aborts: [`EmuQueuePair::abort_command`] (NVMe Abort) completes one pending or lost command
//! with "Command Abort Requested"; `stuck_pct` makes some lost commands ignore it.
//!
//! Resets: [`EmuController::reset`] resets the whole controller, [`EmuQueuePair::reset`] one
//! queue pair. Either way every command outstanding on an affected queue pair completes with
//! "Command Aborted due to SQ Deletion". A controller reset reaches the queue pairs, which
//! belong to other threads, without a lock on the I/O path: it bumps a shared generation
//! counter, and each queue pair compares that counter with the last value it saw (one
//! relaxed load) whenever its owner submits, polls or arms the interrupt, resetting itself
//! before anything else when it changed. Queue pairs blocked on an armed interrupt are woken.
//!
//! Layout: `config` (the device string's keys and profiles), `latency` (the latency model),
//! `store` (where the namespace's data lives), `file` (the file backing and the rules it is
//! opened under), `queue` (a queue pair as the host drives it), `engine` (what the
//! controller does with each command), `zeroing` (Write Zeroes and Deallocate in bounded
//! steps), `recovery` (aborts and resets).
//! This file holds the controller and what its queue pairs share with it.

pub mod config;
mod engine;
pub mod file;
pub mod latency;
mod queue;
mod recovery;
pub mod store;
mod zeroing;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

pub use config::{Backing, EmuConfig};
pub use queue::EmuQueuePair;
use store::Store;
pub use zeroing::ZEROED_BYTES_PER_POLL_MAX;

use crate::clock::Clock;
use crate::qpair::{Controller, QueuePair, QueuePairError, QUEUE_DEPTH_MAX};
use crate::spec::NamespaceInfo;
use crate::sys::TimerFd;

/// The only namespace an emulated controller has.
pub const NSID: u32 = 1;

/// Shared by every queue pair of one controller.
struct Shared {
    cfg: EmuConfig,
    ns: NamespaceInfo,
    store: Store,
    clock: Clock,
    /// When the controller was created, on its clock (the origin of `drift_pct`).
    created_ns: u64,
    /// Queue pairs created so far (qids are handed out from it, wrapping in 1..=65535).
    queues_created: AtomicU64,
    queues_live: AtomicU32,
    /// Controller resets so far. Each queue pair resets itself when it sees this change.
    reset_generation: AtomicU64,
    /// Interrupt lines of the live queue pairs (real clock only), so a controller reset can
    /// wake the ones blocked on an armed interrupt. Locked when a queue pair is created or
    /// dropped and by a controller reset: never on the submit or poll path.
    irq_lines: Mutex<Vec<Arc<IrqLine>>>,
}

impl Shared {
    /// Resets the controller: bumps the generation every queue pair watches and raises the
    /// interrupt of every queue pair that has it armed (the owner then sees the new
    /// generation when it polls). Returns the new generation.
    fn reset_controller(&self) -> u64 {
        // SeqCst pairs with `arm_interrupt`: either the owner, arming, sees the new
        // generation, or this sees the line armed.
        let generation = self.reset_generation.fetch_add(1, Ordering::SeqCst) + 1;
        for line in self.irq_lines.lock().iter() {
            if line.armed.load(Ordering::SeqCst) {
                // At worst (the owner disarmed meanwhile) a spurious wake-up: the owner
                // re-arms its timer before it blocks again.
                line.timer
                    .arm_at(1)
                    .expect("emulated controller: timerfd_settime on our own timer failed");
            }
        }
        generation
    }
}

/// A queue pair's interrupt: its timerfd, and whether its owner has it armed (mirrored here
/// for a controller reset on another thread).
#[derive(Debug)]
struct IrqLine {
    timer: TimerFd,
    armed: AtomicBool,
}

/// An emulated NVMe controller with one namespace.
#[derive(Clone)]
pub struct EmuController {
    shared: Arc<Shared>,
}

impl EmuController {
    /// A controller on the real monotonic clock.
    pub fn new(cfg: EmuConfig) -> std::io::Result<EmuController> {
        EmuController::with_clock(cfg, Clock::Monotonic)
    }

    /// A controller on the given clock; a virtual clock makes the latency model
    /// deterministic and leaves the queue pairs without an interrupt fd.
    pub fn with_clock(cfg: EmuConfig, clock: Clock) -> std::io::Result<EmuController> {
        cfg.validate()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let ns = NamespaceInfo {
            nsid: NSID,
            lba_size_bytes: cfg.lba_bytes,
            capacity_lbas: cfg.size_bytes / u64::from(cfg.lba_bytes),
            transfer_bytes_max: cfg.mdts_bytes,
        };
        let store = Store::open(&cfg.backing, cfg.size_bytes, cfg.read_only)?;
        let queues_max = cfg.queues_max as usize;
        Ok(EmuController {
            shared: Arc::new(Shared {
                cfg,
                ns,
                store,
                created_ns: clock.now_ns(),
                clock,
                queues_created: AtomicU64::new(0),
                queues_live: AtomicU32::new(0),
                reset_generation: AtomicU64::new(0),
                irq_lines: Mutex::new(Vec::with_capacity(queues_max)),
            }),
        })
    }

    pub fn config(&self) -> &EmuConfig {
        &self.shared.cfg
    }

    /// Creates an I/O queue pair, as the concrete type (tests and benchmarks use its extra
    /// methods; reactors go through [`Controller::create_queue_pair`]).
    pub fn queue_pair(&self, depth: usize) -> Result<EmuQueuePair, QueuePairError> {
        if depth == 0 || depth > QUEUE_DEPTH_MAX {
            return Err(QueuePairError::BadDepth {
                depth,
                max: QUEUE_DEPTH_MAX,
            });
        }
        let max = self.shared.cfg.queues_max;
        self.shared
            .queues_live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| QueuePairError::NoQueuesLeft { max: max as usize })?;
        // Qid 0 is the admin queue: I/O queues take 1..=65535, wrapping.
        let created = self.shared.queues_created.fetch_add(1, Ordering::AcqRel);
        let qid = (created % u64::from(u16::MAX)) as u16 + 1;
        let irq = if self.shared.clock.is_virtual() {
            None
        } else {
            match TimerFd::new() {
                Ok(timer) => {
                    let line = Arc::new(IrqLine {
                        timer,
                        armed: AtomicBool::new(false),
                    });
                    self.shared.irq_lines.lock().push(line.clone());
                    Some(line)
                }
                Err(e) => {
                    self.shared.queues_live.fetch_sub(1, Ordering::AcqRel);
                    return Err(e.into());
                }
            }
        };
        Ok(EmuQueuePair::new(self.shared.clone(), qid, depth, irq))
    }

    /// Resets the controller, as a host does after a command timeout: every command
    /// outstanding on every live queue pair, pending or lost, completes with "Command
    /// Aborted due to SQ Deletion". Each queue pair carries out the reset the next time its
    /// owner submits, polls or arms its interrupt, before anything else, so the aborts are
    /// the first completions it reaps; a queue pair blocked on an armed interrupt is woken.
    /// Safe to call from any thread; the I/O path pays one relaxed atomic load for it.
    pub fn reset(&self) {
        self.shared.reset_controller();
    }

    /// Controller resets so far (asked for, or injected by `reset_pct`).
    pub fn resets(&self) -> u64 {
        self.shared.reset_generation.load(Ordering::Relaxed)
    }

    /// Times a file backing was made durable: once per Flush and per FUA write (0 for a
    /// memory backing).
    pub fn backing_syncs(&self) -> u64 {
        self.shared.store.syncs()
    }
}

impl Controller for EmuController {
    /// The configuration's canonical device string (see `EmuConfig`'s `Display`).
    fn describe(&self) -> String {
        self.shared.cfg.to_string()
    }

    fn namespace(&self) -> NamespaceInfo {
        self.shared.ns
    }

    fn create_queue_pair(&self, depth: usize) -> Result<Box<dyn QueuePair>, QueuePairError> {
        Ok(Box::new(self.queue_pair(depth)?))
    }
}

#[cfg(test)]
mod tests;
