//! Submission: an I/O goes onto its device's queue pair and into a slot, or, when the queue
//! pair is full, waits in the device's bounded wait queue (first come, first served) until a
//! completion frees a slot; a full wait queue is a refusal, never an allocation.

use hypoll_nvme::{Command, SubmitError};
use hypoll_policy::{Bucket, Direction};

use super::{IoSlot, Reactor, Recovery};
use crate::io::{
    DeviceId, IoCallback, IoDone, IoFailure, IoOp, IoRequest, RejectReason, Rejected,
    WAIT_QUEUE_MAX,
};

/// An accepted I/O waiting for a free queue-pair slot.
pub(super) struct QueuedIo<S> {
    pub(super) req: IoRequest,
    pub(super) buf: Option<hypoll_nvme::IoBuf>,
    pub(super) callback: IoCallback<S>,
    pub(super) accepted_ns: u64,
}

/// Why `Reactor::issue` did not put an I/O on its queue pair: the error, with what the
/// caller gave back.
type NotIssued<C> = (hypoll_nvme::SubmitError, Option<hypoll_nvme::IoBuf>, C);

/// A callback as `Reactor::issue` takes it: a caller's closure is boxed only once its
/// command is on the queue pair, so that a refusal hands the closure itself back; a waiter's
/// was boxed when it began to wait.
trait IntoCallback<S> {
    fn into_callback(self) -> IoCallback<S>;
}

/// A caller's closure, not boxed yet.
struct Unboxed<F>(F);

impl<S, F: FnOnce(&mut Reactor<S>, &mut S, IoDone) + 'static> IntoCallback<S> for Unboxed<F> {
    #[inline(always)]
    fn into_callback(self) -> IoCallback<S> {
        Box::new(self.0)
    }
}

impl<S> IntoCallback<S> for IoCallback<S> {
    #[inline(always)]
    fn into_callback(self) -> IoCallback<S> {
        self
    }
}

impl<S> Reactor<S> {
    /// Submits one I/O. `buf` is required for reads and writes (at least `nlb` blocks) and
    /// must be `None` otherwise; it comes back in the completion. A refusal hands back
    /// everything given here, the callback included (it has not run): see [`Rejected`].
    pub fn submit<F>(
        &mut self,
        device: DeviceId,
        req: IoRequest,
        buf: Option<hypoll_nvme::IoBuf>,
        callback: F,
    ) -> Result<(), Rejected<F>>
    where
        F: FnOnce(&mut Reactor<S>, &mut S, IoDone) + 'static,
    {
        self.submit_as(device, req, buf, Unboxed(callback))
            .map_err(|rejected| Rejected {
                reason: rejected.reason,
                device: rejected.device,
                req: rejected.req,
                buf: rejected.buf,
                callback: rejected.callback.0,
            })
    }

    /// Submits again an I/O refused earlier, as the refusal handed it back with its
    /// callback boxed ([`Rejected::boxed`], to queue refusals of different callbacks
    /// together): as `submit` would, without boxing the boxed callback again.
    pub fn resubmit(
        &mut self,
        rejected: Rejected<IoCallback<S>>,
    ) -> Result<(), Rejected<IoCallback<S>>> {
        self.submit_as(
            rejected.device,
            rejected.req,
            rejected.buf,
            rejected.callback,
        )
    }

    /// `submit`, for a callback boxed or not.
    #[inline(always)]
    fn submit_as<C: IntoCallback<S>>(
        &mut self,
        device: DeviceId,
        req: IoRequest,
        mut buf: Option<hypoll_nvme::IoBuf>,
        callback: C,
    ) -> Result<(), Rejected<C>> {
        debug_assert!(self.wait_queues_hold());
        debug_assert!(self.abandoned_hold());
        let refuse = move |reason, buf, callback| {
            Err(Rejected {
                reason,
                device,
                req,
                buf,
                callback,
            })
        };
        if self.stopping {
            return refuse(RejectReason::ShuttingDown, buf, callback);
        }
        let d = device.0 as usize;
        let Some(dev) = self.devices.get(d) else {
            return refuse(RejectReason::UnknownDevice, buf, callback);
        };
        let data_op = matches!(req.op, IoOp::Read | IoOp::Write);
        if data_op != buf.is_some() {
            return refuse(RejectReason::Buffer, buf, callback);
        }
        let submitted = if !dev.waiting.is_empty() {
            match self.may_wait_behind(d, &req, buf.as_mut()) {
                Ok(()) => {
                    self.push_waiter(d, req, buf, callback.into_callback());
                    Ok(())
                }
                Err(reason) => refuse(reason, buf, callback),
            }
        } else {
            match self.issue(d, req, buf, callback, self.now_ns) {
                Ok(()) => Ok(()),
                Err((error, buf, callback)) => match self.may_wait(d, error) {
                    Ok(()) => {
                        self.push_waiter(d, req, buf, callback.into_callback());
                        Ok(())
                    }
                    Err(reason) => refuse(reason, buf, callback),
                },
            }
        };
        debug_assert!(self.wait_queues_hold());
        debug_assert!(self.abandoned_hold());
        submitted
    }

