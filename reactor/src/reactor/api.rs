//! What embedders call on their reactor: who it is, its clock, attaching devices, timers,
//! pollers, and a look at what it holds. Submitting I/O is in `submit`.

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use hypoll_nvme::EmuQueuePair;

use super::{
    Attached, Poller, PollerId, Reactor, ReactorHandle, COMPLETION_BATCH, DEVICES_MAX,
    TOKEN_DEVICE_BASE, TOKEN_POLLER_BASE,
};
use crate::io::{AttachError, Device, DeviceId, DeviceOptions, WAIT_QUEUE_MAX};
use crate::stats::Counters;
use crate::timer::{TimerFn, TimerId};

impl<S> Reactor<S> {
    /// The core this reactor is pinned to.
    pub fn core(&self) -> usize {
        self.core
    }

    /// This reactor's position in its set.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Handles to every reactor of the set, this one included, for cross-core messages.
    pub fn handles(&self) -> &Arc<[ReactorHandle<S>]> {
        &self.handles
    }

    /// The timestamp of the current poll batch (CLOCK_MONOTONIC ns): one clock read per
    /// batch, not per I/O.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// Reads the clock again and makes it the current timestamp: for a poller that waited
    /// inside its poll (a timed sleep, a watch for input), so the I/Os it submits next are
    /// stamped with the time they are made, not with the turn's start.
    pub fn refresh_now_ns(&mut self) -> u64 {
        self.now_ns = self.clock.now_ns();
        self.now_ns
    }

    /// From an I/O callback: asks for `after` to run once every callback of the batch of
    /// completions this one came in has run (a batch is what one turn reaped), for work
    /// that costs less once per batch than once per completion: an executor runs the tasks
    /// its completions woke. The same function asked for twice in a batch runs once.
    /// Returns false, asking nothing, outside a batch (a callback run by a refusal, a
    /// timeout or shutdown), or when [`AFTER_BATCH_MAX`](crate::AFTER_BATCH_MAX) functions
    /// are asked for already: the caller then does the work itself.
    #[inline]
    pub fn after_completions(&mut self, after: super::AfterBatch<S>) -> bool {
        if !self.in_batch {
            return false;
        }
        // Functions compare by address: one instantiated twice is at worst run twice.
        #[allow(unpredictable_function_pointer_comparisons)]
        for slot in &mut self.after_batch {
            match slot {
                Some(f) if *f == after => return true,
                Some(_) => {}
                None => {
                    *slot = Some(after);
                    return true;
                }
            }
        }
        false
    }

    /// From an I/O callback: how many completions of its batch come after it (their
    /// callbacks run next, in this turn). 0 for the last, and outside a batch. A callback
    /// that would rather leave work for `after_completions` when more completions follow
    /// asks this.
    #[inline]
    pub fn completions_left(&self) -> usize {
        self.batch_left
    }

    /// The policy's name, as its spec.
    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// I/Os accepted by this reactor whose callback has not run yet: on a queue pair, or
    /// waiting for a slot.
    pub fn outstanding(&self) -> usize {
        self.live() + self.waiters
    }

    /// Abandoned I/Os whose buffers are still quarantined (see
    /// [`IoFailure::Abandoned`](crate::io::IoFailure::Abandoned)).
    pub fn quarantined(&self) -> usize {
        self.abandoned
    }

    /// The counters so far (the published copy lags by up to 10 ms).
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Creates a queue pair of `depth` on `device` for this reactor, with the default
    /// timeouts ([`DeviceOptions::new`]).
    pub fn attach(&mut self, device: &Device, depth: usize) -> Result<DeviceId, AttachError> {
        self.attach_with(device, DeviceOptions::new(depth))
    }

    /// Creates a queue pair on `device` for this reactor, as `options` say.
    pub fn attach_with(
        &mut self,
        device: &Device,
        options: DeviceOptions,
    ) -> Result<DeviceId, AttachError> {
        debug_assert!(self.devices.len() <= DEVICES_MAX);
        let depth = options.depth;
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        if options.io_timeout.is_some_and(|t| t.is_zero()) {
            return Err(AttachError::ZeroIoTimeout);
        }
        if options.wait_queue > WAIT_QUEUE_MAX {
            return Err(AttachError::WaitQueueTooLong {
                wait_queue: options.wait_queue,
                max: WAIT_QUEUE_MAX,
            });
        }
        if self.devices.len() >= DEVICES_MAX {
            return Err(AttachError::TooManyDevices { max: DEVICES_MAX });
        }
        let qp = device
            .ctrl
            .create_queue_pair(depth)
            .map_err(|source| AttachError::QueuePair {
                device: device.ctrl.describe(),
                source,
            })?;
        let id = self.devices.len() as u16;
        let has_irq = match qp.interrupt_fd() {
            Some(fd) => {
                self.epoll
                    .add(fd, TOKEN_DEVICE_BASE + u64::from(id))
                    .map_err(AttachError::Interrupt)?;
                true
            }
            None => self.emulated_interrupt(&*qp),
        };
        // Only the benchmark's `oracle` policy reads the emulator's deadlines, and only an
        // emulated queue pair has them: every other pairing pays nothing for them.
        let wants_oracle = self.policy.name() == hypoll_policy::Oracle::NAME;
        let oracle = wants_oracle && EmuQueuePair::downcast(&*qp).is_some();
        if wants_oracle && !oracle {
            tracing::warn!(
                core = self.core,
                device = %device.ctrl.describe(),
                "the oracle policy needs an emulated device's deadlines; on this one it spins"
            );
        }
        self.io_capacity += qp.depth();
        // Preallocate everything the I/O path touches, so it never allocates.
        self.slots.reserve(self.io_capacity - self.slots.len());
        self.order
            .reserve(2 * self.io_capacity - self.order.len().min(2 * self.io_capacity));
        self.completions
            .reserve(COMPLETION_BATCH * (self.devices.len() + 1) - self.completions.len());
        self.to_abandon
            .reserve(self.io_capacity - self.to_abandon.len());
        // Room for every device's waiters at once: capacity grows by this device's share.
        self.expired
            .reserve(self.expired.capacity() - self.expired.len() + options.wait_queue);
        self.devices.push(Attached {
            lba_bytes: qp.namespace().lba_size_bytes,
            qp,
            recorder: device.stats.recorder(self.now_ns),
            has_irq,
            io_timeout_ns: options.io_timeout.map(ns),
            abort_timeout_ns: ns(options.abort_timeout),
            reset_timeout_ns: ns(options.reset_timeout),
            waiting: VecDeque::with_capacity(options.wait_queue),
            wait_capacity: options.wait_queue,
            abandoned: 0,
            regions: vec![None; hypoll_nvme::REGIONS_MAX],
            oracle,
        });
        // What the I/O path counts on: room reserved for every slot, every device's wait
        // queue within the limit.
        debug_assert!(self.devices.len() <= DEVICES_MAX);
        debug_assert!(self.slots.capacity() >= self.io_capacity);
        debug_assert!(self.to_abandon.capacity() >= self.io_capacity);
        debug_assert!(self
            .devices
            .iter()
            .all(|d| d.wait_capacity <= WAIT_QUEUE_MAX));
        Ok(DeviceId(id))
    }