    /// A queue pair refused an I/O: it may wait for a slot if the device has a wait queue
    /// with room; otherwise, why it is refused.
    #[cold]
    #[inline(never)]
    fn may_wait(&self, d: usize, error: SubmitError) -> Result<(), RejectReason> {
        let SubmitError::QueueFull { depth } = error else {
            return Err(RejectReason::Submit(error));
        };
        let reason = self.full(d, depth);
        let dev = &self.devices[d];
        if dev.waiting.len() >= dev.wait_capacity
            || matches!(reason, RejectReason::Quarantined { .. })
        {
            return Err(reason);
        }
        Ok(())
    }

    /// Others already wait for a slot on device `d`: first come, first served, a new I/O
    /// may wait behind them, unless the wait queue is full (or no slot will ever free:
    /// every one holds an abandoned command) or its command cannot be built.
    #[cold]
    #[inline(never)]
    fn may_wait_behind(
        &self,
        d: usize,
        req: &IoRequest,
        buf: Option<&mut hypoll_nvme::IoBuf>,
    ) -> Result<(), RejectReason> {
        let dev = &self.devices[d];
        let has_room = dev.waiting.len() < dev.wait_capacity;
        let reason = self.full(d, dev.qp.depth());
        if !has_room || matches!(reason, RejectReason::Quarantined { .. }) {
            return Err(reason);
        }
        command(req, buf)
            .check(dev.lba_bytes)
            .map_err(RejectReason::Submit)
    }

    /// Queues an accepted I/O behind the others waiting for a slot on device `d` (the caller
    /// made sure there is room); its timeout counts from now.
    fn push_waiter(
        &mut self,
        d: usize,
        req: IoRequest,
        buf: Option<hypoll_nvme::IoBuf>,
        callback: IoCallback<S>,
    ) {
        let dev = &mut self.devices[d];
        debug_assert!(dev.waiting.len() < dev.wait_capacity);
        dev.waiting.push_back(QueuedIo {
            req,
            buf,
            callback,
            accepted_ns: self.now_ns,
        });
        self.waiters += 1;
        if let Some(timeout_ns) = dev.io_timeout_ns {
            self.recovery_due_ns = self
                .recovery_due_ns
                .min(self.now_ns.saturating_add(timeout_ns));
        }
        debug_assert!(self.devices[d].waiting.len() <= self.devices[d].wait_capacity);
        debug_assert!(self.wait_queues_hold());
    }

    /// The wait queues' bookkeeping: `waiters` counts every device's queue, and none is over
    /// its capacity, itself within [`WAIT_QUEUE_MAX`].
    pub(super) fn wait_queues_hold(&self) -> bool {
        let queued: usize = self.devices.iter().map(|dev| dev.waiting.len()).sum();
        self.waiters == queued
            && self.devices.iter().all(|dev| {
                dev.waiting.len() <= dev.wait_capacity && dev.wait_capacity <= WAIT_QUEUE_MAX
            })
    }

    /// Why a full queue pair refuses an I/O: back-pressure, or a device whose every slot
    /// holds an abandoned command (retrying will not help until it recovers).
    pub(super) fn full(&self, d: usize, depth: usize) -> RejectReason {
        let dev = &self.devices[d];
        if dev.abandoned > 0 && dev.abandoned >= dev.qp.depth() {
            RejectReason::Quarantined {
                abandoned: dev.abandoned,
            }
        } else {
            RejectReason::Submit(SubmitError::QueueFull { depth })
        }
    }