    /// The namespace of an attached device.
    pub fn namespace(&self, device: DeviceId) -> Option<hypoll_nvme::NamespaceInfo> {
        self.devices
            .get(device.0 as usize)
            .map(|d| d.qp.namespace())
    }

    /// The block size of an attached device: the unit every I/O call addresses it in.
    pub fn lba_bytes(&self, device: DeviceId) -> Option<u32> {
        self.devices.get(device.0 as usize).map(|d| d.lba_bytes)
    }

    /// Whether a submission to `device` now would not be refused for a full queue (it may
    /// still be refused for another reason, which `submit` reports: an unknown device, a
    /// queue pair whose every slot holds an abandoned command). Callers that hold work back
    /// under back-pressure check this before building the next I/O (its buffer, its
    /// callback) instead of building it only to have it refused.
    pub fn has_room(&self, device: DeviceId) -> bool {
        self.devices.get(device.0 as usize).is_none_or(|dev| {
            let depth = dev.qp.depth();
            let quarantined = dev.abandoned > 0 && dev.abandoned >= depth;
            quarantined || (dev.waiting.is_empty() && dev.qp.outstanding() < depth)
        })
    }

    /// Runs `f` on this reactor after `delay` (counted from this call), given the reactor
    /// and its state.
    pub fn after(
        &mut self,
        delay: Duration,
        f: impl FnOnce(&mut Reactor<S>, &mut S) + 'static,
    ) -> TimerId {
        let deadline_ns = self
            .arm_now_ns()
            .saturating_add(u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX));
        self.timers.add(deadline_ns, 0, TimerFn::Once(Box::new(f)))
    }

    /// Runs `f` on this reactor every `period` (missed periods are skipped, not bunched),
    /// the first a `period` after this call, given the reactor and its state.
    pub fn every(
        &mut self,
        period: Duration,
        f: impl FnMut(&mut Reactor<S>, &mut S) + 'static,
    ) -> TimerId {
        let period_ns = u64::try_from(period.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.timers.add(
            self.arm_now_ns().saturating_add(period_ns),
            period_ns,
            TimerFn::Every(Box::new(f)),
        )
    }

    /// The time a timer armed now counts from: the clock read again, since the turn's
    /// timestamp falls behind over a long turn and a delay counted from it would end early.
    /// The turn's timestamp is left as it is: the I/Os of the turn keep one time.
    fn arm_now_ns(&self) -> u64 {
        self.clock.now_ns().max(self.now_ns)
    }

    /// Cancels a timer; returns whether it was still pending.
    pub fn cancel_timer(&mut self, id: TimerId) -> bool {
        self.timers.cancel(id)
    }

    /// Adds a poller, polled every loop turn; its wake fd (if any) wakes a parked reactor.
    pub fn add_poller(&mut self, poller: Box<dyn Poller<S>>) -> std::io::Result<PollerId> {
        let id = PollerId(self.next_poller);
        self.next_poller += 1;
        if let Some(fd) = poller.wake_fd() {
            self.epoll.add(fd, TOKEN_POLLER_BASE + id.0)?;
            self.poller_fds.push((id, fd.as_raw_fd()));
        }
        self.pollers.push((id, poller));
        Ok(id)
    }

    /// Removes a poller (also from inside a `poll`).
    pub fn remove_poller(&mut self, id: PollerId) {
        self.pollers.retain(|(p, _)| *p != id);
        // While pollers run they are out of `self.pollers`: remember the removal.
        self.removed_pollers.push(id);
        if let Some(pos) = self.poller_fds.iter().position(|(p, _)| *p == id) {
            let (_, fd) = self.poller_fds.swap_remove(pos);
            let _ = self.epoll.remove(fd);
        }
    }
}