    /// Puts an I/O on device `d`'s queue pair and records it in a slot. Inlined: it is the
    /// body of every submission.
    #[inline(always)]
    fn issue<C: IntoCallback<S>>(
        &mut self,
        d: usize,
        req: IoRequest,
        buf: Option<hypoll_nvme::IoBuf>,
        callback: C,
        accepted_ns: u64,
    ) -> Result<(), NotIssued<C>> {
        let dev = &mut self.devices[d];
        debug_assert!(dev.qp.outstanding() <= dev.qp.depth());
        let mut buf = buf;
        let key = self.slots.vacant_key();
        let submitted = {
            let cmd = command(&req, buf.as_mut());
            // SAFETY: the buffer moves into the slot below (moving an IoBuf does not move
            // its memory) and stays there until the completion for `key` is reaped, or
            // until the queue pair is dropped (shutdown drops queue pairs before slots);
            // an abandoned I/O's buffer stays in its slot too (quarantine).
            unsafe { dev.qp.submit(&cmd, key as u64) }
        };
        if let Err(e) = submitted {
            return Err((e, buf, callback));
        }
        self.record(d, req, buf, callback.into_callback(), accepted_ns, key);
        Ok(())
    }

    /// Records an I/O its queue pair just took under tag `key` in that slot, with its
    /// buffer (if it has one: a vectored I/O's memory is in registered regions) and its
    /// callback. Inlined: it is part of every submission.
    #[inline(always)]
    pub(super) fn record(
        &mut self,
        d: usize,
        req: IoRequest,
        buf: Option<hypoll_nvme::IoBuf>,
        callback: IoCallback<S>,
        accepted_ns: u64,
        key: usize,
    ) {
        let dev = &self.devices[d];
        let bucket = match req.op {
            IoOp::Read => Bucket::new(
                Direction::Read,
                u64::from(req.nlb) * u64::from(dev.lba_bytes),
            ),
            IoOp::Write => Bucket::new(
                Direction::Write,
                u64::from(req.nlb) * u64::from(dev.lba_bytes),
            ),
            _ => None,
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let inserted = self.slots.insert(IoSlot {
            device: d as u16,
            bucket,
            submit_ns: self.now_ns,
            accepted_ns,
            seq,
            slept: None,
            idle_polls_at_submit: self.counters.idle_polls,
            user: req.user,
            buf,
            callback: Some(callback),
            recovery: Recovery::InTime,
        });
        debug_assert_eq!(inserted, key);
        if let Some(timeout_ns) = self.devices[d].io_timeout_ns {
            self.recovery_due_ns = self
                .recovery_due_ns
                .min(accepted_ns.saturating_add(timeout_ns));
        }
        // Drop completed I/Os from the front of the order (amortized O(1): in-order
        // completions never let it grow); compact it when a slow I/O holds the front.
        let slots = &self.slots;
        let live = |&(k, s): &(usize, u64)| slots.get(k).is_some_and(|slot| slot.seq == s);
        while self.order.front().is_some_and(|e| !live(e)) {
            self.order.pop_front();
        }
        if self.order.len() == self.order.capacity() {
            self.order.retain(live);
        }
        self.order.push_back((key, seq));
        debug_assert!(self.devices[d].qp.outstanding() <= self.devices[d].qp.depth());
    }

    /// Puts waiting I/Os on their queue pairs while there is room, oldest first. Returns
    /// how many it started (or failed: a queue pair that refuses one for another reason
    /// than being full fails it with `IoFailure::Refused`).
    pub(super) fn start_waiters(&mut self, state: &mut S) -> usize {
        debug_assert!(self.wait_queues_hold());
        if self.waiters == 0 {
            return 0;
        }
        let mut started = 0;
        for d in 0..self.devices.len() {
            while let Some(w) = self.devices[d].waiting.pop_front() {
                self.waiters -= 1;
                let (req, accepted_ns) = (w.req, w.accepted_ns);
                match self.issue(d, req, w.buf, w.callback, accepted_ns) {
                    Ok(()) => started += 1,
                    Err((SubmitError::QueueFull { .. }, buf, callback)) => {
                        self.devices[d].waiting.push_front(QueuedIo {
                            req,
                            buf,
                            callback,
                            accepted_ns,
                        });
                        self.waiters += 1;
                        break;
                    }
                    Err((e, buf, callback)) => {
                        started += 1;
                        let waiter = QueuedIo {
                            req,
                            buf,
                            callback,
                            accepted_ns,
                        };
                        tracing::warn!(
                            core = self.core,
                            device = d,
                            error = %e,
                            "the queue pair refused an I/O that waited for a slot"
                        );
                        self.fail_waiter(state, d, waiter, IoFailure::Refused);
                    }
                }
            }
        }
        debug_assert!(self.wait_queues_hold());
        debug_assert!(self.abandoned_hold());
        started
    }

    /// Runs the callback of an I/O that never reached its queue pair, buffer handed back.
    pub(super) fn fail_waiter(
        &mut self,
        state: &mut S,
        d: usize,
        w: QueuedIo<S>,
        failure: IoFailure,
    ) {
        self.counters.ios += 1;
        self.counters.io_errors += 1;
        let done = IoDone {
            device: DeviceId(d as u16),
            result: Err(failure),
            buf: w.buf,
            user: w.req.user,
            latency_ns: self.now_ns.saturating_sub(w.accepted_ns),
        };
        (w.callback)(self, state, done);
    }

    // ---- convenience wrappers over `submit`; a refusal hands back what `submit`'s does ----
    //
    // One unit throughout: where and how much are in blocks of the device (its
    // `NamespaceInfo::lba_size_bytes`, [`Reactor::lba_bytes`]). A buffer must hold at least
    // `nlb` blocks; a request past the namespace, of zero blocks, or over the device's
    // transfer limit is refused (`RejectReason::Submit`). Front ends that count in bytes or
    // 512-byte sectors convert with [`IoRequest::from_bytes`], which refuses an offset or
    // length that is not whole blocks.

    /// Reads `nlb` blocks from block `slba` into `buf`.
    pub fn read<F>(
        &mut self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        buf: hypoll_nvme::IoBuf,
        callback: F,
    ) -> Result<(), Rejected<F>>
    where
        F: FnOnce(&mut Reactor<S>, &mut S, IoDone) + 'static,
    {
        self.submit(
            device,
            IoRequest::new(IoOp::Read, slba, nlb),
            Some(buf),
            callback,
        )
    }

    /// Writes `nlb` blocks from `buf` at block `slba`.
    pub fn write<F>(
        &mut self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        buf: hypoll_nvme::IoBuf,
        callback: F,
    ) -> Result<(), Rejected<F>>
    where
        F: FnOnce(&mut Reactor<S>, &mut S, IoDone) + 'static,
    {
        self.submit(
            device,
            IoRequest::new(IoOp::Write, slba, nlb),
            Some(buf),
            callback,
        )
    }

    pub fn flush<F>(&mut self, device: DeviceId, callback: F) -> Result<(), Rejected<F>>
    where
        F: FnOnce(&mut Reactor<S>, &mut S, IoDone) + 'static,
    {
        self.submit(device, IoRequest::new(IoOp::Flush, 0, 0), None, callback)
    }

    pub fn write_zeroes<F>(
        &mut self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        callback: F,
    ) -> Result<(), Rejected<F>>
    where
        F: FnOnce(&mut Reactor<S>, &mut S, IoDone) + 'static,
    {
        self.submit(
            device,
            IoRequest::new(IoOp::WriteZeroes, slba, nlb),
            None,
            callback,
        )
    }

    pub fn deallocate<F>(
        &mut self,
        device: DeviceId,
        slba: u64,
        nlb: u32,
        callback: F,
    ) -> Result<(), Rejected<F>>
    where
        F: FnOnce(&mut Reactor<S>, &mut S, IoDone) + 'static,
    {
        self.submit(
            device,
            IoRequest::new(IoOp::Deallocate, slba, nlb),
            None,
            callback,
        )
    }
}

/// The command for `req`, on `buf` (which `Reactor::submit` checked is there exactly for
/// reads and writes).
#[inline]
fn command<'b>(req: &IoRequest, buf: Option<&'b mut hypoll_nvme::IoBuf>) -> Command<'b> {
    match (req.op, buf) {
        (IoOp::Read, Some(b)) => Command::read(req.slba, req.nlb, b),
        (IoOp::Write, Some(b)) => Command::write(req.slba, req.nlb, b),
        (IoOp::Flush, None) => Command::flush(),
        (IoOp::WriteZeroes, None) => Command::write_zeroes(req.slba, req.nlb),
        (IoOp::Deallocate, None) => Command::deallocate(req.slba, req.nlb),
        _ => unreachable!("Reactor::submit checks the buffer against the operation"),
    }
    .with_fua(req.fua)
    .with_deallocate(req.deallocate)
}
